"""The run config's checks that need more than the config itself, run by every entry point (the CLI verbs, the
Trainer) right after ``anytrain.config.load_config`` and before anything is written: the model's
(``anytrain.models.run_config``) and ``data.seq_len`` against each prepared dataset's shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

from anytrain.data.shards import check_seq_len
from anytrain.models.run_config import resolve_model_config

if TYPE_CHECKING:
    from anytrain.config import RunConfig


def resolve_run_config(cfg: RunConfig) -> RunConfig:
    """Check ``cfg`` against the model registry and the disk (``model.init_from``'s config.json fills ``model.args``
    in place); returns ``cfg``. One ConfigError or DataError naming the field."""
    resolve_model_config(cfg)
    for path in [s["path"] for s in cfg.data.sources] or [cfg.data.path]:
        check_seq_len(path, cfg.data.seq_len)
    return cfg
