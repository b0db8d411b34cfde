"""Typed, validated run configuration: pure data and checks (imports nothing of anytrain but ``errors``).

A run is described by one YAML file with the sections of :mod:`anytrain.config.schema`, plus dotted command-line
overrides (``--train.steps 20 --model.args.n_layers 4``). Loading validates every field against its annotation, every
numeric field's domain and the cross-field rules (:mod:`anytrain.config.checks`), and raises
:class:`~anytrain.errors.ConfigError` naming the field (``train.steps: expected int, got 'ten'``). The checks that need
the model registry or a dataset on disk (the family's args, ``model.init_from``'s config.json, ``data.seq_len`` against
the prepared shards) run right after loading, in ``anytrain.data.resolve.resolve_run_config``. The resolved config
(defaults filled in) is written into the run directory as ``config.yaml``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import yaml

from anytrain.config.checks import (
    GRAD_COMPRESSION_SYNTAX,
    MAX_SEQ_LEN,
    check_document_mask,
    check_fp8,
    check_fsdp_only_options,
    check_grad_compression,
    parse_grad_compression,
    validate,
)
from anytrain.config.schema import (
    BatchPlan,
    CheckpointConfig,
    DataConfig,
    KernelsConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
    WandbConfig,
    from_dict,
    plan_batches,
    to_dict,
)
from anytrain.errors import ConfigError

__all__ = [
    "GRAD_COMPRESSION_SYNTAX",
    "MAX_SEQ_LEN",
    "BatchPlan",
    "CheckpointConfig",
    "DataConfig",
    "KernelsConfig",
    "MetricsConfig",
    "ModelConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RunConfig",
    "TrainConfig",
    "WandbConfig",
    "check_document_mask",
    "check_fp8",
    "check_fsdp_only_options",
    "check_grad_compression",
    "deep_merge",
    "from_dict",
    "load_config",
    "parse_grad_compression",
    "parse_overrides",
    "plan_batches",
    "resolve_data_path",
    "save_config",
    "to_dict",
    "validate",
]


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``['--train.steps', '20', '--model.args.dim=64']`` into a nested dict; values parsed as YAML scalars."""
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"{arg}: expected an override like --section.field VALUE")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key}: missing value")
            raw = args[i + 1]
            i += 2
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = nested
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{key}: conflicts with another override")
        node[parts[-1]] = value
    return nested


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_data_path(path: str) -> str:
    """``data.path`` as an absolute path: a relative one is taken from the current working directory."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML recipe (or start from defaults when ``path`` is None), apply overrides, make ``data.path``
    absolute (relative to the current working directory), validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    data = deep_merge(data, parse_overrides(overrides or []))
    cfg = from_dict(RunConfig, data)
    if not cfg.name:
        cfg.name = path.stem if path is not None else "run"
    cfg.data.path = resolve_data_path(cfg.data.path)
    if cfg.data.sources:
        _resolve_sources(cfg)
    validate(cfg)
    return cfg


def _resolve_sources(cfg: RunConfig) -> None:
    """``data.sources``: each entry a mapping {path, weight[, name]} with weight > 0 and a unique name; paths made
    absolute; ``data.path`` replaced by the first source's."""
    names = []
    for i, entry in enumerate(cfg.data.sources):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
            raise ConfigError(f"{where}: expected a mapping {{path: DIR, weight: W}}, got {entry!r}")
        unknown = sorted(set(entry) - {"path", "weight", "name"})
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown field; valid fields are name, path, weight")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (0 < weight < math.inf):
            raise ConfigError(f"{where}.weight: must be a finite number > 0, got {weight!r}")
        path = resolve_data_path(entry["path"])
        name = str(entry.get("name") or Path(path).name)
        if name in names:
            raise ConfigError(f"{where}.name: {name!r} is already the name of another source; set a unique name")
        names.append(name)
        cfg.data.sources[i] = {"path": path, "weight": float(weight), "name": name}
    cfg.data.path = cfg.data.sources[0]["path"]


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
