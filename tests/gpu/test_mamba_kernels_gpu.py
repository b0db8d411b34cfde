"""Triton Mamba kernels at real sizes on a GPU vs the float32 reference on the same (bf16-rounded) inputs.

Tolerances are mamba-ssm's (tests/ops/test_selective_scan.py): fp32 rtol 6e-4 / atol 2e-3, bf16 rtol 3e-2 / atol 5e-2,
with its per-gradient multipliers; the edge-shape tests compare every gradient against float64 relative to its scale.
Run on a lent GPU: ``PYTHONPATH=src python3 -m pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # skip before importing the kernels (CPU runs use the interpreter, see tests/unit)
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

from anytrain.kernels.causal_conv1d_triton import causal_conv1d_triton  # noqa: E402
from anytrain.kernels.reference import causal_conv1d_ref, selective_scan_ref  # noqa: E402
from anytrain.kernels.selective_scan_triton import selective_scan_triton  # noqa: E402

TOL = {torch.float32: (6e-4, 2e-3), torch.bfloat16: (3e-2, 5e-2)}


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - ref).abs()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any(), f"{name}: {int(bad.sum())} of {bad.numel()} outside tolerance, max abs err {err.max():.3e}"


def _scan_case(itype, seqlen, dim, ngroups, has_z, deterministic=False, seed=0, dstate=16):
    torch.manual_seed(seed)
    dev, batch = "cuda", 2
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
    # Ground truth in float64 on the same (itype-rounded) values: the float32 reference is not accurate enough for dA at
    # seqlen 4096 (its own dA error against float64 is several times the kernels'). Tolerances stay mamba-ssm's.
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


# (seqlen, dim, dstate, ngroups): the kernel paths by shape. dstate 3: the forward's one-state iterations; 20: the
# backward's carry scratch (dstate > 16); 40: the forward's per-state loads (dstate > 32); 256 / 512: whole forward
# chunks (unmasked loads, bf16 int32 pairs), 64: a whole backward chunk; dims not a multiple of the 4-channel tile
@pytest.mark.parametrize("itype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seqlen,dim,dstate,ngroups", [(256, 41, 3, None), (64, 40, 20, None), (300, 24, 40, 2), (512, 30, 16, None)]
)
def test_selective_scan_kernel_paths_match_reference(itype, seqlen, dim, dstate, ngroups):
    rtol, atol = TOL[itype]
    ours, ref, out, out_ref, last, last_ref = _scan_case(itype, seqlen, dim, ngroups, True, dstate=dstate)
    _close("out", out, out_ref, rtol, atol)
    _close("last_state", last, last_ref, rtol, atol)
    for k, mult in (("u", 2), ("delta", 10), ("A", 5), ("B", 2), ("C", 2), ("D", 1), ("z", 1), ("delta_bias", 1)):
        g_ref = ref[k].grad
        _close(f"d{k}", ours[k].grad, g_ref, rtol * 5, atol * mult * max(1.0, g_ref.abs().max().item() / 100))


def _edge_case(seqlen, dim, dstate, has_z, has_d, has_bias, softplus, seed=0):
    """fp32 inputs, batch 1: out, last state and every gradient of the kernels and of the float64 reference."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=g)

    vals = {
        "u": rnd(1, dim, seqlen),
        "delta": 0.5 * rnd(1, dim, seqlen),
        "A": -torch.rand(dim, dstate, device=dev, generator=g) * 2 - 0.1,
        "B": rnd(1, dstate, seqlen),
        "C": rnd(1, dstate, seqlen),
        "D": rnd(dim) if has_d else None,
        "z": rnd(1, dim, seqlen) if has_z else None,
        "delta_bias": 0.3 * rnd(dim) if has_bias else None,
    }
    ours = {k: None if v is None else v.clone().requires_grad_() for k, v in vals.items()}
    ref = {k: None if v is None else v.double().requires_grad_() for k, v in vals.items()}
    out, last = selective_scan_triton(**ours, delta_softplus=softplus, return_last_state=True)
    out_ref, last_ref = selective_scan_ref(**ref, delta_softplus=softplus, return_last_state=True)
    dout = rnd(*out.shape)
    out.backward(dout)
    out_ref.backward(dout.double())
    return ours, ref, (out, last), (out_ref, last_ref)


# seqlen 1-3 (inside one chunk of both kernels), dstate 1 and dstates the forward's groups of 4 do not divide, dims
# below / not a multiple of the 4-channel tile, every optional input on and off
EDGE = [
    (seqlen, dim, dstate, opt, sp)
    for seqlen in (1, 2, 3)
    for dim, dstate in ((3, 1), (3, 4), (5, 3), (7, 16))
    for opt, sp in (((True, True, True), True), ((False, False, False), False), ((True, False, True), False))
]


@pytest.mark.parametrize("seqlen,dim,dstate,opt,softplus", EDGE)
def test_selective_scan_edge_shapes_match_float64(seqlen, dim, dstate, opt, softplus):
    """Every output and gradient within 1e-4 of its scale (max |ref|) plus 1e-3 relative. At seqlen 1 the exact dA is
    0 (h_{-1} = 0), so dA must be exactly 0: a backward that formed exp(delta A) h_{t-1} as h_t - delta B u left the
    fused multiply-add's rounding there (relative error 1e21 against the float64 reference's 0)."""
    ours, ref, res, res_ref = _edge_case(seqlen, dim, dstate, *opt, softplus)
    pairs = [("out", res[0], res_ref[0]), ("last_state", res[1], res_ref[1])]
    pairs += [(f"d{k}", v.grad, ref[k].grad) for k, v in ours.items() if v is not None]
    for name, got, want in pairs:
        assert got is not None, name
        _close(name, got, want, 1e-3, 1e-4 * want.abs().max().item())
    if seqlen == 1:
        assert torch.equal(ours["A"].grad, torch.zeros_like(ours["A"]))


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
