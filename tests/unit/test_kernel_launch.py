"""kernels/launch.py: which constexpr values the direct relaunch appends, and when it stays on the ordinary path.

The relaunch itself needs a GPU (tests/gpu/test_causal_conv_gpu.py checks it bitwise against the first launch)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from anytrain.kernels.launch import _constexpr_tail, _hook_set, _hooks_set  # noqa: E402


def _kernel(x_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr = None):
    pass


def _mixed(x_ptr, BLOCK: tl.constexpr, n):
    pass


def test_tail_is_the_constexprs_in_signature_order_with_defaults():
    kernel = JITFunction(_kernel)  # compiled-path object whatever TRITON_INTERPRET says (never launched here)
    assert _constexpr_tail(kernel, {"EVEN": True, "BLOCK": 64, "num_warps": 4}) == (64, True, None)
    assert _constexpr_tail(kernel, {"EVEN": False, "BLOCK": 8, "STAGES": 3}) == (8, False, 3)


def test_a_runtime_parameter_after_a_constexpr_keeps_the_ordinary_path():
    assert _constexpr_tail(JITFunction(_mixed), {"BLOCK": 64}) is None


def test_an_interpreted_kernel_keeps_the_ordinary_path():
    assert _constexpr_tail(object(), {}) is None


def test_no_launch_hook_is_set_by_default_and_a_hook_is_seen():
    assert not _hooks_set()  # else the direct relaunch would never run
    knobs = pytest.importorskip("triton.knobs")
    chain = type(knobs.runtime.launch_enter_hook)
    assert not _hook_set(None)
    assert _hook_set(print)
    if hasattr(chain, "add"):  # Triton's HookChain: empty is unset, one call is set
        hooks = chain()
        assert not _hook_set(hooks)
        hooks.add(print)
        assert _hook_set(hooks)
