"""Run-dir lock, resume config comparison and the metrics logger's non-finite values, in-process."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from anytrain.config import load_config
from anytrain.errors import RunDirError
from anytrain.train import rundir
from anytrain.train.metrics import MetricsLogger


def test_the_lock_is_exclusive_names_its_holder_and_goes_with_release(tmp_path):
    first = rundir.RunLock(tmp_path)
    first.acquire()
    holder = json.loads((tmp_path / rundir.LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()} on host {socket.gethostname()}"):
        rundir.RunLock(tmp_path).acquire()  # another open file description: flock refuses it
    assert rundir.lock_held(tmp_path)["pid"] == os.getpid()
    first.release()
    assert rundir.lock_held(tmp_path) is None
    second = rundir.RunLock(tmp_path)
    second.acquire()
    second.release()


def _no_flock(fd, op):  # a filesystem without flock (some NFS mounts)
    raise OSError(errno.ENOLCK, "No locks available")


def test_without_flock_the_recorded_holder_decides(tmp_path, monkeypatch):
    import fcntl

    monkeypatch.setattr(fcntl, "flock", _no_flock)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_file = tmp_path / rundir.LOCK
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "since": "then"}))
    lock = rundir.RunLock(tmp_path)
    lock.acquire()  # the holder's process is gone: stale, taken over
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    lock.release()
    lock_file.write_text(json.dumps({"host": "another-node", "pid": 1, "since": "then"}))
    with pytest.raises(RunDirError, match="in use by pid 1 on host another-node"):
        rundir.RunLock(tmp_path).acquire()


def test_config_changes_compare_the_resolved_model(tmp_path):
    base = load_config(None, ["--model.flavour", "debug"])
    same = load_config(None, ["--model.flavour", "debug", "--model.args.n_layers", str(base_layers(base))])
    assert rundir.config_changes(base, same) == []  # the same architecture, spelled differently
    other = load_config(None, ["--model.flavour", "debug", "--train.steps", "7", "--model.args.n_layers", "1"])
    changes = {k: (a, b) for k, a, b in rundir.config_changes(base, other)}
    assert changes["model.args.n_layers"] == (base_layers(base), 1) and changes["train.steps"] == (200, 7)


def base_layers(cfg) -> int:
    from anytrain.models import resolve_args

    return resolve_args(cfg.model).n_layers


def test_the_logger_prints_non_finite_and_missing_values(tmp_path, capsys):
    log = MetricsLogger(tmp_path, True, 10, tensorboard=False)
    log.log(
        {
            "step": 1,
            "loss": float("nan"),
            "lr": float("inf"),
            "grad_norm": float("-inf"),
            "tokens_per_s": None,
            "mfu": float("nan"),
            "peak_mem_gib": 0.0,
        }
    )
    log.log({"step": 1, "val_loss": float("nan"), "val_ppl": float("inf")}, kind="eval")
    log.close()
    err = capsys.readouterr().err
    assert "loss nan | lr inf | gnorm -inf" in err and "val_loss nan | val_ppl inf" in err
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == "nan" and records[0]["tokens_per_s"] is None
