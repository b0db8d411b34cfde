"""Model registry: architecture name -> ModelSpec (args class, named flavours, builder).

Every model built here is a single-device ``nn.Module`` exposing ``num_params(exclude_embedding=...)``,
``flops_per_token(seq_len)``, ``blocks()`` (the repeated units parallelism wraps), ``init_weights()`` and
``generate(...)``. New families register a ModelSpec in ``REGISTRY``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from anytrain.config import ModelConfig, from_dict
from anytrain.errors import ConfigError
from anytrain.models.llama.model import Transformer, TransformerArgs


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args_cls: type
    build: Callable[[Any], nn.Module]
    flavours: dict[str, dict[str, Any]] = field(default_factory=dict)


TRANSFORMER_FLAVOURS: dict[str, dict[str, Any]] = {
    # For unit and multi-process tests: builds and steps in milliseconds.
    "debug": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256),
    # The CPU demo model (~7M parameters with an 8k vocabulary).
    "tiny": dict(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=512),
    "125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_dim=2048, max_seq_len=4096),
    "350m": dict(vocab_size=32000, dim=1024, n_layers=24, n_heads=16, ffn_dim=2816, max_seq_len=4096),
    # TinyLlama-1.1B shape: the reference shape of the throughput benchmarks.
    "1.1b": dict(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, max_seq_len=4096),
    "llama-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096),
}

REGISTRY: dict[str, ModelSpec] = {
    "transformer": ModelSpec("transformer", TransformerArgs, Transformer, TRANSFORMER_FLAVOURS),
}


def register(spec: ModelSpec) -> None:
    REGISTRY[spec.name] = spec


def get_spec(arch: str) -> ModelSpec:
    if arch not in REGISTRY:
        raise ConfigError(f"model.arch: unknown architecture {arch!r}; choose from {', '.join(sorted(REGISTRY))}")
    return REGISTRY[arch]


def resolve_args(cfg: ModelConfig) -> Any:
    """Flavour defaults + ``model.args`` overrides -> validated args dataclass of the family."""
    spec = get_spec(cfg.arch)
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


def list_flavours() -> dict[str, list[str]]:
    return {name: list(spec.flavours) for name, spec in REGISTRY.items()}


def args_dict(args: Any) -> dict[str, Any]:
    return dataclasses.asdict(args)


def _register_builtin() -> None:
    from anytrain.models.mamba.model import spec as mamba_spec

    register(mamba_spec())


_register_builtin()
