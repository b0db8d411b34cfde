"""Pure-PyTorch ground truth for the Mamba kernels (selective scan, causal depthwise conv1d).

Same signatures and semantics as mamba-ssm's ``selective_scan_ref`` / ``causal_conv1d_ref``. Everything is computed
in float32 (float64 when any input is float64) and autograd differentiates straight through, so these double as the
CPU backend and as the reference the Triton kernels are tested against.
"""

from __future__ import annotations

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
) -> Tensor | tuple[Tensor, Tensor]:
    """Sequential selective scan. u, delta, z: (batch, dim, L); A: (dim, dstate); B, C: (batch, [ngroups,] dstate, L).

    Returns out (batch, dim, L) in u's dtype, plus last_state (batch, dim, dstate) when ``return_last_state``.
    """
    dtype_in = u.dtype
    ct = _compute_dtype(u, delta, A, B, C, D, z, delta_bias)
    batch, dim, seqlen = u.shape
    u_c = u.to(ct)
    dt = delta.to(ct)
    if delta_bias is not None:
        dt = dt + delta_bias.to(ct)[None, :, None]
    if delta_softplus:
        dt = F.softplus(dt)
    Bx = _expand_groups(B.to(ct), dim)  # (batch, dim, dstate, L)
    Cx = _expand_groups(C.to(ct), dim)
    A_c = A.to(ct)
    delta_a = torch.exp(torch.einsum("bdl,dn->bdln", dt, A_c))  # (batch, dim, L, dstate)
    delta_bu = torch.einsum("bdl,bdnl,bdl->bdln", dt, Bx, u_c)
    h = u_c.new_zeros(batch, dim, A.shape[1])  # (batch, dim, dstate)
    ys = []
    for t in range(seqlen):
        h = delta_a[:, :, t] * h + delta_bu[:, :, t]
        ys.append(torch.einsum("bdn,bdn->bd", h, Cx[:, :, :, t]))
    y = torch.stack(ys, dim=2) if ys else u_c.new_zeros(batch, dim, 0)  # (batch, dim, L)
    out = y if D is None else y + u_c * D.to(ct)[None, :, None]
    if z is not None:
        out = out * F.silu(z.to(ct))
    out = out.to(dtype_in)
    return (out, h) if return_last_state else out


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
