"""Backward kernel v7 of the Triton selective scan (``ScanConfig.bwd_impl=6``); see ``selective_scan.py``.

v6's algorithm and layout (one channel per thread, 8-step segments, the program's 2 channels on the two 16-lane groups
of a warp) with ONE loop over (chunk, state) pairs instead of a chunk loop around a state loop, so that Triton's
software pipeliner streams each state's B/C rows and saved states (asynchronous copies into shared memory,
``STAGES`` - 1 states ahead) across chunk boundaries too. In v6 the per-state loads were a register prefetch one
state ahead, whose loop-carried copy waited for the load at the end of every state (Nsight Compute, H100: 28% of the
kernel's stall samples on that one instruction); pipelining v6's own state loop removed most of it but left the
pipeline's prologue, one exposed memory latency at every chunk start. Here the chunk's start (its inputs, prefetched
in registers during the previous chunk's epilogue) and its end (du / ddelta / dz) are branches of the loop body on
the state index.
"""

from __future__ import annotations

import triton
import triton.language as tl

from anytrain.kernels.selective_scan_bwd import (
    LOG2E,
    _adjoint8,
    _bc_bases,
    _chan_params,
    _chunk_epilogue,
    _chunk_inputs,
    _combine,
    _dbdc_out,
    _delta,
    _flat_rows,
    _join8,
    _program_block,
    _rescan8,
    _row_bases,
    _sigmoid_fm,
    _split8,
    _store_dA_lane0,
)
from anytrain.kernels.selective_scan_bwd_v6 import _pair_sum4


