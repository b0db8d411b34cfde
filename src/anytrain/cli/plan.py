"""``anytrain plan``: rank parallel layouts by the cost model before a run, or size the job for a deadline or budget.

``--model`` takes a config YAML (the model is built on the meta device to read its shape), a flavour name
(``1.1b``, ``llama-7b``), or a parameter count (``7e9``, ``175B``, ``1T``) with optional ``--layers/--hidden``.
The verb only reads its options: the shapes and the workload come from ``cost.shapes``, the search from
``cost.planner`` and the text from ``cost.tables``.
"""

from __future__ import annotations

import json

import typer

from anytrain.cost.devices import get_device, load_efficiency_table
from anytrain.cost.model import PRECISIONS, STRATEGIES
from anytrain.cost.planner import OBJECTIVES, RUNNABLE_STRATEGIES, fp8_variants, plan, size_job
from anytrain.cost.shapes import plan_workload, resolve_model
from anytrain.cost.tables import (
    format_fp8_variants,
    format_plan_header,
    format_sizing,
    format_table,
    parse_duration,
)
from anytrain.errors import ConfigError


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
    fp8: str = typer.Option(
        None, "--fp8", help="FP8 recipe to plan: none, tensorwise, rowwise, rowwise_with_gw_hp (default: config's)."
    ),
) -> None:
    """Rank parallel layouts by predicted memory, step time and energy before a run."""
    shape, cfg = resolve_model(model, layers, hidden, heads, kv_heads, ffn, vocab)
    table = load_efficiency_table(efficiency_table) if efficiency_table else None
    device = get_device(gpu, table, gpus_per_node=gpus_per_node, efficiency=efficiency)
    if watts:
        device = device.replace(power_fraction=watts / device.tdp_watts)
    _check_choices(precision, strategy)
    wl = plan_workload(cfg, gpus, seq, global_batch, tokens, compiled, grad_compression, fp8)
    prec = PRECISIONS.get(precision) if precision else None
    strategies = tuple(strategy) if strategy else RUNNABLE_STRATEGIES
    if gpus is None:
        if deadline is None and budget is None:
            raise ConfigError("--gpus: give the device count, or --deadline / --budget-gpu-hours to size the job")
        deadline_s = parse_duration(deadline) if deadline else None
        sized = size_job(
            shape,
            device,
            wl,
            deadline_s,
            max_gpus,
            budget,
            objective,
            prec,
            strategies=strategies,
            tp=tp,
            pp=pp,
            micro_batches=(micro_batch,) if micro_batch else None,
        )
        text = format_sizing(sized, model if cfg else None, wl)
        typer.echo(json.dumps(sized.as_dict(), indent=1, default=str) if as_json else text)
        return
    try:
        result = plan(shape, device, gpus, wl, prec, strategies=strategies, tp=tp, pp=pp, micro_batch=micro_batch)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("train.fp8:", "--fp8:", 1) if fp8 else str(exc)) from None
    kw = dict(precision=prec, strategies=strategies, tp=tp, pp=pp, micro_batch=micro_batch)
    variants = fp8_variants(shape, device, gpus, wl, result.recommended, **kw)
    if as_json:
        out = result.as_dict(top)
        out["fp8_variants"] = variants
        out["model"] = {"name": shape.name, "params": shape.num_params, "layers": shape.n_layers, "dim": shape.dim}
        out["device"] = device.__dict__
        typer.echo(json.dumps(out, indent=1, default=str))
        return
    typer.echo(format_plan_header(shape, device, gpus, wl))
    typer.echo(format_table(result, top, price))
    if variants:
        typer.echo(format_fp8_variants(variants, wl))


def _check_choices(precision: str | None, strategy: list[str] | None) -> None:
    if precision and precision not in PRECISIONS:
        raise ConfigError(f"--precision: unknown {precision!r}; choose from {', '.join(PRECISIONS)}")
    bad = [s for s in strategy or [] if s not in STRATEGIES]
    if bad:
        raise ConfigError(f"--strategy: unknown {bad[0]!r}; choose from {', '.join(STRATEGIES)}")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
