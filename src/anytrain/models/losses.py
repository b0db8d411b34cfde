"""Language-model losses shared by every model family (no torch.distributed here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from anytrain.kernels.fused_linear_ce import IGNORE_INDEX, linear_cross_entropy

LOSS_IMPLS = ("chunked", "naive")
LOSS_IMPL: str = "chunked"
"""'chunked': fused chunked linear + cross-entropy (what training runs); 'naive': full logits then F.cross_entropy,
the cross-check of tests and benchmarks, which assign this attribute."""


def lm_cross_entropy(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ head_weight.T`` against ``targets`` (ignoring -100).

    hidden: (B, T, D) final normed hidden states; head_weight: (V, D); targets: (B, T) int64. Logits are formed in
    the compute dtype (the autocast dtype when autocast is on) and the softmax is taken in fp32. The default path
    never holds fp32 logits for the whole batch (see ``anytrain.kernels.fused_linear_ce``). Returns an fp32 scalar.
    """
    if LOSS_IMPL not in LOSS_IMPLS:
        raise ValueError(f"losses.LOSS_IMPL must be one of {LOSS_IMPLS}, got {LOSS_IMPL!r}")
    if LOSS_IMPL == "naive":
        logits = F.linear(hidden, head_weight)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # do autocast's cast ourselves: the op below runs with autocast off
        dtype = torch.get_autocast_dtype(device_type)
        hidden, head_weight = hidden.to(dtype), head_weight.to(dtype)
    elif hidden.dtype != head_weight.dtype:
        hidden = hidden.to(head_weight.dtype)
    with torch.autocast(device_type, enabled=False):
        return linear_cross_entropy(hidden, head_weight, targets)
