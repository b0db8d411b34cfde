"""Process group set-up and parallelism applied to single-device models from outside.

Order (torchtitan's): tensor parallel -> activation checkpointing -> compile -> data parallel (FSDP2 / DDP).
Everything is PyTorch's own engine: ``torch.distributed`` process groups, ``DeviceMesh``, FSDP2 ``fully_shard``
and ``DistributedDataParallel``. Launchers (torchrun, SLURM, MPI) only need to provide the usual environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ``launch_env`` maps SLURM/MPI variables to those.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from anytrain import hardware
from anytrain.config import RunConfig, check_fsdp_only_options
from anytrain.errors import ConfigError
from anytrain.models import spec_of
from anytrain.parallel import compression, fp8
from anytrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_env() -> DistInfo:
    """Rank facts from torchrun, MPI (mpirun) or SLURM (srun), exported as RANK / WORLD_SIZE / LOCAL_RANK /
    MASTER_ADDR / MASTER_PORT for ``init_process_group``; single process otherwise (``anytrain.parallel.env``)."""
    from anytrain.parallel.env import discover

    found = discover()
    found.export()
    return DistInfo(found.rank, found.world_size, found.local_rank)


def local_world_size() -> int:
    """Processes of this job on this host, from the launcher's environment (1 when it does not say)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 1


def physical_cores(cpus: set[int], sysfs: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """``cpus`` grouped by physical core (package, core id; SMT siblings together), cores ordered by lowest CPU."""
    groups: dict[tuple, list[int]] = {}
    for cpu in sorted(cpus):
        topo = f"{sysfs}/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f_pkg, open(f"{topo}/core_id") as f_core:
                key = (int(f_pkg.read()), int(f_core.read()))
        except (OSError, ValueError):
            key = (-1, cpu)  # no topology: every CPU its own core
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values(), key=min)


def core_share(cores: list[list[int]], local_rank: int, local_world: int) -> list[int] | None:
    """Local rank ``local_rank``'s CPUs: the ``local_rank``-th of ``local_world`` equal runs of whole cores (the
    remainder unused), or None when there are fewer cores than processes."""
    per = len(cores) // max(local_world, 1)
    if per == 0:
        return None
    return sorted(c for core in cores[local_rank * per : (local_rank + 1) * per] for c in core)


def bind_to_cores(local_rank: int, local_world: int, sysfs: str = "/sys/devices/system/cpu") -> list[int] | None:
    """Bind every thread of this process to local rank ``local_rank``'s share of the allowed physical cores
    (``parallel.cpu_affinity: cores``). Returns the CPUs, or None (nothing changed) when there are fewer physical
    cores than local processes or the OS has no affinity API."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    mine = core_share(physical_cores(os.sched_getaffinity(0), sysfs), local_rank, local_world)
    if mine is None:
        return None
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), mine)
    return mine


def init_distributed(device_request: str = "auto", timeout_s: int = 600,
                     cpu_affinity: str = "none") -> tuple[DistInfo, torch.device]:  # fmt: skip
    """Initialise the default process group if launched with several processes; pick this rank's device. With
    ``cpu_affinity="cores"`` the process is bound to its cores first, so the communication threads inherit it."""
    hardware.apply_env_defaults()
    info = launch_env()
    if cpu_affinity == "cores":
        bind_to_cores(info.local_rank, local_world_size())
    device = hardware.resolve_device(device_request, info.local_rank)
    if info.is_distributed and not dist.is_initialized():
        kwargs = {"device_id": device} if hardware.is_gpu(device) else {}
        dist.init_process_group(hardware.dist_backend(device), timeout=timedelta(seconds=timeout_s), **kwargs)
    return info, device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s Python object on every rank (identity when single-process)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_object(obj) -> list:
    """Every rank's Python object, in rank order, on every rank (``[obj]`` when single-process)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


# ---------------------------------------------------------------------------------------------------------------------
# Applying parallelism


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


