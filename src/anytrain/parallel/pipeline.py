"""Pipeline parallelism with ``torch.distributed.pipelining``: split the model into stages, build a schedule.

The layers split into ``pp × virtual`` contiguous stages; pipeline rank r holds stages r, r + pp, r + 2·pp, ...
(round-robin, what ``ScheduleInterleaved1F1B`` expects; one stage per rank for 1F1B and GPipe). Each stage is a
*part*: a copy of the model holding only that stage's layers (layers live in a ModuleDict keyed by global index), the
first stage also the embedding, the last the final norm and LM head; the family's ``pipeline_split``
(``ModelSpec.parallelize_plan``) makes it. Parameter names equal the full model's, so
checkpoints move between layouts. The last stage's forward takes the targets and returns the mean token loss of its
micro-batch (the fused linear + cross-entropy, as without pipelining); the schedule's loss function passes it through
and the schedule divides gradients by the number of micro-batches, so the step's gradient is the mean over the batch.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from anytrain.errors import ConfigError
from anytrain.models import spec_of

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble")
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Schedules with ``pp_virtual_stages`` >= 2 stages per rank (round-robin placement)."""


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible layer ranges per stage (earlier stages get the extra layer)."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def rank_stages(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Global stage indices held by pipeline rank ``pp_rank`` (round-robin over ranks)."""
    return [pp_rank + k * pp for k in range(virtual)]


def check_pipeline_layout(n_layers: int, pp: int, virtual: int, schedule: str, n_microbatches: int | None) -> None:
    """One-line errors for pipeline layouts that cannot run (before any process group work)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if virtual < 1:
        raise ConfigError(f"parallel.pp_virtual_stages: must be >= 1, got {virtual}")
    if pp == 1:
        return
    if virtual > 1 and schedule not in MULTI_STAGE:
        raise ConfigError(
            f"parallel.pp_virtual_stages: {schedule} runs one stage per pipeline rank; set "
            "--parallel.pp_schedule Interleaved1F1B (or InterleavedZeroBubble) or pp_virtual_stages 1"
        )
    if schedule in MULTI_STAGE and virtual < 2:
        raise ConfigError(
            f"parallel.pp_virtual_stages: {schedule} needs >= 2 stages per rank; set "
            "--parallel.pp_virtual_stages 2 (or use 1F1B)"
        )
    if pp * virtual > n_layers:
        raise ConfigError(
            f"parallel.pp: {pp} x {virtual} pipeline stages for {n_layers} layers; use at most "
            f"{n_layers} stages in all (pp x pp_virtual_stages)"
        )
    if n_microbatches is None:
        return
    if n_microbatches < pp:
        raise ConfigError(
            f"train.micro_batch: {n_microbatches} micro-batches per step for {pp} pipeline ranks "
            f"(per-rank batch / micro_batch); lower train.micro_batch so there are >= {pp}"
        )
    rounds = max(1, n_microbatches // pp)
    if schedule in MULTI_STAGE and n_microbatches % rounds:
        raise ConfigError(
            f"train.micro_batch: {schedule} needs the micro-batch count ({n_microbatches}) to be a "
            f"multiple of {rounds} (= count // pp); use a multiple of pp={pp}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# stage modules


def _pipeline_split(model: nn.Module):
    """The family's pipeline split of ``model``, after checking that the model can be split."""
    spec = spec_of(model)
    split = spec.parallelize_plan.pipeline_split
    if split is None:
        raise ConfigError(f"parallel.pp: pipeline parallelism is not implemented for {spec.name}; set pp 1")
    if model.tie_embeddings:
        raise ConfigError(
            "parallel.pp: tied embeddings put the embedding and the head on one stage; "
            "set --model.args.tie_embeddings false (or pp 1)"
        )
    return split


def prune_to_stage(model: nn.Module, stage: int, n_stages: int, copy_model: bool = True) -> nn.Module:
    """Stage ``stage`` of ``model`` (a copy unless ``copy_model`` is False): only its layers; the embedding on the
    first stage, the final norm and head on the last (the family's ``pipeline_split``). Parameter names stay the
    full model's."""
    split = _pipeline_split(model)
    layers = stage_layer_ranges(len(model.blocks()), n_stages)[stage]
    model = copy.deepcopy(model) if copy_model else model
    return split(model, layers, stage == 0, stage == n_stages - 1)


