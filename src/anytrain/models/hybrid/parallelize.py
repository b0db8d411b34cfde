"""How the hybrid LM is parallelized: its pipeline split, whole-model compile and per-step context.

The hybrid has the Mamba families' module layout (``backbone.{embeddings, layers, norm_f}`` and ``lm_head``), so its
pipeline stages are cut by the same ``split_backbone`` and its body compiles as Mamba's; a stage's forward passes the
RoPE tables to its blocks as the backbone's does. Data parallelism (DDP, ZeRO-1, FSDP) and activation checkpointing
need only ``Hybrid.blocks()`` (one unit per pattern symbol). The attention and MLP blocks are the Transformer's
modules, so the Transformer's step context (weight gradients summed by their GEMMs in a one-process step) applies.
"""

from __future__ import annotations

import torch

from anytrain.models.hybrid.model import Hybrid
from anytrain.models.llama.parallelize import step_context
from anytrain.models.losses import lm_cross_entropy
from anytrain.models.mamba.parallelize import BackboneStage, compile_model, split_backbone
from anytrain.models.protocol import ParallelizePlan


class HybridStage(BackboneStage):
    """A pipeline stage of the hybrid LM (embeddings on the first stage, its blocks, norm_f and the head on the last;
    parameter names of the whole model)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, D) later; returns hidden states, or on the last
        stage logits (B, T, V) / the mean token loss when ``targets`` (B, T) are given."""
        bb = self.backbone
        h = bb.run_layers(bb.stream(bb.embeddings(x) if bb.embeddings is not None else x))  # (B, T, D)
        if bb.norm_f is None:
            return h
        h = bb.final_norm(h)
        if targets is not None:
            return lm_cross_entropy(h, self.lm_head.weight, targets)
        return self.lm_head(h)


def pipeline_split(model: Hybrid, layers: range, first: bool, last: bool) -> HybridStage:
    """A stage holding only the blocks ``layers`` of ``model`` (whose modules it takes over)."""
    return split_backbone(model, layers, first, last, HybridStage)


PLAN = ParallelizePlan(
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    step_context=step_context,
    stage_init=False,  # init_weights draws from one stream in module order: initialise the whole model, then cut
    stage_types=(HybridStage,),
)
