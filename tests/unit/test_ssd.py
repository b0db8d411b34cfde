"""Mamba-2's SSD: the chunked PyTorch op against the sequential float64 recurrence (forward, final state and every
gradient) at odd shapes, document boundaries (seq_idx) equal to running each document alone, the document-aware
causal conv, low precision and the shape checks."""

from __future__ import annotations

import pytest
import torch

from anytrain.kernels import causal_conv1d
from anytrain.kernels.reference import ssd_scan_ref
from anytrain.kernels.ssd import causal_conv1d_documents, segment_sum, ssd_chunk_scan

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


def inputs(b: int, L: int, h: int, p: int, g: int, n: int, seed: int = 0, dtype=torch.float64, d_per_channel=False):
    """Random SSD arguments that require gradients: A < 0, dt around softplus's knee, D per head (or per channel)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=dtype)).requires_grad_()

    return {
        "x": randn(b, L, h, p),
        "dt": randn(b, L, h),
        "A": (-0.2 - 1.5 * torch.rand(h, generator=gen, dtype=dtype)).requires_grad_(),
        "B": randn(b, L, g, n),
        "C": randn(b, L, g, n),
        "D": randn(h, p) if d_per_channel else randn(h),
        "z": randn(b, L, h, p),
        "dt_bias": randn(h, scale=0.5),
    }


def run_both(args: dict, chunk: int, **kw) -> tuple[tuple, tuple]:
    """(y, final state, gradients of every input) of the chunked op and of the sequential reference, for one random
    cotangent of y and of the final state."""
    xs = [args[k] for k in ("x", "dt", "A", "B", "C")]
    rest = {k: args[k] for k in ("D", "z", "dt_bias")}
    out = []
    for y, state in (ssd_chunk_scan(*xs, chunk, **rest, **kw), ssd_scan_ref(*xs, **rest, **kw)):
        gen = torch.Generator().manual_seed(7)
        gy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
        gs = torch.randn(state.shape, generator=gen, dtype=state.dtype)
        grads = torch.autograd.grad((y * gy).sum() + (state * gs).sum(), [args[k] for k in NAMES])
        out.append((y, state, grads))
    return out[0], out[1]


def assert_same(chunked, reference, atol=1e-10):
    torch.testing.assert_close(chunked[0], reference[0], rtol=0, atol=atol)
    torch.testing.assert_close(chunked[1], reference[1], rtol=0, atol=atol)
    for name, got, expected in zip(NAMES, chunked[2], reference[2], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize(
    ("L", "chunk", "h", "g"),
    [
        (1, 4, 2, 1),  # one position
        (2, 4, 3, 1),  # shorter than a chunk, odd head count
        (3, 2, 4, 2),  # one full and one partial chunk, two groups
        (11, 4, 6, 3),  # not a multiple of the chunk, three groups of two heads
        (12, 4, 5, 1),  # a multiple of the chunk, five heads
        (9, 1, 2, 2),  # chunks of one position (all state passing)
        (7, 16, 2, 1),  # one padded chunk longer than the sequence
    ],
)
def test_chunked_equals_the_recurrence_forward_and_every_gradient(L, chunk, h, g):
    args = inputs(2, L, h, 3, g, 5, seed=L)
    chunked, reference = run_both(args, chunk, dt_softplus=True, return_final_states=True)
    assert chunked[0].shape == (2, L, h, 3) and chunked[1].shape == (2, h, 3, 5)
    assert_same(chunked, reference)


def test_initial_states_options_and_per_channel_skip():
    """Without softplus or dt_bias, without z, with D per (head, channel) and a given initial state (whose gradient
    is checked too)."""
    args = inputs(2, 10, 4, 3, 2, 6, seed=3, d_per_channel=True)
    with torch.no_grad():
        args["dt"].abs_().mul_(0.3)  # dt itself positive without softplus
    init = torch.randn(2, 4, 3, 6, dtype=torch.float64, requires_grad=True)
    results = []
    for fn in (ssd_chunk_scan, ssd_scan_ref):
        extra = (4,) if fn is ssd_chunk_scan else ()
        y, state = fn(
            *(args[k] for k in ("x", "dt", "A", "B", "C")),
            *extra,
            D=args["D"],
            initial_states=init,
            return_final_states=True,
        )
        grads = torch.autograd.grad(y.square().sum() + state.sum(), [init, args["x"], args["A"], args["D"]])
        results.append((y, state, grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-10)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-10)
    for got, expected in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_the_chunk_size_does_not_change_the_result():
    args = inputs(1, 20, 2, 4, 1, 3, seed=5)
    xs = [args[k] for k in ("x", "dt", "A", "B", "C")]
    ys = [ssd_chunk_scan(*xs, chunk, D=args["D"], dt_bias=args["dt_bias"], dt_softplus=True) for chunk in (1, 3, 8, 64)]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=0, atol=1e-11)


def documents_alone(args: dict, bounds: list[tuple[int, int]], chunk: int) -> torch.Tensor:
    """Row 0 of the batch with each [start, end) document run through the op on its own, concatenated."""
    parts = []
    for start, end in bounds:
        piece = {k: (v[:1, start:end] if v.dim() >= 3 else v) for k, v in args.items()}
        parts.append(
            ssd_chunk_scan(
                *(piece[k] for k in ("x", "dt", "A", "B", "C")),
                chunk,
                D=piece["D"],
                z=piece["z"],
                dt_bias=piece["dt_bias"],
                dt_softplus=True,
            )
        )
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("chunk", [1, 3, 4, 32])
def test_document_boundaries_equal_each_document_alone(chunk):
    """seq_idx resets the state at every document start, inside a chunk and on a chunk boundary: each document's
    outputs (and the gradients into it) equal that document run alone; the reference recurrence agrees."""
    L, bounds = 13, [(0, 4), (4, 5), (5, 12), (12, 13)]  # boundaries at 4 (a chunk edge for chunk 4), 5, 12
    args = inputs(2, L, 4, 3, 2, 5, seed=11)
    seq_idx = torch.zeros(2, L, dtype=torch.long)
    for i, (start, end) in enumerate(bounds):
        seq_idx[0, start:end] = 10 + i  # ids need only change at a boundary
    rest = {k: args[k] for k in ("D", "z", "dt_bias")}
    xs = [args[k] for k in ("x", "dt", "A", "B", "C")]
    y, state = ssd_chunk_scan(*xs, chunk, **rest, dt_softplus=True, seq_idx=seq_idx, return_final_states=True)
    alone = documents_alone(args, bounds, chunk)
    torch.testing.assert_close(y[:1], alone, rtol=0, atol=1e-11)
    y_ref, state_ref = ssd_scan_ref(*xs, **rest, dt_softplus=True, seq_idx=seq_idx, return_final_states=True)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=0, atol=1e-10)
    # row 1 is one document: the same as no seq_idx
    torch.testing.assert_close(
        y[1:],
        ssd_chunk_scan(
            *(t[1:] for t in xs[:2]),
            xs[2],
            *(t[1:] for t in xs[3:]),
            chunk,
            D=rest["D"],
            z=rest["z"][1:],
            dt_bias=rest["dt_bias"],
            dt_softplus=True,
        ),
        rtol=0,
        atol=1e-11,
    )
    # gradients: the first document's outputs do not depend on the later documents' inputs
    grads = torch.autograd.grad(y[0, :4].sum(), [args["x"], args["B"], args["dt"]], retain_graph=True)
    for grad in grads:
        assert grad[0, 4:].abs().max() == 0 and grad[0, :4].abs().max() > 0
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    got = torch.autograd.grad((y * gy).sum(), [args[k] for k in NAMES])
    ref = ssd_scan_ref(*xs, **rest, dt_softplus=True, seq_idx=seq_idx)
    expected = torch.autograd.grad((ref * gy).sum(), [args[k] for k in NAMES])
    for name, a, b in zip(NAMES, got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_segment_sum_is_the_sum_over_each_segment():
    a = torch.tensor([0.5, -1.0, 2.0, -0.25], dtype=torch.float64)
    seg = segment_sum(a)
    for row in range(4):
        for col in range(4):
            expected = a[col + 1 : row + 1].sum() if col <= row else float("-inf")
            assert seg[row, col] == expected, (row, col)


def test_low_precision_inputs_compute_in_fp32():
    """bf16 inputs: the output is bf16 and equals the fp32 computation on the same (rounded) values to bf16's
    precision; the final state is fp32."""
    args = {k: v.detach().to(torch.bfloat16) for k, v in inputs(2, 10, 4, 8, 1, 4, seed=2).items()}
    xs = [args[k] for k in ("x", "dt", "A", "B", "C")]
    y, state = ssd_chunk_scan(*xs, 4, D=args["D"], dt_bias=args["dt_bias"], dt_softplus=True, return_final_states=True)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    y32 = ssd_chunk_scan(
        *(t.float() for t in xs), 4, D=args["D"].float(), dt_bias=args["dt_bias"].float(), dt_softplus=True
    )
    torch.testing.assert_close(y.float(), y32, rtol=2e-2, atol=2e-2)


def test_document_conv_equals_each_document_alone():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)
    weight, bias = (
        torch.randn(5, 4, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    )
    one = torch.zeros(2, 11, dtype=torch.long)
    torch.testing.assert_close(
        causal_conv1d_documents(x, weight, bias, one, "silu"),
        causal_conv1d(x, weight, bias, "silu"),
        rtol=0,
        atol=1e-12,
    )
    bounds = [(0, 2), (2, 3), (3, 9), (9, 11)]  # documents shorter than the conv width too
    seq_idx = torch.cat([torch.full((end - start,), i) for i, (start, end) in enumerate(bounds)]).expand(2, -1)
    got = causal_conv1d_documents(x, weight, bias, seq_idx, None)
    alone = torch.cat([causal_conv1d(x[..., s:e], weight, bias, None) for s, e in bounds], dim=-1)
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-12)
    assert causal_conv1d_documents(x.float(), weight.float(), None, seq_idx, "silu").dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.zeros(2, 5, 4)}, "x must be"),
        ({"B": torch.zeros(2, 5, 3, 2)}, "B must be"),
        ({"dt": torch.zeros(2, 5, 3)}, "dt must have shape"),
        ({"A": torch.zeros(2)}, "A must have shape"),
        ({"D": torch.zeros(3, 4)}, "D must have shape"),
        ({"seq_idx": torch.zeros(2, 4, dtype=torch.long)}, "seq_idx must have shape"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
    ],
)
def test_bad_shapes_are_one_clear_error(change, message):
    args = {
        "x": torch.zeros(2, 5, 4, 3),
        "dt": torch.zeros(2, 5, 4),
        "A": torch.zeros(4),
        "B": torch.zeros(2, 5, 2, 6),
        "C": torch.zeros(2, 5, 2, 6),
        "chunk_size": 4,
        **change,
    }
    with pytest.raises(ValueError, match=rf"^ssd_chunk_scan: {message}"):
        ssd_chunk_scan(**args)
