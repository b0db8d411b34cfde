"""Backward kernel v5 of the Triton selective scan (``ScanConfig.bwd_impl=4``); see ``selective_scan.py``.

v4 (``selective_scan_bwd.py``) gives each lane a segment of 8 steps, one 16-byte bf16 vector. With 2 channels per
program that is 255 registers (8 warps per SM) and the kernel is latency bound; with 1 channel it is bound by its
dB/dC atomics. v5 gives each lane a segment of SUB = 4 steps, so 2 channels cost about the registers of v4's one, while
the forward keeps saving the state every 8 steps:

  - the global loads and stores use (BLOCK_D, CHUNK) pointers whose offsets are built as
    ``(SEG - 1 - j // SUB) * (SUB * one) + j % SUB`` with ``one`` a runtime 1 (not specialised): the compiler sees
    runs of SUB contiguous elements only, so a lane's vector is SUB elements (8 bytes in bf16, 16 in fp32) and the
    reshape to (BLOCK_D, SEG, SUB) puts one segment in one thread and the segments on the lanes, in every Triton
    version;
  - the segments are lane-reversed (lane p holds the time segment SEG - 1 - p): the adjoint, a reverse-time scan, is
    then a forward cross-lane scan without lane-reversing gathers;
  - the dB/dC tile (summed over the block's channels) is already in the coalesced layout of a 4-wide fp32 vector
    atomic (lane p: 16 contiguous bytes, the warp: 512), so no values cross lanes for the atomics (v4 ``flat_bwd``
    moved them with 16 shuffles per state);
  - a segment that starts half-way between two saved states (every other one) takes its start state from the
    previous segment's end: every lane rescans its 4 steps once from the saved state of its pair, the odd segments
    take the even neighbour's end state (one ``tl.gather``), and the second rescan produces the states.
"""

from __future__ import annotations

import triton
import triton.language as tl

from anytrain.kernels.selective_scan_bwd import (
    LOG2E,
    _bc_bases,
    _chan_params,
    _chunk_epilogue,
    _chunk_inputs,
    _combine,
    _dbdc_out,
    _delta,
    _flat_rows,
    _program_block,
    _row_bases,
    _sigmoid_fm,
    _store_dA_lane0,
)


@triton.jit
def _split4(x, BLOCK_D: tl.constexpr, SEG: tl.constexpr):
    # (BLOCK_D, SEG, 4) -> its 4 steps as (BLOCK_D, SEG) tensors (register renaming: the steps are in-thread)
    x_e, x_o = tl.split(tl.reshape(x, (BLOCK_D, SEG, 2, 2)))  # step bit 0
    r0, r2 = tl.split(x_e)  # step bit 1
    r1, r3 = tl.split(x_o)
    return r0, r1, r2, r3


@triton.jit
def _join4(r0, r1, r2, r3, BLOCK_D: tl.constexpr, SEG: tl.constexpr):
    # inverse of _split4
    return tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_D, SEG, 4))


@triton.jit
def _ld4(ptrs, mask, BLOCK_D: tl.constexpr, SEG: tl.constexpr, ACC: tl.constexpr):
    return tl.reshape(tl.load(ptrs, mask=mask, other=0.0), (BLOCK_D, SEG, 4)).to(ACC)


