"""Triton causal depthwise conv1d (width 2-4) with optional SiLU, forward and backward.

The kernels read the weight (dim, width) in place as 4 taps, the missing leading taps masked to zero, so one kernel
serves every width: out_t = bias + sum_{k<4} w4[k] x_{t-3+k}. The forward's programs own (BLOCK_D channels, BLOCK_T
timesteps) tiles; the shifted x tiles are re-read through L1/L2, so DRAM sees x once and out once (the memory floor).

Backward (v3) recomputes the pre-activation instead of saving it (only x is kept): dx_t = sum_j w4[3-j] dpre_{t+j}
with dpre_s = dout_s * silu'(pre_s), pre_s recomputed from x_{s-3..s} (7 sigmoids per 4 outputs). One program per
channel block loops over every (batch, time block) and accumulates dweight/dbias in registers, so it writes the final
dweight/dbias itself: one launch, no partial buffers, no torch reduction, deterministic. Only when dim / block_d_bwd
gives fewer than ``min_programs_bwd`` programs is the loop split over more programs, whose per-split partials torch
sums (still deterministic).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from anytrain import hardware
from anytrain.kernels import _make_callable
from anytrain.kernels.fastmath import fast_math_ok, fast_sigmoid

_TAPS = 4
TAPS = tl.constexpr(_TAPS)  # globals read inside @triton.jit must be constexpr


@dataclass(frozen=True)
class ConvConfig:
    block_d: int = 2
    block_t: int = 1024
    num_warps: int = 4
    block_d_bwd: int = 1
    block_t_bwd: int = 1024
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

    def __post_init__(self) -> None:  # every path (the public op, the fused mixer, ANYTRAIN_CONV_CONFIG) builds one
        if self.slots_bwd not in (4, 8) or self.block_t_bwd < self.slots_bwd:
            raise ValueError(f"ConvConfig: slots_bwd must be 4 or 8 and at most block_t_bwd ({self.block_t_bwd}), "
                             f"got {self.slots_bwd}")  # fmt: skip


_VENDOR_CONFIGS = {  # CUDA: fastest GPU time of the H200 sweeps (bench/results/mamba_kernels_nvidia-h200_conv8.json)
    hardware.CUDA: ConvConfig(slots_bwd=8),  # backward 0.075 ms of GPU time (twelfth session; runs of 4: +18% in 7th)
    hardware.ROCM: ConvConfig(block_d_bwd=2),  # not run; 64-wide wavefronts: 8+ elements per lane either way
    hardware.CPU: ConvConfig(block_d=2, block_t=8, num_warps=1, block_d_bwd=2, block_t_bwd=8, num_warps_bwd=1),
}


def default_config() -> ConvConfig:
    """Per-vendor tiles; env ANYTRAIN_CONV_CONFIG="block_d,block_t,warps,block_d_bwd,block_t_bwd,warps_bwd" with
    optional 7th-9th values, min_programs_bwd, stages_bwd and slots_bwd."""
    env = os.environ.get("ANYTRAIN_CONV_CONFIG")
    if env:
        return ConvConfig(*(int(v) for v in env.split(",")))
    return _VENDOR_CONFIGS[hardware.vendor()]


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
def _load_taps(w_ptr, offs_d, mask_d, s_wd, s_ww, PADW: tl.constexpr, ACC: tl.constexpr):
    # the weight (dim, width) as 4 taps (BLOCK_D, 1) each, zero-padded in front: tap k is weight[:, k - PADW]
    w0 = tl.load(w_ptr + offs_d * s_wd + (0 - PADW) * s_ww, mask=mask_d & (PADW <= 0), other=0.0).to(ACC)[:, None]
    w1 = tl.load(w_ptr + offs_d * s_wd + (1 - PADW) * s_ww, mask=mask_d & (PADW <= 1), other=0.0).to(ACC)[:, None]
    w2 = tl.load(w_ptr + offs_d * s_wd + (2 - PADW) * s_ww, mask=mask_d & (PADW <= 2), other=0.0).to(ACC)[:, None]
    w3 = tl.load(w_ptr + offs_d * s_wd + (3 - PADW) * s_ww, mask=mask_d, other=0.0).to(ACC)[:, None]
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
def _store_dw_db(dw_ptr, db_ptr, row, mask_d, acc0, acc1, acc2, acc3, accb, PADW: tl.constexpr,
                 HAS_BIAS: tl.constexpr):  # fmt: skip
    # the backward's per-thread tap / bias sums, reduced over time and written to row ``row`` of dw (., width) / db
    width = 4 - PADW
    if PADW <= 0:
        tl.store(dw_ptr + row * width + (0 - PADW), tl.sum(acc0, axis=1), mask=mask_d)
    if PADW <= 1:
        tl.store(dw_ptr + row * width + (1 - PADW), tl.sum(acc1, axis=1), mask=mask_d)
    if PADW <= 2:
        tl.store(dw_ptr + row * width + (2 - PADW), tl.sum(acc2, axis=1), mask=mask_d)
    tl.store(dw_ptr + row * width + (3 - PADW), tl.sum(acc3, axis=1), mask=mask_d)
    if HAS_BIAS:
        tl.store(db_ptr + row, tl.sum(accb, axis=1), mask=mask_d)


@triton.jit
def _conv_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, dim, seqlen, s_xb, s_xd, s_ob, s_od, s_wd, s_ww,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, PADW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    # Time is tiled as (BLOCK_T // 4 blocks, 4 slots): every load is an aligned vector of 4 (this block and the
    # previous one), and the 3 shifted taps are picked from the slots in registers (no misaligned scalar loads).
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    j = pid_t * (BLOCK_T // 4) + tl.arange(0, BLOCK_T // 4)
    x_rows = x_ptr + b * s_xb + offs_d * s_xd
    w0, w1, w2, w3 = _load_taps(w_ptr, offs_d, mask_d, s_wd, s_ww, PADW, ACC)
    bias = _bias_col(bias_ptr, offs_d, mask_d, HAS_BIAS, BLOCK_D, ACC)
    x0, x1, x2, x3 = _split4(_load4(x_rows, j, mask_d, seqlen, ACC, EVEN))
    _, p1, p2, p3 = _split4(_load4(x_rows, j - 1, mask_d, seqlen, ACC, EVEN))
    o0, o1, o2, o3 = _conv4(w0, w1, w2, w3, bias, p1, p2, p3, x0, x1, x2, x3)
    out = _join4(o0, o1, o2, o3)
    if SILU:
        out = out * _sigmoid(out, SILU == 2)
    tt = 4 * j[:, None] + tl.arange(0, 4)[None, :]
    o_rows = out_ptr + b * s_ob + offs_d * s_od
    tl.store(o_rows[:, None, None] + tt[None, :, :], out.to(out_ptr.dtype.element_ty),
             mask=_time_mask(j, mask_d, seqlen, EVEN))  # fmt: skip


@triton.jit
def _conv_bwd_kernel(
    x_ptr, w_ptr, bias_ptr, dout_ptr, dx_ptr, dw_ptr, db_ptr, dim, seqlen, n_tblocks, n_iters, iters_per_program,
    s_xb, s_xd, s_gb, s_gd, s_db, s_dd, s_wd, s_ww,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, PADW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr = None,
):  # fmt: skip
    # Program (channel block, split s) walks iterations [s * iters_per_program, (s + 1) * iters_per_program) of the
    # flattened (batch, time block) space; dweight/dbias accumulate elementwise in registers and are reduced and
    # written once: dw (n_splits, dim, width) and db (n_splits, dim), final when there is one split.
    # dpre_s = dout_s * act'(pre_s) is formed for this block's 4 slots and for slots 0-2 of the next block
    # (7 sigmoids per 4 outputs); dx_t = w3 dpre_t + w2 dpre_{t+1} + w1 dpre_{t+2} + w0 dpre_{t+3}.
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    w0, w1, w2, w3 = _load_taps(w_ptr, offs_d, mask_d, s_wd, s_ww, PADW, ACC)
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
        tl.store(dx_rows[:, None, None] + tt[None, :, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=_time_mask(j, mask_d, seqlen, EVEN))  # fmt: skip
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
    return tl.load(rows[:, None, None] + (start[:, None] + r)[None, :, :], mask=mask_d[:, None, None] & ok[None, :, :],
                   other=0)  # fmt: skip


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
    x_ptr, w_ptr, bias_ptr, dout_ptr, dx_ptr, dw_ptr, db_ptr, dim, seqlen, n_tblocks, n_iters, iters_per_program,
    s_xb, s_xd, s_gb, s_gd, s_db, s_dd, s_wd, s_ww,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, PADW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ACC: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr = None,
):  # fmt: skip
    # _conv_bwd_kernel with runs of 8 timesteps per thread (ConvConfig.slots_bwd = 8): time is tiled as (BLOCK_T // 8
    # runs, 8 slots); the 3 timesteps before a run come from the previous aligned block of 4 and the 3 after it from
    # the next one. EVEN: seqlen % 8 == 0. The (batch, time block) of an iteration and the row pointers are carried
    # from one iteration to the next (recomputing them with a division cost ~40 instructions per 8 outputs).
    pid_d = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    w0, w1, w2, w3 = _load_taps(w_ptr, offs_d, mask_d, s_wd, s_ww, PADW, ACC)
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
        tl.store(dx_rows[:, None, None] + tt[None, :, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=_time_mask(jl + t0 // 8, mask_d, seqlen, EVEN, 8))  # fmt: skip
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


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _acc(*tensors: Tensor | None) -> tuple[torch.dtype, tl.dtype]:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64, tl.float64
    return torch.float32, tl.float32


def _bwd_splits(cfg: ConvConfig, dim: int, n_iters: int) -> tuple[int, int]:
    """(splits, iterations per program) of the backward: one program per channel block over all (batch, time
    blocks) when that already gives ``cfg.min_programs_bwd`` programs (no partials, no reduction launch); otherwise
    the iterations are split so that about that many programs run, and torch sums the per-split dweight/dbias."""
    d_blocks = triton.cdiv(dim, cfg.block_d_bwd)
    splits = max(1, min(n_iters, triton.cdiv(cfg.min_programs_bwd, d_blocks)))
    per = triton.cdiv(n_iters, splits)
    return triton.cdiv(n_iters, per), per


def _silu_mode(silu: bool, x: Tensor, acc) -> int:
    """The kernels' SILU constexpr: 0 none, 1 SiLU, 2 SiLU with the fast fp32 sigmoid (GPU tensors, not under the
    Triton interpreter, which has no libdevice)."""
    if not silu:
        return 0
    return 2 if fast_math_ok(x, acc == tl.float32) else 1


def _fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool, cfg: ConvConfig, *, out: Tensor | None = None
) -> Tensor:
    """Launch the forward: ``out`` = conv(x) (+ SiLU), (batch, dim, L). x and out: any batch/channel strides, unit
    stride in time (out defaults to a new contiguous tensor; it must not overlap x); bias: unit stride or None."""
    batch, dim, seqlen = x.shape
    if out is None:
        out = torch.empty((batch, dim, seqlen), device=x.device, dtype=x.dtype)
    _, acc = _acc(x, weight, bias)
    grid = (triton.cdiv(seqlen, cfg.block_t), triton.cdiv(dim, cfg.block_d), batch)
    _conv_fwd_kernel[grid](
        x, weight, bias if bias is not None else weight, out, dim, seqlen,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), weight.stride(0), weight.stride(1),
        BLOCK_D=cfg.block_d, BLOCK_T=cfg.block_t, PADW=_TAPS - weight.shape[1], HAS_BIAS=bias is not None,
        SILU=_silu_mode(silu, x, acc), ACC=acc, EVEN=seqlen % 4 == 0,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def _bwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, dout: Tensor, silu: bool, cfg: ConvConfig
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Launch the backward of ``_fwd``: dx (``empty_like(x)``: x's layout when x is dense), dweight and dbias (None
    without bias) in the parameters' dtypes. x, dout: any batch/channel strides, unit stride in time."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    acc_t, acc = _acc(x, weight, bias)
    n_tblocks = triton.cdiv(seqlen, cfg.block_t_bwd)
    splits, per = _bwd_splits(cfg, dim, batch * n_tblocks)
    dx = torch.empty_like(x)
    dw = torch.empty((splits, dim, width), device=x.device, dtype=acc_t)
    db = torch.empty((splits, dim), device=x.device, dtype=acc_t) if bias is not None else dw
    grid = (triton.cdiv(dim, cfg.block_d_bwd), splits)
    eight = cfg.slots_bwd == 8
    (_conv_bwd8_kernel if eight else _conv_bwd_kernel)[grid](
        x, weight, bias if bias is not None else weight, dout, dx, dw, db, dim, seqlen, n_tblocks,
        batch * n_tblocks, per,
        x.stride(0), x.stride(1), dout.stride(0), dout.stride(1), dx.stride(0), dx.stride(1),
        weight.stride(0), weight.stride(1),
        BLOCK_D=cfg.block_d_bwd, BLOCK_T=cfg.block_t_bwd, PADW=_TAPS - width, HAS_BIAS=bias is not None,
        SILU=_silu_mode(silu, x, acc), ACC=acc, EVEN=seqlen % (8 if eight else 4) == 0, STAGES=cfg.stages_bwd or None,
        num_warps=cfg.num_warps_bwd,
    )  # fmt: skip
    dweight = dw[0] if splits == 1 else dw.sum(0)
    dbias = None if bias is None else (db[0] if splits == 1 else db.sum(0))
    dweight = dweight.to(weight.dtype)  # no-ops for fp32 parameters (the training case)
    dbias = None if dbias is None else dbias.to(bias.dtype)
    return dx, dweight, dbias


class _CausalConv1dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, silu, cfg):
        out = _fwd(x, weight, bias, silu, cfg)
        ctx.save_for_backward(x, weight, bias)
        ctx.silu, ctx.cfg = silu, cfg
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        dx, dweight, dbias = _bwd(x, weight, bias, _unit_last(dout), ctx.silu, ctx.cfg)
        return dx, dweight, dbias, None, None


def causal_conv1d_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    config: ConvConfig | None = None,
) -> Tensor:
    """Triton causal depthwise conv1d. x: (batch, dim, L); weight: (dim, width), width 2..4; bias: (dim,)."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"causal_conv1d: bad shapes x {tuple(x.shape)} weight {tuple(weight.shape)}")
    if not 2 <= weight.shape[1] <= _TAPS:
        raise ValueError(f"causal_conv1d: width must be 2..{_TAPS}, got {weight.shape[1]}")
    cfg = config or default_config()
    for cfg_t in cfg.block_t, cfg.block_t_bwd:
        if cfg_t < 4 or cfg_t & (cfg_t - 1):
            raise ValueError(f"ConvConfig: block_t must be a power of 2 >= 4, got {cfg_t}")
    x = _unit_last(x)
    bias = None if bias is None else bias.contiguous()
    return _CausalConv1dFn.apply(x, weight, bias, activation == "silu", config or default_config())


_make_callable(__name__)  # this module's package attribute also acts as the public op (see kernels/__init__.py)
