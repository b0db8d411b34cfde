"""Triton causal conv1d under the CPU interpreter vs the float64 reference: forward and every gradient, for the code
paths the vendors' tiles take (interpreter-sized), and the launcher's host-side contract (launch counts, dtypes, the
per-shape plan cache, layouts)."""

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

from anytrain.kernels.causal_conv1d_triton import (  # noqa: E402
    _PLANS,
    ConvConfig,
    _bwd,
    _bwd_splits,
    _fwd,
    _plan,
    causal_conv1d_triton,
    default_config,
)
from anytrain.kernels.reference import causal_conv1d_ref  # noqa: E402

F64 = torch.float64
SMALL = dict(block_d=2, block_t=8, num_warps=1, block_t_bwd=8, num_warps_bwd=1)
CONFIGS = {
    # CUDA's backward: runs of 8 timesteps, one channel per program looping over every (batch, time block)
    "cuda": ConvConfig(**SMALL, block_d_bwd=1, min_programs_bwd=1, slots_bwd=8),
    # the same split over 3 programs per channel (3 channels, min 9 programs): at 2 batches x 3 time blocks a split
    # starts in the middle of a batch and moves on to the next one; partials summed by the second kernel
    "cuda-split": ConvConfig(**SMALL, block_d_bwd=1, min_programs_bwd=9, slots_bwd=8),
    # ROCm's backward: runs of 4, 2 channels per program, no split
    "rocm": ConvConfig(**SMALL, block_d_bwd=2, min_programs_bwd=1),
    # the CPU tiles (config=None on CPU tensors): runs of 4, one iteration per split
    "cpu": None,
}
DIM = 3  # odd: the last channel block is partial


def _inputs(width, seqlen, has_bias, seed, dtype=F64, batch=2, dim=DIM):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, seqlen, generator=g, dtype=dtype)
    w = torch.randn(dim, width, generator=g, dtype=dtype)
    b = torch.randn(dim, generator=g, dtype=dtype) if has_bias else None
    dout = torch.randn(batch, dim, seqlen, generator=g, dtype=dtype)
    return x, w, b, dout


def _check_against_reference(width, seqlen, has_bias, act, config, seed=0):
    x, w, b, dout = _inputs(width, seqlen, has_bias, seed)
    ours = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    out = causal_conv1d_triton(*ours, activation=act, config=config)
    out_ref = causal_conv1d_ref(*ref, activation=act)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    leaves = [t for t in ours if t is not None]
    grads = torch.autograd.grad(out, leaves, dout)
    grads_ref = torch.autograd.grad(out_ref, [t for t in ref if t is not None], dout)
    for name, a, r in zip(("dx", "dweight", "dbias"), grads, grads_ref, strict=False):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


# (width, seqlen, bias, activation, configs): widths 2-4, seqlen 1-3, odd and even (seqlen % 4 and % 8 select the
# kernels' aligned-load paths), with / without bias and SiLU; each case on the configs that reach its paths
CASES = [
    (4, 1, True, "silu", ["cuda", "rocm"]),
    (2, 2, False, "silu", ["cuda", "cpu"]),
    (3, 3, True, None, ["cuda-split", "rocm"]),
    (2, 7, True, "silu", ["cuda-split", "cpu"]),
    (3, 12, False, "silu", ["cuda", "rocm"]),
    (4, 16, True, "silu", ["cuda", "cuda-split"]),
    (4, 19, False, None, ["cuda-split", "cpu"]),
]


@pytest.mark.parametrize(
    "width,seqlen,has_bias,act,cfg",
    [(w, s, b, a, c) for w, s, b, a, cs in CASES for c in cs],
    ids=[f"{c}-w{w}-L{s}-{'bias' if b else 'nobias'}-{a or 'none'}" for w, s, b, a, cs in CASES for c in cs],
)
def test_matches_reference(width, seqlen, has_bias, act, cfg):
    _check_against_reference(width, seqlen, has_bias, act, CONFIGS[cfg], seed=width * 100 + seqlen)


