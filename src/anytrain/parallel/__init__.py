"""Parallelism applied to single-device models from outside, with PyTorch's own engine: ``torch.distributed``
process groups, ``DeviceMesh``, FSDP2 ``fully_shard``, ``DistributedDataParallel``, DTensor tensor parallelism and
``torch.distributed.pipelining``.

``parallelize`` applies, in place and in torchtitan's order: FP8 conversion -> tensor parallel -> activation
checkpointing -> compile -> data parallel (FSDP2 / DDP). One module per concern:

- ``env``: the launcher's environment (torchrun, SLURM, MPI mapped to RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  MASTER_PORT) and CPU-core binding.
- ``mesh``: ``init_distributed`` / ``shutdown`` of the process group, ``ParallelDims`` and the one DeviceMesh.
- ``collectives``: barrier, mean all-reduce, object broadcast / gather (identities in one process).
- ``tensor_parallel``, ``ac``, ``compile``, ``data_parallel``: the steps of ``parallelize``, and the gradient-sync
  context and TP's Partial-gradient reduction the trainer uses.
- ``fp8``, ``compression`` (gradient compression), ``pipeline``: FP8 layers, compressed reduction, pipeline stages.
"""

from __future__ import annotations

import torch
from torch import nn

from anytrain.config import RunConfig, check_fsdp_only_options
from anytrain.errors import ConfigError
from anytrain.parallel import compression, fp8
from anytrain.parallel.ac import apply_activation_checkpointing
from anytrain.parallel.compile import compile_model
from anytrain.parallel.data_parallel import apply_ddp, apply_fsdp, resolve_strategy
from anytrain.parallel.mesh import ParallelDims
from anytrain.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(
    model: nn.Module, cfg: RunConfig, dims: ParallelDims, device: torch.device, compute_dtype: torch.dtype
) -> tuple[nn.Module, str]:
    """Apply FP8 -> TP -> AC -> compile -> DDP/FSDP in this order, in place; returns (the model to call, strategy
    used). The family-specific steps (FP8 layers, TP plan, whole-model compile) come from the model's
    ``ModelSpec.parallelize_plan``."""
    strategy = resolve_strategy(cfg, dims)
    check_fsdp_only_options(cfg.parallel, strategy)
    if (dims.tp > 1 or dims.pp > 1) and strategy in ("ddp", "zero1"):
        raise ConfigError(
            "parallel.strategy: tensor/pipeline parallelism combine with fsdp (or no data parallelism); "
            "set --parallel.strategy fsdp"
        )
    if cfg.train.fp8 != "none":  # first: TP, checkpointing, compile and FSDP then see the FP8 layers
        fp8.convert_model(model, cfg.train, strategy, device)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims, device, cfg.parallel.async_tp, cfg.parallel.tp_sequence_loss)
    if cfg.train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        compile_model(model, cfg.train.compile_scope, strategy)
    if strategy == "fsdp":
        mp_dtype = compute_dtype if compute_dtype != torch.float32 else None
        model = apply_fsdp(
            model,
            dims,
            device,
            mp_dtype,
            cfg.parallel.reshard_after_forward,
            cfg.parallel.fsdp_group_blocks,
            compression.reduce_dtype(cfg.parallel),
        )
    elif strategy in ("ddp", "zero1"):
        model = apply_ddp(model, dims, device, cfg.parallel, cfg.train)
    return model, strategy
