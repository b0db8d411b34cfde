"""Llama-style decoder-only Transformer: the single-device model (``model``) and its parallelize plans."""

from anytrain.models.llama.model import (
    Attention,
    FeedForward,
    Linear,
    Transformer,
    TransformerArgs,
    TransformerBlock,
    apply_rope,
    rope_tables,
)

__all__ = [
    "Attention",
    "FeedForward",
    "Linear",
    "Transformer",
    "TransformerArgs",
    "TransformerBlock",
    "apply_rope",
    "rope_tables",
]
