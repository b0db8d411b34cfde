"""Forward kernel of the Triton selective scan; see ``selective_scan_triton.py`` for the launcher.

Program = (block of BLOCK_D channels, group, batch); it walks the sequence in chunks of SEG x SUB steps held as
(channel, segment, step) tiles, t = chunk start + s * SUB + r. The global loads and stores go through
(BLOCK_D, SEG * SUB) pointers whose coalesced layout (16-byte vectors, lanes along time, warps over channels) is the
same in every Triton version; with SUB = the steps of one 16-byte vector (8 for bf16) and SEG = 32, the reshape to
(BLOCK_D, SEG, SUB) is free and puts a segment in one thread and the segments on the lanes of one warp. So:
  - a runtime loop over the states makes y = sum_n C h a register accumulation (no reduction over states);
  - per state, each segment is scanned in-thread from h = 0, the (decay product, end state) aggregates of the SEG
    segments (the chunk's carry folded into segment 0's) are combined by one cross-lane scan, and each segment's start
    state (the previous segment's end state, fetched with ``tl.gather`` one lane down) is folded in with
    hs = pa h0 + pb;
  - the state at the end of every SUB * SAVE steps (the backward's chunk) is stored to ``states`` (batch, dim, N, nsub)
    by the lane that owns it; the chunk's carry into the next chunk is re-read from there after a barrier.
The per-state B/C rows reach the state loop through Triton's software pipeliner (``STAGES``), one state per iteration
or, with ``GROUP`` > 1 (``ScanConfig.states_per_iteration``), a group of states per iteration from a chunk-major copy
of B and C that the launcher makes (one (2 GROUP, chunk) tile per group: fewer pipeline and address instructions per
state). With ``LANES`` (dstate <= SEG) A and the carry between chunks are held in lanes (lane n: state n) and
broadcast with ``tl.gather`` per state; a larger dstate loads them per state (the carry re-read from the saved states
after a barrier).
Other SUB / SEG / BLOCK_D values are correct too (the compiler then converts layouts).
"""

from __future__ import annotations

import triton
import triton.language as tl

from anytrain.kernels.selective_scan_common import (
    LOG2E,
    _chan_params,
    _combine,
    _delta,
    _gated,
    _ld2,
    _program_block,
    _widen_bf16_pairs,
)


@triton.jit
def _ld_bc(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:  # whole chunks: every step of the tile is inside the sequence (if/else: the other branch is not built)
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0)
    return x


@triton.jit
def _bc_values(x, SEG: tl.constexpr, SUB: tl.constexpr, BC_BITS: tl.constexpr, ACC: tl.constexpr):
    # one state's raw B or C row of the chunk, (1, SEG * SUB) (or int32 pairs) -> (1, SEG, SUB) in the ACC dtype
    if BC_BITS:
        return _widen_bf16_pairs(x, 1, SEG, SUB)
    else:
        return tl.reshape(x, (1, SEG, SUB)).to(ACC)


@triton.jit
def _later(x1, i1, x2, i2):
    # of two (value, step) pairs the one with the later step: associative and commutative, so a reduction with it
    # returns the last step's value in any reduction order (lanes included). Over an in-thread axis the steps are
    # constants per register and the compiler folds the choice: no arithmetic, where a masked tl.sum of the last
    # element costs an x + 0.0 (it does not fold for floats)
    later = i2 > i1
    return tl.where(later, x2, x1), tl.where(later, i2, i1)


