"""How the Transformer is parallelized: its tensor-parallel plan, pipeline split, whole-model compile and FP8 layers.

Tensor parallelism with sequence parallelism, on DTensor's ``parallelize_module`` (Megatron layout per block):
wq/wk/wv and w1/w3 column-parallel (heads / FFN columns split over the TP ranks), wo and w2 row-parallel; the norms
and residual stream are sequence-parallel (each TP rank holds T/tp tokens), so activations outside attention/FFN are
not replicated. The embedding is row-parallel with a sequence-sharded output. The final norm hands the LM head a full
(replicated) tensor, and the head is *not* split: every TP rank computes the same fused linear+cross-entropy (the loss
never forms full logits) — simpler, at the cost of repeating the head's matmul on each TP rank (vocab × d per token;
~6% of a 1.1B model's FLOPs at tp 2). A tied embedding is the head's tensor, so it stays whole too (a plain tensor on
every TP rank, no extra memory) and the first block shards its output by sequence on entry.

The options shard the same way: LayerNorm (weight and bias) is sequence-parallel like RMSNorm; biases of column-
parallel projections are split with their rows, those of row-parallel ones replicated (added once after the
reduction); the GELU MLP is w1 column- and w2 row-parallel; QK-norm runs on each rank's heads (its E-wide weight
replicated, the input sharded over heads); ALiBi keeps each rank's slice of the slopes; a learned position table is
row-parallel like the token embedding, with the same sequence-sharded output, so the two add shard by shard (both
whole when the embedding is tied).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from anytrain.kernels import wide_mm
from anytrain.models.llama.model import Transformer
from anytrain.models.protocol import ParallelizePlan


def block_plan(block: torch.nn.Module) -> dict:
    """The per-block plan (fresh styles per block): Megatron column/row split, norms sequence-parallel."""
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if block.feed_forward.w3 is not None:  # SwiGLU's up projection
        plan["feed_forward.w3"] = ColwiseParallel()
    if block.attention.q_norm is not None:  # per-head norms of (B, T, H/tp, E): heads are dim 2
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _to_full() -> PrepareModuleOutput:
    """A sequence-sharded output -> the full (B, T, D) tensor as a plain tensor on every TP rank."""
    return PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)


def _wait_for_async_output(module: torch.nn.Module, inputs, output):
    """A row-parallel embedding's sequence-sharded output as a plain tensor: DTensor leaves its reduce-scatter in
    flight (an ``AsyncCollectiveTensor``), and a compiled block that takes one as input returns a plain gradient where
    the redistribute's backward needs a DTensor (torch 2.13: "'Tensor' object has no attribute '_local_tensor'"). The
    first block waits for the collective at once anyway."""
    # an op on the wrapper waits and returns a plain tensor inside autograd (``wait()`` would detach the embedding)
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def apply_tensor_parallel(model: Transformer, tp_mesh) -> None:
    """Shard the Transformer (or a pipeline stage of it) over the 1D ``tp_mesh`` in place."""
    top_plan = {}
    # A tied embedding is the (unsplit, plain) LM head's tensor: it stays whole on every TP rank, so the head keeps
    # it and the blocks shard the full embedding output on entry. Untied, the tables are row-parallel.
    split_embeddings = model.tok_embeddings is not None and not model.tie_embeddings
    if split_embeddings:
        top_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if split_embeddings and model.pos_embeddings is not None:
        top_plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top_plan["norm"] = SequenceParallel()
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)
    if split_embeddings:  # after parallelize_module's own output hooks
        for table in (model.tok_embeddings, model.pos_embeddings):
            if table is not None:
                table.register_forward_hook(_wait_for_async_output)
    if model.norm is not None:  # the head and the loss see the whole sequence as a plain tensor on every TP rank
        parallelize_module(model.norm, tp_mesh, _to_full())
    blocks = model.blocks()
    rank, tp = tp_mesh.get_local_rank(), tp_mesh.size()
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan(block))
        slopes = getattr(block.attention, "alibi_slopes", None)
        if slopes is not None:  # this rank's query heads are the rank-th H/tp of them
            block.attention.alibi_slopes = slopes.chunk(tp)[rank].clone()
    if not split_embeddings:  # full hidden states (a later pipeline stage's input, a tied embedding's output)
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Shard(1), None, None),
                use_local_output=True,
            ),
        )
    if model.norm is None:
        parallelize_module(blocks[-1], tp_mesh, _to_full())


def pipeline_split(model: Transformer, layers: range, first: bool, last: bool) -> Transformer:
    """The model, in place, holding only ``layers``; its forward skips the pieces set to None."""
    keep = {str(i) for i in layers}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if not first:
        model.tok_embeddings = model.pos_embeddings = None
    if not last:
        model.norm = model.output = None
    return model


def fp8_linears(model: Transformer) -> list[str]:
    """FP8 candidates: every projection of the blocks this module holds (wq, wk, wv, wo and the MLP's w1, w3, w2). Not
    the LM head: the fused linear + cross-entropy reads its weight and never calls it."""
    return [
        f"layers.{key}.{name}"
        for key, block in model.layers.items()
        for name, module in block.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def compile_model(model: Transformer) -> None:
    """Compile ``forward_hidden`` (embedding, blocks, final norm) as one graph; the loss stays outside."""
    model.forward_hidden = torch.compile(model.forward_hidden, fullgraph=False)


def step_context(model: Transformer, strategy: str, graphed: bool) -> contextlib.AbstractContextManager:
    """One process (no DDP reducer hooks on the gradients): from an optimizer step's second micro-batch on, the
    projections' weight gradients are summed into ``.grad`` by their GEMMs (``wide_mm.accumulate_in_gemm``), in eager
    micro-steps and in a captured CUDA graph alike."""
    return wide_mm.accumulate_in_gemm(strategy == "single")


PLAN = ParallelizePlan(
    tensor_parallel=apply_tensor_parallel,
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    fp8_linears=fp8_linears,
    step_context=step_context,
    stage_init=True,  # init_weights(seed) draws each parameter from a stream keyed by its name
)
