"""Triton causal conv1d under the CPU interpreter vs the float64 reference: forward and gradients."""

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

from anytrain.kernels.causal_conv1d import ConvConfig, causal_conv1d_triton  # noqa: E402
from anytrain.kernels.reference import causal_conv1d_ref  # noqa: E402

CFG = ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=8, num_warps_bwd=1)
# backward with one program per channel block looping over every (batch, time block): no partials
CFG_ONE_SPLIT = ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=8, num_warps_bwd=1,
                           min_programs_bwd=1)  # fmt: skip
# the same with the backward loop software-pipelined (tl.range num_stages; compiled GPUs only change the schedule)
CFG_PIPELINED = ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=8, num_warps_bwd=1,
                           min_programs_bwd=1, stages_bwd=3)  # fmt: skip

# runs of 8 timesteps per thread in the backward (slots_bwd 8): 2 runs per time block with splits, 1 without
CFG_EIGHT = ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=16, num_warps_bwd=1,
                       slots_bwd=8)  # fmt: skip
CFG_EIGHT_ONE = ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=8, num_warps_bwd=1,
                           min_programs_bwd=1, slots_bwd=8)  # fmt: skip
# 3 splits of 2 iterations over (batch 2 x 3 time blocks) at seqlen 17-24 (19 and 24 below): a split starts in the
# middle of a batch and its next iteration moves on to the next batch (the kernel carries the batch and time block
# between iterations)
CFG_EIGHT_MID = ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=8, num_warps_bwd=1,
                           min_programs_bwd=9, slots_bwd=8)  # fmt: skip


@pytest.mark.parametrize(
    "width,seqlen,has_bias,act",
    [(2, 1, True, "silu"), (3, 7, False, None), (4, 19, True, "silu"), (4, 1, False, None), (2, 9, False, "silu"),
     (3, 16, True, "silu"), (4, 8, True, None), (4, 12, True, "silu"), (4, 24, True, "silu")],
)  # fmt: skip
@pytest.mark.parametrize(
    "cfg",
    [CFG, CFG_ONE_SPLIT, CFG_PIPELINED, CFG_EIGHT, CFG_EIGHT_ONE, CFG_EIGHT_MID],
    ids=["splits", "one-split", "pipelined", "eight", "eight-one-split", "eight-mid-batch"],
)
def test_matches_reference(width, seqlen, has_bias, act, cfg):
    g = torch.Generator().manual_seed(width * 100 + seqlen)
    dim = 5  # not a multiple of block_d
    x = torch.randn(2, dim, seqlen, generator=g, dtype=torch.float64)
    w = torch.randn(dim, width, generator=g, dtype=torch.float64)
    b = torch.randn(dim, generator=g, dtype=torch.float64) if has_bias else None
    ours = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    out = causal_conv1d_triton(*ours, activation=act, config=cfg)
    out_ref = causal_conv1d_ref(*ref, activation=act)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    out_ref.backward(grad)
    for name, a, r in zip(("x", "weight", "bias"), ours, ref, strict=True):
        if a is not None:
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")


def test_noncontiguous_input_and_bf16():
    g = torch.Generator().manual_seed(3)
    xz = torch.randn(1, 8, 11, generator=g)
    x = xz[:, :4]  # (batch, dim, L) view with a batch stride of 8 * 11, as after splitting an in_proj output
    w = torch.randn(4, 4, generator=g)
    out = causal_conv1d_triton(x.to(torch.bfloat16), w.to(torch.bfloat16), None, "silu", config=CFG)
    assert out.dtype == torch.bfloat16
    ref = causal_conv1d_ref(x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double(), None, "silu")
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_rejects_bad_arguments():
    x, w = torch.randn(1, 2, 5), torch.randn(2, 4)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_triton(x, w, activation="relu")
    with pytest.raises(ValueError, match="width"):
        causal_conv1d_triton(x, torch.randn(2, 5))
    with pytest.raises(ValueError, match="slots_bwd"):
        causal_conv1d_triton(x, w, config=ConvConfig(slots_bwd=2))


