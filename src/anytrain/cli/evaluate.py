"""``anytrain eval`` and ``anytrain compare``: a run's validation loss, sample and downstream tasks
(``evals/__init__.py``, ``evals/tasks.py``, ``evals/lm_eval_bridge.py``), and loss curves of several runs side by side
(``evals/compare.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


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
        _eval_tasks(run_dir, tasks, lm_eval, include_path, num_fewshot, limit, task_dir, batch_size, data, json_out)
        return
    from anytrain.evals import evaluate_run

    result = evaluate_run(run_dir, prompt=prompt, max_new_tokens=max_new_tokens, batches=batches, seed=seed, data=data)
    if json_out:
        typer.echo(json.dumps(result, indent=1))
        return
    typer.echo(f"checkpoint:  {result['checkpoint']} (step {result['step']})")
    typer.echo(
        f"val loss:    {result['val_loss']:.4f} (perplexity {result['val_ppl']:.1f}) "
        f"over {result['val_tokens']:,} tokens"
    )
    for name, loss in result["val_loss_per_source"].items():
        typer.echo(f"  {name}: {loss:.4f}")
    typer.echo("sample:\n" + result["sample"])


def _split(entries: str | None) -> list[str]:
    return [e.strip() for e in (entries or "").split(",") if e.strip()]


def _eval_tasks(
    run_dir: str,
    tasks: str | None,
    lm_eval: str | None,
    include_path: str | None,
    num_fewshot: int,
    limit: int,
    task_dir: str,
    batch_size: int,
    data: str | None,
    json_out: bool,
) -> None:
    """``anytrain eval RUN --tasks ... / --lm-eval ...``: score, write RUN/evals/<task>.json, print a table."""
    from anytrain.evals.tasks import evaluate_tasks, format_table, scorer_for_run

    results = []
    if tasks:
        results += evaluate_tasks(run_dir, _split(tasks), num_fewshot, limit, batch_size, task_dir, data)
    if lm_eval:
        from anytrain.evals.lm_eval_bridge import run_lm_eval

        scorer, _, path = scorer_for_run(run_dir, None, batch_size, data)
        table = run_lm_eval(scorer, _split(lm_eval), include_path, num_fewshot, limit)
        for task, metrics in table.items():
            result = {
                "task": task,
                "harness": "lm-eval",
                **metrics,
                "num_fewshot": num_fewshot,
                "limit": limit,
                "checkpoint": str(path),
                "step": int(path.name.split("_")[-1]),
            }
            (Path(run_dir) / "evals").mkdir(exist_ok=True)
            (Path(run_dir) / "evals" / f"{task}.json").write_text(json.dumps(result, indent=1))
            results.append(result)
    typer.echo(json.dumps(results, indent=1) if json_out else format_table(results))


def compare(
    runs: list[str] = typer.Argument(..., help="Two or more run directories; the first is the reference."),
    by: str = typer.Option("step", "--by", help="Align curves on: step or tokens (tokens seen)."),
    out: str = typer.Option(None, "--out", "-o", help="Write the curves as a PNG here (needs anytrain[plot])."),
    assert_within: float = typer.Option(
        None,
        "--assert-within",
        help="Fail (exit 1) when a loss differs from the reference's by more than this at a common step "
        "(with --final: in the final smoothed loss or the last val_loss).",
    ),
    assert_metric: str = typer.Option(
        "both",
        "--assert-metric",
        help="Which losses --assert-within checks: loss (training), val_loss or both.",
    ),
    final: int = typer.Option(
        None,
        "--final",
        help="Also compare the final smoothed loss (mean of the last N logged losses) and the last val_loss.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out PNG."),
) -> None:
    """Compare runs' training / validation loss curves (metrics.jsonl): differences and throughput tables."""
    from anytrain.evals.compare import ASSERT_METRICS, check_within, compare_runs, format_report

    if assert_within is not None and (assert_within < 0 or assert_metric not in ASSERT_METRICS):
        check_within({}, assert_within, assert_metric)  # the one-line error, before any work
    result = compare_runs(runs, by=by, out=out, overwrite=overwrite, final=final)
    typer.echo(json.dumps(result, indent=1) if json_out else format_report(result))
    if assert_within is not None:
        check_within(result, assert_within, assert_metric)


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate)
    app.command("compare")(compare)
