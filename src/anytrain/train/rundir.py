"""Run directories that are ours, one writer at a time, and resumed only with a compatible config.

- ``.anytrain-run.json`` is written first into every run dir this code creates and names the run (name, creation
  time, host, pid, anytrain version). ``--overwrite`` and ``--resume`` touch only directories that carry it.
- ``.anytrain-run.lock`` is held (``fcntl.flock``, exclusive) by rank 0 for the run's lifetime and records the
  holder's host and pid: a second writer (a second ``train`` on the same dir, ``--resume`` or ``--overwrite`` while
  it trains) is refused with a line naming the holder. Where flock is unavailable the recorded host/pid decide: a
  lock left by a process of this host that no longer exists is stale and taken over.
- ``status.json``: how the last invocation ended (running, finished, preempted, failed) for ``anytrain status``.
- ``metrics.jsonl``: one record per line; ``read_metrics`` gives the run's history as it stands after resumes.
- On resume the new resolved config is compared with ``RUN/config.yaml``: a change of the model, the data order or
  the dtype is refused (``--resume-allow-changes FIELD`` allows it), every other change is reported.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from anytrain.diskio import write_text_atomic
from anytrain.errors import AnytrainError, ConfigError, RunDirError

MARKER = ".anytrain-run.json"
LOCK = ".anytrain-run.lock"
STATUS = "status.json"
LEGACY_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
# fields whose change makes a resumed run another run: the model, the data order, the precision
UNSAFE_FIELDS = ("model.", "data.", "train.seed", "train.global_batch", "train.dtype")


def _identity() -> dict:
    from anytrain import __version__

    return {"host": socket.gethostname(), "pid": os.getpid(), "anytrain": __version__}


def _adopt_hint(path: Path) -> str:
    return (
        f"{path}: holds a run without a {MARKER} marker (written before run markers, or not by anytrain); "
        f"if it is an anytrain run, adopt it with `echo '{{}}' > {path / MARKER}`, else choose another "
        "--run-dir"
    )


class RunLock:
    """Exclusive advisory lock on ``RUN/.anytrain-run.lock``; released by ``release`` or when the process ends."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        holder = {**_identity(), "since": datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd

    def _lock(self, fd: int) -> None:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            raise RunDirError(self.busy_message(read_holder(self.path))) from None
        except OSError as exc:  # e.g. a filesystem without flock (some NFS mounts): decide by the recorded holder
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        holder = read_holder(self.path)
        if holder and holder_alive(holder):
            raise RunDirError(self.busy_message(holder))

    def busy_message(self, holder: dict | None) -> str:
        who = (
            f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since')})"
            if holder
            else ("another process")
        )
        return (
            f"{self.path.parent}: in use by {who}; wait for that run to end or stop it (it saves on SIGTERM), "
            f"then try again"
        )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def read_holder(lock_file: Path) -> dict | None:
    try:
        return json.loads(lock_file.read_text() or "null")
    except (OSError, ValueError):
        return None


