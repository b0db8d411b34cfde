"""Chunked linear + cross-entropy and native-GQA attention on a GPU at real sizes vs fp32 references.

Run on a lent GPU: ``PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_fused_ops_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)

from anytrain.kernels import fused_linear_ce as flce  # noqa: E402
from anytrain.models import losses  # noqa: E402
from anytrain.models.llama import model as transformer  # noqa: E402


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def test_row_kernel_at_vocab_32000():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(4096, 32000, device="cuda", generator=g)).to(torch.bfloat16)
    targets = torch.randint(0, 32000, (4096,), device="cuda", generator=g)
    targets[:7] = flce.IGNORE_INDEX
    scale = torch.tensor([1 / 4089.0], device="cuda")
    ref = logits.float()
    ref_loss = flce.ce_rows_ref(ref, targets, scale)
    grad = logits.clone()
    loss = flce.ce_rows_triton(grad, targets, scale)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    assert _rel_err(grad, ref) < 5e-3  # bf16 rounding of the stored gradient


def test_chunked_linear_ce_at_tinyllama_head():
    """(B=4, T=2048) tokens through the 2048 x 32000 head in bf16, vs F.cross_entropy on fp32 logits of the same
    bf16 inputs; and the peak memory it adds is a fraction of the full-logits path's."""
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(8192, 2048, device="cuda", generator=g).to(torch.bfloat16)
    weight = (0.02 * torch.randn(32000, 2048, device="cuda", generator=g)).to(torch.bfloat16)
    targets = torch.randint(0, 32000, (8192,), device="cuda", generator=g)
    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    ref = F.cross_entropy(h32 @ w32.t(), targets)
    ref.backward()
    del ref
    torch.cuda.synchronize()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = flce.linear_cross_entropy(h, w, targets)
    loss.backward()
    extra_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    torch.testing.assert_close(loss, F.cross_entropy(h32.detach() @ w32.detach().t(), targets), rtol=2e-3, atol=2e-3)
    assert _rel_err(h.grad, h32.grad) < 2e-2 and _rel_err(w.grad, w32.grad) < 2e-2
    assert extra_gib < 1.2, f"chunked loss used {extra_gib:.2f} GiB over its inputs"  # full fp32 logits alone: 0.98


@pytest.mark.parametrize("compile_blocks", [False, True])
def test_native_gqa_matches_expanded_kv(monkeypatch, compile_blocks):
    args = transformer.TransformerArgs(
        vocab_size=1000, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=512, max_seq_len=512
    )
    out = {}
    for native in (False, True):
        monkeypatch.setattr(transformer, "SDPA_NATIVE_GQA", native)
        torch.manual_seed(0)
        model = transformer.Transformer(args).cuda()
        if compile_blocks:
            for block in model.blocks():
                block.compile()
        x = torch.randint(0, 1000, (2, 512), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x.roll(-1, 1))
        loss.backward()
        out[native] = (loss.detach(), model.layers["0"].attention.wk.weight.grad)
        torch._dynamo.reset()
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-2, atol=1e-2)
    assert _rel_err(out[True][1], out[False][1]) < 3e-2


def test_model_loss_paths_agree_under_autocast(monkeypatch):
    args = transformer.TransformerArgs(vocab_size=32000, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=512)
    torch.manual_seed(0)
    model = transformer.Transformer(args).cuda()
    x = torch.randint(0, 32000, (4, 1024), device="cuda")
    got = {}
    for impl in ("naive", "chunked"):
        monkeypatch.setattr(losses, "LOSS_IMPL", impl)
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x.roll(-1, 1))
        loss.backward()
        got[impl] = (loss.detach(), model.output.weight.grad.clone(), model.tok_embeddings.weight.grad.clone())
    torch.testing.assert_close(got["chunked"][0], got["naive"][0], rtol=2e-3, atol=2e-3)
    assert _rel_err(got["chunked"][1], got["naive"][1]) < 2e-2
    assert _rel_err(got["chunked"][2], got["naive"][2]) < 2e-2


@pytest.mark.parametrize("compiled", [False, True])
def test_wide_grad_linear_at_the_ffn_shape(compiled):
    """transformer.Linear under bf16 autocast at the 1.1B FFN shape (16k tokens, 2048 -> 5632): same output and
    input gradient as nn.Linear (autocast), and an fp32 weight gradient at least as close to the fp32 product of the
    same bf16 operands as autocast's bf16 one (here: no bf16 rounding at all), eager and compiled."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8, 2048, 2048, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(8, 2048, 5632, device="cuda", generator=g).to(torch.bfloat16)
    wide, plain = transformer.Linear(2048, 5632, bias=False).cuda(), torch.nn.Linear(2048, 5632, bias=False).cuda()
    plain.weight.data.copy_(wide.weight.data)
    outs = {}
    for name, mod in (("wide", wide), ("plain", plain)):
        fn = torch.compile(mod) if compiled else mod
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xi)
        y.backward(dy)
        outs[name] = (y, xi.grad, mod.weight.grad)
    (y, dx, dw), (y0, dx0, dw0) = outs["wide"], outs["plain"]
    assert dw.dtype == torch.float32
    if compiled:  # inductor may order the same bf16 GEMMs' work differently
        torch.testing.assert_close(y, y0, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(dx, dx0, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(y, y0) and torch.equal(dx, dx0)
    exact = dy.reshape(-1, 5632).float().t() @ x.reshape(-1, 2048).float()
    err, err0 = _rel_err(dw, exact), _rel_err(dw0, exact)
    assert err < 1e-4 and err < err0 / 20, (err, err0)  # H100: 1.9e-5 against autocast's bf16 gradient's 1.7e-3


@pytest.mark.parametrize("compiled", [False, True])
def test_weight_gradients_accumulate_in_the_gemm_on_the_gpu(compiled):
    """Two micro-batches at the FFN shape inside ``wide_mm.accumulate_in_gemm``: the second one's weight gradient is
    summed into ``.grad`` by the GEMM (``addmm`` with an fp32 ``out_dtype``; counted, same storage), eager and from an
    inductor-compiled backward, and the sum matches the fp32 product of the same bf16 operands as closely as one
    GEMM's does."""
    from anytrain.kernels import wide_mm

    g = torch.Generator(device="cuda").manual_seed(4)
    xs = [torch.randn(4, 2048, 2048, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(4, 2048, 5632, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    wide = transformer.Linear(2048, 5632, bias=False).cuda()
    fn = torch.compile(wide) if compiled else wide
    before, ptrs = wide_mm.accumulated, []
    with wide_mm.accumulate_in_gemm():
        for x, dy in zip(xs, dys, strict=True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = fn(x)
            y.backward(dy)
            ptrs.append(wide.weight.grad.data_ptr())
    assert wide_mm.accumulated - before == 1 and ptrs[0] == ptrs[1]
    exact = sum(dy.reshape(-1, 5632).float().t() @ x.reshape(-1, 2048).float() for x, dy in zip(xs, dys, strict=True))
    assert _rel_err(wide.weight.grad, exact) < 1e-4