def test_config_resolution_and_split_counts():
    assert default_config(torch.device("cpu")).block_t == 8  # the interpreter tiles for CPU tensors
    cuda, split, rocm = CONFIGS["cuda"], CONFIGS["cuda-split"], CONFIGS["rocm"]
    assert _bwd_splits(cuda, dim=3, n_iters=6) == (1, 6)  # one program per channel does it all
    assert _bwd_splits(split, dim=3, n_iters=6) == (3, 2)  # 3 splits of 2 iterations
    assert _bwd_splits(rocm, dim=3, n_iters=6) == (1, 6)
    assert _bwd_splits(ConvConfig(block_d_bwd=4, min_programs_bwd=8), dim=8, n_iters=7) == (4, 2)
    assert _bwd_splits(ConvConfig(slots_bwd=8), dim=5376, n_iters=8) == (1, 8)  # the bench shape: no split


def test_rejects_bad_arguments():
    x, w = torch.randn(1, 2, 5), torch.randn(2, 4)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_triton(x, w, activation="relu")
    with pytest.raises(ValueError, match="width"):
        causal_conv1d_triton(x, torch.randn(2, 5))
    with pytest.raises(ValueError, match="bad shapes"):
        causal_conv1d_triton(x, torch.randn(3, 4))
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d_triton(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="slots_bwd"):
        ConvConfig(slots_bwd=2)
    with pytest.raises(ValueError, match="power of 2"):
        ConvConfig(block_t=12)


class _Launches:
    """Counts Triton launches (the interpreter's grid executor calls)."""

    def __init__(self, monkeypatch):
        from triton.runtime import interpreter

        self.n = 0
        launch = interpreter.GridExecutor.__call__

        def counted(executor, *args, **kwargs):
            self.n += 1
            return launch(executor, *args, **kwargs)

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)


@pytest.mark.parametrize("cfg,bwd_launches", [("cuda", 1), ("cuda-split", 2)])
def test_one_launch_per_call_and_grads_in_the_parameters_dtypes(monkeypatch, cfg, bwd_launches):
    """bf16 parameters: the backward writes dweight / dbias in bf16 itself (no cast launches); one forward launch,
    one backward launch (two with splits: the partials' sum). The plan is made once per shape."""
    x, w, b, dout = _inputs(4, 13, True, seed=5, dtype=torch.float32)
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (x, w, b)]
    launches = _Launches(monkeypatch)
    out = causal_conv1d_triton(*leaves, "silu", config=CONFIGS[cfg])
    assert launches.n == 1 and out.dtype == torch.bfloat16
    plans = len(_PLANS)
    grads = torch.autograd.grad(out, leaves, dout.to(torch.bfloat16))
    assert launches.n == 1 + bwd_launches
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = causal_conv1d_ref(*ref_leaves, "silu")
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.to(torch.bfloat16).double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=2e-2, atol=2e-2 * r.abs().max().item())
    with torch.no_grad():  # no autograd Function, same plan, same values
        again = causal_conv1d_triton(*leaves, "silu", config=CONFIGS[cfg])
    assert launches.n == 2 + bwd_launches and len(_PLANS) == plans and torch.equal(again, out)
    assert _plan(leaves[0], leaves[1], leaves[2], "silu", CONFIGS[cfg]) is _plan(
        leaves[0].detach(), leaves[1], leaves[2], "silu", CONFIGS[cfg]
    )


