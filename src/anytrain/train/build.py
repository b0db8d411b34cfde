"""The Trainer's construction, as parts it holds.

``setup_layout``: the ``Layout`` (this process's rank and device, the parallel degrees, its data-parallel coordinate,
the batch plan, the model's args), after the checks that refuse a run before anything is built. ``build_model``: the
``BuiltModel`` (the model as trained or this rank's pipeline stages, optimizer and LR schedule, autocast and the
family's step context). ``open_sources``: the ``DataSources``. ``setup_cuda_graphs``: the captured micro-step, where
that is sound.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from anytrain import hardware
from anytrain.checkpoint.hf_import import init_from_hf
from anytrain.config import BatchPlan, RunConfig, check_document_mask, plan_batches
from anytrain.data.loader import BatchProvider, BatchSource, SampleIndex
from anytrain.data.mixture import open_mixture
from anytrain.data.sft import masked_sources
from anytrain.errors import ConfigError
from anytrain.models import ModelSpec, configure_kernels, get_spec, resolve_args
from anytrain.models.protocol import StepContext
from anytrain.parallel import parallelize
from anytrain.parallel.collectives import gather_object
from anytrain.parallel.compression import GradCommMeter
from anytrain.parallel.data_parallel import dp_mesh_1d, resolve_strategy, unwrap
from anytrain.parallel.env import DistInfo
from anytrain.parallel.fp8 import attach_fp8
from anytrain.parallel.mesh import ParallelDims, init_distributed, validate_for_model
from anytrain.parallel.pipeline import (
    build_schedule,
    build_stage_parts,
    merge_parts,
    pipeline_forward,
    rank_stages,
    step_accepts_return_outputs,
)
from anytrain.train import cuda_graph
from anytrain.train.optim import Zero1AdamW, build_optimizer, build_scheduler

Log = Callable[[str], None]
"""A line for the run's console (rank 0's ``MetricsLogger.print``)."""


def compute_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    if cfg.train.dtype == "fp32":
        return torch.float32
    if cfg.train.dtype == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if hardware.supports_bf16(device) else torch.float32


def apply_auto_layout(cfg: RunConfig, world_size: int, device: torch.device) -> str | None:
    """parallel.auto: take strategy / micro-batch / activation checkpointing from the cost model's plan."""
    from anytrain.cost.planner import choose_layout

    choice = choose_layout(cfg, world_size, hardware.device_spec(device))
    for key in (
        "parallel.strategy",
        "parallel.reshard_after_forward",
        "train.micro_batch",
        "train.activation_checkpointing",
    ):
        if key in choice:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, choice[key])
    return choice.get("reason")


def gather_affinity() -> list:
    """Every rank's CPUs after ``parallel.cpu_affinity: cores`` (for summary.json)."""
    return gather_object(sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)


def check_data_fits_model(dataset, model_args, seq_len: int) -> None:
    if dataset.vocab_size > model_args.vocab_size:
        raise ConfigError(
            f"model.args.vocab_size: {model_args.vocab_size} is smaller than the tokenizer vocabulary "
            f"{dataset.vocab_size} of {dataset.path}; set --model.args.vocab_size "
            f"{dataset.vocab_size} or larger"
        )
    if seq_len > model_args.max_seq_len:
        raise ConfigError(f"data.seq_len: {seq_len} exceeds model.args.max_seq_len {model_args.max_seq_len}")


FIT_MARGIN = 1.3
"""A run is refused only when the cost model's peak exceeds the device's memory by more than this factor: beyond the
model's error band against allocator peaks (docs/cost-model.md), so that no run that would fit is turned away."""


