"""``anytrain launch slurm``: an sbatch script for a training run, with preemption handled.

The script asks for ``nodes x tasks_per_node`` tasks (one per GPU, or ``tasks_per_node`` CPU processes with
``gpus_per_node = 0``), finds the master address with ``scontrol show hostnames`` (the first host of the allocation)
and a port from the job id, sets the vendor's collective-library environment, and runs ``srun python -m anytrain
train`` with ``checkpoint.auto_resume true`` and a fixed run directory. Preemption: ``--signal=B:TERM@<grace>`` has
SLURM send SIGTERM to the batch shell ``grace`` seconds before the time limit; the shell passes it to every task with
``scancel --signal=TERM <job>`` (not through srun, which would cancel the step and SIGKILL the tasks KillWait seconds
later, possibly in the middle of the save), the trainer saves a checkpoint and exits 143, and the script requeues
the job (``--requeue``), which resumes from that checkpoint. A job cancelled with ``scancel`` is not requeued.

``preflight``: before training, the same tasks run ``anytrain doctor --suite quick`` (GEMMs, exact collectives, the
p2p matrix over the training's process layout); a failed check ends the job with the doctor's exit status and its
``error:`` line in the job log, before the training's process group forms.

Every value is written so that neither bash nor sbatch reads it as code: shell words with ``shlex.quote``, ``#SBATCH``
values in sbatch's own quoting (double quotes, backslash before ``\\`` and ``"``), and no user value in a comment. A
value an ``#SBATCH`` line cannot hold (a control character such as a newline; a backslash in the log path, which
would turn off SLURM's ``%j``) is a :class:`ConfigError` naming the flag.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from anytrain.cost.tables import SLURM_TIME_FORMS, slurm_time_seconds
from anytrain.errors import AnytrainError, ConfigError
from anytrain.launch.recipe import control_char, load_recipe, shown
from anytrain.launch.vendor import SHELL_EXPANDED, VENDORS, check_ifname, collective_env

MARKER = "# Written by `anytrain launch slurm`"
"""The second line of every script written here: ``launch slurm`` rewrites a file that has it and no other."""
# SLURM's time formats (sbatch --time): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit
PREFLIGHT_WAIT_S = 60
"""srun --wait of the preflight: how long the other ranks may take to finish after the first one exits."""


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
    preflight: bool = False
    """Run ``anytrain doctor --suite quick`` on the job's tasks first; train only if it passes."""
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
            raise ConfigError(
                f"--vendor {vendor} with --gpus-per-node {self.gpus_per_node}: CPU jobs have 0 GPUs "
                "per node and GPU jobs at least 1"
            )
        return vendor

    def tasks(self) -> int:
        """Tasks per node: one per GPU, or ``tasks_per_node`` for a CPU job."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node


def train_command(job: SlurmJob) -> list[str]:
    """The command every task runs."""
    cmd = [
        job.python,
        "-m",
        "anytrain",
        "train",
        str(Path(job.config).resolve()),
        "--run-dir",
        str(Path(job.workdir, job.run_dir)),
        "--checkpoint.auto_resume",
        "true",
    ]
    if job.resolved_vendor() == "cpu":
        cmd += ["--device", "cpu"]
    return cmd + list(job.overrides)


def sbatch_value(flag: str, value: str) -> str:
    """``value`` quoted for an ``#SBATCH`` line as sbatch parses it: inside double quotes, with a backslash before
    ``\\`` and ``"``; spaces, ``#``, ``'`` and ``$`` then stay literal. A control character (a newline would end the
    comment and start a shell line) is refused, naming ``flag``."""
    bad = control_char(value)
    if bad is not None:
        raise ConfigError(
            f"{flag}: {value!r} holds a control character ({bad!r}), which an #SBATCH line cannot hold; "
            "give it without one"
        )
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def default_job_name(config: str) -> str:
    """``anytrain-<config file name without .yaml>``, control characters as ``_`` (a default is not refused)."""
    return "anytrain-" + "".join("_" if control_char(ch) else ch for ch in Path(config).stem)


def _output_pattern(log_dir: Path) -> str:
    """``<log dir>/slurm-%j.out`` as an ``--output`` value: a ``%`` of the path doubled (``%%`` is SLURM's literal
    ``%``); a backslash is refused, since SLURM then replaces no ``%j`` at all."""
    text = str(log_dir)
    if "\\" in text or control_char(text) is not None:
        what = "a backslash" if "\\" in text else f"a control character ({control_char(text)!r})"
        raise ConfigError(
            f"--run-dir: the job log folder {text!r} (the run directory's parent) holds {what}, which "
            "SLURM's #SBATCH --output cannot take; choose a run directory whose path has none"
        )
    return text.replace("%", "%%") + "/slurm-%j.out"


def _sbatch_lines(job: SlurmJob, log_dir: Path) -> list[str]:
    if job.time and slurm_time_seconds(job.time) is None:
        raise ConfigError(f"--time: expected {SLURM_TIME_FORMS}, got {job.time!r}")
    job_name = sbatch_value("--job-name", job.job_name or default_job_name(job.config))
    options = [f"--job-name={job_name}", f"--nodes={job.nodes}", f"--ntasks-per-node={job.tasks()}"]
    if job.gpus_per_node > 0:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task > 0:
        options.append(f"--cpus-per-task={job.cpus_per_task}")
    for flag, value in (("--partition", job.partition), ("--time", job.time), ("--account", job.account)):
        if value:
            options.append(f"{flag}={sbatch_value(flag, value)}")
    output = sbatch_value("--run-dir", _output_pattern(log_dir))
    options += [f"--output={output}", "--open-mode=append", f"--signal=B:TERM@{job.grace_s}"]
    if job.requeue:
        options.append("--requeue")
    return [f"#SBATCH {option}" for option in options]


def preflight_command(job: SlurmJob) -> list[str]:
    """What every task runs before training with ``preflight``: the doctor's quick suite."""
    return [job.python, "-m", "anytrain", "doctor", "--suite", "quick"]


