"""Data parallelism: choosing the strategy, FSDP2 (incl. HSDP) and DDP (incl. ZeRO-1's replicated parameters)
wrapping, and skipping or deferring the gradient reduction across an accumulation step's micro-batches.

Strategies (``resolve_strategy``): 'single' (one process), 'ddp', 'zero1' (DDP + sharded optimizer state, which
``train/optim.py`` shards), 'fsdp' (incl. HSDP on a 2D (dp_replicate, dp_shard) mesh), or 'none' (model parallel
only, no data parallelism).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from anytrain import hardware
from anytrain.config import ParallelConfig, RunConfig, TrainConfig
from anytrain.parallel import compression
from anytrain.parallel.mesh import ParallelDims


def resolve_strategy(cfg: RunConfig, dims: ParallelDims) -> str:
    """'single' (one process), 'ddp', 'zero1' (DDP + sharded optimizer state), 'fsdp' (incl. HSDP), or 'none'
    (model parallel only, no data parallelism)."""
    if dims.world_size == 1:
        return "single"  # one process: nothing to shard or replicate
    if dims.dp == 1:
        return "none"
    if cfg.parallel.strategy == "auto":  # model parallelism composes with FSDP2 (DTensor parameters), not DDP
        return "fsdp" if dims.tp > 1 or dims.pp > 1 else "ddp"
    return cfg.parallel.strategy


def _dp_mesh(dims: ParallelDims, device: torch.device):
    """The data-parallel part of the run's mesh: 1D (dp_shard or dp_replicate) or 2D (dp_replicate, dp_shard)."""
    mesh = dims.build_mesh(device.type)
    names = tuple(n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ()))
    return mesh[names] if len(names) > 1 or mesh.ndim > 1 else mesh


def dp_mesh_1d(dims: ParallelDims, device: torch.device):
    """The 1D DeviceMesh over the data-parallel ranks (the flattened 'dp' dimension for 2D data parallelism)."""
    mesh = _dp_mesh(dims, device)
    return mesh if mesh.ndim == 1 else dims.build_mesh(device.type)["dp"]


# Each fully_shard'ed module's configured reshard_after_forward, restored after a step that kept parameters gathered.
_RESHARD_ATTR = "_anytrain_reshard_after_forward"


def apply_fsdp(
    model: nn.Module,
    dims: ParallelDims,
    device: torch.device,
    mp_dtype: torch.dtype | None,
    reshard: bool,
    group_blocks: int = 1,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """FSDP2: shard each block (or each group of ``group_blocks`` consecutive blocks, one unit for communication),
    then the root (embeddings, final norm, head); bf16 params with fp32 reduction, or ``reduce_dtype``
    (``parallel.grad_compression`` bf16 / fp16). On a 2D (dp_replicate, dp_shard) mesh this is HSDP: sharded inside a
    group, replicated across groups."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _dp_mesh(dims, device)
    if reduce_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=reduce_dtype)
    elif mp_dtype:
        mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    blocks = model.blocks()
    groups = [blocks[i : i + group_blocks] for i in range(0, len(blocks), group_blocks)]
    for i, group in enumerate(groups):
        # The last unit's params are needed again right away by backward: keeping them saves one all-gather.
        keep = reshard and i < len(groups) - 1
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=mp, reshard_after_forward=keep)
        for block in group:
            setattr(block, _RESHARD_ATTR, keep)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    setattr(model, _RESHARD_ATTR, reshard)
    return model


def apply_ddp(
    model: nn.Module, dims: ParallelDims, device: torch.device, parallel: ParallelConfig, train: TrainConfig
) -> nn.Module:
    """DDP over the data-parallel ranks (ddp and zero1: replicated parameters and gradients; ``train/optim.py``
    shards zero1's optimizer state), with ``parallel.grad_compression``'s communication hook, if any, and the
    gradients as views of its buckets with ``parallel.ddp_bucket_view``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = _dp_mesh(dims, device)
    group = mesh.get_group() if mesh.ndim == 1 else mesh["dp"].get_group()
    model = DDP(
        model,
        device_ids=[device.index] if hardware.is_gpu(device) else None,
        process_group=group,
        bucket_cap_mb=parallel.ddp_bucket_mb,
        gradient_as_bucket_view=parallel.ddp_bucket_view,
    )
    compression.attach(model, parallel, train, group)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place, nothing to unwrap)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, strategy: str, sync: bool, keep_gathered: bool = False):
    """Skip the gradient all-reduce on non-final micro-batches of an accumulation step.

    ``keep_gathered`` (FSDP, ``parallel.reshard_during_accumulation: false``; pass it only when the step has several
    micro-batches): the first micro-batch's forward all-gathers the parameters and they stay gathered (no reshard
    after forward or backward) until the last micro-batch's backward, which reduce-scatters and reshards; then each
    module gets its configured reshard_after_forward back, so evaluation and checkpoints see the usual set-up."""
    if strategy in ("ddp", "zero1") and not sync:
        with model.no_sync():
            yield
        return
    if strategy != "fsdp":
        yield
        return
    model.set_requires_gradient_sync(sync)
    if not keep_gathered:
        yield
        return
    model.set_reshard_after_forward(False)  # the final micro-batch too: resharding would force a second gather
    model.set_reshard_after_backward(sync)
    try:
        yield
    except BaseException:
        _restore_resharding(model, reshard_now=True)  # leave no gathered parameters behind a failed step
        raise
    if sync:
        _restore_resharding(model)


def _restore_resharding(model: nn.Module, reshard_now: bool = False) -> None:
    """Each FSDP module's configured reshard_after_forward (recorded by ``apply_fsdp``), reshard after backward on;
    ``reshard_now`` also frees any parameters still gathered."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(getattr(module, _RESHARD_ATTR, True), recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            if reshard_now:
                module.reshard()