def check_model_fits(cfg: RunConfig, dims: ParallelDims, micro_batch: int, device: torch.device) -> None:
    """Refuse, before anything is built, a model whose training step cannot fit one device (on the CPU: the host's
    RAM): the cost model's peak per device (cost/memory.py) and, without pipeline stages, the whole model's fp32
    weights (``init_weights`` materialises all of them on each device before any sharding), both from the config's
    arithmetic alone. Model families the cost model does not cover (arch hf) are not checked."""
    from anytrain.cost.devices import from_spec
    from anytrain.cost.memory import run_memory_estimate
    from anytrain.cost.shapes import GIB, shape_from_config

    capacity = hardware.memory_capacity(device)
    try:
        shape = shape_from_config(cfg)
    except ConfigError:
        return  # a family the cost model does not cover
    if not capacity:
        return
    weights = 4 * shape.num_params if dims.pp == 1 else 0
    if weights > capacity:
        need = f"its fp32 weights alone take {weights / GIB:,.1f} GiB on each device"
    else:
        spec = from_spec(hardware.device_spec(device))
        fp32 = compute_dtype(cfg, device) == torch.float32
        est = run_memory_estimate(
            cfg,
            dims,
            resolve_strategy(cfg, dims),
            micro_batch,
            fp32,
            spec.blas_workspace_mib if spec is not None else 0.0,
        )
        if est is None or est[0] * GIB <= FIT_MARGIN * capacity:
            return
        need = f"the cost model puts a training step's peak at {est[0]:,.1f} GiB per device ({est[1]})"
    where = f"the {hardware.device_name(device)}'s" if hardware.is_gpu(device) else "the host's RAM of"
    raise ConfigError(
        f"model.args: {cfg.model.arch}/{cfg.model.flavour} has {shape.num_params:,} parameters and "
        f"{need}, more than {where} {capacity / GIB:,.1f} GiB; make it smaller (model.args dim / "
        "n_layers / vocab_size) or spread it (parallel.strategy fsdp, parallel.tp / pp, "
        "train.micro_batch, train.activation_checkpointing)"
    )


def init_weights(model: torch.nn.Module, device: torch.device, seed: int, init_device: str = "device") -> None:
    """Materialise a meta-device model on ``device`` and initialise its weights from ``seed``; with ``init_device``
    'cpu' (model.init_device) the weights are drawn on the CPU and copied to ``device``."""
    model.to_empty(device="cpu" if init_device == "cpu" else device)
    torch.manual_seed(seed)  # identical weights on every rank of the same device type
    if "seed" in inspect.signature(model.init_weights).parameters:
        model.init_weights(seed=seed)  # per-parameter streams: independent of the layout
    else:
        model.init_weights()
    if init_device == "cpu":
        model.to(device)


def setup_document_mask(cfg: RunConfig, model: torch.nn.Module, dataset, batches: BatchProvider | None) -> None:
    """data.document_mask: the model splits its input at the data's EOS id (the dataset's index.json, or the
    ``eos_id`` attribute of the ``batches`` given to the trainer) and keeps attention inside each document."""
    if not cfg.data.document_mask:
        return
    check_document_mask(cfg)  # also for a config built in code (the benches), which load_config did not see
    eos_id = dataset.eos_id if dataset is not None else getattr(batches, "eos_id", None)
    if eos_id is None:
        raise ConfigError(
            "data.document_mask: the batches given to Trainer have no eos_id attribute (the token "
            "that ends each document); set one or turn data.document_mask off"
        )
    model.document_eos_id = int(eos_id)


def clip_in_optimizer(optimizer: torch.optim.Optimizer, strategy: str, dims: ParallelDims) -> bool:
    """Whether gradient clipping hands its factor to the fused AdamW (``grad_scale``, which the kernel divides each
    gradient by as it reads it) instead of scaling every gradient in a pass of its own: plain (non-DTensor) gradients
    on one mesh (one process or DDP) and torch's fused AdamW. The trainer asks only with ``train.clip_in_optimizer``."""
    fused = type(optimizer) is torch.optim.AdamW and all(g.get("fused") for g in optimizer.param_groups)
    return fused and strategy in ("single", "ddp") and dims.tp == 1 and dims.pp == 1


