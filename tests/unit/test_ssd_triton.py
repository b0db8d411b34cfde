"""Triton SSD (Mamba-2) under the CPU interpreter against the sequential float64 recurrence and the chunked PyTorch
twin: the output, the final state and every gradient (x, dt, A, B, C, D, z, dt_bias, initial_states) at odd shapes.

The first cases run the tiles every device runs (``ssd_triton.CONFIG``, clamped to these tiny dimensions: one tile
per chunk); the small-tile cases (16-wide tiles, runs of 2 heads) cover what the device shapes reach through their
sizes: several position tiles per chunk (the off-diagonal tiles of the backward), head runs split across programs
(with a shorter last run), several state blocks, document boundaries inside a chunk and on a chunk edge, and ids
that come back after another document.
"""

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

from anytrain.kernels import ops  # noqa: E402
from anytrain.kernels import ssd_triton as ssd_mod  # noqa: E402
from anytrain.kernels.reference import ssd_scan_ref  # noqa: E402
from anytrain.kernels.ssd import ssd_chunk_scan, ssd_chunk_scan_torch  # noqa: E402
from anytrain.kernels.ssd_triton import SSDConfig, document_counter, ssd_chunk_scan_triton  # noqa: E402
from tests.unit.test_ssd import inputs  # noqa: E402

F64 = torch.float64
SMALL = SSDConfig(
    block_l=16,
    block_s=16,
    block_k=16,
    block_n=16,
    block_p=16,
    block_t=16,
    block_state=16,
    heads_per_program=2,
    scan_warps=2,  # the forward output kernel's own launch options
    scan_stages=1,
)
GRADS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "init")


def make_case(b, L, h, p, g, n, seed, *, d_per_channel=False, init=False, options=True):
    """``inputs`` (tests/unit/test_ssd.py) plus an initial state; ``options=False`` drops D, z and dt_bias."""
    args = inputs(b, L, h, p, g, n, seed=seed, d_per_channel=d_per_channel)
    if init:
        gen = torch.Generator().manual_seed(seed + 100)
        args["init"] = torch.randn(b, h, p, n, generator=gen, dtype=F64).requires_grad_()
    if not options:
        for k in ("D", "z", "dt_bias"):
            args.pop(k)
        with torch.no_grad():
            args["dt"].abs_().mul_(0.3)  # a positive step without softplus
    return args


