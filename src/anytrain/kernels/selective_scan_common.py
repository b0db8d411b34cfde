"""Triton helpers shared by the selective-scan forward (``selective_scan_fwd.py``) and backward
(``selective_scan_bwd.py``): the scan's math (softplus, sigmoid, the linear-recurrence combine), program/row
addressing, and the per-segment 8-step recurrences of the backward.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from anytrain.kernels.fastmath import fast_sigmoid

LOG2E = tl.constexpr(1.4426950408889634)  # globals read inside @triton.jit must be constexpr
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _combine(a1, b1, a2, b2):
    # (a1, b1) is earlier in scan order: h = a2 * (a1 * h0 + b1) + b2.
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _softplus(x):
    # max(x, 0) + log1p(e), e = exp(-|x|) in (0, 1]. Below fp64: log1p(e) = e q(e) with q a degree-8 polynomial fitted
    # to log1p(e) / e on (0, 1] (softplus within 2.1e-7 relative in fp32, where exp + libdevice's log give 1.7e-7;
    # exact-ratio form, so tiny e keep their relative accuracy): 9 FMAs instead of ~20 instructions and a branch.
    if x.dtype == tl.float64:  # log1p(e) = log(u) e / (u - 1), u = 1 + e (exact for e below an ulp of 1, too)
        e = tl.exp(-tl.abs(x))
        u = 1.0 + e
        return tl.maximum(x, 0.0) + tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    e = tl.exp2(-tl.abs(x) * LOG2E)
    q = 0.005185997575498875 * e - 0.029210234659302222
    q = q * e + 0.07754031022213989
    q = q * e - 0.13583934074473472
    q = q * e + 0.19055950823489196
    q = q * e - 0.24825646902804502
    q = q * e + 0.33316010356469294
    q = q * e - 0.4999925587104245
    q = q * e + 0.9999999208635986
    return tl.maximum(x, 0.0) + e * q


@triton.jit
def _softplus_grad(dt):
    # softplus'(x) = sigmoid(x) from dt = softplus(x) alone: exp(-softplus(x)) = 1 / (1 + e^x) = 1 - sigmoid(x), so
    # sigmoid(x) = -expm1(-dt): its degree-8 Taylor polynomial below 1/2 (fp64: 1/16), where 1 - exp(-dt) would cancel
    # (truncation below 1.1e-8 relative at 1/2, 7e-16 at 1/16), 1 - exp(-dt) above (exp's error over a result >= 0.39)
    small = 0.0625 if dt.dtype == tl.float64 else 0.5
    p = 1.0 / 5040.0 - dt * (1.0 / 40320.0)
    p = 1.0 / 720.0 - dt * p
    p = 1.0 / 120.0 - dt * p
    p = 1.0 / 24.0 - dt * p
    p = 1.0 / 6.0 - dt * p
    p = 0.5 - dt * p
    p = 1.0 - dt * p
    return tl.where(dt < small, dt * p, 1.0 - tl.exp2(-dt * LOG2E))


@triton.jit
def _delta(dt, bias, valid, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, MASK: tl.constexpr = True):
    # the scan's delta from the raw one: + delta_bias, softplus, and 0 on padding steps (there a = 1 and b = 0, so the
    # state passes through unchanged); bias is unused without HAS_BIAS. MASK=False (the forward's whole chunks): no
    # padding steps, and a masked channel's delta only reaches its own (unstored) states and outputs
    if HAS_BIAS:
        dt += bias
    if SOFTPLUS:
        dt = _softplus(dt)
    if MASK:
        dt = tl.where(valid, dt, 0.0)
    return dt


@triton.jit
def _sigmoid(x):
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    return tl.where(x >= 0, r, e * r)


@triton.jit
def _sigmoid_fm(x, FAST: tl.constexpr):
    # FAST (fp32 on a GPU; the launchers decide): ``fastmath.fast_sigmoid``, as in the conv kernels
    if FAST:
        return fast_sigmoid(x)
    return _sigmoid(x)


@triton.jit
def _gated(x, z, FAST: tl.constexpr):
    # x z sigmoid(z). FAST: one approximate division x z / (1 + exp(-z)), 6 instructions per value (the sigmoid's
    # 1 / (1 + e) first, then the products, took 8: a negation and the reciprocal's x 1.0 more)
    if FAST:
        return libdevice.fast_dividef(x * z, 1.0 + tl.exp2(z * -LOG2E))
    return x * z * _sigmoid(z)


@triton.jit
def _program_block(dpg, BLOCK_D: tl.constexpr):
    """The (channel block, group, batch) program of the scan kernels' grid: (pid_blk, g, b, dim, offs_dl, mask_d,
    offs_d) with offs_dl the block's channels inside the group, offs_d the same channels in the model."""
    pid_blk = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_dl = pid_blk * BLOCK_D + tl.arange(0, BLOCK_D)
    return pid_blk, g, b, dpg * tl.num_programs(1), offs_dl, offs_dl < dpg, g * dpg + offs_dl


