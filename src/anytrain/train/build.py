"""The Trainer's construction: compute dtype, parallel layout, pipeline stages, model checks, size line, CUDA graphs."""

from __future__ import annotations

import contextlib
import inspect
import os

import torch

from anytrain import hardware
from anytrain.config import RunConfig, check_document_mask, plan_batches
from anytrain.data.loader import BatchProvider
from anytrain.errors import ConfigError
from anytrain.evals.hf import init_from_hf
from anytrain.models import resolve_args
from anytrain.parallel import parallelize
from anytrain.parallel.collectives import gather_object
from anytrain.parallel.compression import GradCommMeter
from anytrain.parallel.data_parallel import dp_mesh_1d, resolve_strategy, unwrap
from anytrain.parallel.mesh import ParallelDims, init_distributed, validate_for_model
from anytrain.parallel.pipeline import (
    build_schedule,
    build_stage_parts,
    merge_parts,
    rank_stages,
    step_accepts_return_outputs,
)
from anytrain.train import cuda_graph
from anytrain.train.optim import Zero1AdamW, build_optimizer, build_scheduler


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
    for key in ("parallel.strategy", "parallel.reshard_after_forward", "train.micro_batch",
                "train.activation_checkpointing"):  # fmt: skip
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
        raise ConfigError(f"data.seq_len: {seq_len} exceeds model.args.max_seq_len "
                          f"{model_args.max_seq_len}")  # fmt: skip


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
        est = run_memory_estimate(cfg, dims, resolve_strategy(cfg, dims), micro_batch, fp32,
                                  spec.blas_workspace_mib if spec is not None else 0.0)  # fmt: skip
        if est is None or est[0] * GIB <= FIT_MARGIN * capacity:
            return
        need = f"the cost model puts a training step's peak at {est[0]:,.1f} GiB per device ({est[1]})"
    where = f"the {hardware.device_name(device)}'s" if hardware.is_gpu(device) else "the host's RAM of"
    raise ConfigError(f"model.args: {cfg.model.arch}/{cfg.model.flavour} has {shape.num_params:,} parameters and "
                      f"{need}, more than {where} {capacity / GIB:,.1f} GiB; make it smaller (model.args dim / "
                      "n_layers / vocab_size) or spread it (parallel.strategy fsdp, parallel.tp / pp, "
                      "train.micro_batch, train.activation_checkpointing)")  # fmt: skip


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
        raise ConfigError("data.document_mask: the batches given to Trainer have no eos_id attribute (the token "
                          "that ends each document); set one or turn data.document_mask off")  # fmt: skip
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


