"""train.attention_backend on a GPU: the SDPA kernel PyTorch picks after hardware.set_attention_backend.

Each case runs in a fresh process: PyTorch sets its default SDPA order at the first attention call of a process
(cuDNN first on an H200), replacing an order set before; a process that already ran attention would hide that.
Run on a lent GPU: ``PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_attention_backend_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)

_SCRIPT = """
import sys, torch
from anytrain import hardware
from torch.nn.attention import SDPBackend
name, gqa = sys.argv[1], sys.argv[2] == "gqa"
hardware.set_attention_backend(name)
q = torch.zeros(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
kv = torch.zeros(2, 2 if gqa else 8, 256, 64, device="cuda", dtype=torch.bfloat16)
got = torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=gqa)
print(int(got), int(getattr(SDPBackend, sys.argv[3])))
"""


@pytest.mark.parametrize(
    "name,gqa,expect",
    [
        ("flash", True, "FLASH_ATTENTION"),
        ("efficient", False, "EFFICIENT_ATTENTION"),
        ("cudnn", True, "CUDNN_ATTENTION"),
        ("math", True, "MATH"),
    ],
)
def test_the_chosen_kernel_runs(name, gqa, expect):
    if name == "cudnn" and torch.version.hip:
        pytest.skip("cuDNN attention exists on NVIDIA only")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, name, "gqa" if gqa else "expanded", expect],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got, want = out.stdout.split()
    assert got == want, f"attention_backend {name}: SDPA chose backend {got}, expected {want} ({expect})"
