"""Mamba-2's SSD (state space duality) op, and the causal conv of its mixer under document boundaries.

``ssd_chunk_scan`` has the arguments of mamba-ssm's ``mamba_chunk_scan_combined`` (without its dt_limit and
cu_seqlens); ``kernels.reference.ssd_scan_ref`` is the same function as a one-step-at-a-time recurrence, the ground
truth of the tests. ``ssd_chunk_scan`` runs the Triton kernels (``kernels.ssd_triton``) for GPU tensors and
``ssd_chunk_scan_torch`` otherwise, by ``ops``' backend rule (``kernels.backend``); the latter is the chunked algorithm
of the Mamba-2 paper in PyTorch (differentiated by autograd), the twin the Triton kernels are tested against.

Shapes: b batch, L sequence, h heads, p headdim, g groups (h = g·r, head h reads group h // r), n dstate; the
chunked form cuts L into c chunks of Q = chunk_size positions (l and s index positions inside a chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from anytrain.kernels import ops
from anytrain.kernels.ops import causal_conv1d
from anytrain.kernels.reference import _compute_dtype


def ssd_chunk_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-2's selective SSM with a scalar decay per head, over a whole sequence.

    x, z: (b, L, h, p); dt: (b, L, h); A, dt_bias: (h,); B, C: (b, L, g, n) with h a multiple of g; D: (h,) or
    (h, p); seq_idx: (b, L) integer document ids (a change between t - 1 and t starts a new document at t from an
    empty state; ``data.document_mask``); initial_states: (b, h, p, n), the state before position 0 (it belongs to
    the first document). With Δ = softplus(dt + dt_bias) when ``dt_softplus`` (else dt + dt_bias), per head::

        h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t^T,   y_t = h_t C_t + D x_t,   y_t * silu(z_t) when z is given

    Returns y (b, L, h, p) in x's dtype [, the state after the last position (b, h, p, n), fp32 (fp64 for fp64
    inputs)]. Computed in fp32 (fp64 when an input is fp64). ``chunk_size`` (Q) trades the intra-chunk quadratic
    work (b·h·L·Q) against the number of sequential chunk steps (L / Q); the result does not depend on it.

    GPU tensors run the Triton kernels (``kernels.ssd_triton``: fp32 accumulation, matmul operands in the inputs'
    dtype, so bf16 / fp16 inputs use the tensor cores), CPU tensors ``ssd_chunk_scan_torch`` (``kernels.backend``).
    """
    _check_shapes(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, initial_states)
    if x.shape[1] > 0 and ops._use_triton(x):
        return ops._triton_modules()[2].ssd_chunk_scan_triton(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, seq_idx, initial_states, return_final_states
        )
    return ssd_chunk_scan_torch(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, seq_idx, initial_states, return_final_states
    )


