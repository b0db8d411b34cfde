"""Fused Mamba mixer (``kernels/mamba_inner.py``) on the Triton CPU interpreter vs the unfused reference composition:
forward and every gradient in float64, the model's dispatch, autocast dtypes, and torch.compile over a block."""

from __future__ import annotations

import os
import sys

import pytest

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run in the interpreter
pytest.importorskip("triton")
if _TRITON_PREIMPORTED:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

import torch  # noqa: E402

from anytrain import kernels  # noqa: E402
from anytrain.kernels import mamba_inner as mi  # noqa: E402
from anytrain.kernels import ops  # noqa: E402
from anytrain.models.mamba.model import MambaArgs, MambaBlock, MambaMixer  # noqa: E402

F64 = torch.float64
WEIGHTS = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "A_log",
    "D",
    "out_proj.weight",
)


@pytest.fixture(autouse=True)
def restore_options():
    """The kernel options restored after each test."""
    previous = kernels.get_backend()
    yield
    kernels.set_backend(previous)
    mi.set_mamba_inner(True)
    mi.set_cast_cache(True)


def make_mixer(dtype=F64, d_conv=4, seed=0) -> MambaMixer:
    """d_model 2 -> E 4, S 4, R 2 (the interpreter's scan forward runs one program per channel and batch);
    parameters perturbed so that no gradient is structurally trivial."""
    torch.manual_seed(seed)
    mixer = MambaMixer(MambaArgs(d_model=2, d_state=4, d_conv=d_conv, expand=2, dt_rank=2)).to(dtype)
    mixer.reset_parameters()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def weights(mixer: MambaMixer) -> list[torch.Tensor]:
    params = dict(mixer.named_parameters())
    return [params[n] for n in WEIGHTS]


def run(fn, h, params, seed=1):
    """out and the gradients of (h, *params) for a fixed random output gradient."""
    h = h.detach().clone().requires_grad_()
    out = fn(h)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return out, torch.autograd.grad(out, [h, *params], grad)


