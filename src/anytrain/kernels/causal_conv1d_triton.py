"""Triton causal depthwise conv1d (width 2-4) with optional SiLU, forward and backward.

The kernels read the weight (dim, width) as 4 taps, the missing leading taps masked to zero, so one kernel serves every
width: out_t = bias + sum_{k<4} w4[k] x_{t-3+k}. The forward's programs own (BLOCK_D channels, BLOCK_T timesteps)
tiles; the shifted x tiles are re-read through L1/L2, so DRAM sees x once and out once (the memory floor).

The backward recomputes the pre-activation instead of saving it (only x is kept): dx_t = sum_j w4[3-j] dpre_{t+j}
with dpre_s = dout_s * silu'(pre_s), pre_s recomputed from x_{s-3..s}. One program per channel block loops over
every (batch, time block) and accumulates dweight/dbias in registers, so it writes the final dweight/dbias itself, in
the parameters' dtypes: one launch, no partial buffers, deterministic. Only when dim / block_d_bwd gives fewer than
``min_programs_bwd`` programs is the loop split over more programs; a second small kernel then sums their partials
(still deterministic).

Host side, per call: the launch parameters (grids, constexprs, split counts) are computed once per (shapes, dtypes,
activation, config) and kept in a dict; a call checks x's time stride, allocates its outputs with ``torch.empty`` and
launches one kernel (two for a split backward) through ``launch.Launcher``, which relaunches the compiled binary
without Triton's per-call argument binding. Without autograd (no_grad or no input requiring grad) the forward
skips the autograd Function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from anytrain import hardware
from anytrain.kernels import ops
from anytrain.kernels.fastmath import fast_math_ok, fast_sigmoid
from anytrain.kernels.launch import Launcher

_TAPS = 4


@dataclass(frozen=True)
class ConvConfig:
    """Tiles and launch parameters of the conv kernels (chosen per vendor in ``_VENDOR_CONFIGS``)."""

    block_d: int = 2
    """Forward: channels per program (a power of 2)."""
    block_t: int = 1024
    """Forward: timesteps per program (a power of 2 >= 4)."""
    num_warps: int = 4
    block_d_bwd: int = 1
    """Backward: channels per program (a power of 2)."""
    block_t_bwd: int = 1024
    """Backward: timesteps per loop iteration (a power of 2 >= slots_bwd)."""
    num_warps_bwd: int = 4
    min_programs_bwd: int = 1024
    """Backward: split the (batch, time) loop over more programs only when dim / block_d_bwd gives fewer."""
    stages_bwd: int = 0
    """Backward: software-pipeline depth of the (batch, time block) loop (``tl.range(num_stages=...)``; 0 = the
    compiler's default): > 1 asks Triton to issue later iterations' x / dout loads while the current one computes."""
    slots_bwd: int = 4
    """Backward: consecutive timesteps per thread (4 or 8). Each thread recomputes the activation derivative of the
    3 timesteps after its run (the next run's first 3), so 8 does 11 instead of 14 of them per 8 outputs and loads
    28 instead of 40 values."""

    def __post_init__(self) -> None:
        for name in ("block_d", "block_t", "block_d_bwd", "block_t_bwd"):
            v = getattr(self, name)
            if v < (4 if name.startswith("block_t") else 1) or v & (v - 1):
                raise ValueError(f"ConvConfig: {name} must be a power of 2 (block_t* >= 4), got {v}")
        if self.slots_bwd not in (4, 8) or self.block_t_bwd < self.slots_bwd:
            raise ValueError(
                f"ConvConfig: slots_bwd must be 4 or 8 and at most block_t_bwd ({self.block_t_bwd}), "
                f"got {self.slots_bwd}"
            )


_VENDOR_CONFIGS = {
    # the fastest tiles of the CUDA tile sweep (bench/mamba_kernels.py --sweep; figures: docs/kernels.md)
    hardware.CUDA: ConvConfig(slots_bwd=8),
    # not measured; 64-wide wavefronts: 8+ elements per lane either way
    hardware.ROCM: ConvConfig(block_d_bwd=2),
    # CPU tensors run only under the Triton interpreter (tests): small tiles, few ops per program
    hardware.CPU: ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=8, num_warps_bwd=1),
}
_VENDOR: list[str] = []  # hardware.vendor(), looked up once


def default_config(device: torch.device | None = None) -> ConvConfig:
    """The tiles for tensors on ``device``: the CPU tiles for CPU tensors, else (and without a device) the tiles of
    this process's GPU vendor."""
    if device is not None and device.type == "cpu":
        return _VENDOR_CONFIGS[hardware.CPU]
    if not _VENDOR:
        _VENDOR.append(hardware.vendor())
    return _VENDOR_CONFIGS[_VENDOR[0]]


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    # exp(-x) overflowing to inf for x << 0 gives 1 / inf = 0, the right limit (no NaN): no branch needed. FAST (fp32
    # on a GPU): ``fastmath.fast_sigmoid`` without the IEEE division's range checks: 350 instead of 417 instructions
    # per 8 outputs in the backward
    if FAST:
        return fast_sigmoid(x)
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _split4(v):
    # (BLOCK_D, J, 4) -> the four (BLOCK_D, J) slots v[..., 0], v[..., 1], v[..., 2], v[..., 3] (in-thread)
    a, b = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))  # a = slots 0, 2; b = slots 1, 3
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _join4(v0, v1, v2, v3):
    j = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [..., m, k] = slot 2m + k
    return tl.reshape(j, (v0.shape[0], v0.shape[1], 4))


