"""Relaunching a compiled Triton kernel without Triton's per-call argument binding.

``kernel[grid](*args, **meta)`` binds and specializes every argument on each call (divisibility of each int by 16,
alignment of each pointer, a cache-key lookup): host time comparable to the GPU time of a small op, which makes a
public op called through ``torch.autograd`` host-bound (measured: docs/kernels.md, "Launching").
``Launcher`` does that work once per *specialization* and then calls the compiled kernel's launcher directly.

The specialization of a call is what Triton would key on: the int arguments (their values, which covers the
``== 1`` and ``% 16`` properties), the 16-byte alignment of each tensor's data pointer, the tensors' dtypes and
the constexpr/launch options (fixed per ``Launcher``). A call whose specialization was seen before relaunches that
binary; any other call goes through ``kernel[grid]`` (which compiles or finds the binary) and records it. Launch
hooks (profilers such as Proton set them), the interpreter and a Triton without the compiled-kernel attributes used
here all take the ordinary ``kernel[grid]`` path; the results are the same on both paths, only host time differs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from anytrain import hardware

try:  # the runtime knobs that hold launch hooks (Triton >= 3.3)
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: hooks unknown, so never take the direct path
    _knobs = None

_DIRECT_ATTRS = ("run", "function", "packed_metadata", "launch_metadata")


def _hook_set(hook: Any) -> bool:
    # a plain callable, or a HookChain (Triton >= 3.5; never None there) holding at least one call
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    if _knobs is None:
        return True
    return _hook_set(_knobs.runtime.launch_enter_hook) or _hook_set(_knobs.runtime.launch_exit_hook)


def _constexpr_tail(kernel: Any, meta: dict[str, Any]) -> tuple | None:
    """The constexpr values that follow the positional arguments, in signature order (Triton's launcher takes every
    bound argument, constexprs included; a parameter ``meta`` does not give takes its default), or None where the
    direct launch does not apply (an interpreted kernel, a runtime parameter after a constexpr)."""
    params = getattr(kernel, "params", None)
    if params is None:
        return None
    n_pos = sum(1 for p in params if not p.is_constexpr)
    tail = []
    for param in params[n_pos:]:
        if not param.is_constexpr:
            return None
        tail.append(meta[param.name] if param.name in meta else param.default)
    return tuple(tail)


class Launcher:
    """One Triton kernel with fixed constexprs/launch options (``meta``) and grid, relaunched directly.

    ``launcher(*args)`` is ``kernel[grid](*args, **meta)``; ``args`` are the kernel's non-constexpr arguments in
    signature order (tensors and ints)."""

    __slots__ = ("kernel", "grid", "meta", "tail", "binaries", "direct")

    def __init__(self, kernel: triton.runtime.JITFunction, grid: tuple[int, ...], meta: dict[str, Any]):
        self.kernel, self.meta = kernel, meta
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.binaries: dict[tuple, Any] = {}
        self.tail = None if hardware.triton_interpreted() else _constexpr_tail(kernel, meta)
        self.direct = self.tail is not None

    def __call__(self, *args: Any) -> None:
        if self.direct and not _hooks_set():
            driver = triton.runtime.driver.active
            device = driver.get_current_device()  # a binary is loaded per device
            key = (device, *((a.data_ptr() & 15 == 0, a.dtype) if isinstance(a, torch.Tensor) else a for a in args))
            binary = self.binaries.get(key)
            if binary is not None:
                stream = driver.get_current_stream(device)
                binary.run(
                    *self.grid, stream, binary.function, binary.packed_metadata, None, None, None, *args, *self.tail
                )
                return
            binary = self.kernel[self.grid](*args, **self.meta)
            if all(hasattr(binary, name) for name in _DIRECT_ATTRS):
                self.binaries[key] = binary
            else:
                self.direct = False
            return
        self.kernel[self.grid](*args, **self.meta)


_LAUNCHERS: dict[tuple, Launcher] = {}


def launch(kernel: triton.runtime.JITFunction, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)`` through a ``Launcher`` kept per (kernel, grid, meta): for call sites without a
    plan object of their own. ``meta``'s values must be hashable (constexprs and launch options are)."""
    key = (kernel, tuple(grid), *meta.items())
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        if len(_LAUNCHERS) >= 4096:  # many distinct shapes (e.g. variable-length evaluation): start over
            _LAUNCHERS.clear()
        launcher = _LAUNCHERS[key] = Launcher(kernel, grid, meta)
    launcher(*args)
