"""Pass / fail thresholds of ``anytrain doctor``: defaults, a YAML or JSON file (``--thresholds FILE``) and
``--threshold NAME=VALUE`` flags, applied in that order. A threshold of 0 turns its check off."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from anytrain.errors import ConfigError


@dataclass
class Thresholds:
    busbw_min_gb_per_s: float = 0.0
    """all_reduce bus bandwidth at the largest swept message must reach this (GB/s); 0 = no floor."""
    p2p_latency_max_us: float = 0.0
    """Every ordered rank pair's small-message latency (half a ping-pong) must stay at or below this (µs); 0 = off."""
    p2p_bandwidth_min_gb_per_s: float = 0.0
    """Every ordered rank pair's large-message bandwidth must reach this (GB/s); 0 = off."""
    gemm_min_fraction: float = 0.35
    """Every rank's bf16 matmul rate must reach this fraction of its device's dense peak (hardware's table; measured
    fractions: bench/results/doctor_*.json); skipped on CPU and on GPUs without a peak."""
    loss_rtol: float = 0.02
    """Tiny trainings: each rank's one-device losses against rank 0's, and the all-rank run's losses against the
    one-device run's, per step, relative difference at most this."""
    resume_rtol: float = 1e-3
    """Kill-restart: the resumed run's losses against the uninterrupted run's, per step, relative difference."""
    min_loss_drop: float = 0.1
    """Tiny trainings: the loss must fall by at least this fraction of its first value over the run."""


def names() -> list[str]:
    return [f.name for f in dataclasses.fields(Thresholds)]


def _set(thresholds: Thresholds, name: str, value: object, where: str) -> None:
    if name not in names():
        raise ConfigError(f"{where}: unknown threshold {name!r}; known: {', '.join(names())}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: threshold {name} must be a number, got {value!r}") from None
    if number < 0 or number != number:
        raise ConfigError(f"{where}: threshold {name} must be >= 0, got {value!r}")
    setattr(thresholds, name, number)


def load_thresholds(path: str | None = None, overrides: list[str] | None = None) -> Thresholds:
    """Defaults, then the mapping in ``path`` (YAML or JSON), then ``NAME=VALUE`` overrides."""
    thresholds = Thresholds()
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--thresholds: {file} not found")
        try:
            data = json.loads(file.read_text()) if file.suffix == ".json" else yaml.safe_load(file.read_text())
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(
                f"--thresholds: {file} is not valid {file.suffix[1:] or 'YAML'}: {str(exc).splitlines()[0]}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"--thresholds: {file} must hold a mapping of threshold names to numbers")
        for name, value in data.items():
            _set(thresholds, str(name), value, f"--thresholds {file}")
    for item in overrides or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--threshold {item!r}: expected NAME=VALUE, e.g. busbw_min_gb_per_s=150")
        _set(thresholds, name.strip(), value.strip(), "--threshold")
    return thresholds
