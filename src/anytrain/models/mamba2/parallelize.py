"""How the Mamba-2 LM is parallelized: its pipeline split and whole-model compile.

No tensor-parallel plan: ``parallel.tp > 1`` is refused with one line (``anytrain.parallel``). Data parallelism
(DDP, ZeRO-1, FSDP) and activation checkpointing need only ``Mamba2.blocks()``.
"""

from __future__ import annotations

import torch
from torch import nn

from anytrain.models.losses import lm_cross_entropy
from anytrain.models.mamba2.model import Mamba2
from anytrain.models.protocol import ParallelizePlan


class Mamba2Stage(nn.Module):
    """A pipeline stage of the Mamba-2 LM: ``backbone`` (embeddings on the first stage, its layers, norm_f on the
    last) and ``lm_head`` on the last, under the full model's parameter names. The forward repeats
    ``Mamba2Backbone`` and ``Mamba2.forward`` for the modules this stage holds. Document masking is refused with
    pipeline stages at config load (later stages see hidden states, not token ids), so the blocks get no seq_idx."""

    def __init__(self, model: Mamba2) -> None:
        super().__init__()
        self.args = model.args
        self.backbone = model.backbone
        self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, D) later; returns hidden states, or on the last
        stage logits (B, T, V) / the mean token loss when ``targets`` (B, T) are given."""
        bb = self.backbone
        h = bb.stream(bb.embeddings(x) if bb.embeddings is not None else x)  # (B, T, D)
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


def pipeline_split(model: Mamba2, layers: range, first: bool, last: bool) -> Mamba2Stage:
    """A stage holding only ``layers`` of ``model`` (whose modules it takes over)."""
    keep = {str(i) for i in layers}
    for name in list(model.backbone.layers.keys()):
        if name not in keep:
            del model.backbone.layers[name]
    if not first:
        model.backbone.embeddings = None
    if not last:
        model.backbone.norm_f = model.lm_head = None
    return Mamba2Stage(model)


def compile_model(model: Mamba2) -> None:
    """Compile the backbone (embeddings, blocks, final norm) as one graph; the loss stays outside."""
    model.backbone.compile(fullgraph=False)


PLAN = ParallelizePlan(
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    stage_init=False,  # init_weights draws from one stream in module order: initialise the whole model, then cut
    stage_types=(Mamba2Stage,),
)