@triton.jit
def _load4(rows, j, mask_d, seqlen, ACC: tl.constexpr, EVEN: tl.constexpr):
    # rows: (BLOCK_D,) row pointers; j: (J,) block-of-4 indices -> x[rows, 4j + 0..3] as (BLOCK_D, J, 4), zero outside.
    # EVEN (seqlen % 4 == 0): the mask is per block of 4, so the load is one aligned 4-element vector.
    tt = 4 * j[:, None] + tl.arange(0, 4)[None, :]  # (J, 4)
    if EVEN:
        mj = (j >= 0) & (4 * j < seqlen)
        m = mask_d[:, None, None] & (mj[:, None] & (tl.arange(0, 4) < 4)[None, :])[None, :, :]
    else:
        m = mask_d[:, None, None] & ((tt >= 0) & (tt < seqlen))[None, :, :]
    return tl.load(rows[:, None, None] + tt[None, :, :], mask=m, other=0.0).to(ACC)


@triton.jit
def _conv4(w0, w1, w2, w3, bias, p1, p2, p3, x0, x1, x2, x3):
    # pre-activation at the four slots of a block, from the previous block's slots 1-3 and this block's slots 0-3
    o0 = bias + w0 * p1 + w1 * p2 + w2 * p3 + w3 * x0
    o1 = bias + w0 * p2 + w1 * p3 + w2 * x0 + w3 * x1
    o2 = bias + w0 * p3 + w1 * x0 + w2 * x1 + w3 * x2
    o3 = bias + w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
    return o0, o1, o2, o3


@triton.jit
def _dsilu(d, p, SILU: tl.constexpr):
    # SILU: 0 none, 1 SiLU, 2 SiLU with the fast sigmoid
    if SILU:  # d silu'(p) = d s (1 + p (1 - s)) = t + t (p - p s) with t = d s: one multiply and two FMAs
        s = _sigmoid(p, SILU == 2)
        t = d * s
        d = t + t * (p - p * s)
    return d


@triton.jit
def _load_taps(w_ptr, offs_d, mask_d, PADW: tl.constexpr, ACC: tl.constexpr):
    # the contiguous weight (dim, width) as 4 taps (BLOCK_D, 1) each, zero-padded in front: tap k is weight[:, k - PADW]
    rows = w_ptr + offs_d * (4 - PADW) - PADW
    w0 = tl.load(rows + 0, mask=mask_d & (PADW <= 0), other=0.0).to(ACC)[:, None]
    w1 = tl.load(rows + 1, mask=mask_d & (PADW <= 1), other=0.0).to(ACC)[:, None]
    w2 = tl.load(rows + 2, mask=mask_d & (PADW <= 2), other=0.0).to(ACC)[:, None]
    w3 = tl.load(rows + 3, mask=mask_d, other=0.0).to(ACC)[:, None]
    return w0, w1, w2, w3


@triton.jit
def _time_mask(j, mask_d, seqlen, EVEN: tl.constexpr, N: tl.constexpr = 4):
    # (BLOCK_D, J, N) mask for the run indices j >= 0 (runs of N slots); EVEN (seqlen % N == 0): one mask per run
    tt = N * j[:, None] + tl.arange(0, N)[None, :]
    if EVEN:
        return mask_d[:, None, None] & ((N * j < seqlen)[:, None] & (tl.arange(0, N) < N)[None, :])[None, :, :]
    return mask_d[:, None, None] & (tt < seqlen)[None, :, :]


@triton.jit
def _bias_col(bias_ptr, offs_d, mask_d, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    # the bias as a (BLOCK_D, 1) column, zeros without one
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)[:, None]
    else:
        bias = tl.zeros((BLOCK_D, 1), dtype=ACC)
    return bias