def test_backward_split_count():
    from anytrain.kernels.causal_conv1d import _bwd_splits

    assert _bwd_splits(CFG_ONE_SPLIT, dim=5, n_iters=6) == (1, 6)  # one program per channel block does it all
    assert _bwd_splits(CFG, dim=5, n_iters=6) == (6, 1)  # 3 channel blocks < 1024 programs: one iteration each
    cfg = ConvConfig(block_d_bwd=4, min_programs_bwd=8)
    assert _bwd_splits(cfg, dim=8, n_iters=7) == (4, 2)  # 2 blocks x 4 splits of ceil(7 / 4) = 2 iterations


@pytest.mark.parametrize("cfg", [CFG, CFG_ONE_SPLIT], ids=["splits", "one-split"])
def test_launchers_take_batch_folded_layouts_and_out(cfg):
    """``_fwd`` / ``_bwd`` on (batch, dim, L) views of a (dim, batch·L) matrix (strides (L, batch·L, 1), the fused
    Mamba op's layout), writing into a given ``out``: bitwise the same as on contiguous tensors; dx keeps x's layout."""
    from anytrain.kernels.causal_conv1d import _bwd, _fwd

    g = torch.Generator().manual_seed(11)
    batch, dim, seqlen = 2, 5, 13

    def folded(t):  # (batch, dim, L) contiguous -> the same values in the (dim, batch·L) layout
        return t.transpose(0, 1).reshape(dim, batch * seqlen).view(dim, batch, seqlen).transpose(0, 1)

    x = torch.randn(batch, dim, seqlen, generator=g, dtype=torch.float64)
    w = torch.randn(dim, 4, generator=g, dtype=torch.float64)
    b = torch.randn(dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, dim, seqlen, generator=g, dtype=torch.float64)
    ref = _fwd(x, w, b, True, cfg)
    out = folded(torch.zeros_like(x))
    assert _fwd(folded(x), w, b, True, cfg, out=out) is out and out.stride() == (seqlen, batch * seqlen, 1)
    assert torch.equal(out, ref)
    dx_ref, dw_ref, db_ref = _bwd(x, w, b, dout, True, cfg)
    dx, dw, db = _bwd(folded(x), w, b, folded(dout), True, cfg)
    assert dx.stride() == (seqlen, batch * seqlen, 1)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref) and torch.equal(db, db_ref)


@pytest.mark.parametrize("seqlen", [19, 24])
@pytest.mark.parametrize("cfg", [CFG_EIGHT_ONE, CFG_EIGHT_MID], ids=["one-split", "mid-batch"])
def test_eight_slot_backward_with_three_different_layouts(seqlen, cfg):
    """x a channel slice of a wider tensor, dout in the (dim, batch·L) layout and dx dense: three different batch
    strides, which the 8-slot backward advances separately when an iteration moves on to the next batch. Bitwise the
    same as on contiguous tensors."""
    from anytrain.kernels.causal_conv1d import _bwd

    g = torch.Generator().manual_seed(seqlen)
    batch, dim = 2, 5
    xz = torch.randn(batch, 2 * dim, seqlen, generator=g, dtype=torch.float64)
    x = xz[:, :dim]
    dout = torch.randn(dim, batch * seqlen, generator=g, dtype=torch.float64).view(dim, batch, seqlen).transpose(0, 1)
    w, b = torch.randn(dim, 4, generator=g, dtype=torch.float64), torch.randn(dim, generator=g, dtype=torch.float64)
    dx, dw, db = _bwd(x, w, b, dout, True, cfg)
    assert len({x.stride(0), dout.stride(0), dx.stride(0)}) == 3
    dx_ref, dw_ref, db_ref = _bwd(x.contiguous(), w, b, dout.contiguous(), True, cfg)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref) and torch.equal(db, db_ref)


def test_fast_sigmoid_only_for_fp32_gpu_tensors_outside_the_interpreter(monkeypatch):
    """The libdevice sigmoid (SILU mode 2) needs a GPU compile: never for CPU tensors, fp64 or the interpreter."""
    from types import SimpleNamespace

    import triton.language as tl

    from anytrain.kernels.causal_conv1d import _silu_mode

    cpu, gpu = torch.empty(1), SimpleNamespace(device=torch.device("cuda", 0))
    assert _silu_mode(False, cpu, tl.float32) == 0
    assert _silu_mode(True, cpu, tl.float32) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _silu_mode(True, gpu, tl.float32) == 2
    assert _silu_mode(True, gpu, tl.float64) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _silu_mode(True, gpu, tl.float32) == 1
