"""How the Transformer is parallelized: its tensor-parallel plan, pipeline split, whole-model compile and FP8 layers.

Tensor parallelism with sequence parallelism, on DTensor's ``parallelize_module`` (Megatron layout per block):
wq/wk/wv and w1/w3 column-parallel (heads / FFN columns split over the TP ranks), wo and w2 row-parallel; the norms
and residual stream are sequence-parallel (each TP rank holds T/tp tokens), so activations outside attention/FFN are
not replicated. The embedding is row-parallel with a sequence-sharded output. The final norm hands the LM head a full
(replicated) tensor, and the head is *not* split: every TP rank computes the same fused linear+cross-entropy (the loss
never forms full logits) — simpler, at the cost of repeating the head's matmul on each TP rank (vocab × d per token;
~6% of a 1.1B model's FLOPs at tp 2). With ``parallel.tp_sequence_loss`` the final norm's output stays
sequence-sharded instead and each rank scores its own positions (``SequenceShardedLoss`` below). A tied embedding
is the head's tensor, so it stays whole too (a plain tensor on every TP rank, no extra memory) and the first block
shards its output by sequence on entry.

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
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from anytrain.kernels import wide_mm
from anytrain.kernels.fused_linear_ce import IGNORE_INDEX
from anytrain.models.llama.model import Transformer
from anytrain.models.losses import lm_cross_entropy
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


def _to_local_shard() -> PrepareModuleOutput:
    """A sequence-sharded output -> this rank's (B, T/tp, D) shard as a plain tensor (``parallel.tp_sequence_loss``)."""
    return PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=True)


def apply_tensor_parallel(model: Transformer, tp_mesh, sequence_loss: bool = False) -> None:
    """Shard the Transformer (or a pipeline stage of it) over the 1D ``tp_mesh`` in place. With ``sequence_loss``
    the final hidden states stay sequence-sharded and the head and loss run on each rank's shard
    (``SequenceShardedLoss``) instead of on the whole sequence on every rank."""
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
    # the head and the loss see the whole sequence as a plain tensor on every TP rank, or this rank's shard of it
    last_output = _to_local_shard() if sequence_loss else _to_full()
    if model.norm is not None:
        parallelize_module(model.norm, tp_mesh, last_output)
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
        parallelize_module(blocks[-1], tp_mesh, last_output)
    if sequence_loss:
        model.sequence_loss = SequenceShardedLoss(tp_mesh.get_group(), rank, tp, tp_mesh)


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


# ---------------------------------------------------------------------------------------------------------------------
# The LM head and the loss on each TP rank's sequence shard (parallel.tp_sequence_loss)
#
# With sequence parallelism every TP rank holds T/tp positions of the final norm's output. Instead of gathering the
# whole sequence and repeating the head's V x D matmul and the cross-entropy on every rank, each rank scores its own
# positions against the whole (replicated) head weight:
#
# * the rank's targets are the same ``torch.chunk`` of the sequence that its hidden-state shard is (DTensor's
#   ``Shard(1)``; the config check asks for a sequence length divisible by tp);
# * its loss is the sum of its positions' token losses over the micro-batch's count of valid targets (every rank
#   holds all targets, so the count needs no collective), and the micro-batch loss is the sum of the ranks' shares
#   (an all-reduce in the forward whose backward is the identity: each rank's share reaches the loss once);
# * the head weight enters through the identity whose backward all-reduces the gradient over the TP group (each
#   rank's gradient covers only its positions), in the compute dtype: one V x D all-reduce per micro-batch, in place
#   of the all-gather of the hidden states and tp - 1 repeats of the head's matmul. A tied embedding adds its
#   lookup's gradient, the same on every rank, as before.
#
# A shard without a valid target scores one stand-in target weighted 0 (no NaN, no host sync). The logits path
# (no targets: evaluation by logits, sampling) gathers the whole sequence first.


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum of ``x`` over the group (every rank gets it). Backward: the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # noqa: ARG004 - autograd's signature
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ARG004
        return grad, None


class _SumGradOverGroup(torch.autograd.Function):
    """Forward: the identity. Backward: the gradient summed over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SequenceShardedLoss:
    """Installed on a model as ``sequence_loss`` by its tensor-parallel plan; ``__call__`` replaces
    ``lm_cross_entropy(hidden, head_weight, targets)`` for the rank's (B, T/tp, D) hidden states and the full (B, T)
    targets, ``gather`` gives the logits path the full (B, T, D) hidden states."""

    def __init__(self, group, rank: int, size: int, mesh=None) -> None:
        self.group, self.rank, self.size, self.mesh = group, rank, size, mesh

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        local = targets.chunk(self.size, dim=1)[self.rank]
        if local.shape[1] != hidden.shape[1]:
            raise ValueError(
                f"parallel.tp_sequence_loss: hidden shard of {hidden.shape[1]} positions against {local.shape[1]} "
                f"targets; the sequence length must be divisible by parallel.tp"
            )
        n_all = (targets != IGNORE_INDEX).sum()
        n_local = (local != IGNORE_INDEX).sum()
        stand_in = local.reshape(-1)[:1]
        local = local.clone()
        local.view(-1)[:1] = torch.where(n_local > 0, stand_in, torch.zeros_like(stand_in))
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):  # the gradient's all-reduce in the compute dtype
            head_weight = head_weight.to(torch.get_autocast_dtype(device_type))
        weight = _SumGradOverGroup.apply(head_weight, self.group)
        share = lm_cross_entropy(hidden, weight, local) * (n_local / n_all.clamp_min(1))
        return _SumOverGroup.apply(share, self.group)

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rank's (B, T/tp, D) shard -> the whole (B, T, D), differentiably (a DTensor redistribution)."""
        if self.mesh is None:
            raise ValueError("SequenceShardedLoss.gather needs the tensor-parallel mesh")
        shard = DTensor.from_local(hidden, self.mesh, [Shard(1)], run_check=False)
        return shard.redistribute(self.mesh, [Replicate()]).to_local()


PLAN = ParallelizePlan(
    tensor_parallel=apply_tensor_parallel,
    sequence_loss=True,
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    fp8_linears=fp8_linears,
    step_context=step_context,
    stage_init=True,  # init_weights(seed) draws each parameter from a stream keyed by its name
)