def lagged_checks_apply(cfg: RunConfig, optimizer: torch.optim.Optimizer) -> bool:
    """train.lagged_checks takes effect with the fused AdamW (its found_inf skips a non-finite update on the device)
    and without the spike guard (which needs the step's loss on the host before the update)."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return bool(cfg.train.lagged_checks and fused and not cfg.train.spike_factor)


# ---------------------------------------------------------------------------------------------------------------------
# the layout


@dataclass(frozen=True)
class Layout:
    """Where this process stands in the run (``setup_layout``)."""

    info: DistInfo
    device: torch.device
    dims: ParallelDims
    dp_rank: int  # this rank's data-parallel coordinate: which slice of each global batch it reads
    dp_world: int
    plan: BatchPlan
    model_args: Any  # the family's validated args dataclass
    auto_reason: str | None = None  # parallel.auto: why the cost model chose this layout (a line at start)
    affinity_per_rank: list | None = None  # parallel.cpu_affinity cores: every rank's CPUs (summary.json)


def setup_layout(cfg: RunConfig) -> Layout:
    """Processes and devices, the parallel layout (``parallel.auto`` applied to ``cfg``), the batch plan, the model
    args; refuses a layout the model cannot take and a model that cannot fit one device."""
    comm_env = hardware.communication_env(cfg.parallel)
    info, device = init_distributed(cfg.device, cpu_affinity=cfg.parallel.cpu_affinity, comm_env=comm_env)
    affinity = gather_affinity() if cfg.parallel.cpu_affinity == "cores" else None
    auto_reason = apply_auto_layout(cfg, info.world_size, device) if cfg.parallel.auto else None
    dims = ParallelDims.from_config(cfg.parallel, info.world_size)
    plan = plan_batches(cfg.train, dims.dp)
    model_args = resolve_args(cfg.model)
    tp_check = get_spec(cfg.model.arch).parallelize_plan.check_tensor_parallel
    validate_for_model(
        dims,
        model_args.n_layers,
        getattr(model_args, "n_heads", None),
        getattr(model_args, "n_kv_heads", None),
        cfg.parallel,
        plan.grad_accum,
        getattr(model_args, "tie_embeddings", False),
        None if tp_check is None else functools.partial(tp_check, model_args),
    )
    check_model_fits(cfg, dims, plan.micro_batch, device)
    return Layout(info, device, dims, dims.dp_rank(info.rank), dims.dp, plan, model_args, auto_reason, affinity)


# ---------------------------------------------------------------------------------------------------------------------
# the model, its pipeline stages, optimizer and schedule


@dataclass(frozen=True)
class PipelineStages:
    """This rank's share of a pipeline-parallel model: its stage modules (parallelized one by one), their global
    indices, the schedule that runs a step's micro-batches through them, and the pipeline's process group."""

    parts: list[nn.Module]
    stages: list[int]
    n_stages: int
    rank: int  # this rank's pipeline coordinate
    degree: int  # parallel.pp
    group: Any
    schedule: Any
    step_kwargs: dict  # extra arguments of ``schedule.step`` (``return_outputs=False`` where it takes one)
    first: bool  # holds the first stage (feeds the token ids)
    last: bool  # holds the last stage (computes the loss)

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, autocast: Callable[[], contextlib.AbstractContextManager]
    ) -> torch.Tensor:
        """One step's forward and backward: the schedule runs every micro-batch of this rank's batch through the
        stages. The first stage's rank passes the token ids, the last stage's rank the targets (to the schedule, and
        to the last stage's forward, which returns the micro-batch's mean loss); the schedule averages gradients over
        micro-batches. Returns the mean loss on the last stage's ranks, 0 elsewhere (no host sync here)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        kwargs = dict(target=targets, losses=losses, targets=targets) if self.last else {}
        with autocast():
            self.schedule.step(*args, **kwargs, **self.step_kwargs)
        if self.last:
            return torch.stack([x.detach().float() for x in losses]).mean()
        return torch.zeros((), device=inputs.device)

    def forward_only(self, tokens: torch.Tensor, width: int) -> torch.Tensor | None:
        """Forward-only pass of one micro-batch (B, T) through the stages in order (evaluation); logits (B, T, V) on
        the last stage's ranks, None elsewhere."""
        return pipeline_forward(
            self.parts, self.stages, self.n_stages, self.group, self.rank, self.degree, tokens, (*tokens.shape, width)
        )