class ModelSetup:
    """The Trainer's set-up steps that fill in its layout, pipeline, optimizer and CUDA-graph attributes (a mixin)."""

    def _setup_layout(self) -> None:
        """Processes and devices, the parallel layout (``parallel.auto`` applied), the batch plan, the model args."""
        cfg = self.cfg
        self.info, self.device = init_distributed(cfg.device, cpu_affinity=cfg.parallel.cpu_affinity)
        self._affinity_per_rank = gather_affinity() if cfg.parallel.cpu_affinity == "cores" else None
        self._auto_reason = apply_auto_layout(cfg, self.info.world_size, self.device) if cfg.parallel.auto else None
        self.dims = ParallelDims.from_config(cfg.parallel, self.info.world_size)
        self.dp_rank, self.dp_world = self.dims.dp_rank(self.info.rank), self.dims.dp
        self.plan = plan_batches(cfg.train, self.dp_world)
        self.model_args = resolve_args(cfg.model)
        validate_for_model(self.dims, self.model_args.n_layers, getattr(self.model_args, "n_heads", None),
                           getattr(self.model_args, "n_kv_heads", None), cfg.parallel, self.plan.grad_accum,
                           getattr(self.model_args, "tie_embeddings", False))  # fmt: skip
        check_model_fits(cfg, self.dims, self.plan.micro_batch, self.device)

    def _build_pipeline(self, spec) -> None:
        """This rank's stage parts (parallelized one by one), their schedule, and ``self.model``: one module naming
        all of this rank's parameters by their full-model names (for the optimizer, clipping and checkpoints)."""
        pcfg = self.cfg.parallel
        self.pp_rank = self.dims.coordinates(self.info.rank)["pp"]
        self.pp_n_stages = self.dims.pp * pcfg.pp_virtual_stages
        self.pp_stages = rank_stages(self.pp_rank, self.dims.pp, pcfg.pp_virtual_stages)
        parts = build_stage_parts(lambda: spec.build(self.model_args), self.pp_stages, self.pp_n_stages, self.device,
                                  self.cfg.train.seed, self.cfg.model.init_device)  # fmt: skip
        self.pp_parts = []
        for part in parts:
            init_from_hf(part, self.cfg.model, self.log.print)  # model.init_from: only this stage's tensors are read
            if not self.cfg.train.compile:  # one autocast region runs all micro-batches: keep autocast's shared casts
                for module in part.modules():
                    if hasattr(module, "wide_grads"):
                        module.wide_grads = False
            part, self.strategy = parallelize(part, self.cfg, self.dims, self.device, self.dtype)
            self.pp_parts.append(part)
        self.pp_group = self.dims.build_mesh(self.device.type)["pp"].get_group()
        self.pp_schedule = build_schedule(self.pp_parts, self.pp_stages, self.pp_n_stages, self.device,
                                          self.pp_group, pcfg.pp_schedule, self.plan.grad_accum,
                                          loss_fn=self._pipeline_loss)  # fmt: skip
        self._pp_step_kwargs = {"return_outputs": False} if step_accepts_return_outputs(self.pp_schedule) else {}
        self.pp_first, self.pp_last = 0 in self.pp_stages, self.pp_n_stages - 1 in self.pp_stages
        self.model = merge_parts(self.pp_parts)
        self.raw_model = self.accounting_model

    def _setup_optimizer(self) -> None:
        """The optimizer and LR schedule for ``self.model``, the gradient-communication meter, the autocast context."""
        if self.strategy == "zero1":
            self.optimizer = Zero1AdamW(
                unwrap(self.model), self.cfg.train, self.device, dp_mesh_1d(self.dims, self.device)
            )
        else:
            self.optimizer = build_optimizer(self.model, self.cfg.train, self.device, by_mesh=self.dims.tp > 1)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.train)
        # grad_comm_bytes of the log records (parallel.grad_compression's hook counts them where there is one)
        self.grad_comm = GradCommMeter(self.model, self.strategy, self.cfg.parallel, self.dims.dp_replicate,
                                       self.dims.dp_shard)  # fmt: skip
        # FSDP casts parameters itself (bf16 params, fp32 reduce); otherwise autocast does mixed precision.
        use_autocast = self.dtype != torch.float32 and self.strategy != "fsdp"
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=self.dtype)) if use_autocast else (
            contextlib.nullcontext)  # fmt: skip

    def _log_model_size(self) -> None:
        """One line at start: parameters, training FLOPs per token and the cost model's peak memory per device."""
        from anytrain.cost.devices import from_spec
        from anytrain.cost.memory import run_memory_estimate

        model, cfg = self.accounting_model, self.cfg
        device = from_spec(hardware.device_spec(self.device))
        est = run_memory_estimate(cfg, self.dims, self.strategy, self.plan.micro_batch, self.dtype == torch.float32,
                                  device.blas_workspace_mib if device is not None else 0.0)  # fmt: skip
        size = (f"{est[0]:.2f} GiB" if est[0] >= 0.1 else f"{est[0] * 1024:.1f} MiB") if est else ""
        memory = f"cost model: {size} peak allocated per device ({est[1]})" if est else "cost model: n/a"
        self.log.print(f"model: {cfg.model.arch}/{cfg.model.flavour}, {model.num_params():,} parameters "
                       f"({model.num_params(exclude_embedding=True):,} without input embeddings), "
                       f"{self.flops_per_token:.4g} FLOPs/token at seq {cfg.data.seq_len}; {memory}")  # fmt: skip

    def _setup_cuda_graphs(self) -> None:
        """train.cuda_graphs: capture the micro-step where that is sound (train/cuda_graph.py), else say why."""
        self._graphed = None
        if not self.cfg.train.cuda_graphs:
            return
        reason = cuda_graph.applicability(self.device, self.info.world_size, self.pp_schedule is not None,
                                          bool(self.guard.test_nan_step), data_parallel=self.dims.dp > 1)  # fmt: skip
        if not reason and self.cfg.data.document_mask:
            reason = "data.document_mask builds its block mask per batch, not captured"
        if not reason and self.cfg.parallel.async_tp and self.dims.tp > 1:
            reason = "parallel.async_tp's fused collective matmuls (symmetric memory) are not captured"
        if reason:
            if self.info.is_main and hasattr(self, "log"):
                self.log.print(f"train.cuda_graphs: eager micro-steps ({reason})")
            return
        self._graphed = cuda_graph.GraphedMicroStep(lambda x, y: self.forward_backward(x, y, sync=True),
                                                    list(self.model.parameters()),
                                                    distributed=self.info.world_size > 1)  # fmt: skip