def holder_alive(holder: dict) -> bool:
    """Whether the recorded holder may still run: a live pid on this host, or any pid on another host."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return True
    return True


def lock_held(run_dir: Path) -> dict | None:
    """The holder of a run dir's lock when some process holds it (None when free or absent)."""
    import fcntl

    lock_file = run_dir / LOCK
    if not lock_file.is_file():
        return None
    fd = os.open(lock_file, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(lock_file) or {}
    except OSError:
        holder = read_holder(lock_file)
        return holder if holder and holder_alive(holder) else None
    finally:
        os.close(fd)
    return None


def _clear(path: Path) -> None:
    """Empty a run dir we hold the lock of (the lock file stays: it is what keeps a second writer out)."""
    for child in path.iterdir():
        if child.name == LOCK:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def write_marker(path: Path, name: str) -> None:
    marker = {"name": name, "created": datetime.now().isoformat(timespec="seconds"), **_identity()}
    (path / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def open_run_dir(path: Path, name: str, resume: bool, overwrite: bool) -> RunLock:
    """Validate ``path`` for this invocation, take its lock and (new or overwritten run) write its marker first.
    Nothing is deleted unless the directory carries our marker and its lock is ours."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{path}: run dir exists and is a file; choose another --run-dir")
    occupied = path.is_dir() and any(p.name != LOCK for p in path.iterdir())
    ours = (path / MARKER).is_file()
    if occupied and not ours:
        if any((path / m).exists() for m in LEGACY_MARKERS):
            raise RunDirError(_adopt_hint(path))
        if resume:
            raise RunDirError(f"{path}: --resume given but the directory holds no anytrain run; pass a run's --run-dir")
        if overwrite:
            raise RunDirError(
                f"{path}: not an anytrain run dir (no {MARKER}); refusing to delete it even with "
                "--overwrite; choose another --run-dir"
            )
        raise RunDirError(f"{path}: directory is not empty and holds no anytrain run; choose another --run-dir")
    if occupied and not (resume or overwrite):  # refused without touching anything, the lock file included
        holder = lock_held(path)
        if holder is not None:
            raise RunDirError(RunLock(path).busy_message(holder))
        raise RunDirError(
            f"{path}: run dir already holds a run; pass --resume to continue it, --overwrite to "
            "replace it, or choose another --run-dir"
        )
    path.mkdir(parents=True, exist_ok=True)
    lock = RunLock(path)
    lock.acquire()
    try:
        if occupied and not resume:
            _clear(path)
        if not (path / MARKER).is_file():
            write_marker(path, name)
    except BaseException:
        lock.release()
        raise
    return lock


def write_status(run_dir: Path, state: str, **fields) -> None:
    """RUN/status.json: how this invocation stands (running, finished, preempted, failed), written atomically."""
    record = {"state": state, "time": datetime.now().isoformat(timespec="seconds"), **_identity(), **fields}
    write_text_atomic(run_dir / STATUS, json.dumps(record, indent=1) + "\n")


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return None


def read_metrics(run_dir: Path) -> list[dict]:
    """RUN/metrics.jsonl's records in order, as the run's history stands: a line cut short by a crash is skipped; a
    resume marker (``{"kind": "resume", "step": N}``) drops the records before it past step N (logged after the
    checkpoint the run continued from, by an invocation that then died: the resumed run logs those steps again); and
    of two records of one kind at one step the later one is kept, in its place."""
    kept: dict[tuple, dict] = {}  # (kind, step) -> record, in the order of the kept records
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        step = record.get("step")
        if record.get("kind") == "resume" and isinstance(step, (int, float)):
            kept = {key: r for key, r in kept.items() if not (isinstance(key[1], (int, float)) and key[1] > step)}
        key = (record.get("kind"), step)
        kept.pop(key, None)
        kept[key] = record
    return list(kept.values())


# config comparison on resume ----------------------------------------------------------------------------------------


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _comparable(cfg) -> dict:
    """A config as dotted fields, with the model as its resolved architecture (flavour + overrides) and the data
    path made absolute."""
    from anytrain.config import to_dict
    from anytrain.models import args_dict, resolve_args

    d = to_dict(cfg)
    d["model"] = {"arch": cfg.model.arch, "args": args_dict(resolve_args(cfg.model))}
    d["data"]["path"] = os.path.realpath(d["data"]["path"])
    return _flatten(d)


def config_changes(old_cfg, new_cfg) -> list[tuple[str, object, object]]:
    """(field, old value, new value) for every field that differs."""
    old, new = _comparable(old_cfg), _comparable(new_cfg)
    keys = sorted(old.keys() | new.keys())
    return [(key, old.get(key), new.get(key)) for key in keys if old.get(key) != new.get(key)]


def _allowed(key: str, allow: tuple[str, ...]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allow)


def check_resume_config(run_dir: Path, new_cfg, allow: tuple[str, ...] = ()) -> list[str]:
    """Compare the resumed run's config with RUN/config.yaml. Raises on a change of a field in ``UNSAFE_FIELDS``
    not named in ``allow``; returns a description of each other change (to be printed)."""
    from anytrain.config import load_config

    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        return []
    try:
        old_cfg = load_config(config_file)
    except ConfigError as exc:
        raise RunDirError(
            f"{config_file}: cannot be read to compare with the resumed config ({exc}); fix or remove "
            "it to resume without the check"
        ) from None
    changes = config_changes(old_cfg, new_cfg)
    unsafe = [c for c in changes if c[0].startswith(UNSAFE_FIELDS) and not _allowed(c[0], allow)]
    if unsafe:
        listed = "; ".join(f"{k}: {old!r} in the run, {new!r} now" for k, old, new in unsafe)
        names = ",".join(k for k, _, _ in unsafe)
        raise RunDirError(
            f"{run_dir}: --resume with a different model, data order or dtype ({listed}); use the run's "
            f"values, or pass --resume-allow-changes {names} to resume anyway"
        )
    return [f"{k}: {old!r} -> {new!r}" for k, old, new in changes]


@dataclass
class RunDir:
    path: Path
    lock: RunLock | None  # rank 0's
    changes: list[str]  # resumed: the changed config fields, to be reported
    previous_config: Path | None  # resumed: where the previous config.yaml was moved
    previous_status: str | None = None  # resumed: the status.json this invocation replaced (its text)
    recorded: bool = False  # whether status.json already says how this invocation ends

    def restore_config(self) -> None:
        """A resume that failed: put the previous config.yaml back (rank 0)."""
        if self.previous_config is not None and self.previous_config.is_file():
            self.previous_config.replace(self.path / "config.yaml")

    def restore(self, step: int) -> None:
        """A resume with nothing to do at ``step``: put the previous config.yaml back (rank 0), and the previous
        status.json when it said ``finished``. Any other previous state (``preempted`` by a signal at the last step,
        ``failed`` after the last checkpoint, a run dir without a status) becomes ``finished`` at ``step``: the run
        is complete, and a requeue script that reads ``anytrain status`` must not requeue it again."""
        self.restore_config()
        previous = None
        with contextlib.suppress(ValueError, TypeError):
            previous = json.loads(self.previous_status) if self.previous_status is not None else None
        if isinstance(previous, dict) and previous.get("state") == "finished":
            write_text_atomic(self.path / STATUS, self.previous_status)
            self.recorded = True
        else:
            self.record("finished", step=step)

    def record(self, state: str, **fields) -> None:
        """status.json says how this invocation ends (rank 0): ``finished``, ``preempted`` or ``failed``."""
        write_status(self.path, state, **fields)
        self.recorded = True

    def record_failure(self, exc: BaseException, step: int) -> None:
        """An invocation that ends on ``exc`` after ``step`` steps: ``failed``, with a one-line message and the exit
        code, unless its ending is recorded already (rank 0; a preemption records its own state)."""
        if self.recorded:
            return
        if isinstance(exc, KeyboardInterrupt):
            message, code = "interrupted by a second SIGINT; stopped without saving", 130
        elif isinstance(exc, AnytrainError):
            message, code = str(exc), exc.exit_code
        else:
            message, code = f"{type(exc).__name__}: {exc}", 1  # a traceback: the exit code of an uncaught exception
        self.recorded = True
        with contextlib.suppress(OSError, AnytrainError):  # a full disk may refuse this file too
            write_status(self.path, "failed", step=step, message=" ".join(message.split())[:2000], exit_code=code)


def open_sample_log(run_dir: Path, rank: int, step: int):
    """``train.log_sample_ids``: rank ``rank``'s log of the sample ids it trained on, open for appending; entries of
    steps from ``step`` on (a resumed checkpoint's) are dropped first, so the log is exactly the samples that trained
    the weights."""
    path = run_dir / f"samples_rank{rank}.jsonl"
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < step]
        path.write_text("".join(line + "\n" for line in kept))
    return open(path, "a", buffering=1)  # noqa: SIM115 - the trainer closes it


def setup_run_dir(
    cfg, run_dir: str | None, resume: bool, overwrite: bool, allow: tuple[str, ...], is_main: bool
) -> RunDir:
    """Rank 0 validates and locks the run dir, compares a resumed run's config, and writes config.yaml (keeping the
    previous one) and status.json; every rank gets the RunDir or the same one-line error."""
    from anytrain.config import save_config
    from anytrain.parallel.collectives import broadcast_object

    result: tuple = (None, None, [], None, None)
    lock = previous = None
    if is_main:
        path = Path(run_dir or cfg.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            lock = open_run_dir(path, cfg.name, resume, overwrite)
            changes = check_resume_config(path, cfg, allow) if resume else []
            config_file = path / "config.yaml"
            if config_file.exists():  # resuming: keep the previous resolved config next to the new one
                previous = path / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml"
                config_file.rename(previous)
            save_config(cfg, config_file)
            status_text = (path / STATUS).read_text() if resume and (path / STATUS).is_file() else None
            write_status(path, "running")
            result = (str(path), None, changes, previous and str(previous), status_text)
        except AnytrainError as exc:
            if lock is not None:
                lock.release()
            result = (None, str(exc), [], None, None)
    path, error, changes, previous, status_text = broadcast_object(result)
    if error:
        raise RunDirError(error)
    return RunDir(Path(path), lock, changes, previous and Path(previous), status_text)


def describe_status(run_dir: Path) -> tuple[str, int]:
    """(one line, exit code) for ``anytrain status``: 0 finished, the recorded 143 / 130 after a preemption, 3 after
    an error stop, 1 when the run crashed or is still running, 2 when ``run_dir`` is not a run."""
    if not (run_dir / MARKER).is_file() and not (run_dir / STATUS).is_file():
        raise RunDirError(f"{run_dir}: not an anytrain run dir (no {MARKER}); pass a --run-dir of `anytrain train`")
    holder = lock_held(run_dir)
    if holder is not None:
        return f"{run_dir}: running (pid {holder.get('pid')} on host {holder.get('host')})", 1
    status = read_status(run_dir) or {"state": "unknown"}
    state, step = status["state"], status.get("step")
    if state == "finished":
        return f"{run_dir}: finished at step {step} (checkpoint {status.get('checkpoint')})", 0
    if state == "preempted":
        checkpoint = status.get("checkpoint")
        saved = f"checkpoint {checkpoint} saved" if checkpoint else "before its first checkpoint (nothing to save)"
        line = (
            f"{run_dir}: preempted by {status.get('signal')} at step {step}, {saved}; continue with --resume or "
            "checkpoint.auto_resume"
        )
        return line, int(status.get("exit_code", 143))
    if state == "failed":
        code = f" (exit {status['exit_code']})" if "exit_code" in status else ""
        return f"{run_dir}: stopped on an error at step {step}{code}: {status.get('message')}", 3
    return f"{run_dir}: crashed or killed (state {state!r} at {status.get('time')}); continue with --resume", 1
