"""The run config's model checks that need the family registry or the model's folder, run right after
``anytrain.config.load_config`` (which reads no model code): ``model.hf_path``'s folder, ``model.init_from``'s
config.json into ``model.args``, ``model.args`` through the family's args dataclass, and ``data.seq_len`` against
the model's ``max_seq_len``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from anytrain.config import MAX_SEQ_LEN
from anytrain.config.checks import check_finite, in_range
from anytrain.errors import ConfigError
from anytrain.models import resolve_args
from anytrain.models.conversion import apply_init_from
from anytrain.models.hf import check_run_config

if TYPE_CHECKING:
    from anytrain.config import RunConfig


def resolve_model_config(cfg: RunConfig) -> None:
    """Check (and with ``model.init_from``, fill in) ``cfg.model`` in place; one ConfigError naming the field."""
    if cfg.model.arch == "hf" or cfg.model.hf_path:  # folder checked, layouts hf cannot take refused (models/hf)
        check_run_config(cfg)
    if cfg.model.init_from:  # HF config.json -> model.args (models/conversion.py)
        apply_init_from(cfg)
    args = resolve_args(cfg.model)
    check_finite(dataclasses.asdict(args), "model.args.")
    in_range(args.max_seq_len, "model.args.max_seq_len", 1, MAX_SEQ_LEN)
    if cfg.data.seq_len > args.max_seq_len:
        raise ConfigError(
            f"data.seq_len: {cfg.data.seq_len} exceeds model.args.max_seq_len {args.max_seq_len}; "
            "lower data.seq_len or raise model.args.max_seq_len"
        )
