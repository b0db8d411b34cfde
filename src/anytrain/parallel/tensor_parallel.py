"""Tensor parallelism from outside: the model family's TP plan applied over the mesh's ``tp`` dimension, and the one
reduction of the gradients that TP leaves Partial."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from anytrain import hardware
from anytrain.errors import ConfigError
from anytrain.models import spec_of
from anytrain.parallel.mesh import ParallelDims


def apply_tensor_parallel(
    model: nn.Module, dims: ParallelDims, device: torch.device, async_tp: bool = False, sequence_loss: bool = False
) -> None:
    """The family's ``ParallelizePlan.tensor_parallel`` over the run mesh's ``tp`` dimension, in place; with
    ``async_tp`` (``parallel.async_tp``) the fused collective-matmul kernels on that group, with ``sequence_loss``
    (``parallel.tp_sequence_loss``) the LM head and loss on each rank's sequence shard. Call it before compile: the
    blocks' graphs are then built with the fused collectives."""
    spec = spec_of(model)
    plan = spec.parallelize_plan
    if plan.tensor_parallel is None:
        raise ConfigError(f"parallel.tp: tensor parallelism is not implemented for {spec.name}; set tp 1")
    if sequence_loss and not plan.sequence_loss:
        raise ConfigError(
            f"parallel.tp_sequence_loss: not implemented for {spec.name} (the Transformer family has it); "
            "set --parallel.tp_sequence_loss false"
        )
    tp_mesh = dims.build_mesh(device.type)["tp"]
    if sequence_loss:
        plan.tensor_parallel(model, tp_mesh, sequence_loss=True)
    else:
        plan.tensor_parallel(model, tp_mesh)
    if async_tp:
        hardware.enable_async_tp(device, tp_mesh.get_group().group_name)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_partial_gradients(params) -> int:
    """Sum the gradients that tensor parallelism leaves Partial (the sequence-parallel norms' weights: each TP rank
    holds its own tokens' share) with ONE all-reduce per (mesh, placements), and mark them reduced, in place. Left
    Partial, every consumer reduces each of them again: the clipping norm once and AdamW's ops three times, 4 x (2L
    + 1) small all-reduces per step that each wait for the slowest rank. The reduced gradients keep their local
    storage (a CUDA graph writes to it). Under FSDP2 nothing is left Partial here: its reduction redistributes each
    gradient itself. Returns the collectives issued."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import Partial

    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(isinstance(pl, Partial) for pl in grad.placements):
            groups.setdefault((grad.device_mesh, tuple(grad.placements), grad.dtype), []).append(p)
    issued = 0
    with torch.no_grad():
        for (mesh, placements, _), members in groups.items():
            local = [p.grad.to_local() for p in members]
            flat = torch.cat([t.reshape(-1) for t in local])
            for dim, placement in enumerate(placements):
                if isinstance(placement, Partial):
                    if placement.reduce_op not in _REDUCE_OPS:
                        raise ValueError(f"reduce_partial_gradients: Partial({placement.reduce_op}) is not supported")
                    dist.all_reduce(flat, op=_REDUCE_OPS[placement.reduce_op], group=mesh.get_group(dim))
                    issued += 1
            pieces = flat.split([t.numel() for t in local])
            torch._foreach_copy_(local, [v.view_as(t) for v, t in zip(pieces, local, strict=True)])
            reduced = tuple(Replicate() if isinstance(pl, Partial) else pl for pl in placements)
            for p, tensor in zip(members, local, strict=True):
                p.grad = DTensor.from_local(
                    tensor, mesh, reduced, run_check=False, shape=p.grad.shape, stride=p.grad.stride()
                )
    return issued
