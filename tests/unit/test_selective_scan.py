"""Triton selective scan under the CPU interpreter vs the float64 reference: forward, last state, all gradients.

The interpreter runs the tiles every device runs (``selective_scan_triton.CONFIG``): 256-step forward chunks (32
segments of 8 steps), 64-step backward chunks (8 segments of 8 steps, 4 channels per program). The cases cover each
kernel path: forward states in lanes (dstate <= 32) with 4 states per iteration (dstate % 4 == 0) or one, and per-state
loads above 32 states; backward carries in lanes (dstate <= 16) or in the scratch; whole chunks (unmasked loads, bf16
int32 pairs) or not; atomics with the batch sums in the kernel (several programs) or one program, and the
deterministic partials; seqlen 1-3 and dims that are not a multiple of the channel tiles.
"""

from __future__ import annotations

import os
import sys

import pytest

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run in the interpreter
pytest.importorskip("triton")
if _TRITON_PREIMPORTED:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from anytrain import hardware  # noqa: E402
from anytrain.kernels import ops  # noqa: E402
from anytrain.kernels import selective_scan_triton as scan_mod  # noqa: E402
from anytrain.kernels.reference import selective_scan_ref  # noqa: E402
from anytrain.kernels.selective_scan_common import _combine, _softplus, _softplus_grad  # noqa: E402
from anytrain.kernels.selective_scan_fwd import _later  # noqa: E402
from anytrain.kernels.selective_scan_triton import CONFIG, ScanConfig, _fast_math, selective_scan_triton  # noqa: E402

F64 = torch.float64
NARROW = ("u", "delta", "z", "B", "C")  # the inputs given in bf16 / fp32 by the model (the parameters stay fp32)


def make_inputs(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, seed=0, dt_scale=0.5):
    g = torch.Generator().manual_seed(seed)
    bshape = (batch, dstate, seqlen) if ngroups is None else (batch, ngroups, dstate, seqlen)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return {
        "u": rnd(batch, dim, seqlen),
        "delta": dt_scale * rnd(batch, dim, seqlen),
        "A": -torch.rand(dim, dstate, generator=g, dtype=F64) * 2 - 0.1,
        "B": rnd(*bshape),
        "C": rnd(*bshape),
        "D": rnd(dim) if has_d else None,
        "z": rnd(batch, dim, seqlen) if has_z else None,
        "delta_bias": 0.3 * rnd(dim) if has_bias else None,
    }