@triton.jit
def _state_step(dt, dtu, A2, hc, B_n, C_n, y, offs_s2, prev):
    # One state over one chunk: returns y + C h and the state at the end of each segment, (BLOCK_D, SEG). A2: A log2 e
    # of the state, (BLOCK_D, SEG, 1); hc: the state before the chunk, (BLOCK_D, SEG) or (BLOCK_D, 1) (read in segment 0
    # only).
    a = tl.exp2(dt * A2)
    pa, pb = tl.associative_scan((a, dtu * B_n), axis=2, combine_fn=_combine)  # in-thread, from h = 0
    # segment aggregates, (BLOCK_D, SEG): 2-D (not keep_dims) so that no register dimension is broadcast, which
    # Triton 3.6's cross-lane scan lowering does not support
    step = tl.broadcast_to(tl.arange(0, pa.shape[2])[None, None, :], pa.shape)
    la, _ = tl.reduce((pa, step), 2, _later)
    lb, _ = tl.reduce((pb, step), 2, _later)
    # the carry folded into segment 0's end state: the cross-lane scan then yields the end states themselves, and its
    # decay products are dead after the last round (no ia hc + ib per lane: one shuffle and multiply fewer)
    lb = tl.where(offs_s2 == 0, la * hc + lb, lb)
    _, e = tl.associative_scan((la, lb), axis=1, combine_fn=_combine)  # across lanes (segments)
    h0 = tl.where(offs_s2 == 0, hc, tl.gather(e, prev, axis=1))  # state at the start of each segment
    y += (pa * h0[:, :, None] + pb) * C_n
    return y, e


