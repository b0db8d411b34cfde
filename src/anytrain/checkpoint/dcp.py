"""Sharded, atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

``run_dir/checkpoints/step_00000100/`` holds DCP's shard files and ``.metadata``; the checkpoint counts only once
rank 0 has written ``COMMITTED`` into it, after every rank finished writing. Model and optimizer state go through
``torch.distributed.checkpoint.state_dict`` so the same checkpoint loads under DDP, FSDP or a single process, at
another world size, and on another device type (tensors are read into the live model's own tensors).

``COMMITTED`` lists every file of the checkpoint with its size (and, with ``checkpoint.checksums``, its sha256);
loading verifies them and falls back from a damaged newest checkpoint to the next older committed one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from anytrain.checkpoint import safe_load
from anytrain.diskio import DiskFullError, disk_full_as_error, write_text_atomic
from anytrain.errors import RunDirError, one_line
from anytrain.parallel.collectives import barrier, broadcast_object

IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable", "maximize")
"""Param-group entries that choose the kernel on this machine: kept, not taken from a checkpoint."""

COMMIT_MARKER = "COMMITTED"
PREFIX = "step_"


class TrainState(Stateful):
    """Everything a resume needs: model, optimizer, LR schedule and progress counters (step, tokens seen, RNG).

    The optimizer state is flattened by parameter name (``flatten_optimizer_state_dict``): every key names one
    parameter, so a checkpoint loads at any pipeline / data-parallel layout (pipeline ranks hold different parameter
    lists, which the nested format's per-group name lists cannot express). An optimizer that keeps shards of the
    parameters rather than the parameters (ZeRO-1, ``train/optim.py``) provides that layout itself through
    ``checkpoint_state`` / ``load_checkpoint_state``. ``extras`` are further Stateful pieces saved under their
    names (the PowerSGD state of ``parallel.grad_compression``); on load each gets the entries the checkpoint holds
    (``saved_keys``, set by ``Checkpointer.load``), possibly none.
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
    # the running metric state (the log window's per-rank loss sums and step count, the spike guard's running mean):
    # plain Python values, set by the trainer before a save and read by it after a load
    METRICS = {"window_loss": [], "window_steps": 0, "loss_ranks": 1, "spike": []}

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        progress: dict,
        extras: dict[str, Stateful] | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.progress = model, optimizer, scheduler, progress
        self.extras = extras or {}
        self.saved_keys: set[str] | None = None  # the flattened keys of the checkpoint being loaded
        self.metrics: dict | None = None  # None: not saved / not in the loaded checkpoint (written by older versions)
        self.expect_metrics = True  # whether the checkpoint being loaded holds "metrics"

    def state_dict(self) -> dict:
        model_sd = get_model_state_dict(self.model)  # first: its hooks reshard FSDP modules left unsharded by eval
        if hasattr(self.optimizer, "checkpoint_state"):
            optim_sd = self.optimizer.checkpoint_state()
        else:
            optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=self.OPTIONS)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "progress": dict(self.progress),
            "rng_cpu": torch.get_rng_state(),
            **({"metrics": dict(self.metrics or self.METRICS)} if self.expect_metrics else {}),
            **{
                name: _saved_only(extra.state_dict(), f"train.{name}", self.saved_keys)
                for name, extra in self.extras.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"])
        if hasattr(self.optimizer, "load_checkpoint_state"):
            self.optimizer.load_checkpoint_state(state["optim"])
        else:
            # the param groups' kernel choice (fused / foreach, from train.optimizer_impl and this machine) stays the
            # one built here: a checkpoint from a GPU run must not make a CPU or tensor-parallel resume use its kernel
            kept = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in self.optimizer.param_groups]
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=self.OPTIONS)
            for group, keys in zip(self.optimizer.param_groups, kept, strict=True):
                group.update(keys)
        self.scheduler.load_state_dict(_fit_groups(state["scheduler"], len(self.optimizer.param_groups)))
        self.progress.clear()
        self.progress.update(state["progress"])
        torch.set_rng_state(state["rng_cpu"])
        self.metrics = state.get("metrics")
        for name, extra in self.extras.items():
            extra.load_state_dict(state.get(name, {}))


