"""``anytrain train`` and ``anytrain status``: run a recipe (``train/trainer.py``), and report how a run's last
invocation ended (``train/rundir.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from anytrain.errors import AnytrainError


def train(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="YAML recipe, e.g. configs/tiny.yaml."),
    run_dir: str = typer.Option(None, "--run-dir", help="Output directory (default runs/<name>-<time>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from its newest checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete an existing run in --run-dir first."),
    resume_allow_changes: str = typer.Option(
        "",
        "--resume-allow-changes",
        metavar="FIELD[,FIELD]",
        help="With --resume: accept these changed model / data-order / dtype fields (e.g. model.args.n_layers); "
        "other changed fields are always accepted and reported.",
    ),
) -> None:
    """Train. Extra arguments override config fields: --train.steps 20 --model.args.dim 128."""
    from anytrain.config import load_config
    from anytrain.data.resolve import resolve_run_config
    from anytrain.parallel.mesh import shutdown
    from anytrain.train.trainer import run_training

    if resume and overwrite:
        raise AnytrainError("--resume and --overwrite: choose one")
    cfg = resolve_run_config(load_config(config, ctx.args))
    try:
        allow = tuple(f.strip() for f in resume_allow_changes.split(",") if f.strip())
        summary = run_training(cfg, run_dir=run_dir, resume=resume, overwrite=overwrite, resume_allow=allow)
    finally:
        shutdown()
    if summary.get("already_complete"):  # a resume with nothing to do: the trainer said so in one line
        return
    if summary.get("world_size", 1) == 1 or int(os.environ.get("RANK", "0")) == 0:
        _print_summary(summary)


def _print_summary(summary: dict) -> None:
    from anytrain.train.metrics import format_duration

    first, last = summary["first_val_loss"], summary["final_val_loss"]
    lines = [f"run dir:     {summary['run_dir']}"]
    run_dir = Path(summary["run_dir"])
    lines.append(f"metrics:     {run_dir / 'metrics.jsonl'} (TensorBoard: {run_dir / 'tensorboard'})")
    lines.append(f"checkpoint:  {summary['checkpoint']}")
    if first is not None and last is not None:
        lines.append(f"val loss:    {first:.4f} -> {last:.4f} ({100 * (first - last) / first:.1f}% lower)")
    mfu = "n/a (no peak FLOP/s for this device)" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%"
    lines.append(
        f"throughput:  {summary['tokens_per_s']:,.0f} tokens/s ({summary['world_size']} x "
        f"{summary['hardware']['device']}), MFU {mfu}"
    )
    lines.append(f"wall time:   {format_duration(summary['wall_s'])} ({summary['wall_s']:.1f} s, this invocation)")
    typer.echo("\n".join(lines))


def status(run_dir: str = typer.Argument(..., help="A run directory written by `anytrain train`.")) -> None:
    """How the run's last invocation ended, as one line and the exit code: 0 finished, 143 / 130 preempted (saved;
    requeue it with checkpoint.auto_resume or --resume), 3 stopped on an error (the line gives its message and the
    invocation's exit code), 1 killed hard or still running."""
    from anytrain.train.rundir import describe_status

    line, code = describe_status(Path(run_dir))
    typer.echo(line)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(train)
    app.command("status")(status)
