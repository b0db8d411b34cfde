"""The run configuration's checks at load: every numeric field's domain and the cross-field rules that need neither the
world size nor the model registry nor the disk (``anytrain.config.load_config`` runs :func:`validate`;
``parallelize`` repeats the strategy checks with the resolved strategy; the model's args and the prepared dataset are
checked by ``anytrain.data.resolve.resolve_run_config``)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from anytrain.errors import ConfigError

if TYPE_CHECKING:
    from anytrain.config.schema import ParallelConfig, RunConfig, TrainConfig

MAX_SEQ_LEN = 2**20  # tokens; larger sequences (and RoPE tables) do not fit any accelerator's memory


def _positive(value: float, where: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def in_range(value: float, where: str, low: float, high: float, closed: str = "[]") -> None:
    """``low <= value <= high`` with the ends open or closed as in ``closed`` ('[)', '(]', '()' or '[]')."""
    above = value >= low if closed[0] == "[" else value > low
    below = value <= high if closed[1] == "]" else value < high
    if not (above and below):
        raise ConfigError(f"{where}: must be in {closed[0]}{low}, {high}{closed[1]}, got {value}")


def check_finite(obj: Any, prefix: str = "") -> None:
    """Every float field of every section (and of model.args) must be a finite number: YAML reads .nan / .inf."""
    values = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
    for key, value in values.items():
        if isinstance(value, dict):
            check_finite(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{key}: must be a finite number, got {value}")


def _validate_train(t: TrainConfig) -> None:
    _positive(t.steps, "train.steps")
    _positive(t.global_batch, "train.global_batch")
    _positive(t.stop_at_step, "train.stop_at_step", allow_zero=True)
    _positive(t.micro_batch, "train.micro_batch", allow_zero=True)
    _positive(t.lr, "train.lr")
    _positive(t.warmup_steps, "train.warmup_steps", allow_zero=True)
    _positive(t.log_interval, "train.log_interval")
    _positive(t.eval_interval, "train.eval_interval", allow_zero=True)
    _positive(t.eval_batches, "train.eval_batches", allow_zero=True)
    _positive(t.grad_clip, "train.grad_clip", allow_zero=True)
    _positive(t.spike_factor, "train.spike_factor", allow_zero=True)
    _positive(t.gc_interval, "train.gc_interval", allow_zero=True)
    _positive(t.peak_tflops, "train.peak_tflops", allow_zero=True)
    _positive(t.weight_decay, "train.weight_decay", allow_zero=True)
    _positive(t.eps, "train.eps")
    in_range(t.beta1, "train.beta1", 0.0, 1.0, "[)")
    in_range(t.beta2, "train.beta2", 0.0, 1.0, "[)")
    in_range(t.min_lr_ratio, "train.min_lr_ratio", 0.0, 1.0)
    in_range(t.decay_fraction, "train.decay_fraction", 0.0, 1.0, "(]")
    in_range(t.seed, "train.seed", 0, 2**63 - 1)
    if t.micro_batch > t.global_batch:
        raise ConfigError(f"train.micro_batch: {t.micro_batch} is larger than train.global_batch {t.global_batch}")
    if 0 < t.spike_factor <= 1:
        raise ConfigError(
            f"train.spike_factor: must be 0 (off) or > 1 (a multiple of the mean loss), got {t.spike_factor}"
        )


def _validate_others(cfg: RunConfig) -> None:
    _positive(cfg.checkpoint.interval, "checkpoint.interval", allow_zero=True)
    _positive(cfg.checkpoint.interval_minutes, "checkpoint.interval_minutes", allow_zero=True)
    _positive(cfg.checkpoint.keep_last, "checkpoint.keep_last")
    _positive(cfg.profile.steps, "profile.steps", allow_zero=True)
    _positive(cfg.profile.start_step, "profile.start_step", allow_zero=True)
    if cfg.profile.memory_snapshot and cfg.profile.steps == 0:
        raise ConfigError(
            "profile.memory_snapshot: records the profiled steps, and profile.steps is 0; set --profile.steps 1"
        )
    p = cfg.parallel
    for name in ("dp_replicate", "tp", "pp", "pp_virtual_stages"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}: must be >= 1, got {getattr(p, name)}")
    if p.async_tp and (p.tp < 2 or not cfg.train.compile):
        raise ConfigError(
            f"parallel.async_tp: overlaps tensor-parallel collectives inside compiled blocks, so it "
            f"needs --parallel.tp >= 2 and --train.compile true (got tp {p.tp}, compile "
            f"{str(cfg.train.compile).lower()}); set --parallel.async_tp false"
        )
    if p.tp_sequence_loss and (p.tp < 2 or p.pp > 1 or cfg.data.seq_len % p.tp):
        raise ConfigError(
            f"parallel.tp_sequence_loss: scores each tensor-parallel rank's sequence shard, so it needs "
            f"--parallel.tp >= 2, --parallel.pp 1 and data.seq_len divisible by tp (got tp {p.tp}, pp {p.pp}, "
            f"seq_len {cfg.data.seq_len}); set --parallel.tp_sequence_loss false"
        )
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallel.dp_shard: must be >= 1 or -1 (infer), got {p.dp_shard}")
    if cfg.device not in ("auto", "cpu", "gpu", "cuda"):
        raise ConfigError(f"device: expected auto, cpu or gpu, got {cfg.device!r}")
    wandb = cfg.metrics.wandb
    if not wandb.project.strip():
        raise ConfigError("metrics.wandb.project: must name a W&B project, got an empty string")
    if not all(isinstance(tag, str) and 0 < len(tag) <= 64 for tag in wandb.tags):
        raise ConfigError(f"metrics.wandb.tags: expected a list of 1 to 64-character strings, got {wandb.tags!r}")


def validate(cfg: RunConfig) -> None:
    """Every numeric field's domain and the cross-field checks that do not need the world size (those live in
    ``batching``), the model registry or the disk; runs at load, before anything is written."""
    check_finite(cfg)
    _validate_train(cfg.train)
    _validate_others(cfg)
    if not cfg.data.path:
        raise ConfigError("data.path: must name the folder written by `anytrain prepare`")
    _positive(cfg.data.seq_len, "data.seq_len")
    check_document_mask(cfg)
    check_fsdp_only_options(cfg.parallel, cfg.parallel.strategy)
    check_fp8(cfg)


def check_fp8(cfg: RunConfig) -> None:
    """train.fp8 at load: not with the two combinations no test has run (they need several GPUs): CUDA graphs under
    tensor parallelism, and async TP. torchao and the device are checked when the model is converted
    (``anytrain.parallel.fp8``), so that evaluating or exporting an FP8 run needs neither."""
    if cfg.train.fp8 == "none":
        return
    if cfg.train.cuda_graphs and cfg.parallel.tp > 1:
        raise ConfigError(
            "train.cuda_graphs: not run with train.fp8 under tensor parallelism yet (one GPU is); set "
            "--train.cuda_graphs false, --parallel.tp 1 or --train.fp8 none"
        )
    if cfg.parallel.async_tp:
        raise ConfigError(
            "parallel.async_tp: not run with train.fp8 yet (inductor's fused collective matmuls around FP8 GEMMs); "
            "set --parallel.async_tp false or --train.fp8 none"
        )


def check_document_mask(cfg: RunConfig) -> None:
    """data.document_mask: the Transformer, Mamba-2 and hybrid families only, and no pipeline stages (they receive
    hidden states, not the token ids the document boundaries are read from)."""
    if not cfg.data.document_mask:
        return
    if cfg.model.arch == "mamba":
        raise ConfigError(
            "data.document_mask: Mamba carries its scan state across documents (a per-document state "
            "reset is not implemented); set --data.document_mask false"
        )
    if cfg.model.arch not in ("transformer", "mamba2", "hybrid"):
        raise ConfigError(
            f"data.document_mask: applies to model.arch transformer, mamba2 and hybrid only, not "
            f"{cfg.model.arch}; set --data.document_mask false"
        )
    if cfg.parallel.pp > 1:
        raise ConfigError(
            f"data.document_mask: not available with pipeline parallelism (parallel.pp "
            f"{cfg.parallel.pp}: later stages see hidden states, not the token ids that mark documents); "
            "set --parallel.pp 1 or --data.document_mask false"
        )


def check_fsdp_only_options(parallel: ParallelConfig, strategy: str) -> None:
    """Refuse FSDP-only settings with a DDP-family strategy, and PowerSGD with FSDP (called at load with the
    configured strategy and again by ``parallelize`` with the resolved one, which catches ``auto``'s choice)."""
    if parallel.fsdp_group_blocks < 1:
        raise ConfigError(f"parallel.fsdp_group_blocks: expected >= 1, got {parallel.fsdp_group_blocks}")
    if parallel.fsdp_group_blocks > 1 and strategy in ("ddp", "zero1"):
        raise ConfigError(
            f"parallel.fsdp_group_blocks applies to FSDP only, but the strategy is {strategy}; set "
            "--parallel.strategy fsdp or --parallel.fsdp_group_blocks 1"
        )
    if not parallel.ddp_bucket_mb > 0:
        raise ConfigError(f"parallel.ddp_bucket_mb: expected a size in MB > 0, got {parallel.ddp_bucket_mb}")
    for name in ("nccl_min_ctas", "nccl_max_ctas"):
        if getattr(parallel, name) < 0:
            raise ConfigError(f"parallel.{name}: expected a thread-block count >= 0 (0: NCCL's default)")
    if 0 < parallel.nccl_max_ctas < parallel.nccl_min_ctas:
        raise ConfigError(
            f"parallel.nccl_min_ctas: {parallel.nccl_min_ctas} is above parallel.nccl_max_ctas "
            f"{parallel.nccl_max_ctas}; lower it"
        )
    check_grad_compression(parallel, strategy)
    if not parallel.reshard_during_accumulation and strategy in ("ddp", "zero1"):
        raise ConfigError(
            f"parallel.reshard_during_accumulation: false applies to FSDP only, but the strategy is "
            f"{strategy}; set --parallel.strategy fsdp or --parallel.reshard_during_accumulation "
            "true"
        )


GRAD_COMPRESSION_SYNTAX = "none, bf16, fp16 or powersgd:rank=R (R an integer >= 1, e.g. powersgd:rank=4)"


def parse_grad_compression(text: str) -> tuple[str, int]:
    """``parallel.grad_compression`` as (kind, PowerSGD rank): 'none' | 'bf16' | 'fp16' -> (kind, 0);
    'powersgd:rank=R' -> ('powersgd', R). Anything else is a ConfigError naming the field and the syntax."""
    if text in ("none", "bf16", "fp16"):
        return text, 0
    kind, _, option = str(text).partition(":")
    key, _, value = option.partition("=")
    if kind == "powersgd" and key.strip() == "rank" and value.strip().isdigit() and int(value) >= 1:
        return "powersgd", int(value)
    hint = "; PowerSGD needs its rank, e.g. powersgd:rank=4" if kind == "powersgd" and not option else ""
    raise ConfigError(f"parallel.grad_compression: expected {GRAD_COMPRESSION_SYNTAX}, got {text!r}{hint}")


def check_grad_compression(parallel: ParallelConfig, strategy: str) -> None:
    """The compression's syntax, PowerSGD's start step, and PowerSGD only where DDP's communication hooks run."""
    kind, _ = parse_grad_compression(parallel.grad_compression)
    if parallel.powersgd_start_step < 0 or parallel.powersgd_start_step == 1:
        raise ConfigError(
            f"parallel.powersgd_start_step: must be 0 (= train.warmup_steps) or >= 2, got "
            f"{parallel.powersgd_start_step}"
        )
    if kind == "powersgd" and strategy == "fsdp":
        raise ConfigError(
            "parallel.grad_compression: powersgd runs with ddp or zero1 only (PyTorch has no PowerSGD "
            "for FSDP); set --parallel.strategy ddp, or use bf16 (FSDP's reduce dtype)"
        )
