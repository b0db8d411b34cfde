"""Llama-style decoder-only Transformer: the single-device model (``model``) and how it is parallelized
(``parallelize``); ``SPEC`` is its registry entry ("transformer")."""

from anytrain.models.llama.model import (
    TRANSFORMER_FLAVOURS,
    Attention,
    FeedForward,
    Linear,
    Transformer,
    TransformerArgs,
    TransformerBlock,
    apply_rope,
    rope_tables,
)
from anytrain.models.llama.parallelize import PLAN
from anytrain.models.protocol import ModelSpec

SPEC = ModelSpec("transformer", TransformerArgs, Transformer, TRANSFORMER_FLAVOURS, PLAN)

__all__ = [
    "SPEC",
    "TRANSFORMER_FLAVOURS",
    "Attention",
    "FeedForward",
    "Linear",
    "Transformer",
    "TransformerArgs",
    "TransformerBlock",
    "apply_rope",
    "rope_tables",
]
