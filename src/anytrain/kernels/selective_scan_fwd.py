"""Forward kernel v3 of the Triton selective scan (``ScanConfig.fwd_impl=1``, default); see ``selective_scan.py``.

Program = (block of BLOCK_D channels, group, batch); it walks the sequence in chunks of SEG x SUB steps held as
(channel, segment, step) tiles, t = chunk start + s * SUB + r. The global loads and stores go through
(BLOCK_D, SEG * SUB) pointers whose coalesced layout (16-byte vectors, lanes along time, warps over channels) is the
same in every Triton version; with SUB = the steps of one 16-byte vector (8 for bf16) and SEG = 32, the reshape to
(BLOCK_D, SEG, SUB) is free and puts a segment in one thread and the segments on the lanes of one warp. So:
  - a runtime loop over the states makes y = sum_n C h a register accumulation (no reduction over states);
  - per state, each segment is scanned in-thread from h = 0, the (decay product, end state) aggregates of the SEG
    segments are combined by one cross-lane scan, and each segment's start state (the previous segment's end state,
    fetched with ``tl.gather`` one lane down) is folded in with hs = pa h0 + pb;
  - the state at the end of every SUB * SAVE steps (the backward's chunk) is stored to ``states`` (batch, dim, N, nsub)
    by the lane that owns it; the chunk's carry into the next chunk is re-read from there after a barrier.
Other SUB / SEG / BLOCK_D values are correct too (the compiler then converts layouts).
"""

from __future__ import annotations

import triton
import triton.language as tl

from anytrain.kernels.selective_scan_bwd import (
    LOG2E,
    _chan_params,
    _combine,
    _delta,
    _join8,
    _ld2,
    _program_block,
    _rescan8,
    _sigmoid_fm,
    _split8,
)


@triton.jit
def _ld_bc(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:  # whole chunks: every step of the tile is inside the sequence (if/else: the other branch is not built)
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0)
    return x


