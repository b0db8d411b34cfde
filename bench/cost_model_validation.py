"""Check the cost model against real runs: predicted vs measured peak memory and step time.

Runs anytrain recipes on this GPU host through bench/scaling.py's launcher (``torchrun -m anytrain train``, steady
state from the trainer's summary), or reuses the rows of one or more results files (``--reuse A.json B.json``: every
measured anytrain row; a later file's row replaces an earlier one of the same name), then predicts each run with
``anytrain.cost.estimate`` for the same model, layout, micro-batch, sequence and global batch.

Calibration — up to three constants, each fitted on ONE run, every other row is a prediction:
  - ``efficiency`` (achieved fraction of peak on the GEMM/attention arithmetic) on the 1.1B Transformer on one GPU
    (``--calibrate``, default t-1-g32);
  - ``host_op_us`` (the host's cost of one eager op, the launch floor of small eager models) on the tiny model
    (``--calibrate-host``, default v-tiny-1: the only host-bound run);
  - ``fp8_efficiency`` (achieved fraction of the dense FP8 peak on the FP8 GEMMs) on the 1.1B Transformer with
    ``train.fp8`` tensorwise on one GPU (``--calibrate-fp8``, default t-1-g32-fp8tw), when that row is measured.
``--add fp8`` adds the FP8 rows (the 1.1B recipe in each torchao recipe, on one GPU and FSDP on two), ``--add mamba2``
the Mamba-2 rows (configs/mamba2-1.3b.yaml: its full activation checkpointing, and none; FSDP on two GPUs).
Memory has no fitted constant. Pass criteria (issue #7): peak memory (allocator peak,
``torch.cuda.max_memory_allocated`` of rank 0) within ±10%, step time within ±20%. The fitted table is written as
an efficiency file that ``anytrain plan --efficiency-table`` reads.

    R=bench/results; PYTHONPATH=src python -m bench.cost_model_validation --reuse-only --reuse \\
        $R/scaling_nvidia-h200.json --doctor $R/doctor_2gpu_nvidia-h200.json $R/doctor_4gpu_nvidia-h200.json --markdown
    PYTHONPATH=src python -m bench.cost_model_validation --add fp8 mamba2 --tag fp8_mamba2 --markdown   # on GPUs
    python -m bench.cost_model_validation --plot bench/results/cost_model_validation_nvidia-h200.json
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench import scaling, scaling_analysis
from bench.scaling_cases import Case

RECIPES = {"transformer": "configs/1.1b.yaml", "mamba": "configs/mamba-1.4b.yaml"}
MEMORY_BAND, STEP_BAND = 0.10, 0.20

# Facts about recorded results files (in bench/results or its git history) that their rows do not carry:
# {file name: {row-name glob: extra overrides}}.
# The Mamba rows of the 2026-11-22 H200 scaling files ran before `train.compile: true` entered
# configs/mamba-1.4b.yaml: their peaks and rates equal bench/mamba_train.py's *uncompiled* run of the same shape
# (50.36 GiB and 27.4k tokens/s; compiled: 47.36 GiB, 31.1k) to 0.01 GiB. Every Mamba row recorded so far also ran
# before the recipe's bf16 residual stream (`model.args.residual_in_fp32: false`): fp32 residual.
# --no-as-run predicts them as recorded.
_UNCOMPILED = (
    "scaling_nvidia-h200_2gpu_main.json",
    "scaling_nvidia-h200_2gpu_rerun.json",
    "scaling_nvidia-h200_4gpu.json",
    "scaling_nvidia-h200.json",
)
_FP32_RESIDUAL = _UNCOMPILED + (
    "scaling_nvidia-h200_4gpu_s5.json",
    "scaling_nvidia-h200_ab0_gc50_1.json",
    "scaling_nvidia-h200_ab0_gcauto_1.json",
    "scaling_nvidia-h200_ab0_nosync_1.json",
    "scaling_nvidia-h200_ab_a1.json",
    "scaling_nvidia-h200_ab_a2.json",
    "scaling_nvidia-h200_ab_lagged_1.json",
    "scaling_nvidia-h200_ab_p1.json",
    "scaling_nvidia-h200_ab_p2.json",
    "scaling_nvidia-h200_ab_sync_1.json",
    "scaling_nvidia-h200_group.json",
    "scaling_nvidia-h200_mamba_accum.json",
    "scaling_nvidia-h200_mamba_v5.json",
    "scaling_nvidia-h200_weak_repeat.json",
)
AS_RUN: dict[str, dict[str, list[str]]] = {
    name: {
        "m-*": (["--train.compile", "false"] if name in _UNCOMPILED else []) + ["--model.args.residual_in_fp32", "true"]
    }
    for name in _FP32_RESIDUAL
}


def default_cases() -> list[Case]:
    """Small to large on one GPU, then FSDP. Names match bench/scaling.py rows so --reuse can pick them up."""
    t = "transformer"
    return [
        Case("t-1-g32", t, 1, "single", 32, studies=("calibration",)),
        Case("v-tiny-1", t, 1, "single", 16, micro=16, seq=256, recipe="configs/tiny.yaml", studies=("calibration",)),
        Case("v-125m-1", t, 1, "single", 64, micro=16, seq=1024, recipe="configs/125m.yaml"),
        Case("t-fsdp-2-g32", t, 2, "fsdp", 32),
        Case("t-fsdp-4-g32", t, 4, "fsdp", 32),
        Case("t-ddp-2-g32", t, 2, "ddp", 32),
        Case("t-hsdp2x2-4-g32", t, 4, "hsdp", 32, dp_replicate=2),
    ]


FP8_RECIPES = {"tw": "tensorwise", "rw": "rowwise", "gw": "rowwise_with_gw_hp"}


def fp8_cases() -> list[Case]:
    """The 1.1B recipe with ``train.fp8``: each recipe on one GPU (tensorwise: the fp8_efficiency fit), tensorwise
    (FP8 all-gather) and rowwise (bf16 all-gather) under FSDP on two GPUs."""
    t = "transformer"
    one = [Case(f"t-1-g32-fp8{k}", t, 1, "single", 32, extra=["--train.fp8", v]) for k, v in FP8_RECIPES.items()]
    two = [Case(f"t-fsdp-2-g32-fp8{k}", t, 2, "fsdp", 32, extra=["--train.fp8", FP8_RECIPES[k]]) for k in ("tw", "rw")]
    return one + two


def mamba2_cases() -> list[Case]:
    """configs/mamba2-1.3b.yaml at global batch 16: as the recipe reads (full activation checkpointing), without
    checkpointing at micro-batch 2, and FSDP on two GPUs."""
    recipe, m2 = "configs/mamba2-1.3b.yaml", "mamba2"
    no_ac = ["--train.activation_checkpointing", "none"]
    return [
        Case("m2-1-g16-ac", m2, 1, "single", 16, micro=4, recipe=recipe),
        Case("m2-1-g16", m2, 1, "single", 16, micro=2, recipe=recipe, extra=no_ac),
        Case("m2-fsdp-2-g16-ac", m2, 2, "fsdp", 16, micro=4, recipe=recipe),
    ]


EXTRA_CASES = {"fp8": fp8_cases, "mamba2": mamba2_cases}


# ---------------------------------------------------------------------------------------------------------------------
# Rows -> cost-model inputs (the same mapping as bench/scaling.py's launcher)


def as_run_overrides(row: dict, use_as_run: bool, extra: dict[str, list[str]]) -> list[str]:
    out: list[str] = []
    table = {**(AS_RUN.get(row.get("source_file", ""), {}) if use_as_run else {}), **extra}
    for pattern, overrides in table.items():
        if fnmatch.fnmatch(row["name"], pattern):
            out += overrides
    return out


def row_config(row: dict, use_as_run: bool = True, extra: dict[str, list[str]] | None = None):
    """The RunConfig a row trained with: recipe + the row's layout and overrides (+ the as-run facts)."""
    return scaling_analysis.run_config(row, as_run_overrides(row, use_as_run, extra or {}))


