"""The pure-PyTorch kernel references: autograd gradcheck, known values, and the backend/deterministic switches."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # if this module is the first to import triton (see test_selective_scan)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import anytrain.kernels as K  # noqa: E402
from anytrain.kernels import ops  # noqa: E402
from anytrain.kernels.reference import causal_conv1d_ref, selective_scan_ref  # noqa: E402

F64 = torch.float64


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_selective_scan_ref_gradcheck():
    batch, dim, seqlen, dstate = 1, 2, 4, 3
    u, delta, z = (
        _rand(batch, dim, seqlen, seed=1),
        _rand(batch, dim, seqlen, seed=2),
        _rand(batch, dim, seqlen, seed=3),
    )
    A = -torch.rand(dim, dstate, dtype=F64) - 0.1
    B, C = _rand(batch, 2, dstate, seqlen, seed=4), _rand(batch, 2, dstate, seqlen, seed=5)
    D, bias = _rand(dim, seed=6), _rand(dim, seed=7)
    inputs = [t.requires_grad_() for t in (u, delta, A, B, C, D, z, bias)]
    assert torch.autograd.gradcheck(lambda *a: selective_scan_ref(*a, delta_softplus=True), inputs)


def test_causal_conv1d_ref_gradcheck():
    x, w, b = _rand(2, 3, 5, seed=1), _rand(3, 4, seed=2), _rand(3, seed=3)
    inputs = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda *a: causal_conv1d_ref(*a, activation="silu"), inputs)


def test_selective_scan_ref_matches_closed_form():
    # dstate 1, constant delta: h_t = sum_{s<=t} exp(dA (t-s)) delta B_s u_s
    seqlen = 6
    u, B, C = _rand(1, 1, seqlen, seed=1), _rand(1, 1, seqlen, seed=2), _rand(1, 1, seqlen, seed=3)
    delta = torch.full((1, 1, seqlen), 0.3, dtype=F64)
    A = torch.tensor([[-0.7]], dtype=F64)
    D = torch.tensor([0.5], dtype=F64)
    out, last = selective_scan_ref(u, delta, A, B, C, D, return_last_state=True)
    t = torch.arange(seqlen, dtype=F64)
    decay = torch.exp(-0.7 * 0.3 * (t[:, None] - t[None, :])).tril()  # (t, s)
    h = decay @ (0.3 * B[0, 0] * u[0, 0])
    torch.testing.assert_close(out[0, 0], h * C[0, 0] + 0.5 * u[0, 0])
    torch.testing.assert_close(last[0, 0, 0], h[-1])


def test_causal_conv1d_ref_is_causal_and_matches_loop():
    x, w, b = _rand(1, 2, 6, seed=1), _rand(2, 3, seed=2), _rand(2, seed=3)
    out = causal_conv1d_ref(x, w, b)
    xp = F.pad(x, (2, 0))
    loop = torch.stack(
        [b[:, None] * 0 + b[:, None] + sum(w[:, k, None] * xp[0, :, t + k, None] for k in range(3)) for t in range(6)],
        dim=-1,
    )[:, 0]
    torch.testing.assert_close(out[0], loop)
    x2 = x.clone()
    x2[..., 4:] += 1.0  # changing the future leaves the past unchanged
    torch.testing.assert_close(causal_conv1d_ref(x2, w, b)[..., :4], out[..., :4])


def test_reference_keeps_input_dtype():
    x = torch.randn(1, 2, 5, dtype=torch.bfloat16)
    assert causal_conv1d_ref(x, torch.randn(2, 4, dtype=torch.bfloat16), activation="silu").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_ref(x, torch.randn(2, 4), activation="gelu")


def test_backend_and_deterministic_switches(monkeypatch):
    # ops.causal_conv1d: the package attribute is the Triton module wherever a test imported that module directly
    old_backend, old_det = K.get_backend(), K.is_deterministic()
    try:
        with pytest.raises(ValueError):
            K.set_backend("cuda")
        K.set_backend("reference")
        assert K.get_backend() == "reference"
        x, w = torch.randn(1, 2, 5), torch.randn(2, 4)
        torch.testing.assert_close(
            ops.causal_conv1d(x, w, activation="silu"), causal_conv1d_ref(x, w, activation="silu")
        )
        K.set_backend("auto")  # CPU tensors: the reference, whether or not triton is installed
        torch.testing.assert_close(ops.causal_conv1d(x, w), causal_conv1d_ref(x, w))
        K.set_deterministic(True)
        assert K.is_deterministic()
        K.triton_available()  # import triton (if installed) now, while TRITON_INTERPRET=1
        K.set_backend("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="triton"):
            ops.causal_conv1d(x, w)
    finally:
        K.set_backend(old_backend)
        K.set_deterministic(old_det)


def test_configure_sets_every_kernel_option(monkeypatch):
    """``configure(KernelsConfig)`` reaches the backend (the chunked cross-entropy's row kernel too), deterministic
    mode, the fused mixer, the cast cache and the GEMM accumulation; the defaults are the unconfigured state."""
    from anytrain.config import KernelsConfig
    from anytrain.kernels import fused_linear_ce, mamba_inner, wide_mm

    for mod, name in (
        (ops, "_backend"),
        (ops, "_deterministic"),
        (mamba_inner, "_enabled"),
        (mamba_inner, "_cache_casts"),
        (wide_mm, "_accumulate_on"),
    ):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    monkeypatch.setattr(fused_linear_ce, "triton_importable", lambda: True)
    gpu = torch.empty(0, device="meta")
    monkeypatch.setattr(type(gpu), "is_cuda", property(lambda t: True))
    K.configure(
        KernelsConfig(
            backend="reference", deterministic=True, fused_mamba_inner=False, cast_cache=False, gemm_accumulate=False
        )
    )
    assert (K.get_backend(), K.is_deterministic()) == ("reference", True)
    assert not mamba_inner._enabled and not mamba_inner._cache_casts and not wide_mm._accumulate_on
    assert not fused_linear_ce._use_triton(gpu)
    K.configure(KernelsConfig())
    assert (K.get_backend(), K.is_deterministic()) == ("auto", False)
    assert mamba_inner._enabled and mamba_inner._cache_casts and wide_mm._accumulate_on
    assert fused_linear_ce._use_triton(gpu)


def test_package_attributes_are_the_public_ops_after_the_lazy_import():
    K.triton_available()
    assert K.selective_scan is ops.selective_scan and K.causal_conv1d is ops.causal_conv1d


@pytest.mark.parametrize("seqlen", [1, 5, 16, 37])
@pytest.mark.parametrize("decay_scale", [1.0, 1e4])  # 1e4: exp(delta * A) underflows to exactly 0 at most steps
def test_chunked_scan_matches_loop_float64(seqlen, decay_scale):
    """The default (chunked, two-level) reference equals the one-step-at-a-time loop: outputs, last state, gradients."""
    batch, dim, dstate = 2, 4, 3
    g = torch.Generator().manual_seed(seqlen)
    u, delta, z = (torch.randn(batch, dim, seqlen, generator=g, dtype=F64) for _ in range(3))
    A = -torch.rand(dim, dstate, generator=g, dtype=F64) * decay_scale - 0.01 * torch.arange(dstate, dtype=F64)
    A[0, 0] = 0.0  # no decay at all: the state only accumulates
    B, C = (torch.randn(batch, 2, dstate, seqlen, generator=g, dtype=F64) for _ in range(2))
    D, bias = torch.randn(dim, generator=g, dtype=F64), torch.randn(dim, generator=g, dtype=F64)
    results = []
    for impl in ("loop", "chunked"):
        leaves = [t.clone().requires_grad_() for t in (u, delta, A, B, C, D, z, bias)]
        out, last = selective_scan_ref(*leaves, delta_softplus=True, return_last_state=True, impl=impl)
        grads = torch.autograd.grad((out * z).sum() + last.square().sum(), leaves)
        assert torch.isfinite(out).all() and all(torch.isfinite(gr).all() for gr in grads)
        results.append((out, last, *grads))
    for name, ref, got in zip(
        ("out", "last", "du", "ddelta", "dA", "dB", "dC", "dD", "dz", "dbias"), *results, strict=True
    ):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_chunked_scan_float32_and_bad_impl():
    """float32 inputs run in float32 (the CPU training path) and stay close to the float64 loop; impl is validated."""
    g = torch.Generator().manual_seed(0)
    u, delta = torch.randn(1, 3, 70, generator=g), torch.randn(1, 3, 70, generator=g)
    A, B, C = -torch.rand(3, 4, generator=g), torch.randn(1, 4, 70, generator=g), torch.randn(1, 4, 70, generator=g)
    out = selective_scan_ref(u, delta, A, B, C, delta_softplus=True)
    assert out.dtype == torch.float32
    ref = selective_scan_ref(*(t.double() for t in (u, delta, A, B, C)), delta_softplus=True, impl="loop")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl"):
        selective_scan_ref(u, delta, A, B, C, impl="parallel")
