"""Approximate fp32 math shared by the Triton kernels (conv SiLU, the scan's gate).

``libdevice.fast_expf`` / ``fast_dividef`` (``ex2.approx.ftz`` / ``div.approx.ftz`` on CUDA, their ROCm twins in
Triton's HIP libdevice), 2 ulp each, without the IEEE division's range checks. The Triton interpreter has no
libdevice, so the launchers ask ``fast_math_ok`` before turning a kernel's FAST constexpr on.
"""

from __future__ import annotations

import triton
from torch import Tensor
from triton.language.extra import libdevice

from anytrain import hardware


def fast_math_ok(x: Tensor, fp32: bool) -> bool:
    """Whether a kernel on ``x`` may use the approximate math: fp32 accumulation (``fp32``), a GPU tensor, and not
    under the Triton interpreter."""
    return fp32 and hardware.is_gpu(x.device) and not hardware.triton_interpreted()


@triton.jit
def fast_sigmoid(x):
    # exp(-x) overflowing to inf for x << 0 gives 1 / inf = 0, the right limit (no NaN)
    return libdevice.fast_dividef(1.0, 1.0 + libdevice.fast_expf(-x))