def build_stage_parts(
    build, stages: list[int], n_stages: int, device: torch.device, seed: int, init_device: str = "device"
) -> list[nn.Module]:
    """Initialised stage modules for ``stages`` on ``device``; weights equal the same stages of an unsplit model
    (drawn on the CPU and copied to ``device`` with ``init_device`` 'cpu': model.init_device).

    Families whose plan says ``stage_init`` draw each parameter from its own stream: their stages are built on the
    meta device and only the stage's parameters are allocated. Others (Mamba) draw from the global generator in
    order, so the whole model is initialised on ``device`` first and then cut (the full model is held briefly).
    """
    torch.manual_seed(seed)  # the global generator's state is the same in every run (it is checkpointed: rng_cpu)
    draw_on = torch.device("cpu") if init_device == "cpu" else device
    with torch.device("meta"):
        full = build()
    if spec_of(full).parallelize_plan.stage_init:
        parts = []
        for stage in stages:
            part = prune_to_stage(full, stage, n_stages)
            part.to_empty(device=draw_on)
            part.init_weights(seed=seed)
            parts.append(part.to(device))
        return parts
    _pipeline_split(full)
    full.to_empty(device=draw_on)
    full.init_weights(seed=seed)
    parts = [prune_to_stage(full, stage, n_stages, copy_model=i < len(stages) - 1) for i, stage in enumerate(stages)]
    return [part.to(device) for part in parts]


def merge_parts(parts: list[nn.Module]) -> nn.Module:
    """One module naming every parameter of a rank's stage parts by its full-model name (for the optimizer, gradient
    clipping and checkpoints). It shares the parts' modules and is never called; one part is returned as is."""
    if len(parts) == 1:
        return parts[0]
    root = nn.Module()
    for part in parts:
        _graft(root, part)
    return root


def _graft(dst: nn.Module, src: nn.Module) -> None:
    for name, child in src.named_children():
        have = dst._modules.get(name)
        if have is None:
            dst.add_module(name, child)
        elif have is not child:  # the same path in two parts (e.g. `layers`, `backbone`): merge their children
            if any(True for _ in have.named_parameters(recurse=False)) or any(
                True for _ in child.named_parameters(recurse=False)
            ):
                raise RuntimeError(f"pipeline parts both hold parameters of module {name!r}")
            merged = nn.ModuleDict() if isinstance(have, nn.ModuleDict) else nn.Module()
            _graft(merged, have)
            _graft(merged, child)
            dst._modules[name] = merged


# ---------------------------------------------------------------------------------------------------------------------
# schedules


def passthrough_loss(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: ARG001 - schedule signature
    """The last stage's forward already returns the micro-batch's mean token loss."""
    return loss


def build_schedule(
    parts: list[nn.Module],
    stages: list[int],
    n_stages: int,
    device: torch.device,
    group,
    schedule: str,
    n_microbatches: int,
    loss_fn=passthrough_loss,
):
    """PipelineStages for this rank's parts and a schedule running ``n_microbatches`` per step.

    Every rank passes the loss function (a schedule without one runs forward only, and the other ranks then wait
    forever for its backward sends); gradients are divided by ``n_microbatches`` (the loss is a per-micro-batch mean).
    """
    from torch.distributed import pipelining

    pipe_stages = [
        pipelining.PipelineStage(part, s, n_stages, device, group=group) for part, s in zip(parts, stages, strict=True)
    ]
    cls = getattr(pipelining, f"Schedule{schedule}")  # Schedule1F1B, ...GPipe, ...Interleaved1F1B, ...ZeroBubble
    if schedule in MULTI_STAGE:  # InterleavedZeroBubble: ZB1P, each backward split into input and weight gradients
        return cls(pipe_stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(pipe_stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)


def step_accepts_return_outputs(schedule) -> bool:
    return "return_outputs" in inspect.signature(schedule.step).parameters


@torch.no_grad()
def pipeline_forward(
    parts: list[nn.Module],
    stages: list[int],
    n_stages: int,
    group,
    pp_rank: int,
    pp: int,
    tokens: torch.Tensor,
    act_shape: tuple[int, ...],
) -> torch.Tensor | None:
    """Forward-only pass of one micro-batch through every stage in order (evaluation): each rank runs its stages and
    sends fp32 hidden states (``act_shape``) to the next stage's rank. Returns the logits on the last stage's rank."""
    import torch.distributed as dist

    by_stage = dict(zip(stages, parts, strict=True))
    out = None
    for stage in range(n_stages):
        if stage not in by_stage:
            continue
        if stage == 0:
            x = tokens
        else:
            x = torch.empty(act_shape, device=tokens.device, dtype=torch.float32)
            dist.recv(x, group_src=(pp_rank - 1) % pp, group=group)
        out = by_stage[stage](x)
        if stage < n_stages - 1:
            dist.send(out.float().contiguous(), group_dst=(pp_rank + 1) % pp, group=group)
    return out if n_stages - 1 in by_stage else None