@triton.jit(do_not_specialize=["s_sk"])
def _ss_fwd_kernel(
    u_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    bias_ptr,
    out_ptr,
    state_ptr,
    dpg,
    seqlen,
    nsub,
    s_ub,
    s_ud,
    s_tb,
    s_td,
    s_ad,
    s_an,
    s_bb,
    s_bg,
    s_bn,
    s_cb,
    s_cg,
    s_cn,
    s_zb,
    s_zd,
    s_ob,
    s_od,
    s_sn,
    s_sk,
    DSTATE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUB: tl.constexpr,
    SEG: tl.constexpr,
    SAVE: tl.constexpr,
    ACC: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    LANES: tl.constexpr,
    BC_BITS: tl.constexpr,
    EVEN: tl.constexpr,
    FAST: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP: tl.constexpr,
):
    # BC_BITS (bf16 B/C, even strides and seqlen; with EVEN or GROUP): B and C are loaded as int32 pairs and widened
    # to fp32 with one shift or mask per value (the bf16 -> fp32 conversion costs 1.5 instructions per value
    # otherwise). EVEN (seqlen a multiple of the chunk): the per-state B/C loads need no time mask.
    # FAST (fp32 on a GPU, set by the launcher): the gate's sigmoid with the approximate exp and division.
    # GROUP > 1 (needs LANES; B_ptr then the launcher's chunk-major B/C copy, C_ptr unused): GROUP states per
    # pipelined iteration, their B/C rows one tile.
    # states: (batch, dim, N, nsub) (s_sn, s_sk: strides of N and nsub; s_sk is 1 but not specialised, so the state
    # stores are not vectorised across segments); entry k is the state after step (k + 1) * SUB * SAVE - 1 (the last
    # entry: the final state).
    CHUNK: tl.constexpr = SUB * SEG
    KPC: tl.constexpr = SEG // SAVE  # saved states per chunk
    tl.static_assert(not LANES or DSTATE <= SEG, "LANES needs dstate <= seg (one lane per state)")
    tl.static_assert(not BC_BITS or ((EVEN or GROUP > 1) and SUB % 2 == 0), "BC_BITS: EVEN or GROUP, an even chunk")
    tl.static_assert(GROUP == 1 or (LANES and DSTATE % GROUP == 0), "GROUP needs LANES and divides DSTATE")
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
        dt = _delta(dt, bias, m3, HAS_BIAS, SOFTPLUS, not EVEN)
        dtu = dt * u
        y = tl.zeros((BLOCK_D, SEG, SUB), dtype=ACC)
        if HAS_D:
            y += u * Dv
        kc = c * KPC
        msave = save & (kc + ks < nsub)
        if GROUP > 1:  # GROUP states per pipelined iteration, their B/C rows one (2 GROUP, chunk) tile
            # B_ptr: (batch, G, nchunks, N, 2, CHUNK) from the launcher (B and C of a chunk's states side by side,
            # zero-padded to whole chunks): a group's rows are one contiguous block, loaded without a mask
            if BC_BITS:
                ROW: tl.constexpr = CHUNK // 2
                g_rows = B_base.to(tl.pointer_type(tl.int32)) + c * (DSTATE * CHUNK)
            else:
                ROW: tl.constexpr = CHUNK
                g_rows = B_base + c * (DSTATE * 2 * CHUNK)
            rid = tl.arange(0, 2 * GROUP)[:, None]
            g_rows = g_rows + rid * ROW + tl.arange(0, ROW)[None, :]  # row 2i: B of the group's state i, 2i + 1: C
            for j in tl.range(0, DSTATE // GROUP, num_stages=STAGES):
                tile = tl.load(g_rows + j * (2 * GROUP * ROW))
                for i in tl.static_range(GROUP):
                    n = j * GROUP + i
                    # the rows sit in each thread's registers: the masked sums compile to register picks
                    B_nx = tl.sum(tl.where(rid == 2 * i, tile, 0), axis=0)[None, :]
                    C_nx = tl.sum(tl.where(rid == 2 * i + 1, tile, 0), axis=0)[None, :]
                    B_n = _bc_values(B_nx, SEG, SUB, BC_BITS, ACC)
                    C_n = _bc_values(C_nx, SEG, SUB, BC_BITS, ACC)
                    A2 = tl.gather(A_l, n + 0 * lane_n, axis=1)[:, :, None]
                    hc = tl.gather(carry, n + 0 * lane_n, axis=1)
                    y, e = _state_step(dt, dtu, A2, hc, B_n, C_n, y, offs_s2, prev)
                    tl.store(st_tile + n * s_sn + (kc + ks) * s_sk, e, mask=msave)
                    carry = tl.where(lane_n == n, tl.gather(e, SEG - 1 + 0 * lane_n, axis=1), carry)
        else:
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
            # without LANES, A and the carry are loaded one state ahead (loop-carried), so their latency overlaps a
            # state's compute; the B/C rows are left to the software pipeliner
            if not LANES:
                A_nx = tl.load(A_rows, mask=mask_d, other=0.0)
                h_nx = tl.load(st_rows + (kc - 1) * s_sk, mask=mc, other=0.0)
            for n in tl.range(0, DSTATE, num_stages=STAGES):
                B_nx = _ld_bc(B_rows + n * s_bn2, mt1, EVEN)
                C_nx = _ld_bc(C_rows + n * s_cn2, mt1, EVEN)
                if LANES:
                    A2 = tl.gather(A_l, n + 0 * lane_n, axis=1)[:, :, None]  # (BLOCK_D, SEG, 1): A[d, n] in every lane
                    hc = tl.gather(carry, n + 0 * lane_n, axis=1)  # (BLOCK_D, SEG): the state before the chunk
                else:
                    A2 = A_nx.to(ACC)[:, None, None] * LOG2E
                    hc = h_nx[:, None]  # the state before the chunk
                    n1 = (n + 1) % DSTATE  # (the last state prefetches state 0 again, unused)
                    A_nx = tl.load(A_rows + n1 * s_an, mask=mask_d, other=0.0)
                    h_nx = tl.load(st_rows + n1 * s_sn + (kc - 1) * s_sk, mask=mc, other=0.0)
                B_n = _bc_values(B_nx, SEG, SUB, BC_BITS, ACC)
                C_n = _bc_values(C_nx, SEG, SUB, BC_BITS, ACC)
                y, e = _state_step(dt, dtu, A2, hc, B_n, C_n, y, offs_s2, prev)
                tl.store(st_tile + n * s_sn + (kc + ks) * s_sk, e, mask=msave)
                if LANES:  # the chunk's end state (the last lane's e) becomes lane n's carry
                    carry = tl.where(lane_n == n, tl.gather(e, SEG - 1 + 0 * lane_n, axis=1), carry)
        if HAS_Z:
            zz = _ld2(z_base + t2, m2, BLOCK_D, SEG, SUB, ACC)
            y = _gated(y, zz, FAST)
        tl.store(o_base + t2, tl.reshape(y, (BLOCK_D, CHUNK)).to(out_ptr.dtype.element_ty), mask=m2)
