"""Weights & Biases sink of the metric records (``metrics.wandb``), rank 0 only; docs/metrics.md.

wandb is imported only when ``metrics.wandb.mode`` is offline or online: :func:`require_wandb` runs before the run
directory is touched, so a missing package is one line with the install hint and exit 2. :class:`WandbSink` logs

- the resolved config (``wandb.config``) and the run's identity under ``anytrain_run`` (run dir, resumed, start step,
  the checkpoint resumed from), updated when the trainer reports a resume;
- every numeric value of every train / eval record (the ones metrics.jsonl and TensorBoard get) as ``KIND/KEY`` at
  the record's step.

Everything wandb writes goes under ``RUN/wandb``: its run folders (``wandb.init(dir=RUN)``, what ``WANDB_DIR=RUN``
would do), and the log of its wandb-core service (``WANDB_CACHE_DIR=RUN/wandb/cache``, set while ``wandb.init``
starts the service). The W&B run id is stored in ``RUN/wandb/run_id`` and reused by every later invocation on the
run dir (``--resume``, ``checkpoint.auto_resume``), so that W&B keeps one run; ``--overwrite`` deletes it with the
rest of the run dir.

Turned off for speed and to keep the run dir the only output: console capture (``console="off"``), code and git
saving, system metrics sampling (``x_disable_stats``), system metadata (``x_disable_meta``), job creation and, in
offline mode, wandb's error reporting (which would reach the network). A failing ``wandb.init`` (online: no login,
no server) stops the start with one line, before the first step; a failing ``wandb.log`` / ``finish`` later is
reported once and W&B logging stops, training goes on (metrics.jsonl keeps every record).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from anytrain.config import to_dict
from anytrain.errors import AnytrainError, ConfigError

if TYPE_CHECKING:
    from anytrain.config import RunConfig, WandbConfig

INSTALL_HINT = "pip install 'anytrain[wandb]'"


def require_wandb(cfg: WandbConfig) -> None:
    """Import wandb when ``cfg.mode`` needs it; a ConfigError with the install hint when it cannot be imported."""
    if cfg.mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"metrics.wandb.mode: {cfg.mode} needs the wandb package ({exc}); {INSTALL_HINT}, or set "
            "--metrics.wandb.mode disabled"
        ) from None


def stored_run_id(run_dir: Path) -> str | None:
    """The W&B run id of earlier invocations on ``run_dir`` (``RUN/wandb/run_id``), or None."""
    path = run_dir / "wandb" / "run_id"
    if not path.is_file():
        return None
    return path.read_text().strip() or None


@contextmanager
def _environment(values: dict[str, str]):
    """``values`` in os.environ for the block (wandb-core, started by the first ``wandb.init``, reads them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _init_failure(exc: Exception, mode: str, folder: Path) -> str:
    """One line for a failed ``wandb.init``: wandb's first line and what to do."""
    first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else type(exc).__name__
    if mode == "online":
        fix = "online runs need a login (`wandb login` or WANDB_API_KEY) and the W&B server, or set "
        fix += "--metrics.wandb.mode offline"
    else:
        fix = f"wandb's log is {folder / 'debug-internal.log'}"
    return f"metrics.wandb: wandb.init ({mode}) failed: {first}; {fix}"


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class WandbSink:
    """One W&B run for one invocation of a run dir: ``log`` each record, ``close`` at the end."""

    def __init__(self, cfg: RunConfig, run_dir: Path, warn: Callable[[str], None]) -> None:
        import wandb

        w = cfg.metrics.wandb
        self._warn = warn
        folder = run_dir / "wandb"
        folder.mkdir(exist_ok=True)
        run_id = stored_run_id(run_dir) or secrets.token_hex(6)  # W&B ids: letters and digits
        self.identity = {"run_dir": str(run_dir.resolve()), "resumed": False, "start_step": 0, "checkpoint": None}
        (folder / "run_id").write_text(run_id + "\n")
        # no console capture, code / git saving, system stats or metadata, job: the module docstring says why
        settings = wandb.Settings(
            console="off",
            save_code=False,
            disable_code=True,
            disable_git=True,
            silent=True,
            x_disable_stats=True,
            x_disable_meta=True,
            disable_job_creation=True,
        )
        env = {"WANDB_CACHE_DIR": str(folder / "cache")}
        if w.mode == "offline":
            env["WANDB_ERROR_REPORTING"] = "false"
        try:
            with _environment(env):
                self.run = wandb.init(
                    project=w.project,
                    entity=w.entity or None,
                    name=w.name or run_dir.name,
                    group=w.group or None,
                    tags=list(w.tags) or None,
                    id=run_id,
                    resume="allow",
                    mode=w.mode,
                    dir=str(run_dir),
                    settings=settings,
                )
            self.run.config.update({**to_dict(cfg), "anytrain_run": self.identity}, allow_val_change=True)
        except Exception as exc:  # no API key, server unreachable, bad entity/project: before any training step
            raise AnytrainError(_init_failure(exc, w.mode, folder)) from None
        where = self.run.url if w.mode == "online" else Path(self.run.dir).parent
        warn(escape(f"wandb: {w.mode} run {run_id} ({where})"))

    def log(self, record: dict, kind: str) -> None:
        """The numeric values of ``record`` as ``KIND/KEY`` at ``record['step']``; a 'resume' record updates the run's
        identity instead (its step is an earlier one than W&B's current step after a restart)."""
        if self.run is None:
            return
        try:
            if kind == "resume":
                checkpoint = record.get("checkpoint")  # None: --resume found no checkpoint, training starts at 0
                self.identity.update(resumed=checkpoint is not None, start_step=record["step"], checkpoint=checkpoint)
                self.run.config.update({"anytrain_run": self.identity}, allow_val_change=True)
                return
            values = {f"{kind}/{k}": v for k, v in record.items() if k != "step" and _numeric(v)}
            if values:
                self.run.log(values, step=int(record["step"]))
        except Exception as exc:
            self._fail("log", exc)

    def close(self) -> None:
        if self.run is None:
            return
        try:
            self.run.finish()
        except Exception as exc:
            self._fail("finish", exc)
        self.run = None

    def _fail(self, what: str, exc: Exception) -> None:
        self._warn(
            f"[yellow]wandb: {what} failed ({type(exc).__name__}: {escape(str(exc))}); W&B logging stops here, "
            "metrics.jsonl keeps every record[/]"
        )
        self.run = None