def log_dir(job: SlurmJob) -> Path:
    """Where the job's output goes (slurm-<job id>.out, appended across requeues); must exist before submission."""
    return Path(job.workdir, job.run_dir).parent / "slurm-logs"


def _export(key: str, value: str) -> str:
    if key in SHELL_EXPANDED:  # vendor.py's own constants, expanded by the job's shell
        return f'export {key}="{value}"'
    return f"export {key}={shlex.quote(value)}"


def render_sbatch(job: SlurmJob) -> str:
    """The whole sbatch script, as text."""
    if job.nodes < 1 or job.tasks() < 1 or job.gpus_per_node < 0:
        raise ConfigError("launch slurm: --nodes and the tasks per node must be >= 1, --gpus-per-node >= 0")
    vendor = job.resolved_vendor()
    check_ifname(job.ifname)
    env = collective_env(vendor, job.ifname)
    threads = str(job.cpus_per_task) if job.cpus_per_task > 0 else "${SLURM_CPUS_PER_TASK:-1}"
    requeue = 'scontrol requeue "$SLURM_JOB_ID"' if job.requeue else 'echo "anytrain: --requeue is off; not requeued"'
    preflight = []
    if job.preflight:
        preflight = [
            "# preflight: the doctor's quick suite on the same tasks; its failures end the job before training",
            f'echo "anytrain: preflight: anytrain doctor --suite quick on {job.nodes * job.tasks()} task(s)"',
            # no --kill-on-bad-exit: every rank fails alike and exits with the doctor's status (2) unless it is
            # killed first; --wait ends a step whose other ranks are stuck after one of them died
            f"run_step --kill-on-bad-exit=0 --wait={PREFLIGHT_WAIT_S} {shlex.join(preflight_command(job))}",
            f'if [ "$preempted" = 1 ]; then {requeue}; exit "$status"; fi  # the training has not started',
            'if [ "$status" -ne 0 ]; then',
            '  echo "anytrain: preflight failed (exit $status), training not started; the doctor says why above"',
            '  exit "$status"',
            "fi",
        ]
    lines = [
        "#!/bin/bash",
        f"{MARKER} (it rewrites files that have this line): {job.nodes} node(s) x {job.tasks()} task(s), {vendor}.",
        *_sbatch_lines(job, log_dir(job)),
        "set -uo pipefail",
        f"cd {shlex.quote(job.workdir)}",
        "# rank 0's host and a port every task derives alike (anytrain's srun discovery reads the same variables)",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 20000))",
        f"export OMP_NUM_THREADS={threads}",
        *[_export(key, value) for key, value in env.items()],
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
        # srun in the background and `wait`: a trap runs as soon as the signal comes, not when srun ends; after the
        # trap the first wait returns and the second waits for the step to end.
        'run_step() { srun "$@" & srun_pid=$!; wait "$srun_pid"; status=$?; '
        'if [ "$preempted" = 1 ]; then wait "$srun_pid"; status=$?; fi; }',
        *preflight,
        f"run_step --kill-on-bad-exit=1 {shlex.join(train_command(job))}",
        f'if [ "$preempted" = 1 ] && [ "$status" -ne 0 ]; then {requeue}; fi',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def is_own_script(path: Path) -> bool:
    """Whether ``path`` is a script this module wrote (its second line starts with :data:`MARKER`)."""
    try:
        with path.open("rb") as handle:
            head = handle.read(4096).split(b"\n")
    except OSError:
        return False
    return len(head) > 1 and head[0].startswith(b"#!") and head[1].startswith(MARKER.encode())


