"""The model of a run directory with a checkpoint's weights (``anytrain eval``, ``anytrain export``): the run's
config.yaml loaded and resolved as at training, the model built and the newest committed checkpoint that loads (or the
one asked for) read into it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from anytrain.checkpoint.dcp import COMMIT_MARKER, Checkpointer, CheckpointUnusable, is_committed
from anytrain.config import load_config
from anytrain.data.resolve import resolve_run_config
from anytrain.errors import RunDirError
from anytrain.models import build_model


def load_run_model(run_dir: str | Path, device: torch.device, checkpoint: str | Path | None = None):
    """(config, model with the newest committed checkpoint's weights, checkpoint path) of a run directory."""
    run_dir = Path(run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise RunDirError(f"{run_dir}: no config.yaml; is this a directory written by `anytrain train`?")
    cfg = resolve_run_config(load_config(config_file))
    model = build_model(cfg.model).to(device)
    state = {"model": get_model_state_dict(model)}
    path = _load_checkpoint(run_dir, state, checkpoint)
    model.load_state_dict(state["model"])
    model.eval()
    return cfg, model, path


def _load_checkpoint(run_dir: Path, state: dict, checkpoint: str | Path | None) -> Path:
    """Load ``checkpoint``, or the newest committed checkpoint that loads (a damaged newest one is named in a warning
    and the previous one used, as on resume); one-line RunDirError when none can be."""
    checkpointer = Checkpointer(run_dir / "checkpoints", 1, True, log=lambda m: print(m, file=sys.stderr))
    if not checkpoint:
        path = checkpointer.load_newest(state)
        if path is None:
            raise RunDirError(f"{run_dir}/checkpoints: no committed checkpoint to evaluate")
        return path
    path = Path(checkpoint)
    if not is_committed(path):
        raise RunDirError(
            f"{path}: not a committed checkpoint (no {COMMIT_MARKER} in it); pass a step_N directory "
            "of the run's checkpoints/"
        )
    try:
        checkpointer.load(path, state)
    except CheckpointUnusable as exc:
        raise RunDirError(f"{path}: cannot be loaded ({exc})") from None
    return path
