"""``anytrain launch slurm``: an sbatch script for a training run, with preemption handled.

The script asks for ``nodes x tasks_per_node`` tasks (one per GPU, or ``tasks_per_node`` CPU processes with
``gpus_per_node = 0``), finds the master address with ``scontrol show hostnames`` (the first host of the allocation)
and a port from the job id, sets the vendor's collective-library environment, and runs ``srun python -m anytrain
train`` with ``checkpoint.auto_resume true`` and a fixed run directory. Preemption: ``--signal=B:TERM@<grace>`` has
SLURM send SIGTERM to the batch shell ``grace`` seconds before the time limit; the shell passes it to every task with
``scancel --signal=TERM <job>`` (not through srun, which would cancel the step and SIGKILL the tasks KillWait seconds
later, possibly in the middle of the save), the trainer saves a checkpoint and exits 143, and the script requeues
the job (``--requeue``), which resumes from that checkpoint. A job cancelled with ``scancel`` is not requeued.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from anytrain.errors import ConfigError
from anytrain.launch.vendor import VENDORS, collective_env


@dataclass
class SlurmJob:
    """One training job as ``anytrain launch slurm`` describes it (the CLI options, field by field)."""

    config: str
    """The YAML recipe (resolved to an absolute path when the script is written)."""
    run_dir: str
    """The run directory; fixed, so that a requeued job resumes in it."""
    nodes: int = 1
    gpus_per_node: int = 0
    """GPUs per node and tasks per node when > 0; 0 = a CPU job (gloo, ``--device cpu``)."""
    tasks_per_node: int = 1
    """Processes per node of a CPU job (ignored with GPUs: one task per GPU)."""
    cpus_per_task: int = 0
    """``--cpus-per-task`` (0 = SLURM's default); also OMP_NUM_THREADS."""
    partition: str = ""
    time: str = ""
    """Time limit, e.g. 04:00:00 (empty = the partition's default)."""
    account: str = ""
    job_name: str = ""
    vendor: str = "auto"
    """cuda, rocm or cpu; auto = cpu without GPUs, else cuda."""
    grace_s: int = 120
    """Seconds between the SIGTERM and the time limit: time for one step and a checkpoint save."""
    requeue: bool = True
    ifname: str = ""
    """Network interface for NCCL / RCCL / gloo sockets (e.g. ib0, hsn0); empty = the library's choice."""
    python: str = field(default_factory=lambda: sys.executable)
    workdir: str = field(default_factory=lambda: str(Path.cwd()))
    overrides: list[str] = field(default_factory=list)
    """Extra ``anytrain train`` arguments (config overrides such as ``--train.steps 100``)."""

    def resolved_vendor(self) -> str:
        vendor = self.vendor if self.vendor != "auto" else ("cuda" if self.gpus_per_node > 0 else "cpu")
        if vendor not in VENDORS:
            raise ConfigError(f"--vendor: expected auto, {', '.join(VENDORS)}; got {self.vendor!r}")
        if (vendor == "cpu") != (self.gpus_per_node == 0):
            raise ConfigError(f"--vendor {vendor} with --gpus-per-node {self.gpus_per_node}: CPU jobs have 0 GPUs "
                              "per node and GPU jobs at least 1")  # fmt: skip
        return vendor

    def tasks(self) -> int:
        """Tasks per node: one per GPU, or ``tasks_per_node`` for a CPU job."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node


def train_command(job: SlurmJob) -> list[str]:
    """The command every task runs."""
    cmd = [job.python, "-m", "anytrain", "train", str(Path(job.config).resolve()), "--run-dir",
           str(Path(job.workdir, job.run_dir)), "--checkpoint.auto_resume", "true"]  # fmt: skip
    if job.resolved_vendor() == "cpu":
        cmd += ["--device", "cpu"]
    return cmd + list(job.overrides)


def _sbatch_lines(job: SlurmJob, log_dir: Path) -> list[str]:
    options = [f"--job-name={job.job_name or 'anytrain-' + Path(job.config).stem}", f"--nodes={job.nodes}",
               f"--ntasks-per-node={job.tasks()}"]  # fmt: skip
    if job.gpus_per_node > 0:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task > 0:
        options.append(f"--cpus-per-task={job.cpus_per_task}")
    options += [f"--{key}={value}" for key, value in
                (("partition", job.partition), ("time", job.time), ("account", job.account)) if value]  # fmt: skip
    options += [f"--output={log_dir}/slurm-%j.out", "--open-mode=append", f"--signal=B:TERM@{job.grace_s}"]
    if job.requeue:
        options.append("--requeue")
    return [f"#SBATCH {option}" for option in options]


def log_dir(job: SlurmJob) -> Path:
    """Where the job's output goes (slurm-<job id>.out, appended across requeues); must exist before submission."""
    return Path(job.workdir, job.run_dir).parent / "slurm-logs"


def render_sbatch(job: SlurmJob) -> str:
    """The whole sbatch script, as text."""
    if job.nodes < 1 or job.tasks() < 1 or job.gpus_per_node < 0:
        raise ConfigError("launch slurm: --nodes and the tasks per node must be >= 1, --gpus-per-node >= 0")
    vendor = job.resolved_vendor()
    env = collective_env(vendor, job.ifname)
    threads = str(job.cpus_per_task) if job.cpus_per_task > 0 else "${SLURM_CPUS_PER_TASK:-1}"
    requeue = 'scontrol requeue "$SLURM_JOB_ID"' if job.requeue else 'echo "anytrain: --requeue is off; not requeued"'
    lines = [
        "#!/bin/bash",
        f"# Written by `anytrain launch slurm` for {job.config}: {job.nodes} node(s) x {job.tasks()} task(s), "
        f"{vendor}.",
        *_sbatch_lines(job, log_dir(job)),
        "set -uo pipefail",
        f"cd {shlex.quote(job.workdir)}",
        "# rank 0's host and a port every task derives alike (anytrain's srun discovery reads the same variables)",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 20000))",
        f"export OMP_NUM_THREADS={threads}",
        *[f'export {key}="{value}"' for key, value in env.items()],
        'echo "anytrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s), '
        'master $MASTER_ADDR:$MASTER_PORT"',
        "# SIGTERM (preemption, or the time limit minus the grace period) -> every task: the trainer saves a",
        "# checkpoint and exits 143; the job is then requeued and resumes from it (checkpoint.auto_resume).",
        "preempted=0",
        # The job's state tells a preemption / time-limit signal (RUNNING) from a user's scancel (CANCELLED). It is
        # read into a variable, three tries: a pipe into `grep -q` under pipefail, or one slow slurmctld answer,
        # would read as "not running" and lose the requeue.
        "job_state() { local out i; for i in 1 2 3; do "
        'if out=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null); then '
        'out=${out#*JobState=}; echo "${out%% *}"; return 0; fi; sleep 1; done; echo UNKNOWN; }',
        # scancel without --batch signals the job steps' tasks only (srun itself would cancel the step on SIGTERM:
        # the tasks would get SIGKILL KillWait seconds later, possibly in the middle of the save).
        'trap \'state=$(job_state); if [ "$state" = RUNNING ]; then preempted=1; '
        'echo "anytrain: SIGTERM, saving"; scancel --signal=TERM "$SLURM_JOB_ID"; '
        'else echo "anytrain: job cancelled, not requeued (state $state)"; fi\' TERM',
        f"srun --kill-on-bad-exit=1 {shlex.join(train_command(job))} &",
        "srun_pid=$!",
        'wait "$srun_pid"; status=$?',
        'if [ "$preempted" = 1 ]; then wait "$srun_pid"; status=$?; fi  # the first wait returned for the trap',
        f'if [ "$preempted" = 1 ] && [ "$status" -ne 0 ]; then {requeue}; fi',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"