AC_POLICIES = ("none", "selective", "full")


def checkpointed_blocks(blocks: list[nn.Module], policy: str) -> list[nn.Module]:
    """The blocks ``train.activation_checkpointing`` recomputes: none, every block (full), or every other block
    starting from the second (selective: torchtitan's layer-level policy with frequency 2, so half of the blocks
    keep their activations and half save only their input)."""
    if policy not in AC_POLICIES:
        raise ConfigError(f"train.activation_checkpointing: expected one of {', '.join(AC_POLICIES)}, got {policy!r}")
    if policy == "none":
        return []
    return list(blocks) if policy == "full" else list(blocks)[1::2]


def apply_activation_checkpointing(model: nn.Module, policy: str = "full") -> None:
    """Recompute the blocks ``policy`` selects in backward (non-reentrant checkpointing; state-dict keys unchanged
    for DCP)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    chosen = {id(b) for b in checkpointed_blocks(model.blocks(), policy)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in chosen:
                parent.register_module(name, checkpoint_wrapper(child, preserve_rng_state=False))


def resolve_compile_scope(scope: str, strategy: str, whole_model_when_auto: bool = True) -> str:
    """train.compile_scope for a run with this strategy: auto = the whole model in a one-process run (unless the
    family's ``ParallelizePlan.whole_model_when_auto`` says blocks), else blocks."""
    if scope == "auto":
        return "model" if strategy == "single" and whole_model_when_auto else "blocks"
    if scope == "model" and strategy != "single":
        raise ConfigError("train.compile_scope: 'model' needs a one-process run; use --train.compile_scope blocks "
                          "(or auto)")  # fmt: skip
    return scope


def apply_compile(model: nn.Module, scope: str = "blocks") -> None:
    """Compile each block separately (same-shaped blocks share one compiled graph and compile fast), or with scope
    "model" the model's whole body (embedding, blocks, final norm) as one graph, as its family's plan says; the loss
    stays outside (the chunked linear + cross-entropy runs its own kernels)."""
    if scope == "model":
        spec = spec_of(model)
        if spec.parallelize_plan.compile_model is None:
            raise ConfigError(f"train.compile_scope: 'model' is not implemented for {spec.name}; use blocks")
        spec.parallelize_plan.compile_model(model)
        return
    for block in model.blocks():
        block.compile(fullgraph=False)


def _dp_mesh(dims: ParallelDims, device: torch.device):
    """The data-parallel part of the run's mesh: 1D (dp_shard or dp_replicate) or 2D (dp_replicate, dp_shard)."""
    mesh = dims.build_mesh(device.type)
    names = tuple(n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ()))
    return mesh[names] if len(names) > 1 or mesh.ndim > 1 else mesh


# Each fully_shard'ed module's configured reshard_after_forward, restored after a step that kept parameters gathered.
_RESHARD_ATTR = "_anytrain_reshard_after_forward"


