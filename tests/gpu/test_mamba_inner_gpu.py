"""The fused Mamba mixer (``kernels/mamba_inner.py``) against the unfused composition of the same Triton kernels, at
the mamba-130m width on a GPU: output and every parameter gradient, fp32 and under bf16 autocast.

Both sides run the same kernels; what differs is layout, recomputation and GEMM grouping, so fp32 agrees to TF32 /
summation-order level and bf16 to bf16 rounding (mamba-ssm's tolerances, as in test_mamba_kernels_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

from anytrain.kernels import mamba_inner, wide_mm  # noqa: E402
from anytrain.models.mamba.model import MambaArgs, MambaMixer  # noqa: E402

TOL = {torch.float32: (6e-4, 2e-3), torch.bfloat16: (3e-2, 5e-2)}


def _run(mixer: MambaMixer, h: torch.Tensor, dout: torch.Tensor, fused: bool, dtype: torch.dtype):
    mamba_inner.set_mamba_inner(fused)
    try:
        mixer.zero_grad(set_to_none=True)
        x = h.detach().clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = mixer(x)
        out.float().backward(dout)
        grads = {n: p.grad.detach().clone() for n, p in mixer.named_parameters()}
        return out.detach().float(), x.grad.detach().float(), grads
    finally:
        mamba_inner.set_mamba_inner(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mixer_matches_unfused_at_130m_width(dtype):
    torch.manual_seed(0)
    mixer = MambaMixer(MambaArgs(d_model=768, d_state=16)).cuda()
    mixer.reset_parameters()
    h = torch.randn(4, 1024, 768, device="cuda")
    dout = torch.randn(4, 1024, 768, device="cuda")
    out_f, dh_f, g_f = _run(mixer, h, dout, True, dtype)
    out_u, dh_u, g_u = _run(mixer, h, dout, False, dtype)
    rtol, atol = TOL[dtype]
    for name, got, ref in [("out", out_f, out_u), ("dh", dh_f, dh_u), *((n, g_f[n], g_u[n]) for n in g_u)]:
        assert torch.isfinite(got).all(), name
        scale = ref.abs().max().clamp_min(1e-6)  # weight gradients sum B·T terms: compare relative to their size
        err = ((got.float() - ref.float()).abs() / scale).max().item()
        assert err < max(rtol, atol / scale.item()) * 5, f"{name}: max error {err:.3e} of max |ref| {scale:.3e}"


def test_weight_gradients_come_out_of_the_gemm_in_fp32():
    """Under bf16 autocast the weight-gradient GEMMs write fp32 directly (``wide_mm``: ``mm`` / ``addmm`` with
    ``out_dtype``): the overloads ran (no fallback) and the products, and a product added to an fp32 accumulator in the
    GEMM, match the exact values closer than a bf16-rounded product would."""
    torch.manual_seed(0)
    a = torch.randn(768, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 512, device="cuda").bfloat16()
    exact = a.double() @ b.double()
    wide = wide_mm.grad_mm(a, b, torch.float32)
    assert wide.dtype == torch.float32 and wide_mm._ok["mm"], "mm(out_dtype=float32) fell back"
    rounded = (a @ b).float()
    assert (wide.double() - exact).abs().max() < 0.5 * (rounded.double() - exact).abs().max()
    out = torch.empty(768, 512, device="cuda")
    assert wide_mm.grad_mm(a, b, torch.float32, out=out) is out and torch.equal(out, wide)
    acc = torch.randn(768, 512, device="cuda")
    acc0 = acc.double()
    assert wide_mm.add_mm_(acc, a, b) is acc and wide_mm._ok["addmm"], "addmm(out_dtype=float32, out=acc) fell back"
    assert (acc.double() - (acc0 + exact)).abs().max() < 0.5 * (rounded.double() - exact).abs().max()
