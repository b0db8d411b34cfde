"""A SLURM-style preemption of a 2-process torchrun job (gloo): SIGTERM to the launcher, as ``scancel`` / a time
limit sends it. Every worker saves the same step and exits 143; torchrun itself exits 1 (it does for any worker
exit other than 0), so the job script asks ``anytrain status RUN``, which exits 143 for a preemption and 0 once the
run finished, and requeues on 143."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.conftest import ROOT, cli_env, run_cli
from tests.distributed.test_fault_tolerance import _wait_for_step, command, step_losses, train, write_config


def test_sigterm_to_torchrun_is_a_clean_preemption_that_status_reports(tmp_path, small_data):
    config = write_config(tmp_path, small_data, steps=100_000, interval=0, log_sample_ids=False)
    run = tmp_path / "job"
    argv = [*command(2), "train", str(config), "--run-dir", str(run), "--checkpoint.auto_resume", "true"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run, 3, proc)
        os.kill(proc.pid, signal.SIGTERM)  # the launcher: torchrun forwards it to every worker
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert err.count("stopped: SIGTERM at step") == 2, err[-3000:]  # both workers, no "error:" line
    assert not [line for line in err.splitlines() if line.startswith("error:")], err[-3000:]
    committed = [p for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").is_file()]
    step = int(committed[0].name.split("_")[1])
    assert len(committed) == 1 and step == max(step_losses(run))  # the last step that ran is saved
    status = run_cli("status", str(run))
    assert status.returncode == 143, status.stdout + status.stderr
    assert f"preempted by SIGTERM at step {step}" in status.stdout
    # the requeued job: the same command line continues the run, and status then says finished
    proc = train(config, run, 2, "--checkpoint.auto_resume", "true", "--train.stop_at_step", str(step + 2))
    assert "resumed from" in proc.stderr
    assert run_cli("status", str(run)).returncode == 0
    assert sorted(step_losses(run)) == list(range(1, step + 3))