@triton.jit(do_not_specialize=["s_sk", "one"])
def _ss_bwd_kernel_v7(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, state_ptr, dout_ptr,
    du_ptr, ddt_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dbias_ptr, q_ptr,
    dpg, seqlen, nsub,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn, s_zb, s_zd, s_gb, s_gd,
    s_rb, s_rg, s_rk, s_rn, s_sn, s_sk, one,
    DSTATE: tl.constexpr, BLOCK_D: tl.constexpr, SEG: tl.constexpr, ACC: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, ATOMIC: tl.constexpr,
    DBDC: tl.constexpr = True, FAST: tl.constexpr = False, STAGES: tl.constexpr = 3,
):  # fmt: skip
    # Arguments and outputs as _ss_bwd_kernel_v6 (q_ptr unused: the adjoint carry is held in lanes, which needs
    # DSTATE <= SEG). STAGES: the pipeliner's num_stages for the per-state loads (0: loads issued where used).
    tl.static_assert(DSTATE <= SEG, "bwd_impl 6 needs dstate <= seg_bwd (one lane per state)")
    SUB: tl.constexpr = 8
    CHUNK: tl.constexpr = SUB * SEG
    pid_blk, g, b, dim, offs_dl, mask_d, offs_d = _program_block(dpg, BLOCK_D)
    nchunks = tl.cdiv(seqlen, CHUNK)
    md3 = mask_d[:, None, None]
    jj = tl.arange(0, CHUNK)
    tf0 = (SEG - 1 - jj // SUB) * (SUB * one) + jj % SUB  # lane-reversed steps, runs of 8 (see v5)
    tl2 = tf0[None, :]  # (1, CHUNK)
    tloc = tl.reshape(tl2, (1, SEG, SUB))
    offs_p = tl.arange(0, SEG)[None, :]  # (1, SEG) lane p = time segment SEG - 1 - p
    rows = offs_d[:, None]
    Dv, bias = _chan_params(D_ptr, bias_ptr, offs_d, mask_d, ACC, HAS_D, HAS_BIAS)
    u_base, dt_base, z_base, go_base, du_base, ddt_base, dz_base = _row_bases(
        b, rows, u_ptr, dt_ptr, z_ptr, dout_ptr, du_ptr, ddt_ptr, dz_ptr, s_ub, s_ud, s_tb, s_td, s_zb, s_zd, s_gb, s_gd
    )
    B_base, C_base, r_base, rc_base = _bc_bases(b, g, pid_blk, B_ptr, C_ptr, dB_ptr, dC_ptr, s_bb, s_bg, s_cb, s_cg,
                                                s_rb, s_rg, s_rk, ATOMIC)  # fmt: skip
    ii, i_m, i_seg, st_flat, q_flat, A_flat, dA_flat, first_lane, last = _flat_rows(
        pid_blk, b, g, dpg, dim, state_ptr, q_ptr, A_ptr, dA_ptr, s_sn, s_ad, DSTATE, BLOCK_D, SEG
    )
    down = tl.maximum(offs_p - 1, 0) + 0 * rows  # gather index: the lane of the next time segment
    PAIR: tl.constexpr = BLOCK_D == 2
    if PAIR:  # dB/dC: channel 1's lanes keep steps 4-7 of the channel sum (see v6)
        second = (tl.arange(0, BLOCK_D)[:, None] + 0 * offs_p) == 1
        partner = (ii + SEG) % (2 * SEG)
        iq = tl.arange(0, BLOCK_D * SEG * 4)
        tfr = (SEG - 1 - (iq // 4) % SEG) * (SUB * one) + (iq // (4 * SEG)) * (4 * one) + iq % 4
    else:
        tfr = tf0
    tb0 = tl2 + 0 * rows  # B/C as (BLOCK_D, CHUNK) tiles (zero channel stride): the compute layout
    lane2 = offs_p + 0 * rows
    lane_f = ii % SEG
    A_l = tl.load(A_flat + (lane_f % DSTATE) * s_an, mask=i_m & (lane_f < DSTATE), other=0.0)
    A_l = tl.reshape(A_l, (BLOCK_D, SEG)).to(ACC) * LOG2E
    q_l = tl.zeros((BLOCK_D, SEG), dtype=ACC)  # lane n: state n's adjoint carry from the later chunk
    dD_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    t2p = (nchunks - 1) * CHUNK + tl2
    r_dt, r_go, r_z, r_u = _chunk_inputs(dt_base, go_base, z_base, u_base, t2p, mask_d[:, None] & (t2p < seqlen), HAS_Z)
    # loop-carried per-chunk values, set at each chunk's first state
    dt = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
    dy = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
    dtu = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
    y = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
    sgb = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)  # sum_n g B
    sahm = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)  # sum_n A hm (A in log2 units)
    for it in tl.range(0, nchunks * DSTATE, num_stages=STAGES if STAGES > 0 else None):
        n = it % DSTATE
        c = nchunks - 1 - it // DSTATE
        t2 = c * CHUNK + tl2
        # this state's B/C rows and the saved state before each segment (the pipeliner's asynchronous copies)
        mt1 = (t2 < seqlen) & (rows >= 0)
        B_n = tl.reshape(tl.load(B_base + n * s_bn + c * CHUNK + tb0, mask=mt1, other=0.0), (BLOCK_D, SEG, SUB))
        C_n = tl.reshape(tl.load(C_base + n * s_cn + c * CHUNK + tb0, mask=mt1, other=0.0), (BLOCK_D, SEG, SUB))
        k = c * SEG + i_seg - 1
        hp = tl.load(st_flat + k * s_sk + n * s_sn, mask=i_m & (k >= 0) & (k < nsub), other=0.0)
        B_n = B_n.to(ACC)
        C_n = C_n.to(ACC)
        hp = tl.reshape(hp, (BLOCK_D, SEG))
        if n == 0:  # the chunk's inputs (loaded during the previous chunk's end) and fresh sums
            m3 = md3 & (c * CHUNK + tloc < seqlen)
            dt = _delta(tl.reshape(r_dt, (BLOCK_D, SEG, SUB)).to(ACC), bias, m3, HAS_BIAS, SOFTPLUS)
            dy = tl.reshape(r_go, (BLOCK_D, SEG, SUB)).to(ACC)
            if HAS_Z:
                zz = tl.reshape(r_z, (BLOCK_D, SEG, SUB)).to(ACC)
                dy = dy * zz * _sigmoid_fm(zz, FAST)
            dtu = dt * tl.reshape(r_u, (BLOCK_D, SEG, SUB)).to(ACC)
            y = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
            sgb = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
            sahm = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
        A2 = tl.gather(A_l, n + 0 * lane2, axis=1)[:, :, None]
        q = tl.gather(q_l, n + 0 * lane2, axis=1)
        a = tl.exp2(dt * A2)
        bu = dtu * B_n
        a0, a1, a2, a3, a4, a5, a6, a7 = _split8(a, BLOCK_D, SEG)
        b0, b1, b2, b3, b4, b5, b6, b7 = _split8(bu, BLOCK_D, SEG)
        w0, w1, w2, w3, w4, w5, w6, w7 = _split8(C_n * dy, BLOCK_D, SEG)
        h0, h1, h2, h3, h4, h5, h6, h7 = _rescan8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, hp)
        hs = _join8(h0, h1, h2, h3, h4, h5, h6, h7, BLOCK_D, SEG)
        y += hs * C_n
        # the adjoint as in v6: per-segment maps linked by one forward cross-lane scan, the carry q at lane 0
        sg = a0 * (w0 + a1 * (w1 + a2 * (w2 + a3 * (w3 + a4 * (w4 + a5 * (w5 + a6 * (w6 + a7 * w7)))))))
        sa = ((a0 * a1) * (a2 * a3)) * ((a4 * a5) * (a6 * a7))
        sg = tl.where(offs_p == 0, sg + sa * q, sg)
        _, xf = tl.associative_scan((sa, sg), axis=1, combine_fn=_combine)
        q_l = tl.where(lane2 == n, tl.gather(xf, SEG - 1 + 0 * lane2, axis=1), q_l)
        x = tl.where(offs_p == 0, q, tl.gather(xf, down, axis=1))
        g0, g1, g2, g3, g4, g5, g6, g7 = _adjoint8(a1, a2, a3, a4, a5, a6, a7, w0, w1, w2, w3, w4, w5, w6, w7, x)
        gs = _join8(g0, g1, g2, g3, g4, g5, g6, g7, BLOCK_D, SEG)
        hm = gs * (hs - bu)  # g_t exp(delta_t A) h_{t-1}
        sgb += gs * B_n
        sahm += hm * A2
        _store_dA_lane0(hm, dt, dA_flat, (b * nchunks + c) * dim * DSTATE + n, first_lane, BLOCK_D, SEG)
        if DBDC:
            tf = c * CHUNK + tfr
            if PAIR:
                u0, u1, u2, u3, u4, u5, u6, u7 = _split8(dtu, BLOCK_D, SEG)
                y0, y1, y2, y3, y4, y5, y6, y7 = _split8(dy, BLOCK_D, SEG)
                dBf = _pair_sum4(g0 * u0, g1 * u1, g2 * u2, g3 * u3, g4 * u4, g5 * u5, g6 * u6, g7 * u7,
                                 partner, second, BLOCK_D, SEG)  # fmt: skip
                dCf = _pair_sum4(h0 * y0, h1 * y1, h2 * y2, h3 * y3, h4 * y4, h5 * y5, h6 * y6, h7 * y7,
                                 partner, second, BLOCK_D, SEG)  # fmt: skip
            else:
                dBf = tl.reshape(tl.sum(gs * dtu, axis=0), (CHUNK,))
                dCf = tl.reshape(tl.sum(hs * dy, axis=0), (CHUNK,))
            _dbdc_out(r_base, rc_base, n * s_rn, tf, dBf, dCf, tf < seqlen, ATOMIC)
        if n == DSTATE - 1:  # the chunk's end: the next chunk's inputs first, then du / ddelta / dz
            t2n = (c - 1) * CHUNK + tl2
            m2n = mask_d[:, None] & (t2n < seqlen) & (t2n >= 0)
            r_dt, r_go, r_z, r_u = _chunk_inputs(dt_base, go_base, z_base, u_base, t2n, m2n, HAS_Z)
            m3 = md3 & (c * CHUNK + tloc < seqlen)
            dD_c, dbias_c = _chunk_epilogue(
                dt, dy, y, sgb, sahm, t2, mask_d[:, None] & (t2 < seqlen), m3, Dv, bias, u_base, go_base, z_base,
                dt_base, du_base, ddt_base, dz_base, BLOCK_D, SEG, SUB, ACC, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, FAST
            )  # fmt: skip
            if HAS_D:
                dD_acc += dD_c
            dbias_acc += dbias_c
    tl.store(dD_ptr + b * dim + offs_d, dD_acc, mask=mask_d)
    tl.store(dbias_ptr + b * dim + offs_d, dbias_acc, mask=mask_d)