def predict_row(row: dict, device, use_as_run: bool = True, extra: dict[str, list[str]] | None = None):
    overrides = as_run_overrides(row, use_as_run, extra or {})
    return scaling_analysis.predict_row(row, device, overrides), row_config(row, use_as_run, extra).train.compile


def measured_step(row: dict) -> float:
    return row["global_batch"] * row["seq"] / row["tokens_per_s"]


def predict(
    rows: list[dict],
    device_key: str,
    gpus_per_node: int,
    calibrate: str,
    calibrate_host: str | None = None,
    use_as_run: bool = True,
    extra: dict[str, list[str]] | None = None,
    measured: dict[str, float] | None = None,
    calibrate_fp8: str | None = None,
) -> dict:
    """Adds ``predicted`` to every measured row; returns the fitted table {device: {efficiency, host_op_us[,
    fp8_efficiency]}}. ``calibrate``: the run the GEMM efficiency is fitted on; ``calibrate_host`` (optional): a
    host-bound run the host cost per eager op is fitted on (else the device table's value); ``calibrate_fp8``
    (optional): a compute-bound FP8 run the FP8 GEMMs' efficiency is fitted on (else the bf16 efficiency)."""
    from anytrain.cost import get_device
    from anytrain.cost.model import fit_efficiency, fit_fp8_efficiency, fit_host_op_us

    device = get_device(device_key).replace(gpus_per_node=gpus_per_node, **(measured or {}))
    by_name = {r["name"]: r for r in rows if "tokens_per_s" in r}
    if calibrate not in by_name:
        raise SystemExit(f"error: the calibration run {calibrate!r} has no measurement; run it or pass --reuse")
    # efficiency first (compute-bound run), then the host cost per op on the host-bound run with that efficiency
    fitted = device.replace(
        efficiency=fit_efficiency(
            predict_row(by_name[calibrate], device, use_as_run, extra)[0], measured_step(by_name[calibrate])
        )
    )
    if calibrate_host in by_name:
        host_est = predict_row(by_name[calibrate_host], fitted, use_as_run, extra)[0]
        if host_est.host_s >= host_est.compute_s:
            fitted = fitted.replace(host_op_us=fit_host_op_us(host_est, measured_step(by_name[calibrate_host])))
    if calibrate_fp8 in by_name:
        fp8_est = predict_row(by_name[calibrate_fp8], fitted, use_as_run, extra)[0]
        if fp8_est.fp8_gemm_s:
            fitted = fitted.replace(fp8_efficiency=fit_fp8_efficiency(fp8_est, measured_step(by_name[calibrate_fp8])))
    for row in rows:
        if "tokens_per_s" not in row or row.get("layout") == "hf-ddp":
            continue
        e, compiled = predict_row(row, fitted, use_as_run, extra)
        m_step, m_mem = measured_step(row), row["peak_mem_gib"]
        row["predicted"] = {
            "step_s": e.step_s,
            "compute_s": e.compute_s,
            "elementwise_s": e.elementwise_s,
            "host_s": e.host_s,
            "bubble_s": e.bubble_s,
            "exposed_comm_s": e.exposed_comm_s,
            "optimizer_s": e.optimizer_s,
            "allocated_gib": e.allocated_gib,
            "memory_phase": e.memory_phase,
            "compiled": compiled,
            "memory_gib": {k: round(v, 3) for k, v in e.as_dict()["memory_gib"].items()},
            "measured_step_s": m_step,
            "measured_peak_gib": m_mem,
            "step_error": e.step_s / m_step - 1,
            "memory_error": e.allocated_gib / m_mem - 1,
            "fp8_gemm_s": e.fp8_gemm_s,
            "calibration_run": row["name"] in (calibrate, calibrate_fp8),
            "host_calibration_run": row["name"] == calibrate_host,
            "notes": e.notes,
        }
        row["predicted"]["step_ok"] = abs(row["predicted"]["step_error"]) <= STEP_BAND
        row["predicted"]["memory_ok"] = abs(row["predicted"]["memory_error"]) <= MEMORY_BAND
    return {
        device.key: {
            "efficiency": round(fitted.efficiency, 4),
            "host_op_us": round(fitted.host_op_us, 2),
            **({"fp8_efficiency": round(fitted.fp8_efficiency, 4)} if fitted.fp8_efficiency else {}),
            **{k: round(v, 3) for k, v in (measured or {}).items()},
        }
    }