@dataclass
class BuiltModel:
    """The model as trained and what steps it (``build_model``)."""

    model: nn.Module
    """What is called and optimized: the parallelized model, or (pipeline) one module naming this rank's stage
    parameters by their full-model names (for the optimizer, clipping and checkpoints; never called)."""
    raw_model: nn.Module  # the single-device module before wrapping (pipeline: the whole model on the meta device)
    accounting_model: nn.Module  # the whole model on the meta device: parameter and FLOP counts
    strategy: str  # 'single' | 'ddp' | 'zero1' | 'fsdp' | 'none' (data_parallel.resolve_strategy)
    dtype: torch.dtype  # the compute dtype
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    grad_comm: GradCommMeter  # grad_comm_bytes of the log records
    loss_ranks: int  # ranks holding a copy of the loss: all but the non-final pipeline stages
    autocast: Callable[[], contextlib.AbstractContextManager]  # mixed precision of forward passes (or a no-op)
    pipeline: PipelineStages | None = None
    family_step_context: StepContext | None = None  # ParallelizePlan.step_context of the model's family

    @property
    def parts(self) -> list[nn.Module]:
        """The modules this rank runs: its pipeline stages, or the model."""
        return self.pipeline.parts if self.pipeline is not None else [self.model]

    def release_ddp_wrapper(self) -> nn.Module | None:
        """Drop the DDP wrapper (DDP, ZeRO-1) while the process group is still registered: its C++ Reducer holds a
        reference to the group. ``destroy_process_group`` then drops the group's last reference from Python, whose
        binding releases the GIL while gloo joins its worker threads. Left to the unwinding of an error's traceback
        (a NaN stop raises with the trainer in its frames), the Reducer dropped the last reference after the shutdown,
        with the GIL held, while a gloo worker waited for the GIL to free a finished collective's tensors: the rank
        never exited (``tests/distributed/test_shutdown.py``). ``model`` becomes the unwrapped module (same parameters),
        which does not train any more (``Trainer.close``). Returns the dropped wrapper (None without one)."""
        if self.strategy not in ("ddp", "zero1"):
            return None
        wrapper, self.model = self.model, unwrap(self.model)
        return wrapper

    def step_context(self, graphed: bool) -> contextlib.AbstractContextManager:
        """The family's context for one optimizer step's micro-batches (``ParallelizePlan.step_context``); ``graphed``:
        the micro-steps replay a captured CUDA graph."""
        if self.family_step_context is None:
            return contextlib.nullcontext()
        return self.family_step_context(self.model, self.strategy, graphed)