@triton.jit(do_not_specialize=["s_sk", "one"])
def _ss_bwd_kernel_v5(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, state_ptr, dout_ptr,
    du_ptr, ddt_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dbias_ptr, q_ptr,
    dpg, seqlen, nsub,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn, s_zb, s_zd, s_gb, s_gd,
    s_rb, s_rg, s_rk, s_rn, s_sn, s_sk, one,
    DSTATE: tl.constexpr, BLOCK_D: tl.constexpr, SEG: tl.constexpr, ACC: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, ATOMIC: tl.constexpr,
    DBDC: tl.constexpr = True, BC_TILE: tl.constexpr = False, LATE: tl.constexpr = False, PIPE: tl.constexpr = False,
    LANES: tl.constexpr = False, FAST: tl.constexpr = False,
):  # fmt: skip
    # Arguments and outputs as _ss_bwd_kernel_v4, plus ``one`` (= 1, see the module docstring). The saved states are
    # every 8 steps: entry k is the state after step 8 (k + 1) - 1. dA: (batch, nchunks, dim, N) per-chunk partials
    # with chunks of 4 * SEG steps. (DBDC=False skips dB/dC: a timing diagnostic of bench/mamba_kernels.py only.)
    # Several warps (num_warps_bwd > 1) take BLOCK_D / num_warps channels each (the loads' layout puts channels on
    # warps); their dB/dC tiles are summed across warps (shared memory) before the atomics, and B/C are then loaded as
    # full (BLOCK_D, CHUNK) tiles (BC_TILE: zero channel stride, L1 hits) so that they need no layout conversion.
    # LATE: the per-state loads of the saved state and the adjoint carry are issued after the current values' last use
    # (a prefetch into a register still in use costs a register copy that waits for the load). PIPE: the next chunk's
    # delta, dout, z and u are loaded before this chunk's epilogue (one memory latency per chunk instead of two).
    # LANES (needs DSTATE <= SEG): A and the adjoint carry between chunks are held in lanes (lane n: state n) and
    # broadcast with ``tl.gather``, instead of per-state loads and the scratch ``q`` (no barrier).
    tl.static_assert(SEG % 2 == 0, "bwd_impl 4 needs an even seg_bwd")
    tl.static_assert(not LANES or DSTATE <= SEG, "LANES needs dstate <= seg_bwd (one lane per state)")
    SUB: tl.constexpr = 4
    CHUNK: tl.constexpr = SUB * SEG
    pid_blk, g, b, dim, offs_dl, mask_d, offs_d = _program_block(dpg, BLOCK_D)
    nchunks = tl.cdiv(seqlen, CHUNK)
    md3 = mask_d[:, None, None]
    jj = tl.arange(0, CHUNK)
    # (CHUNK,) step in the chunk, lane-reversed, built directly (contiguity through a reshape is lost in some Triton
    # versions) with runs of SUB contiguous steps: the loads' vectors, and lane p's 4-wide fp32 dB/dC atomic covering
    # its segment's 16 bytes (the warp's 512 contiguous bytes)
    tf0 = (SEG - 1 - jj // SUB) * (SUB * one) + jj % SUB
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
    # per-state (channel, segment) tiles through flat pointers (see _flat_rows)
    ii, i_m, i_seg, st_flat, q_flat, A_flat, dA_flat, first_lane, last = _flat_rows(
        pid_blk, b, g, dpg, dim, state_ptr, q_ptr, A_ptr, dA_ptr, s_sn, s_ad, DSTATE, BLOCK_D, SEG
    )
    seg_t = SEG - 1 - offs_p  # (1, SEG) time segment of each lane
    odd = (seg_t % 2) == 1  # segments that start between two saved states
    up = tl.minimum(offs_p + 1, SEG - 1) + 0 * rows  # gather index: the lane of the previous time segment
    down = tl.maximum(offs_p - 1, 0) + 0 * rows  # gather index: the lane of the next time segment
    dD_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    if LANES:
        lane2 = offs_p + 0 * rows  # (BLOCK_D, SEG) lane index
        lane_f = ii % SEG
        A_l = tl.load(A_flat + (lane_f % DSTATE) * s_an, mask=i_m & (lane_f < DSTATE), other=0.0)
        A_l = tl.reshape(A_l, (BLOCK_D, SEG)).to(ACC) * LOG2E
        q_l = tl.zeros((BLOCK_D, SEG), dtype=ACC)  # lane n: state n's carry from the later chunk
    if PIPE:  # the first (last in time) chunk's inputs
        t2p = (nchunks - 1) * CHUNK + tl2
        r_dt, r_go, r_z, r_u = _chunk_inputs(
            dt_base, go_base, z_base, u_base, t2p, mask_d[:, None] & (t2p < seqlen), HAS_Z
        )
    for cc in range(0, nchunks):
        c = nchunks - 1 - cc
        if not LANES:
            tl.debug_barrier()  # the previous chunk's q stores (one thread each) before this chunk's loads (all)
        t = c * CHUNK + tloc
        m3 = md3 & (t < seqlen)
        t2 = c * CHUNK + tl2
        m2 = mask_d[:, None] & (t2 < seqlen)
        if PIPE:
            dt = tl.reshape(r_dt, (BLOCK_D, SEG, 4)).to(ACC)
            dy = tl.reshape(r_go, (BLOCK_D, SEG, 4)).to(ACC)
            if HAS_Z:
                zz = tl.reshape(r_z, (BLOCK_D, SEG, 4)).to(ACC)
            uu = tl.reshape(r_u, (BLOCK_D, SEG, 4)).to(ACC)
        else:
            dt = _ld4(dt_base + t2, m2, BLOCK_D, SEG, ACC)
            dy = _ld4(go_base + t2, m2, BLOCK_D, SEG, ACC)
            if HAS_Z:
                zz = _ld4(z_base + t2, m2, BLOCK_D, SEG, ACC)
            uu = _ld4(u_base + t2, m2, BLOCK_D, SEG, ACC)
        dt = _delta(dt, bias, m3, HAS_BIAS, SOFTPLUS)
        if HAS_Z:
            dy = dy * zz * _sigmoid_fm(zz, FAST)
        dtu = dt * uu
        y = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
        sgb = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)  # sum_n g B
        sahm = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)  # sum_n A hm (A in log2 units)
        q_in = q_flat + ((c + 1) % 2) * DSTATE  # double-buffered carry: the later chunk's, and this chunk's
        q_out = q_flat + (c % 2) * DSTATE
        k = c * (SEG // 2) + i_seg // 2 - 1  # (BLOCK_D * SEG,) the saved state before each pair of segments
        mk = i_m & (k >= 0) & (k < nsub)  # pairs past seqlen: no saved state (h0 = 0)
        st_k = st_flat + k * s_sk
        mq = i_m & (ii * 0 + c < nchunks - 1)
        mt1 = t2 < seqlen  # (1, CHUNK)
        if BC_TILE:
            tb = t2 + 0 * rows  # (BLOCK_D, CHUNK)
            mt1 = mt1 & (rows >= 0)
        else:
            tb = t2
        tf = c * CHUNK + tf0
        mf = tf < seqlen
        # per-state loads are issued one state ahead (loop-carried), so their latency overlaps a state's compute
        if not LANES:
            A_nx = tl.load(A_flat, mask=i_m, other=0.0)
            q_nx = tl.load(q_in, mask=mq, other=0.0)
        B_nx = tl.load(B_base + tb, mask=mt1, other=0.0)
        C_nx = tl.load(C_base + tb, mask=mt1, other=0.0)
        h_nx = tl.load(st_k, mask=mk, other=0.0)
        for n in range(0, DSTATE):
            if LANES:
                A2 = tl.gather(A_l, n + 0 * lane2, axis=1)[:, :, None]
                q = tl.gather(q_l, n + 0 * lane2, axis=1)  # x_0 of the next chunk's first segment
            else:
                A2 = tl.reshape(A_nx, (BLOCK_D, SEG)).to(ACC)[:, :, None] * LOG2E
                q = tl.reshape(q_nx, (BLOCK_D, SEG))  # x_0 of the next chunk's first segment
            B_n = tl.reshape(B_nx, (BLOCK_D if BC_TILE else 1, SEG, SUB)).to(ACC)
            C_n = tl.reshape(C_nx, (BLOCK_D if BC_TILE else 1, SEG, SUB)).to(ACC)
            hp = tl.reshape(h_nx, (BLOCK_D, SEG))  # the saved state before each pair of segments
            n1 = (n + 1) % DSTATE  # (the last state prefetches the first one again, unused)
            if not LANES:
                A_nx = tl.load(A_flat + n1 * s_an, mask=i_m, other=0.0)
            B_nx = tl.load(B_base + n1 * s_bn + tb, mask=mt1, other=0.0)
            C_nx = tl.load(C_base + n1 * s_cn + tb, mask=mt1, other=0.0)
            if not LATE:
                h_nx = tl.load(st_k + n1 * s_sn, mask=mk, other=0.0)
                if not LANES:
                    q_nx = tl.load(q_in + n1, mask=mq, other=0.0)
            a = tl.exp2(dt * A2)
            bu = dtu * B_n
            a0, a1, a2, a3 = _split4(a, BLOCK_D, SEG)
            b0, b1, b2, b3 = _split4(bu, BLOCK_D, SEG)
            w0, w1, w2, w3 = _split4(C_n * dy, BLOCK_D, SEG)
            # start states: even segments from the saved state, odd ones from the even neighbour's end state
            e = a3 * (a2 * (a1 * (a0 * hp + b0) + b1) + b2) + b3
            h = tl.where(odd, tl.gather(e, up, axis=1), hp)
            if LATE:
                h_nx = tl.load(st_k + n1 * s_sn, mask=mk, other=0.0)
            h0 = a0 * h + b0
            h1 = a1 * h0 + b1
            h2 = a2 * h1 + b2
            h3 = a3 * h2 + b3
            hs = _join4(h0, h1, h2, h3, BLOCK_D, SEG)
            y += hs * C_n
            # adjoint g_r = w_r + x_{r+1} with x_r = a_r g_r. Per segment x_0 = sa * (x entering at its end) + sg; the
            # segments are linked by one forward cross-lane scan (lanes run backwards in time), the next chunk's
            # carry q entering at lane 0
            sg = a0 * (w0 + a1 * (w1 + a2 * (w2 + a3 * w3)))
            sa = (a0 * a1) * (a2 * a3)
            sg = tl.where(offs_p == 0, sg + sa * q, sg)
            _, xf = tl.associative_scan((sa, sg), axis=1, combine_fn=_combine)  # xf: x_0 of each segment
            # the carry for the previous chunk: x_0 of its first segment
            if LANES:
                q_l = tl.where(lane2 == n, tl.gather(xf, SEG - 1 + 0 * lane2, axis=1), q_l)
            else:
                tl.store(q_out + n, tl.reshape(xf, (BLOCK_D * SEG,)), mask=last)
            x = tl.where(offs_p == 0, q, tl.gather(xf, down, axis=1))
            if LATE and not LANES:
                q_nx = tl.load(q_in + n1, mask=mq, other=0.0)
            g3 = w3 + x
            g2 = w2 + a3 * g3
            g1 = w1 + a2 * g2
            g0 = w0 + a1 * g1
            gs = _join4(g0, g1, g2, g3, BLOCK_D, SEG)
            hm = gs * (hs - bu)  # g_t exp(delta_t A) h_{t-1}
            sgb += gs * B_n
            sahm += hm * A2
            _store_dA_lane0(hm, dt, dA_flat, (b * nchunks + c) * dim * DSTATE + n, first_lane, BLOCK_D, SEG)
            if DBDC:  # sums over this block's channels; (SEG, 4) is already the 4-wide atomics' layout
                dBf = tl.reshape(tl.sum(gs * dtu, axis=0), (CHUNK,))
                dCf = tl.reshape(tl.sum(hs * dy, axis=0), (CHUNK,))
                _dbdc_out(r_base, rc_base, n * s_rn, tf, dBf, dCf, mf, ATOMIC)
        if PIPE:  # the next chunk's inputs (none past the first chunk), issued before this chunk's reloads
            t2n = (c - 1) * CHUNK + tl2
            m2n = mask_d[:, None] & (t2n < seqlen) & (t2n >= 0)
            r_dt, r_go, r_z, r_u = _chunk_inputs(dt_base, go_base, z_base, u_base, t2n, m2n, HAS_Z)
        dD_c, dbias_c = _chunk_epilogue(
            dt, dy, y, sgb, sahm, t2, m2, m3, Dv, u_base, go_base, z_base, du_base, ddt_base, dz_base,
            BLOCK_D, SEG, SUB, ACC, HAS_D, HAS_Z, SOFTPLUS, FAST
        )  # fmt: skip
        if HAS_D:
            dD_acc += dD_c
        dbias_acc += dbias_c
    tl.store(dD_ptr + b * dim + offs_d, dD_acc, mask=mask_d)
    tl.store(dbias_ptr + b * dim + offs_d, dbias_acc, mask=mask_d)
