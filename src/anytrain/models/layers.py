"""Building blocks shared by the model families."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def residual_stream(h: torch.Tensor, keep_fp32: bool) -> torch.Tensor:
    """Hidden states entering the blocks in the residual stream's dtype: the autocast dtype unless ``keep_fp32`` (the
    models' ``residual_in_fp32``) or autocast is off."""
    device_type = h.device.type
    if keep_fp32 or not torch.is_autocast_enabled(device_type):
        return h
    return h.to(torch.get_autocast_dtype(device_type))
