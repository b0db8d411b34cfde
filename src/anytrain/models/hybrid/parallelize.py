"""How the hybrid LM is parallelized: its tensor-parallel plan, pipeline split, whole-model compile and per-step
context.

The hybrid has the Mamba families' module layout (``backbone.{embeddings, layers, norm_f}`` and ``lm_head``), so its
pipeline stages are cut by the same ``split_backbone`` and its body compiles as Mamba's; a stage's forward passes the
RoPE tables to its blocks as the backbone's does. Data parallelism (DDP, ZeRO-1, FSDP) and activation checkpointing
need only ``Hybrid.blocks()`` (one unit per pattern symbol). The attention and MLP blocks are the Transformer's
modules, so the Transformer's step context (weight gradients summed by their GEMMs in a one-process step) applies.

Tensor parallelism is Megatron's without sequence parallelism (the residual stream, norms, embedding and head whole
on every TP rank): each Mamba-2 mixer split over its heads as the Mamba-2 family's (``mamba2.parallelize.
shard_mixer``), each attention block over its heads (wq/wk/wv column-, wo row-parallel) and each MLP over its
hidden width (w1/w3 column-, w2 row-parallel); a block's input is made one replicated DTensor first, so its gradient
is all-reduced once, and its output is all-reduced by the row-parallel projection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from anytrain.errors import ConfigError
from anytrain.models.hybrid.model import ATTENTION, MAMBA, MLP, Hybrid, HybridArgs
from anytrain.models.llama.parallelize import step_context
from anytrain.models.losses import lm_cross_entropy
from anytrain.models.mamba.parallelize import BackboneStage, compile_model, split_backbone
from anytrain.models.mamba2.parallelize import check_mixer_tensor_parallel, shard_mixer
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


def check_tensor_parallel(args: HybridArgs, tp: int) -> None:
    """One ConfigError naming the field for a TP degree some block cannot be split over."""
    if args.has(MAMBA):
        check_mixer_tensor_parallel(args.mamba_args(), tp, prefix="model.args.mamba_")
    if args.has(ATTENTION) and (args.attn_heads % tp or args.attn_kv_heads % tp):
        raise ConfigError(
            f"parallel.tp: {tp} does not divide model.args.attn_heads {args.attn_heads} / attn_kv_heads "
            f"{args.attn_kv_heads}; choose a divisor"
        )
    if args.has(MLP) and args.ffn_dim % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide model.args.ffn_dim {args.ffn_dim}; choose a divisor")


def _replicated_input(n_args: int) -> PrepareModuleInput:
    """The module's first input as one replicated DTensor (its projections share it: one gradient all-reduce)."""
    rest = (None,) * (n_args - 1)
    return PrepareModuleInput(input_layouts=(Replicate(), *rest), desired_input_layouts=(Replicate(), *rest))


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any) -> None:
    """Shard every block of the hybrid (or a pipeline stage of it) over the 1D ``tp_mesh`` in place."""
    for block in model.blocks():
        if block.kind == MAMBA:
            shard_mixer(block.mixer, tp_mesh)
        elif block.kind == ATTENTION:
            plan = {"attention": _replicated_input(3), "attention.wo": RowwiseParallel()}
            plan |= {f"attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")}
            parallelize_module(block, tp_mesh, plan)
        else:
            plan = {"feed_forward": _replicated_input(1), "feed_forward.w2": RowwiseParallel()}
            plan |= {f"feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3") if getattr(block.feed_forward, n)}
            parallelize_module(block, tp_mesh, plan)


PLAN = ParallelizePlan(
    tensor_parallel=apply_tensor_parallel,
    check_tensor_parallel=check_tensor_parallel,
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    step_context=step_context,
    stage_init=False,  # init_weights draws from one stream in module order: initialise the whole model, then cut
    stage_types=(HybridStage,),
)
