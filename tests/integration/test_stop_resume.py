"""A planned stop and a resume log exactly the uninterrupted run's records; status.json says how every invocation
ended (an exception, a SIGTERM before the first step, a resume with nothing to do, a hard kill); the log line shows
progress, time left and, on CPU, the process's resident memory."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from anytrain.evals.compare import load_curves
from anytrain.train.rundir import read_metrics
from tests import forklaunch
from tests.conftest import ROOT, cli_env, run_cli
from tests.distributed.test_fault_tolerance import train, write_config

# measurements, which differ between any two runs (and the resume marker's path); every other field must be equal
MEASURED = {
    "tokens_per_s",
    "tokens_per_s_per_device",
    "mfu",
    "window_s",
    "eta_s",
    "peak_mem_gib",
    "avg_watts",
    "joules",
    "tokens_per_joule",
    "tflops_per_watt",
    "checkpoint",
}
STRATEGY = {1: "auto", 2: "fsdp"}


def logged(run_dir: Path) -> list[dict]:
    """metrics.jsonl as written, line by line, without the measured fields."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in MEASURED} for line in lines]


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


class _Stopped(dict):
    """nproc -> (reference run dir, stopped-and-resumed run dir, the reference's process), trained when asked."""

    def __init__(self, tmp, config):
        super().__init__()
        self.tmp, self.config = tmp, config

    def __missing__(self, nproc):
        tmp, config = self.tmp, self.config
        flags = ("--parallel.strategy", STRATEGY[nproc], "--train.eval_batches", "1", "--train.micro_batch", "4")
        reference = train(config, tmp / f"reference{nproc}", nproc, *flags)
        train(config, tmp / f"stopped{nproc}", nproc, *flags, "--train.stop_at_step", "8")
        train(config, tmp / f"stopped{nproc}", nproc, *flags, "--resume")
        self[nproc] = (tmp / f"reference{nproc}", tmp / f"stopped{nproc}", reference)
        return self[nproc]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, small_data):
    """For 1 process and 2 FSDP ranks: an uninterrupted 10-step run (checkpoint every 4, a record every 5), and the
    same run stopped at step 8 (inside the second log window) by train.stop_at_step, then resumed."""
    tmp = tmp_path_factory.mktemp("stop")
    config = write_config(tmp, small_data, steps=10, interval=4, log_interval=5, log_sample_ids=False)
    return tmp, config, _Stopped(tmp, config)


# 2 FSDP ranks slow: the ranks' window sums in a checkpoint inside a log window are test_fault_tolerance.py's
# test_every_logged_record_after_a_kill_and_resume_equals_the_uninterrupted_run[2-2]; the planned stop is [1]
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_planned_stop_and_resume_log_the_uninterrupted_records(stopped, nproc):
    _, _, runs = stopped
    reference, run, _ = runs[nproc]
    expected, got = logged(reference), logged(run)
    assert [r["step"] for r in of_kind(expected, "train")] == [5, 10]
    assert of_kind(got, "train") == of_kind(expected, "train")  # no record at step 8, and step 10's is the same
    assert of_kind(got, "eval") == of_kind(expected, "eval")  # no evaluation at the planned stop either
    assert of_kind(got, "resume") == [{"kind": "resume", "step": 8}]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 10


def test_the_log_line_shows_progress_eta_and_resident_memory(stopped):
    _, _, runs = stopped
    reference, _, proc = runs[1]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("step  5/10 |"))  # padded to 10's width
    assert re.search(r"\| eta \d+:\d\d$", line), line
    rss = float(re.search(r"\| rss (\d+\.\d+) GiB", line).group(1))
    assert rss > 0
    records = of_kind([json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()], "train")
    assert all(r["peak_mem_gib"] > 0 and r["eta_s"] >= 0 for r in records)
    assert records[-1]["eta_s"] == 0  # at train.steps
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["wall_s"] > 0 and summary["peak_mem_gib"] > 0
    assert re.search(r"^wall time:   \d+:\d\d \(", proc.stdout, re.M), proc.stdout


def test_resuming_a_finished_run_changes_nothing(stopped):
    tmp, config, runs = stopped
    run = tmp / "finished-again"
    shutil.copytree(runs[1][0], run)
    files = ("summary.json", "status.json", "config.yaml", "metrics.jsonl")
    before = {name: (run / name).read_bytes() for name in files}
    listing = sorted(p.name for p in run.iterdir())
    for extra in ((), ("--train.steps", "5")):
        proc = train(config, run, 1, "--resume", "--train.eval_batches", "1", "--train.micro_batch", "4", *extra)
        steps = extra[1] if extra else "10"
        last = proc.stderr.strip().splitlines()[-1]
        assert last == f"{run}: the run is already complete at step 10 (train.steps {steps}); nothing to train"
        assert proc.stdout == ""
        assert {name: (run / name).read_bytes() for name in files} == before
        assert sorted(p.name for p in run.iterdir()) == listing
    assert run_cli("status", str(run)).returncode == 0