def test_noncontiguous_inputs():
    """x a channel slice of a wider tensor or strided in time, a transposed weight, a strided bias and a dout strided
    in time: the same values as the reference on the same views."""
    g = torch.Generator().manual_seed(3)
    xz = torch.randn(2, 2 * DIM, 14, generator=g, dtype=F64)
    w_t = torch.randn(4, DIM, generator=g, dtype=F64)
    b2 = torch.randn(2 * DIM, generator=g, dtype=F64)
    dout = torch.randn(7, 2, DIM, generator=g, dtype=F64).permute(1, 2, 0)  # time stride 2·dim
    views = {
        "channel slice": lambda xz, w_t, b2: (xz[:, :DIM, :7], w_t.t(), b2[::2]),
        "strided in time": lambda xz, w_t, b2: (xz[:, DIM:, ::2], w_t.t(), b2[::2]),
    }
    for name, view in views.items():
        ours = [t.clone().requires_grad_() for t in (xz, w_t, b2)]
        ref = [t.clone().requires_grad_() for t in (xz, w_t, b2)]
        out = causal_conv1d_triton(*view(*ours), "silu", config=CONFIGS["cuda"])
        out_ref = causal_conv1d_ref(*view(*ref), "silu")
        torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        for a, r in zip(torch.autograd.grad(out, ours, dout), torch.autograd.grad(out_ref, ref, dout), strict=True):
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_launchers_take_three_different_layouts_and_out():
    """``_fwd`` / ``_bwd`` as the fused Mamba op calls them: x a channel slice of a wider tensor, dout and ``out`` in
    the (dim, batch·L) layout (strides (L, batch·L, 1)), dx dense: three different batch strides, which the backward
    advances separately when a split moves on to the next batch. Bitwise the same as on contiguous tensors."""
    cfg = CONFIGS["cuda-split"]
    g = torch.Generator().manual_seed(19)
    batch, seqlen = 2, 19
    xz = torch.randn(batch, 2 * DIM, seqlen, generator=g, dtype=F64)
    x = xz[:, :DIM]
    folded = torch.randn(DIM, batch * seqlen, generator=g, dtype=F64)
    dout = folded.view(DIM, batch, seqlen).transpose(0, 1)
    w, b = torch.randn(DIM, 4, generator=g, dtype=F64), torch.randn(DIM, generator=g, dtype=F64)
    out = torch.zeros(DIM, batch * seqlen, dtype=F64).view(DIM, batch, seqlen).transpose(0, 1)
    assert _fwd(x, w, b, True, cfg, out=out) is out
    assert torch.equal(out, _fwd(x.contiguous(), w, b, True, cfg))
    dx, dw, db = _bwd(x, w, b, dout, True, cfg)
    assert len({x.stride(0), dout.stride(0), dx.stride(0)}) == 3
    dx_ref, dw_ref, db_ref = _bwd(x.contiguous(), w, b, dout.contiguous(), True, cfg)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref) and torch.equal(db, db_ref)


# no bias slow: the models' convs all have one ([True]); the no-bias numerics are test_matches_reference's nobias cases
@pytest.mark.parametrize("has_bias", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_custom_ops_pass_opcheck_and_compile_without_graph_breaks(has_bias):
    """Under torch.compile the conv is ``anytrain::causal_conv1d_fwd`` (schema, fake kernels and autograd registered
    right: opcheck), and a compiled function around it is one graph with the eager op's values and gradients."""
    from anytrain.kernels import causal_conv1d_triton as conv_mod

    assert conv_mod.HAS_CUSTOM_OP
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 13, generator=gen, requires_grad=True)
    w = torch.randn(5, 4, generator=gen, requires_grad=True)
    b = torch.randn(5, generator=gen, requires_grad=True) if has_bias else None
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")  # the compile check is below
    torch.library.opcheck(torch.ops.anytrain.causal_conv1d_fwd.default, (x, w, b, True), test_utils=utils)
    dout = torch.randn(2, 5, 13, generator=gen)
    bwd = (x.detach(), w.detach(), None if b is None else b.detach(), dout, True)
    torch.library.opcheck(
        torch.ops.anytrain.causal_conv1d_bwd.default, bwd, test_utils=("test_schema", "test_faketensor")
    )

    def f(x, w, b):
        return causal_conv1d_triton(x * 2, w, b, "silu").sin()

    leaves = [t for t in (x, w, b) if t is not None]
    eager = f(x, w, b)
    grads = torch.autograd.grad((eager * dout).sum(), leaves)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(x, w, b)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(f, backend="aot_eager")(x, w, b)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad((compiled * dout).sum(), leaves), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