@triton.jit
def _bc_bases(
    b, g, pid_blk, B_ptr, C_ptr, dB_ptr, dC_ptr, s_bb, s_bg, s_cb, s_cg, s_rb, s_rg, s_rk, ATOMIC: tl.constexpr
):
    """This (batch, group)'s B and C (loaded as (1, CHUNK) rows, broadcast over the block's channels) and its dB and
    dC outputs: the shared sums (ATOMIC) or this program's own partial slice (deterministic mode)."""
    B_base = B_ptr + b * s_bb + g * s_bg
    C_base = C_ptr + b * s_cb + g * s_cg
    r_base = dB_ptr + b * s_rb + g * s_rg
    rc_base = dC_ptr + b * s_rb + g * s_rg
    if not ATOMIC:
        r_base += pid_blk * s_rk
        rc_base += pid_blk * s_rk
    return B_base, C_base, r_base, rc_base


@triton.jit
def _widen_bf16_pairs(x, ROWS: tl.constexpr, SEG: tl.constexpr, SUB: tl.constexpr):
    # (ROWS, SEG * SUB // 2) int32, each the bf16 steps 2i (low half) and 2i + 1 (high half) -> (ROWS, SEG, SUB) fp32:
    # a bf16 is the top half of the fp32 with the same value, so one shift or mask per value (Triton's own bf16 -> fp32
    # takes 1.5); the forward's B/C (ROWS 1) and backward's (ROWS = its channels)
    x = tl.reshape(x, (ROWS, SEG, SUB // 2))
    lo = (x << 16).to(tl.float32, bitcast=True)
    hi = (x & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (ROWS, SEG, SUB))


@triton.jit
def _dbdc_out(r_base, rc_base, row, t, dB, dC, mask, ATOMIC: tl.constexpr, EVEN: tl.constexpr = False):
    """Add a state's dB / dC sums (state offset ``row``, steps ``t``) to the outputs (relaxed atomics), or store them
    into this program's partials. EVEN: every step is inside the sequence (no mask)."""
    if EVEN:
        if ATOMIC:
            tl.atomic_add(r_base + row + t, dB, sem="relaxed")
            tl.atomic_add(rc_base + row + t, dC, sem="relaxed")
        else:
            tl.store(r_base + row + t, dB)
            tl.store(rc_base + row + t, dC)
    elif ATOMIC:
        tl.atomic_add(r_base + row + t, dB, mask=mask, sem="relaxed")
        tl.atomic_add(rc_base + row + t, dC, mask=mask, sem="relaxed")
    else:
        tl.store(r_base + row + t, dB, mask=mask)
        tl.store(rc_base + row + t, dC, mask=mask)


@triton.jit
def _row_bases(
    b, rows, u_ptr, dt_ptr, z_ptr, dout_ptr, du_ptr, ddt_ptr, dz_ptr, s_ub, s_ud, s_tb, s_td, s_zb, s_zd, s_gb, s_gd
):
    """Pointers to this batch's ``rows`` (channel ids, any shape) of u, delta, z, dout and of du, ddelta, dz (which
    share the strides of u, delta and z)."""
    u_base = u_ptr + b * s_ub + rows * s_ud
    dt_base = dt_ptr + b * s_tb + rows * s_td
    z_base = z_ptr + b * s_zb + rows * s_zd
    go_base = dout_ptr + b * s_gb + rows * s_gd
    du_base = du_ptr + b * s_ub + rows * s_ud
    ddt_base = ddt_ptr + b * s_tb + rows * s_td
    dz_base = dz_ptr + b * s_zb + rows * s_zd
    return u_base, dt_base, z_base, go_base, du_base, ddt_base, dz_base


@triton.jit
def _ld2(ptrs, mask, BLOCK_D: tl.constexpr, SEG: tl.constexpr, SUB: tl.constexpr, ACC: tl.constexpr):
    # (BLOCK_D, SEG * SUB) load -> (BLOCK_D, SEG, SUB) tile (free when a thread's 16-byte vector is one segment)
    return tl.reshape(tl.load(ptrs, mask=mask, other=0.0), (BLOCK_D, SEG, SUB)).to(ACC)


@triton.jit
def _chan_params(D_ptr, bias_ptr, offs_d, mask_d, ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr):
    """D and delta_bias of the program's channels as (BLOCK_D, 1, 1) tiles (0.0 where the op has none)."""
    Dv = 0.0
    bias = 0.0
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)[:, None, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)[:, None, None]
    return Dv, bias


@triton.jit
def _flat_rows(
    pid_blk,
    b,
    g,
    dpg,
    dim,
    state_ptr,
    q_ptr,
    A_ptr,
    dA_ptr,
    s_sn,
    s_ad,
    DSTATE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEG: tl.constexpr,
):
    """The backward loads and store their per-state (channel, segment) tiles through flat
    (BLOCK_D * SEG,) pointers: a 1-D tensor without contiguity has one layout in every Triton version (element i on
    lane i % 32) and its reshape is the compute layout; a 2-D pointer would tie its two dimensions, which Triton
    versions break differently (3.6: a conversion through shared memory per state). Returns the flat index, the
    channel mask, each element's time segment (lanes run backwards in time), the rows of the saved states, of the
    adjoint scratch, of A and of the dA partials, and the masks of lane 0 of each channel and of the lane holding
    the chunk's first segment."""
    ii = tl.arange(0, BLOCK_D * SEG)
    i_d = pid_blk * BLOCK_D + ii // SEG  # channel (in the group) of each flat element
    i_m = i_d < dpg
    i_seg = SEG - 1 - ii % SEG
    st_flat = state_ptr + (b * dim + g * dpg + i_d) * (DSTATE * s_sn)
    q_flat = q_ptr + (b * dim + g * dpg + i_d) * (2 * DSTATE)
    A_flat = A_ptr + (g * dpg + i_d) * s_ad
    dA_flat = dA_ptr + (g * dpg + i_d) * DSTATE
    return ii, i_m, i_seg, st_flat, q_flat, A_flat, dA_flat, i_m & (i_seg == SEG - 1), i_m & (i_seg == 0)


@triton.jit
def _chunk_inputs(dt_base, go_base, z_base, u_base, t2, mask, HAS_Z: tl.constexpr):
    """A chunk's delta, dout, z (delta again when the op has no z) and u tiles as stored (loaded one chunk ahead)."""
    r_dt = tl.load(dt_base + t2, mask=mask, other=0.0)
    r_go = tl.load(go_base + t2, mask=mask, other=0.0)
    r_z = r_dt
    if HAS_Z:
        r_z = tl.load(z_base + t2, mask=mask, other=0.0)
    r_u = tl.load(u_base + t2, mask=mask, other=0.0)
    return r_dt, r_go, r_z, r_u


@triton.jit
def _chunk_epilogue(
    dt,
    dy,
    y,
    sgb,
    sahm,
    t2,
    m2,
    m3,
    Dv,
    u_base,
    go_base,
    z_base,
    du_base,
    ddt_base,
    dz_base,
    BLOCK_D: tl.constexpr,
    SEG: tl.constexpr,
    SUB: tl.constexpr,
    ACC: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    FAST: tl.constexpr,
):
    """The end of a chunk in the backward: du, ddelta and dz from the state loop's sums
    (sgb = sum_n g B, sahm = sum_n A hm in log2 units, y), stored; returns the chunk's dD and ddelta_bias partials
    (BLOCK_D,). u, dout and z are reloaded (L1/L2) instead of kept in registers through the loop, all before the first
    store (a load after a store that may alias it waits for it); softplus' comes from delta itself (no raw reload)."""
    u = _ld2(u_base + t2, m2, BLOCK_D, SEG, SUB, ACC)
    if HAS_Z:
        go = _ld2(go_base + t2, m2, BLOCK_D, SEG, SUB, ACC)
        zz = _ld2(z_base + t2, m2, BLOCK_D, SEG, SUB, ACC)
    du = dt * sgb
    if FAST:
        ddt = u * sgb + sahm * LN2  # (ln 2 = 1 / log2(e) to within its rounding: no division)
    else:
        ddt = u * sgb + sahm / LOG2E
    dD = tl.zeros((BLOCK_D,), dtype=ACC)
    if HAS_D:
        dD = tl.sum(tl.sum(dy * u, axis=2), axis=1)
        du += dy * Dv
        y += u * Dv
    if HAS_Z:
        sz = _sigmoid_fm(zz, FAST)
        dz = go * y * sz * (1.0 + zz * (1.0 - sz))
        tl.store(dz_base + t2, tl.reshape(dz, (BLOCK_D, SEG * SUB)).to(dz_base.dtype.element_ty), mask=m2)
    if SOFTPLUS:
        ddt = ddt * _softplus_grad(dt)
    ddt = tl.where(m3, ddt, 0.0)
    tl.store(du_base + t2, tl.reshape(du, (BLOCK_D, SEG * SUB)).to(du_base.dtype.element_ty), mask=m2)
    tl.store(ddt_base + t2, tl.reshape(ddt, (BLOCK_D, SEG * SUB)).to(ddt_base.dtype.element_ty), mask=m2)
    return dD, tl.sum(tl.sum(ddt, axis=2), axis=1)


@triton.jit
def _split8(x, BLOCK_D: tl.constexpr, SEG: tl.constexpr):
    # (BLOCK_D, SEG, 8) -> its 8 steps as (BLOCK_D, SEG) tensors (register renaming: the steps are in-thread)
    x_e, x_o = tl.split(tl.reshape(x, (BLOCK_D, SEG, 2, 2, 2)))  # step bit 0
    x_ee, x_eo = tl.split(x_e)  # step bit 1
    x_oe, x_oo = tl.split(x_o)
    r0, r4 = tl.split(x_ee)  # step bit 2
    r2, r6 = tl.split(x_eo)
    r1, r5 = tl.split(x_oe)
    r3, r7 = tl.split(x_oo)
    return r0, r1, r2, r3, r4, r5, r6, r7


@triton.jit
def _join8(r0, r1, r2, r3, r4, r5, r6, r7, BLOCK_D: tl.constexpr, SEG: tl.constexpr):
    # inverse of _split8
    x_e = tl.join(tl.join(r0, r4), tl.join(r2, r6))
    x_o = tl.join(tl.join(r1, r5), tl.join(r3, r7))
    return tl.reshape(tl.join(x_e, x_o), (BLOCK_D, SEG, 8))


@triton.jit
def _rescan8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, h):
    # the 8 states of a segment from the state h before it: h_r = a_r h_{r-1} + b_r (in-thread, sequential)
    h0 = a0 * h + b0
    h1 = a1 * h0 + b1
    h2 = a2 * h1 + b2
    h3 = a3 * h2 + b3
    h4 = a4 * h3 + b4
    h5 = a5 * h4 + b5
    h6 = a6 * h5 + b6
    h7 = a7 * h6 + b7
    return h0, h1, h2, h3, h4, h5, h6, h7


