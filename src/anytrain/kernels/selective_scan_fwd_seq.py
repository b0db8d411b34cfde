"""Forward kernel v4 of the Triton selective scan (``ScanConfig.fwd_impl=2``): a channel per thread, sequential.

Each thread owns one channel and holds its 16 states in registers; it walks the sequence one step at a time,
    a_n = exp2(delta A_n log2 e),  h_n = a_n h_n + delta u B_n,  y = sum_n C_n h_n,
so a step costs 5 instructions per state (one of them the ``ex2``) and nothing else: no scan over time, no cross-lane
traffic, no layout conversion. The 16 states are independent chains, which is enough instruction-level parallelism
for one warp per scheduler. Program = BLOCK_D channels (one per thread) x (group, batch).

  - u, delta and z are read as (BLOCK_D, 8) tiles (one 16-byte vector of 8 bf16 steps per thread) and split into
    their 8 steps in registers (``tl.split``); y is joined back the same way and stored as one vector;
  - B and C come from a host-made copy laid out (batch, group, L_pad, 16) in the accumulation dtype (state last,
    zero-padded to 16 states and a whole number of 8-step chunks), so the 16 values of a step are four 16-byte
    loads that every thread of the warp shares (one request each), with no mask and no conversion;
  - the (BLOCK_D, 16) state tiles are built with ``tl.join`` from (BLOCK_D, 4) tiles, which keeps all 16 in one
    thread whatever the Triton version (a (BLOCK_D, 16) load would be spread over 4 lanes by the coalescing pass);
  - the state after every 8 * SAVE steps (the backward's chunk) is stored to ``states`` (batch, dim, N, nsub), the
    format the backward kernels read; the last entry is the final state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from anytrain.kernels.selective_scan_bwd import LOG2E, _delta, _program_block, _sigmoid

NPAD = 16  # states per thread (dstate <= 16; the rest are zero)


@triton.jit
def _cols8(x):
    # (BLOCK_D, 8) tile whose 8 steps are in-thread -> its 8 columns in step order (register renaming)
    BD: tl.constexpr = x.shape[0]
    e, o = tl.split(tl.reshape(x, (BD, 2, 2, 2)))  # step bit 0
    ee, eo = tl.split(e)  # step bit 1
    oe, oo = tl.split(o)
    x0, x4 = tl.split(ee)  # step bit 2
    x2, x6 = tl.split(eo)
    x1, x5 = tl.split(oe)
    x3, x7 = tl.split(oo)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _rows8(x0, x1, x2, x3, x4, x5, x6, x7):
    # inverse of _cols8
    BD: tl.constexpr = x0.shape[0]
    e = tl.join(tl.join(x0, x4), tl.join(x2, x6))
    o = tl.join(tl.join(x1, x5), tl.join(x3, x7))
    return tl.reshape(tl.join(e, o), (BD, 8))


@triton.jit
def _join16(q0, q1, q2, q3):
    # four (BLOCK_D, 4) tiles (states 4j..4j+3 of tile j) -> one (BLOCK_D, 16) tile held by one thread per row.
    # Column p holds state 4 (p % 4) + p // 4 ... only the order's consistency matters: every (BLOCK_D, 16) tile of
    # the kernel is built (and taken apart, _split16) the same way.
    BD: tl.constexpr = q0.shape[0]
    return tl.reshape(tl.join(tl.join(q0, q1), tl.join(q2, q3)), (BD, 16))


@triton.jit
def _split16(x):
    # inverse of _join16: the four (BLOCK_D, 4) tiles
    BD: tl.constexpr = x.shape[0]
    lo, hi = tl.split(tl.reshape(x, (BD, 4, 2, 2)))
    q0, q1 = tl.split(lo)
    q2, q3 = tl.split(hi)
    return q0, q1, q2, q3


@triton.jit
def _ld16(p, four):
    # the 16 values at p + [0, 16) (p: (BLOCK_D, 1) pointers, four: (1, 4) offsets 0..3) as a _join16 tile
    return _join16(tl.load(p + four), tl.load(p + 4 + four), tl.load(p + 8 + four), tl.load(p + 12 + four))


@triton.jit
def _step(h, A2, dt, du, bc_p, four):
    # one step of every state: h = exp2(delta A log2 e) h + delta u B; returns (h, y = sum_n C h)
    Bt = _ld16(bc_p, four)
    Ct = _ld16(bc_p + 16, four)
    h = tl.exp2(dt[:, None] * A2) * h + du[:, None] * Bt
    return h, tl.sum(h * Ct, axis=1)


@triton.jit
def _store_states(p, h, four, s_sn, md, DSTATE: tl.constexpr):
    # h (BLOCK_D, 16) -> states[..., n, k] for n < DSTATE (p: (BLOCK_D, 1) pointers to n = 0 at this k)
    q0, q1, q2, q3 = _split16(h)
    tl.store(p + four * s_sn, q0, mask=md & (four < DSTATE))
    tl.store(p + (4 + four) * s_sn, q1, mask=md & (four + 4 < DSTATE))
    tl.store(p + (8 + four) * s_sn, q2, mask=md & (four + 8 < DSTATE))
    tl.store(p + (12 + four) * s_sn, q3, mask=md & (four + 12 < DSTATE))


@triton.jit(do_not_specialize=["s_sk"])
def _ss_fwd_kernel_v4(
    u_ptr, dt_ptr, A_ptr, BC_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, state_ptr,
    dpg, seqlen, nsub,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_qb, s_qg, s_zb, s_zd, s_ob, s_od, s_sn, s_sk,
    DSTATE: tl.constexpr, BLOCK_D: tl.constexpr, SAVE: tl.constexpr, STAGES: tl.constexpr, DIAG: tl.constexpr,
    ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
):  # fmt: skip
    # BC: (batch, group, L_pad, 32) in ACC: step t's B at [.., t, 0:16], its C at [.., t, 16:32] (zero-padded).
    # states: (batch, dim, N, nsub) (s_sn, s_sk the strides of N and nsub); entry k is the state after step
    # (k + 1) * 8 * SAVE - 1, the last entry the final state.
    pid_blk, g, b, dim, offs_dl, mask_d, offs_d = _program_block(dpg, BLOCK_D)
    rows = offs_d[:, None]  # (BLOCK_D, 1)
    md = mask_d[:, None]
    tt = tl.arange(0, 8)[None, :]  # (1, 8)
    four = tl.arange(0, 4)[None, :]  # (1, 4)
    u_base = u_ptr + b * s_ub + rows * s_ud
    dt_base = dt_ptr + b * s_tb + rows * s_td
    z_base = z_ptr + b * s_zb + rows * s_zd
    o_base = out_ptr + b * s_ob + rows * s_od
    bc_base = BC_ptr + b * s_qb + g * s_qg + 0 * rows  # (BLOCK_D, 1): the same address in every thread
    A_rows = A_ptr + rows * s_ad
    A2 = (
        _join16(
            tl.load(A_rows + four * s_an, mask=md & (four < DSTATE), other=0.0),
            tl.load(A_rows + (4 + four) * s_an, mask=md & (four + 4 < DSTATE), other=0.0),
            tl.load(A_rows + (8 + four) * s_an, mask=md & (four + 8 < DSTATE), other=0.0),
            tl.load(A_rows + (12 + four) * s_an, mask=md & (four + 12 < DSTATE), other=0.0),
        ).to(ACC)
        * LOG2E
    )
    Dv = 0.0
    bias = 0.0
    if HAS_D:
        Dv = tl.load(D_ptr + rows, mask=md, other=0.0).to(ACC)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=md, other=0.0).to(ACC)
    st_base = state_ptr + (b * dim + rows) * (DSTATE * s_sn)  # (BLOCK_D, 1)
    h = A2 * 0.0
    nchunks = tl.cdiv(seqlen, 8)
    for c in tl.range(0, nchunks, num_stages=STAGES):
        t = c * 8 + tt
        m = md & (t < seqlen)
        u = tl.load(u_base + t, mask=m, other=0.0).to(ACC)
        dt = _delta(tl.load(dt_base + t, mask=m, other=0.0).to(ACC), bias, m, HAS_BIAS, SOFTPLUS)
        du = dt * u
        d0, d1, d2, d3, d4, d5, d6, d7 = _cols8(dt)
        v0, v1, v2, v3, v4, v5, v6, v7 = _cols8(du)
        p = bc_base + c * (8 * 32)
        if DIAG & 4:
            p = bc_base + (c % 2) * (8 * 32)
        h, y0 = _step(h, A2, d0, v0, p, four)
        h, y1 = _step(h, A2, d1, v1, p + 32, four)
        h, y2 = _step(h, A2, d2, v2, p + 64, four)
        h, y3 = _step(h, A2, d3, v3, p + 96, four)
        h, y4 = _step(h, A2, d4, v4, p + 128, four)
        h, y5 = _step(h, A2, d5, v5, p + 160, four)
        h, y6 = _step(h, A2, d6, v6, p + 192, four)
        h, y7 = _step(h, A2, d7, v7, p + 224, four)
        y = _rows8(y0, y1, y2, y3, y4, y5, y6, y7)
        if HAS_D:
            y += u * Dv
        if HAS_Z:
            zz = tl.load(z_base + t, mask=m, other=0.0).to(ACC)
            y = y * zz * _sigmoid(zz)
        tl.store(o_base + t, y.to(out_ptr.dtype.element_ty), mask=m)
        if DIAG & 1:
            pass
        elif DIAG & 2:  # coalesced layout (batch, nsub, N, dim) for timing only
            _store_states(state_ptr + b * dim * DSTATE * s_sn + c * DSTATE * dim + rows, h, four, dim, md, DSTATE)
        elif SAVE == 1:
            _store_states(st_base + c * s_sk, h, four, s_sn, md, DSTATE)
        else:
            k = (c + 1) // SAVE - 1
            last = (c + 1) % SAVE == 0
            if c == nchunks - 1:
                k = nsub - 1
                last = True
            if last:
                _store_states(st_base + k * s_sk, h, four, s_sn, md, DSTATE)