def results(fn, args, chunk, **kw):
    """(y, final state, gradient of every given input) of ``fn`` for one fixed random cotangent of y and state."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in args.items()}
    xs = [leaves[k] for k in ("x", "dt", "A", "B", "C")]
    opt = {k: leaves.get(k) for k in ("D", "z", "dt_bias")}
    extra = (chunk,) if fn is not ssd_scan_ref else ()
    y, state = fn(*xs, *extra, **opt, initial_states=leaves.get("init"), return_final_states=True, **kw)
    gen = torch.Generator().manual_seed(7)
    gy = torch.randn(y.shape, generator=gen, dtype=F64).to(y.dtype)
    gs = torch.randn(state.shape, generator=gen, dtype=F64).to(state.dtype)
    names = [k for k in GRADS if k in leaves]
    grads = torch.autograd.grad((y * gy).sum() + (state * gs).sum(), [leaves[k] for k in names])
    return y, state, dict(zip(names, grads, strict=True))


def assert_close(got, expected, tol):
    torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol, msg=lambda m: f"y: {m}")
    torch.testing.assert_close(got[1], expected[1], rtol=tol, atol=tol, msg=lambda m: f"final state: {m}")
    assert got[2].keys() == expected[2].keys()
    for k, grad in got[2].items():
        torch.testing.assert_close(grad, expected[2][k], rtol=tol, atol=tol, msg=lambda m, k=k: f"d{k}: {m}")


def triton_op(config):
    def fn(*args, **kw):
        return ssd_chunk_scan_triton(*args, **kw, config=config)

    return fn


def check(args, chunk, config=None, **kw):
    """The Triton op against the float64 recurrence and the twin (both tight in float64)."""
    ours = results(triton_op(config), args, chunk, **kw)
    assert_close(ours, results(ssd_scan_ref, args, chunk, **kw), 1e-10)
    assert_close(ours, results(ssd_chunk_scan_torch, args, chunk, **kw), 1e-10)
    return ours


@pytest.mark.parametrize(
    ("L", "chunk", "h", "g"),
    [
        (1, 4, 2, 1),  # one position
        (2, 4, 3, 1),  # shorter than a chunk, odd head count
        (3, 2, 4, 2),  # one full and one partial chunk, two groups
        (11, 4, 3, 1),  # not a multiple of the chunk, three chunks
    ],
)
def test_device_tiles_match_reference_and_twin(L, chunk, h, g):
    check(make_case(1, L, h, 3, g, 5, seed=L), chunk, dt_softplus=True)


def test_small_tiles_with_documents_initial_state_and_per_channel_d():
    """Two 16-wide tiles per chunk of 24 (the second chunk partial), three heads in runs of 2 (the last run alone), a
    state of 3 x 6 in blocks of 16; documents start at 5 (inside a chunk), 24 (a chunk edge) and 27, and the last id
    equals the first (a later document, not the first one again)."""
    L, chunk = 30, 24
    args = make_case(1, L, 3, 3, 1, 6, seed=3, d_per_channel=True, init=True)
    seq_idx = torch.zeros(1, L, dtype=torch.long)
    for start, doc in ((5, 4), (24, 9), (27, 0)):
        seq_idx[0, start:] = doc
    check(args, chunk, config=SMALL, dt_softplus=True, seq_idx=seq_idx)


def test_small_tiles_two_groups_without_options():
    """Two groups of two heads (one run each), no D / z / dt_bias / softplus, a full and a partial chunk of two
    tiles."""
    check(make_case(1, 26, 4, 4, 2, 5, seed=4, options=False), 17, config=SMALL)


def test_backward_is_bitwise_reproducible():
    """No atomics anywhere: two runs give bitwise the same output and gradients (the ``kernels.deterministic`` flag
    has nothing to switch)."""
    args = make_case(1, 18, 3, 3, 1, 4, seed=5, init=True)
    first, second = (results(triton_op(SMALL), args, 17, dt_softplus=True) for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for k, grad in first[2].items():
        assert torch.equal(grad, second[2][k]), k
        assert grad.abs().sum() > 0, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_keep_their_dtype(dtype):
    """x, dt, B, C, z in fp32 / bf16 (A, D, dt_bias fp32): y and every gradient keep their input's dtype, the final
    state is fp32, and all match the float64 recurrence on the same rounded values to the dtype's precision."""
    args = make_case(1, 20, 2, 16, 1, 16, seed=6)
    narrow = {k: v.detach().to(dtype if k in ("x", "dt", "B", "C", "z") else torch.float32) for k, v in args.items()}
    y, state, grads = results(triton_op(None), narrow, 8, dt_softplus=True)
    assert y.dtype == dtype and state.dtype == torch.float32
    ref = results(ssd_scan_ref, {k: v.double() for k, v in narrow.items()}, 8, dt_softplus=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), ref[0], rtol=tol, atol=tol * ref[0].abs().max().item())
    torch.testing.assert_close(state.double(), ref[1], rtol=tol, atol=tol * ref[1].abs().max().item())
    for k, grad in grads.items():
        assert grad.dtype == narrow[k].dtype, k
        expected = ref[2][k]
        torch.testing.assert_close(
            grad.double(), expected, rtol=tol, atol=tol * expected.abs().max().item(), msg=lambda m, k=k: f"d{k}: {m}"
        )


