"""Mamba kernels (selective scan, causal depthwise conv1d) with Triton and pure-PyTorch backends, the fused Mamba
mixer, the chunked linear + cross-entropy and the wide weight-gradient GEMMs.

The public ops and options live in ``anytrain.kernels.ops`` (see there for the backend rules). ``configure`` sets
every process-wide kernel option from a ``KernelsConfig`` (the trainer calls it with ``RunConfig.kernels``, so the run
directory's config.yaml records them).

The Triton implementations are the modules ``selective_scan_triton`` and ``causal_conv1d_triton`` (imported lazily
on first use, so tests can set ``TRITON_INTERPRET`` first); their names differ from the public ops', so importing
them never rebinds ``anytrain.kernels.causal_conv1d`` / ``selective_scan``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anytrain.kernels.ops import (
    BACKENDS,
    causal_conv1d,
    get_backend,
    is_deterministic,
    selective_scan,
    set_backend,
    set_deterministic,
    triton_available,
)
from anytrain.kernels.reference import causal_conv1d_ref, selective_scan_ref

if TYPE_CHECKING:
    from anytrain.config import KernelsConfig

__all__ = [
    "BACKENDS",
    "causal_conv1d",
    "causal_conv1d_ref",
    "configure",
    "get_backend",
    "is_deterministic",
    "selective_scan",
    "selective_scan_ref",
    "set_backend",
    "set_deterministic",
    "triton_available",
]


def configure(cfg: KernelsConfig) -> None:
    """Set every process-wide kernel option from ``cfg``: the backend (also of the chunked cross-entropy's row
    kernel), deterministic scan gradients, the fused Mamba mixer, the weight-cast cache and the GEMM accumulation."""
    from anytrain.kernels import mamba_inner, wide_mm

    set_backend(cfg.backend)
    set_deterministic(cfg.deterministic)
    mamba_inner.set_mamba_inner(cfg.fused_mamba_inner)
    mamba_inner.set_cast_cache(cfg.cast_cache)
    wide_mm.set_gemm_accumulate(cfg.gemm_accumulate)
