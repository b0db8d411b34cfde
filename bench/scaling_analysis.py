"""The analysis half of the scaling study (bench/scaling.py): weak / strong efficiencies against same-shape
baselines, the cost model's predictions per row, the merge of several results files (repeats of one host folded into
their median), the results table and the plot. Pure functions of result rows: no GPU needed.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from bench.scaling_cases import LEGACY_DDP_BUCKET_MB, MODEL_NAMES, RECIPES, ROOT, default_cases, layout_overrides


def shape_key(row: dict) -> tuple:
    """What makes two rows the same training problem apart from GPUs and batch: model, recipe, sequence length and
    micro-batch (HF + DDP runs the 1.1B recipe's shape). Efficiency baselines and HF references must share it."""
    return (row["model"], row.get("recipe") or RECIPES[row["model"]], row["seq"], row["micro"])


def add_efficiencies(rows: list[dict]) -> None:
    """Weak / strong scaling efficiency and the ratio to HF + DDP, with the name of each reference row.

    weak: vs the 1-GPU row of the same stack and shape whose global batch is this row's per-GPU batch (dp == GPUs
    only); strong: vs the 1-GPU row of the same stack and shape at the same global batch; vs HF + DDP: per-GPU
    tokens/s vs the HF row of the same shape on as many GPUs, at the same global batch when there is one
    (``vs_hf_ddp_batch_matched`` says whether it was), else the HF row of that GPU count."""
    good = [r for r in rows if "tokens_per_s_per_gpu" in r]

    def base(row: dict, global_batch: int) -> dict | None:
        """The same-shape 1-GPU row; for a model-parallel row whose micro-batch one GPU cannot hold (TP at 16), the
        1-GPU row of the same model, recipe and sequence at another micro-batch (its name is recorded as the ref)."""
        hf = row["layout"] == "hf-ddp"
        found = [
            r
            for r in good
            if r["gpus"] == 1
            and (r["layout"] == "hf-ddp") == hf
            and shape_key(r) == shape_key(row)
            and r["global_batch"] == global_batch
        ]
        if not found and (row["tp"] > 1 or row["pp"] > 1):
            found = [
                r
                for r in good
                if r["gpus"] == 1
                and (r["layout"] == "hf-ddp") == hf
                and shape_key(r)[:3] == shape_key(row)[:3]
                and r["global_batch"] == global_batch
            ]
        return found[0] if found else None

    for r in good:
        hf = r["layout"] == "hf-ddp"
        per_gpu_batch = r["global_batch"] // r["gpus"] if r["dp"] == r["gpus"] else -1
        for study, ref in (("weak", base(r, per_gpu_batch)), ("strong", base(r, r["global_batch"]))):
            r[f"{study}_efficiency"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"] if ref else None
            r[f"{study}_ref"] = ref["name"] if ref else None
        hf_rows = [
            x
            for x in good
            if x["layout"] == "hf-ddp" and x["gpus"] == r["gpus"] and not hf and shape_key(x) == shape_key(r)
        ]
        same_batch = [x for x in hf_rows if x["global_batch"] == r["global_batch"]]
        ref = (same_batch or hf_rows or [None])[0]
        r["vs_hf_ddp_same_gpus"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"] if ref else None
        r["vs_hf_ddp_ref"] = ref["name"] if ref else None
        r["vs_hf_ddp_batch_matched"] = bool(same_batch) if ref else None


def cost_layout(row: dict, cfg=None):
    """The cost model's Layout of a row: what the trainer builds from the row's config (``run_config``, or ``cfg``)
    on its number of GPUs."""
    from anytrain.cost import Layout
    from anytrain.parallel.data_parallel import resolve_strategy
    from anytrain.parallel.mesh import ParallelDims

    cfg = cfg or run_config(row)
    dims = ParallelDims.from_config(cfg.parallel, row["gpus"])
    return Layout.from_config(cfg, dims, resolve_strategy(cfg, dims), row["micro"])


def run_config(case: dict, overrides: list[str] | tuple[str, ...] = ()):
    """The RunConfig a row trained with (recipe + the row's layout and options + ``overrides``), for the cost
    model."""
    from anytrain.config import load_config

    recipe = case.get("recipe") or RECIPES[case["model"]]
    layout = case["layout"]
    degrees = (case.get("tp", 1), case.get("pp", 1), case.get("dp_replicate", 1))
    args = [] if layout == "hf-ddp" else layout_overrides(layout, *degrees)
    args += [
        *case.get("extra", []),
        "--data.seq_len",
        str(case["seq"]),
        "--train.global_batch",
        str(case["global_batch"]),
        "--train.micro_batch",
        str(case["micro"]),
        *overrides,
    ]
    return load_config(ROOT / recipe, [o for o in args if o not in ("--device", "cpu")])


def predict_row(row: dict, device, overrides: list[str] | tuple[str, ...] = ()):
    """anytrain.cost.estimate for the model, layout and batch of one row (its config + ``overrides``)."""
    from anytrain.cost import Workload, estimate
    from anytrain.cost.shapes import shape_from_config

    cfg = run_config(row, overrides)  # the bucket size the row recorded (rows from before the field: PyTorch's)
    wl = Workload.from_config(cfg, ddp_bucket_mib=row.get("ddp_bucket_mb") or LEGACY_DDP_BUCKET_MB)
    return estimate(shape_from_config(cfg), cost_layout(row, cfg), wl, device)


def add_predictions(rows: list[dict], device_key: str, gpus_per_node: int, calibrate: str = "t-1-g32") -> None:
    """Planner predictions for every anytrain row: catalogue efficiency, and efficiency fitted on ONE run (the 1.1B
    Transformer on one GPU) — the other rows, Mamba included, are predictions."""
    from anytrain.cost import get_device
    from anytrain.cost.model import fit_efficiency

    device = get_device(device_key).replace(gpus_per_node=gpus_per_node)
    candidates = [r for r in rows if r["layout"] != "hf-ddp"]
    calib = next((r for r in candidates if r["name"] == calibrate and "tokens_per_s" in r), None)
    fitted = None
    if calib:
        measured = calib["global_batch"] * calib["seq"] / calib["tokens_per_s"]
        fitted = device.replace(efficiency=fit_efficiency(predict_row(calib, device), measured))
    for r in candidates:
        r["predicted"] = {}
        for label, dev in (("catalogue", device), ("calibrated", fitted)):
            if dev is None:
                continue
            try:
                est = predict_row(r, dev)
            except Exception as exc:  # a row the cost model cannot take must not cost the file its measured rows
                r["predicted"][label] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            pred = {
                "step_s": est.step_s,
                "allocated_gib": est.allocated_gib,
                "efficiency": dev.efficiency,
                "exposed_comm_s": est.exposed_comm_s,
                "bubble_s": est.bubble_s,
                "host_s": est.host_s,
                "elementwise_s": est.elementwise_s,
                "calibration_run": r["name"] == calibrate,
            }
            if "tokens_per_s" in r:
                measured = r["global_batch"] * r["seq"] / r["tokens_per_s"]
                pred["measured_step_s"] = measured
                pred["step_error"] = est.step_s / measured - 1
                pred["memory_error"] = est.allocated_gib / r["peak_mem_gib"] - 1 if r.get("peak_mem_gib") else None
            r["predicted"][label] = pred


DERIVED = (
    "weak_efficiency",
    "strong_efficiency",
    "weak_ref",
    "strong_ref",
    "vs_hf_ddp_same_gpus",
    "vs_hf_ddp_ref",
    "vs_hf_ddp_batch_matched",
    "predicted",
)


def _outcome(row: dict) -> dict:
    got = {"tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"]} if "tokens_per_s_per_gpu" in row else {}
    return {"source": row.get("source"), **(got or {"error": row.get("error", "not run")})}


def merge_rows(sources: list[tuple[str, dict]]) -> list[dict]:
    """One row per case name from several results files (``(file name, payload)``, oldest first): a later file's row
    replaces an earlier one of the same name, except that an error row never replaces a measured row, and measured
    runs of one case from files of the same ``host`` (one machine lease, run after run) are repeats: the row is their
    median run (the lower middle one for an even count) with every run's rate in ``repeat_tokens_per_s_per_gpu``.
    Each kept row records its ``source`` file, ``machine`` and ``date``, and the runs of the same case it was preferred
    to (``other_runs``); derived columns are dropped, to be recomputed on the merged set."""
    merged: dict[str, dict] = {}
    repeats: dict[str, list[dict]] = {}  # name -> measured runs of the kept row's host
    for src, payload in sources:
        machine = f"{payload.get('gpus_on_host', '?')}x {payload.get('device', '?')}"
        for row in payload["rows"]:
            new = {k: v for k, v in row.items() if k not in DERIVED and k != "other_runs"}
            new.update(source=src, machine=machine, date=payload.get("date"), host=payload.get("host"))
            name, old = row["name"], merged.get(row["name"])
            if old is None:
                merged[name] = new
                repeats[name] = [new] if "tokens_per_s_per_gpu" in new else []
            elif "tokens_per_s_per_gpu" in old and "tokens_per_s_per_gpu" not in new:
                old.setdefault("other_runs", []).append(_outcome(new))  # a failed rerun keeps the measurement
            elif "tokens_per_s_per_gpu" in old and new["host"] is not None and new["host"] == old["host"]:
                runs = [*repeats[name], new]
                repeats[name] = runs
                rates = [r["tokens_per_s_per_gpu"] for r in runs]
                median = next(r for r in runs if r["tokens_per_s_per_gpu"] == statistics.median_low(rates))
                merged[name] = {**median, "repeat_tokens_per_s_per_gpu": rates, "other_runs": old.get("other_runs", [])}
            else:
                replaced = repeats[name] or [old]  # every run of the replaced host
                new["other_runs"] = [*old.get("other_runs", []), *map(_outcome, replaced)]
                merged[name] = new
                repeats[name] = [new] if "tokens_per_s_per_gpu" in new else []
    canonical = {c.name: i for i, c in enumerate(default_cases(1 << 10))}

    def order(r: dict) -> tuple:  # anytrain Transformer, HF + DDP, Mamba, then the cost-model validation rows
        group = 3 if r.get("recipe") else 1 if r["layout"] == "hf-ddp" else 0 if r["model"] == "transformer" else 2
        return group, r["gpus"], canonical.get(r["name"], len(canonical)), r["name"]

    return sorted(merged.values(), key=order)


def merge_payloads(sources: list[tuple[str, dict]], notes: list[str] | tuple[str, ...] = ()) -> dict:
    """The merged results: rows (``merge_rows``), efficiencies and cost-model predictions recomputed on them."""
    rows = merge_rows(sources)
    add_efficiencies(rows)
    payloads = [p for _, p in sources]
    devices = sorted({p.get("device") or "" for p in payloads})
    gpus_per_node = max(p.get("gpus_on_host") or 1 for p in payloads)
    device_key = "h200" if "H200" in devices[0] else "h100"
    add_predictions(rows, device_key, gpus_per_node)
    by_name = {r["name"]: r for r in rows}
    auto = []
    if len(devices) > 1:
        auto.append(f"sources ran on different devices: {devices}")
    cross: dict[tuple[str, str], list[str]] = {}  # (row file, reference file) -> "row (kind ref)"
    for r in rows:
        refs = {k: r.get(f"{k}_ref") for k in ("weak", "strong")} | {"vs HF": r.get("vs_hf_ddp_ref")}
        for kind, n in refs.items():
            if n and n != r["name"] and by_name[n]["source"] != r["source"]:
                cross.setdefault((r["source"], by_name[n]["source"]), []).append(f"{r['name']} ({kind} {n})")
    for (src, ref_src), items in cross.items():
        auto.append(
            f"reference rows from another results file (another run; merged_from names the machines): {src} "
            f"rows against {ref_src}: {', '.join(items)}"
        )
    loose = [f"{r['name']} vs {r['vs_hf_ddp_ref']}" for r in rows if r.get("vs_hf_ddp_batch_matched") is False]
    if loose:
        auto.append(
            "vs HF + DDP at a different global batch (no HF row of the same batch on that GPU count): "
            + ", ".join(loose)
        )
    dates = sorted({p.get("date") for p in payloads})
    versions = [p.get("versions") for p in payloads]
    settings = [p.get("settings") for p in payloads]
    return {
        "date": dates[0] if len(dates) == 1 else dates,
        "device": devices[0] if len(devices) == 1 else devices,
        "gpus_on_host": gpus_per_node,
        "versions": versions[0] if all(v == versions[0] for v in versions) else versions,
        "settings": settings[0] if all(s == settings[0] for s in settings) else settings,
        "merged_from": [
            {
                "file": src,
                "machine": f"{p.get('gpus_on_host')}x {p.get('device')}",
                "date": p.get("date"),
                "rows_kept": [r["name"] for r in rows if r["source"] == src],
                "rows_not_kept": [r["name"] for r in p["rows"] if by_name[r["name"]]["source"] != src],
            }
            for src, p in sources
        ],
        "analysis": {
            "recomputed_by": "bench/scaling.py --merge",
            "cost_model_device": device_key,
            "gpus_per_node": gpus_per_node,
            "calibration_run": "t-1-g32",
        },
        "notes": [*notes, *auto],
        "rows": rows,
    }


def print_table(rows: list[dict]) -> None:
    """The results table; ``host`` is the machine a merged row came from, ``~`` marks a vs-HF ratio taken against an
    HF row of another global batch."""
    head = (
        f"{'case':<20}{'GPUs':>5}{'layout':>8}{'gbs':>5}{'acc':>4}{'tok/s/GPU':>11}{'MFU':>7}{'GiB':>7}"
        f"{'weak':>7}{'strong':>8}{'vs HF':>8}{'pred err':>9}{'host':>6}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    pct = lambda v: "" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for r in rows:
        host = r["machine"].split("x")[0] + "x" if r.get("machine") else ""
        if "tokens_per_s_per_gpu" not in r:
            print(f"{r['name']:<20}{r['gpus']:>5}{r['layout']:>8}  {r.get('error', 'not run')[:120]!r}")
            continue
        pred = (r.get("predicted") or {}).get("calibrated", {}).get("step_error")
        vs = r.get("vs_hf_ddp_same_gpus")
        vs = "" if vs is None else f"{vs:.2f}x" + ("~" if r.get("vs_hf_ddp_batch_matched") is False else " ")
        print(
            f"{r['name']:<20}{r['gpus']:>5}{r['layout']:>8}{r['global_batch']:>5}{r['accum']:>4}"
            f"{r['tokens_per_s_per_gpu']:>11,.0f}{pct(r.get('mfu')):>7}{r['peak_mem_gib']:>7.1f}"
            f"{pct(r.get('weak_efficiency')):>7}{pct(r.get('strong_efficiency')):>8}{vs:>8}"
            f"{'' if pred is None else format(100 * pred, '+.0f') + '%':>9}{host:>6}"
        )


LAYOUT_STYLE = {
    "fsdp": ("FSDP", "tab:blue", "o"),
    "zero2": ("ZeRO-2", "tab:orange", "s"),
    "zero1": ("ZeRO-1", "tab:green", "D"),
    "ddp": ("DDP", "tab:red", "^"),
    "hsdp": ("HSDP 2x2", "tab:purple", "v"),
    "tp": ("TP", "tab:brown", "P"),
    "pp": ("PP", "tab:pink", "X"),
}


def row_variant(row: dict) -> str:
    """The label suffix of a row's option variant: FSDP kept gathered through accumulation, blocks per FSDP unit;
    profiled rows (``--profile.*``) are not plotted."""
    extra = " ".join(row.get("extra", []))
    out = " gathered" if "reshard_during_accumulation false" in extra else ""
    group = re.search(r"fsdp_group_blocks (\d+)", extra)
    return out + (f", {group.group(1)} blocks/unit" if group else "") + (" profiled" if "--profile." in extra else "")


def variant_styles(rows: list[dict]) -> list:
    """(layout, variant) -> (name, color, marker) for every layout in LAYOUT_STYLE and each variant present."""
    out = []
    for layout, style in LAYOUT_STYLE.items():
        variants = sorted({row_variant(r) for r in rows if r["layout"] == layout} | {""})
        out += [((layout, v), style) for v in variants if "profiled" not in v]
    return out


def plot_series(rows: list[dict], model: str) -> list[dict]:
    """Lines for one model's panel: per layout, the 1-GPU run at the study's global batch then the layout's rows at
    that batch (labelled with strong efficiency); FSDP and HF + DDP also at a fixed per-GPU batch (weak efficiency)."""
    rows = [r for r in rows if "tokens_per_s_per_gpu" in r and r["model"] == model and not r.get("recipe")]
    singles = {r["global_batch"]: r for r in rows if r["gpus"] == 1 and r["layout"] == "single"}
    strong_gbs = max(singles, default=None)
    series = []
    for (layout, variant), (name, color, marker) in variant_styles(rows):
        mine = sorted(
            (r for r in rows if r["layout"] == layout and row_variant(r) == variant and r["gpus"] > 1),
            key=lambda r: r["gpus"],
        )
        name = f"{name}{variant}"
        strong = [r for r in mine if r["global_batch"] == strong_gbs]
        if strong:
            untied = any("tie_embeddings" in " ".join(r.get("extra", [])) for r in strong)
            series.append(
                {
                    "label": f"{name}{' (untied emb.)' if untied else ''}, {strong_gbs} seq global",
                    "rows": [singles[strong_gbs], *strong],
                    "eff": "strong",
                    "color": color,
                    "marker": marker,
                    "style": "-" if not variant else "-.",
                }
            )
        weak_batches = {r["global_batch"] // r["gpus"] for r in mine if r["global_batch"] != strong_gbs}
        for b in sorted(weak_batches & set(singles)):
            weak = [r for r in mine if r["dp"] == r["gpus"] and r["global_batch"] == b * r["gpus"]]
            series.append(
                {
                    "label": f"{name}, {b} seq per GPU",
                    "rows": [singles[b], *weak],
                    "eff": "weak",
                    "color": color,
                    "marker": marker,
                    "style": ":",
                }
            )
    hf = sorted((r for r in rows if r["layout"] == "hf-ddp"), key=lambda r: r["gpus"])
    if hf:
        b = hf[0]["global_batch"] // hf[0]["gpus"]
        series.append(
            {
                "label": f"HF + DDP, {b} seq per GPU",
                "rows": hf,
                "eff": "weak",
                "color": "dimgray",
                "marker": "o",
                "style": "--",
            }
        )
    return series


def plot(payload: dict, png: Path) -> None:
    """Per-GPU tokens/s against GPUs, one panel per model, efficiency labels at each multi-GPU point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    models = [m for m in MODEL_NAMES if any(r["model"] == m and "tokens_per_s_per_gpu" in r for r in rows)]
    widths = [1.6 if m == "transformer" else 1.0 for m in models]  # the Transformer panel has more lines and labels
    fig, axes = plt.subplots(
        1, len(models), figsize=(6.6 * sum(widths), 7.2), squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for ax, model in zip(axes[0], models, strict=True):
        series = plot_series(rows, model)
        labels: dict[int, list[tuple[float, str, str]]] = {}
        for s in series:
            xs = [r["gpus"] for r in s["rows"]]
            ys = [r["tokens_per_s_per_gpu"] / 1e3 for r in s["rows"]]
            ax.plot(
                xs,
                ys,
                linestyle=s["style"],
                marker=s["marker"],
                color=s["color"],
                label=s["label"],
                linewidth=2.2 if s["color"] == "dimgray" else 1.6,
                markersize=7,
            )
            for r in s["rows"][1:]:
                eff = r.get(f"{s['eff']}_efficiency")
                if eff is not None:
                    name = s["label"].split(",")[0].replace(" (untied emb.)", "")
                    text = f"{name} {100 * eff:.1f}% {s['eff']}"
                    if r.get("vs_hf_ddp_batch_matched"):  # the ratio only where HF ran the same batch
                        text += f", {r['vs_hf_ddp_same_gpus']:.2f}x HF"
                    labels.setdefault(r["gpus"], []).append((r["tokens_per_s_per_gpu"] / 1e3, text, s["color"]))
        top = max((r["tokens_per_s_per_gpu"] / 1e3 for s in series for r in s["rows"]), default=1.0) * 1.12
        gap = top * 0.042
        for gpus, items in labels.items():  # spread the labels of one GPU count so that none overlap
            items.sort()
            placed: list[float] = []
            for y, _, _ in items:
                placed.append(max(y, placed[-1] + gap) if placed else y)
            shift = max(0.0, placed[-1] - (top - gap / 2))
            for (y, text, color), ly in zip(items, placed, strict=True):
                ax.annotate(
                    text,
                    (gpus, y),
                    xytext=(gpus * 1.1, ly - shift),
                    fontsize=8.5,
                    color=color,
                    va="center",
                    bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9},
                    arrowprops={"arrowstyle": "-", "color": color, "lw": 0.6},
                    zorder=5,
                )
        counts = sorted({r["gpus"] for s in series for r in s["rows"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlim(0.85, max(counts) * 2.3)
        ax.set_ylim(0, top)
        ax.set_xlabel("GPUs (one host, NVLink)")
        ax.set_ylabel("tokens/s per GPU (thousands), seq 2048")
        ax.set_title(f"anytrain {MODEL_NAMES[model]}" + (" vs HF + DDP (dashed)" if model == "transformer" else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    date = payload.get("date")
    date = ", ".join(date) if isinstance(date, list) else date
    fig.suptitle(
        f"Per-GPU throughput and scaling efficiency: {payload.get('device')}, {date} "
        "(strong: vs 1 GPU at the same global batch; weak: vs 1 GPU at the same per-GPU batch)",
        fontsize=10,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")