def run_both(vals, softplus, deterministic=False):
    ours = {k: None if v is None else v.clone().requires_grad_() for k, v in vals.items()}
    ref = {k: None if v is None else v.clone().requires_grad_() for k, v in vals.items()}
    out, last = selective_scan_triton(
        **ours, delta_softplus=softplus, return_last_state=True, deterministic=deterministic
    )
    out_ref, last_ref = selective_scan_ref(**ref, delta_softplus=softplus, return_last_state=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    out.backward(grad)
    out_ref.backward(grad)
    return ours, ref, (out, last), (out_ref, last_ref)


def assert_match(ours, ref, res, res_ref, tol=1e-9):
    torch.testing.assert_close(res[0], res_ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(res[1], res_ref[1], rtol=tol, atol=tol)
    for k, v in ours.items():
        if v is not None:
            assert v.grad is not None, f"no gradient for {k}"
            torch.testing.assert_close(v.grad, ref[k].grad, rtol=tol, atol=tol, msg=lambda m, k=k: f"d{k}: {m}")


# (batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, softplus)
EDGE_CASES = [  # seqlen 1-3 (inside one chunk of both kernels), dstate 1, dims below / not a multiple of the tiles
    (1, 3, 1, 1, None, True, True, True, True),
    (1, 3, 1, 4, None, False, False, False, False),
    (1, 5, 1, 4, None, True, False, True, False),
    (1, 3, 2, 1, None, False, True, False, True),
    (1, 3, 2, 4, None, True, True, True, True),
    (1, 3, 3, 1, None, True, False, False, True),
    (1, 7, 3, 4, None, False, True, True, False),
    (1, 1, 3, 3, None, True, True, True, True),
]
# with the options the launchers must derive: forward (LANES, GROUP, EVEN), backward (LANES, EVEN, BSUM): lanes up to
# 32 (forward) / 16 (backward) states, groups of 4 states where 4 divides dstate, whole chunks of 256 / 64 steps, the
# batch sums in the kernel only with atomics (several programs) and lanes
PATH_CASES = [
    ((1, 5, 64, 4, None, True, True, True, True), (True, 4, False), (True, True, True)),  # whole chunk, 2 programs
    ((1, 5, 27, 8, 1, False, True, True, False), (True, 4, False), (True, False, True)),  # 4-d B/C, one group
    ((1, 6, 19, 3, 2, True, True, False, True), (True, 1, False), (True, False, False)),  # 2 groups, dstate 3
    ((1, 2, 150, 6, None, True, False, True, True), (True, 1, False), (True, False, False)),  # 2 backward chunk ends
    ((1, 3, 70, 20, None, True, True, True, True), (True, 4, False), (False, False, False)),  # backward scratch
    ((1, 1, 9, 36, None, True, True, True, True), (False, 1, False), (False, False, False)),  # forward per-state loads
]
SLOW_CASES = [
    (1, 1, 260, 33, None, True, True, True, True),  # dstate 33: forward per-state loads, carry across forward chunks
    (1, 1, 512, 8, None, True, True, True, True),  # two whole forward chunks (unmasked, carries in lanes)
]


def _recording(monkeypatch, name):
    """Replace ``scan_mod.<name>`` by a recorder of its launches' keyword arguments (the kernel still runs)."""
    kernel, seen = getattr(scan_mod, name), []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw)
                return kernel[grid](*a, **kw)

            return launch

    monkeypatch.setattr(scan_mod, name, Recorder())
    return seen


@pytest.mark.parametrize("batch,dim,seqlen,dstate,ngroups,has_z,has_d,has_bias,softplus", EDGE_CASES)
def test_edge_shapes_match_reference(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, softplus):
    vals = make_inputs(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias)
    assert_match(*run_both(vals, softplus))


@pytest.mark.parametrize("shape,fwd,bwd", PATH_CASES)
def test_kernel_paths_match_reference(monkeypatch, shape, fwd, bwd):
    fwd_seen, bwd_seen = _recording(monkeypatch, "_ss_fwd_kernel"), _recording(monkeypatch, "_ss_bwd_kernel")
    batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, softplus = shape
    vals = make_inputs(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias)
    assert_match(*run_both(vals, softplus))
    (f,), (b,) = fwd_seen, bwd_seen
    assert (f["LANES"], f["GROUP"], f["EVEN"]) == fwd
    assert (b["LANES"], b["EVEN"], b["BSUM"]) == bwd
    assert b["ATOMIC"] == (dim // (ngroups or 1) > CONFIG.block_d_bwd)
    assert (f["STAGES"], b["STAGES"], b["SEG"], b["BLOCK_D"]) == (2, 4, 8, 4)
    assert not f["FAST"] and not b["FAST"] and not f["BC_BITS"] and not b["BITS"]  # fp64, the interpreter


@pytest.mark.slow
@pytest.mark.parametrize("batch,dim,seqlen,dstate,ngroups,has_z,has_d,has_bias,softplus", SLOW_CASES)
def test_long_sequences_match_reference(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, softplus):
    vals = make_inputs(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias)
    assert_match(*run_both(vals, softplus))


@pytest.mark.parametrize("dstate", [1, 4])
def test_seqlen_one_da_is_exactly_zero_in_fp32(dstate):
    # dA = sum_t delta_t g_t exp(delta_t A) h_{t-1} with h_{-1} = 0: exactly 0 at seqlen 1. The backward forms
    # exp(delta A) h_{t-1} from the previous state, not as h_t - delta B u (which leaves the product's rounding where a
    # GPU fuses the multiply-add)
    vals = make_inputs(1, 3, 1, dstate, None, True, True, True)
    leaves = {k: None if v is None else v.float().requires_grad_() for k, v in vals.items()}
    out = selective_scan_triton(**leaves, delta_softplus=True)
    out.backward(torch.ones_like(out))
    assert torch.equal(leaves["A"].grad, torch.zeros_like(leaves["A"]))


@pytest.mark.parametrize("seqlen,dstate", [(64, 8), (256, 3), (37, 4)])
def test_float32_and_bfloat16_inputs_keep_dtype(monkeypatch, seqlen, dstate):
    """bf16 B/C read as int32 pairs where they apply (the forward's groups at any seqlen, its single states and the
    backward at whole chunks), fp32 and bf16 against the float64 reference on the rounded inputs."""
    fwd_seen, bwd_seen = _recording(monkeypatch, "_ss_fwd_kernel"), _recording(monkeypatch, "_ss_bwd_kernel")
    vals = make_inputs(1, 3, seqlen, dstate, None, True, True, True)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        cast = {k: None if v is None else v.to(dtype if k in NARROW else torch.float32) for k, v in vals.items()}
        leaves = {k: None if v is None else v.clone().requires_grad_() for k, v in cast.items()}
        out, last = selective_scan_triton(**leaves, delta_softplus=True, return_last_state=True)
        assert out.dtype == dtype and last.dtype == torch.float32
        ref_in = {k: None if v is None else v.double().requires_grad_() for k, v in cast.items()}
        ref = selective_scan_ref(**ref_in, delta_softplus=True)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
        out.backward(grad.to(dtype))
        ref.backward(grad)
        for k, v in leaves.items():  # gradients keep their input's dtype
            if v is not None:
                assert v.grad.dtype == v.dtype, k
                g_ref = ref_in[k].grad
                torch.testing.assert_close(v.grad.double(), g_ref, rtol=tol, atol=tol * g_ref.abs().max().item())
    pairs = [kw["BC_BITS"] for kw in fwd_seen], [kw["BITS"] for kw in bwd_seen]
    assert pairs == ([False, dstate % 4 == 0 or seqlen % 256 == 0], [False, seqlen % 64 == 0])


def test_extreme_decay_underflows_without_nan():
    # delta*A down to about -1e4: exp underflows to exactly 0; the state then forgets the past completely
    vals = make_inputs(1, 3, 12, 4, None, True, True, False, dt_scale=1.0)
    vals["delta"] = vals["delta"].abs() * 100.0
    vals["A"] = vals["A"] * 50.0
    ours, ref, res, res_ref = run_both(vals, False)
    for k, v in ours.items():
        if v is not None:
            assert torch.isfinite(v.grad).all(), k
    assert torch.isfinite(res[0]).all()
    assert_match(ours, ref, res, res_ref, tol=1e-7)


def test_deterministic_mode_is_bitwise_reproducible_and_matches_atomics():
    vals = make_inputs(1, 5, 11, 4, None, True, True, True, seed=5)  # 2 programs
    runs = [run_both(vals, True, deterministic=True)[0] for _ in range(2)]
    atomic = run_both(vals, True, deterministic=False)[0]
    for k in vals:
        if vals[k] is not None:
            assert torch.equal(runs[0][k].grad, runs[1][k].grad), k
            torch.testing.assert_close(atomic[k].grad, runs[0][k].grad, rtol=1e-10, atol=1e-10)


def test_public_dispatch_uses_triton_when_asked(monkeypatch):
    vals = make_inputs(1, 3, 5, 2, None, False, True, False)
    calls = []
    real = scan_mod.selective_scan_triton
    monkeypatch.setattr(scan_mod, "selective_scan_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    old = ops.get_backend()
    try:
        ops.set_backend("triton")
        out = ops.selective_scan(**vals)
        ops.set_backend("reference")
        ref = ops.selective_scan(**vals)
    finally:
        ops.set_backend(old)
    assert calls == [1]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_rejects_bad_groups_and_tiles():
    vals = make_inputs(1, 5, 4, 2, 2, False, False, False)
    with pytest.raises(ValueError, match="ngroups"):
        selective_scan_triton(**vals)
    with pytest.raises(ValueError, match="power of 2"):
        ScanConfig(segments=12)
    with pytest.raises(ValueError, match="states_per_iteration"):
        ScanConfig(states_per_iteration=3)


def test_fwd_launcher_writes_into_strided_out():
    """``_fwd(..., out=)`` into a (batch, dim, L) view of a (dim, batch·L) matrix (the fused Mamba op's layout), with
    u, delta, z and B/C in such views too: bitwise the same output and states as on contiguous tensors."""
    batch, dim, seqlen, dstate = 2, 2, 19, 4
    vals = make_inputs(batch, dim, seqlen, dstate, None, True, True, True, seed=3)

    def folded(t):  # (batch, C, L) contiguous -> the same values in the (C, batch·L) layout
        c = t.shape[1]
        return t.transpose(0, 1).reshape(c, batch * seqlen).view(c, batch, seqlen).transpose(0, 1)

    args = (vals["A"], scan_mod._as_groups(vals["B"]), scan_mod._as_groups(vals["C"]), vals["D"])
    ref, states_ref = scan_mod._fwd(vals["u"], vals["delta"], *args, vals["z"], vals["delta_bias"], True, CONFIG)
    u, delta, z = folded(vals["u"]), folded(vals["delta"]), folded(vals["z"])
    Bg, Cg = folded(vals["B"]).unsqueeze(1), folded(vals["C"]).unsqueeze(1)
    out = folded(torch.zeros_like(ref))
    y, states = scan_mod._fwd(u, delta, vals["A"], Bg, Cg, vals["D"], z, vals["delta_bias"], True, CONFIG, out=out)
    assert y is out and out.stride() == (seqlen, batch * seqlen, 1)
    assert torch.equal(out, ref) and torch.equal(states, states_ref)


@pytest.mark.parametrize("seqlen", [256, 100])
def test_chunk_major_copy_of_b_and_c(seqlen):
    g = torch.Generator().manual_seed(1)
    B = torch.randn(2, 3, 5, 2 * seqlen, generator=g)[..., ::2]  # (batch, G, N, L), strided in time
    C = torch.randn(2, 3, 5, seqlen, generator=g)
    bc = scan_mod._chunk_major(B, C, 64)
    nch = -(-seqlen // 64)
    assert bc.shape == (2, 3, nch, 5, 2, 64) and bc.is_contiguous()
    for k, x in enumerate((B, C)):
        flat = bc[:, :, :, :, k].transpose(2, 3).reshape(2, 3, 5, nch * 64)
        assert torch.equal(flat[..., :seqlen], x)
        assert not flat[..., seqlen:].any()  # the padding is zero


def test_fast_sigmoid_and_register_caps_only_where_they_compile(monkeypatch):
    """The libdevice sigmoid (FAST) needs a GPU compile: never for CPU tensors, fp64 or the interpreter; the register
    caps are a CUDA launch option."""
    from types import SimpleNamespace

    cpu, gpu = torch.empty(1), SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _fast_math(cpu, torch.float32)
    assert _fast_math(gpu, torch.float32)
    assert not _fast_math(gpu, torch.float64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _fast_math(gpu, torch.float32)
    for vendor, expected in ((hardware.CUDA, {"maxnreg": 72}), (hardware.ROCM, {}), (hardware.CPU, {})):
        monkeypatch.setattr(hardware, "vendor", lambda v=vendor: v)
        assert scan_mod._maxnreg(72) == expected
    assert scan_mod._maxnreg(0) == {}


@triton.jit
def _softplus_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _softplus(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_softplus_polynomial_is_fp32_accurate():
    """The kernels' fp32 softplus (log1p(exp(-|x|)) as exp(-|x|) times a degree-8 polynomial) against float64 over
    [-40, 40], relatively (tiny values included): within 4e-7 plus the fp32 rounding of -|x| log2(e) before exp2
    (|x| 2^-24 relative, as GPUs' exp has); float64 inputs keep the exact log."""
    x = torch.cat([torch.linspace(-40, 40, 4001), torch.tensor([0.0, -1e-6, 1e-6, -87.0, 30.0])])
    exact = x.double().clamp(min=0) + torch.log1p(torch.exp(-x.double().abs()))  # (torch's softplus is x above 20)
    for dtype, rtol, per_x in ((torch.float32, 4e-7, 2.0**-24), (F64, 1e-14, 0.0)):
        y = torch.empty_like(x, dtype=dtype)
        _softplus_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(dtype), y, x.numel(), BLOCK=1024)
        rel = (y.double() - exact).abs() / exact
        assert (rel < rtol + per_x * x.double().abs()).all(), (dtype, rel.max())


@triton.jit
def _softplus_grad_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _softplus_grad(_softplus(tl.load(x_ptr + offs, mask=offs < n))), mask=offs < n)


def test_softplus_derivative_from_delta():
    """The backward's softplus'(x) = sigmoid(x), computed from delta = softplus(x) alone (-expm1(-delta): a Taylor
    polynomial for small delta, 1 - exp(-delta) above), against float64's sigmoid over [-40, 40], relatively: fp32
    within the softplus' own error (4e-7 plus |x| 2^-24, passed through for small delta) plus 2e-7; fp64 within 1e-14.
    Both branches and their switches (delta = 1/2 at x = -0.43; 1/16 at x = -2.74) are in the range."""
    x = torch.cat([torch.linspace(-40, 40, 4001), torch.tensor([0.0, -0.4328, -0.4330, -2.7405, -2.7407, -87.0])])
    exact = torch.sigmoid(x.double())
    for dtype, rtol, per_x in ((torch.float32, 6e-7, 2.0**-24), (F64, 1e-14, 0.0)):
        y = torch.empty_like(x, dtype=dtype)
        _softplus_grad_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(dtype), y, x.numel(), BLOCK=1024)
        rel = (y.double() - exact).abs() / exact
        assert (rel < rtol + per_x * x.double().abs()).all(), (dtype, rel.max())


@triton.jit
def _times(a, b):
    return a * b


@triton.jit
def _wide_sum(a, b):
    # returns fp32 for fp16 inputs: the interpreter casts each step's result back to the inputs' dtype (only the
    # interpreter runs this kernel; compiled Triton wants the inputs' dtype back)
    return a.to(tl.float32) + b.to(tl.float32)


@triton.jit
def _reduce_scan_kernel(x_ptr, o_ptr, h_ptr, R: tl.constexpr, K: tl.constexpr):
    # custom-combine reductions and scans of the shapes the interpreter patch handles: 2-D over each axis (the
    # forward's _later and the scans' _combine), keep_dims, the whole tile (axis None), reverse, a 1-D scan (its
    # elements are scalars), and fp16 inputs whose combine returns fp32 (the cast back after every step)
    rows, cols = tl.arange(0, R)[:, None], tl.arange(0, K)[None, :]
    half = (tl.load(x_ptr + rows * K + cols) * 1000.0).to(tl.float16)
    tl.store(h_ptr + rows * K + cols, tl.associative_scan(half, 1, _wide_sum))
    tl.store(h_ptr + R * K + tl.arange(0, K), tl.reduce(half, 0, _wide_sum))
    x = tl.load(x_ptr + rows * K + cols)
    y = tl.load(x_ptr + R * K + rows * K + cols)
    step = cols + 0 * rows
    last, _ = tl.reduce((x, step), 1, _later)  # (R,)
    first_col, _ = tl.reduce((y, rows + 0 * cols), 0, _later, keep_dims=True)  # (1, K)
    pa, pb = tl.associative_scan((x, y), axis=1, combine_fn=_combine)
    qa, qb = tl.associative_scan((x, y), axis=0, combine_fn=_combine, reverse=True)
    whole_a = tl.reduce(x, None, _times)  # (one input: the interpreter's own axis-None path takes no tuples)
    whole_b = tl.reduce(y, None, _times, keep_dims=True)  # (1, 1)
    line_a, line_b = tl.associative_scan((tl.arange(0, K) * 0.5 + 1.0, tl.arange(0, K) * 0.25), 0, _combine)
    base = o_ptr + rows * K + cols
    tl.store(base, pa)
    tl.store(base + R * K, pb)
    tl.store(base + 2 * R * K, qa)
    tl.store(base + 3 * R * K, qb)
    tl.store(o_ptr + 4 * R * K + tl.arange(0, R), last)
    tl.store(o_ptr + 4 * R * K + R + tl.arange(0, K)[None, :], first_col)
    tl.store(o_ptr + 4 * R * K + R + K + tl.arange(0, K), line_a)
    tl.store(o_ptr + 4 * R * K + R + 2 * K + tl.arange(0, K), line_b)
    tl.store(o_ptr + 4 * R * K + R + 3 * K, whole_a)
    tl.store(o_ptr + 4 * R * K + R + 3 * K + 1 + tl.zeros((1, 1), dtype=tl.int32), whole_b)


def test_vectorized_interpreter_reduce_and_scan_are_bitwise_the_originals():
    """tests/triton_interpreter.py runs the interpreter's custom-combine reduce / scan on whole slices and skips its
    nested language patches: every result must be bitwise the interpreter's own, for a kernel of the shapes it handles
    and for a forward + backward of the scan (the device tiles)."""
    from tests import triton_interpreter

    if not triton_interpreter.installed():  # (installed by tests/conftest.py's session fixture)
        pytest.skip("this Triton's interpreter is not the layout tests/triton_interpreter.py knows: nothing patched")
    R, K = 4, 8
    x = torch.rand(2 * R * K, generator=torch.Generator().manual_seed(3)) + 0.5

    def both(fn):
        got = []
        for fast in (True, False):
            if fast:
                triton_interpreter.install()
            else:
                triton_interpreter.uninstall()
            try:
                assert triton_interpreter.installed() == fast
                got.append(fn())
            finally:
                triton_interpreter.install()
        return got

    def kernel():
        out, half = torch.zeros(4 * R * K + R + 3 * K + 2), torch.zeros(R * K + K, dtype=torch.float16)
        _reduce_scan_kernel[(1,)](x, out, half, R=R, K=K)
        return [out, half]

    def scan():
        vals = make_inputs(1, 2, 20, 4, 2, True, True, True)
        ours, _, (out, last), _ = run_both(vals, True)
        return [out, last, *(v.grad for v in ours.values() if v is not None)]

    for fn in (kernel, scan):
        fast, slow = both(fn)
        assert len(fast) == len(slow) and all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True)), fn.__name__
        assert all(t.abs().sum() > 0 for t in fast), fn.__name__
