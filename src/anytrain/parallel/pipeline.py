"""Pipeline parallelism with ``torch.distributed.pipelining``: split the model into stages, build a schedule.

Each pipeline rank builds only its stage: the full model is created on the meta device, the layers of other stages
are deleted (layers live in a ModuleDict keyed by global index, so the stage's parameter names equal the full
model's and checkpoints move between layouts), the first stage keeps the embedding and the last stage the final norm
and LM head. The last stage returns logits per micro-batch and the schedule's loss function takes the
cross-entropy (the fused linear+cross-entropy path needs the head inside the module's forward; not yet wired here).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from anytrain.errors import ConfigError

SCHEDULES = ("1F1B", "GPipe")


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible layer ranges per stage (earlier stages get the extra layer)."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def prune_to_stage(meta_model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of ``meta_model`` holding only stage ``stage``'s modules (others set to None / removed)."""
    if not hasattr(meta_model, "forward_hidden"):
        raise ConfigError("parallel.pp: pipeline parallelism is implemented for the transformer only; set pp 1")
    if getattr(meta_model.args, "tie_embeddings", False):
        raise ConfigError("parallel.pp: tied embeddings put the embedding and the head on one stage; "
                          "set --model.args.tie_embeddings false")  # fmt: skip
    model = copy.deepcopy(meta_model)
    keep = {str(i) for i in stage_layer_ranges(len(model.layers), n_stages)[stage]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(model: nn.Module, stage: int, n_stages: int, device: torch.device, group, schedule: str,
                   n_microbatches: int):  # fmt: skip
    """The PipelineStage for this rank's sub-model and a schedule running ``n_microbatches`` per step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if n_microbatches < n_stages:
        raise ConfigError(f"train.micro_batch: {n_microbatches} micro-batches per step for {n_stages} pipeline "
                          "stages leaves stages idle; lower train.micro_batch (>= pp micro-batches)")  # fmt: skip
    # The stage module is the (FSDP-wrapped) sub-model itself, so FSDP's forward hooks run: a middle stage returns
    # hidden states, the last stage logits (B, T, V) — the loss function must run outside the module here.
    pipe_stage = PipelineStage(model, stage, n_stages, device, group=group)
    loss_fn = None
    if stage == n_stages - 1:
        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # mean loss of one micro-batch
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[schedule]
    return cls(pipe_stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