def assert_same(res, ref, rtol=1e-10, atol=1e-12):
    torch.testing.assert_close(res[0], ref[0], rtol=rtol, atol=atol)
    for name, g, g_ref in zip(("h", *WEIGHTS), res[1], ref[1], strict=True):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
        torch.testing.assert_close(g, g_ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("seqlen, d_conv, deterministic", [(7, 4, False), (33, 4, True), (16, 3, False)])
def test_fused_op_matches_unfused_reference(seqlen, d_conv, deterministic):
    mixer = make_mixer(d_conv=d_conv)
    ws = weights(mixer)
    h = torch.randn(2, seqlen, 2, dtype=F64)
    fused = run(lambda x: mi.mamba_inner_triton(x, *ws, deterministic=deterministic), h, ws)
    kernels.set_backend("reference")
    unfused = run(mixer, h, ws)  # the model's own composition on the reference ops
    assert_same(fused, unfused)
    assert_same(run(lambda x: mi.mamba_inner_ref(x, *ws), h, ws), unfused, rtol=1e-13, atol=1e-14)
    assert all(g.abs().max() > 1e-6 for g in fused[1])  # no gradient compared is trivially zero


def test_fused_op_is_one_autograd_node():
    mixer = make_mixer()
    h = torch.randn(2, 7, 2, dtype=F64, requires_grad=True)
    out = mi.mamba_inner_triton(h, *weights(mixer))
    assert type(out.grad_fn).__name__ == "_MambaInnerFnBackward"
    leaves = [fn.variable for fn, _ in out.grad_fn.next_functions if fn is not None]
    assert [id(t) for t in leaves] == [id(t) for t in (h, *weights(mixer))]  # straight to the leaves, no cast nodes


def test_mixer_dispatches_to_the_fused_op_on_the_triton_path():
    mixer = make_mixer()
    ws = weights(mixer)
    h = torch.randn(2, 4, 2, dtype=F64)
    kernels.set_backend("triton")
    assert mi.use_mamba_inner(h)
    assert mi.use_mamba_inner(h, d_inner=4) and not mi.use_mamba_inner(h, d_inner=2**31 // h.shape[1])  # 32-bit guard
    fused = run(mixer, h, ws)
    assert type(mixer(h).grad_fn).__name__ == "_MambaInnerFnBackward"
    mi.set_mamba_inner(False)  # the unfused composition on the Triton kernels
    assert not mi.use_mamba_inner(h) and type(mixer(h).grad_fn).__name__ != "_MambaInnerFnBackward"
    unfused_triton = run(mixer, h, ws)
    kernels.set_backend("reference")
    assert not mi.use_mamba_inner(h)
    reference = run(mixer, h, ws)
    assert_same(fused, reference)
    assert_same(unfused_triton, reference)


def test_autocast_casts_gemms_and_returns_grads_in_param_dtypes():
    """bf16 autocast over fp32 weights: out in bf16, gradients in the parameters' dtype, close to the reference
    composition under the same autocast (bf16 rounding level)."""
    mixer = make_mixer(dtype=torch.float32)
    ws = weights(mixer)
    h = torch.randn(2, 16, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = run(lambda x: mi.mamba_inner_triton(x, *ws), h, ws)
        reference = run(lambda x: mi.mamba_inner_ref(x, *ws), h, ws)
    assert fused[0].dtype == torch.bfloat16 == reference[0].dtype
    assert all(g.dtype == torch.float32 for g in fused[1])
    for g, g_ref in zip((fused[0], *fused[1]), (reference[0], *reference[1]), strict=True):
        assert (g.float() - g_ref.float()).abs().max() <= 0.05 * g_ref.float().abs().max()


def test_cached_weight_casts_reuse_one_cast_per_weight_until_it_changes(monkeypatch):
    """Inside ``cached_weight_casts`` (one optimizer step's micro-batches) the four projections are cast once and the
    copies serve later forwards and backwards: the results equal the uncached op bitwise; a weight changed in place
    (a new version) is cast again; the cache is gone after the block; off with ``set_cast_cache(False)``."""
    mixer = make_mixer(dtype=torch.float32)
    ws = weights(mixer)
    h = torch.randn(1, 4, 2)
    casts = []
    cast = mi._cast

    def counting(w, dtype):
        out = cast(w, dtype)
        casts.append(out)
        return out

    monkeypatch.setattr(mi, "_cast", counting)
    fn = lambda x: mi.mamba_inner_triton(x, *ws)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = [run(fn, h, ws, seed=s) for s in (1, 2)]
        assert mi._casts is None and len({id(c) for c in casts}) == 16  # 2 x (4 forward + 4 backward) fresh casts
        casts.clear()
        with mi.cached_weight_casts():
            cached = [run(fn, h, ws, seed=s) for s in (1, 2)]
            assert len(mi._casts) == 4 and len({id(c) for c in casts}) == 4  # cast once, reused 3 more times
            for res, ref in zip(cached, plain, strict=True):
                for a, b in zip((res[0], *res[1]), (ref[0], *ref[1]), strict=True):
                    assert torch.equal(a, b)
            with torch.no_grad():
                ws[0].mul_(1.5)  # in_proj changes (version bump): its next use casts again
            changed = run(fn, h, ws)
        assert mi._casts is None
        assert len({id(c) for c in casts}) == 5
        torch.testing.assert_close(changed[0], run(fn, h, ws)[0], rtol=0, atol=0)
        mi.set_cast_cache(False)
        with mi.cached_weight_casts():
            assert mi._casts is None


@pytest.mark.slow
@pytest.mark.skipif(not mi.HAS_CUSTOM_OP, reason="torch.library.custom_op is not available")
def test_custom_ops_pass_opcheck():
    """Schema, fake kernels, autograd registration and AOT dispatch (dynamic shapes) of both torch.library ops."""
    ws = weights(make_mixer())
    h = torch.randn(2, 3, 2, dtype=F64, requires_grad=True)
    out, *residuals = torch.ops.anytrain.mamba_inner_fwd(h, *ws, False)
    assert out.requires_grad and not any(r.requires_grad for r in residuals)  # no zero grads materialised for them
    assert [tuple(r.shape) for r in residuals] == [(8, 6), (2 + 8, 6), (4, 6), (2, 4, 4, 1)]  # N = 2 x 3
    ok = {k: "SUCCESS" for k in ("test_schema", "test_autograd_registration", "test_faketensor")}
    ok["test_aot_dispatch_dynamic"] = "SUCCESS"
    assert torch.library.opcheck(torch.ops.anytrain.mamba_inner_fwd.default, (h, *ws, False)) == ok
    bwd_args = (torch.randn_like(out), h.detach(), *(w.detach() for w in ws), *residuals, False)
    assert torch.library.opcheck(torch.ops.anytrain.mamba_inner_bwd.default, bwd_args) == ok


@pytest.mark.skipif(not mi.HAS_CUSTOM_OP, reason="torch.library.custom_op is not available")
def test_compiled_block_uses_the_opaque_op_and_matches_eager(monkeypatch):
    """One graph per block (fullgraph), also when the block is compiled before anything imported the Triton kernels,
    as in a training run whose first forward is compiled: the lazy import was a graph break that split each block in
    three graphs (two extra activation casts and an eager residual-gradient add per block and micro-batch)."""
    torch.manual_seed(0)
    block = MambaBlock(MambaArgs(d_model=2, d_state=4, expand=2, dt_rank=2)).to(F64)
    block.mixer.reset_parameters()
    params = list(block.parameters())
    h = torch.randn(2, 4, 2, dtype=F64)
    kernels.set_backend("triton")
    eager = run(block, h, params)
    graph_ops: list[str] = []

    def backend(gm, example_inputs):
        graph_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    monkeypatch.setattr(ops, "_modules", False)  # as in a fresh process: the kernels not imported yet
    compiled = run(torch.compile(block, backend=backend, fullgraph=True), h, params)
    assert any("mamba_inner_fwd" in op for op in graph_ops), graph_ops
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