@triton.jit
def _store_dw_db(dw_ptr, db_ptr, row, mask_d, acc0, acc1, acc2, acc3, accb, PADW: tl.constexpr, HAS_BIAS: tl.constexpr):
    # the backward's per-thread tap / bias sums, reduced over time and written (in the outputs' dtypes) to row ``row``
    # of dw (., width) / db (.,)
    rows = dw_ptr + row * (4 - PADW) - PADW
    ty = dw_ptr.dtype.element_ty
    if PADW <= 0:
        tl.store(rows + 0, tl.sum(acc0, axis=1).to(ty), mask=mask_d)
    if PADW <= 1:
        tl.store(rows + 1, tl.sum(acc1, axis=1).to(ty), mask=mask_d)
    if PADW <= 2:
        tl.store(rows + 2, tl.sum(acc2, axis=1).to(ty), mask=mask_d)
    tl.store(rows + 3, tl.sum(acc3, axis=1).to(ty), mask=mask_d)
    if HAS_BIAS:
        tl.store(db_ptr + row, tl.sum(accb, axis=1).to(db_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _conv_fwd_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    dim,
    seqlen,
    s_xb,
    s_xd,
    s_ob,
    s_od,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PADW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    ACC: tl.constexpr,
    EVEN: tl.constexpr,
):
    # Time is tiled as (BLOCK_T // 4 blocks, 4 slots): every load is an aligned vector of 4 (this block and the
    # previous one), and the 3 shifted taps are picked from the slots in registers (no misaligned scalar loads).
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    j = pid_t * (BLOCK_T // 4) + tl.arange(0, BLOCK_T // 4)
    x_rows = x_ptr + b * s_xb + offs_d * s_xd
    w0, w1, w2, w3 = _load_taps(w_ptr, offs_d, mask_d, PADW, ACC)
    bias = _bias_col(bias_ptr, offs_d, mask_d, HAS_BIAS, BLOCK_D, ACC)
    x0, x1, x2, x3 = _split4(_load4(x_rows, j, mask_d, seqlen, ACC, EVEN))
    _, p1, p2, p3 = _split4(_load4(x_rows, j - 1, mask_d, seqlen, ACC, EVEN))
    o0, o1, o2, o3 = _conv4(w0, w1, w2, w3, bias, p1, p2, p3, x0, x1, x2, x3)
    out = _join4(o0, o1, o2, o3)
    if SILU:
        out = out * _sigmoid(out, SILU == 2)
    tt = 4 * j[:, None] + tl.arange(0, 4)[None, :]
    o_rows = out_ptr + b * s_ob + offs_d * s_od
    tl.store(
        o_rows[:, None, None] + tt[None, :, :],
        out.to(out_ptr.dtype.element_ty),
        mask=_time_mask(j, mask_d, seqlen, EVEN),
    )


@triton.jit
def _conv_bwd_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    dout_ptr,
    dx_ptr,
    dw_ptr,
    db_ptr,
    dim,
    seqlen,
    n_tblocks,
    n_iters,
    iters_per_program,
    s_xb,
    s_xd,
    s_gb,
    s_gd,
    s_db,
    s_dd,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PADW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    ACC: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr = None,
):
    # Program (channel block, split s) walks iterations [s * iters_per_program, (s + 1) * iters_per_program) of the
    # flattened (batch, time block) space; dweight/dbias accumulate elementwise in registers and are reduced and
    # written once: dw (n_splits, dim, width) and db (n_splits, dim), final when there is one split.
    # dpre_s = dout_s * act'(pre_s) is formed for this block's 4 slots and for slots 0-2 of the next block
    # (7 sigmoids per 4 outputs); dx_t = w3 dpre_t + w2 dpre_{t+1} + w1 dpre_{t+2} + w0 dpre_{t+3}.
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    w0, w1, w2, w3 = _load_taps(w_ptr, offs_d, mask_d, PADW, ACC)
    bias = _bias_col(bias_ptr, offs_d, mask_d, HAS_BIAS, BLOCK_D, ACC)
    acc0 = tl.zeros((BLOCK_D, BLOCK_T // 4), dtype=ACC)
    acc1 = tl.zeros((BLOCK_D, BLOCK_T // 4), dtype=ACC)
    acc2 = tl.zeros((BLOCK_D, BLOCK_T // 4), dtype=ACC)
    acc3 = tl.zeros((BLOCK_D, BLOCK_T // 4), dtype=ACC)
    accb = tl.zeros((BLOCK_D, BLOCK_T // 4), dtype=ACC)
    it0 = pid_s * iters_per_program
    for it in tl.range(it0, tl.minimum(it0 + iters_per_program, n_iters), num_stages=STAGES):
        b = (it // n_tblocks).to(tl.int64)
        j = (it % n_tblocks) * (BLOCK_T // 4) + tl.arange(0, BLOCK_T // 4)
        x_rows = x_ptr + b * s_xb + offs_d * s_xd
        g_rows = dout_ptr + b * s_gb + offs_d * s_gd
        _, p1, p2, p3 = _split4(_load4(x_rows, j - 1, mask_d, seqlen, ACC, EVEN))
        x0, x1, x2, x3 = _split4(_load4(x_rows, j, mask_d, seqlen, ACC, EVEN))
        n0, n1, n2, _ = _split4(_load4(x_rows, j + 1, mask_d, seqlen, ACC, EVEN))
        g0, g1, g2, g3 = _split4(_load4(g_rows, j, mask_d, seqlen, ACC, EVEN))
        f0, f1, f2, _ = _split4(_load4(g_rows, j + 1, mask_d, seqlen, ACC, EVEN))
        c0, c1, c2, c3 = _conv4(w0, w1, w2, w3, bias, p1, p2, p3, x0, x1, x2, x3)
        e0 = _dsilu(g0, c0, SILU)
        e1 = _dsilu(g1, c1, SILU)
        e2 = _dsilu(g2, c2, SILU)
        e3 = _dsilu(g3, c3, SILU)
        # next block, slots 0-2 (zero beyond seqlen because dout is loaded as zero there)
        e4 = _dsilu(f0, bias + w0 * x1 + w1 * x2 + w2 * x3 + w3 * n0, SILU)
        e5 = _dsilu(f1, bias + w0 * x2 + w1 * x3 + w2 * n0 + w3 * n1, SILU)
        e6 = _dsilu(f2, bias + w0 * x3 + w1 * n0 + w2 * n1 + w3 * n2, SILU)
        dx = _join4(
            w3 * e0 + w2 * e1 + w1 * e2 + w0 * e3,
            w3 * e1 + w2 * e2 + w1 * e3 + w0 * e4,
            w3 * e2 + w2 * e3 + w1 * e4 + w0 * e5,
            w3 * e3 + w2 * e4 + w1 * e5 + w0 * e6,
        )
        tt = 4 * j[:, None] + tl.arange(0, 4)[None, :]
        dx_rows = dx_ptr + b * s_db + offs_d * s_dd
        tl.store(
            dx_rows[:, None, None] + tt[None, :, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=_time_mask(j, mask_d, seqlen, EVEN),
        )
        # e0..e3 are zero outside [0, seqlen), so these sums only see real timesteps
        k0, k1, k2, k3 = _conv4(e0, e1, e2, e3, 0.0, p1, p2, p3, x0, x1, x2, x3)
        acc0 += k0
        acc1 += k1
        acc2 += k2
        acc3 += k3
        accb += e0 + e1 + e2 + e3
    row = pid_s * dim + offs_d  # (BLOCK_D,) row of the (n_splits, dim, ...) outputs
    _store_dw_db(dw_ptr, db_ptr, row, mask_d, acc0, acc1, acc2, acc3, accb, PADW, HAS_BIAS)


@triton.jit
def _halves8(v):
    # (BLOCK_D, J, 8) -> slots 0-3 and slots 4-7 as (BLOCK_D, J, 4) each (in-thread)
    lo, hi = tl.split(tl.permute(tl.reshape(v, (v.shape[0], v.shape[1], 2, 4)), (0, 1, 3, 2)))
    return lo, hi


@triton.jit
def _ld_run(rows, start, t_abs, N: tl.constexpr, mask_d, seqlen, EVEN: tl.constexpr):
    # rows: (BLOCK_D,) row pointers at the time block's start; start: (J,) first of N consecutive elements relative to
    # them, t_abs: (J,) its absolute timestep -> (BLOCK_D, J, N), zero outside [0, seqlen). EVEN (the N elements of a
    # run are all inside or all outside, as for aligned runs with seqlen % 8 == 0): one mask per run, one vector load
    r = tl.arange(0, N)[None, :]
    if EVEN:
        ok = ((t_abs >= 0) & (t_abs < seqlen))[:, None] & (r < N)
    else:
        ok = (t_abs[:, None] + r >= 0) & (t_abs[:, None] + r < seqlen)
    return tl.load(
        rows[:, None, None] + (start[:, None] + r)[None, :, :], mask=mask_d[:, None, None] & ok[None, :, :], other=0
    )


@triton.jit
def _run8(rows, jl, t0, mask_d, seqlen, ACC: tl.constexpr, EVEN: tl.constexpr):
    # the 3 timesteps before run jl of the time block starting at t0, its 8, and the 3 after it, as 14 (BLOCK_D, J)
    # tensors (zero outside [0, seqlen)); rows point at the block's start
    _, p1, p2, p3 = _split4(_ld_run(rows, 8 * jl - 4, t0 + 8 * jl - 4, 4, mask_d, seqlen, EVEN).to(ACC))
    lo, hi = _halves8(_ld_run(rows, 8 * jl, t0 + 8 * jl, 8, mask_d, seqlen, EVEN).to(ACC))
    x0, x1, x2, x3 = _split4(lo)
    x4, x5, x6, x7 = _split4(hi)
    n0, n1, n2, _ = _split4(_ld_run(rows, 8 * jl + 8, t0 + 8 * jl + 8, 4, mask_d, seqlen, EVEN).to(ACC))
    return p1, p2, p3, x0, x1, x2, x3, x4, x5, x6, x7, n0, n1, n2


@triton.jit
def _conv_bwd8_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    dout_ptr,
    dx_ptr,
    dw_ptr,
    db_ptr,
    dim,
    seqlen,
    n_tblocks,
    n_iters,
    iters_per_program,
    s_xb,
    s_xd,
    s_gb,
    s_gd,
    s_db,
    s_dd,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PADW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    ACC: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr = None,
):
    # _conv_bwd_kernel with runs of 8 timesteps per thread (ConvConfig.slots_bwd = 8): time is tiled as (BLOCK_T // 8
    # runs, 8 slots); the 3 timesteps before a run come from the previous aligned block of 4 and the 3 after it from
    # the next one. EVEN: seqlen % 8 == 0. The (batch, time block) of an iteration and the row pointers are carried
    # from one iteration to the next (recomputing them with a division cost ~40 instructions per 8 outputs).
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    w0, w1, w2, w3 = _load_taps(w_ptr, offs_d, mask_d, PADW, ACC)
    bias = _bias_col(bias_ptr, offs_d, mask_d, HAS_BIAS, BLOCK_D, ACC)
    acc0 = tl.zeros((BLOCK_D, BLOCK_T // 8), dtype=ACC)
    acc1 = tl.zeros((BLOCK_D, BLOCK_T // 8), dtype=ACC)
    acc2 = tl.zeros((BLOCK_D, BLOCK_T // 8), dtype=ACC)
    acc3 = tl.zeros((BLOCK_D, BLOCK_T // 8), dtype=ACC)
    accb = tl.zeros((BLOCK_D, BLOCK_T // 8), dtype=ACC)
    jl = tl.arange(0, BLOCK_T // 8)  # runs of 8 inside a time block
    it0 = pid_s * iters_per_program
    b = (it0 // n_tblocks).to(tl.int64)
    tb = it0 % n_tblocks
    t0 = tb * BLOCK_T
    # row pointers at the current time block, advanced by one block per iteration (by the batch stride minus the
    # blocks already walked when the next batch starts)
    x_rows = x_ptr + offs_d * s_xd + b * s_xb + t0
    g_rows = dout_ptr + offs_d * s_gd + b * s_gb + t0
    dx_rows = dx_ptr + offs_d * s_dd + b * s_db + t0
    back = (n_tblocks - 1) * BLOCK_T  # the blocks walked in a batch, undone when the next batch starts
    for _ in tl.range(it0, tl.minimum(it0 + iters_per_program, n_iters), num_stages=STAGES):
        p1, p2, p3, x0, x1, x2, x3, x4, x5, x6, x7, n0, n1, n2 = _run8(x_rows, jl, t0, mask_d, seqlen, ACC, EVEN)
        _, _, _, g0, g1, g2, g3, g4, g5, g6, g7, f0, f1, f2 = _run8(g_rows, jl, t0, mask_d, seqlen, ACC, EVEN)
        c0, c1, c2, c3 = _conv4(w0, w1, w2, w3, bias, p1, p2, p3, x0, x1, x2, x3)
        c4, c5, c6, c7 = _conv4(w0, w1, w2, w3, bias, x1, x2, x3, x4, x5, x6, x7)
        e0 = _dsilu(g0, c0, SILU)
        e1 = _dsilu(g1, c1, SILU)
        e2 = _dsilu(g2, c2, SILU)
        e3 = _dsilu(g3, c3, SILU)
        e4 = _dsilu(g4, c4, SILU)
        e5 = _dsilu(g5, c5, SILU)
        e6 = _dsilu(g6, c6, SILU)
        e7 = _dsilu(g7, c7, SILU)
        # the next run's slots 0-2 (zero beyond seqlen because dout is loaded as zero there)
        e8 = _dsilu(f0, bias + w0 * x5 + w1 * x6 + w2 * x7 + w3 * n0, SILU)
        e9 = _dsilu(f1, bias + w0 * x6 + w1 * x7 + w2 * n0 + w3 * n1, SILU)
        e10 = _dsilu(f2, bias + w0 * x7 + w1 * n0 + w2 * n1 + w3 * n2, SILU)
        dxl = _join4(
            w3 * e0 + w2 * e1 + w1 * e2 + w0 * e3,
            w3 * e1 + w2 * e2 + w1 * e3 + w0 * e4,
            w3 * e2 + w2 * e3 + w1 * e4 + w0 * e5,
            w3 * e3 + w2 * e4 + w1 * e5 + w0 * e6,
        )
        dxh = _join4(
            w3 * e4 + w2 * e5 + w1 * e6 + w0 * e7,
            w3 * e5 + w2 * e6 + w1 * e7 + w0 * e8,
            w3 * e6 + w2 * e7 + w1 * e8 + w0 * e9,
            w3 * e7 + w2 * e8 + w1 * e9 + w0 * e10,
        )
        dx = tl.reshape(tl.permute(tl.join(dxl, dxh), (0, 1, 3, 2)), (BLOCK_D, BLOCK_T // 8, 8))
        tt = 8 * jl[:, None] + tl.arange(0, 8)[None, :]
        tl.store(
            dx_rows[:, None, None] + tt[None, :, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=_time_mask(jl + t0 // 8, mask_d, seqlen, EVEN, 8),
        )
        # dweight tap k: sum_t dpre_t x_{t-3+k}, one FMA chain per tap (e0..e7 are zero outside [0, seqlen))
        acc0 = acc0 + e0 * p1 + e1 * p2 + e2 * p3 + e3 * x0 + e4 * x1 + e5 * x2 + e6 * x3 + e7 * x4
        acc1 = acc1 + e0 * p2 + e1 * p3 + e2 * x0 + e3 * x1 + e4 * x2 + e5 * x3 + e6 * x4 + e7 * x5
        acc2 = acc2 + e0 * p3 + e1 * x0 + e2 * x1 + e3 * x2 + e4 * x3 + e5 * x4 + e6 * x5 + e7 * x6
        acc3 = acc3 + e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3 + e4 * x4 + e5 * x5 + e6 * x6 + e7 * x7
        accb = accb + e0 + e1 + e2 + e3 + e4 + e5 + e6 + e7
        tb += 1
        wrap = tb == n_tblocks  # the next iteration starts the next batch
        tb = tl.where(wrap, 0, tb)
        t0 = tb * BLOCK_T
        x_rows += tl.where(wrap, s_xb - back, BLOCK_T)
        g_rows += tl.where(wrap, s_gb - back, BLOCK_T)
        dx_rows += tl.where(wrap, s_db - back, BLOCK_T)
    row = pid_s * dim + offs_d  # (BLOCK_D,) row of the (n_splits, dim, ...) outputs
    _store_dw_db(dw_ptr, db_ptr, row, mask_d, acc0, acc1, acc2, acc3, accb, PADW, HAS_BIAS)


@triton.jit
def _sum_splits_kernel(pw_ptr, pb_ptr, dw_ptr, db_ptr, n_w, n_b, splits, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    # the split backward's partials summed over the splits: pw (splits, n_w) -> dw (n_w,) and pb (splits, n_b) -> db,
    # in the outputs' dtypes; elements [0, n_w) of the grid are dw's, [n_w, n_w + n_b) db's
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_w = offs < n_w
    acc = tl.zeros((BLOCK,), dtype=pw_ptr.dtype.element_ty)
    if HAS_BIAS:
        ob = offs - n_w
        in_b = (ob >= 0) & (ob < n_b)
        for s in range(splits):
            acc += tl.load(pw_ptr + s * n_w + offs, mask=in_w, other=0.0)
            acc += tl.load(pb_ptr + s * n_b + ob, mask=in_b, other=0.0)
        tl.store(db_ptr + ob, acc.to(db_ptr.dtype.element_ty), mask=in_b)
    else:
        for s in range(splits):
            acc += tl.load(pw_ptr + s * n_w + offs, mask=in_w, other=0.0)
    tl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=in_w)


_SUM_BLOCK = 1024


def _bwd_splits(cfg: ConvConfig, dim: int, n_iters: int) -> tuple[int, int]:
    """(splits, iterations per program) of the backward: one program per channel block over all (batch, time
    blocks) when that already gives ``cfg.min_programs_bwd`` programs; otherwise the iterations are split so that
    about that many programs run, and ``_sum_splits_kernel`` sums the per-split dweight/dbias."""
    d_blocks = triton.cdiv(dim, cfg.block_d_bwd)
    splits = max(1, min(n_iters, triton.cdiv(cfg.min_programs_bwd, d_blocks)))
    per = triton.cdiv(n_iters, splits)
    return triton.cdiv(n_iters, per), per


class _Plan:
    """Everything a call's launches need that depends only on (shapes, dtypes, device type, activation, config)."""

    __slots__ = (
        "dim",
        "seqlen",
        "out_shape",
        "out_strides",
        "fwd",
        "bwd",
        "bwd_args",
        "splits",
        "dw_shape",
        "dw_dtype",
        "db_dtype",
        "partial_dtype",
        "sum",
    )

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, cfg: ConvConfig):
        if activation not in (None, "silu"):
            raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
        if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
            raise ValueError(f"causal_conv1d: bad shapes x {tuple(x.shape)} weight {tuple(weight.shape)}")
        batch, dim, seqlen = x.shape
        width = weight.shape[1]
        if not 2 <= width <= _TAPS:
            raise ValueError(f"causal_conv1d: width must be 2..{_TAPS}, got {width}")
        if bias is not None and tuple(bias.shape) != (dim,):
            raise ValueError(f"causal_conv1d: bias must have shape ({dim},), got {tuple(bias.shape)}")
        f64 = any(t is not None and t.dtype == torch.float64 for t in (x, weight, bias))
        acc = tl.float64 if f64 else tl.float32
        silu = 0 if activation is None else (2 if fast_math_ok(x, not f64) else 1)  # 2: the fast fp32 sigmoid
        has_bias, padw = bias is not None, _TAPS - width
        self.dim, self.seqlen = dim, seqlen
        self.out_shape, self.out_strides = (batch, dim, seqlen), (dim * seqlen, seqlen)
        fwd_grid = (triton.cdiv(seqlen, cfg.block_t), triton.cdiv(dim, cfg.block_d), batch)
        fwd_meta = dict(
            BLOCK_D=cfg.block_d,
            BLOCK_T=cfg.block_t,
            PADW=padw,
            HAS_BIAS=has_bias,
            SILU=silu,
            ACC=acc,
            EVEN=seqlen % 4 == 0,
            num_warps=cfg.num_warps,
        )
        self.fwd = Launcher(_conv_fwd_kernel, fwd_grid, fwd_meta)
        eight = cfg.slots_bwd == 8
        n_tblocks = triton.cdiv(seqlen, cfg.block_t_bwd)
        n_iters = batch * n_tblocks
        self.splits, per = _bwd_splits(cfg, dim, n_iters)
        bwd_meta = dict(
            BLOCK_D=cfg.block_d_bwd,
            BLOCK_T=cfg.block_t_bwd,
            PADW=padw,
            HAS_BIAS=has_bias,
            SILU=silu,
            ACC=acc,
            EVEN=seqlen % (8 if eight else 4) == 0,
            STAGES=cfg.stages_bwd or None,
            num_warps=cfg.num_warps_bwd,
        )
        bwd_grid = (triton.cdiv(dim, cfg.block_d_bwd), self.splits)
        self.bwd = Launcher(_conv_bwd8_kernel if eight else _conv_bwd_kernel, bwd_grid, bwd_meta)
        self.bwd_args = (dim, seqlen, n_tblocks, n_iters, per)
        self.dw_shape, self.dw_dtype = (dim, width), weight.dtype
        self.db_dtype = None if bias is None else bias.dtype
        self.partial_dtype = torch.float64 if f64 else torch.float32
        sum_grid = (triton.cdiv(dim * (width + has_bias), _SUM_BLOCK),)
        self.sum = Launcher(_sum_splits_kernel, sum_grid, dict(BLOCK=_SUM_BLOCK, HAS_BIAS=has_bias))


_PLANS: dict[tuple, _Plan] = {}


def _plan(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, config: ConvConfig | None) -> _Plan:
    """The cached ``_Plan`` of these arguments (made, and the arguments checked, on the first call with them)."""
    key = (
        x.shape,
        weight.shape,
        x.dtype,
        weight.dtype,
        None if bias is None else (bias.shape, bias.dtype),
        activation,
        x.is_cuda,
        config,
    )
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 4096:  # many distinct shapes (e.g. variable-length evaluation): start over
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(x, weight, bias, activation, config or default_config(x.device))
    return plan


def _launch_fwd(p: _Plan, x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    sx = x.stride()
    if out is None:
        out = torch.empty(p.out_shape, device=x.device, dtype=x.dtype)
        so = p.out_strides
    else:
        so = out.stride()
    p.fwd(x, weight, weight if bias is None else bias, out, p.dim, p.seqlen, sx[0], sx[1], so[0], so[1])
    return out


def _launch_bwd(
    p: _Plan, x: Tensor, weight: Tensor, bias: Tensor | None, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor | None]:
    dx = torch.empty_like(x)
    if p.splits == 1:  # the kernel writes the final dweight / dbias
        dw = torch.empty(p.dw_shape, device=x.device, dtype=p.dw_dtype)
        db = None if bias is None else torch.empty(p.dim, device=x.device, dtype=p.db_dtype)
    else:  # per-split partials, summed below
        dw = torch.empty((p.splits, *p.dw_shape), device=x.device, dtype=p.partial_dtype)
        db = None if bias is None else torch.empty((p.splits, p.dim), device=x.device, dtype=p.partial_dtype)
    sx, sg, sd = x.stride(), dout.stride(), dx.stride()
    p.bwd(
        x,
        weight,
        dw if bias is None else bias,
        dout,
        dx,
        dw,
        dw if db is None else db,
        *p.bwd_args,
        sx[0],
        sx[1],
        sg[0],
        sg[1],
        sd[0],
        sd[1],
    )
    if p.splits == 1:
        return dx, dw, db
    dweight = torch.empty(p.dw_shape, device=x.device, dtype=p.dw_dtype)
    dbias = None if bias is None else torch.empty(p.dim, device=x.device, dtype=p.db_dtype)
    pb, ob = (dw, dweight) if bias is None else (db, dbias)
    p.sum(dw, pb, dweight, ob, dweight.numel(), p.dim, p.splits)
    return dx, dweight, dbias


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool, cfg: ConvConfig, *, out: Tensor | None = None
) -> Tensor:
    """Launch the forward: ``out`` = conv(x) (+ SiLU), (batch, dim, L). x and out: any batch/channel strides, unit
    stride in time (out defaults to a new contiguous tensor; it must not overlap x); weight contiguous; bias: unit
    stride or None."""
    return _launch_fwd(_plan(x, weight, bias, "silu" if silu else None, cfg), x, weight, bias, out)


def _bwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, dout: Tensor, silu: bool, cfg: ConvConfig
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Launch the backward of ``_fwd``: dx (``empty_like(x)``: x's layout when x is dense), dweight and dbias (None
    without bias) in the parameters' dtypes. x, dout: any batch/channel strides, unit stride in time."""
    return _launch_bwd(_plan(x, weight, bias, "silu" if silu else None, cfg), x, weight, bias, dout)


class _CausalConv1dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan):
        ctx.save_for_backward(x, weight, bias)
        ctx.plan = plan
        return _launch_fwd(plan, x, weight, bias)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        dx, dweight, dbias = _launch_bwd(ctx.plan, x, weight, bias, _unit_last(dout))
        return dx, dweight, dbias, None


# Under torch.compile the op is the custom ops ``anytrain::causal_conv1d_fwd`` / ``_bwd`` (torch.library, opaque to
# the compiler, with fake kernels), so that a compiled block, checkpointed or not, keeps one graph around it (dynamo
# cannot trace the direct launches of ``kernels.launch``; a graph break inside a checkpointed block makes dynamo run
# the whole block eagerly). The default tiles only; absent outputs (no bias) are 0-element tensors.
def _forward_op(x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool) -> Tensor:
    return _launch_fwd(_plan(x, weight, bias, "silu" if silu else None, None), x, weight, bias)


def _backward_op(x: Tensor, weight: Tensor, bias: Tensor | None, dout: Tensor, silu: bool) -> tuple[Tensor, ...]:
    plan = _plan(x, weight, bias, "silu" if silu else None, None)
    dx, dweight, dbias = _launch_bwd(plan, x, weight, bias, _unit_last(dout))
    return dx, dweight, weight.new_empty(0) if dbias is None else dbias


_FWD_SCHEMA = "(Tensor x, Tensor w, Tensor? b, bool silu) -> Tensor"
_BWD_SCHEMA = "(Tensor x, Tensor w, Tensor? b, Tensor dout, bool silu) -> (Tensor, Tensor, Tensor)"


def _register_custom_ops() -> bool:
    """``anytrain::causal_conv1d_fwd`` / ``_bwd`` (torch >= 2.4); False where the API is missing."""
    pair = ops.define_op_pair("causal_conv1d", _forward_op, _FWD_SCHEMA, _backward_op, _BWD_SCHEMA)
    if pair is None:
        return False
    fwd_op, bwd_op = pair

    @fwd_op.register_fake
    def _(x, weight, bias, silu):
        return x.new_empty(x.shape)  # contiguous (batch, dim, L), as the kernel writes it

    @bwd_op.register_fake
    def _(x, weight, bias, dout, silu):
        return (
            torch.empty_like(x),
            torch.empty_like(weight),
            weight.new_empty(0) if bias is None else torch.empty_like(bias),
        )

    def setup_context(ctx, inputs, output):
        x, weight, bias, silu = inputs
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = silu

    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        dx, dweight, dbias = torch.ops.anytrain.causal_conv1d_bwd(x, weight, bias, dout, ctx.silu)
        return dx, dweight, None if bias is None else dbias, None

    torch.library.register_autograd("anytrain::causal_conv1d_fwd", backward, setup_context=setup_context)
    return True


HAS_CUSTOM_OP = _register_custom_ops()


@torch.compiler.disable
def _conv_eager(x: Tensor, weight: Tensor, bias: Tensor | None, plan: _Plan) -> Tensor:
    """``_CausalConv1dFn`` kept out of compiled graphs (a non-default ``config``, or no custom-op API)."""
    return _CausalConv1dFn.apply(x, weight, bias, plan)


def causal_conv1d_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    config: ConvConfig | None = None,
) -> Tensor:
    """Triton causal depthwise conv1d. x: (batch, dim, L); weight: (dim, width), width 2..4; bias: (dim,);
    activation None or "silu". ``config``: the tiles (default ``default_config(x.device)``). Inside compiled code it
    is the custom op ``anytrain::causal_conv1d_fwd`` (one node of the graph)."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    x = _unit_last(x)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    if torch.compiler.is_compiling():
        if HAS_CUSTOM_OP and config is None:
            return torch.ops.anytrain.causal_conv1d_fwd(x, weight, bias, activation == "silu")
        return _conv_eager(x, weight, bias, _plan(x, weight, bias, activation, config))
    plan = _plan(x, weight, bias, activation, config)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _CausalConv1dFn.apply(x, weight, bias, plan)
    return _launch_fwd(plan, x, weight, bias)
