"""Real SLURM (a one-node cluster started by ``conftest.slurm_cluster``): ``srun -n 2`` runs the doctor, and the sbatch
script ``anytrain launch slurm --dry-run`` writes (2 tasks, a 10-step gloo training, hostile names, a preflight) is
submitted and completes; a preflight with a planted fault ends its job before training."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anytrain.launch.slurm import SlurmJob, log_dir, render_sbatch, sbatch_value
from tests.cluster.test_launch import (
    HOSTILE_JOB_NAME,
    HOSTILE_RUN_DIR,
    INJECT,
    OWNED,
    hostile_config,
    losses,
    write_config,
)
from tests.conftest import ROOT, cli_in_process

STEPS = 10


def srun(cluster, *args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    cmd = ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, "-m", "anytrain", *args]
    return subprocess.run(cmd, cwd=ROOT, env=cluster.env(**env), capture_output=True, text=True, timeout=timeout)


# the disagreement check is test_launch.py::test_disagreeing_launchers_are_one_line_errors (WORLD_SIZE against
# SLURM_STEP_NUM_TASKS); test_srun_two_tasks_doctor reads a real srun step's variables
@pytest.mark.slow
def test_srun_with_a_contradicting_world_size_is_a_one_line_error(slurm_cluster, small_data, tmp_path):
    proc = srun(
        slurm_cluster,
        "train",
        str(write_config(tmp_path, small_data, 2)),
        "--run-dir",
        str(tmp_path / "r"),
        WORLD_SIZE="4",
    )
    assert proc.returncode != 0
    line = (
        "error: srun: WORLD_SIZE=4 but SLURM_STEP_NUM_TASKS=2; the launchers disagree: unset WORLD_SIZE "
        "(anytrain reads SLURM_STEP_NUM_TASKS) or launch 4 tasks"
    )
    assert line in proc.stderr.splitlines(), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


# the sbatch test below runs the same `anytrain doctor --suite quick` on 2 real srun tasks (its preflight: the
# all_reduce line asserted) and then trains on the srun step's ranks (world_size 2 in the summary)
@pytest.mark.slow
def test_srun_two_tasks_doctor(slurm_cluster, tmp_path):
    out = tmp_path / "doctor.json"
    proc = srun(slurm_cluster, "doctor", "--suite", "quick", "--json", str(out), "--expect-nodes", "1")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["launch"]["launcher"] == "slurm" and report["launch"]["world_size"] == 2
    assert report["slurm"]["job_id"]
    assert len(report["functional"]) == 2 and all(row["wrong"] == 0 for rows in report["functional"] for row in rows)
    assert report["failures"] == [] and "all_reduce over 2 ranks (gloo): ok" in proc.stdout


def job_fields(cluster, job_id: str) -> dict[str, str]:
    """``scontrol show job -o``'s KEY=VALUE fields of one job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env(), capture_output=True, text=True)
    return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.3):
    """Poll ``predicate()`` until it returns something truthy (sbatch --wait polls every 2 to 32 s: too slow)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def job_ended(cluster, job_id: str):
    fields = job_fields(cluster, job_id)
    return fields if fields.get("JobState") in FINAL_STATES else None


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def write_job(
    capsys,
    monkeypatch,
    tmp_path: Path,
    config: Path,
    run_dir: Path | str,
    *overrides: str,
    options: tuple = (),
    cwd: Path = ROOT,
) -> Path:
    """The script ``anytrain launch slurm --dry-run`` writes for 1 node x 2 CPU tasks (``options``: more flags), the
    CLI run in this process from ``cwd``."""
    script = tmp_path / "job.sbatch"
    monkeypatch.chdir(cwd)
    args = ["--nodes", "1", "--tasks-per-node", "2", "--run-dir", str(run_dir), "--script", str(script), "--dry-run"]
    code, _, err = cli_in_process(
        capsys, "launch", "slurm", str(config), *args, "--time", "00:10:00", *options, "--", *overrides
    )
    assert code == 0, err
    return script


def submit(cluster, script: Path, cwd: Path = ROOT, **env: str) -> str:
    sub = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        cwd=cwd,
        env=cluster.env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def render_job(tmp_path: Path, **fields) -> Path:
    """The script of a 1 node x 2 CPU task ``SlurmJob`` in ``tmp_path`` (in this process: what ``write_job`` gives
    for these fields without starting an interpreter), and its log folder."""
    job = SlurmJob(tasks_per_node=2, time="00:10:00", workdir=str(tmp_path), python=sys.executable, **fields)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(job))
    log_dir(job).mkdir(parents=True, exist_ok=True)
    return script


def test_sbatch_script_with_hostile_paths_and_a_preflight_trains(
    slurm_cluster, small_data, tmp_path, capsys, monkeypatch
):
    """The script for a config in a folder named with newlines, quotes and ``$(...)``, a run directory with a space,
    quotes, ``$(...)`` and ``%``, and such a job name, submitted with sbatch: the preflight doctor passes, the 10-step
    2-task gloo training completes, the log is where the script says, nothing in a name ran."""
    config = hostile_config(tmp_path, small_data, STEPS)
    run_dir = tmp_path / HOSTILE_RUN_DIR
    options = ("--preflight", "--job-name", HOSTILE_JOB_NAME)
    script = write_job(capsys, monkeypatch, tmp_path, config, HOSTILE_RUN_DIR, cwd=tmp_path, options=options)
    assert "#SBATCH --signal=B:TERM@120" in script.read_text()
    job_id = submit(slurm_cluster, script, cwd=tmp_path)
    fields = wait_for(lambda: job_ended(slurm_cluster, job_id), 240, f"job {job_id}")
    log = (run_dir.parent / "slurm-logs" / f"slurm-{job_id}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=slurm_cluster.env(), capture_output=True)
    assert f"JobName={HOSTILE_JOB_NAME} UserId=" in shown.stdout.decode()
    assert f"anytrain: job {job_id} (restart 0) on 1 node(s), master {slurm_cluster.node}:" in log
    assert "anytrain: preflight: anytrain doctor --suite quick on 2 task(s)" in log
    assert "all_reduce over 2 ranks (gloo): ok" in log and "error:" not in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(losses(run_dir)) == STEPS
    assert not list(tmp_path.rglob(OWNED)), "an injected command ran"


def test_preflight_failure_ends_the_job_before_training(slurm_cluster, small_data, tmp_path):
    """A planted fault (the doctor's test-only ``ANYTRAIN_TEST_CORRUPT_RANK=1``: one wrong all_reduce element on rank
    1) fails the preflight: the job fails with the doctor's exit status and error line, and no training starts."""
    run_dir = tmp_path / "run"
    config = str(write_config(tmp_path, small_data, STEPS))
    script = render_job(tmp_path, config=config, run_dir=str(run_dir), preflight=True)
    job_id = submit(slurm_cluster, script, ANYTRAIN_TEST_CORRUPT_RANK="1")
    fields = wait_for(lambda: job_ended(slurm_cluster, job_id), 240, f"job {job_id}")
    log = (tmp_path / "slurm-logs" / f"slurm-{job_id}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0"), log[-3000:]
    reason = f"error: doctor: 1 check(s) failed: rank 1 ({slurm_cluster.node}): all_reduce: #wrong 1 of 4096 elements"
    assert reason in log.splitlines(), log[-3000:]
    assert "anytrain: preflight failed (exit 2), training not started; the doctor says why above" in log
    assert not run_dir.exists()