def test_public_op_dispatches_by_backend(monkeypatch):
    args = make_case(1, 6, 2, 3, 1, 4, seed=8)
    xs = [args[k].detach() for k in ("x", "dt", "A", "B", "C")]
    calls = []
    real = ssd_mod.ssd_chunk_scan_triton
    monkeypatch.setattr(ssd_mod, "ssd_chunk_scan_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    old = ops.get_backend()
    try:
        ops.set_backend("triton")
        got = ssd_chunk_scan(*xs, 4, D=args["D"].detach(), dt_softplus=True)
        ops.set_backend("auto")  # CPU tensors: the twin
        expected = ssd_chunk_scan(*xs, 4, D=args["D"].detach(), dt_softplus=True)
    finally:
        ops.set_backend(old)
    assert calls == [1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_document_counter_and_tiles():
    ids = torch.tensor([[3, 3, 8, 8, 3, 1], [0, 0, 0, 0, 0, 0]])
    assert document_counter(ids).tolist() == [[0, 0, 1, 1, 2, 3], [0] * 6]
    assert document_counter(ids).dtype == torch.int32
    with pytest.raises(ValueError, match="power of 2"):
        SSDConfig(block_t=24)
    with pytest.raises(ValueError, match="heads_per_program"):
        SSDConfig(heads_per_program=0)
    with pytest.raises(ValueError, match="scan_warps / scan_stages"):
        SSDConfig(scan_stages=-1)


@pytest.mark.parametrize("options", [True, False])
def test_custom_ops_pass_opcheck_and_compile_to_the_eager_gradients(options):
    """Under torch.compile the SSD is ``anytrain::ssd_fwd`` / ``ssd_bwd``: schema, fake kernels (shapes, dtypes,
    strides: the forward's x is a strided view, as the Mamba-2 mixer's conv output is) and autograd registration
    pass opcheck; compiled with dynamic shapes (AOTAutograd), the output, final state and every gradient equal the
    eager op's for cotangents on both differentiable outputs (the y-before-gate output is not differentiable)."""
    assert ssd_mod.HAS_CUSTOM_OP
    args = make_case(1, 7, 2, 3, 1, 4, seed=11, init=options, options=options)  # small: the interpreter is slow
    x = args["x"].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # same values, not contiguous
    assert not x.is_contiguous()
    names = [k for k in ("dt", "A", "B", "C", "D", "z", "dt_bias", "init") if k in args]
    leaves = {"x": x, **{k: args[k].detach().clone().requires_grad_() for k in names}}
    seq = document_counter(torch.tensor([[0, 0, 0, 1, 1, 2, 2]])) if options else None

    def fwd_args(t):
        opt = [t.get(k) for k in ("D", "z", "dt_bias")]
        return (t["x"], t["dt"], t["A"], t["B"], t["C"], 4, *opt, options, seq, t.get("init"))

    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.anytrain.ssd_fwd.default, fwd_args(leaves), test_utils=utils)
    out, final, ypre = torch.ops.anytrain.ssd_fwd(*fwd_args(leaves))
    gen = torch.Generator().manual_seed(5)
    dout, dfinal = torch.randn(out.shape, generator=gen, dtype=F64), torch.randn(final.shape, generator=gen, dtype=F64)
    detached = {k: v.detach() for k, v in leaves.items()}
    bwd = (dout, dfinal, *fwd_args(detached), ypre.detach() if options else None)
    torch.library.opcheck(torch.ops.anytrain.ssd_bwd.default, bwd, test_utils=("test_schema", "test_faketensor"))

    def loss(t):
        y, state, _ = torch.ops.anytrain.ssd_fwd(*fwd_args(t))
        return (y * dout).sum() + (state * dfinal).sum()

    eager = torch.autograd.grad(loss(leaves), list(leaves.values()))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(
        torch.compile(loss, backend="aot_eager", dynamic=True)(leaves), list(leaves.values())
    )
    for k, got, want in zip(leaves, compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, k=k: f"d{k}: {m}")
    torch._dynamo.reset()


def test_compiled_checkpointed_mamba2_block_is_one_graph_with_the_eager_values():
    """A Mamba-2 block (Triton conv and SSD) under torch.compile, checkpointed as train.activation_checkpointing does
    it, is one graph (a break inside a checkpointed region makes dynamo run the whole block eagerly: no graph at
    all), and gives the eager block's output and input gradient. Two chunks of a one-sequence batch: the interpreter
    takes seconds per launch."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.utils.checkpoint import checkpoint

    from anytrain.models.mamba2.model import Mamba2Args, Mamba2Block

    torch.manual_seed(0)
    block = Mamba2Block(Mamba2Args(d_model=16, n_layers=1, d_state=16, headdim=16, chunk_size=16, vocab_size=64))
    block.mixer.reset_parameters()
    old = ops.get_backend()
    try:
        ops.set_backend("triton")

        def f(h):
            return checkpoint(block, h, use_reentrant=False)

        h = torch.randn(1, 20, 16, requires_grad=True)
        eager = f(h)
        (grad,) = torch.autograd.grad(eager.sum(), h)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")  # the graph as AOTAutograd runs it
        compiled = torch.compile(f, backend=counter)(h)
        assert counter.frame_count == 1
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.autograd.grad(compiled.sum(), h)[0], grad, rtol=1e-5, atol=1e-5)
    finally:
        ops.set_backend(old)
        torch._dynamo.reset()
