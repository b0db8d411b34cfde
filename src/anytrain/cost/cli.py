"""``anytrain plan``: the planner on the command line (register ``plan_command`` with the main typer app).

``--model`` takes a config YAML (the model is built on the meta device to read its shape), a flavour name
(``1.1b``, ``llama-7b``), or a parameter count (``7e9``, ``175B``, ``1T``) with optional ``--layers/--hidden``.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import typer

from anytrain.config import parse_grad_compression
from anytrain.cost.devices import get_device, load_efficiency_table
from anytrain.cost.model import PRECISIONS, STRATEGIES, ModelShape, Workload
from anytrain.cost.planner import OBJECTIVES, RUNNABLE_STRATEGIES, PlanResult, SizingResult, plan, size_job
from anytrain.cost.shapes import shape_from_config
from anytrain.errors import ConfigError

# Published shapes for bare parameter counts: (layers, hidden, heads, mlp, ffn, vocab).
KNOWN_SHAPES: dict[float, tuple[int, int, int, str, int, int]] = {
    175e9: (96, 12288, 96, "gelu", 4 * 12288, 51200),  # GPT-3 175B
    1e12: (128, 25600, 160, "gelu", 4 * 25600, 51200),  # Megatron / ORNL 1T
}


def parse_count(text: str) -> float:
    """'7e9', '7B', '175b', '1.3T', '350M' -> a float number of parameters."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not match:
        raise ConfigError(f"--model: {text!r} is neither a config file, a flavour, nor a parameter count like 7e9")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2)]
    return float(match.group(1)) * scale


