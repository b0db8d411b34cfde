"""``anytrain launch slurm|mpi``: write (and optionally run) the job for a training run (``launch/slurm.py``,
``launch/mpi.py``).

Arguments after ``--`` are passed to ``anytrain train`` (config overrides such as ``--train.steps 100``).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import typer

from anytrain.errors import ConfigError

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


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
    from anytrain.launch import slurm as sbatch
    from anytrain.launch.recipe import default_run_dir, load_recipe

    run_dir = run_dir or default_run_dir(config)
    overrides = list(ctx.args)
    if nodes == "auto":
        count, gpus_per_node, overrides, reason = sbatch.auto_nodes(
            config, overrides, gpu, gpus_per_node, deadline, time_limit, max_nodes
        )
        typer.echo(f"--nodes auto: {reason}")
    elif nodes.isdigit():
        count = int(nodes)
    else:
        raise ConfigError(f"--nodes: expected a number or auto, got {nodes!r}")
    job = sbatch.SlurmJob(
        config=config,
        run_dir=run_dir,
        nodes=count,
        gpus_per_node=gpus_per_node,
        tasks_per_node=tasks_per_node,
        cpus_per_task=cpus_per_task,
        partition=partition,
        time=time_limit,
        account=account,
        job_name=job_name,
        vendor=vendor,
        grace_s=grace,
        requeue=requeue,
        preflight=preflight,
        ifname=ifname,
        overrides=overrides,
    )
    load_recipe(config, job.overrides)
    path = Path(script or f"{run_dir.rstrip('/')}.sbatch")
    logs = sbatch.write_script(job, path, overwrite)
    typer.echo(f"wrote {path} (job output: {logs}/slurm-<job id>.out)")
    if not submit:
        typer.echo(f"submit with: sbatch {shlex.quote(str(path))}")
        return
    typer.echo(sbatch.submit(path))


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
    from anytrain.launch.recipe import default_run_dir, load_recipe

    load_recipe(config, list(ctx.args))
    cmd = mpirun_command(
        config,
        run_dir or default_run_dir(config),
        processes,
        hostfile,
        gpus_per_node,
        vendor,
        master_port,
        ifname,
        mpirun_args,
        list(ctx.args),
    )
    typer.echo(shlex.join(cmd))
    if execute:
        sys.stdout.flush()
        code = subprocess.call(cmd)
        if code:
            raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    launch = typer.Typer(
        add_completion=False,
        no_args_is_help=True,
        help="Write and submit a SLURM job or an mpirun line for a training run.",
    )
    launch.command("slurm", context_settings=EXTRA)(slurm)
    launch.command("mpi", context_settings=EXTRA)(mpi)
    app.add_typer(launch, name="launch")
