"""Mamba-1 language model: the single-device model (``model``) and its parallelize plans."""

from anytrain.models.mamba.model import MAMBA_FLAVOURS, Mamba, MambaArgs, MambaBackbone, MambaBlock, MambaMixer, spec

__all__ = ["MAMBA_FLAVOURS", "Mamba", "MambaArgs", "MambaBackbone", "MambaBlock", "MambaMixer", "spec"]