def apply_fsdp(model: nn.Module, dims: ParallelDims, device: torch.device, mp_dtype: torch.dtype | None,
               reshard: bool, group_blocks: int = 1, reduce_dtype: torch.dtype | None = None) -> nn.Module:  # fmt: skip
    """FSDP2: shard each block (or each group of ``group_blocks`` consecutive blocks, one unit for communication),
    then the root (embeddings, final norm, head); bf16 params with fp32 reduction, or ``reduce_dtype``
    (``parallel.grad_compression`` bf16 / fp16). On a 2D (dp_replicate, dp_shard) mesh this is HSDP: sharded inside a
    group, replicated across groups."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _dp_mesh(dims, device)
    if reduce_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=reduce_dtype)
    else:
        mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else (
            MixedPrecisionPolicy())  # fmt: skip
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


def parallelize(model: nn.Module, cfg: RunConfig, dims: ParallelDims, device: torch.device,
                compute_dtype: torch.dtype) -> tuple[nn.Module, str]:  # fmt: skip
    """Apply FP8 -> TP -> AC -> compile -> DDP/FSDP in this order, in place; returns (the model to call, strategy
    used). The family-specific steps (FP8 layers, TP plan, whole-model compile) come from the model's
    ``ModelSpec.parallelize_plan``."""
    strategy = resolve_strategy(cfg, dims)
    check_fsdp_only_options(cfg.parallel, strategy)
    if (dims.tp > 1 or dims.pp > 1) and strategy in ("ddp", "zero1"):
        raise ConfigError("parallel.strategy: tensor/pipeline parallelism combine with fsdp (or no data "
                          "parallelism); set --parallel.strategy fsdp")  # fmt: skip
    if cfg.train.fp8 != "none":  # first: TP, checkpointing, compile and FSDP then see the FP8 layers
        fp8.convert_model(model, cfg.train, strategy, device)
    if dims.tp > 1:
        spec = spec_of(model)
        if spec.parallelize_plan.tensor_parallel is None:
            raise ConfigError(f"parallel.tp: tensor parallelism is not implemented for {spec.name}; set tp 1")
        tp_mesh = dims.build_mesh(device.type)["tp"]
        spec.parallelize_plan.tensor_parallel(model, tp_mesh)
        if cfg.parallel.async_tp:  # before compile: the blocks' graphs are built with the fused collectives
            hardware.enable_async_tp(device, tp_mesh.get_group().group_name)
    if cfg.train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        whole = spec_of(model).parallelize_plan.whole_model_when_auto
        whole = whole(model) if callable(whole) else whole
        apply_compile(model, resolve_compile_scope(cfg.train.compile_scope, strategy, whole))
    if strategy == "fsdp":
        mp_dtype = compute_dtype if compute_dtype != torch.float32 else None
        model = apply_fsdp(model, dims, device, mp_dtype, cfg.parallel.reshard_after_forward,
                           cfg.parallel.fsdp_group_blocks, compression.reduce_dtype(cfg.parallel))  # fmt: skip
    elif strategy in ("ddp", "zero1"):  # zero1: replicated parameters and gradients; optim.py shards the state
        from torch.nn.parallel import DistributedDataParallel as DDP

        mesh = _dp_mesh(dims, device)
        group = mesh.get_group() if mesh.ndim == 1 else mesh["dp"].get_group()
        model = DDP(model, device_ids=[device.index] if hardware.is_gpu(device) else None, process_group=group,
                    bucket_cap_mb=cfg.parallel.ddp_bucket_mb)  # fmt: skip
        compression.attach(model, cfg.parallel, cfg.train, group)  # parallel.grad_compression's comm hook, if any
    return model, strategy


def dp_mesh_1d(dims: ParallelDims, device: torch.device):
    """The 1D DeviceMesh over the data-parallel ranks (the flattened 'dp' dimension for 2D data parallelism)."""
    mesh = _dp_mesh(dims, device)
    return mesh if mesh.ndim == 1 else dims.build_mesh(device.type)["dp"]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies the module in place, nothing to unwrap)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_partial_gradients(params) -> int:
    """Sum the gradients that tensor parallelism leaves Partial (the sequence-parallel norms' weights: each TP rank
    holds its own tokens' share) with ONE all-reduce per (mesh, placements), and mark them reduced, in place. Left
    Partial, every consumer reduces each of them again: the clipping norm once and AdamW's ops three times, 4 x (2L
    + 1) small all-reduces per step that each wait for the slowest rank (180 calls, 54 ms of a 0.49 s TP4 step on 4
    H100s). The reduced gradients keep their local storage (a CUDA graph writes to it). Under FSDP2 nothing is left
    Partial here: its reduction redistributes each gradient itself. Returns the collectives issued."""
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
                p.grad = DTensor.from_local(tensor, mesh, reduced, run_check=False, shape=p.grad.shape,
                                            stride=p.grad.stride())  # fmt: skip
    return issued


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
