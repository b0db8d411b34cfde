"""``anytrain compare RUN_A RUN_B ...``: training and validation loss curves of runs side by side.

Curves come from each run's ``metrics.jsonl`` (``train`` records: ``loss``; ``eval`` records: ``val_loss``; a step
logged twice, as after a resume, keeps its last value; records a resumed run replaced are dropped:
``train.rundir.read_metrics``), aligned on the optimizer step or on tokens seen. Every run is
compared with the first: the largest and the mean absolute difference over the x values both logged. With
``final`` = N the runs are also compared on their final smoothed loss (the mean of the last N logged training
losses) and their last validation loss, and ``assert_within`` then applies to those two figures only (the check of a
convergence run against a reference: step-by-step noise of two numerics is larger than their end-of-run gap);
without it, ``assert_within`` applies to every common point. A larger difference makes the command fail (exit 1).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anytrain.diskio import remove, temp_sibling
from anytrain.errors import AnytrainError, RunDirError
from anytrain.train.rundir import read_metrics

METRICS = ("loss", "val_loss")
PLOT_INSTALL_HINT = "pip install 'anytrain[plot]'"


class CurvesDiverge(AnytrainError):
    """A compared run differs from the reference by more than ``--assert-within``."""

    exit_code = 1


@dataclass
class RunCurves:
    name: str
    curves: dict[str, dict[float, float]] = field(default_factory=dict)  # metric -> {x: value}
    throughput: dict[str, Any] = field(default_factory=dict)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise RunDirError(f"{run_dir}: no metrics.jsonl; is this a directory written by `anytrain train`?")
    return read_metrics(run_dir)  # after a resume: the records of the resumed run replace those it logged again


def load_curves(run_dir: str | Path, by: str = "step") -> RunCurves:
    """A run's loss curves keyed by step or tokens seen (eval records get the tokens of their step, from the train
    records' tokens per step) and its median throughput figures."""
    if by not in ("step", "tokens"):
        raise RunDirError(f"--by: expected step or tokens, got {by!r}")
    run_dir = Path(run_dir)
    records = _records(run_dir)
    train = [r for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    tokens_per_step = train[-1]["tokens_seen"] / train[-1]["step"] if train and train[-1].get("step") else None
    out = RunCurves(run_dir.name)
    for metric, kind in (("loss", "train"), ("val_loss", "eval")):
        curve: dict[float, float] = {}
        for r in records:
            if r.get("kind") != kind or r.get(metric) is None:
                continue
            if by == "step":
                x = r["step"]
            elif "tokens_seen" in r:
                x = r["tokens_seen"]
            elif tokens_per_step is not None:
                x = round(r["step"] * tokens_per_step)
            else:
                continue
            curve[x] = float(r[metric])
        out.curves[metric] = dict(sorted(curve.items()))
    for key in ("tokens_per_s", "mfu", "peak_mem_gib"):
        values = [r[key] for r in train if isinstance(r.get(key), int | float)]
        out.throughput[key] = statistics.median(values) if values else None
    out.throughput["steps"] = train[-1]["step"] if train else 0
    return out


def differences(reference: RunCurves, other: RunCurves) -> dict[str, dict[str, Any]]:
    """Per metric: points logged by both, max and mean |other - reference| over them (None without any)."""
    out = {}
    for metric in METRICS:
        ref, cur = reference.curves.get(metric, {}), other.curves.get(metric, {})
        common = sorted(set(ref) & set(cur))
        gaps = [abs(cur[x] - ref[x]) for x in common]
        out[metric] = {
            "points": len(common),
            "max_abs": max(gaps) if gaps else None,
            "mean_abs": sum(gaps) / len(gaps) if gaps else None,
        }
    return out


def final_values(run: RunCurves, window: int) -> dict[str, float | None]:
    """The final smoothed training loss (mean of the last ``window`` logged losses) and the last validation loss."""
    losses = list(run.curves.get("loss", {}).values())[-window:]
    vals = list(run.curves.get("val_loss", {}).values())
    return {"loss": sum(losses) / len(losses) if losses else None, "val_loss": vals[-1] if vals else None}


def compare_runs(
    run_dirs: list[str | Path],
    by: str = "step",
    out: str | Path | None = None,
    overwrite: bool = False,
    final: int | None = None,
) -> dict[str, Any]:
    """Curves, differences against the first run and throughput of each run; with ``final`` = N, each run's final
    smoothed loss and last validation loss and their differences from the reference's (key ``final``); writes the PNG
    ``out`` if given (an existing file only with ``overwrite``)."""
    if len(run_dirs) < 2:
        raise RunDirError("compare: give at least two run directories")
    if final is not None and final < 1:
        raise RunDirError(f"--final: the number of last logged losses to average must be >= 1, got {final}")
    if out is not None:
        check_plot_path(Path(out), overwrite)
    runs = [load_curves(r, by) for r in run_dirs]
    names = _unique_names(run_dirs)
    for run, name in zip(runs, names, strict=True):
        run.name = name
    diffs = {run.name: differences(runs[0], run) for run in runs[1:]}
    result = {
        "by": by,
        "reference": runs[0].name,
        "differences": diffs,
        "throughput": {run.name: run.throughput for run in runs},
    }
    if final is not None:
        values = {run.name: final_values(run, final) for run in runs}
        ref = values[runs[0].name]
        result["final"] = {
            "window": final,
            "values": values,
            "differences": {
                run.name: {
                    m: None if ref[m] is None or values[run.name][m] is None else abs(values[run.name][m] - ref[m])
                    for m in METRICS
                }
                for run in runs[1:]
            },
        }
    if out is not None:
        result["plot"] = str(plot_curves(runs, by, Path(out)))
    return result


def check_plot_path(out: Path, overwrite: bool) -> None:
    """``--out`` must name a .png file, and one that does not exist yet unless ``overwrite``."""
    if out.suffix.lower() != ".png":
        raise RunDirError(f"--out: {out} must end in .png (the curves are written as a PNG image)")
    if out.is_dir():
        raise RunDirError(f"--out: {out} is a directory; pass a .png file name")
    if out.exists() and not overwrite:
        raise RunDirError(f"--out: {out} exists; pass --overwrite to replace it")


def _unique_names(run_dirs: list[str | Path]) -> list[str]:
    names = [Path(r).name for r in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(r) for r in run_dirs]


ASSERT_METRICS = ("loss", "val_loss", "both")


def check_within(result: dict[str, Any], limit: float, metric: str = "both") -> None:
    """Raise ``CurvesDiverge`` (exit 1) when a run's loss differs from the reference's by more than ``limit`` at a
    common point (with ``final``: in the final smoothed loss or the last validation loss), or when nothing is
    compared. ``metric``: which curves the check reads, ``loss`` (training), ``val_loss`` or ``both``."""
    if limit < 0:
        raise RunDirError(f"--assert-within: must be >= 0, got {limit}")
    if metric not in ASSERT_METRICS:
        raise RunDirError(f"--assert-metric: expected loss, val_loss or both, got {metric!r}")
    checked = ("loss", "val_loss") if metric == "both" else (metric,)
    compared, reference = 0, result["reference"]
    if "final" in result:
        window = result["final"]["window"]
        for name, per_metric in result["final"]["differences"].items():
            for metric, gap in per_metric.items():
                if gap is None or metric not in checked:
                    continue
                compared += 1
                if gap > limit:
                    what = f"final smoothed loss (last {window})" if metric == "loss" else "last val_loss"
                    raise CurvesDiverge(
                        f"{name}: {what} differs from {reference}'s by {gap:.4g} (> --assert-within {limit:g})"
                    )
        if not compared:
            raise CurvesDiverge(f"--assert-within: {reference} and the other runs log no loss to compare")
        return
    for name, per_metric in result["differences"].items():
        for metric, d in per_metric.items():
            if d["max_abs"] is None or metric not in checked:
                continue
            compared += 1
            if d["max_abs"] > limit:
                raise CurvesDiverge(
                    f"{name}: {metric} differs from {reference} by up to {d['max_abs']:.4g} "
                    f"(> --assert-within {limit:g}) over {d['points']} points"
                )
    if not compared:
        raise CurvesDiverge(f"--assert-within: no step is logged by both {reference} and the other runs")


def plot_curves(runs: list[RunCurves], by: str, out: Path) -> Path:
    """One PNG: train loss and validation loss against step or tokens, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AnytrainError(f"--out needs matplotlib: {PLOT_INSTALL_HINT}") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, METRICS, strict=True):
        for run in runs:
            curve = run.curves.get(metric, {})
            if curve:
                ax.plot(list(curve), list(curve.values()), label=run.name, marker="." if len(curve) < 30 else None)
        ax.set_xlabel("tokens seen" if by == "tokens" else "step")
        ax.set_ylabel(metric)
        ax.set_title({"loss": "training loss", "val_loss": "validation loss"}[metric])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_sibling(out)  # a failed write leaves an earlier PNG as it was
    try:
        fig.savefig(temp, dpi=120, format="png")
        temp.replace(out)
    finally:
        plt.close(fig)
        remove(temp)
    return out


def format_report(result: dict[str, Any]) -> str:
    """The differences table (each run against the reference) and the throughput table."""
    lines = [
        f"against {result['reference']} (by {result['by']}):",
        f"{'run':<24} {'metric':<9} {'points':>6} {'max |d|':>10} {'mean |d|':>10}",
    ]
    for name, per_metric in result["differences"].items():
        for metric, d in per_metric.items():
            fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
            lines.append(f"{name:<24} {metric:<9} {d['points']:>6} {fmt(d['max_abs']):>10} {fmt(d['mean_abs']):>10}")
    lines += ["", f"{'run':<24} {'steps':>6} {'tokens/s':>12} {'MFU':>7} {'peak GiB':>9}"]
    for name, t in result["throughput"].items():
        tps = "-" if t["tokens_per_s"] is None else f"{t['tokens_per_s']:,.0f}"
        mfu = "-" if t["mfu"] is None else f"{100 * t['mfu']:.1f}%"
        mem = "-" if t["peak_mem_gib"] is None else f"{t['peak_mem_gib']:.2f}"
        lines.append(f"{name:<24} {t['steps']:>6} {tps:>12} {mfu:>7} {mem:>9}")
    if "final" in result:
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        window, values = result["final"]["window"], result["final"]["values"]
        lines += ["", f"{'run':<24} {f'loss (last {window})':>16} {'|d|':>8} {'last val_loss':>14} {'|d|':>8}"]
        for name, v in values.items():
            d = result["final"]["differences"].get(name, {"loss": None, "val_loss": None})
            lines.append(
                f"{name:<24} {fmt(v['loss']):>16} {fmt(d['loss']):>8} {fmt(v['val_loss']):>14} {fmt(d['val_loss']):>8}"
            )
    if "plot" in result:
        lines.append(f"\nplot: {result['plot']}")
    return "\n".join(lines)