def _fit_groups(scheduler_state: dict, n_groups: int) -> dict:
    """A saved LR-schedule state for an optimizer with ``n_groups`` param groups: a layout with another group count (a
    tensor-parallel run has a group per device mesh, train/optim.py) saved per-group lists of one value repeated —
    every group shares train.lr and the schedule — so the first entry stands for every group here."""
    fitted = dict(scheduler_state)
    for key in ("base_lrs", "_last_lr"):
        values = fitted.get(key)
        if isinstance(values, list) and values and len(values) != n_groups:
            fitted[key] = [values[0]] * n_groups
    return fitted


def _saved_only(tree: dict, prefix: str, keys: set[str] | None) -> dict:
    """``tree`` without the leaves whose flattened DCP key (``prefix.a.b``) is not in ``keys`` (None: all of it)."""
    if keys is None:
        return tree
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}"
        if isinstance(value, dict):
            value = _saved_only(value, path, keys)
            if value:
                out[key] = value
        elif path in keys:
            out[key] = value
    return out


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def is_committed(path: Path) -> bool:
    return (path / COMMIT_MARKER).is_file()


class CheckpointUnusable(Exception):
    """A committed checkpoint that cannot be loaded (damaged, or not matching the model); the message is one line."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_manifest(path: Path, checksums: bool) -> dict:
    """{file name: {"size": bytes[, "sha256": hex]}} of a checkpoint directory's files (but the marker)."""
    out = {}
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.name != COMMIT_MARKER):
        out[file.name] = {"size": file.stat().st_size, **({"sha256": _sha256(file)} if checksums else {})}
    return out