def test_a_run_preempted_at_its_last_step_is_finished_by_the_resume_that_has_nothing_to_do(stopped):
    """A SIGTERM during the last step saves that step and records ``preempted`` (exit 143); the requeued resume has
    nothing to train and must record ``finished``, or a requeue script reading ``anytrain status`` loops forever."""
    tmp, config, runs = stopped
    run = tmp / "preempted-at-end"
    shutil.copytree(runs[1][0], run)
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "preempted", "exit_code": 143}))
    assert run_cli("status", str(run)).returncode == 143
    train(config, run, 1, "--resume", "--train.eval_batches", "1", "--train.micro_batch", "4")
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    assert run_cli("status", str(run)).returncode == 0


def test_an_exception_is_recorded_as_failed_with_its_message(tmp_path):
    """A batch source that fails at step 3 (an I/O error): the exception propagates, status.json says failed with the
    error's line and exit code 1, and ``anytrain status`` reports it (exit 3)."""
    from anytrain.train.trainer import Trainer
    from tests.unit.test_trainer_api import FixedBatches, _config

    class FailingBatches(FixedBatches):
        def rank_batch(self, step, dp_rank, dp_world):
            if step == 2:
                raise OSError(5, "Input/output error")
            return super().rank_batch(step, dp_rank, dp_world)

    run = tmp_path / "failing"
    trainer = Trainer(_config(steps=6), batches=FailingBatches(512, 4, 32), run_dir=str(run))
    try:
        with pytest.raises(OSError, match="Input/output error"):
            trainer.train()
    finally:
        trainer.close()
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 2 and status["exit_code"] == 1
    assert status["message"] == "OSError: [Errno 5] Input/output error"
    proc = run_cli("status", str(run))
    assert proc.returncode == 3
    error = "OSError: [Errno 5] Input/output error"
    assert proc.stdout.strip() == f"{run}: stopped on an error at step 2 (exit 1): {error}"


def test_a_full_disk_is_recorded_as_failed(tmp_path, small_data, small_tmpfs):
    run = small_tmpfs("640k") / "run"
    proc = train(write_config(tmp_path, small_data, steps=2, interval=2, log_sample_ids=False), run, 1, expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 2
    assert status["message"].startswith(f"disk full while writing {run / 'checkpoints'}")
    check = run_cli("status", str(run))
    assert check.returncode == 3 and "(exit 2): disk full while writing" in check.stdout


def test_sigterm_during_the_step_0_evaluation_is_a_preemption(tmp_path, small_data):
    """SIGTERM while the step-0 evaluation runs: exit 143, status preempted at step 0 with nothing to save, so the
    requeue script of docs/checkpointing.md requeues; the requeued command then trains the run."""
    config = write_config(tmp_path, small_data, steps=4, interval=2, log_sample_ids=False)
    run = tmp_path / "job"
    argv = ["train", str(config), "--run-dir", str(run), "--checkpoint.auto_resume", "true"]
    # a fork of the pre-imported CLI left running (tests/forklaunch.py), a process of its own
    proc = forklaunch.start([*argv, "--train.eval_batches", "100"], cli_env(), ROOT)
    deadline = time.monotonic() + 120
    try:
        # the trainer's last set-up line: the evaluation comes next
        while not any(line.startswith("model: ") for line in proc.stderr_text().splitlines()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr_text()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = proc.stderr_text()
    assert proc.returncode == 143, text[-3000:]
    assert "stopped: SIGTERM at step 0: before the first step, nothing to save (exit 143)" in text
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    status = run_cli("status", str(run))
    assert status.returncode == 143, status.stdout
    assert "preempted by SIGTERM at step 0, before its first checkpoint" in status.stdout
    train(config, run, 1, "--checkpoint.auto_resume", "true")
    assert run_cli("status", str(run)).returncode == 0
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4]


def test_a_resume_after_kill_9_marks_the_records_that_readers_replace(tmp_path, small_data):
    """kill -9 at step 9 (records 1-8 logged, checkpoint 5), resumed to step 6: a resume marker follows the dead
    invocation's records, and the readers keep the resumed run's records (steps 7 and 8 of the dead one are gone).
    Killed before its first checkpoint, the resumed run starts at step 0 and marks that too."""
    config = write_config(tmp_path, small_data, steps=12, interval=5, log_sample_ids=False)
    for kill, saved, stop in ((9, 5, 6), (3, 0, 2)):
        run = tmp_path / f"killed{kill}"
        proc = train(config, run, 1, expect_ok=False, ANYTRAIN_TEST_KILL_AT_STEP=str(kill))
        assert proc.returncode != 0
        train(config, run, 1, "--resume", "--train.stop_at_step", str(stop))
        raw = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [(r["kind"], r["step"]) for r in raw]
        assert steps.index(("resume", saved)) == kill - 1  # after the dead invocation's kill - 1 records
        kept = read_metrics(run)
        assert [r["step"] for r in kept if r["kind"] == "train"] == list(range(1, stop + 1))
        replayed = {r["step"]: r["loss"] for r in raw[kill:] if r["kind"] == "train"}
        assert {r["step"]: r["loss"] for r in kept if r["kind"] == "train" and r["step"] > saved} == replayed
        assert sorted(load_curves(run).curves["loss"]) == list(range(1, stop + 1))