def _check_shapes(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    seq_idx: Tensor | None,
    initial_states: Tensor | None,
) -> None:
    """One ValueError naming the argument whose shape does not fit x (b, L, h, p)."""
    if x.dim() != 4:
        raise ValueError(f"ssd_chunk_scan: x must be (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
    b, L, h, p = x.shape
    if B.dim() != 4 or B.shape[:2] != (b, L) or h % B.shape[2] != 0:
        raise ValueError(
            f"ssd_chunk_scan: B must be (batch, seqlen, ngroups, dstate) with nheads {h} a multiple of "
            f"ngroups, got {tuple(B.shape)} for x {tuple(x.shape)}"
        )
    expected = {
        "dt": (dt, (b, L, h)),
        "A": (A, (h,)),
        "C": (C, tuple(B.shape)),
        "z": (z, (b, L, h, p)),
        "dt_bias": (dt_bias, (h,)),
        "seq_idx": (seq_idx, (b, L)),
        "initial_states": (initial_states, (b, h, p, B.shape[3])),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"ssd_chunk_scan: {name} must have shape {shape}, got {tuple(tensor.shape)}")
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ValueError(f"ssd_chunk_scan: D must have shape ({h},) or ({h}, {p}), got {tuple(D.shape)}")
    if chunk_size < 1:
        raise ValueError(f"ssd_chunk_scan: chunk_size must be >= 1, got {chunk_size}")


def segment_sum(a: Tensor) -> Tensor:
    """(..., Q) log-decays -> (..., Q, Q): [l, s] = a_{s+1} + ... + a_l for s <= l (0 on the diagonal), -inf above
    it. Each entry is summed directly (a masked cumulative sum), not taken as a difference of running sums, which
    would cancel badly once the running sum is large; exp of it is the decay from position s to position l."""
    Q = a.shape[-1]
    on_or_below = torch.ones(Q, Q, dtype=torch.bool, device=a.device).tril()  # [l, s]: s <= l
    below = on_or_below.tril(-1)  # [k, s]: k > s
    terms = a[..., :, None].expand(*a.shape, Q).masked_fill(~below, 0.0)  # [k, s] = a_k where k > s
    sums = terms.cumsum(dim=-2)  # [l, s] = sum of a_k over s < k <= l
    return sums.masked_fill(~on_or_below, float("-inf"))


@torch.compiler.disable
def ssd_chunk_scan_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``ssd_chunk_scan`` in PyTorch: the Mamba-2 paper's chunked algorithm (its "minimal SSD").

    The sequence is zero-padded to c·Q positions (Δ = 0 there: decay 1, no input, so the last state is unchanged).
    With a_t = Δ_t·A the log-decay of step t, (1) inside each chunk y is a masked quadratic form, y_l =
    sum_{s<=l} (C_l·B_s) exp(a_{s+1} + ... + a_l) Δ_s x_s (``segment_sum``); (2) each chunk's end state from a zero
    start is sum_s exp(a_{s+1} + ... + a_{Q-1}) Δ_s x_s B_s^T; (3) the state entering each chunk is passed along
    the c chunks, h_in[c+1] = exp(sum of the chunk's a) h_in[c] + end state[c]; (4) each position adds the entering
    state's contribution, exp(a_0 + ... + a_l) h_in C_l. Document starts (seq_idx changes) set a_t = -inf: every
    decay across one is exp(-inf) = 0, so no state crosses it, inside a chunk or between chunks, and the gradient
    through those entries is exactly zero.

    It runs eagerly inside compiled code (``torch.compiler.disable``: a graph break around it): inductor's code
    generation for the chunk-wise cumulative sums fails at some real shapes (a block of the 1.3b flavour).
    """
    ct = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r, Q = h // g, chunk_size
    c = max(1, -(-L // Q))
    delta = dt.to(ct) if dt_bias is None else dt.to(ct) + dt_bias.to(ct)
    delta = F.softplus(delta) if dt_softplus else delta  # (b, L, h)
    a = delta * A.to(ct)  # (b, L, h): log-decay of each step, <= 0 for A < 0
    if seq_idx is not None and L > 1:
        starts = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0))  # (b, L): True where a document starts (not t=0)
        a = a.masked_fill(starts[..., None], float("-inf"))
    xc = x.to(ct)
    pad = c * Q - L
    a_c = F.pad(a, (0, 0, 0, pad)).view(b, c, Q, g, r).permute(0, 3, 4, 1, 2)  # (b, g, r, c, Q)
    xdt = F.pad(xc * delta[..., None], (0, 0, 0, 0, 0, pad)).view(b, c, Q, g, r, p)  # Δ_s x_s
    B_c = F.pad(B.to(ct), (0, 0, 0, 0, 0, pad)).view(b, c, Q, g, n)
    C_c = F.pad(C.to(ct), (0, 0, 0, 0, 0, pad)).view(b, c, Q, g, n)

    decay = torch.exp(segment_sum(a_c))  # (b, g, r, c, Q, Q): [l, s] decay from s to l, 0 for s > l
    # (1) inside each chunk: C_l·B_s once per group, the decays per head
    scores = torch.einsum("bclgn,bcsgn->bgcls", C_c, B_c)[:, :, None] * decay  # (b, g, r, c, Q, Q)
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", scores, xdt)  # (b, c, Q, g, r, p)
    # (2) each chunk's end state from a zero start: the decays from s to the chunk's last position
    ends = torch.einsum("bcsgn,bgrcs,bcsgrp->bcgrpn", B_c, decay[..., -1, :], xdt)  # (b, c, g, r, p, n)
    # (3) the states entering the chunks, passed along sequentially
    chunk_decay = torch.exp(a_c.sum(-1))  # (b, g, r, c)
    state = (
        xc.new_zeros(b, g, r, p, n, dtype=ct) if initial_states is None else initial_states.to(ct).view(b, g, r, p, n)
    )
    entering = []
    for k in range(c):
        entering.append(state)
        state = chunk_decay[..., k, None, None] * state + ends[:, k]
    # (4) the entering state's contribution at each position: decayed from the chunk start to l
    from_start = torch.exp(torch.cumsum(a_c, dim=-1))  # (b, g, r, c, Q)
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", C_c, torch.stack(entering, dim=1), from_start)
    y = y.reshape(b, c * Q, h, p)[:, :L]
    if D is not None:
        y = y + xc * (D.to(ct)[:, None] if D.dim() == 1 else D.to(ct))
    if z is not None:
        y = y * F.silu(z.to(ct))
    y = y.to(x.dtype)
    return (y, state.reshape(b, h, p, n)) if return_final_states else y


def causal_conv1d_documents(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, seq_idx: Tensor | None = None, activation: str | None = None
) -> Tensor:
    """``kernels.causal_conv1d`` (x: (b, dim, L), weight: (dim, width)) with each output reading only positions of
    its own document (seq_idx: (b, L) integer ids; a tap reaching into an earlier document reads zero, as the
    sequence start does). Without ``seq_idx`` it is the public op (Triton on GPU tensors); with it, ``width``
    masked shifted products summed in PyTorch (computed in fp32, returned in x's dtype)."""
    if seq_idx is None:
        return causal_conv1d(x, weight, bias, activation)
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    ct = _compute_dtype(x, weight, bias)
    xc, w = x.to(ct), weight.to(ct)
    width, L = w.shape[1], x.shape[-1]
    out = xc.new_zeros(xc.shape) if bias is None else bias.to(ct)[:, None].expand_as(xc)
    for back in range(min(width, L)):  # tap width-1-back reads x[t - back]
        same = F.pad(seq_idx[:, back:] == seq_idx[:, : L - back], (back, 0))  # (b, L): t - back in t's document
        shifted = F.pad(xc[..., : L - back], (back, 0))  # (b, dim, L): x[t - back], zero before the start
        out = out + w[:, width - 1 - back, None] * shifted * same[:, None, :].to(ct)
    return (F.silu(out) if activation == "silu" else out).to(x.dtype)
