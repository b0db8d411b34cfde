"""Triton Mamba kernels at real sizes on a GPU vs the float32 reference on the same (bf16-rounded) inputs.

Tolerances are mamba-ssm's (tests/ops/test_selective_scan.py): fp32 rtol 6e-4 / atol 2e-3, bf16 rtol 3e-2 / atol 5e-2,
with its per-gradient multipliers. Run on a lent GPU: ``PYTHONPATH=src python3 -m pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # skip before importing the kernels (CPU runs use the interpreter, see tests/unit)
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

from anytrain.kernels.causal_conv1d import causal_conv1d_triton  # noqa: E402
from anytrain.kernels.reference import causal_conv1d_ref, selective_scan_ref  # noqa: E402
from anytrain.kernels.selective_scan import selective_scan_triton  # noqa: E402

TOL = {torch.float32: (6e-4, 2e-3), torch.bfloat16: (3e-2, 5e-2)}


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - ref).abs()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any(), f"{name}: {int(bad.sum())} of {bad.numel()} outside tolerance, max abs err {err.max():.3e}"


def _scan_case(itype, seqlen, dim, ngroups, has_z, deterministic=False, seed=0):
    torch.manual_seed(seed)
    dev, batch, dstate = "cuda", 2, 16
    bshape = (batch, dstate, seqlen) if ngroups is None else (batch, ngroups, dstate, seqlen)
    vals = {
        "u": torch.randn(batch, dim, seqlen, device=dev).to(itype),
        "delta": (0.5 * torch.rand(batch, dim, seqlen, device=dev)).to(itype),
        "A": -0.5 * torch.rand(dim, dstate, device=dev),
        "B": torch.randn(bshape, device=dev).to(itype),
        "C": torch.randn(bshape, device=dev).to(itype),
        "D": torch.randn(dim, device=dev),
        "z": torch.randn(batch, dim, seqlen, device=dev).to(itype) if has_z else None,
        "delta_bias": 0.5 * torch.rand(dim, device=dev),
    }
    ours = {k: None if v is None else v.clone().requires_grad_() for k, v in vals.items()}
    # Ground truth in float64 on the same (itype-rounded) values. The float32 reference is not accurate enough for dA at
    # seqlen 4096: on the H200 its own dA error (vs float64) was 19.7 at |dA| = 2.4e4 against the kernels' 5.5, so
    # kernel-vs-fp32-reference differences of 25 tripped rtol 1e-3 although both kernels were within tolerance of the
    # float64 value (bench/scan_da_precision.py). Tolerances stay mamba-ssm's.
    ref = {k: None if v is None else v.double().requires_grad_() for k, v in vals.items()}
    out, last = selective_scan_triton(**ours, delta_softplus=True, return_last_state=True, deterministic=deterministic)
    out_ref, last_ref = selective_scan_ref(**ref, delta_softplus=True, return_last_state=True)
    g = torch.randn_like(out_ref).to(itype)
    out.backward(g)
    out_ref.backward(g.double())
    return ours, ref, out, out_ref.to(itype), last, last_ref


@pytest.mark.parametrize("itype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seqlen,dim,ngroups,has_z", [(1, 24, None, True), (333, 36, 2, False), (2048, 40, None, True), (4096, 24, 2, True)]
)
def test_selective_scan_matches_reference(itype, seqlen, dim, ngroups, has_z):
    rtol, atol = TOL[itype]
    ours, ref, out, out_ref, last, last_ref = _scan_case(itype, seqlen, dim, ngroups, has_z)
    _close("out", out, out_ref, rtol, atol)
    _close("last_state", last, last_ref, rtol, atol)
    rtolw, atolw = (max(1e-3, rtol), max(1e-3, atol)) if has_z else (1e-3, 1e-3)
    _close("du", ours["u"].grad, ref["u"].grad, rtol * 2, atol * 2)
    _close("ddelta", ours["delta"].grad, ref["delta"].grad, rtol * 5, atol * 10)
    _close("dA", ours["A"].grad, ref["A"].grad, rtolw, atolw * 5)
    _close("dB", ours["B"].grad, ref["B"].grad, rtol, atol * 2)
    _close("dC", ours["C"].grad, ref["C"].grad, rtol, atol * 2)
    _close("dD", ours["D"].grad, ref["D"].grad, rtolw, atolw)
    _close("ddelta_bias", ours["delta_bias"].grad, ref["delta_bias"].grad, rtolw, atolw)
    if has_z:
        _close("dz", ours["z"].grad, ref["z"].grad, rtolw, atolw)


def test_selective_scan_deterministic_is_bitwise_and_matches_atomics():
    runs = [_scan_case(torch.bfloat16, 1000, 64, None, True, deterministic=True, seed=3)[0] for _ in range(2)]
    atomic = _scan_case(torch.bfloat16, 1000, 64, None, True, deterministic=False, seed=3)[0]
    for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias"):
        assert torch.equal(runs[0][k].grad, runs[1][k].grad), k
        _close(k, atomic[k].grad, runs[0][k].grad, 1e-2, 1e-2)


@pytest.mark.parametrize("itype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "width,seqlen,has_bias,act", [(4, 4096, True, "silu"), (3, 1, False, None), (2, 777, True, "silu")]
)
def test_causal_conv1d_matches_reference(itype, width, seqlen, has_bias, act):
    torch.manual_seed(1)
    rtol, atol = TOL[itype]
    batch, dim = 2, 1000
    x = torch.randn(batch, dim, seqlen, device="cuda").to(itype)
    w = (0.5 * torch.randn(dim, width, device="cuda")).to(itype)
    b = torch.randn(dim, device="cuda").to(itype) if has_bias else None
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if has_bias else None
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    br = b.float().requires_grad_() if has_bias else None
    out = causal_conv1d_triton(xs, ws, bs, act)
    out_ref = causal_conv1d_ref(xr, wr, br, act)
    _close("out", out, out_ref.to(itype), rtol, atol)
    g = torch.randn_like(out_ref)
    out.backward(g.to(itype))
    out_ref.backward(g)
    _close("dx", xs.grad, xr.grad, rtol, atol)
    # dweight/dbias sum over batch*seqlen products: compare relative to their scale
    scale = wr.grad.abs().max().item()
    _close("dweight", ws.grad, wr.grad, rtol, atol * scale)
    if has_bias:
        _close("dbias", bs.grad, br.grad, rtol, atol * br.grad.abs().max().item())
