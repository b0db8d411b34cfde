"""The recipe a launched job trains: its default run directory, and the check at submission (not in the queue) that
it loads with the job's overrides."""

from __future__ import annotations

from pathlib import Path

from anytrain.errors import ConfigError


def default_run_dir(config: str) -> str:
    """``runs/<config file name without .yaml>``."""
    return f"runs/{Path(config).stem}"


def control_char(text: str) -> str | None:
    """The first control character of ``text`` (C0 or DEL: what ends or rewrites a script or log line), or None."""
    return next((ch for ch in text if ord(ch) < 32 or ord(ch) == 127), None)


def shown(path: str | Path) -> str:
    """A path for a one-line message: as it is, or as a Python literal when it holds a control character."""
    text = str(path)
    return repr(text) if control_char(text) is not None else text


def load_recipe(config: str, overrides: list[str]):
    """Fail at submission, not in the queue: the recipe must load with the overrides; returns the RunConfig."""
    from anytrain.config import load_config
    from anytrain.data.resolve import resolve_run_config

    if not Path(config).is_file():
        raise ConfigError(f"{shown(config)}: no such config file")
    return resolve_run_config(load_config(config, overrides))
