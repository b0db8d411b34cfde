"""Chunked linear + cross-entropy: the Triton row kernel under the CPU interpreter and the chunked op vs float64."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from anytrain.kernels import fused_linear_ce as flce
from anytrain.models import losses
from anytrain.models.llama.model import Transformer, TransformerArgs

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"


def _triton_interpreter():
    """Skip unless the Triton kernel can run in the CPU interpreter in this process."""
    if not flce.triton_importable():
        pytest.skip("triton not installed")
    if _TRITON_PREIMPORTED and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")


os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel launch: kernels run in the interpreter


def _case(n: int, d: int, v: int, dtype: torch.dtype, seed: int = 0, ignore: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[:ignore] = flce.IGNORE_INDEX
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    """Loss and gradients of F.cross_entropy on float64 logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), targets, ignore_index=flce.IGNORE_INDEX)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize(
    "dtype,block,tol", [(torch.float32, 8, 1e-6), (torch.float32, 64, 1e-6), (torch.bfloat16, 16, 1e-2)]
)
def test_row_kernel_matches_reference(dtype, block, tol):
    _triton_interpreter()
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(5, 37, generator=g, dtype=torch.float64)).to(dtype)  # V=37: not a multiple of block
    targets = torch.tensor([0, 36, flce.IGNORE_INDEX, 5, 17])
    scale = torch.tensor([0.25])
    ref_grad = logits.double().clone()
    ref_loss = flce.ce_rows_ref(ref_grad, targets, scale.double())
    grad = logits.clone()
    loss = flce.ce_rows_triton(grad, targets, scale, block_v=block)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)
    assert (grad[2] == 0).all() and loss[2] == 0  # ignored row: no loss, no gradient
    no_grad = logits.clone()
    flce.ce_rows_triton(no_grad, targets, scale, write_grad=False, block_v=block)
    assert torch.equal(no_grad, logits)


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 7, 100])
def test_chunked_op_matches_float64_reference(chunk_rows):
    hidden, weight, targets = _case(13, 6, 11, torch.float64, ignore=2)
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = flce.linear_cross_entropy(h, w, targets, chunk_rows=chunk_rows)
    (2.5 * loss).backward()  # backward scales the precomputed gradients by grad_output
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, 2.5 * ref_dh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, 2.5 * ref_dw, rtol=1e-12, atol=1e-12)


def test_chunked_op_through_triton_kernel(monkeypatch):
    _triton_interpreter()
    monkeypatch.setattr(flce, "_use_triton", lambda t: True)
    hidden, weight, targets = _case(9, 8, 21, torch.float32, seed=3, ignore=1)
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = flce.linear_cross_entropy(h.view(3, 3, 8), w, targets.view(3, 3), chunk_rows=4)
    loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-5, atol=1e-6)


def test_no_grad_path_and_all_ignored():
    hidden, weight, targets = _case(6, 4, 9, torch.float32)
    with torch.no_grad():
        loss = flce.linear_cross_entropy(hidden, weight, targets, chunk_rows=4)
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), targets))
    assert torch.isnan(flce.linear_cross_entropy(hidden, weight, torch.full_like(targets, -100)))


def test_default_chunks_bound_logits_memory():
    rows = flce.default_chunk_rows(8192, 32000, torch.bfloat16)
    assert rows * 32000 * 2 <= flce.LOGITS_CHUNK_BYTES and rows >= 4096 - 1
    assert flce.default_chunk_rows(3, 10, torch.float32) == 3


