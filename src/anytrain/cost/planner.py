"""Layout search: enumerate (tp, pp, dp, strategy, micro-batch, activation checkpointing), keep those that fit,
rank by predicted step time, and explain the choice — or, when nothing fits, name the smallest change that would.

The ranking realises the seed study's rule "use the fewest nodes that fit the model with model parallelism, give the
rest to data parallelism": TP traffic is exposed and PP adds a bubble, so among layouts that fit the fastest one
is usually the one with the smallest model-parallel group (ties are broken towards smaller tp·pp, larger
micro-batches, then less memory).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from anytrain.config import parse_grad_compression
from anytrain.cost.devices import DEVICES, Device
from anytrain.cost.model import STRATEGIES, Estimate, Layout, ModelShape, Precision, Workload, estimate
from anytrain.cost.shapes import shape_from_config
from anytrain.errors import ConfigError

# What anytrain's trainer can run today (no TP/PP yet): used by choose_layout.
TRAINER_STRATEGIES = ("ddp", "zero1", "fsdp")
"""What ``parallel.auto`` chooses from on one node: the trainer's strategies (fsdp includes its no-reshard-after-forward
form, the trainer's ZeRO-2)."""
RUNNABLE_STRATEGIES = (*TRAINER_STRATEGIES, "hsdp")
"""``anytrain plan``'s default: the layouts the trainer can run. ``zero2`` (parameters replicated, gradients and
optimizer state sharded: the seed study's accounting) is available with ``--strategy zero2``; anytrain runs ZeRO-2 as
fsdp with ``parallel.reshard_after_forward: false`` (listed as fsdp-noreshard)."""