def check_script_path(path: Path, config: str, overwrite: bool) -> None:
    """Refuse to write over the config, a folder, or (without ``--overwrite``) a file launch slurm did not write."""
    if not (path.exists() or path.is_symlink()):
        return
    name = shown(path)
    if path.is_dir():
        raise ConfigError(f"--script: {name} is a folder; give the script's file name")
    if path.exists() and os.path.samefile(path, config):
        raise ConfigError(f"--script: {name} is the config file; write the script elsewhere (e.g. <run-dir>.sbatch)")
    if not overwrite and not is_own_script(path):
        what = f"{name} exists and was not written by anytrain launch slurm"
        raise ConfigError(f"--script: {what}; choose another --script or pass --overwrite to replace it")


def write_script(job: SlurmJob, path: Path, overwrite: bool = False) -> Path:
    """Render ``job``'s sbatch script and write it (executable) to ``path``, after :func:`check_script_path`; create
    the job's log folder. Returns the log folder."""
    text = render_sbatch(job)
    check_script_path(path, job.config, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    log_dir(job).mkdir(parents=True, exist_ok=True)
    return log_dir(job)


def submit(path: Path) -> str:
    """Run ``sbatch`` on the script; returns what it printed (``Submitted batch job <id>``)."""
    proc = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AnytrainError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def auto_nodes(
    config: str,
    overrides: list[str],
    gpu: str,
    gpus_per_node: int,
    deadline: str,
    time_limit: str,
    max_nodes: int,
) -> tuple[int, int, list[str], str]:
    """``--nodes auto``: the cost model's fewest devices that train the recipe's ``train.steps`` by the deadline (else
    the time limit). Returns (nodes, GPUs per node, the layout's overrides followed by ``overrides``, the reason)."""
    from anytrain.cost.devices import get_device
    from anytrain.cost.model import Workload
    from anytrain.cost.planner import RUNNABLE_STRATEGIES, size_job, trainer_overrides
    from anytrain.cost.shapes import shape_from_config
    from anytrain.cost.tables import parse_duration

    if gpus_per_node < 1 or not gpu:
        raise ConfigError("--nodes auto: needs --gpus-per-node N and --gpu KIND (e.g. --gpu h100) for the cost model")
    if not (deadline or time_limit):
        raise ConfigError("--nodes auto: needs --time (or --deadline): the job is sized to finish by then")
    cfg = load_recipe(config, overrides)
    tokens = cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len
    wl = Workload.from_config(cfg, tokens=tokens)
    device = get_device(gpu, gpus_per_node=gpus_per_node)
    seconds = parse_duration(deadline, "--deadline") if deadline else parse_duration(time_limit, "--time")
    try:
        sized = size_job(
            shape_from_config(cfg), device, wl, seconds, max_nodes * gpus_per_node, strategies=RUNNABLE_STRATEGIES
        )
    except ConfigError as exc:
        text = str(exc).replace(f"--max-gpus {max_nodes * gpus_per_node}", f"--max-nodes {max_nodes}")
        text = text.replace("--max-gpus", "--max-nodes")
        raise ConfigError(text if deadline else text.replace("--deadline", "--time")) from None
    layout = trainer_overrides(sized.best)[:-2]  # the recipe's train.steps stay
    return sized.nodes, min(sized.gpus, gpus_per_node), layout + overrides, sized.reason
