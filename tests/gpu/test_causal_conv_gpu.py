"""Triton causal conv1d at real sizes on a GPU vs the float32 reference on the same (rounded) inputs: the public op
(``anytrain.kernels.causal_conv1d_triton``), forward and every gradient, on the device's default tiles.

Tolerances as tests/gpu/test_mamba_kernels_gpu.py (mamba-ssm's): fp32 rtol 6e-4 / atol 2e-3, bf16 rtol 3e-2 /
atol 5e-2; dweight / dbias (sums over batch·seqlen products) relative to their largest value.
Run on a lent GPU: ``PYTHONPATH=src python3 -m pytest tests/gpu/test_causal_conv_gpu.py -m gpu``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # skip before importing the kernels (CPU runs use the interpreter, see tests/unit)
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

from anytrain.kernels.causal_conv1d_triton import _PLANS, _plan, causal_conv1d_triton, default_config  # noqa: E402
from anytrain.kernels.reference import causal_conv1d_ref  # noqa: E402

TOL = {torch.float32: (6e-4, 2e-3), torch.bfloat16: (3e-2, 5e-2)}


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - ref).abs()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any(), f"{name}: {int(bad.sum())} of {bad.numel()} outside tolerance, max abs err {err.max():.3e}"


def _case(batch, dim, seqlen, width, dtype, param_dtype, has_bias, act, seed=1):
    """The op's output and gradients next to the fp32 reference's on the same rounded inputs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, dim, seqlen, device="cuda", generator=g).to(dtype)
    w = (0.5 * torch.randn(dim, width, device="cuda", generator=g)).to(param_dtype)
    b = torch.randn(dim, device="cuda", generator=g).to(param_dtype) if has_bias else None
    dout = torch.randn(batch, dim, seqlen, device="cuda", generator=g).to(dtype)
    leaves = [x, w] if b is None else [x, w, b]
    ours = [t.clone().requires_grad_() for t in leaves]
    ref = [t.float().requires_grad_() for t in leaves]
    out = causal_conv1d_triton(ours[0], ours[1], ours[2] if has_bias else None, act)
    out_ref = causal_conv1d_ref(ref[0], ref[1], ref[2] if has_bias else None, act)
    grads = torch.autograd.grad(out, ours, dout)
    grads_ref = torch.autograd.grad(out_ref, ref, dout.float())
    return out, out_ref, grads, grads_ref, ours


def _check(out, out_ref, grads, grads_ref, ours, dtype):
    rtol, atol = TOL[dtype]
    _close("out", out, out_ref.to(out.dtype), rtol, atol)
    for name, a, r, leaf in zip(("dx", "dweight", "dbias"), grads, grads_ref, ours, strict=False):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape, name
        scale = 1.0 if name == "dx" else r.abs().max().item()
        _close(name, a, r, rtol, atol * scale)


@pytest.mark.parametrize(
    "batch,dim,seqlen,width,dtype,param_dtype,has_bias,act",
    [
        (2, 5376, 4096, 4, torch.bfloat16, torch.bfloat16, True, "silu"),  # the bench shape (no backward split)
        (2, 5376, 4096, 4, torch.float32, torch.float32, True, "silu"),
        (2, 1536, 2048, 4, torch.bfloat16, torch.float32, True, "silu"),  # fp32 parameters, as in training
        (4, 64, 1000, 3, torch.float32, torch.float32, False, None),  # few channels: the split backward
        (3, 257, 777, 2, torch.bfloat16, torch.bfloat16, True, "silu"),  # odd sizes, seqlen % 8 != 0
        (2, 1000, 1, 4, torch.float32, torch.float32, True, "silu"),
        (2, 1000, 3, 3, torch.bfloat16, torch.bfloat16, False, "silu"),
    ],
)
def test_matches_fp32_reference(batch, dim, seqlen, width, dtype, param_dtype, has_bias, act):
    _check(*_case(batch, dim, seqlen, width, dtype, param_dtype, has_bias, act), dtype)


def test_no_grad_forward_and_repeat_calls_agree():
    """The no-autograd forward (no Function) equals the autograd one; repeated calls reuse one plan."""
    out, _, _, _, ours = _case(2, 5376, 4096, 4, torch.bfloat16, torch.bfloat16, True, "silu")
    plans = len(_PLANS)
    with torch.no_grad():
        again = [causal_conv1d_triton(*ours, "silu") for _ in range(3)]
    assert all(torch.equal(a, out) for a in again)
    assert len(_PLANS) == plans


def test_backward_is_deterministic():
    """dweight / dbias are reduced in registers (or by the split sum), never with atomics: bitwise repeatable."""
    runs = [_case(2, 5376, 1024, 4, torch.bfloat16, torch.float32, True, "silu")[2] for _ in range(2)]
    runs += [_case(4, 64, 1000, 4, torch.bfloat16, torch.float32, True, "silu")[2] for _ in range(2)]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(runs[2], runs[3], strict=True):
        assert torch.equal(a, b)


def test_direct_relaunch_matches_the_first_launch():
    """Calls after the first relaunch the compiled binary directly (kernels/launch.py); a misaligned input of the same
    shape and strides is another specialization, compiled and kept apart. Every call equals the first, bitwise."""
    g = torch.Generator(device="cuda").manual_seed(3)
    batch, dim, seqlen = 2, 768, 1000
    buf = torch.randn(batch * dim * seqlen + 8, device="cuda", generator=g).to(torch.bfloat16)
    aligned = buf[: batch * dim * seqlen].view(batch, dim, seqlen)
    shifted = buf[1 : 1 + batch * dim * seqlen].view(batch, dim, seqlen)  # 2-byte offset: not 16-byte aligned
    w = torch.randn(dim, 4, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(dim, device="cuda", generator=g).to(torch.bfloat16)
    dout = torch.randn(batch, dim, seqlen, device="cuda", generator=g).to(torch.bfloat16)
    plan = _plan(aligned, w, b, "silu", None)
    for x in (aligned, shifted):
        runs = []
        for _ in range(3):
            leaves = [t.detach().requires_grad_() for t in (x, w, b)]  # x keeps its offset into buf
            out = causal_conv1d_triton(*leaves, "silu")
            runs.append((out, *torch.autograd.grad(out, leaves, dout)))
        ref = causal_conv1d_ref(x.float(), w.float(), b.float(), "silu")
        _close("out", runs[0][0], ref, *TOL[torch.bfloat16])
        for later in runs[1:]:
            assert all(torch.equal(a, c) for a, c in zip(runs[0], later, strict=True))
    assert plan.fwd.direct and plan.bwd.direct  # this Triton's compiled kernels support the direct relaunch
    assert len(plan.fwd.binaries) == 2 and len(plan.bwd.binaries) == 2  # both specializations, kept apart


def test_default_tiles_are_the_vendors():
    cfg = default_config(torch.device("cuda"))
    assert cfg == default_config() and cfg.block_t >= 256
