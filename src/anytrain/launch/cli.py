"""``anytrain launch slurm|mpi``: write (and optionally run) the job for a training run.

Arguments after ``--`` are passed to ``anytrain train`` (config overrides such as ``--train.steps 100``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import typer

from anytrain.errors import AnytrainError, ConfigError

launch_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Write and submit a SLURM job or an mpirun line for a training run.")  # fmt: skip
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def _default_run_dir(config: str) -> str:
    return f"runs/{Path(config).stem}"


@launch_app.command("slurm", context_settings=EXTRA)
def slurm(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="YAML recipe, e.g. configs/125m.yaml."),
    nodes: str = typer.Option("1", "--nodes", "-N", help="Nodes, or auto: sized by the cost model (--gpu, --time)."),
    gpus_per_node: int = typer.Option(0, "--gpus-per-node", "-G", help="GPUs (= tasks) per node; 0 = a CPU job."),
    gpu: str = typer.Option("", "--gpu", help="--nodes auto: the device kind (h100, h200, mi250x, ...)."),
    deadline: str = typer.Option("", "--deadline", help="--nodes auto: finish train.steps by then (default --time)."),
    max_nodes: int = typer.Option(64, "--max-nodes", help="--nodes auto: most nodes to consider."),
    tasks_per_node: int = typer.Option(1, "--tasks-per-node", help="Processes per node of a CPU job."),
    cpus_per_task: int = typer.Option(0, "--cpus-per-task", help="CPUs per task (0 = SLURM's default)."),
    partition: str = typer.Option("", "--partition", "-p", help="SLURM partition."),
    time_limit: str = typer.Option("", "--time", "-t", help="Time limit, e.g. 04:00:00."),
    account: str = typer.Option("", "--account", "-A", help="SLURM account."),
    job_name: str = typer.Option("", "--job-name", help="Job name (default anytrain-<config name>)."),
    vendor: str = typer.Option("auto", help="cuda, rocm or cpu (auto: cpu without GPUs, else cuda)."),
    run_dir: str = typer.Option("", "--run-dir", help="Run directory (default runs/<config name>); fixed for requeue."),
    grace: int = typer.Option(120, "--grace", help="Seconds between SIGTERM and the time limit (checkpoint time)."),
    requeue: bool = typer.Option(True, "--requeue/--no-requeue", help="Requeue the job after a preemption save."),
    ifname: str = typer.Option("", "--ifname", help="Network interface for NCCL / RCCL / gloo (e.g. ib0)."),
    script: str = typer.Option("", "--script", help="Where to write the script (default <run-dir>.sbatch)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a --script file not written by launch slurm."),
    preflight: bool = typer.Option(False, "--preflight", help="Run `anytrain doctor --suite quick` before training."),
    submit: bool = typer.Option(False, "--submit/--dry-run", help="Run sbatch on the script (default: only write it)."),
) -> None:
    """Write an sbatch script for `anytrain train CONFIG` (and submit it with --submit)."""
    from anytrain.launch.slurm import SlurmJob, log_dir, render_sbatch

    run_dir = run_dir or _default_run_dir(config)
    overrides = list(ctx.args)
    if nodes == "auto":
        nodes, gpus_per_node, overrides = _auto_nodes(config, overrides, gpu, gpus_per_node, deadline, time_limit,
                                                      max_nodes)  # fmt: skip
    elif not nodes.isdigit():
        raise ConfigError(f"--nodes: expected a number or auto, got {nodes!r}")
    job = SlurmJob(config=config, run_dir=run_dir, nodes=int(nodes), gpus_per_node=gpus_per_node,
                   tasks_per_node=tasks_per_node, cpus_per_task=cpus_per_task, partition=partition,
                   time=time_limit, account=account, job_name=job_name, vendor=vendor, grace_s=grace,
                   requeue=requeue, preflight=preflight, ifname=ifname, overrides=overrides)  # fmt: skip
    _check_config(config, job.overrides)
    text = render_sbatch(job)
    path = Path(script or f"{run_dir.rstrip('/')}.sbatch")
    _check_script_path(path, config, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    log_dir(job).mkdir(parents=True, exist_ok=True)
    typer.echo(f"wrote {path} (job output: {log_dir(job)}/slurm-<job id>.out)")
    if not submit:
        typer.echo(f"submit with: sbatch {shlex.quote(str(path))}")
        return
    proc = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AnytrainError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    typer.echo(proc.stdout.strip())


@launch_app.command("mpi", context_settings=EXTRA)
def mpi(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="YAML recipe, e.g. configs/tiny.yaml."),
    processes: int = typer.Option(..., "-n", "--np", help="Processes (ranks) in all."),
    hostfile: str = typer.Option("", "--hostfile", help="Open MPI hostfile (default: this host only)."),
    gpus_per_node: int = typer.Option(0, "--gpus-per-node", "-G", help="Ranks (GPUs) per host; 0 = a CPU job."),
    vendor: str = typer.Option("auto", help="cuda, rocm or cpu (auto: cpu without GPUs, else cuda)."),
    run_dir: str = typer.Option("", "--run-dir", help="Run directory (default runs/<config name>)."),
    master_port: int = typer.Option(29500, "--master-port", help="TCP port on the first host for the rendezvous."),
    ifname: str = typer.Option("", "--ifname", help="Network interface for NCCL / RCCL / gloo (e.g. ib0)."),
    mpirun_args: str = typer.Option("", "--mpirun-args", help="More mpirun options, e.g. '--allow-run-as-root'."),
    execute: bool = typer.Option(False, "--execute/--dry-run", help="Run the command (default: only print it)."),
) -> None:
    """Print the mpirun command line for `anytrain train CONFIG` (and run it with --execute)."""
    from anytrain.launch.mpi import mpirun_command

    _check_config(config, list(ctx.args))
    cmd = mpirun_command(config, run_dir or _default_run_dir(config), processes, hostfile, gpus_per_node, vendor,
                         master_port, ifname, mpirun_args, list(ctx.args))  # fmt: skip
    typer.echo(shlex.join(cmd))
    if execute:
        sys.stdout.flush()
        code = subprocess.call(cmd)
        if code:
            raise typer.Exit(code)


def _auto_nodes(config: str, overrides: list[str], gpu: str, gpus_per_node: int, deadline: str, time_limit: str,
                max_nodes: int) -> tuple[str, int, list[str]]:  # fmt: skip
    """``--nodes auto``: the cost model's fewest devices that train the recipe's ``train.steps`` by the deadline.
    Returns (nodes, GPUs per node, the layout's overrides followed by the user's)."""
    from anytrain.cost.devices import get_device
    from anytrain.cost.model import Workload
    from anytrain.cost.planner import RUNNABLE_STRATEGIES, size_job, trainer_overrides
    from anytrain.cost.shapes import shape_from_config
    from anytrain.cost.tables import parse_duration

    if gpus_per_node < 1 or not gpu:
        raise ConfigError("--nodes auto: needs --gpus-per-node N and --gpu KIND (e.g. --gpu h100) for the cost model")
    if not (deadline or time_limit):
        raise ConfigError("--nodes auto: needs --time (or --deadline): the job is sized to finish by then")
    cfg = _check_config(config, overrides)
    tokens = cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len
    wl = Workload.from_config(cfg, tokens=tokens)
    device = get_device(gpu, gpus_per_node=gpus_per_node)
    seconds = parse_duration(deadline, "--deadline") if deadline else parse_duration(time_limit, "--time")
    try:
        sized = size_job(shape_from_config(cfg), device, wl, seconds, max_nodes * gpus_per_node,
                         strategies=RUNNABLE_STRATEGIES)  # fmt: skip
    except ConfigError as exc:
        text = str(exc).replace(f"--max-gpus {max_nodes * gpus_per_node}", f"--max-nodes {max_nodes}")
        text = text.replace("--max-gpus", "--max-nodes")
        raise ConfigError(text if deadline else text.replace("--deadline", "--time")) from None
    layout = trainer_overrides(sized.best)[:-2]  # the recipe's train.steps stay
    typer.echo(f"--nodes auto: {sized.reason}")
    return str(sized.nodes), min(sized.gpus, gpus_per_node), layout + overrides


def _check_script_path(path: Path, config: str, overwrite: bool) -> None:
    """Refuse to write over the config, a folder, or (without ``--overwrite``) a file launch slurm did not write."""
    from anytrain.launch.slurm import is_own_script

    if not (path.exists() or path.is_symlink()):
        return
    shown = _shown(path)
    if path.is_dir():
        raise ConfigError(f"--script: {shown} is a folder; give the script's file name")
    if path.exists() and os.path.samefile(path, config):
        raise ConfigError(f"--script: {shown} is the config file; write the script elsewhere (e.g. <run-dir>.sbatch)")
    if not overwrite and not is_own_script(path):
        what = f"{shown} exists and was not written by anytrain launch slurm"
        raise ConfigError(f"--script: {what}; choose another --script or pass --overwrite to replace it")


def _shown(path: str | Path) -> str:
    """A path for a one-line message: as it is, or as a Python literal when it holds a control character."""
    text = str(path)
    return repr(text) if any(ord(ch) < 32 or ord(ch) == 127 for ch in text) else text


def _check_config(config: str, overrides: list[str]):
    """Fail at submission, not in the queue: the recipe must load with the overrides; returns the RunConfig."""
    from anytrain.config import load_config

    if not Path(config).is_file():
        raise ConfigError(f"{_shown(config)}: no such config file")
    return load_config(config, overrides)
