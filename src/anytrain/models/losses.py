"""Language-model losses shared by every model family (no torch.distributed here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_cross_entropy(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ head_weight.T`` against ``targets``.

    hidden: (B, T, D) final normed hidden states; head_weight: (V, D); targets: (B, T) int64. Logits are formed in
    the compute dtype and the softmax is taken in fp32.
    """
    logits = F.linear(hidden, head_weight)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