def shape_from_params(
    params: float,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int = 32000,
) -> ModelShape:
    """A Llama-style shape with about ``params`` parameters. Published shapes for 175B and 1T (GPT); otherwise
    hidden = (128·Ψ/12)^(1/3) rounded to 128 (GPT-3's d/L ≈ 128), L = Ψ/(12·d²), and the SwiGLU width solves
    Ψ = 2·V·d + L·(4·d² + 3·d·F)."""
    for known, (kl, kd, kh, mlp, kf, kv) in KNOWN_SHAPES.items():
        if abs(params / known - 1) < 0.02 and layers in (None, kl) and hidden in (None, kd):
            return ModelShape(
                kl,
                kd,
                heads or kh,
                kv_heads or heads or kh,
                ffn or kf,
                kv,
                mlp=mlp,
                expand_kv=False,
                name=f"GPT {params / 1e12:g}T" if params >= 1e12 else f"GPT {params / 1e9:g}B",
            )
    if hidden is None:
        hidden = max(128, 128 * round((128 * params / 12) ** (1 / 3) / 128))
    if layers is None:
        layers = max(1, round(params / (12 * hidden * hidden)))
    heads = heads or max(1, hidden // 128)
    if hidden % heads:
        raise ConfigError(f"--heads: {heads} does not divide --hidden {hidden}")
    kv_heads = kv_heads or heads
    if ffn is None:
        body = params - 2 * vocab * hidden - layers * (2 * hidden * hidden + 2 * hidden * hidden * kv_heads // heads)
        ffn = 64 * math.ceil(body / (3 * layers * hidden) / 64) if body > 0 else 0
        if ffn <= 0:
            raise ConfigError(
                f"--model: {params:.3g} parameters is too few for --layers {layers} --hidden {hidden} "
                f"(embeddings and attention alone exceed it)"
            )
    return ModelShape(layers, hidden, heads, kv_heads, ffn, vocab, name=f"{params / 1e9:.3g}B")


def count_params_on_meta(cfg: object) -> int:
    """Build the model on the meta device (no memory) and count its parameters — cross-checks ModelShape."""
    import torch

    from anytrain.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    return model.num_params()


def resolve_model(
    model: str,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    kv_heads: int | None,
    ffn: int | None,
    vocab: int,
) -> tuple[ModelShape, object | None]:
    """(shape, RunConfig or None) from --model."""
    from anytrain.config import ModelConfig, RunConfig, load_config
    from anytrain.models import TRANSFORMER_FLAVOURS

    if model.endswith((".yaml", ".yml")) or Path(model).is_file():
        cfg = load_config(model)
        return shape_from_config(cfg), cfg
    if model in TRANSFORMER_FLAVOURS:
        cfg = RunConfig(model=ModelConfig(flavour=model))
        return shape_from_config(cfg), None
    return shape_from_params(parse_count(model), layers, hidden, heads, kv_heads, ffn, vocab), None


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


def format_table(result: PlanResult, top: int, price: float | None) -> str:
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
            f"{_duration(e.total_s):>8} "
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


def plan_command(
    model: str = typer.Option(..., "--model", help="Config YAML, flavour (1.1b), or parameter count (7e9, 175B)."),
    gpu: str = typer.Option(..., "--gpu", help="Device kind: h100, h200, a100-80, mi250x, mi300x, frontier, ..."),
    gpus: int = typer.Option(None, "--gpus", help="Total number of devices (omit to size the job: --deadline)."),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", help="Devices per node (default: the device's)."),
    tokens: float = typer.Option(None, "--tokens", help="Training tokens (default 20 × parameters, Chinchilla)."),
    seq: int = typer.Option(None, "--seq", help="Sequence length (default: the config's, else 2048)."),
    global_batch: int = typer.Option(
        None, "--global-batch", help="Sequences per step (default: the config's, else --gpus; sizing: 4 Mi tokens)."
    ),
    layers: int = typer.Option(None, "--layers", help="Layers, with a parameter count."),
    hidden: int = typer.Option(None, "--hidden", help="Model width, with a parameter count."),
    heads: int = typer.Option(None, "--heads", help="Attention heads (default hidden/128)."),
    kv_heads: int = typer.Option(None, "--kv-heads", help="Key/value heads (default = heads)."),
    ffn: int = typer.Option(None, "--ffn", help="FFN width (default: solved from the parameter count)."),
    vocab: int = typer.Option(32000, "--vocab", help="Vocabulary, with a parameter count."),
    tp: int = typer.Option(None, "--tp", help="Fix the tensor-parallel degree."),
    pp: int = typer.Option(None, "--pp", help="Fix the pipeline-parallel degree."),
    micro_batch: int = typer.Option(None, "--micro-batch", help="Fix the micro-batch."),
    strategy: list[str] = typer.Option(
        None, "--strategy", help=f"Allowed data-parallel strategies, of {STRATEGIES} (default: those anytrain runs)."
    ),
    precision: str = typer.Option(None, "--precision", help=f"Precision accounting: {', '.join(PRECISIONS)}."),
    compiled: bool = typer.Option(True, "--compiled/--eager", help="Activation accounting of compiled blocks."),
    efficiency: float = typer.Option(None, "--efficiency", help="Achieved fraction of peak (overrides the table)."),
    efficiency_table: str = typer.Option(None, "--efficiency-table", help="JSON of per-device field overrides."),
    watts: float = typer.Option(None, "--watts", help="Average watts per device (default TDP × power fraction)."),
    price: float = typer.Option(None, "--price-per-gpu-hour", help="Price of one device-hour, for a cost column."),
    top: int = typer.Option(10, "--top", help="Rows to show."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    grad_compression: str = typer.Option(
        None, "--grad-compression", help="Gradient reduction: none, bf16, fp16, powersgd:rank=R (default: config's)."
    ),
    deadline: str = typer.Option(
        None, "--deadline", help="Size the job: finish --tokens by then (36h, 30d, 2-00:00:00)."
    ),
    max_gpus: int = typer.Option(None, "--max-gpus", help="Job sizing: most devices to consider (default 64 nodes)."),
    budget: float = typer.Option(None, "--budget-gpu-hours", help="Job sizing: most device-hours to spend."),
    objective: str = typer.Option("fewest", "--objective", help=f"Job sizing: {' or '.join(OBJECTIVES)} devices."),
) -> None:
    """Predict memory, step time, communication and energy of parallel layouts; recommend one."""
    shape, cfg = resolve_model(model, layers, hidden, heads, kv_heads, ffn, vocab)
    table = load_efficiency_table(efficiency_table) if efficiency_table else None
    device = get_device(gpu, table, gpus_per_node=gpus_per_node, efficiency=efficiency)
    if watts:
        device = device.replace(power_fraction=watts / device.tdp_watts)
    seq_len = seq or (cfg.data.seq_len if cfg else 2048)
    # sizing without a config: about 4 Mi tokens per step, whatever the device count
    batch = global_batch or (cfg.train.global_batch if cfg else max(gpus, 8) if gpus else max(1, 2**22 // seq_len))
    if precision and precision not in PRECISIONS:
        raise ConfigError(f"--precision: unknown {precision!r}; choose from {', '.join(PRECISIONS)}")
    bad = [s for s in strategy or [] if s not in STRATEGIES]
    if bad:
        raise ConfigError(f"--strategy: unknown {bad[0]!r}; choose from {', '.join(STRATEGIES)}")
    graphs = bool(cfg and cfg.train.cuda_graphs)  # train.cuda_graphs: one device or TP alone replays graphs
    compression = grad_compression or (cfg.parallel.grad_compression if cfg else "none")
    try:
        parse_grad_compression(compression)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("parallel.grad_compression", "--grad-compression")) from None
    bucket = {"ddp_bucket_mib": cfg.parallel.ddp_bucket_mb} if cfg else {}
    wl = Workload(seq_len, batch, tokens=tokens or 0.0, compiled=compiled, cuda_graphs=graphs,
                  grad_compression=compression, **bucket)  # fmt: skip
    if gpus is None:
        if deadline is None and budget is None:
            raise ConfigError("--gpus: give the device count, or --deadline / --budget-gpu-hours to size the job")
        kw = dict(strategies=tuple(strategy) if strategy else RUNNABLE_STRATEGIES, tp=tp, pp=pp,
                  micro_batches=(micro_batch,) if micro_batch else None)  # fmt: skip
        sized = size_job(shape, device, wl, parse_duration(deadline) if deadline else None, max_gpus, budget,
                         objective, PRECISIONS.get(precision) if precision else None, **kw)  # fmt: skip
        typer.echo(json.dumps(sized.as_dict(), indent=1, default=str) if as_json else
                   format_sizing(sized, model if cfg else None, wl))  # fmt: skip
        return
    result = plan(
        shape,
        device,
        gpus,
        wl,
        PRECISIONS.get(precision) if precision else None,
        strategies=tuple(strategy) if strategy else RUNNABLE_STRATEGIES,
        tp=tp,
        pp=pp,
        micro_batch=micro_batch,
    )
    if as_json:
        out = result.as_dict(top)
        out["model"] = {"name": shape.name, "params": shape.num_params, "layers": shape.n_layers, "dim": shape.dim}
        out["device"] = device.__dict__
        typer.echo(json.dumps(out, indent=1, default=str))
        return
    typer.echo(
        f"{shape.name or 'model'}: {shape.num_params / 1e9:.3f}B parameters, L={shape.n_layers} d={shape.dim}"
        f" | {gpus} x {device.name} ({device.gpus_per_node}/node, efficiency {device.efficiency:.2f}, "
        f"{device.avg_watts:.0f} W) | seq {seq_len}, global batch {batch}, grad compression {compression}, "
        f"{(wl.tokens or 20 * shape.num_params) / 1e9:,.1f}B tokens"
    )
    typer.echo(format_table(result, top, price))


def parse_duration(text: str, flag: str = "--deadline") -> float:
    """Seconds from '36h', '30d', '90min', '45m', '600s' or SLURM's 'D-HH:MM:SS' / 'HH:MM:SS'."""
    value = text.strip().lower()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)", value)
    if match:
        return float(match.group(1)) * {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}[match.group(2)]
    match = re.fullmatch(r"(?:([0-9]+)-)?([0-9]+):([0-9]{2}):([0-9]{2})", value)
    if match:
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    raise ConfigError(f"{flag}: {text!r} is not a duration; write e.g. 36h, 30d, 90min or 2-00:00:00")


def slurm_time(seconds: float) -> str:
    """SLURM's D-HH:MM:SS, rounded up to the minute."""
    minutes = math.ceil(seconds / 60)
    return f"{minutes // 1440}-{minutes // 60 % 24:02d}:{minutes % 60:02d}:00"


def format_sizing(sized: SizingResult, config: str | None, wl: Workload) -> str:
    """The counts tried, the choice and why, the train overrides and the sbatch line."""
    from anytrain.cost.planner import trainer_overrides

    lines = [f"{'devices':>8} {'nodes':>6}  {'layout':<26} {'mb':>3} {'AC':<4} {'step s':>9} {'total':>9} "
             f"{'device-h':>11}"]  # fmt: skip
    for row in sized.tried:
        if row["fits"]:
            lines.append(f"{row['gpus']:>8} {row['nodes']:>6}  {row['layout']:<26} {row['micro_batch']:>3} "
                         f"{row['ac']:<4} {row['step_s']:>9.3f} {_duration(row['total_s']):>9} "
                         f"{row['gpu_hours']:>11,.0f}")  # fmt: skip
        else:
            lines.append(f"{row['gpus']:>8} {row['nodes']:>6}  does not fit: {row['why'][:80]}")
    per_node = min(sized.gpus, sized.best.device.gpus_per_node)
    overrides = shlex.join(trainer_overrides(sized.best))
    lines += [f"chosen: {sized.reason}",
              f"{wl.tokens / 1e9:,.1f}B tokens = {sized.best.steps:,} steps of {wl.global_batch} x {wl.seq_len}",
              f"overrides: {overrides}",
              f"sbatch: anytrain launch slurm {config or 'CONFIG'} --nodes {sized.nodes} --gpus-per-node {per_node} "
              f"--time {slurm_time(1.1 * sized.best.total_s)} -- {overrides}"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:  # pragma: no cover - `python -m anytrain.cost.cli`
    import sys

    from anytrain.errors import AnytrainError

    app = typer.Typer(add_completion=False)
    app.command()(plan_command)
    try:
        app(standalone_mode=False)
    except AnytrainError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
