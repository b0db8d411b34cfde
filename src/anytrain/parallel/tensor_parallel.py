"""Tensor parallelism with sequence parallelism for the Transformer, on DTensor's ``parallelize_module``.

Megatron layout per block: wq/wk/wv and w1/w3 column-parallel (heads / FFN columns split over the TP ranks),
wo and w2 row-parallel; the norms and residual stream are sequence-parallel (each TP rank holds T/tp tokens), so
activations outside attention/FFN are not replicated. The embedding is row-parallel with a sequence-sharded output.
The final norm hands the LM head a full (replicated) tensor, and the head is *not* split: every TP rank computes the
same fused linear+cross-entropy (the loss never forms full logits) — simpler, at the cost of repeating the head's
matmul on each TP rank (vocab × d per token; ~6% of a 1.1B model's FLOPs at tp 2).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from anytrain.errors import ConfigError


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Shard the Transformer's blocks over ``tp_mesh`` in place (also works on a pipeline stage's sub-model)."""
    if not hasattr(model, "layers") or not hasattr(model, "forward_hidden"):
        raise ConfigError("parallel.tp: tensor parallelism is implemented for the transformer only; set tp 1")
    top_plan = {}
    if model.tok_embeddings is not None:
        top_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top_plan["norm"] = SequenceParallel()
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)
    if model.norm is not None:  # the head and the loss see the whole sequence as a plain tensor on every TP rank
        parallelize_module(model.norm, tp_mesh,
                           PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                               use_local_output=True))  # fmt: skip
    for block in model.layers.values():
        block_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),  # fmt: skip
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, block_plan)
    if model.tok_embeddings is None:
        # a later pipeline stage receives full hidden states: shard them along the sequence on entry
        first = next(iter(model.layers.values()))
        parallelize_module(first, tp_mesh, PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                                              desired_input_layouts=(Shard(1), None, None),
                                                              use_local_output=True))  # fmt: skip
    if model.norm is None:
        last = list(model.layers.values())[-1]
        to_full = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                      use_local_output=True)  # fmt: skip
        parallelize_module(last, tp_mesh, to_full)
