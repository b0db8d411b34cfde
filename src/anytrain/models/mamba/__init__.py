"""Mamba-1 language model: the single-device model (``model``) and how it is parallelized (``parallelize``);
``SPEC`` is its registry entry ("mamba")."""

from anytrain.models.mamba.model import MAMBA_FLAVOURS, Mamba, MambaArgs, MambaBackbone, MambaBlock, MambaMixer
from anytrain.models.mamba.parallelize import PLAN, MambaStage
from anytrain.models.protocol import ModelSpec

SPEC = ModelSpec("mamba", MambaArgs, Mamba, MAMBA_FLAVOURS, PLAN)

__all__ = ["MAMBA_FLAVOURS", "SPEC", "Mamba", "MambaArgs", "MambaBackbone", "MambaBlock", "MambaMixer", "MambaStage"]
