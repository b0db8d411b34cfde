"""Check the cost model against real runs: predicted vs measured peak memory and step time.

Runs anytrain recipes on this GPU host through bench/scaling.py's launcher (``torchrun -m anytrain train``, steady
state from the trainer's summary), or reuses matching rows of a scaling results file (``--reuse``), then predicts
each run with ``anytrain.cost.estimate`` for the same model, layout, micro-batch, sequence and global batch.

Calibration: the efficiency (achieved fraction of peak on a step's compute) is fitted on ONE run, the 1.1B
Transformer on one GPU (``--calibrate``); every other run is a prediction. Pass criteria (issue #7): peak memory
(allocator peak, ``torch.cuda.max_memory_allocated`` of rank 0) within ±10%, step time within ±20%.
The fitted table is written as an efficiency file that ``anytrain plan --efficiency-table`` and
``$ANYTRAIN_EFFICIENCY_TABLE`` read.

    PYTHONPATH=src python bench/cost_model_validation.py --reuse bench/results/scaling_nvidia-h200.json
    python bench/cost_model_validation.py --plot bench/results/cost_model_validation_nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import scaling  # noqa: E402  (bench/scaling.py: launcher and row format)


def default_cases() -> list[scaling.Case]:
    """Small to large on one GPU, then FSDP. Names match bench/scaling.py rows so --reuse can pick them up."""
    t = "transformer"
    return [
        scaling.Case("t-1-g32", t, 1, "single", 32, studies=("calibration",)),
        scaling.Case("v-tiny-1", t, 1, "single", 16, micro=16, seq=256, recipe="configs/tiny.yaml"),
        scaling.Case("v-125m-1", t, 1, "single", 64, micro=16, seq=1024, recipe="configs/125m.yaml"),
        scaling.Case("t-fsdp-2-g32", t, 2, "fsdp", 32),
        scaling.Case("t-fsdp-4-g32", t, 4, "fsdp", 32),
        scaling.Case("t-ddp-2-g32", t, 2, "ddp", 32),
        scaling.Case("t-hsdp2x2-4-g32", t, 4, "hsdp", 32, dp_replicate=2),
    ]


def predict(rows: list[dict], device_key: str, gpus_per_node: int, calibrate: str) -> dict:
    """Adds ``predicted`` to every row; returns the fitted efficiency table."""
    from anytrain.cost import get_device
    from anytrain.cost.model import fit_efficiency

    device = get_device(device_key).replace(gpus_per_node=gpus_per_node)
    est = scaling.predict_row

    def measured_step(row: dict) -> float:
        return row["global_batch"] * row["seq"] / row["tokens_per_s"]

    calib = next((r for r in rows if r["name"] == calibrate and "tokens_per_s" in r), None)
    if calib is None:
        raise SystemExit(f"error: the calibration run {calibrate!r} has no measurement; run it or pass --reuse")
    fitted = device.replace(efficiency=fit_efficiency(est(calib, device), measured_step(calib)))
    for row in rows:
        if "tokens_per_s" not in row:
            continue
        e = est(row, fitted)
        m_step, m_mem = measured_step(row), row["peak_mem_gib"]
        row["predicted"] = {
            "step_s": e.step_s, "compute_s": e.compute_s, "exposed_comm_s": e.exposed_comm_s,
            "allocated_gib": e.allocated_gib,
            "memory_gib": {k: round(v, 3) for k, v in e.as_dict()["memory_gib"].items()},
            "measured_step_s": m_step, "measured_peak_gib": m_mem,
            "step_error": e.step_s / m_step - 1, "memory_error": e.allocated_gib / m_mem - 1,
            "calibration_run": row["name"] == calibrate,
        }  # fmt: skip
        row["predicted"]["step_ok"] = abs(row["predicted"]["step_error"]) <= 0.20
        row["predicted"]["memory_ok"] = abs(row["predicted"]["memory_error"]) <= 0.10
    return {device.key: {"efficiency": round(fitted.efficiency, 4)}}


def print_table(rows: list[dict]) -> None:
    head = f"{'run':<16}{'GPUs':>5}{'meas GiB':>10}{'pred GiB':>10}{'err':>7}{'meas ms':>10}{'pred ms':>10}{'err':>7}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        p = r.get("predicted")
        if not p:
            print(f"{r['name']:<16}{r['gpus']:>5}  {r.get('error', 'not run')[:120]!r}")
            continue
        mark = " (calibration)" if p["calibration_run"] else ""
        print(f"{r['name']:<16}{r['gpus']:>5}{p['measured_peak_gib']:>10.2f}{p['allocated_gib']:>10.2f}"
              f"{100 * p['memory_error']:>+6.0f}%{1e3 * p['measured_step_s']:>10.0f}{1e3 * p['step_s']:>10.0f}"
              f"{100 * p['step_error']:>+6.0f}%{mark}")  # fmt: skip


def plot(payload: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if r.get("predicted")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key_m, key_p, band, unit in ((axes[0], "measured_peak_gib", "allocated_gib", 0.10, "GiB"),
                                         (axes[1], "measured_step_s", "step_s", 0.20, "s")):  # fmt: skip
        xs = [r["predicted"][key_m] for r in rows]
        ys = [r["predicted"][key_p] for r in rows]
        lo, hi = min(xs + ys) * 0.7, max(xs + ys) * 1.3
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)],
                        color="tab:green", alpha=0.15, label=f"±{int(band * 100)}%")  # fmt: skip
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.scatter([x], [y], color="tab:red" if r["predicted"]["calibration_run"] else "tab:blue")
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.legend(fontsize=8)
    axes[0].set_title("peak memory per GPU (allocator)", fontsize=9)
    axes[1].set_title(f"step time (red: calibration run) — {payload['device']}", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reuse", default=None, help="a bench/scaling.py results JSON: rows with the same name are "
                        "taken from it instead of being run again")  # fmt: skip
    parser.add_argument("--reuse-only", action="store_true", help="run nothing: predict the reused rows only")
    parser.add_argument("--calibrate", default="t-1-g32", help="the run the efficiency is fitted on")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--serial", action="store_true")
    parser.add_argument("--budget-s", type=float, default=0.0)
    parser.add_argument("--job-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--plot", default=None, help="only plot an existing results JSON")
    parser.add_argument("--png", default="docs/cost_model_validation.png")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.png))
        return
    n_gpus = scaling.gpu_count()
    if n_gpus == 0 and not args.reuse_only:
        sys.exit("error: bench/cost_model_validation.py needs GPUs; use --plot to redraw a results file")
    reused = {}
    if args.reuse:
        reused = {r["name"]: r for r in json.loads(Path(args.reuse).read_text())["rows"] if "tokens_per_s" in r}
    cases = [c for c in default_cases() if c.gpus <= max(n_gpus, 4 if args.reuse_only else 0)]
    to_run = [c for c in cases if c.name not in reused and not args.reuse_only]
    ran = {r["name"]: r for r in scaling.run_cases(to_run, args, n_gpus)} if to_run else {}
    rows = [reused.get(c.name) or ran.get(c.name) or {**asdict(c), "error": "not run"} for c in cases]
    for row, case in zip(rows, cases, strict=True):
        row.setdefault("recipe", case.recipe)
        row.setdefault("extra", case.extra)
    from anytrain import hardware

    env = hardware.summary(hardware.resolve_device("auto"))
    device_name = next((r["device"] for r in rows if r.get("device")), env.get("device", ""))
    table = predict(rows, "h200" if "H200" in device_name else "h100", max(n_gpus, 1), args.calibrate)
    print_table(rows)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "device": device_name, "versions": env,
               "calibration": args.calibrate, "efficiency_table": table, "reused_from": args.reuse,
               "rows": rows}  # fmt: skip
    (out / f"cost_model_validation_{slug}.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / f"efficiency_{slug}.json").write_text(json.dumps(table, indent=1))
    print(f"\nwrote {out / f'cost_model_validation_{slug}.json'} and {out / f'efficiency_{slug}.json'}")


if __name__ == "__main__":
    main()
