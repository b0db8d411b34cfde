"""Projection report: the seed study's kind of table for GPT 175B and 1T on a Frontier-like MI250X system and on
H100 clusters — time and energy for 1× data (D = Ψ tokens) and 20× data (Chinchilla, D = 20·Ψ) — plus a
strong-scaling check against ORNL's published efficiencies.

A bench of the cost model alone (nothing runs on a device): the tables are the planner's predictions. Regenerate them
in docs/cost-model.md with::

    PYTHONPATH=src python -m bench.cost_projection --write docs/cost-model.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from anytrain.cost.devices import get_device
from anytrain.cost.model import MEGATRON, STRATEGIES, Estimate, ModelShape, Workload, seed_compute_flops, seed_time_s
from anytrain.cost.planner import plan
from anytrain.cost.shapes import shape_from_params

BEGIN, END = "<!-- projection:begin -->", "<!-- projection:end -->"

# (model params, global batch in sequences, [(system, devices)]); seq 2048.
CASES: list[tuple[float, int, list[tuple[str, int]]]] = [
    (175e9, 1536, [("frontier", 1024), ("dgx-h100", 1024)]),
    (1e12, 3072, [("frontier", 3072), ("dgx-h100", 3072)]),
]
SEQ = 2048


def _best(
    shape: ModelShape,
    system: str,
    gpus: int,
    batch: int,
    tokens: float,
    strategies: tuple[str, ...] = STRATEGIES,
    tp: int | None = None,
    pp: int | None = None,
) -> Estimate:
    device = get_device(system)
    wl = Workload(SEQ, batch, tokens=tokens, compiled=True)
    return plan(shape, device, gpus, wl, MEGATRON, strategies=strategies, tp=tp, pp=pp).recommended


def projection_rows() -> list[dict]:
    """One row per (model, system, variant): the planner's choice over all strategies, and the seed's 3D recipe
    (TP inside a node, PP, ZeRO-1 over the rest). Time and energy for 1× and 20× data."""
    rows = []
    for params, batch, systems in CASES:
        shape = shape_from_params(params)
        for system, gpus in systems:
            for variant, strategies in (("planner", STRATEGIES), ("3D ZeRO-1", ("zero1",))):
                best = _best(shape, system, gpus, batch, shape.num_params, strategies)
                row = {
                    "model": shape.name,
                    "params": shape.num_params,
                    "system": system,
                    "gpus": gpus,
                    "variant": variant,
                    "device": best.device.name,
                    "layout": best.layout.label,
                    "mb": best.layout.micro_batch,
                    "ac": best.layout.ac,
                    "mem_gib": best.required_gib,
                    "step_s": best.step_s,
                    "mfu": best.mfu,
                    "tflops_dev": best.mfu * best.device.peak_bf16_tflops,
                    "tflops_w": best.tflops_per_watt,
                    "comm_share": best.comm_share,
                }
                for factor in (1, 20):
                    tokens = factor * shape.num_params
                    total_s = -(-tokens // (batch * SEQ)) * best.step_s
                    naive = seed_time_s(
                        seed_compute_flops(shape.num_params, tokens),
                        gpus,
                        best.device.peak_flops,
                        best.device.efficiency,
                    )
                    row[f"days_{factor}x"] = total_s / 86400
                    row[f"naive_days_{factor}x"] = naive / 86400
                    row[f"mwh_{factor}x"] = total_s * gpus * best.device.avg_watts / 3.6e9
                rows.append(row)
    return rows


def strong_scaling(params: float, batch: int, system: str, counts: list[int]) -> list[dict]:
    """Fixed global batch and fixed model-parallel group (the planner's 3D ZeRO-1 choice at the smallest count),
    data parallelism grows; efficiency(N) = T(N0)·N0 / (T(N)·N)."""
    shape = shape_from_params(params)
    first = _best(shape, system, counts[0], batch, shape.num_params, ("zero1",))
    tp, pp = first.layout.tp, first.layout.pp
    out = []
    for n in counts:
        best = _best(shape, system, n, batch, shape.num_params, ("zero1",), tp=tp, pp=pp)
        eff = first.step_s * counts[0] / (best.step_s * n)
        out.append(
            {
                "gpus": n,
                "layout": best.layout.label,
                "mb": best.layout.micro_batch,
                "step_s": best.step_s,
                "efficiency": eff,
                "bubble_share": best.bubble_s / best.step_s,
                "comm_share": best.comm_share,
            }
        )
    return out


def markdown() -> str:
    lines = [
        "| model | system | devices | variant | layout (micro-batch, AC) | GiB/dev | step s | MFU | TFLOP/s/dev | "
        "TFLOP/s/W | 1× data: days (6PD) | 1× MWh | 20× data: days (6PD) | 20× MWh |",
        "|" + "---|" * 14,
    ]
    for r in projection_rows():
        lines.append(
            f"| {r['model']} | {r['system']} | {r['gpus']:,} | {r['variant']} | {r['layout']} ({r['mb']}, "
            f"{r['ac']}) | {r['mem_gib']:.1f} | {r['step_s']:.2f} | {100 * r['mfu']:.1f}% | "
            f"{r['tflops_dev']:.0f} | {r['tflops_w']:.3f} | {r['days_1x']:,.1f} ({r['naive_days_1x']:,.1f}) | "
            f"{r['mwh_1x']:,.0f} | {r['days_20x']:,.0f} ({r['naive_days_20x']:,.0f}) | {r['mwh_20x']:,.0f} |"
        )
    lines += [
        "",
        "Strong scaling at fixed global batch and fixed tp×pp, data parallelism growing (predicted; ORNL "
        "measured 89.9% for 175B at 1,024 GCDs and 87.05% for 1T at 3,072 GCDs):",
        "",
        "| model | system | devices | layout | micro-batch | step s | bubble | exposed comm | efficiency |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for params, batch, counts in ((175e9, 1536, [128, 256, 512, 1024]), (1e12, 3072, [1024, 2048, 3072])):
        name = "GPT 175B" if params < 1e12 else "GPT 1T"
        for r in strong_scaling(params, batch, "frontier", counts):
            lines.append(
                f"| {name} | frontier | {r['gpus']:,} | {r['layout']} | {r['mb']} | {r['step_s']:.2f} | "
                f"{100 * r['bubble_share']:.1f}% | {100 * r['comm_share']:.1f}% | "
                f"{100 * r['efficiency']:.1f}% |"
            )
    return "\n".join(lines)


def write_into(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: markers {BEGIN} / {END} not found")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="Replace the table between the projection markers in this file.")
    args = parser.parse_args()
    text = markdown()
    if args.write:
        write_into(args.write, text)
    else:
        print(text)


__all__ = ["projection_rows", "strong_scaling", "markdown"]

if __name__ == "__main__":
    main()