def _layout_text(row: dict) -> str:
    lay = scaling_analysis.cost_layout(row)
    return f"{row['layout']} {lay.label.split()[0]} mb{row['micro']}×{row['global_batch'] // (lay.dp * row['micro'])}"


def print_table(rows: list[dict], markdown: bool = False) -> None:
    done = [r for r in rows if r.get("predicted")]
    if markdown:
        print(
            "\n| run | layout | measured GiB | predicted GiB | error | peak at | measured ms | predicted ms | error |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    else:
        head = (
            f"{'run':<22}{'layout':<24}{'meas GiB':>9}{'pred GiB':>9}{'err':>9} {'peak at':<10}{'meas ms':>9}"
            f"{'pred ms':>9}  {'err'}"
        )
        print("\n" + head + "\n" + "-" * len(head))
    for r in done:
        p = r["predicted"]
        fit = "fp8 efficiency fit" if r.get("extra") and "--train.fp8" in r["extra"] else "efficiency fit"
        mark = f" ({fit})" if p["calibration_run"] else " (host fit)" if p["host_calibration_run"] else ""
        mem_flag = "" if p["memory_ok"] else " ✗"
        step_flag = "" if p["step_ok"] or mark else " ✗"
        cells = (
            r["name"],
            _layout_text(r),
            f"{p['measured_peak_gib']:.2f}",
            f"{p['allocated_gib']:.2f}",
            f"{100 * p['memory_error']:+.1f}%{mem_flag}",
            p["memory_phase"],
            f"{1e3 * p['measured_step_s']:.1f}",
            f"{1e3 * p['step_s']:.1f}",
            f"{100 * p['step_error']:+.1f}%{step_flag}{mark}",
        )
        if markdown:
            print("| " + " | ".join(cells) + " |")
        else:
            print(
                f"{cells[0]:<22}{cells[1]:<24}{cells[2]:>9}{cells[3]:>9}{cells[4]:>9} {cells[5]:<10}{cells[6]:>9}"
                f"{cells[7]:>9}  {cells[8]}"
            )
    for r in rows:
        if not r.get("predicted") and r.get("layout") != "hf-ddp":
            print(f"{r['name']:<22} not predicted: {r.get('error', 'not run')[:100]!r}")
    mem = [abs(r["predicted"]["memory_error"]) for r in done]
    step = [
        abs(r["predicted"]["step_error"])
        for r in done
        if not (r["predicted"]["calibration_run"] or r["predicted"]["host_calibration_run"])
    ]
    if mem:
        print(
            f"\nmemory: {sum(m <= MEMORY_BAND for m in mem)}/{len(mem)} rows within ±10% (max |error| "
            f"{100 * max(mem):.1f}%); step time: {sum(s <= STEP_BAND for s in step)}/{len(step)} predicted rows "
            f"within ±20% (max |error| {100 * max(step):.1f}%)"
        )


def plot(payload: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if r.get("predicted")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key_m, key_p, band, unit in (
        (axes[0], "measured_peak_gib", "allocated_gib", MEMORY_BAND, "GiB"),
        (axes[1], "measured_step_s", "step_s", STEP_BAND, "s"),
    ):
        xs = [r["predicted"][key_m] for r in rows]
        ys = [r["predicted"][key_p] for r in rows]
        lo, hi = min(xs + ys) * 0.7, max(xs + ys) * 1.3
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.fill_between(
            [lo, hi],
            [lo * (1 - band), hi * (1 - band)],
            [lo * (1 + band), hi * (1 + band)],
            color="tab:green",
            alpha=0.15,
            label=f"±{int(band * 100)}%",
        )
        for r, x, y in zip(rows, xs, ys, strict=True):
            fit = r["predicted"]["calibration_run"] or r["predicted"].get("host_calibration_run")
            ax.scatter([x], [y], color="tab:red" if fit else "tab:blue")
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.legend(fontsize=8)
    axes[0].set_title("peak memory per GPU (allocator)", fontsize=9)
    axes[1].set_title(f"step time (red: calibration runs) — {payload['device']}", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def doctor_overrides(paths: list[str]) -> dict[str, float]:
    """Measured ceilings of this host from ``anytrain doctor`` results (independent of the validated rows): NCCL
    all-reduce bus bandwidth at the largest message (ring: time = 2(n-1)/n·M / busbw, what the cost model's
    ``intra_node_gb_per_s`` means), the latency = the smallest message's time minus its bandwidth term, and the
    achieved HBM copy bandwidth as ``hbm_efficiency``."""
    out: dict[str, float] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        sweep = sorted(data.get("collectives", {}).get("sweep", []), key=lambda s: s["bytes"])
        if sweep:
            n = data["collectives"]["world_size"]
            bus = sweep[-1]["busbw_gb_per_s"] * 1e9
            small = sweep[0]
            latency = small["seconds"] - 2 * (n - 1) / n * small["bytes"] / bus
            out["intra_node_gb_per_s"] = min(out.get("intra_node_gb_per_s", 1e9), bus / 1e9)
            out["intra_latency_us"] = max(out.get("intra_latency_us", 0.0), 1e6 * max(latency, 0.0) / 2)
        copy = data.get("ceilings", {}).get("copy_gb_per_s")
        hbm = {"H200": 4.8, "H100": 3.35}.get(next((k for k in ("H200", "H100") if k in json.dumps(data)), ""), 0)
        if copy and hbm:
            out["hbm_efficiency"] = min(out.get("hbm_efficiency", 1.0), copy / (hbm * 1e3))
    return out


def load_reused(paths: list[str]) -> dict[str, dict]:
    """Measured anytrain rows of several results files by name; a later file's row replaces an earlier one."""
    reused: dict[str, dict] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if "tokens_per_s" in row and row.get("layout") != "hf-ddp":
                reused[row["name"]] = {**row, "source_file": Path(path).name}
    return reused


def parse_overrides(items: list[str]) -> dict[str, list[str]]:
    """'m-*=--train.compile,false' -> {'m-*': ['--train.compile', 'false']}."""
    out: dict[str, list[str]] = {}
    for item in items:
        pattern, _, overrides = item.partition("=")
        if not overrides:
            raise SystemExit(f"error: --as-run {item!r}: expected ROW_GLOB=--key,value[,--key,value]")
        out[pattern] = overrides.split(",")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--reuse",
        nargs="+",
        default=[],
        help="bench/scaling.py results JSONs: their measured rows "
        "are taken instead of being run again (later files win on equal names)",
    )
    parser.add_argument("--reuse-only", action="store_true", help="run nothing: predict every reused row")
    parser.add_argument("--calibrate", default="t-1-g32", help="the run the efficiency is fitted on")
    parser.add_argument("--calibrate-host", default="v-tiny-1", help="the host-bound run host_op_us is fitted on")
    parser.add_argument("--calibrate-fp8", default="t-1-g32-fp8tw", help="the FP8 run fp8_efficiency is fitted on")
    parser.add_argument(
        "--add", nargs="*", default=[], choices=sorted(EXTRA_CASES), help="more rows: fp8 (train.fp8), mamba2"
    )
    parser.add_argument(
        "--no-as-run",
        action="store_true",
        help="predict rows from their recipes as recorded, without the AS_RUN facts about known results files",
    )
    parser.add_argument("--as-run", nargs="*", default=[], help="extra config overrides per row: ROW_GLOB=--key,value")
    parser.add_argument(
        "--doctor",
        nargs="*",
        default=[],
        help="`anytrain doctor` results of this host: use its "
        "measured NCCL bus bandwidth, latency and HBM copy rate instead of the datasheet",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/cost-model.md)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--serial", action="store_true")
    parser.add_argument("--budget-s", type=float, default=0.0)
    parser.add_argument("--job-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument(
        "--tag",
        default=None,
        help="suffix of the output files (default: 'reuse' with --reuse-only, "
        "so that predictions of recorded rows never overwrite a GPU run's results)",
    )
    parser.add_argument("--plot", default=None, help="only plot an existing results JSON")
    parser.add_argument("--png", default="docs/cost_model_validation.png")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.png))
        return
    n_gpus = scaling.gpu_count()
    if n_gpus == 0 and not args.reuse_only:
        sys.exit("error: bench/cost_model_validation.py needs GPUs; use --reuse-only to predict recorded rows")
    reused = load_reused(args.reuse)
    if args.reuse_only:
        rows = list(reused.values())
    else:
        cases = [c for c in [*default_cases(), *(c for k in args.add for c in EXTRA_CASES[k]())] if c.gpus <= n_gpus]
        to_run = [c for c in cases if c.name not in reused]
        ran = {r["name"]: r for r in scaling.run_cases(to_run, args, n_gpus)} if to_run else {}
        rows = [reused.get(c.name) or ran.get(c.name) or {**asdict(c), "error": "not run"} for c in cases]
        rows += [r for name, r in reused.items() if name not in {c.name for c in cases}]
    for row in rows:
        row.setdefault("recipe", "")
        row.setdefault("extra", [])
    from anytrain import hardware

    env = hardware.summary(hardware.resolve_device("auto"))
    device_name = next((r["device"] for r in rows if r.get("device")), env.get("device", ""))
    gpus_per_node = max([n_gpus, 1, *(r["gpus"] for r in rows)])
    table = predict(
        rows,
        "h200" if "H200" in device_name else "h100",
        gpus_per_node,
        args.calibrate,
        args.calibrate_host,
        not args.no_as_run,
        parse_overrides(args.as_run),
        doctor_overrides(args.doctor),
        args.calibrate_fp8,
    )
    print(f"fitted: {table}")
    print_table(rows, args.markdown)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    tag = args.tag if args.tag is not None else ("reuse" if args.reuse_only else "")
    slug += f"_{tag}" if tag else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device_name,
        "versions": env,
        "calibration": {
            "efficiency": args.calibrate,
            "host_op_us": args.calibrate_host,
            "fp8_efficiency": args.calibrate_fp8,
        },
        "efficiency_table": table,
        "reused_from": args.reuse,
        "as_run": not args.no_as_run,
        "rows": rows,
    }
    (out / f"cost_model_validation_{slug}.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / f"efficiency_{slug}.json").write_text(json.dumps(table, indent=1))
    print(f"\nwrote {out / f'cost_model_validation_{slug}.json'} and {out / f'efficiency_{slug}.json'}")


if __name__ == "__main__":
    main()
