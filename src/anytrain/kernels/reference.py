"""Pure-PyTorch ground truth for the Mamba kernels (selective scan, causal depthwise conv1d, Mamba-2's SSD).

Same signatures and semantics as mamba-ssm's ``selective_scan_ref`` / ``causal_conv1d_ref``. Everything is computed
in float32 (float64 when any input is float64) and autograd differentiates straight through, so these double as the
CPU backend and as the reference the Triton kernels are tested against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _expand_groups(x: Tensor, dim: int) -> Tensor:
    """(batch, dstate, L) or (batch, ngroups, dstate, L) -> (batch, dim, dstate, L) (a broadcast view)."""
    if x.dim() == 3:
        return x.unsqueeze(1).expand(-1, dim, -1, -1)
    ngroups = x.shape[1]
    if dim % ngroups != 0:
        raise ValueError(f"selective_scan: dim {dim} is not divisible by ngroups {ngroups}")
    return x.repeat_interleave(dim // ngroups, dim=1)


def _chunk_len(seqlen: int) -> int:
    """Steps per chunk of the two-level scan: the power of two nearest sqrt(seqlen) (2·T + L/T Python steps)."""
    return 1 << max(0, round(math.log2(max(seqlen, 1)) / 2))


def _to_chunks(x: Tensor, T: int) -> Tensor:
    """(..., L) -> (T, ..., nc) contiguous, zero-padded at the end to nc·T steps; [t, ..., c] is step c·T + t."""
    nc = -(-x.shape[-1] // T)
    x = F.pad(x, (0, nc * T - x.shape[-1]))
    return x.unflatten(-1, (nc, T)).movedim(-1, 0).contiguous()


def _from_chunks(x: Tensor, seqlen: int) -> Tensor:
    """Inverse of ``_to_chunks``: (T, ..., nc) -> (..., L)."""
    return x.movedim(0, -1).flatten(-2)[..., :seqlen]


def _scan_loop(dt: Tensor, A: Tensor, dtu: Tensor, Bx: Tensor, Cx: Tensor) -> tuple[Tensor, Tensor]:
    """The plain recurrence, one time step per Python step (the ground truth the chunked form is tested against).

    dt, dtu: (batch, dim, L); A: (dim, dstate); Bx, Cx: (batch, dim, dstate, L). Returns y (batch, dim, L) and the
    states (batch, dim, L, dstate). Its backward is slow: every per-step slice's gradient is a full-size tensor.
    """
    delta_a = torch.exp(torch.einsum("bdl,dn->bdln", dt, A))  # (batch, dim, L, dstate)
    delta_bu = torch.einsum("bdl,bdnl->bdln", dtu, Bx)
    h = dtu.new_zeros(dtu.shape[0], dtu.shape[1], A.shape[1])  # (batch, dim, dstate)
    hs, ys = [], []
    for t in range(dtu.shape[2]):
        h = delta_a[:, :, t] * h + delta_bu[:, :, t]
        hs.append(h)
        ys.append(torch.einsum("bdn,bdn->bd", h, Cx[:, :, :, t]))
    if not hs:
        return dtu.new_zeros(dtu.shape), dtu.new_zeros(*dtu.shape, A.shape[1])
    return torch.stack(ys, dim=2), torch.stack(hs, dim=2)


def _chunk_groups(x: Tensor, dim: int, T: int) -> Tensor:
    """B or C, (batch, dstate, L) or (batch, ngroups, dstate, L) -> (T, batch, dim, nc, dstate), chunked before the
    expansion over channels so that with one group it stays a broadcast view (no dim-sized copy, forward or back)."""
    x = x.unsqueeze(1) if x.dim() == 3 else x
    xc = _to_chunks(x, T).transpose(-1, -2)  # (T, batch, ngroups, nc, dstate)
    if xc.shape[2] == 1:
        return xc
    return xc.repeat_interleave(dim // xc.shape[2], dim=2)


def _scan_chunked(dt: Tensor, A: Tensor, dtu: Tensor, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor]:
    """The same recurrence as ``_scan_loop`` in 2·T + L/T vectorised Python steps instead of L. Returns y
    (batch, dim, L) and the last state (batch, dim, dstate). B, C: (batch, [ngroups,] dstate, L).

    Time is cut into nc chunks of T steps (zero-padded at the end: a = 1, Bu = 0, which changes no earlier step).
    (1) All chunks scan at once from a zero state, one step of every chunk per Python step:
    H_t = exp(dt_t A) H_{t-1} + dt_t B_t u_t; only the chunk-end states H_{T-1} are kept. (2) The state entering
    chunk c, carried sequentially over chunks: h_in[c] = P[c-1] h_in[c-1] + H_{T-1}[c-1], with
    P = exp(A sum_t dt_t) the product of the chunk's decays. (3) All chunks scan again, now from h_in, and
    y_t = <C_t, h_t> is taken at each step. Only products of decays appear (no division, no exp of a difference):
    nothing overflows when dt·A <= 0, and underflow gives exact zeros, as in the loop. Per-step tensors come from
    ``unbind`` (one backward op for all steps) rather than per-step indexing, whose backward writes a full-size zero
    tensor per step.
    """
    seqlen = dt.shape[-1]
    T = _chunk_len(seqlen)
    dt_c, dtu_c = _to_chunks(dt, T)[..., None], _to_chunks(dtu, T)[..., None]  # (T, batch, dim, nc, 1)
    B_c, C_c = _chunk_groups(B, dt.shape[1], T), _chunk_groups(C, dt.shape[1], T)  # (T, batch, dim | 1, nc, dstate)
    A_c = A[:, None, :]  # (dim, 1, dstate)
    a, bu = torch.exp(dt_c * A_c).unbind(0), (dtu_c * B_c).unbind(0)  # T x (batch, dim, nc, dstate)
    h = bu[0]
    for t in range(1, T):  # (1) chunk-end states from zero
        h = torch.addcmul(bu[t], a[t], h)
    decay_end = torch.exp(dt_c.sum(0) * A_c)  # (batch, dim, nc, dstate): P, from small tensors
    carry = [torch.zeros_like(h[:, :, 0])]
    for h_end, p_end in list(zip(h.unbind(2), decay_end.unbind(2), strict=True))[:-1]:  # (2)
        carry.append(torch.addcmul(h_end, p_end, carry[-1]))
    h = torch.stack(carry, dim=2)  # (batch, dim, nc, dstate)
    t_last, c_last = (seqlen - 1) % T, (seqlen - 1) // T
    ys, last = [], None
    for t, (a_t, bu_t, c_t) in enumerate(zip(a, bu, C_c.unbind(0), strict=True)):  # (3)
        h = torch.addcmul(bu_t, a_t, h)
        ys.append((h * c_t).sum(-1))  # (batch, dim, nc)
        if t == t_last:
            last = h[:, :, c_last]
    return _from_chunks(torch.stack(ys), seqlen), last


def selective_scan_ref(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    impl: str = "chunked",
) -> Tensor | tuple[Tensor, Tensor]:
    """Selective scan. u, delta, z: (batch, dim, L); A: (dim, dstate); B, C: (batch, [ngroups,] dstate, L).

    Returns out (batch, dim, L) in u's dtype, plus last_state (batch, dim, dstate) when ``return_last_state``.
    ``impl="chunked"`` (default) runs the recurrence in about 3·sqrt(L) vectorised steps (``_scan_chunked``);
    ``impl="loop"`` is the one-step-at-a-time loop it is tested against (``_scan_loop``; slow backward).
    """
    if impl not in ("chunked", "loop"):
        raise ValueError(f"selective_scan_ref: impl must be 'chunked' or 'loop', got {impl!r}")
    dtype_in = u.dtype
    ct = _compute_dtype(u, delta, A, B, C, D, z, delta_bias)
    batch, dim, seqlen = u.shape
    u_c = u.to(ct)
    dt = delta.to(ct)
    if delta_bias is not None:
        dt = dt + delta_bias.to(ct)[None, :, None]
    if delta_softplus:
        dt = F.softplus(dt)
    B_c, C_c = B.to(ct), C.to(ct)
    if B_c.dim() == 4 and dim % B_c.shape[1] != 0:
        raise ValueError(f"selective_scan: dim {dim} is not divisible by ngroups {B_c.shape[1]}")
    if impl == "loop" or seqlen == 0:
        y, h = _scan_loop(dt, A.to(ct), dt * u_c, _expand_groups(B_c, dim), _expand_groups(C_c, dim))
        last = h[:, :, -1] if seqlen else h.new_zeros(batch, dim, A.shape[1])
    else:
        y, last = _scan_chunked(dt, A.to(ct), dt * u_c, B_c, C_c)
    out = y if D is None else y + u_c * D.to(ct)[None, :, None]
    if z is not None:
        out = out * F.silu(z.to(ct))
    out = out.to(dtype_in)
    return (out, last) if return_last_state else out


def causal_conv1d_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """Causal depthwise conv. x: (batch, dim, L); weight: (dim, width); out_t = sum_k w[k] x[t - (width-1) + k]."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    dtype_in = x.dtype
    ct = _compute_dtype(x, weight, bias)
    dim, width = weight.shape
    seqlen = x.shape[-1]
    out = F.conv1d(
        x.to(ct), weight.to(ct).unsqueeze(1), None if bias is None else bias.to(ct), padding=width - 1, groups=dim
    )[..., :seqlen]
    if activation is not None:
        out = F.silu(out)
    return out.to(dtype_in)


