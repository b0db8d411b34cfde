"""The public Mamba kernel ops and the process-wide kernel options; re-exported by ``anytrain.kernels``.

Backend ("auto" by default): Triton for GPU tensors (CUDA and ROCm), the PyTorch reference for CPU tensors; "triton"
or "reference" force one. Triton on CPU tensors only runs under ``TRITON_INTERPRET=1`` (tests). If Triton is not
importable, "auto" uses the reference (with one warning on GPU tensors); an explicit "triton" raises. Deterministic
mode makes the Triton scan backward reduce dB/dC through per-program partials instead of atomics (bitwise
reproducible gradients); the SSD backward (``kernels.ssd``, which follows the same backend rule) has no atomics
and is reproducible in either mode. Set them with ``anytrain.kernels.configure`` (from ``RunConfig.kernels``) or the
setters.

The Triton modules are imported lazily, at the first Triton call: tests set ``TRITON_INTERPRET=1`` before Triton is
imported, which decides whether ``@triton.jit`` compiles or interprets.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import torch
from torch import Tensor

from anytrain import hardware
from anytrain.kernels.reference import causal_conv1d_ref, selective_scan_ref

BACKENDS = ("auto", "triton", "reference")

_backend: str = "auto"
_deterministic: bool = False
_warned_gpu_fallback = False


def set_backend(name: str) -> None:
    """'auto' (Triton on GPU tensors, reference on CPU), 'triton' or 'reference'."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def set_deterministic(flag: bool = True) -> None:
    """Deterministic Triton backward: dB/dC reduced via per-program partials (no atomics)."""
    global _deterministic
    _deterministic = bool(flag)


def is_deterministic() -> bool:
    return _deterministic


_modules: tuple[ModuleType, ModuleType, ModuleType] | None | bool = False  # False: not tried yet


def _triton_modules() -> tuple[ModuleType, ModuleType, ModuleType] | None:
    """(selective_scan_triton, causal_conv1d_triton, ssd_triton) modules, imported on first use (``_use_triton``
    asks first, through ``triton_available``, which compiled code calls eagerly); None without Triton."""
    global _modules
    if _modules is False:
        try:
            _modules = (
                importlib.import_module("anytrain.kernels.selective_scan_triton"),
                importlib.import_module("anytrain.kernels.causal_conv1d_triton"),
                importlib.import_module("anytrain.kernels.ssd_triton"),
            )
        except ImportError:
            _modules = None
    return _modules  # type: ignore[return-value]


def define_op_pair(name: str, forward, forward_schema: str, backward, backward_schema: str):
    """(``anytrain::<name>_fwd``, ``anytrain::<name>_bwd``): ``forward`` and ``backward`` as torch.library custom ops,
    opaque to torch.compile (the caller registers their fake kernels and the forward's autograd), or None where this
    torch lacks the custom-op API (before 2.4, or a variant of it)."""
    library = torch.library
    if not all(hasattr(library, n) for n in ("custom_op", "register_fake", "register_autograd")):
        return None
    try:
        fwd = library.custom_op(f"anytrain::{name}_fwd", mutates_args=(), schema=forward_schema)(forward)
        bwd = library.custom_op(f"anytrain::{name}_bwd", mutates_args=(), schema=backward_schema)(backward)
    except (TypeError, RuntimeError, ValueError):  # API variants of older torch
        return None
    return fwd, bwd


def _constant_under_compile(fn):
    """``fn``'s result taken as a constant by torch.compile: dynamo calls it once while tracing instead of tracing
    into it (an import inside a traced frame is a graph break). This is what
    ``torch.compiler.assume_constant_result`` does, without importing dynamo (and with it triton) here: tests set
    TRITON_INTERPRET after importing this package."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def triton_available() -> bool:
    return _triton_modules() is not None


def _use_triton(x: Tensor) -> bool:
    global _warned_gpu_fallback
    if _backend == "reference" or (_backend == "auto" and not x.is_cuda):
        return False  # CPU tensors under "auto" never import triton
    if not triton_available():
        if _backend == "triton":
            raise RuntimeError("kernel backend 'triton' was requested but triton is not importable")
        if not _warned_gpu_fallback:
            warnings.warn(
                "triton is not importable: Mamba kernels fall back to the slow PyTorch reference", stacklevel=3
            )
            _warned_gpu_fallback = True
        return False
    if not x.is_cuda and not hardware.triton_interpreted():
        raise RuntimeError("kernel backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 (slow; for tests)")
    return True


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-1 selective scan (mamba-ssm ``selective_scan_fn`` semantics).

    u, delta, z: (batch, dim, L); A: (dim, dstate); B, C: (batch, dstate, L) or (batch, ngroups, dstate, L);
    D, delta_bias: (dim,). Returns out (batch, dim, L) in u's dtype [, last_state (batch, dim, dstate) fp32].
    """
    if _use_triton(u):
        scan_mod = _triton_modules()[0]  # type: ignore[index]
        return scan_mod.selective_scan_triton(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, deterministic=_deterministic
        )
    return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """Causal depthwise conv1d (causal_conv1d_fn semantics). x: (batch, dim, L); weight: (dim, width), width 2..4."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    if _use_triton(x):
        conv_mod = _triton_modules()[1]  # type: ignore[index]
        return conv_mod.causal_conv1d_triton(x, weight, bias, activation)
    return causal_conv1d_ref(x, weight, bias, activation)