def verify(path: Path) -> str | None:
    """Why a committed checkpoint is damaged (a listed file missing, of another size or checksum), or None."""
    if not (path / ".metadata").is_file():
        return "its .metadata file is missing"
    try:
        files = json.loads((path / COMMIT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        return f"its {COMMIT_MARKER} marker is unreadable ({exc})"
    for name, expected in (files or {}).items():
        if "/" in name or "\\" in name or name in ("", ".", ".."):  # only files of the folder: never read outside it
            return f"its {COMMIT_MARKER} marker lists {name!r}, not a file of the checkpoint folder"
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["size"]:
            return f"{name} has {file.stat().st_size} bytes, {expected['size']} were written"
        if "sha256" in expected and _sha256(file) != expected["sha256"]:
            return f"{name} does not match its sha256 checksum"
    return None


class Checkpointer:
    def __init__(self, directory: Path, keep_last: int, is_main: bool, log=print, checksums: bool = True) -> None:
        self.dir, self.keep_last, self.is_main, self.log = directory, keep_last, is_main, log
        self.checksums = checksums
        self._pending = None
        self._gloo = None

    def path_for(self, step: int) -> Path:
        return self.dir / f"{PREFIX}{step:08d}"

    def all_checkpoints(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.glob(f"{PREFIX}*") if p.is_dir()), key=step_of)

    def committed(self) -> list[Path]:
        return [p for p in self.all_checkpoints() if is_committed(p)]

    def latest(self) -> Path | None:
        """Newest committed checkpoint; newer uncommitted (torn) ones are named in a warning and skipped."""
        newest = None
        for path in reversed(self.all_checkpoints()):
            if is_committed(path):
                newest = path
                break
            self.log(f"warning: skipping {path}: no {COMMIT_MARKER} marker (torn or interrupted save)")
        return newest

    def has(self, step: int) -> bool:
        return is_committed(self.path_for(step))

    def save(self, step: int, state: TrainState, asynchronous: bool = False) -> Path:
        """Write ``state`` as step ``step``; with ``asynchronous``, return once the state is staged in host memory
        and commit in the background (at most one save in flight: a new save first waits for the previous one)."""
        self.wait()
        path = self.path_for(step)
        barrier()  # a commit that rank 0's wait() just wrote is visible to every rank before they look
        if self.has(step):  # never rewrite a committed checkpoint (e.g. a stop right after an async save of it)
            return path
        if self.is_main:
            if path.exists():  # a torn save of the same step from a crashed attempt
                shutil.rmtree(path)
            path.mkdir(parents=True)
        barrier()
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if asynchronous:
                # DCP's background thread runs its own collectives: give it a gloo group, not the training NCCL one.
                future = dcp.async_save({"train": state}, checkpoint_id=str(path), process_group=self._async_group())
                self._pending = (future, path, step, started)
                return path
            with self._disk_full(path):
                dcp.save({"train": state}, checkpoint_id=str(path))
        barrier()  # every rank's shards are on disk before the marker
        with self._disk_full(path):
            self._commit(path, step, started)
        barrier()
        return path

    def _async_group(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if self._gloo is None:
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo

    def wait(self) -> None:
        """Finish the save in flight (if any) and commit it."""
        if self._pending is not None:
            self._pending[0].result()
            self.poll()

    def poll(self) -> None:
        """Commit a finished background save. No collective: DCP's coordinator (rank 0) completes its future only
        after gathering every rank's write results and writing the metadata, so rank 0 alone may commit."""
        if self._pending is None or not self._pending[0].done():
            return
        future, path, step, started = self._pending
        self._pending = None
        with self._disk_full(path):
            future.result()  # re-raises a failed write
            self._commit(path, step, started)

    @contextlib.contextmanager
    def _disk_full(self, path: Path):
        """A full filesystem while writing checkpoint ``path``: one error line; the torn folder is removed (it never
        counted: no COMMITTED marker) so that the space it took is free again."""
        try:
            with disk_full_as_error(path):
                yield
        except DiskFullError:
            if self.is_main:
                shutil.rmtree(path, ignore_errors=True)
            raise

    def _commit(self, path: Path, step: int, started: float) -> None:
        if self.is_main:
            marker = {
                "step": step,
                "time": time.time(),
                "seconds": round(time.perf_counter() - started, 3),
                "files": file_manifest(path, self.checksums),
            }
            write_text_atomic(path / COMMIT_MARKER, json.dumps(marker))
            self._prune()

    def load(self, path: Path, target) -> None:
        """Load checkpoint ``path`` into ``target`` (a TrainState, or a dict of state dicts such as {"model": ...}).
        Raises CheckpointUnusable (on every rank alike) when it is damaged or does not fit the target, and
        UnsafeCheckpointError (a RunDirError) when a file names an object no checkpoint holds."""
        reason = broadcast_object(verify(path) if self.is_main else None)
        if reason:
            raise CheckpointUnusable(reason)
        try:
            if isinstance(target, TrainState):
                keys = safe_load.SafeReader(str(path)).read_metadata().state_dict_metadata
                target.expect_metrics = any(k.startswith("train.metrics.") for k in keys)
                target.saved_keys = set(keys)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                safe_load.load({"train": target}, path)  # runs no code from the files (checkpoint/safe_load.py)
        except safe_load.UnsafeCheckpointError:
            raise  # a planted object is refused, not taken for damage: no fallback to an older checkpoint
        except (Exception, CheckpointException) as exc:
            raise CheckpointUnusable(one_line(exc)) from exc
        finally:
            if isinstance(target, TrainState):
                target.expect_metrics = True
                target.saved_keys = None

    def load_newest(self, target, set_aside: bool = False) -> Path | None:
        """Load the newest committed checkpoint that loads, falling back to older ones with a warning naming each
        skipped one and why. ``set_aside`` (training): once one loaded, the unusable newer ones are renamed
        ``damaged_step_N_<time>`` (rank 0) so that the run saves those steps again. None when there is no committed
        checkpoint; RunDirError (one line, nothing renamed) when none loads."""
        self.latest()  # names torn (uncommitted) newer ones
        failed: list[tuple[Path, str]] = []
        for path in reversed(self.committed()):
            try:
                self.load(path, target)
            except CheckpointUnusable as exc:
                failed.append((path, str(exc)))
                continue
            for bad, reason in failed:
                self.log(f"warning: cannot load {bad} ({reason}); using the previous committed checkpoint {path}")
                if set_aside:
                    self._set_aside(bad)
            return path
        if failed:
            reasons = {reason for _, reason in failed}
            listed = (
                "; ".join(f"{p.name}: {reason}" for p, reason in failed)
                if len(reasons) > 1
                else (f"{', '.join(p.name for p, _ in failed)}: {reasons.pop()}")
            )
            raise RunDirError(f"{self.dir}: no committed checkpoint can be loaded ({listed})")
        return None

    def _set_aside(self, path: Path) -> None:
        if self.is_main:
            path.rename(path.with_name(f"damaged_{path.name}_{time.strftime('%Y%m%d-%H%M%S')}"))
        barrier()

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` committed checkpoints; a failed delete is reported, never fatal."""
        committed = self.committed()
        for old in committed[: max(0, len(committed) - self.keep_last)]:
            try:
                (old / COMMIT_MARKER).unlink()  # uncommit first: a half-deleted checkpoint is never loaded
                shutil.rmtree(old)
            except OSError as exc:
                self.log(f"warning: could not delete old checkpoint {old}: {exc}")
