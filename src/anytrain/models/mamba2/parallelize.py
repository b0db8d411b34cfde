"""How the Mamba-2 LM is parallelized: its tensor-parallel plan, pipeline split and whole-model compile.

The Mamba-2 LM has Mamba's module layout (``backbone.{embeddings, layers, norm_f}`` and ``lm_head``), so its stages
and compile are Mamba's (``models/mamba/parallelize.py``) under a class of its own. Document masking is refused with
pipeline stages at config load (later stages see hidden states, not token ids), so a stage's blocks get no seq_idx.
Data parallelism (DDP, ZeRO-1, FSDP) and activation checkpointing need only ``Mamba2.blocks()``.

Tensor parallelism splits each mixer over its heads, as Megatron-Core's Mamba mixer (no sequence parallelism: the
residual stream, the block norms, the embedding and the head stay whole on every TP rank). The mixer holds HF's
in_proj and conv1d one parameter per piece (``Mamba2Mixer``), so every piece is one DTensor: in_proj_z, in_proj_x,
in_proj_dt, conv_x, A_log, D, dt_bias and the gated norm's weight ``Shard(0)`` over heads (rank r holds heads r·H/tp
... (r+1)·H/tp - 1 and their channels); in_proj_B/C and conv_B/C ``Shard(0)`` over groups when tp divides ngroups,
else (ngroups 1, every released shape) ``Replicate`` with a Partial gradient (each rank's heads give their share;
``parallel.tensor_parallel.reduce_partial_gradients`` sums them); out_proj row-parallel (``Shard(1)``) with its output
all-reduced. The mixer's input gradient is all-reduced on entry (each rank's heads give their share), the SSD runs
on the rank's heads alone, and the gated RMSNorm is local when tp divides ngroups, else its one group's sum of
squares is all-reduced. Per mixer and micro-batch: one (B, T, D) all-reduce forward (out_proj) and one backward (the
input), plus a (B, T, 1) one each way for the norm when its group spans the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from anytrain.errors import ConfigError
from anytrain.models.mamba.parallelize import BackboneStage, compile_model, split_backbone
from anytrain.models.mamba2.model import Mamba2, Mamba2Args, Mamba2Mixer
from anytrain.models.protocol import ParallelizePlan


class Mamba2Stage(BackboneStage):
    """A pipeline stage of the Mamba-2 LM."""


def pipeline_split(model: Mamba2, layers: range, first: bool, last: bool) -> Mamba2Stage:
    """A stage holding only ``layers`` of ``model`` (whose modules it takes over)."""
    return split_backbone(model, layers, first, last, Mamba2Stage)


def check_mixer_tensor_parallel(args: Mamba2Args, tp: int, prefix: str = "model.args.") -> None:
    """One ConfigError naming the field for a TP degree the mixers cannot be split over."""
    if args.nheads % tp:
        raise ConfigError(
            f"parallel.tp: {tp} does not divide the Mamba-2 head count {args.nheads} (expand·d_model / "
            f"{prefix}headdim); choose a divisor"
        )
    if args.ngroups > 1 and args.ngroups % tp:
        raise ConfigError(
            f"parallel.tp: {tp} does not divide {prefix}ngroups {args.ngroups} (B and C are split by groups); "
            "choose a divisor"
        )


def check_tensor_parallel(args: Mamba2Args, tp: int) -> None:
    check_mixer_tensor_parallel(args, tp)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a mixer parameter as a plain tensor; a replicated one's gradient is left Partial (the
    rank's heads' share of it)."""
    if not isinstance(param, DTensor):
        return param
    grads = tuple(Partial() if isinstance(p, Replicate) else p for p in param.placements)
    return param.to_local(grad_placements=grads)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward and backward: each rank's output feeds only its own heads, so the input's gradient is
    the sum of every rank's output gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


_B_AND_C = ("in_proj_B.weight", "in_proj_C.weight", "conv_B.weight", "conv_B.bias", "conv_C.weight", "conv_C.bias")


def shard_mixer(mixer: Mamba2Mixer, tp_mesh) -> None:
    """Split one mixer over the 1D ``tp_mesh`` in place (the layout in the module docstring)."""
    tp = tp_mesh.size()
    by_groups = Shard(0) if mixer.args.ngroups % tp == 0 else Replicate()
    placements = {
        "dt_bias": Shard(0),
        "A_log": Shard(0),
        "D": Shard(0),
        "norm.weight": Shard(0),
        "in_proj_z.weight": Shard(0),
        "in_proj_x.weight": Shard(0),
        "in_proj_dt.weight": Shard(0),
        "conv_x.weight": Shard(0),
        "conv_x.bias": Shard(0),
        **dict.fromkeys(_B_AND_C, by_groups),
    }
    for name, placement in placements.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = mixer.get_submodule(owner_name) if owner_name else mixer
        param = getattr(owner, leaf)
        owner.register_parameter(leaf, nn.Parameter(distribute_tensor(param.data, tp_mesh, [placement])))
    parallelize_module(mixer.out_proj, tp_mesh, RowwiseParallel())  # (B, T, E/tp) -> all-reduced (B, T, D)
    mixer.local = mixer.norm.local = _local
    if not isinstance(by_groups, Shard):  # one group of E channels spread over the ranks
        group = tp_mesh.get_group()
        mixer.norm.sum_over_ranks = lambda t: _SumOverRanks.apply(t, group)

    def enter(module, args):  # the input's gradient: the sum of every rank's heads' shares
        h = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
        return (h.to_local(grad_placements=[Partial()]), *args[1:])

    mixer.register_forward_pre_hook(enter)


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Shard every Mamba-2 mixer of the model (or a pipeline stage of it) over the 1D ``tp_mesh`` in place."""
    for block in model.blocks():
        shard_mixer(block.mixer, tp_mesh)


PLAN = ParallelizePlan(
    tensor_parallel=apply_tensor_parallel,
    check_tensor_parallel=check_tensor_parallel,
    pipeline_split=pipeline_split,
    compile_model=compile_model,
    stage_init=False,  # init_weights draws from one stream in module order: initialise the whole model, then cut
    stage_types=(Mamba2Stage,),
)