def test_lm_loss_under_autocast_matches_naive():
    hidden, weight, targets = _case(16, 8, 40, torch.float32, seed=5)
    results = {}
    for impl in ("chunked", "naive"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with pytest.MonkeyPatch.context() as mp, torch.autocast("cpu", dtype=torch.bfloat16):
            mp.setattr(losses, "LOSS_IMPL", impl)
            loss = losses.lm_cross_entropy(h.view(2, 8, 8), w, targets.view(2, 8))
        loss.backward()
        assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
        results[impl] = (loss.detach(), h.grad, w.grad)
    for ours, naive in zip(results["chunked"], results["naive"], strict=True):
        torch.testing.assert_close(ours, naive, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("native_gqa", [True, False])
def test_transformer_loss_and_grads_match_naive_path(monkeypatch, native_gqa):
    from anytrain.models.llama import model as transformer

    monkeypatch.setattr(transformer, "SDPA_NATIVE_GQA", native_gqa)
    args = TransformerArgs(vocab_size=50, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    assert all(b.attention.native_gqa == native_gqa for b in model.blocks())
    x, y = torch.randint(0, 50, (2, 2, 9)).unbind(0)
    grads = {}
    for impl in ("chunked", "naive"):
        monkeypatch.setattr(losses, "LOSS_IMPL", impl)
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        grads[impl] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads["chunked"][0], grads["naive"][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads["chunked"][1], grads["naive"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    logits_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(grads["naive"][0], logits_loss, rtol=1e-6, atol=1e-6)


def test_wide_mm_fallbacks_on_cpu():
    """``kernels.wide_mm`` off the GPU path: the product in the operands' dtype, cast to the parameter dtype; the
    accumulation is in place (the same tensor back) and exact for matching dtypes. (The fp32-output GEMMs themselves
    are checked on a GPU: tests/gpu/test_mamba_inner_gpu.py.)"""
    from anytrain.kernels import wide_mm

    torch.manual_seed(0)
    a, b = torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    acc = torch.randn(5, 3, dtype=torch.float64)
    expected = acc + a @ b
    assert wide_mm.add_mm_(acc, a, b) is acc and torch.allclose(acc, expected, rtol=1e-14, atol=1e-14)
    a16, b16 = a.bfloat16(), b.bfloat16()
    g = wide_mm.grad_mm(a16, b16, torch.float32)
    assert g.dtype == torch.float32 and torch.equal(g, (a16 @ b16).float())
    acc32 = torch.zeros(5, 3)
    assert wide_mm.add_mm_(acc32, a16, b16) is acc32 and torch.equal(acc32, (a16 @ b16).float())
    out = torch.empty(5, 3)
    assert wide_mm.grad_mm(a16, b16, torch.float32, out=out) is out and torch.equal(out, g)


def test_wide_mm_gives_up_one_overload_at_a_time(monkeypatch):
    """A failing fp32-output overload falls back (with one warning) for itself only: an ``addmm`` that this build
    rejects must not turn off the mixer's ``mm`` path; out-of-memory errors propagate instead."""
    from anytrain.kernels import wide_mm

    monkeypatch.setattr(wide_mm, "_ok", {"mm": True, "addmm": True})
    monkeypatch.setattr(wide_mm, "_wide", lambda op, a, dtype: wide_mm._ok[op])  # as on a GPU
    real_addmm = torch.addmm

    def addmm(*args, **kwargs):
        if "out_dtype" in kwargs:
            raise RuntimeError("self and mat2 must have the same dtype")
        return real_addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", addmm)
    a, b = torch.randn(4, 6).bfloat16(), torch.randn(6, 3).bfloat16()
    acc = torch.zeros(4, 3)
    with pytest.warns(UserWarning, match="addmm with an fp32 out_dtype failed"):
        assert wide_mm.add_mm_(acc, a, b) is acc
    assert torch.equal(acc, (a @ b).float()) and wide_mm._ok == {"mm": True, "addmm": False}

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("out of memory")

    monkeypatch.setattr(torch, "mm", oom)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        wide_mm.grad_mm(a, b, torch.float32)
    assert wide_mm._ok["mm"]


def _linear_grads(mod, x, dy, compiled=False, autocast=True, backend="aot_eager"):
    fn = torch.compile(mod, backend=backend, fullgraph=True) if compiled else mod
    xi = x.clone().requires_grad_()
    mod.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fn(xi)
    y.backward(dy)
    return y, xi.grad, mod.weight.grad


@pytest.mark.parametrize("compiled", [False, True])
def test_wide_grad_linear_matches_autocast_linear(compiled, monkeypatch):
    """transformer.Linear under bf16 autocast takes the wide path (its own autograd function) and gives nn.Linear's
    output, input gradient and (here, on CPU, where the fp32-output GEMM falls back to the bf16 product cast) weight
    gradient, in the weight's layout and dtype; also traced whole by torch.compile (fullgraph, the GEMM as one opaque
    op). The GPU's fp32-output GEMM is checked at real size in tests/gpu/test_fused_ops_gpu.py."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from anytrain.kernels import wide_mm
    from anytrain.models.llama import model as transformer

    torch.manual_seed(0)
    wide, plain = transformer.Linear(24, 40, bias=False), nn.Linear(24, 40, bias=False)
    plain.weight.data.copy_(wide.weight.data)
    x, dy = torch.randn(3, 5, 24), torch.randn(3, 5, 40).bfloat16()
    calls = []  # eager: the weight gradient comes from grad_mm, asked for the weight's dtype
    monkeypatch.setattr(wide_mm, "grad_mm", lambda a, b, dtype: calls.append(dtype) or (a @ b).to(dtype))
    torch._dynamo.reset()
    graphs = AotEagerAndRecordGraphs()
    y, dx, dw = _linear_grads(wide, x, dy, compiled, backend=graphs)
    y0, dx0, dw0 = _linear_grads(plain, x, dy)
    if compiled:  # the backward graph holds the one opaque GEMM op
        assert len(graphs.bw_graphs) == 1 and "anytrain.weight_grad" in graphs.bw_graphs[0].code
    else:
        assert type(y.grad_fn).__name__ == "_WideLinearFnBackward" and calls == [torch.float32]
    assert y.dtype == torch.bfloat16 and dw.dtype == torch.float32 and dw.shape == (40, 24)
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(dw, dw0)


def test_wide_grad_linear_applies_only_to_fp32_weights_under_autocast(monkeypatch):
    """The plain F.linear path everywhere else: no autocast, a bf16 weight (FSDP mixed precision), a bias, the switch
    off."""
    from anytrain.models.llama import model as transformer

    x = torch.randn(2, 8)
    for kwargs, setup, autocast in (
        ({}, None, False),
        ({}, "bf16", True),
        ({"bias": True}, None, True),
        ({}, "off", True),
    ):
        mod = transformer.Linear(8, 4, **kwargs)
        if setup == "bf16":
            mod = mod.bfloat16()
        monkeypatch.setattr(transformer, "WIDE_GRAD_LINEAR", setup != "off")
        y, _, dw = _linear_grads(mod, x, torch.ones(2, 4), autocast=autocast)
        assert type(y.grad_fn).__name__ != "_WideLinearFnBackward", (kwargs, setup, autocast)
        assert dw.dtype == mod.weight.dtype


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_weight_gradients_accumulate_in_the_gemm(backend):
    """Inside ``wide_mm.accumulate_in_gemm`` the second and later micro-batches' weight gradients are summed into
    ``.grad`` by the GEMM (counted by ``wide_mm.accumulated``) and handed back through autograd, eagerly and from a
    compiled backward (which must see the parameter itself): the gradients equal nn.Linear's accumulated ones, and
    ``.grad`` keeps its storage (AccumulateGrad takes the sum back, no copy). Outside the context, or with it
    disabled, nothing is accumulated that way."""
    from anytrain.kernels import wide_mm
    from anytrain.models.llama import model as transformer

    torch.manual_seed(0)
    mod = nn.Sequential(transformer.Linear(24, 40, bias=False), nn.GELU(), transformer.Linear(40, 8, bias=False))
    ref = nn.Sequential(nn.Linear(24, 40, bias=False), nn.GELU(), nn.Linear(40, 8, bias=False))
    ref.load_state_dict(mod.state_dict())
    torch._dynamo.reset()
    fn = mod if backend == "eager" else torch.compile(mod, backend=backend, fullgraph=True)
    xs = [torch.randn(4, 24) for _ in range(3)]

    def run(model, params, context):
        storage = []
        with context:
            for x in xs:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(x).float().square().mean().backward()
                storage.append([p.grad.data_ptr() for p in params])
        return storage

    run(ref, list(ref.parameters()), contextlib.nullcontext())
    for context, expected in (
        (wide_mm.accumulate_in_gemm(), 4),
        (contextlib.nullcontext(), 0),
        (wide_mm.accumulate_in_gemm(False), 0),
    ):
        mod.zero_grad(set_to_none=True)
        before = wide_mm.accumulated
        ptrs = run(fn, list(mod.parameters()), context)
        assert wide_mm.accumulated - before == expected  # 2 layers x micro-batches 2 and 3
        assert not wide_mm._accumulate
        for p, q in zip(mod.parameters(), ref.parameters(), strict=True):
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad)
        if expected:
            assert ptrs[0] == ptrs[1] == ptrs[2]


def test_gemm_accumulation_only_where_accumulate_grad_takes_the_sum_back():
    """The accumulation path is skipped, and ``.grad`` left alone, where autograd would not hand the sum back as it
    is: ``torch.autograd.grad`` and ``backward(inputs=...)`` (no AccumulateGrad for the weight), a tensor hook on the
    weight (it would see, and could rescale, the running sum), and a backward with grad mode on (``create_graph``)."""
    from anytrain.kernels import wide_mm
    from anytrain.models.llama import model as transformer

    torch.manual_seed(1)
    lin = transformer.Linear(6, 5, bias=False)
    xs = [torch.randn(3, 6, requires_grad=True) for _ in range(3)]

    def loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x).float().square().sum()

    with wide_mm.accumulate_in_gemm():
        loss(xs[0]).backward()
        first, before = lin.weight.grad.clone(), wide_mm.accumulated
        torch.autograd.grad(loss(xs[1]), xs[1])
        loss(xs[1]).backward(inputs=[xs[1]])
        assert torch.equal(lin.weight.grad, first) and wide_mm.accumulated == before
        loss(xs[1]).backward(create_graph=True)
        assert wide_mm.accumulated == before and wide_mm._ok["addmm"]
        second = lin.weight.grad.detach().clone()
        lin.weight.grad = second.clone()  # a plain .grad again (create_graph made it part of a graph)
        handle = lin.weight.register_hook(lambda g: g * 0.5)
        loss(xs[2]).backward()
        handle.remove()
        assert wide_mm.accumulated == before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        third = torch.autograd.grad(lin(xs[2]).float().square().sum(), lin.weight)[0]
    torch.testing.assert_close(lin.weight.grad, second + 0.5 * third, rtol=1e-6, atol=1e-6)
