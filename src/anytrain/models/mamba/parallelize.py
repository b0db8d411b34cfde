"""How the Mamba LM is parallelized: its pipeline split, whole-model compile and FP8 layers (no TP plan)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from anytrain.kernels import mamba_inner
from anytrain.models.losses import lm_cross_entropy
from anytrain.models.mamba.model import Mamba
from anytrain.models.protocol import ParallelizePlan


class BackboneStage(nn.Module):
    """A pipeline stage of a Mamba-layout LM (``backbone.{embeddings, layers, norm_f}`` and ``lm_head``): the
    backbone (embeddings on the first stage, its layers, norm_f on the last) and ``lm_head`` on the last, under the
    full model's parameter names. The forward repeats the backbone's and the LM's forward for the modules this stage
    holds (the model's own forward needs every piece). Each family subclasses it, so a stage names its family."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.args = model.args
        self.backbone = model.backbone
        self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, D) later; returns hidden states, or on the last
        stage logits (B, T, V) / the mean token loss when ``targets`` (B, T) are given."""
        bb = self.backbone
        h = bb.stream(bb.embeddings(x) if bb.embeddings is not None else x)  # (B, T, D); stages pass it in fp32
        for block in bb.layers.values():
            h = block(h)
        if bb.norm_f is None:
            return h
        h = bb.final_norm(h)
        if targets is not None:
            return lm_cross_entropy(h, self.lm_head.weight, targets)
        return self.lm_head(h)

    def blocks(self) -> list[nn.Module]:
        return list(self.backbone.layers.values())

    @property
    def hidden_size(self) -> int:
        return self.args.d_model

    @property
    def tie_embeddings(self) -> bool:
        return self.args.tie_embeddings


class MambaStage(BackboneStage):
    """A pipeline stage of the Mamba LM."""


def split_backbone(model: nn.Module, layers: range, first: bool, last: bool, stage: type[BackboneStage]):
    """A ``stage`` holding only ``layers`` of ``model`` (whose modules it takes over)."""
    keep = {str(i) for i in layers}
    for name in list(model.backbone.layers.keys()):
        if name not in keep:
            del model.backbone.layers[name]
    if not first:
        model.backbone.embeddings = None
    if not last:
        model.backbone.norm_f = model.lm_head = None
    return stage(model)


def pipeline_split(model: Mamba, layers: range, first: bool, last: bool) -> MambaStage:
    """A stage holding only ``layers`` of ``model`` (whose modules it takes over)."""
    return split_backbone(model, layers, first, last, MambaStage)


def fp8_linears(model: Mamba | MambaStage) -> list[str]:
    """FP8 candidates: each mixer's in_proj (D -> 2E) and out_proj (E -> D), the large GEMMs; x_proj and dt_proj (rank
    R and 2S wide) and the LM head stay high precision. The mixer then calls these two as modules
    (``MambaMixer.forward``), not its fused op."""
    return [f"backbone.layers.{key}.mixer.{name}" for key in model.backbone.layers for name in ("in_proj", "out_proj")]


def compile_model(model: Mamba) -> None:
    """Compile the backbone (embeddings, blocks, final norm) as one graph; the loss stays outside."""
    model.backbone.compile(fullgraph=False)


def step_context(model: Mamba, strategy: str, graphed: bool) -> contextlib.AbstractContextManager:
    """The fused mixer's weight casts shared by one optimizer step's micro-batches
    (``mamba_inner.cached_weight_casts``), where the parameters are the module's own full tensors (one process, DDP,
    ZeRO-1): not under FSDP (sharded, gathered per use; tensor and pipeline parallelism run under FSDP or none), not
    when a CUDA graph replays the micro-steps (each replay casts inside the graph)."""
    if graphed or strategy not in ("single", "ddp", "zero1"):
        return contextlib.nullcontext()
    return mamba_inner.cached_weight_casts()


PLAN = ParallelizePlan(
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    fp8_linears=fp8_linears,
    step_context=step_context,
    stage_init=False,  # init_weights draws from one stream in module order: initialise the whole model, then cut
    stage_types=(MambaStage,),
)