@triton.jit
def _adjoint8(a1, a2, a3, a4, a5, a6, a7, w0, w1, w2, w3, w4, w5, w6, w7, x):
    # the adjoints of a segment's 8 steps, g_r = w_r + a_{r+1} g_{r+1}, from x entering at its end (g_7 = w_7 + x)
    g7 = w7 + x
    g6 = w6 + a7 * g7
    g5 = w5 + a6 * g6
    g4 = w4 + a5 * g5
    g3 = w3 + a4 * g4
    g2 = w2 + a3 * g3
    g1 = w1 + a2 * g2
    g0 = w0 + a1 * g1
    return g0, g1, g2, g3, g4, g5, g6, g7


@triton.jit
def _store_dA_lane0(hm, dt, dA_flat, off, first_lane, BLOCK_D: tl.constexpr, SEG: tl.constexpr):
    # this state's dA partial of each channel (sum over its steps and segments), stored from the channel's first lane
    # through the flat (BLOCK_D * SEG,) tile
    dA_n = tl.sum(tl.sum(hm * dt, axis=2), axis=1)  # (BLOCK_D,)
    dA_t = tl.reshape(tl.broadcast_to(dA_n[:, None], (BLOCK_D, SEG)), (BLOCK_D * SEG,))
    tl.store(dA_flat + off, dA_t, mask=first_lane)
