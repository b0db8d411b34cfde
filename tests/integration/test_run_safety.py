"""Nothing lost: run dirs that are not ours, two writers, resumes with another model, damaged checkpoints, NaN logs.

Every case runs the real CLI in subprocesses on the debug model (a few steps, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import forklaunch
from tests.conftest import ROOT, cli_env, run_cli


def write_config(tmp: Path, data: Path, steps: int = 4, interval: int = 2, log_interval: int = 1) -> Path:
    cfg = tmp / "safety.yaml"
    cfg.write_text(f"""
model: {{arch: transformer, flavour: debug}}
data: {{path: {data}, seq_len: 32}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 4, lr: 3.0e-3, warmup_steps: 2, dtype: fp32,
        log_interval: {log_interval}, eval_interval: 0, eval_batches: 0}}
checkpoint: {{interval: {interval}, keep_last: 5}}
device: cpu
""")
    return cfg


def train(config: Path, run_dir: Path, *extra: str, ok: bool = True, **env: str) -> subprocess.CompletedProcess:
    proc = run_cli("train", str(config), "--run-dir", str(run_dir), *extra, timeout=120, **env)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """The process failed with exit 2 and exactly one stderr line, an error holding every fragment."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def snapshot(path: Path) -> dict:
    """Size and mtime of every file (the lock file aside: a refused resume takes the lock and records itself)."""
    files = (p for p in path.rglob("*") if p.is_file() and p.name != ".anytrain-run.lock")
    return {p.relative_to(path): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, small_data):
    """A finished 4-step run with committed checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("safety")
    config = write_config(tmp, small_data)
    train(config, tmp / "run")
    return tmp, config


def test_overwrite_and_resume_refuse_a_folder_without_our_marker(tmp_path, small_data):
    config = write_config(tmp_path, small_data)
    folder = tmp_path / "theirs"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text("my: notes\n")
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "thesis.tex").write_text("years of work\n")
    before = snapshot(folder)
    for flag in ("--overwrite", "--resume"):
        one_error_line(train(config, folder, flag, ok=False), str(folder), ".anytrain-run.json", "adopt")
        assert snapshot(folder) == before  # nothing deleted, nothing written
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("keep me\n")
    one_error_line(train(config, plain, "--overwrite", ok=False), "not an anytrain run dir", "refusing to delete")
    assert (plain / "notes.txt").read_text() == "keep me\n"


def test_overwrite_replaces_our_own_run(done_run, tmp_path):
    tmp, config = done_run
    run = tmp_path / "mine"
    train(config, run, "--train.steps", "2")
    marker = json.loads((run / ".anytrain-run.json").read_text())
    assert {"name", "created", "host", "pid", "anytrain"} <= marker.keys()
    train(config, run, "--overwrite", "--train.steps", "1", "--checkpoint.interval", "1")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]
    assert json.loads((run / ".anytrain-run.json").read_text())["pid"] != marker["pid"]


def _wait_for_step(run_dir: Path, step: int, proc: forklaunch.Forked, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and metrics.read_text().count('"train"') >= step:
            return
        time.sleep(0.05)
    raise AssertionError("training did not reach the step in time")


def test_a_second_writer_is_refused_while_a_run_trains(tmp_path, small_data):
    config = write_config(tmp_path, small_data, steps=100_000, interval=0)
    run = tmp_path / "live"
    # the first writer: a fork of the pre-imported CLI left running (tests/forklaunch.py), a process of its own
    first = forklaunch.start(["train", str(config), "--run-dir", str(run)], cli_env(), ROOT)
    try:
        _wait_for_step(run, 2, first)
        for flags in (("--resume",), ("--overwrite",), ()):
            line = one_error_line(train(config, run, *flags, ok=False), "in use by", f"pid {first.pid}")
            assert "host" in line
        assert first.poll() is None  # untouched: still training
        status = run_cli("status", str(run))
        assert status.returncode == 1 and "running" in status.stdout
        os.kill(first.pid, signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, err[-2000:]
    assert "stopped: SIGTERM at step" in err and "error:" not in err
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one writer: every step once, in order
    assert (run / f"checkpoints/step_{steps[-1]:08d}/COMMITTED").is_file()
    status = run_cli("status", str(run))
    assert status.returncode == 143 and "preempted by SIGTERM" in status.stdout


def test_resume_refuses_a_changed_model_or_data_order(done_run):
    tmp, config = done_run
    run = tmp / "run"
    before, config_text = snapshot(run), (run / "config.yaml").read_text()
    proc = train(config, run, "--resume", "--model.args.n_layers", "1", ok=False)
    one_error_line(proc, "model.args.n_layers: 2 in the run, 1 now", "--resume-allow-changes model.args.n_layers")
    one_error_line(
        train(config, run, "--resume", "--train.seed", "7", "--data.seq_len", "16", ok=False),
        "train.seed: 1234 in the run, 7 now",
        "data.seq_len: 32 in the run, 16 now",
    )
    assert snapshot(run) == before
    # allowed by name, the checkpoint still cannot fit the model: one line, no traceback, config.yaml kept
    proc = train(
        config, run, "--resume", "--model.args.n_layers", "3", "--resume-allow-changes", "model.args.n_layers", ok=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {run / 'checkpoints'}: no committed checkpoint")
    assert (run / "config.yaml").read_text() == config_text


def test_resume_reports_safe_changes(done_run, tmp_path):
    tmp, config = done_run
    run = tmp_path / "safe"
    train(config, run, "--train.stop_at_step", "2")
    proc = train(config, run, "--resume", "--train.log_interval", "2", "--checkpoint.keep_last", "3")
    assert "resume: changed train.log_interval: 1 -> 2" in proc.stderr
    assert "resume: changed train.stop_at_step: 2 -> 0" in proc.stderr


def _damage(checkpoint: Path, how: str) -> None:
    shard = next(checkpoint.glob("*.distcp"))
    if how == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "no-metadata":
        (checkpoint / ".metadata").unlink()
    else:  # one flipped byte: only the checksum sees it
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "no-metadata", "flipped-byte"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(done_run, tmp_path, how):
    tmp, config = done_run
    run = tmp_path / "damaged"
    subprocess.run(["cp", "-a", str(tmp / "run"), str(run)], check=True)
    _damage(run / "checkpoints/step_00000004", how)
    proc = run_cli("eval", str(run), "--json", "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["step"] == 2
    assert "warning: cannot load" in proc.stderr and "step_00000004" in proc.stderr
    proc = train(config, run, "--resume", "--train.steps", "5")
    assert "resumed from" in proc.stderr and "step_00000002 (step 2)" in proc.stderr
    assert (run / "checkpoints/step_00000004/COMMITTED").is_file()  # saved again; the damaged one set aside
    assert len(list((run / "checkpoints").glob("damaged_step_00000004_*"))) == 1


def test_no_loadable_checkpoint_is_one_line(done_run, tmp_path):
    tmp, config = done_run
    run = tmp_path / "ruined"
    subprocess.run(["cp", "-a", str(tmp / "run"), str(run)], check=True)
    for step in (2, 4):
        _damage(run / f"checkpoints/step_{step:08d}", "truncated")
    one_error_line(run_cli("eval", str(run)), "no committed checkpoint can be loaded", "step_00000002")
    before = snapshot(run / "checkpoints")
    proc = train(config, run, "--resume", "--train.steps", "6", ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert snapshot(run / "checkpoints") == before  # nothing renamed when nothing loads


def test_non_finite_values_are_logged_not_crashed_on(tmp_path, small_data):
    """train.check_finite false with a NaN loss (test hook): the run logs nan and finishes."""
    config = write_config(tmp_path, small_data, steps=3, interval=0)
    run = tmp_path / "nan"
    proc = train(config, run, "--train.check_finite", "false", ANYTRAIN_TEST_NAN_AT_STEP="2")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records][1:] == ["nan", "nan"]
    assert "loss nan" in proc.stderr


def test_checkpoint_to_a_full_disk_is_one_line_and_leaves_no_torn_checkpoint(tmp_path, small_data, small_tmpfs):
    """A real full filesystem (a 640 KiB tmpfs: the run's files fit, a debug model's checkpoint does not): one
    'disk full' line, exit 2, and no uncommitted checkpoint folder left taking the space."""
    run_dir = small_tmpfs("640k") / "run"
    proc = train(
        write_config(tmp_path, small_data, steps=2, interval=2), run_dir, "--train.log_interval", "2", ok=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # after the step's log line
    assert last.startswith("error: disk full while writing " + str(run_dir / "checkpoints")), last
    assert not list((run_dir / "checkpoints").glob("step_*"))