@triton.jit
def _widen_bf16_pairs(x, SEG: tl.constexpr, SUB: tl.constexpr):
    # (1, SEG * SUB // 2) int32, each the bf16 steps 2i (low half) and 2i + 1 (high half) -> (1, SEG, SUB) fp32: a bf16
    # is the top half of the fp32 with the same value
    x = tl.reshape(x, (1, SEG, SUB // 2))
    lo = (x << 16).to(tl.float32, bitcast=True)
    hi = (x & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (1, SEG, SUB))


@triton.jit(do_not_specialize=["s_sk"])
def _ss_fwd_kernel_v3(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, state_ptr,
    dpg, seqlen, nsub,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn, s_zb, s_zd, s_ob, s_od, s_sn, s_sk,
    DSTATE: tl.constexpr, BLOCK_D: tl.constexpr, SUB: tl.constexpr, SEG: tl.constexpr, SAVE: tl.constexpr,
    ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    UNROLL: tl.constexpr = 1, LANES: tl.constexpr = False, BC_BITS: tl.constexpr = False, EVEN: tl.constexpr = False,
    FAST: tl.constexpr = False, STAGES: tl.constexpr = 0,
):  # fmt: skip
    # BC_BITS (bf16 B/C, even strides and seqlen; set with EVEN only): B and C are loaded as int32 pairs and widened
    # to fp32 with one shift or mask per value (the bf16 -> fp32 conversion costs 1.5 instructions per value
    # otherwise). EVEN (seqlen a multiple of the chunk): the per-state B/C loads need no time mask.
    # UNROLL: the state loop's unroll factor (two states' serial chains interleaved by the compiler at UNROLL 2).
    # LANES (needs DSTATE <= SEG): A and the carry between chunks are held in lanes (lane n: state n) and broadcast
    # with ``tl.gather`` per state, instead of a per-state load of A and of the carry (re-read from the saved states
    # after a barrier). Measured equal to the register prefetch on an H200 (0.688 against 0.686 ms, scan pass 7), but
    # with STAGES (below) it removes the last per-state loads: part of the CUDA default since scan pass 11. Loading B/C
    # two states ahead in registers was slower (0.787: register copies at the loop end).
    # FAST (fp32 on a GPU, set by the launcher): the gate's sigmoid with the approximate exp and division.
    # STAGES > 0: each state's B/C rows are loaded inside the state loop and left to Triton's software pipeliner with
    # ``num_stages`` = STAGES (asynchronous copies into shared memory, STAGES - 1 states ahead) instead of the
    # register prefetch one state ahead; with LANES (no per-state A/carry loads left) this is the CUDA default at 4
    # stages: 0.575 against 0.645 ms on an H200 (docs/kernels.md, scan pass 11).
    # states: (batch, dim, N, nsub) (s_sn, s_sk: strides of N and nsub; s_sk is 1 but not specialised, so the state
    # stores are not vectorised across segments); entry k is the state after step (k + 1) * SUB * SAVE - 1 (the last
    # entry: the final state).
    CHUNK: tl.constexpr = SUB * SEG
    KPC: tl.constexpr = SEG // SAVE  # saved states per chunk
    tl.static_assert(not LANES or DSTATE <= SEG, "LANES needs dstate <= seg (one lane per state)")
    tl.static_assert(not BC_BITS or (EVEN and SUB % 2 == 0), "BC_BITS needs EVEN and an even chunk")
    pid_blk, g, b, dim, offs_dl, mask_d, offs_d = _program_block(dpg, BLOCK_D)
    nchunks = tl.cdiv(seqlen, CHUNK)
    md3 = mask_d[:, None, None]
    offs_s = tl.arange(0, SEG)[None, :, None]
    tloc = offs_s * SUB + tl.arange(0, SUB)[None, None, :]  # (1, SEG, SUB) step inside the chunk
    tl2 = tl.arange(0, CHUNK)[None, :]  # the same steps, flat, for the global loads and stores
    rows = offs_d[:, None]
    offs_s2 = tl.arange(0, SEG)[None, :]
    zero = 0 * (offs_dl[:, None] + offs_s2)  # (BLOCK_D, SEG): the segment aggregates are 2-D (see below)
    u_base = u_ptr + b * s_ub + rows * s_ud
    dt_base = dt_ptr + b * s_tb + rows * s_td
    z_base = z_ptr + b * s_zb + rows * s_zd
    o_base = out_ptr + b * s_ob + rows * s_od
    B_base = B_ptr + b * s_bb + g * s_bg  # B and C: (1, CHUNK) loads, broadcast over the block's channels
    C_base = C_ptr + b * s_cb + g * s_cg
    A_rows = A_ptr + offs_d * s_ad
    st_rows = state_ptr + (b * dim + offs_d) * (DSTATE * s_sn)  # (BLOCK_D,)
    st_tile = st_rows[:, None] + zero  # (BLOCK_D, SEG)
    Dv, bias = _chan_params(D_ptr, bias_ptr, offs_d, mask_d, ACC, HAS_D, HAS_BIAS)
    # the segment that ends a saved sub-chunk ((s + 1) % SAVE == 0) stores its end state at index kc + ks
    ks = (offs_s2 + 1) // SAVE - 1
    save = mask_d[:, None] & ((offs_s2 + 1) % SAVE == 0)
    prev = tl.maximum(offs_s2 - 1, 0) + zero  # gather index: the segment one lane down
    if LANES:
        lane_n = offs_s2 + zero  # (BLOCK_D, SEG) lane index
        A_l = tl.load(A_rows[:, None] + (offs_s2 % DSTATE) * s_an, mask=mask_d[:, None] & (offs_s2 < DSTATE), other=0.0)
        A_l = A_l.to(ACC) * LOG2E
        carry = tl.zeros((BLOCK_D, SEG), dtype=ACC)  # lane n: the state n before the chunk
    for c in range(0, nchunks):
        if not LANES:
            tl.debug_barrier()  # the previous chunk's end states (stored by one lane each) before this chunk reads them
        t = c * CHUNK + tloc
        m3 = md3 & (t < seqlen)
        t2 = c * CHUNK + tl2
        m2 = mask_d[:, None] & (t2 < seqlen)
        u = _ld2(u_base + t2, m2, BLOCK_D, SEG, SUB, ACC)
        dt = _ld2(dt_base + t2, m2, BLOCK_D, SEG, SUB, ACC)
        dt = _delta(dt, bias, m3, HAS_BIAS, SOFTPLUS)
        dtu = dt * u
        y = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
        if HAS_D:
            y += u * Dv
        kc = c * KPC
        msave = save & (kc + ks < nsub)
        mc = mask_d & (offs_dl * 0 + kc > 0)
        mt1 = t2 < seqlen  # (1, CHUNK)
        if BC_BITS:  # pairs of steps: (1, CHUNK // 2) int32 offsets from the bf16 rows' (even) start
            th = tl.arange(0, CHUNK // 2)[None, :]
            mt1 = 2 * (c * (CHUNK // 2) + th) < seqlen
            B_rows = B_base.to(tl.pointer_type(tl.int32)) + c * (CHUNK // 2) + th
            C_rows = C_base.to(tl.pointer_type(tl.int32)) + c * (CHUNK // 2) + th
            s_bn2 = s_bn // 2
            s_cn2 = s_cn // 2
        else:
            B_rows = B_base + t2
            C_rows = C_base + t2
            s_bn2 = s_bn
            s_cn2 = s_cn
        # per-state loads are issued one state ahead (loop-carried), so their latency overlaps a state's compute (B/C:
        # with STAGES 0; otherwise the pipeliner issues them STAGES - 1 states ahead)
        if not LANES:
            A_nx = tl.load(A_rows, mask=mask_d, other=0.0)
            h_nx = tl.load(st_rows + (kc - 1) * s_sk, mask=mc, other=0.0)
        if STAGES == 0:
            B_nx = _ld_bc(B_rows, mt1, EVEN)
            C_nx = _ld_bc(C_rows, mt1, EVEN)
        for n in tl.range(0, DSTATE, loop_unroll_factor=UNROLL, num_stages=STAGES if STAGES > 0 else None):
            if STAGES > 0:  # this state's B/C rows, left to Triton's software pipeliner (asynchronous copies)
                B_nx = _ld_bc(B_rows + n * s_bn2, mt1, EVEN)
                C_nx = _ld_bc(C_rows + n * s_cn2, mt1, EVEN)
            if LANES:
                A2 = tl.gather(A_l, n + 0 * lane_n, axis=1)[:, :, None]  # (BLOCK_D, SEG, 1): A[d, n] in every lane
                hc = tl.gather(carry, n + 0 * lane_n, axis=1)  # (BLOCK_D, SEG): the state before the chunk
            else:
                A2 = A_nx.to(ACC)[:, None, None] * LOG2E
                hc = h_nx[:, None]  # the state before the chunk
            if BC_BITS:
                B_n = _widen_bf16_pairs(B_nx, SEG, SUB)
                C_n = _widen_bf16_pairs(C_nx, SEG, SUB)
            else:
                B_n = tl.reshape(B_nx, (1, SEG, SUB)).to(ACC)
                C_n = tl.reshape(C_nx, (1, SEG, SUB)).to(ACC)
            n1 = (n + 1) % DSTATE  # (the last state prefetches state 0 again, unused)
            if not LANES:
                A_nx = tl.load(A_rows + n1 * s_an, mask=mask_d, other=0.0)
                h_nx = tl.load(st_rows + n1 * s_sn + (kc - 1) * s_sk, mask=mc, other=0.0)
            if STAGES == 0:
                B_nx = _ld_bc(B_rows + n1 * s_bn2, mt1, EVEN)
                C_nx = _ld_bc(C_rows + n1 * s_cn2, mt1, EVEN)
            a = tl.exp2(dt * A2)
            pa, pb = tl.associative_scan((a, dtu * B_n), axis=2, combine_fn=_combine)  # in-thread, from h = 0
            # segment aggregates, (BLOCK_D, SEG): 2-D (not keep_dims) so that no register dimension is broadcast,
            # which Triton 3.6's cross-lane scan lowering does not support
            la = tl.sum(tl.where(tloc % SUB == SUB - 1, pa, 0.0), axis=2)
            lb = tl.sum(tl.where(tloc % SUB == SUB - 1, pb, 0.0), axis=2)
            ia, ib = tl.associative_scan((la, lb), axis=1, combine_fn=_combine)  # across lanes (segments)
            e = ia * hc + ib  # state at the end of each segment
            h0 = tl.where(offs_s2 == 0, hc, tl.gather(e, prev, axis=1))  # state at the start of each segment
            y += (pa * h0[:, :, None] + pb) * C_n
            tl.store(st_tile + n * s_sn + (kc + ks) * s_sk, e, mask=msave)
            if LANES:  # the chunk's end state (the last lane's e) becomes lane n's carry
                carry = tl.where(lane_n == n, tl.gather(e, SEG - 1 + 0 * lane_n, axis=1), carry)
        if HAS_Z:
            zz = _ld2(z_base + t2, m2, BLOCK_D, SEG, SUB, ACC)
            y = y * zz * _sigmoid_fm(zz, FAST)
        tl.store(o_base + t2, tl.reshape(y, (BLOCK_D, CHUNK)).to(out_ptr.dtype.element_ty), mask=m2)


# ---------------------------------------------------------------------------------------------------------------------
# Forward kernel v5 (``ScanConfig.fwd_impl=2``): state lanes, time sequential in each thread.


@triton.jit
def _bc8(base, row, tk, mask, mask_hi, EVEN: tl.constexpr, BC_BITS: tl.constexpr, HALVES: tl.constexpr,
         ACC: tl.constexpr):  # fmt: skip
    # one state row of B or C for a sub-chunk's 8 steps as a (G, BLOCK_D, 8) tile in ACC: ``base`` broadcasts the
    # (batch, group) start over the channels, ``row`` the rows' offsets (state * stride; int32 units with BC_BITS),
    # ``tk`` the steps (BC_BITS: their 4 int32 pairs; HALVES: the first 4 steps), ``mask`` (state < dstate, step <
    # seqlen; with HALVES the first half's, ``mask_hi`` the second's)
    ptrs = base + row + tk
    if HALVES:  # fp32: two 16-byte halves in one thread (an 8-wide fp32 tile would be split over two lanes)
        if EVEN:
            x0 = tl.load(ptrs)
            x1 = tl.load(ptrs + 4)
        else:
            x0 = tl.load(ptrs, mask=mask, other=0)
            x1 = tl.load(ptrs + 4, mask=mask_hi, other=0)
        x = tl.reshape(tl.permute(tl.join(x0, x1), (0, 1, 3, 2)), (x0.shape[0], x0.shape[1], 8))
    else:
        if EVEN:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=mask, other=0)
    if BC_BITS:  # bf16 pairs: step 2i in the low half, 2i + 1 in the high half (a bf16 is the top of its fp32)
        lo = (x << 16).to(tl.float32, bitcast=True)
        hi = (x & -65536).to(tl.float32, bitcast=True)
        x = tl.reshape(tl.join(lo, hi), (x.shape[0], x.shape[1], 2 * x.shape[2]))
    return x.to(ACC)


@triton.jit
def _state8(h, dl, du, A2, Bv, Cv, G: tl.constexpr, BLOCK_D: tl.constexpr):
    # one state over the sub-chunk's 8 steps, sequentially in each thread: h_r = exp2(delta_r A log2 e) h_{r-1} +
    # delta_r u_r B_r; returns the last state and the (G, BLOCK_D, 8) terms C_r h_r of y
    a = tl.exp2(dl * A2[:, :, None])
    bb = du * Bv
    a0, a1, a2, a3, a4, a5, a6, a7 = _split8(a, G, BLOCK_D)
    b0, b1, b2, b3, b4, b5, b6, b7 = _split8(bb, G, BLOCK_D)
    h0, h1, h2, h3, h4, h5, h6, h7 = _rescan8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, h)
    return h7, _join8(h0, h1, h2, h3, h4, h5, h6, h7, G, BLOCK_D) * Cv


@triton.jit
def _keep(sv, h, kk, k: tl.constexpr):
    # the saved-state buffer (G, BLOCK_D, KB) with element k (in-thread) replaced by h (G, BLOCK_D)
    return tl.where(kk == k, h[:, :, None], sv)


@triton.jit
def _store_saved(st_ptrs, sv, c, kk, nsub, mask, G: tl.constexpr, SAVE: tl.constexpr):
    # the chunk's G sub-chunk end states sv (G, BLOCK_D, G) of one in-thread state (rows ``st_ptrs``): every SAVE-th
    # sub-chunk's is the backward's saved entry (c G + k + 1) / SAVE - 1 (unit stride: one vector store with SAVE 1)
    if SAVE == 1:
        tl.store(st_ptrs + c * G + kk, sv, mask=mask & (c * G + kk < nsub))
    else:
        idx = c * G + kk + 1
        tl.store(st_ptrs + idx // SAVE - 1, sv, mask=mask & (idx % SAVE == 0) & (idx // SAVE - 1 < nsub))


@triton.jit
def _to_lanes(x, G: tl.constexpr, BLOCK_D: tl.constexpr):
    # (BLOCK_D, G * 8) coalesced tile -> (G, BLOCK_D, 8) state-lane tile (a permutation of names: no data moves)
    return tl.permute(tl.reshape(x, (BLOCK_D, G, 8)), (1, 0, 2))


@triton.jit
def _bc_tiles(
    c, k, seqlen, B_base, C_base, rb, rc, s_bn2, s_cn2, lt, ms0, ms1, ms2, ms3,
    CHUNK: tl.constexpr, SUB: tl.constexpr, S: tl.constexpr, FULL: tl.constexpr, BC_BITS: tl.constexpr,
    HALVES: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    # B and C of the thread's S states for sub-chunk k of chunk c: (G, BLOCK_D, 8) tiles B0, C0, .., B3, C3 (the
    # states past S repeat state 0's tiles, unused)
    t0 = c * CHUNK + k * SUB
    if BC_BITS:
        tk = t0 // 2 + lt
        mt = t0 + 2 * lt < seqlen
    else:
        tk = t0 + lt
        mt = t0 + lt < seqlen
    mt_hi = t0 + 4 + lt < seqlen  # (HALVES only: the second 4 steps)
    B0 = _bc8(B_base, rb, tk, ms0 & mt, ms0 & mt_hi, FULL, BC_BITS, HALVES, ACC)
    C0 = _bc8(C_base, rc, tk, ms0 & mt, ms0 & mt_hi, FULL, BC_BITS, HALVES, ACC)
    B1 = B0
    C1 = C0
    B2 = B0
    C2 = C0
    B3 = B0
    C3 = C0
    if S > 1:
        B1 = _bc8(B_base, rb + s_bn2, tk, ms1 & mt, ms1 & mt_hi, FULL, BC_BITS, HALVES, ACC)
        C1 = _bc8(C_base, rc + s_cn2, tk, ms1 & mt, ms1 & mt_hi, FULL, BC_BITS, HALVES, ACC)
    if S > 2:
        B2 = _bc8(B_base, rb + 2 * s_bn2, tk, ms2 & mt, ms2 & mt_hi, FULL, BC_BITS, HALVES, ACC)
        C2 = _bc8(C_base, rc + 2 * s_cn2, tk, ms2 & mt, ms2 & mt_hi, FULL, BC_BITS, HALVES, ACC)
        B3 = _bc8(B_base, rb + 3 * s_bn2, tk, ms3 & mt, ms3 & mt_hi, FULL, BC_BITS, HALVES, ACC)
        C3 = _bc8(C_base, rc + 3 * s_cn2, tk, ms3 & mt, ms3 & mt_hi, FULL, BC_BITS, HALVES, ACC)
    return B0, C0, B1, C1, B2, C2, B3, C3


@triton.jit
def _v5_sub(
    k, h0, h1, h2, h3, sv0, sv1, sv2, sv3, Y, dl3, du3, A0, A1, A2, A3, B0, C0, B1, C1, B2, C2, B3, C3,
    lg, l8, zrow, kk, G: tl.constexpr, BLOCK_D: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    # sub-chunk k of the v5 forward for the thread's S states (B/C tiles given): their recurrences, the saved end
    # states (element k of sv0..sv3) and y (lane group k of Y)
    if G > 1:  # sub-chunk k's delta and delta u from lane group k of each channel
        kidx = k + 0 * (lg + l8) + zrow
        dlk = tl.gather(dl3, kidx, axis=0)
        duk = tl.gather(du3, kidx, axis=0)
    else:
        dlk = dl3
        duk = du3
    h0, yk = _state8(h0, dlk, duk, A0, B0, C0, G, BLOCK_D)
    sv0 = _keep(sv0, h0, kk, k)
    if S > 1:
        h1, y1 = _state8(h1, dlk, duk, A1, B1, C1, G, BLOCK_D)
        yk += y1
        sv1 = _keep(sv1, h1, kk, k)
    if S > 2:
        h2, y2 = _state8(h2, dlk, duk, A2, B2, C2, G, BLOCK_D)
        yk += y2
        sv2 = _keep(sv2, h2, kk, k)
        h3, y3 = _state8(h3, dlk, duk, A3, B3, C3, G, BLOCK_D)
        yk += y3
        sv3 = _keep(sv3, h3, kk, k)
    if G > 1:  # y of sub-chunk k: summed over the channel's lane groups, kept by lane group k
        Y = tl.where(lg == k, tl.sum(yk, axis=0)[None, :, :], Y)
    else:
        Y = yk
    return h0, h1, h2, h3, sv0, sv1, sv2, sv3, Y


@triton.jit
def _ss_fwd_kernel_v5(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, state_ptr,
    dpg, seqlen, nsub,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn, s_zb, s_zd, s_ob, s_od, s_sn,
    DSTATE: tl.constexpr, S: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr, SAVE: tl.constexpr,
    ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BC_BITS: tl.constexpr = False, EVEN: tl.constexpr = False, FAST: tl.constexpr = False, HALVES: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, STAGES: tl.constexpr = 0,
):  # fmt: skip
    # Program = (block of BLOCK_D channels, group, batch). Thread (lane group g, channel d) owns the S states
    # g S .. g S + S - 1 of channel d (S <= 4: variables h0..h3) and walks the whole sequence in order, 8 steps at a
    # time: per state and step one exp2 and two FMAs, no scan and no cross-lane traffic in the recurrence.
    # A chunk is G sub-chunks of 8 steps. Its elementwise part (u, delta, softplus, z, D, the output) is a
    # (BLOCK_D, G * 8) tile in the coalesced layout (16-byte vectors: lane = g + G d holds sub-chunk g of channel d);
    # the state side uses (G, BLOCK_D, 8) tiles with the same lanes (B/C loads whose broadcast channel dimension comes
    # second get that order from Triton's coalescing). Each sub-chunk's delta and delta u reach the G lanes of its
    # channel by ``tl.gather`` (shuffles), and its y = sum over states comes back by a sum across those lanes, kept
    # by lane group g = the sub-chunk. B and C rows are loaded per state and sub-chunk (the same 16 bytes for the
    # block's channels). The state after every sub-chunk is kept in registers and stored once per chunk (G values
    # per state: one vector store). Needs G * S >= dstate; 8-step sub-chunks are 16-byte vectors of bf16/fp16 (fp32
    # inputs are correct but converted between layouts).
    SUB: tl.constexpr = 8
    CHUNK: tl.constexpr = G * SUB
    tl.static_assert(S == 1 or S == 2 or S == 4, "v5 holds 1, 2 or 4 states per thread")
    FULL: tl.constexpr = EVEN and DSTATE == G * S  # no state or time masks on the B/C loads
    pid_blk, g, b, dim, offs_dl, mask_d, offs_d = _program_block(dpg, BLOCK_D)
    nchunks = tl.cdiv(seqlen, CHUNK)
    md2 = mask_d[:, None]
    tl2 = tl.arange(0, CHUNK)[None, :]
    rows = offs_d[:, None]
    zrow = 0 * offs_dl[None, :, None]  # (1, BLOCK_D, 1) zeros: B/C pointers broadcast over the channels
    lg = tl.arange(0, G)[:, None, None]  # (G, 1, 1) lane group
    lg2 = tl.arange(0, G)[:, None]
    l8 = tl.arange(0, SUB)[None, None, :]
    kk = tl.arange(0, G)[None, None, :]  # (1, 1, G): sub-chunk index of the saved-state buffers
    u_base = u_ptr + b * s_ub + rows * s_ud
    dt_base = dt_ptr + b * s_tb + rows * s_td
    z_base = z_ptr + b * s_zb + rows * s_zd
    o_base = out_ptr + b * s_ob + rows * s_od
    if BC_BITS:  # B/C as int32 pairs of bf16 steps: 4 offsets per sub-chunk
        B_base = (B_ptr + b * s_bb + g * s_bg).to(tl.pointer_type(tl.int32)) + zrow
        C_base = (C_ptr + b * s_cb + g * s_cg).to(tl.pointer_type(tl.int32)) + zrow
        s_bn2 = s_bn // 2
        s_cn2 = s_cn // 2
        lt = tl.arange(0, SUB // 2)[None, None, :]
    else:
        B_base = B_ptr + b * s_bb + g * s_bg + zrow
        C_base = C_ptr + b * s_cb + g * s_cg + zrow
        s_bn2 = s_bn
        s_cn2 = s_cn
        if HALVES:  # fp32 B/C: the sub-chunk's first 4 steps (the second 4 at + 4)
            lt = tl.arange(0, SUB // 2)[None, None, :]
        else:
            lt = l8
    Dv = 0.0
    bias = 0.0
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)[:, None]
    # per in-thread state s: row n = g S + s, its mask, A (log2 units) and the saved-state rows
    n0 = lg2 * S  # (G, 1)
    A_rows = A_ptr + offs_d[None, :] * s_ad  # (1, BLOCK_D)
    md_s = mask_d[None, :]
    st_rows = state_ptr + (b * dim + offs_d)[None, :, None] * (DSTATE * s_sn) + lg * (S * s_sn)  # state g S
    mst = mask_d[None, :, None] & (lg * S < DSTATE)
    A0 = tl.load(A_rows + n0 * s_an, mask=md_s & (n0 < DSTATE), other=0.0).to(ACC) * LOG2E
    h0 = tl.zeros((G, BLOCK_D), dtype=ACC)
    A1 = A0
    A2 = A0
    A3 = A0
    h1 = h0
    h2 = h0
    h3 = h0
    if S > 1:
        A1 = tl.load(A_rows + (n0 + 1) * s_an, mask=md_s & (n0 + 1 < DSTATE), other=0.0).to(ACC) * LOG2E
    if S > 2:
        A2 = tl.load(A_rows + (n0 + 2) * s_an, mask=md_s & (n0 + 2 < DSTATE), other=0.0).to(ACC) * LOG2E
        A3 = tl.load(A_rows + (n0 + 3) * s_an, mask=md_s & (n0 + 3 < DSTATE), other=0.0).to(ACC) * LOG2E
    rb = lg * (S * s_bn2)
    rc = lg * (S * s_cn2)
    ms0 = lg * S < DSTATE  # (G, 1, 1): the lane group's in-thread states that exist
    ms1 = lg * S + 1 < DSTATE
    ms2 = lg * S + 2 < DSTATE
    ms3 = lg * S + 3 < DSTATE
    if PREFETCH:  # chunk 0's inputs and sub-chunk 0's B/C, then always one ahead (loop-carried)
        m2 = md2 & (tl2 < seqlen)
        u_nx = tl.load(u_base + tl2, mask=m2, other=0.0)
        dt_nx = tl.load(dt_base + tl2, mask=m2, other=0.0)
        z_nx = u_nx
        if HAS_Z:
            z_nx = tl.load(z_base + tl2, mask=m2, other=0.0)
        B0, C0, B1, C1, B2, C2, B3, C3 = _bc_tiles(
            0,
            0,
            seqlen,
            B_base,
            C_base,
            rb,
            rc,
            s_bn2,
            s_cn2,
            lt,
            ms0,
            ms1,
            ms2,
            ms3,
            CHUNK,
            SUB,
            S,
            FULL,
            BC_BITS,
            HALVES,
            ACC,
        )
    for c in tl.range(0, nchunks, num_stages=STAGES if STAGES > 0 else None):
        t2 = c * CHUNK + tl2
        m2 = md2 & (t2 < seqlen)
        if PREFETCH:
            u = u_nx.to(ACC)
            dt = dt_nx.to(ACC)
            zr = z_nx
            m2n = md2 & (t2 + CHUNK < seqlen)  # the next chunk's (nothing past the end)
            u_nx = tl.load(u_base + t2 + CHUNK, mask=m2n, other=0.0)
            dt_nx = tl.load(dt_base + t2 + CHUNK, mask=m2n, other=0.0)
            if HAS_Z:
                z_nx = tl.load(z_base + t2 + CHUNK, mask=m2n, other=0.0)
        else:
            u = tl.load(u_base + t2, mask=m2, other=0.0).to(ACC)
            dt = tl.load(dt_base + t2, mask=m2, other=0.0).to(ACC)
        dt = _delta(dt, bias, m2, HAS_BIAS, SOFTPLUS)
        dl3 = _to_lanes(dt, G, BLOCK_D)
        du3 = _to_lanes(dt * u, G, BLOCK_D)
        Y = tl.zeros((G, BLOCK_D, SUB), dtype=ACC)
        sv0 = tl.zeros((G, BLOCK_D, G), dtype=ACC)
        sv1 = sv0
        sv2 = sv0
        sv3 = sv0
        for k in tl.static_range(G):
            if PREFETCH:  # the next sub-chunk's B/C (the next chunk's first; the last chunk re-reads its own)
                if k + 1 < G:
                    nB0, nC0, nB1, nC1, nB2, nC2, nB3, nC3 = _bc_tiles(
                        c,
                        k + 1,
                        seqlen,
                        B_base,
                        C_base,
                        rb,
                        rc,
                        s_bn2,
                        s_cn2,
                        lt,
                        ms0,
                        ms1,
                        ms2,
                        ms3,
                        CHUNK,
                        SUB,
                        S,
                        FULL,
                        BC_BITS,
                        HALVES,
                        ACC,
                    )
                else:
                    nB0, nC0, nB1, nC1, nB2, nC2, nB3, nC3 = _bc_tiles(
                        tl.minimum(c + 1, nchunks - 1),
                        0,
                        seqlen,
                        B_base,
                        C_base,
                        rb,
                        rc,
                        s_bn2,
                        s_cn2,
                        lt,
                        ms0,
                        ms1,
                        ms2,
                        ms3,
                        CHUNK,
                        SUB,
                        S,
                        FULL,
                        BC_BITS,
                        HALVES,
                        ACC,
                    )
            else:
                B0, C0, B1, C1, B2, C2, B3, C3 = _bc_tiles(
                    c,
                    k,
                    seqlen,
                    B_base,
                    C_base,
                    rb,
                    rc,
                    s_bn2,
                    s_cn2,
                    lt,
                    ms0,
                    ms1,
                    ms2,
                    ms3,
                    CHUNK,
                    SUB,
                    S,
                    FULL,
                    BC_BITS,
                    HALVES,
                    ACC,
                )
            h0, h1, h2, h3, sv0, sv1, sv2, sv3, Y = _v5_sub(
                k, h0, h1, h2, h3, sv0, sv1, sv2, sv3, Y, dl3, du3, A0, A1, A2, A3, B0, C0, B1, C1, B2, C2, B3, C3,
                lg, l8, zrow, kk, G, BLOCK_D, S,
            )  # fmt: skip
            if PREFETCH:
                B0, C0, B1, C1, B2, C2, B3, C3 = nB0, nC0, nB1, nC1, nB2, nC2, nB3, nC3
        _store_saved(st_rows, sv0, c, kk, nsub, mst, G, SAVE)
        if S > 1:
            _store_saved(st_rows + s_sn, sv1, c, kk, nsub, mst & ms1, G, SAVE)
        if S > 2:
            _store_saved(st_rows + 2 * s_sn, sv2, c, kk, nsub, mst & ms2, G, SAVE)
            _store_saved(st_rows + 3 * s_sn, sv3, c, kk, nsub, mst & ms3, G, SAVE)
        y = tl.reshape(tl.permute(Y, (1, 0, 2)), (BLOCK_D, CHUNK))
        if HAS_D:
            y += u * Dv
        if HAS_Z:
            if PREFETCH:
                zz = zr.to(ACC)
            else:
                zz = tl.load(z_base + t2, mask=m2, other=0.0).to(ACC)
            y = y * zz * _sigmoid_fm(zz, FAST)
        tl.store(o_base + t2, y.to(out_ptr.dtype.element_ty), mask=m2)
