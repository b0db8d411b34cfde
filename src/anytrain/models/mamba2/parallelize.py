"""How the Mamba-2 LM is parallelized: its pipeline split and whole-model compile.

The Mamba-2 LM has Mamba's module layout (``backbone.{embeddings, layers, norm_f}`` and ``lm_head``), so its stages
and compile are Mamba's (``models/mamba/parallelize.py``) under a class of its own. Document masking is refused with
pipeline stages at config load (later stages see hidden states, not token ids), so a stage's blocks get no seq_idx.
No tensor-parallel plan: ``parallel.tp > 1`` is refused with one line (``anytrain.parallel``). Data parallelism
(DDP, ZeRO-1, FSDP) and activation checkpointing need only ``Mamba2.blocks()``.
"""

from __future__ import annotations

from anytrain.models.mamba.parallelize import BackboneStage, compile_model, split_backbone
from anytrain.models.mamba2.model import Mamba2
from anytrain.models.protocol import ParallelizePlan


class Mamba2Stage(BackboneStage):
    """A pipeline stage of the Mamba-2 LM."""


def pipeline_split(model: Mamba2, layers: range, first: bool, last: bool) -> Mamba2Stage:
    """A stage holding only ``layers`` of ``model`` (whose modules it takes over)."""
    return split_backbone(model, layers, first, last, Mamba2Stage)


PLAN = ParallelizePlan(
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    stage_init=False,  # init_weights draws from one stream in module order: initialise the whole model, then cut
    stage_types=(Mamba2Stage,),
)
