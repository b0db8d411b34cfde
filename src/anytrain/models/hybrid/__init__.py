"""Hybrid Mamba-2 + attention language model: the single-device model (``model``), how it is parallelized
(``parallelize``) and its Hugging Face mapping (``hf``: ``BambaForCausalLM``); ``SPEC`` is its registry entry
("hybrid")."""

from anytrain.models.hybrid.model import (
    HYBRID_FLAVOURS,
    AttentionLayer,
    Hybrid,
    HybridArgs,
    HybridBackbone,
    MambaLayer,
    MLPLayer,
    bamba_pattern,
)
from anytrain.models.hybrid.parallelize import PLAN, HybridStage
from anytrain.models.protocol import ModelSpec

SPEC = ModelSpec("hybrid", HybridArgs, Hybrid, HYBRID_FLAVOURS, PLAN)

__all__ = [
    "HYBRID_FLAVOURS",
    "SPEC",
    "AttentionLayer",
    "Hybrid",
    "HybridArgs",
    "HybridBackbone",
    "HybridStage",
    "MLPLayer",
    "MambaLayer",
    "bamba_pattern",
]
