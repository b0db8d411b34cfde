"""``anytrain <verb>``: prepare, train, eval, info.

User errors (:class:`~anytrain.errors.AnytrainError`) print one ``error: ...`` line and exit non-zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from anytrain.errors import AnytrainError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Pre-train language models on any accelerator.")


@app.command()
def prepare(
    inputs: list[str] = typer.Argument(
        ...,
        help="Files or folders (.txt, .jsonl[.gz|.zst], .parquet, a datasets save_to_disk folder), or 'shakespeare'.",
    ),  # fmt: skip
    out: str = typer.Option(..., "--out", "-o", help="Output directory for shards, index.json and tokenizer.json."),
    tokenizer: str = typer.Option(None, help="Existing tokenizer.json to use instead of training one."),
    vocab_size: int = typer.Option(8192, help="Vocabulary size when training a tokenizer."),
    val_fraction: float = typer.Option(0.05, help="Fraction of documents held out for validation."),
    text_field: str = typer.Option("text", help="Field/column holding the text in .jsonl, .parquet, datasets inputs."),
    shard_tokens: int = typer.Option(100_000_000, help="Maximum tokens per shard file."),
    overwrite: bool = typer.Option(False, help="Replace an existing dataset (or an interrupted prepare) in --out."),
    encoding_errors: str = typer.Option("strict", help="Text that is not UTF-8: strict (refuse) or replace (U+FFFD)."),
    workers: int = typer.Option(1, help="Tokenizer processes (1 = this process); the output is the same for any."),
    resume: bool = typer.Option(False, help="Continue an interrupted prepare of the same inputs and options."),
    tokenizer_sample_bytes: int = typer.Option(
        1_000_000_000,
        help="Train the tokenizer on about this many bytes, a share of each input file (all of a smaller corpus).",
    ),  # fmt: skip
) -> None:
    """Tokenize raw text into memory-mapped token shards with a validation split, streaming (bounded memory), with a
    progress bar on a terminal. Null texts are skipped."""
    import time

    from anytrain.data.prepare import prepare as run_prepare

    started = time.perf_counter()
    index = run_prepare(inputs, out, tokenizer, vocab_size, val_fraction, text_field, shard_tokens, overwrite,
                        encoding_errors=encoding_errors, workers=workers, resume=resume,
                        tokenizer_sample_bytes=tokenizer_sample_bytes)  # fmt: skip
    seconds = time.perf_counter() - started
    stats, skipped = index["meta"]["stats"], index["meta"]["skipped_null"]
    tokens = stats["train"]["tokens"] + stats["val"]["tokens"]
    typer.echo(
        f"prepared {out}: vocab {index['vocab_size']} ({index['dtype']}), "
        f"train {stats['train']['tokens']:,} tokens / {stats['train']['documents']} docs, "
        f"val {stats['val']['tokens']:,} tokens / {stats['val']['documents']} docs"
        + (f", {skipped} null texts skipped" if skipped else "")
        + f"; {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s"
    )


@app.command("prepare-sft")
def prepare_sft(
    inputs: list[str] = typer.Argument(..., help='JSONL files or folders: {"text"} or {"prompt", "completion"}.'),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (token + loss-mask shards, index.json)."),
    tokenizer: str = typer.Option(..., help="The model's tokenizer.json, or its folder (e.g. the model.hf_path)."),
    layout: str = typer.Option("pack", help="pack (examples back to back) or pad (each example starts a window)."),
    seq_len: int = typer.Option(0, help="With --layout pad: the training data.seq_len."),
    val_fraction: float = typer.Option(0.05, help="Fraction of examples held out for validation."),
    shard_tokens: int = typer.Option(100_000_000, help="Maximum tokens per shard file."),
    overwrite: bool = typer.Option(False, help="Replace an existing dataset that anytrain wrote in --out."),
) -> None:
    """Tokenize supervised fine-tuning examples; training then counts the loss on completion tokens only
    (docs/hf-models.md)."""
    from anytrain.data.sft import prepare_sft as run_prepare_sft

    index = run_prepare_sft(inputs, out, tokenizer, val_fraction, layout, seq_len, shard_tokens, overwrite)
    stats = index["meta"]["stats"]
    typer.echo(f"prepared {out} ({layout}): vocab {index['vocab_size']}, " + ", ".join(
        f"{name} {s['examples']} examples / {s['tokens']:,} tokens ({s['trained_tokens']:,} trained)"
        for name, s in stats.items()))  # fmt: skip


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
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
    ),  # fmt: skip
) -> None:
    """Train. Extra arguments override config fields: --train.steps 20 --model.args.dim 128."""
    from anytrain.config import load_config
    from anytrain.parallel.mesh import shutdown
    from anytrain.train.trainer import run_training

    if resume and overwrite:
        raise AnytrainError("--resume and --overwrite: choose one")
    cfg = load_config(config, ctx.args)
    try:
        allow = tuple(f.strip() for f in resume_allow_changes.split(",") if f.strip())
        summary = run_training(cfg, run_dir=run_dir, resume=resume, overwrite=overwrite, resume_allow=allow)
    finally:
        shutdown()
    if summary.get("already_complete"):  # a resume with nothing to do: the trainer said so in one line
        return
    if summary.get("world_size", 1) == 1 or _rank() == 0:
        _print_summary(summary)


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


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
    lines.append(f"throughput:  {summary['tokens_per_s']:,.0f} tokens/s ({summary['world_size']} x "
                 f"{summary['hardware']['device']}), MFU {mfu}")  # fmt: skip
    lines.append(f"wall time:   {format_duration(summary['wall_s'])} ({summary['wall_s']:.1f} s, this invocation)")
    typer.echo("\n".join(lines))


@app.command()
def status(run_dir: str = typer.Argument(..., help="A run directory written by `anytrain train`.")) -> None:
    """How the run's last invocation ended, as one line and the exit code: 0 finished, 143 / 130 preempted (saved;
    requeue it with checkpoint.auto_resume or --resume), 3 stopped on an error (the line gives its message and the
    invocation's exit code), 1 killed hard or still running."""
    from anytrain.train.rundir import describe_status

    line, code = describe_status(Path(run_dir))
    typer.echo(line)
    raise typer.Exit(code)


@app.command("eval")
def evaluate(
    run_dir: str = typer.Argument(..., help="A run directory written by `anytrain train`."),
    prompt: str = typer.Option("ROMEO.\n", help="Text to continue in the generated sample."),
    max_new_tokens: int = typer.Option(60, help="Tokens to generate."),
    batches: int = typer.Option(0, help="Validation batches (0 = the run's train.eval_batches)."),
    seed: int = typer.Option(0, help="Sampling seed."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    data: str = typer.Option(None, "--data", help="Prepared dataset to evaluate on (default: the run's data.path)."),
    tasks: str = typer.Option(None, help="Downstream tasks, comma-separated: val, FILE.txt, FILE.jsonl or NAME."),
    num_fewshot: int = typer.Option(0, help="With --tasks / --lm-eval: solved examples before each item."),
    limit: int = typer.Option(0, help="With --tasks / --lm-eval: items (text: windows) per task; 0 = all."),
    task_dir: str = typer.Option("data/tasks", help="Where --tasks NAME finds NAME.jsonl."),
    batch_size: int = typer.Option(16, help="With --tasks / --lm-eval: sequences per forward pass."),
    lm_eval: str = typer.Option(None, "--lm-eval", help="lm-evaluation-harness tasks, comma-separated."),
    include_path: str = typer.Option(None, help="With --lm-eval: a folder of local task YAMLs."),
) -> None:
    """Validation loss of a run's newest checkpoint and a generated sample; with --tasks / --lm-eval, downstream
    tasks instead (docs/evaluation.md)."""
    if tasks or lm_eval:
        from anytrain.evals.commands import eval_tasks

        eval_tasks(run_dir, tasks, lm_eval, include_path, num_fewshot, limit, task_dir, batch_size, data, json_out)
        return
    from anytrain.evals import evaluate_run

    result = evaluate_run(run_dir, prompt=prompt, max_new_tokens=max_new_tokens, batches=batches, seed=seed,
                          data=data)  # fmt: skip
    if json_out:
        typer.echo(json.dumps(result, indent=1))
        return
    typer.echo(f"checkpoint:  {result['checkpoint']} (step {result['step']})")
    typer.echo(f"val loss:    {result['val_loss']:.4f} (perplexity {result['val_ppl']:.1f}) "
               f"over {result['val_tokens']:,} tokens")  # fmt: skip
    for name, loss in result["val_loss_per_source"].items():
        typer.echo(f"  {name}: {loss:.4f}")
    typer.echo("sample:\n" + result["sample"])


@app.command("export-checkpoint")
def export_checkpoint(
    run_dir: str = typer.Argument(..., help="A run directory written by `anytrain train`."),
    out: str = typer.Option(..., "--out", "-o", help="Output file, ending in .safetensors (config: <name>.json)."),
    checkpoint: str = typer.Option(None, help="A specific checkpoint directory (default: the newest committed)."),
    dtype: str = typer.Option("fp32", help="Weights dtype in the file: fp32 or bf16."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file and its .json."),
) -> None:
    """Consolidate a sharded DCP checkpoint into one safetensors file (plus <out>.json with the model config)."""
    from anytrain.evals import export_run

    path = export_run(run_dir, out, checkpoint=checkpoint, dtype=dtype, overwrite=overwrite)
    typer.echo(f"wrote {path} and {path.with_suffix('.json')}")


def _register_plan() -> None:
    from anytrain.cost.cli import plan_command

    app.command("plan", help="Rank parallel layouts by predicted memory, step time and energy before a run.")(
        plan_command
    )


_register_plan()


def _register_evals() -> None:
    from anytrain.evals.commands import register

    register(app)  # export, compare


_register_evals()


def _register_launch() -> None:
    from anytrain.launch.cli import launch_app

    app.add_typer(launch_app, name="launch")


_register_launch()


@app.command()
def doctor(
    out: str = typer.Option(None, "--json", "--out", help="Write the report as JSON here (rank 0)."),
    suite: str = typer.Option("full", help="quick (inventory, GEMM, collectives, p2p, small sweep) or full (adds "
                              "ceilings, every sweep to --max-mib, tiny trainings, checkpoint kill-restart)."),
    expect_gpus: int = typer.Option(None, "--expect-gpus", help="GPUs every node must show (fail otherwise)."),
    expect_nodes: int = typer.Option(None, "--expect-nodes", help="Nodes the ranks must span (fail otherwise)."),
    min_bytes: int = typer.Option(8, "--min-bytes", help="Smallest message in the bandwidth sweeps, in bytes."),
    max_mib: int = typer.Option(1024, help="Largest message in the bandwidth sweeps, in MiB."),
    repeats: int = typer.Option(5, help="Timed repeats per size."),
    thresholds_file: str = typer.Option(None, "--thresholds", help="YAML or JSON mapping: threshold name -> value."),
    threshold: list[str] = typer.Option([], "--threshold", metavar="NAME=VALUE",
                                        help="One threshold, e.g. busbw_min_gb_per_s=150 (repeatable; after the file)"),
    work_dir: str = typer.Option(None, "--work-dir", help="Where the full suite's trainings write (default: a "
                                 "temporary folder); point it at the checkpoint file system to test that."),
) -> None:  # fmt: skip
    """Check hosts, devices, GEMMs, the collectives (exact values, #wrong per rank, busbw), every rank pair's links and,
    in the full suite, tiny trainings and a checkpoint kill-restart, under any launcher (torchrun, srun, mpirun);
    exits non-zero naming each failed rank and check (docs/cluster.md)."""
    from anytrain.doctor import run_doctor
    from anytrain.doctor.thresholds import load_thresholds

    thresholds = load_thresholds(thresholds_file, threshold)
    report = run_doctor(out, max_mib, repeats, suite, expect_gpus, expect_nodes, min_bytes, thresholds, work_dir)
    failures = report["failures"]
    if failures:
        more = f"; ... {len(failures) - 10} more in the report" if len(failures) > 10 else ""
        raise AnytrainError(f"doctor: {len(failures)} check(s) failed: " + "; ".join(failures[:10]) + more)


@app.command()
def info() -> None:
    """Devices, backends, versions and the peak FLOP/s anytrain will use for MFU."""
    from anytrain import hardware

    device = hardware.resolve_device("auto")
    typer.echo(json.dumps(hardware.summary(device), indent=1))


def main() -> None:
    try:
        code = app(standalone_mode=False)  # a command's typer.Exit(code) comes back as its return value
    except AnytrainError as exc:  # a clean stop (SIGTERM / SIGINT, checkpoint saved) is not an error: "stopped: ..."
        print(f"{'stopped' if getattr(exc, 'clean_stop', False) else 'error'}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # usage errors of typer's click (the click package, or the copy newer typers vendor)
        kinds = {c.__name__ for c in type(exc).__mro__}
        if "Exit" in kinds and hasattr(exc, "exit_code"):
            sys.exit(exc.exit_code)
        if "ClickException" in kinds:
            exc.show()
            sys.exit(exc.exit_code)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