def build_model(
    cfg: RunConfig, layout: Layout, log: Log, pipeline_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> BuiltModel:
    """Build the model on the meta device, materialise and initialise it (or this rank's pipeline stages; ``model.
    init_from``'s weights), parallelize it, then its optimizer and LR schedule. ``pipeline_loss``: the schedule's loss
    function (the last stage's forward already returns the micro-batch's mean loss)."""
    # train.attention_backend: the SDPA kernel order, set before any block is compiled (a compiled graph keeps the
    # kernel chosen while it was traced); nothing to set for auto and on CPU
    hardware.set_attention_backend(cfg.train.attention_backend)
    configure_kernels(cfg.kernels)  # the kernels' process-wide options (RunConfig.kernels)
    spec = get_spec(cfg.model.arch)
    with torch.device("meta"):
        full = spec.build(layout.model_args)
    dims, device = layout.dims, layout.device
    dtype = compute_dtype(cfg, device)
    pipeline = None
    if dims.pp > 1:
        pipeline, strategy = build_pipeline(cfg, layout, spec, dtype, log, pipeline_loss)
        model, raw_model = merge_parts(pipeline.parts), full
    else:
        init_weights(full, device, cfg.train.seed, cfg.model.init_device)
        init_from_hf(full, cfg.model, log)  # model.init_from: HF weights (checkpoint/hf_import.py)
        model, strategy = parallelize(full, cfg, dims, device, dtype)
        raw_model = full
    if strategy == "zero1":
        optimizer = Zero1AdamW(unwrap(model), cfg.train, device, dp_mesh_1d(dims, device))
    else:
        optimizer = build_optimizer(model, cfg.train, device, by_mesh=dims.tp > 1)
    scheduler = build_scheduler(optimizer, cfg.train)
    # grad_comm_bytes of the log records (parallel.grad_compression's hook counts them where there is one)
    grad_comm = GradCommMeter(model, strategy, cfg.parallel, dims.dp_replicate, dims.dp_shard)
    # FSDP casts parameters itself (bf16 params, fp32 reduce); otherwise autocast does mixed precision.
    use_autocast = dtype != torch.float32 and strategy != "fsdp"
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if use_autocast else contextlib.nullcontext
    attach_fp8(optimizer, model, log)  # train.fp8: its log line; FSDP's FP8 weight scales
    return BuiltModel(
        model=model,
        raw_model=raw_model,
        accounting_model=full,
        strategy=strategy,
        dtype=dtype,
        optimizer=optimizer,
        scheduler=scheduler,
        grad_comm=grad_comm,
        loss_ranks=layout.info.world_size // dims.pp,
        autocast=autocast,
        pipeline=pipeline,
        family_step_context=spec.parallelize_plan.step_context,
    )


def build_pipeline(
    cfg: RunConfig,
    layout: Layout,
    spec: ModelSpec,
    dtype: torch.dtype,
    log: Log,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[PipelineStages, str]:
    """This rank's stage parts (initialised, parallelized one by one) and their schedule; and the strategy."""
    pcfg, dims, device = cfg.parallel, layout.dims, layout.device
    pp_rank = dims.coordinates(layout.info.rank)["pp"]
    n_stages = dims.pp * pcfg.pp_virtual_stages
    stages = rank_stages(pp_rank, dims.pp, pcfg.pp_virtual_stages)
    initialised = build_stage_parts(
        lambda: spec.build(layout.model_args), stages, n_stages, device, cfg.train.seed, cfg.model.init_device
    )
    parts = []
    for part in initialised:  # at least one stage per rank
        init_from_hf(part, cfg.model, log)  # model.init_from: only this stage's tensors are read
        if not cfg.train.compile:  # one autocast region runs all micro-batches: keep autocast's shared casts
            for module in part.modules():
                if hasattr(module, "wide_grads"):
                    module.wide_grads = False
        part, strategy = parallelize(part, cfg, dims, device, dtype)
        parts.append(part)
    group = dims.build_mesh(device.type)["pp"].get_group()
    schedule = build_schedule(
        parts, stages, n_stages, device, group, pcfg.pp_schedule, layout.plan.grad_accum, loss_fn=loss_fn
    )
    step_kwargs = {"return_outputs": False} if step_accepts_return_outputs(schedule) else {}
    pipeline = PipelineStages(
        parts,
        stages,
        n_stages,
        pp_rank,
        dims.pp,
        group,
        schedule,
        step_kwargs,
        first=0 in stages,
        last=n_stages - 1 in stages,
    )
    return pipeline, strategy


def log_model_size(cfg: RunConfig, layout: Layout, built: BuiltModel, flops_per_token: float, log: Log) -> None:
    """One line at start: parameters, training FLOPs per token and the cost model's peak memory per device."""
    from anytrain.cost.devices import from_spec
    from anytrain.cost.memory import run_memory_estimate

    model = built.accounting_model
    device = from_spec(hardware.device_spec(layout.device))
    est = run_memory_estimate(
        cfg,
        layout.dims,
        built.strategy,
        layout.plan.micro_batch,
        built.dtype == torch.float32,
        device.blas_workspace_mib if device is not None else 0.0,
    )
    size = (f"{est[0]:.2f} GiB" if est[0] >= 0.1 else f"{est[0] * 1024:.1f} MiB") if est else ""
    memory = f"cost model: {size} peak allocated per device ({est[1]})" if est else "cost model: n/a"
    log(
        f"model: {cfg.model.arch}/{cfg.model.flavour}, {model.num_params():,} parameters "
        f"({model.num_params(exclude_embedding=True):,} without input embeddings), "
        f"{flops_per_token:.4g} FLOPs/token at seq {cfg.data.seq_len}; {memory}"
    )


# ---------------------------------------------------------------------------------------------------------------------
# data and CUDA graphs


@dataclass(frozen=True)
class DataSources:
    """The training batches and the validation ones (``open_sources``)."""

    train: BatchProvider
    val: BatchProvider | None = None  # None: no validation (the trainer was given its batches)
    val_by_name: dict[str, BatchProvider] | None = None  # data.sources: each source's validation batches, by name

    def shares(self, step: int) -> dict[str, float]:
        """data.sources: the share of the sequences of steps [0, step) each source gave (``data_share/NAME``)."""
        if self.val_by_name is None:
            return {}
        return {f"data_share/{name}": share for name, share in self.train.shares(step).items()}


def open_sources(cfg: RunConfig, dataset, batches: BatchProvider | None, global_batch: int) -> DataSources:
    """The prepared dataset's splits, a data.sources mixture (data/mixture.py), prepare-sft's loss-masked pairs
    (data/sft.py), or the ``batches`` given to the Trainer."""
    seq_len, seed = cfg.data.seq_len, cfg.train.seed
    if batches is not None:
        return DataSources(batches)
    if cfg.data.sources:
        train, by_name = open_mixture(cfg.data.sources, dataset, seq_len, global_batch, seed)
        return DataSources(train, next(iter(by_name.values())), by_name)
    masked = masked_sources(dataset, seq_len, global_batch, seed)
    if masked is not None:
        return DataSources(*masked)
    train = BatchSource(SampleIndex(dataset.split("train"), seq_len, "train"), global_batch, seed)
    val = BatchSource(SampleIndex(dataset.split("val"), seq_len, "val"), global_batch, seed, shuffle=False)
    return DataSources(train, val)


def setup_cuda_graphs(
    cfg: RunConfig,
    layout: Layout,
    built: BuiltModel,
    fault_hook: bool,
    micro_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    log: Log,
) -> cuda_graph.GraphedMicroStep | None:
    """train.cuda_graphs: ``micro_step`` captured where that is sound (train/cuda_graph.py), else None and a line
    saying why. ``fault_hook``: a loss fault-injection hook is set."""
    if not cfg.train.cuda_graphs:
        return None
    info, dims = layout.info, layout.dims
    reason = cuda_graph.applicability(
        layout.device, info.world_size, built.pipeline is not None, fault_hook, data_parallel=dims.dp > 1
    )
    if not reason and cfg.data.document_mask:
        reason = "data.document_mask builds its block mask per batch, not captured"
    if not reason and cfg.parallel.async_tp and dims.tp > 1:
        reason = "parallel.async_tp's fused collective matmuls (symmetric memory) are not captured"
    if reason:
        if info.is_main:
            log(f"train.cuda_graphs: eager micro-steps ({reason})")
        return None
    return cuda_graph.GraphedMicroStep(micro_step, list(built.model.parameters()), distributed=info.world_size > 1)