def ssd_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-2's SSD as the plain recurrence, one time step per Python step: the ground truth that
    ``kernels.ssd.ssd_chunk_scan`` (same arguments but ``chunk_size``) is tested against. Slow; for tests.

    x, z: (batch, L, nheads, headdim); dt: (batch, L, nheads); A, dt_bias: (nheads,); B, C: (batch, L, ngroups,
    dstate), head h reading group h // (nheads / ngroups); D: (nheads,) or (nheads, headdim); seq_idx: (batch, L)
    integer document ids; initial_states: (batch, nheads, headdim, dstate). With Δ = softplus(dt + dt_bias) (or
    dt + dt_bias), per head::

        h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t^T      (headdim, dstate)
        y_t = h_t C_t + D x_t,  then y_t * silu(z_t)

    h_{-1} = initial_states (zeros by default); where seq_idx_t != seq_idx_{t-1}, h_{t-1} is taken as zero (a new
    document starts from an empty state). Returns y (batch, L, nheads, headdim) in x's dtype [, the last state
    (batch, nheads, headdim, dstate) in the compute dtype].
    """
    ct = _compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_states)
    batch, seqlen, nheads, headdim = x.shape
    per_group = nheads // B.shape[2]
    delta = dt.to(ct) if dt_bias is None else dt.to(ct) + dt_bias.to(ct)
    delta = F.softplus(delta) if dt_softplus else delta  # (batch, L, nheads)
    Bh = B.to(ct).repeat_interleave(per_group, dim=2)  # (batch, L, nheads, dstate)
    Ch = C.to(ct).repeat_interleave(per_group, dim=2)
    xc = x.to(ct)
    state = x.new_zeros(batch, nheads, headdim, B.shape[3], dtype=ct)
    if initial_states is not None:
        state = initial_states.to(ct)
    ys = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).to(ct)  # (batch,)
            state = state * same[:, None, None, None]
        decay = torch.exp(delta[:, t] * A.to(ct))  # (batch, nheads)
        inject = (delta[:, t, :, None] * xc[:, t])[..., None] * Bh[:, t, :, None, :]  # (batch, nheads, headdim, dstate)
        state = decay[..., None, None] * state + inject
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else xc.new_zeros(xc.shape)  # (batch, L, nheads, headdim)
    if D is not None:
        y = y + xc * (D.to(ct)[:, None] if D.dim() == 1 else D.to(ct))
    if z is not None:
        y = y * F.silu(z.to(ct))
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y