def test_sbatch_reads_directive_values_literally(slurm_cluster, small_data, tmp_path):
    """A partition name with a space, ``$(...)``, ``#`` and both quotes reaches sbatch whole (``--test-only``)."""
    partition = f"p {INJECT} #\"q'"
    config = str(write_config(tmp_path, small_data, STEPS))
    script = render_job(tmp_path, config=config, run_dir="run", partition=partition)
    test_only = ["sbatch", "--test-only", str(script)]
    test = subprocess.run(test_only, cwd=tmp_path, env=slurm_cluster.env(), capture_output=True, text=True, timeout=60)
    assert test.returncode != 0 and f"invalid partition specified: {partition}" in test.stderr, test.stderr
    script.write_text(script.read_text().replace(sbatch_value("--partition", partition), '"debug"'))
    test = subprocess.run(test_only, cwd=tmp_path, env=slurm_cluster.env(), capture_output=True, text=True, timeout=60)
    assert test.returncode == 0, test.stderr
    assert not list(tmp_path.rglob(OWNED))


@pytest.mark.slow
def test_preempted_job_saves_requeues_and_resumes(slurm_cluster, small_data, tmp_path, capsys, monkeypatch):
    """SIGTERM to the batch shell (what --signal=B:TERM@grace sends) -> the tasks save and exit 143 -> the script
    requeues the job -> the second run resumes from the checkpoint (checkpoint.auto_resume); then a user's scancel
    ends it for good."""
    run_dir = tmp_path / "run"
    script = write_job(capsys, monkeypatch, tmp_path, write_config(tmp_path, small_data, 100_000), run_dir)
    job_id = submit(slurm_cluster, script)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(losses(run_dir)) >= 2, 180, "the first training steps")
    subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], env=slurm_cluster.env(), check=True)
    try:
        wait_for(lambda: job_fields(slurm_cluster, job_id).get("Restarts") == "1", 120, "the requeue")
        saved = wait_for(lambda: sorted((run_dir / "checkpoints").glob("step_*/COMMITTED")), 60, "a checkpoint")
        step = int(saved[-1].parent.name.split("_")[1])
        log = tmp_path / "slurm-logs" / f"slurm-{job_id}.out"
        wait_for(lambda: "(restart 1)" in log.read_text() and len(losses(run_dir)) > step + 1, 240, "the resumed run")
    finally:
        subprocess.run(["scancel", job_id], env=slurm_cluster.env())
        ended = wait_for(lambda: job_ended(slurm_cluster, job_id), 120, f"job {job_id} to end after scancel")
    text = log.read_text()
    assert "anytrain: SIGTERM, saving" in text
    # a user's scancel ends the job: no requeue
    assert (ended["JobState"], ended["Restarts"]) == ("CANCELLED", "1")
    wait_for(lambda: "anytrain: job cancelled, not requeued" in log.read_text(), 30, "the batch shell's last line")
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train"' in line]
    assert steps[-1] > step
