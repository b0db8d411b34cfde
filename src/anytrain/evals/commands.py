"""CLI verbs of the evaluation package (``anytrain export``, ``anytrain compare``), registered by ``cli.py``; the work
is done in ``evals/hf.py``, ``evals/hf_export.py`` and ``evals/compare.py``."""

from __future__ import annotations

import typer


def export_command(
    source: str = typer.Argument(..., help="A run directory, or one of its checkpoints/step_* directories."),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (created; refused if it holds other files)."),
    format: str = typer.Option("hf", "--format", help="Output format: hf (transformers' from_pretrained folder)."),
    dtype: str = typer.Option("fp32", help="Weights dtype: fp32 or bf16."),
    tokenizer: str = typer.Option(None, help="tokenizer.json to ship (default: the one in the run's data.path)."),
    max_shard_size: str = typer.Option("5GB", help="Largest safetensors file; bigger models are sharded."),
    overwrite: bool = typer.Option(False, help="Replace an earlier `anytrain export` in --out."),
) -> None:
    """Write a checkpoint as a Hugging Face model folder: safetensors, config.json, generation_config.json and the
    tokenizer (loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained)."""
    from anytrain.errors import RunDirError
    from anytrain.evals.hf_export import export_hf, parse_size

    if format != "hf":
        raise RunDirError(f"--format: expected hf, got {format!r} (anytrain's own format: export-checkpoint)")
    path = export_hf(source, out, dtype=dtype, overwrite=overwrite, tokenizer=tokenizer,
                     max_shard_bytes=parse_size(max_shard_size))  # fmt: skip
    typer.echo(f"wrote {path} (transformers: AutoModelForCausalLM.from_pretrained({str(path)!r}))")


def _split(entries: str | None) -> list[str]:
    return [e.strip() for e in (entries or "").split(",") if e.strip()]


def eval_tasks(run_dir: str, tasks: str | None, lm_eval: str | None, include_path: str | None, num_fewshot: int,
               limit: int, task_dir: str, batch_size: int, data: str | None, json_out: bool) -> None:  # fmt: skip
    """``anytrain eval RUN --tasks ... / --lm-eval ...``: score, write RUN/evals/<task>.json, print a table."""
    import json
    from pathlib import Path

    from anytrain.evals.tasks import evaluate_tasks, format_table, scorer_for_run

    results = []
    if tasks:
        results += evaluate_tasks(run_dir, _split(tasks), num_fewshot, limit, batch_size, task_dir, data)
    if lm_eval:
        from anytrain.evals.lm_eval_bridge import run_lm_eval

        scorer, _, path = scorer_for_run(run_dir, None, batch_size, data)
        table = run_lm_eval(scorer, _split(lm_eval), include_path, num_fewshot, limit)
        for task, metrics in table.items():
            result = {"task": task, "harness": "lm-eval", **metrics, "num_fewshot": num_fewshot, "limit": limit,
                      "checkpoint": str(path), "step": int(path.name.split("_")[-1])}  # fmt: skip
            (Path(run_dir) / "evals").mkdir(exist_ok=True)
            (Path(run_dir) / "evals" / f"{task}.json").write_text(json.dumps(result, indent=1))
            results.append(result)
    typer.echo(json.dumps(results, indent=1) if json_out else format_table(results))


def compare_command(
    runs: list[str] = typer.Argument(..., help="Two or more run directories; the first is the reference."),
    by: str = typer.Option("step", "--by", help="Align curves on: step or tokens (tokens seen)."),
    out: str = typer.Option(None, "--out", "-o", help="Write the curves as a PNG here (needs anytrain[plot])."),
    assert_within: float = typer.Option(
        None,
        "--assert-within",
        help="Fail (exit 1) when a loss differs from the reference's by more than this at a common step.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out PNG."),
) -> None:
    """Compare runs' training / validation loss curves (metrics.jsonl): differences and throughput tables."""
    import json

    from anytrain.evals.compare import check_within, compare_runs, format_report

    if assert_within is not None and assert_within < 0:
        check_within({}, assert_within)  # the one-line error, before any work
    result = compare_runs(runs, by=by, out=out, overwrite=overwrite)
    typer.echo(json.dumps(result, indent=1) if json_out else format_report(result))
    if assert_within is not None:
        check_within(result, assert_within)


def register(app: typer.Typer) -> None:
    """Add this package's verbs to the ``anytrain`` app."""
    app.command("export")(export_command)
    app.command("compare")(compare_command)