class NoFeasiblePlan(ConfigError):
    """No layout fits; ``best`` is the closest candidate, the message names the smallest change that fits."""

    def __init__(self, message: str, best: Estimate | None = None, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.best = best
        self.suggestions = suggestions or []


@dataclass
class PlanResult:
    ranked: list[Estimate]  # feasible, best first
    recommended: Estimate
    reason: str
    infeasible: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self, top: int = 10) -> dict:
        return {
            "recommended": self.recommended.as_dict(),
            "reason": self.reason,
            "ranked": [e.as_dict() for e in self.ranked[:top]],
            "feasible": len(self.ranked),
            "infeasible": self.infeasible,
            "notes": self.notes,
        }


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def validate_request(
    shape: ModelShape,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    seq_len: int,
    tp: int | None = None,
    pp: int | None = None,
) -> None:
    """Errors that no layout can fix, each naming the flag."""
    for flag, value in (
        ("--gpus", gpus),
        ("--gpus-per-node", gpus_per_node),
        ("--global-batch", global_batch),
        ("--seq", seq_len),
    ):
        if value <= 0:
            raise ConfigError(f"{flag}: must be > 0, got {value}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ConfigError(f"--gpus: {gpus} is not a multiple of --gpus-per-node {gpus_per_node} (whole nodes)")
    if tp is not None:
        if tp > gpus_per_node:
            raise ConfigError(
                f"--tp: {tp} is larger than --gpus-per-node {gpus_per_node}; tensor parallelism must "
                f"stay inside a node (its traffic is on the critical path)"
            )
        if gpus_per_node % tp or shape.n_heads % tp or shape.n_kv_heads % tp and not shape.expand_kv:
            raise ConfigError(
                f"--tp: {tp} must divide --gpus-per-node {gpus_per_node} and the model's "
                f"{shape.n_heads} attention heads"
            )
    if pp is not None:
        if shape.n_layers % pp:
            raise ConfigError(
                f"--pp: {pp} does not divide the model's {shape.n_layers} layers; choose one of "
                f"{', '.join(map(str, _divisors(shape.n_layers)))}"
            )
        if pp > gpus:
            raise ConfigError(f"--pp: {pp} is larger than --gpus {gpus}")
    if tp is not None and pp is not None and gpus % (tp * pp):
        raise ConfigError(f"--gpus: {gpus} is not divisible by tp × pp = {tp * pp}")


def candidate_layouts(
    shape: ModelShape,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    strategies: tuple[str, ...] = STRATEGIES,
    tp: int | None = None,
    pp: int | None = None,
    micro_batches: tuple[int, ...] | None = None,
    ac: tuple[str, ...] = ("none", "selective", "full"),
    pp_schedule: str = "1f1b",
    max_micro_batch: int = 64,
) -> list[Layout]:
    """Every layout with tp | gcd(G, heads), pp | L, tp·pp·dp = N, dp·b | B; HSDP shards within a node."""
    tps = [tp] if tp else [k for k in _powers_of_two(gpus_per_node) if gpus % k == 0 and shape.n_heads % k == 0]
    pps = [pp] if pp else [k for k in _divisors(shape.n_layers) if gpus % k == 0]
    out: list[Layout] = []
    for t in tps:
        for p in pps:
            if gpus % (t * p):
                continue
            dp = gpus // (t * p)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            mbs = micro_batches or tuple(k for k in _powers_of_two(min(per_replica, max_micro_batch)))
            for strategy in strategies:
                shards = [0]
                if strategy == "hsdp":
                    inner = max(1, gpus_per_node // t)
                    if inner < 2 or dp <= inner or dp % inner:
                        continue
                    shards = [inner]
                elif strategy != "ddp" and dp == 1:
                    continue
                reshard = (True, False) if strategy == "fsdp" else (True,)
                for mb in mbs:
                    if per_replica % mb or (p > 1 and per_replica // mb < p):
                        continue
                    for policy in ac:
                        for rs in reshard:
                            out.append(Layout(dp, t, p, strategy, shards[0], mb, policy, pp_schedule, 1, rs))
    return out


def _rank_key(est: Estimate) -> tuple:
    """Step time within 1% first; then smaller model-parallel group, no recomputation, larger micro-batch (better
    kernel efficiency than the model's constant one), fewer bytes moved, less memory."""
    lay = est.layout
    traffic = sum(c.bytes_per_step for c in est.comm)
    bucket = round(math.log(est.step_s) / math.log(1.01)) if est.step_s > 0 else 0
    return (bucket, lay.tp * lay.pp, lay.ac != "none", -lay.micro_batch, traffic, est.required_gib)


def _reason(best: Estimate, ranked: list[Estimate], gpus_per_node: int) -> str:
    lay = best.layout
    mp = lay.tp * lay.pp
    nodes = max(1, -(-mp // gpus_per_node))
    text = f"fastest layout that fits ({best.required_gib:.1f} of {best.device.memory_gib:.0f} GiB per device)"
    if mp > 1:
        text += (
            f"; model parallelism tp{lay.tp}×pp{lay.pp} = {mp} devices ({nodes} node{'s' * (nodes > 1)}) "
            f"holds the model, the remaining factor {lay.dp} is data parallel"
        )
        if lay.tp > 1:
            text += "; tensor parallelism stays inside a node"
    else:
        text += f"; no model parallelism needed, all {lay.dp} devices are data parallel ({lay.strategy})"
    if lay.ac != "none":
        text += f"; {lay.ac} activation checkpointing is needed to fit"
    return text


def _search(
    shape: ModelShape, device: Device, gpus: int, wl: Workload, precision: Precision | None, **kw: object
) -> tuple[list[Estimate], list[Estimate]]:
    feasible, infeasible = [], []
    for layout in candidate_layouts(shape, gpus, device.gpus_per_node, wl.global_batch, **kw):
        est = estimate(shape, layout, wl, device, precision)
        (feasible if est.fits else infeasible).append(est)
    return feasible, infeasible


def smallest_change(
    shape: ModelShape, device: Device, gpus: int, wl: Workload, precision: Precision | None, **kw: object
) -> list[str]:
    """Suggestions that would fit: more devices (whole nodes, up to 64×), or a device with more memory."""
    out = []
    g = device.gpus_per_node
    n = gpus
    for _ in range(8):
        n = g if n < g else 2 * n
        batch = max(wl.global_batch, n)
        trial = Workload(**{**wl.__dict__, "global_batch": batch - batch % n if batch % n else batch})
        feasible, _ = _search(shape, device, n, trial, precision, **kw)
        if feasible:
            extra = f" and --global-batch {trial.global_batch}" if trial.global_batch != wl.global_batch else ""
            out.append(f"use --gpus {n} ({n // g} nodes of {g}){extra}")
            break
    for other in sorted(DEVICES.values(), key=lambda d: d.memory_gib):
        if other.memory_gib > device.memory_gib:
            feasible, _ = _search(shape, other.replace(gpus_per_node=g), gpus, wl, precision, **kw)
            if feasible:
                out.append(f"use --gpu {other.key} ({other.memory_gib:.0f} GiB per device)")
                break
    if wl.seq_len > 512:
        shorter = Workload(**{**wl.__dict__, "seq_len": wl.seq_len // 2})
        if _search(shape, device, gpus, shorter, precision, **kw)[0]:
            out.append(f"halve --seq to {wl.seq_len // 2}")
    return out


def plan(
    shape: ModelShape,
    device: Device,
    gpus: int,
    wl: Workload,
    precision: Precision | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    tp: int | None = None,
    pp: int | None = None,
    micro_batch: int | None = None,
    ac: tuple[str, ...] = ("none", "selective", "full"),
    pp_schedule: str = "1f1b",
) -> PlanResult:
    """Ranked feasible layouts for ``shape`` on ``gpus`` devices. Raises ConfigError for impossible requests and
    NoFeasiblePlan (a ConfigError) naming the smallest change when nothing fits."""
    validate_request(shape, gpus, device.gpus_per_node, wl.global_batch, wl.seq_len, tp, pp)
    if micro_batch is not None and micro_batch <= 0:
        raise ConfigError(f"--micro-batch: must be > 0, got {micro_batch}")
    if parse_grad_compression(wl.grad_compression)[0] == "powersgd":  # DDP's communication hook: ddp / zero1 only
        strategies = tuple(s for s in strategies if s in ("ddp", "zero1"))
        if not strategies:
            raise ConfigError(
                "--grad-compression: powersgd runs with the ddp or zero1 strategy only; allow one of "
                "them (--strategy ddp) or choose bf16"
            )
    kw = dict(
        strategies=strategies,
        tp=tp,
        pp=pp,
        ac=ac,
        pp_schedule=pp_schedule,
        micro_batches=(micro_batch,) if micro_batch else None,
    )
    feasible, infeasible = _search(shape, device, gpus, wl, precision, **kw)
    if not feasible and not infeasible:
        raise ConfigError(
            f"--global-batch: {wl.global_batch} sequences cannot be split over any data-parallel "
            f"degree of {gpus} devices with these constraints; use a multiple of {gpus}"
        )
    if not feasible:
        best = min(infeasible, key=lambda e: e.required_gib)
        changes = smallest_change(shape, device, gpus, wl, precision, **kw)
        hint = "; ".join(changes) if changes else "no change within 64x the devices fits"
        raise NoFeasiblePlan(
            f"--gpus: the model ({shape.num_params / 1e9:.2f}B parameters) does not fit on {gpus} x {device.name}: "
            f"the leanest layout ({best.layout.label}, micro-batch {best.layout.micro_batch}, AC {best.layout.ac}) "
            f"needs {best.required_gib:.1f} GiB per device of {device.memory_gib:.0f}; smallest change: {hint}",
            best,
            changes,
        )
    feasible.sort(key=_rank_key)
    return PlanResult(feasible, feasible[0], _reason(feasible[0], feasible, device.gpus_per_node), len(infeasible))


def fp8_variants(
    shape: ModelShape, device: Device, gpus: int, wl: Workload, baseline: Estimate, **plan_kw: object
) -> list[dict]:
    """For each FP8 recipe (``cost.fp8.RECIPES``) other than ``wl.fp8``: ``plan``'s best layout with that recipe
    and its predicted speed-up over ``baseline`` (the plan's best), or why the trainer would refuse it (a device
    without FP8, no layer left by the filter). Empty on a device without FP8 and for a family without FP8 layers."""
    from anytrain.cost.fp8 import RECIPES, converted_linears

    if not device.peak_fp8_tflops or shape.fp8_candidates() is None:
        return []
    out = []
    for recipe in RECIPES:
        if recipe == wl.fp8:
            continue
        trial = dataclasses.replace(wl, fp8=recipe)
        try:
            best = plan(shape, device, gpus, trial, **plan_kw).recommended
        except ConfigError as exc:
            out.append({"fp8": recipe, "refused": str(exc)})
            continue
        layers = len(converted_linears(shape, recipe, wl.fp8_filter))
        out.append(
            {
                "fp8": recipe,
                "layout": best.layout.label,
                "micro_batch": best.layout.micro_batch,
                "ac": best.layout.ac,
                "step_s": best.step_s,
                "required_gib": best.required_gib,
                "speedup": baseline.step_s / best.step_s,
                "converted_per_block": layers,
                "candidates_per_block": len(shape.fp8_candidates() or []),
            }
        )
    return out


def choose_layout(cfg: object, world_size: int, device_spec: object, gpus_per_node: int | None = None) -> dict:
    """For ``anytrain train --parallel.auto``: pick strategy, micro-batch and activation checkpointing for ``cfg``.

    Restricted to what the trainer runs (DDP or FSDP2, no TP/PP) and to its precision (autocast over fp32 params;
    FSDP2 bf16 params with fp32 reduction) with the run's ``train.fp8`` (FP8 GEMMs, casts and all-gathers; a device
    without FP8 is a ConfigError naming train.fp8). ``device_spec``: hardware.DeviceSpec, cost Device, key, or None
    (CPU: keep the config's choices). Returns config overrides plus the predictions.
    """
    import os

    from anytrain.cost.devices import from_spec

    device = from_spec(device_spec)
    per_rank = cfg.train.global_batch // world_size if cfg.train.global_batch % world_size == 0 else 0
    if device is None:
        return {
            "parallel.strategy": "ddp" if world_size > 1 else "auto",
            "train.micro_batch": cfg.train.micro_batch,
            "train.activation_checkpointing": cfg.train.activation_checkpointing,
            "predicted": None,
        }
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or gpus_per_node or min(world_size, device.gpus_per_node)
    device = device.replace(gpus_per_node=max(1, local))
    shape = shape_from_config(cfg)
    wl = Workload.from_config(cfg)
    strategies = TRAINER_STRATEGIES if world_size > 1 else ("ddp",)
    if not per_rank:
        raise ConfigError(
            f"train.global_batch: {cfg.train.global_batch} is not divisible by the world size {world_size}"
        )
    result = plan(shape, device, world_size, wl, strategies=strategies, tp=1, pp=1)
    best = result.recommended
    lay = best.layout
    return {
        "parallel.strategy": lay.strategy if world_size > 1 else "auto",
        "parallel.reshard_after_forward": lay.reshard_after_forward,
        "parallel.reshard_during_accumulation": lay.reshard_during_accumulation,
        "train.micro_batch": lay.micro_batch,
        "train.activation_checkpointing": lay.ac,
        "dp": lay.dp,
        "tp": 1,
        "pp": 1,
        "grad_accum": per_rank // lay.micro_batch,
        "predicted": {
            "memory_gib": best.allocated_gib,
            "required_gib": best.required_gib,
            "step_s": best.step_s,
            "mfu": best.mfu,
            "fp8": wl.fp8,
        },
        "reason": result.reason,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Job sizing: how many devices, for a token budget and a deadline

OBJECTIVES = ("fewest", "cheapest")


def candidate_gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """The device counts job sizing tries: powers of two up to one node, then whole nodes in the counts 2^k and
    3·2^k (1, 2, 3, 4, 6, 8, 12, ... nodes: the counts global batches and pipeline depths divide), up to
    ``max_gpus``."""
    counts = [k for k in _powers_of_two(gpus_per_node) if k <= max_gpus]
    nodes = sorted({n for k in _powers_of_two(max(1, max_gpus // gpus_per_node)) for n in (k, 3 * k // 2) if n >= 2})
    return counts + [n * gpus_per_node for n in nodes if n * gpus_per_node <= max_gpus]


@dataclass
class SizingResult:
    """The chosen device count and its best layout, and every count tried (``tried``: one dict per count)."""

    best: Estimate
    gpus: int
    nodes: int
    objective: str
    reason: str
    tried: list[dict] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float:
        return self.best.total_s * self.gpus / 3600

    def as_dict(self) -> dict:
        return {
            "gpus": self.gpus,
            "nodes": self.nodes,
            "objective": self.objective,
            "reason": self.reason,
            "total_s": self.best.total_s,
            "gpu_hours": self.gpu_hours,
            "steps": self.best.steps,
            "recommended": self.best.as_dict(),
            "overrides": trainer_overrides(self.best),
            "tried": self.tried,
        }


def trainer_overrides(best: Estimate) -> list[str]:
    """``anytrain train`` overrides that run ``best``'s layout: strategy, degrees, micro-batch, activation
    checkpointing and the steps that cover the token budget."""
    lay = best.layout
    strategy = {"hsdp": "fsdp", "zero2": "fsdp"}.get(lay.strategy, lay.strategy)
    out = ["--parallel.strategy", strategy, "--parallel.tp", str(lay.tp), "--parallel.pp", str(lay.pp)]
    if lay.strategy == "hsdp":
        out += ["--parallel.dp_replicate", str(lay.dp // lay.shard_size), "--parallel.dp_shard", str(lay.shard_size)]
    if lay.strategy == "zero2" or (lay.strategy in ("fsdp", "hsdp") and not lay.reshard_after_forward):
        out += ["--parallel.reshard_after_forward", "false"]
    if lay.tp == 1 or lay.pp > 1:  # a recipe's parallel.tp_sequence_loss needs TP without pipeline stages
        out += ["--parallel.tp_sequence_loss", "false"]
    return out + [
        "--train.micro_batch",
        str(lay.micro_batch),
        "--train.activation_checkpointing",
        lay.ac,
        "--train.steps",
        str(best.steps),
    ]


def _tried_row(gpus: int, gpus_per_node: int, best: Estimate | None, why: str = "") -> dict:
    row = {"gpus": gpus, "nodes": max(1, gpus // gpus_per_node)}
    if best is None:
        return {**row, "fits": False, "why": why}
    return {
        **row,
        "fits": True,
        "layout": best.layout.label,
        "micro_batch": best.layout.micro_batch,
        "ac": best.layout.ac,
        "step_s": best.step_s,
        "total_s": best.total_s,
        "gpu_hours": best.total_s * gpus / 3600,
    }


def _hours(seconds: float) -> str:
    return f"{seconds / 86400:.1f} d" if seconds >= 2 * 86400 else f"{seconds / 3600:.1f} h"


def _fastest_layout(
    shape: ModelShape, device: Device, gpus: int, wl: Workload, precision: Precision | None, **kw: object
) -> tuple[Estimate | None, str]:
    """``plan``'s choice on ``gpus`` devices without its search for the smallest change: (best, "") or (None, why)."""
    try:
        validate_request(shape, gpus, device.gpus_per_node, wl.global_batch, wl.seq_len, kw.get("tp"), kw.get("pp"))
    except ConfigError as exc:
        return None, str(exc)
    feasible, infeasible = _search(shape, device, gpus, wl, precision, **kw)
    if feasible:
        return min(feasible, key=_rank_key), ""
    if not infeasible:
        return None, f"the global batch {wl.global_batch} does not split over {gpus} devices"
    lean = min(infeasible, key=lambda e: e.required_gib)
    return None, f"the leanest layout ({lean.layout.label}) needs {lean.required_gib:.1f} GiB per device"


def size_job(
    shape: ModelShape,
    device: Device,
    wl: Workload,
    deadline_s: float | None = None,
    max_gpus: int | None = None,
    budget_gpu_hours: float | None = None,
    objective: str = "fewest",
    precision: Precision | None = None,
    **plan_kw: object,
) -> SizingResult:
    """The device count for ``wl.tokens`` tokens: ``fewest`` devices whose best layout finishes by ``deadline_s``
    within ``budget_gpu_hours``, or the ``cheapest`` (fewest device-hours) that does. Counts are
    ``candidate_gpu_counts`` up to ``max_gpus`` (default 64 nodes); each count's layout is ``plan``'s choice.
    Raises ConfigError naming the flag when no count meets the constraints."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
    for flag, value in (("--deadline", deadline_s), ("--max-gpus", max_gpus), ("--budget-gpu-hours", budget_gpu_hours)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag}: must be > 0, got {value}")
    if wl.tokens <= 0:
        raise ConfigError("--tokens: job sizing needs the training tokens (e.g. --tokens 2e11)")
    g = device.gpus_per_node
    max_gpus = max_gpus or 64 * g
    tried, meets = [], []
    for gpus in candidate_gpu_counts(g, max_gpus):
        best, why = _fastest_layout(shape, device, gpus, wl, precision, **plan_kw)
        if best is None:
            tried.append(_tried_row(gpus, g, None, why))
            continue
        tried.append(_tried_row(gpus, g, best))
        in_time = deadline_s is None or best.total_s <= deadline_s
        in_budget = budget_gpu_hours is None or best.total_s * gpus / 3600 <= budget_gpu_hours
        if in_time and in_budget:
            meets.append((gpus, best))
            if objective == "fewest":
                break
    if not meets:
        raise ConfigError(_no_size_message(tried, deadline_s, budget_gpu_hours, max_gpus))
    if objective == "fewest":
        gpus, best = meets[0]
    else:
        gpus, best = min(meets, key=lambda m: (m[0] * m[1].total_s, m[0]))
    return SizingResult(
        best,
        gpus,
        max(1, gpus // g),
        objective,
        _sizing_reason(gpus, best, tried, objective, deadline_s, budget_gpu_hours),
        tried,
    )


def _no_size_message(tried: list[dict], deadline_s: float | None, budget: float | None, max_gpus: int) -> str:
    fits = [row for row in tried if row["fits"]]
    if not fits:
        return f"--max-gpus: the model fits on no device count up to {max_gpus} ({tried[-1]['why']})"
    fastest = min(fits, key=lambda row: row["total_s"])
    cheapest = min(fits, key=lambda row: row["gpu_hours"])
    if deadline_s is not None and fastest["total_s"] > deadline_s:
        return (
            f"--deadline: no device count up to --max-gpus {max_gpus} finishes in {_hours(deadline_s)}; the "
            f"fastest, {fastest['gpus']} devices ({fastest['layout']}), takes {_hours(fastest['total_s'])}: "
            "raise --max-gpus or the deadline, or train on fewer tokens"
        )
    in_time = [row for row in fits if deadline_s is None or row["total_s"] <= deadline_s]
    least = min(in_time, key=lambda row: row["gpu_hours"]) if in_time else cheapest
    return (
        f"--budget-gpu-hours: {budget:,.0f} device-hours are too few; the cheapest count that meets the deadline, "
        f"{least['gpus']} devices ({least['layout']}), needs {least['gpu_hours']:,.1f}"
    )


def _sizing_reason(
    gpus: int, best: Estimate, tried: list[dict], objective: str, deadline_s: float | None, budget: float | None
) -> str:
    hours = best.total_s * gpus / 3600
    text = (
        f"{gpus} devices ({best.layout.label}, micro-batch {best.layout.micro_batch}, AC {best.layout.ac}) take "
        f"{_hours(best.total_s)} = {hours:,.0f} device-hours"
    )
    limits = [f"the deadline {_hours(deadline_s)}"] if deadline_s is not None else []
    limits += [f"the budget {budget:,.0f} device-hours"] if budget is not None else []
    fewer = [row for row in tried if row["gpus"] < gpus]
    if objective == "fewest":
        text += f"; the fewest devices that meet {' and '.join(limits) or 'the request'}"
        if fewer:
            last = fewer[-1]
            text += (
                f"; {last['gpus']} would take {_hours(last['total_s'])} ({last['gpu_hours']:,.0f} device-hours)"
                if last["fits"]
                else f"; {last['gpus']} do not fit ({last['why']})"
            )
    else:
        text += f"; the fewest device-hours of the counts that meet {' and '.join(limits) or 'the request'}"
    return text
