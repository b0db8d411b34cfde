"""Activation checkpointing (``train.activation_checkpointing``): which blocks recompute their activations in
backward, and wrapping them."""

from __future__ import annotations

from torch import nn

from anytrain.errors import ConfigError

AC_POLICIES = ("none", "selective", "full")


def checkpointed_blocks(blocks: list[nn.Module], policy: str) -> list[nn.Module]:
    """The blocks ``train.activation_checkpointing`` recomputes: none, every block (full), or every other block
    starting from the second (selective: torchtitan's layer-level policy with frequency 2, so half of the blocks
    keep their activations and half save only their input)."""
    if policy not in AC_POLICIES:
        raise ConfigError(f"train.activation_checkpointing: expected one of {', '.join(AC_POLICIES)}, got {policy!r}")
    if policy == "none":
        return []
    return list(blocks) if policy == "full" else list(blocks)[1::2]


def apply_activation_checkpointing(model: nn.Module, policy: str = "full") -> None:
    """Recompute the blocks ``policy`` selects in backward (non-reentrant checkpointing; state-dict keys unchanged
    for DCP)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    chosen = {id(b) for b in checkpointed_blocks(model.blocks(), policy)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in chosen:
                parent.register_module(name, checkpoint_wrapper(child, preserve_rng_state=False))
