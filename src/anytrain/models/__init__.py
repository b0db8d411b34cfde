"""Model registry: architecture name -> ModelSpec (args class, named flavours, builder, parallelize plan).

Every model built here is a single-device ``nn.Module`` satisfying ``protocol.LanguageModel``; each family lives in
``models/<family>/`` (``model.py`` the module, ``parallelize.py`` its plans). New families register a ModelSpec in
``REGISTRY``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from anytrain import kernels
from anytrain.config import KernelsConfig, ModelConfig, from_dict
from anytrain.errors import ConfigError
from anytrain.models import hf, hybrid, llama, mamba, mamba2
from anytrain.models.hybrid import HYBRID_FLAVOURS, Hybrid, HybridArgs
from anytrain.models.llama import TRANSFORMER_FLAVOURS, Transformer, TransformerArgs
from anytrain.models.mamba import MAMBA_FLAVOURS, Mamba, MambaArgs, MambaBlock, MambaMixer
from anytrain.models.mamba2 import MAMBA2_FLAVOURS, Mamba2, Mamba2Args
from anytrain.models.protocol import LanguageModel, ModelSpec, ParallelizePlan

__all__ = [
    "HYBRID_FLAVOURS",
    "MAMBA2_FLAVOURS",
    "MAMBA_FLAVOURS",
    "REGISTRY",
    "TRANSFORMER_FLAVOURS",
    "Hybrid",
    "HybridArgs",
    "LanguageModel",
    "Mamba",
    "Mamba2",
    "Mamba2Args",
    "MambaArgs",
    "MambaBlock",
    "MambaMixer",
    "ModelSpec",
    "ParallelizePlan",
    "Transformer",
    "TransformerArgs",
    "args_dict",
    "build_model",
    "configure_kernels",
    "get_spec",
    "list_flavours",
    "register",
    "resolve_args",
    "spec_of",
]

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec for spec in (llama.SPEC, mamba.SPEC, mamba2.SPEC, hybrid.SPEC, hf.SPEC)
}


def register(spec: ModelSpec) -> None:
    REGISTRY[spec.name] = spec


def get_spec(arch: str) -> ModelSpec:
    if arch not in REGISTRY:
        raise ConfigError(f"model.arch: unknown architecture {arch!r}; choose from {', '.join(sorted(REGISTRY))}")
    return REGISTRY[arch]


def spec_of(model: nn.Module) -> ModelSpec:
    """The registry entry of a built model or of one of its pipeline stages."""
    for spec in REGISTRY.values():
        if spec.owns(model):
            return spec
    raise ConfigError(f"{type(model).__name__} is not a registered model family ({', '.join(sorted(REGISTRY))})")


def resolve_args(cfg: ModelConfig) -> Any:
    """Flavour defaults + ``model.args`` overrides -> validated args dataclass of the family (or the family's own
    ``ModelSpec.resolve_args``)."""
    spec = get_spec(cfg.arch)
    if spec.resolve_args is not None:
        return spec.resolve_args(cfg)
    if cfg.flavour not in spec.flavours:
        raise ConfigError(
            f"model.flavour: unknown flavour {cfg.flavour!r} for {cfg.arch}; choose from {', '.join(spec.flavours)}"
        )
    merged = {**spec.flavours[cfg.flavour], **cfg.args}
    args = from_dict(spec.args_cls, merged, prefix="model.args.")
    args.validate()
    return args


def build_model(cfg: ModelConfig) -> nn.Module:
    return get_spec(cfg.arch).build(resolve_args(cfg))


def configure_kernels(cfg: KernelsConfig) -> None:
    """Set the process-wide options of the kernels the families' models call (``RunConfig.kernels``: backend,
    deterministic scan gradients, the fused Mamba mixer, the weight-cast cache, GEMM accumulation) before a model is
    built and compiled."""
    kernels.configure(cfg)


def list_flavours() -> dict[str, list[str]]:
    return {name: list(spec.flavours) for name, spec in REGISTRY.items()}


def args_dict(args: Any) -> dict[str, Any]:
    return dataclasses.asdict(args)
