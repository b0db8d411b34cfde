"""AdamW with weight-decay groups and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from anytrain import hardware
from anytrain.config import TrainConfig

NO_DECAY_NAMES = ("A_log", "D")  # Mamba's state matrix and skip gain (mamba-ssm exempts them too)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); never decay vectors (norm gains, biases) or Mamba's A_log / D.

    Decided by shape and name, because marker attributes on tensors do not survive ``to_empty`` or FSDP.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or name.rsplit(".", 1)[-1] in NO_DECAY_NAMES
        (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device,
                    per_tensor: bool = False) -> torch.optim.Optimizer:  # fmt: skip
    """AdamW; the fused kernel on GPU (CUDA and ROCm), the foreach implementation elsewhere.

    ``per_tensor``: plain per-parameter updates, for models whose parameters mix DTensors of different meshes
    with plain tensors (tensor parallelism here), which the fused/foreach kernels cannot batch together.
    """
    fused = hardware.fused_adamw_available(device) and not per_tensor
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
        foreach=False if per_tensor else (None if fused else True),
    )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for optimizer step ``step`` (0-based): linear warm-up, then the chosen decay.

    cosine: from 1 down to min_lr_ratio over the remaining steps. wsd (warmup-stable-decay): 1 until the last
    ``decay_fraction`` of steps, then linear to min_lr_ratio. constant: 1.
    """
    warmup, total, floor = cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = max(1, round(cfg.decay_fraction * total))
    decay_start = max(warmup, total - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total - decay_start))
    return 1.0 - (1.0 - floor) * progress


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
