"""The planner's answers as text (``anytrain plan``'s tables, the job sizing with its overrides and sbatch line) and
the durations it reads (``--deadline``, ``--time``) and writes (SLURM's D-HH:MM:SS)."""

from __future__ import annotations

import math
import re
import shlex

from anytrain.cost.devices import Device
from anytrain.cost.planner import PlanResult, SizingResult, trainer_overrides
from anytrain.cost.shapes import Mamba2Shape, MambaShape, ModelShape, Workload
from anytrain.errors import ConfigError


def format_duration(seconds: float) -> str:
    """A training time as minutes, hours or days, one decimal."""
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


SLURM_TIME_FORMS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 04:00:00)"


def slurm_time_seconds(text: str) -> float | None:
    """Seconds of a SLURM time limit in any of sbatch's forms (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS;
    infinite / unlimited = math.inf), None when ``text`` is none of them (surrounding whitespace included: the text
    goes into an #SBATCH line as it is)."""
    value = text.lower()
    if value in ("infinite", "unlimited"):
        return math.inf
    match = re.fullmatch(r"([0-9]+)-([0-9]+)(?::([0-9]+))?(?::([0-9]+))?", value)
    if match:
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    match = re.fullmatch(r"([0-9]+)(?::([0-9]+))?(?::([0-9]+))?", value)
    if match:
        parts = [int(g) for g in match.groups() if g is not None]
        hours, minutes, seconds = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
        return float((hours * 60 + minutes) * 60 + seconds)
    return None


def parse_duration(text: str, flag: str = "--deadline") -> float:
    """Seconds from '36h', '30d', '90min', '45m', '600s' or any of SLURM's time forms (``slurm_time_seconds``: a
    bare number is minutes, as sbatch reads it); a duration that does not end is refused."""
    value = text.strip().lower()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)", value)
    if match:
        return float(match.group(1)) * {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}[match.group(2)]
    seconds = slurm_time_seconds(value)
    if seconds == math.inf:
        raise ConfigError(f"{flag}: {text!r} does not end; the job is sized to finish by a time: give e.g. 36h")
    if seconds is None:
        raise ConfigError(f"{flag}: {text!r} is not a duration; write e.g. 36h, 30d, 90min or 2-00:00:00")
    return seconds


def slurm_time(seconds: float) -> str:
    """SLURM's D-HH:MM:SS, rounded up to the minute."""
    minutes = math.ceil(seconds / 60)
    return f"{minutes // 1440}-{minutes // 60 % 24:02d}:{minutes % 60:02d}:00"


def format_table(result: PlanResult, top: int, price: float | None) -> str:
    """The ``top`` ranked layouts of ``result`` (with a cost column at ``price`` per device-hour), the recommendation
    and what the columns count."""
    head = (
        f"{'#':>2}  {'layout':<28} {'mb':>3} {'AC':<4} {'GiB/dev':>8} {'step s':>8} {'comm':>5} {'grad MiB':>8} "
        f"{'MFU':>5} {'total':>8} {'MWh':>8}" + (f" {'cost':>10}" if price else "")
    )
    lines = [head]
    for i, e in enumerate(result.ranked[:top], 1):
        lay = e.layout
        row = (
            f"{i:>2}  {lay.label:<28} {lay.micro_batch:>3} {lay.ac:<4} {e.required_gib:>8.1f} {e.step_s:>8.3f} "
            f"{100 * e.comm_share:>4.0f}% {e.grad_reduce_bytes / 2**20:>8.1f} {100 * e.mfu:>4.0f}% "
            f"{format_duration(e.total_s):>8} "
            f"{e.energy_j / 3.6e9:>8.2f}"
        )
        if price:
            row += f" {price * e.world * e.total_s / 3600:>10,.0f}"
        lines.append(row)
    best = result.recommended
    lines.append(
        f"recommended: {best.layout.label}, micro-batch {best.layout.micro_batch}, AC {best.layout.ac} — "
        f"{result.reason}"
    )
    lines.append(
        f"({len(result.ranked)} layouts fit, {result.infeasible} do not; memory = allocator peak × "
        f"(1 + fragmentation) + overhead; grad MiB = bytes per device handed to the gradient reduction per step; "
        f"MFU counts model FLOPs only)"
    )
    return "\n".join(lines)


def format_fp8_variants(variants: list[dict], wl: Workload) -> str:
    """One line per FP8 recipe (``planner.fp8_variants``): its best layout, step time and predicted speed-up over the
    table's best, or why the trainer would refuse it; empty when there is none."""
    lines = []
    for v in variants:
        if "refused" in v:
            lines.append(f"--fp8 {v['fp8']}: refused: {v['refused']}")
            continue
        lines.append(
            f"--fp8 {v['fp8']}: {v['layout']}, micro-batch {v['micro_batch']}, AC {v['ac']}: {v['step_s']:.3f} s per "
            f"step, {v['speedup']:.2f}x the {wl.fp8 if wl.fp8 != 'none' else 'bf16'} plan "
            f"({v['converted_per_block']} of {v['candidates_per_block']} linears per block in FP8, "
            f"train.fp8_filter {wl.fp8_filter}; MFU stays against the bf16 peak)"
        )
    return "\n".join(lines)


def format_sizing(sized: SizingResult, config: str | None, wl: Workload) -> str:
    """The counts tried, the choice and why, the train overrides and the sbatch line."""
    lines = [
        f"{'devices':>8} {'nodes':>6}  {'layout':<26} {'mb':>3} {'AC':<4} {'step s':>9} {'total':>9} {'device-h':>11}"
    ]
    for row in sized.tried:
        if row["fits"]:
            lines.append(
                f"{row['gpus']:>8} {row['nodes']:>6}  {row['layout']:<26} {row['micro_batch']:>3} "
                f"{row['ac']:<4} {row['step_s']:>9.3f} {format_duration(row['total_s']):>9} "
                f"{row['gpu_hours']:>11,.0f}"
            )
        else:
            lines.append(f"{row['gpus']:>8} {row['nodes']:>6}  does not fit: {row['why'][:80]}")
    per_node = min(sized.gpus, sized.best.device.gpus_per_node)
    overrides = shlex.join(trainer_overrides(sized.best))
    lines += [
        f"chosen: {sized.reason}",
        f"{wl.tokens / 1e9:,.1f}B tokens = {sized.best.steps:,} steps of {wl.global_batch} x {wl.seq_len}",
        f"overrides: {overrides}",
        f"sbatch: anytrain launch slurm {config or 'CONFIG'} --nodes {sized.nodes} --gpus-per-node {per_node} "
        f"--time {slurm_time(1.1 * sized.best.total_s)} -- {overrides}",
    ]
    return "\n".join(lines)


def format_plan_header(shape: ModelShape | MambaShape | Mamba2Shape, device: Device, gpus: int, wl: Workload) -> str:
    """One line above the table: the model, the devices and the workload."""
    return (
        f"{shape.name or 'model'}: {shape.num_params / 1e9:.3f}B parameters, L={shape.n_layers} d={shape.dim}"
        f" | {gpus} x {device.name} ({device.gpus_per_node}/node, efficiency {device.efficiency:.2f}, "
        f"{device.avg_watts:.0f} W) | seq {wl.seq_len}, global batch {wl.global_batch}, grad compression "
        f"{wl.grad_compression}, {(wl.tokens or 20 * shape.num_params) / 1e9:,.1f}B tokens"
        + (f", FP8 {wl.fp8} (filter {wl.fp8_filter})" if wl.fp8 != "none" else "")
    )
