"""Mamba-2 language model: the single-device model (``model``), how it is parallelized (``parallelize``) and its
Hugging Face mapping (``hf``); ``SPEC`` is its registry entry ("mamba2")."""

from anytrain.models.mamba2.model import (
    MAMBA2_FLAVOURS,
    GatedRMSNorm,
    Mamba2,
    Mamba2Args,
    Mamba2Backbone,
    Mamba2Block,
    Mamba2Mixer,
)
from anytrain.models.mamba2.parallelize import PLAN, Mamba2Stage
from anytrain.models.protocol import ModelSpec

SPEC = ModelSpec("mamba2", Mamba2Args, Mamba2, MAMBA2_FLAVOURS, PLAN)

__all__ = [
    "MAMBA2_FLAVOURS",
    "SPEC",
    "GatedRMSNorm",
    "Mamba2",
    "Mamba2Args",
    "Mamba2Backbone",
    "Mamba2Block",
    "Mamba2Mixer",
    "Mamba2Stage",
]
