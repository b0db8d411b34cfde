"""Backward kernels of the Triton selective scan (see ``selective_scan.py`` for the math and the saved state).

``_ss_bwd_kernel_v3`` (``bwd_impl=2``, default): state loop over (step, channel, segment) tiles.
``_ss_bwd_kernel_v1`` (``bwd_impl=0``): the first kernel, lane-parallel scans over (channel, state, time) tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # globals read inside @triton.jit must be constexpr


@triton.jit
def _combine(a1, b1, a2, b2):
    # (a1, b1) is earlier in scan order: h = a2 * (a1 * h0 + b1) + b2.
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _softplus(x):
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _sigmoid(x):
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    return tl.where(x >= 0, r, e * r)


@triton.jit
def _combine_adj(a2, b2, c2, d2, a1, b1, c1, d1):
    # Reverse-time adjoint scan. Each element maps x = s_{t+1} to (s_t, g_t) = (a x + b, c x + d); the first argument
    # is the already-combined later part, the second the earlier element: compose earlier o later.
    return a1 * a2, a1 * b2 + b1, c1 * a2, c1 * b2 + d1


@triton.jit
def _ss_bwd_kernel_v1(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, state_ptr, dout_ptr,
    du_ptr, ddt_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dbias_ptr,
    dpg, seqlen, nchunks,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn, s_zb, s_zd, s_gb, s_gd,
    s_rb, s_rg, s_rk, s_rn,
    DSTATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, ACC: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, ATOMIC: tl.constexpr,
):  # fmt: skip
    # v1 layout: (channel, state, time) tiles, tl.associative_scan across lanes over time; the adjoint's shifted
    # exp(delta_{t+1} A) comes from a second, shifted load of delta. Same arguments and outputs as _ss_bwd_kernel.
    # du/ddt/dz: (batch, dim, L) with the strides of u/delta/z (s_gb/s_gd: dout's). dB/dC: (batch, G, K, N, L) ACC
    # where K = 1 (atomic) or the number of channel blocks (s_rk, deterministic partials). dA: (batch, dim, N) partials;
    # dD, dbias: (batch, dim) partials.
    pid_blk = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    dim = dpg * tl.num_programs(1)
    offs_dl = pid_blk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_dl < dpg
    offs_d = g * dpg + offs_dl
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < DSTATE
    offs_t = tl.arange(0, CHUNK)
    mask_dn = mask_d[:, None] & mask_n[None, :]

    A = tl.load(A_ptr + offs_d[:, None] * s_ad + offs_n[None, :] * s_an, mask=mask_dn, other=0.0).to(ACC)
    A2 = A * LOG2E
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)
    u_base = u_ptr + b * s_ub + offs_d[:, None] * s_ud
    dt_base = dt_ptr + b * s_tb + offs_d[:, None] * s_td
    z_base = z_ptr + b * s_zb + offs_d[:, None] * s_zd
    go_base = dout_ptr + b * s_gb + offs_d[:, None] * s_gd
    du_base = du_ptr + b * s_ub + offs_d[:, None] * s_ud
    ddt_base = ddt_ptr + b * s_tb + offs_d[:, None] * s_td
    dz_base = dz_ptr + b * s_zb + offs_d[:, None] * s_zd
    B_base = B_ptr + b * s_bb + g * s_bg + offs_n[:, None] * s_bn
    C_base = C_ptr + b * s_cb + g * s_cg + offs_n[:, None] * s_cn
    r_off = b * s_rb + g * s_rg + offs_n[:, None] * s_rn
    if not ATOMIC:
        r_off += pid_blk * s_rk
    st_base = state_ptr + ((b * dim + offs_d[:, None]) * nchunks) * DSTATE + offs_n[None, :]

    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)
    dD_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    q_next = tl.zeros((BLOCK_D, BLOCK_N), dtype=ACC)  # exp(delta_{t+1} A) g_{t+1} at the next chunk's first step
    for cc in range(0, nchunks):
        c = nchunks - 1 - cc
        t = c * CHUNK + offs_t
        mask_t = t < seqlen
        m2 = mask_d[:, None] & mask_t[None, :]
        mnt = mask_n[:, None] & mask_t[None, :]
        h0 = tl.load(st_base + tl.maximum(c - 1, 0) * DSTATE, mask=mask_dn, other=0.0)  # state before the chunk
        h0 = tl.where(c > 0, h0, 0.0)
        u = tl.load(u_base + t[None, :], mask=m2, other=0.0).to(ACC)
        dt_raw = tl.load(dt_base + t[None, :], mask=m2, other=0.0).to(ACC)
        if HAS_BIAS:
            dt_raw += bias[:, None]
        dt = dt_raw
        if SOFTPLUS:
            dt = _softplus(dt_raw)
        dt = tl.where(m2, dt, 0.0)
        # delta at t+1 (same chunk only; the chunk's last step gets its successor through q_next)
        t1 = t + 1
        m1 = mask_d[:, None] & ((offs_t < CHUNK - 1) & (t1 < seqlen))[None, :]
        dt1 = tl.load(dt_base + t1[None, :], mask=m1, other=0.0).to(ACC)
        if HAS_BIAS:
            dt1 += bias[:, None]
        if SOFTPLUS:
            dt1 = _softplus(dt1)
        dt1 = tl.where(m1, dt1, 0.0)
        Bt = tl.load(B_base + t[None, :], mask=mnt, other=0.0).to(ACC)
        Ct = tl.load(C_base + t[None, :], mask=mnt, other=0.0).to(ACC)
        dy = tl.load(go_base + t[None, :], mask=m2, other=0.0).to(ACC)

        # recompute the chunk's forward states
        dA = tl.exp2(dt[:, None, :] * A2[:, :, None])  # (BLOCK_D, BLOCK_N, CHUNK)
        dtu = dt * u
        dBu = dtu[:, None, :] * Bt[None, :, :]
        pa, pb = tl.associative_scan((dA, dBu), axis=2, combine_fn=_combine)
        hs = pa * h0[:, :, None] + pb
        if HAS_Z:
            zz = tl.load(z_base + t[None, :], mask=m2, other=0.0).to(ACC)
            y = tl.sum(hs * Ct[None, :, :], axis=1)
            if HAS_D:
                y += u * Dv[:, None]
            sz = _sigmoid(zz)
            dz = dy * y * sz * (1.0 + zz * (1.0 - sz))
            tl.store(dz_base + t[None, :], dz.to(dz_ptr.dtype.element_ty), mask=m2)
            dy = dy * zz * sz
        du = tl.zeros((BLOCK_D, CHUNK), dtype=ACC)
        if HAS_D:
            dD_acc += tl.sum(dy * u, axis=1)
            du = dy * Dv[:, None]

        # adjoint recurrence, reverse in time: g_t = exp(delta_{t+1} A) g_{t+1} + C_t dy_t
        dA1 = tl.exp2(dt1[:, None, :] * A2[:, :, None])
        rhs = Ct[None, :, :] * dy[:, None, :] + tl.where(offs_t[None, None, :] == CHUNK - 1, q_next[:, :, None], 0.0)
        _, gs = tl.associative_scan((dA1, rhs), axis=2, combine_fn=_combine, reverse=True)
        q_next = tl.sum(tl.where(offs_t[None, None, :] == 0, dA * gs, 0.0), axis=2)

        sgb = tl.sum(gs * Bt[None, :, :], axis=1)  # (BLOCK_D, CHUNK)
        hm = gs * (hs - dBu)  # g_t * exp(delta_t A) * h_{t-1}
        du += dt * sgb
        ddt = u * sgb + tl.sum(hm * A[:, :, None], axis=1)
        dA_acc += tl.sum(hm * dt[:, None, :], axis=2)
        if SOFTPLUS:
            ddt = ddt * _sigmoid(dt_raw)
        ddt = tl.where(m2, ddt, 0.0)
        dbias_acc += tl.sum(ddt, axis=1)
        tl.store(du_base + t[None, :], du.to(du_ptr.dtype.element_ty), mask=m2)
        tl.store(ddt_base + t[None, :], ddt.to(ddt_ptr.dtype.element_ty), mask=m2)

        dBc = tl.sum(gs * dtu[:, None, :], axis=0)  # (BLOCK_N, CHUNK), reduced over this block's channels
        dCc = tl.sum(hs * dy[:, None, :], axis=0)
        if ATOMIC:
            tl.atomic_add(dB_ptr + r_off + t[None, :], dBc, mask=mnt, sem="relaxed")
            tl.atomic_add(dC_ptr + r_off + t[None, :], dCc, mask=mnt, sem="relaxed")
        else:
            tl.store(dB_ptr + r_off + t[None, :], dBc, mask=mnt)
            tl.store(dC_ptr + r_off + t[None, :], dCc, mask=mnt)

    tl.store(dA_ptr + (b * dim + offs_d[:, None]) * DSTATE + offs_n[None, :], dA_acc, mask=mask_dn)
    tl.store(dD_ptr + b * dim + offs_d, dD_acc, mask=mask_d)
    tl.store(dbias_ptr + b * dim + offs_d, dbias_acc, mask=mask_d)


@triton.jit
def _ss_bwd_kernel_v3(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, state_ptr, dout_ptr,
    du_ptr, ddt_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dbias_ptr, q_ptr,
    dpg, seqlen, nsub,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn, s_zb, s_zd, s_gb, s_gd,
    s_rb, s_rg, s_rk, s_rn,
    DSTATE: tl.constexpr, BLOCK_D: tl.constexpr, SUB: tl.constexpr, SEG: tl.constexpr, ACC: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, ATOMIC: tl.constexpr,
):  # fmt: skip
    # State loop over (SUB, BLOCK_D, SEG) tiles: a chunk is SEG segments of SUB steps, t = chunk start + s * SUB + r.
    # The default layout puts lanes on segments, warps on channels and a segment's SUB steps inside one thread, so:
    #  - the runtime loop over states makes the sums over states (y, sum_n g B, sum_n A hm) register accumulations;
    #  - each segment's h_t is rescanned in-thread from the state the forward saved at its start (every SUB steps);
    #  - the adjoint g_t = a_{t+1} g_{t+1} + C_t dy_t (a_{t+1} from a shifted delta load) is an in-thread reverse
    #    scan per segment plus one cross-lane scan over segment aggregates; a_0 g_0 goes to the previous chunk through
    #    the double-buffered scratch q (batch, dim, 2, N);
    #  - dB/dC sum over the block's channels across warps (shared memory), not lanes.
    # dA: (batch, nchunks, dim, N) per-chunk partials; dD, dbias: (batch, dim); dB/dC: (batch, G, K, N, L).
    CHUNK = SUB * SEG
    pid_blk = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    dim = dpg * tl.num_programs(1)
    nchunks = tl.cdiv(seqlen, CHUNK)
    offs_dl = pid_blk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_dl < dpg
    offs_d = g * dpg + offs_dl
    md3 = mask_d[None, :, None]
    offs_r = tl.arange(0, SUB)[:, None, None]
    offs_s = tl.arange(0, SEG)
    tloc = offs_s[None, None, :] * SUB + offs_r  # (SUB, 1, SEG) step inside the chunk
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)[None, :, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)[None, :, None]
    rows = offs_d[None, :, None]
    u_base = u_ptr + b * s_ub + rows * s_ud  # (1, BLOCK_D, 1)
    dt_base = dt_ptr + b * s_tb + rows * s_td
    z_base = z_ptr + b * s_zb + rows * s_zd
    go_base = dout_ptr + b * s_gb + rows * s_gd
    du_base = du_ptr + b * s_ub + rows * s_ud
    ddt_base = ddt_ptr + b * s_tb + rows * s_td
    dz_base = dz_ptr + b * s_zb + rows * s_zd
    B_base = B_ptr + b * s_bb + g * s_bg
    C_base = C_ptr + b * s_cb + g * s_cg
    r_base = b * s_rb + g * s_rg
    if not ATOMIC:
        r_base += pid_blk * s_rk
    A_rows = A_ptr + offs_d * s_ad  # (BLOCK_D,)
    st_rows = state_ptr + ((b * dim + offs_d) * nsub * DSTATE)[:, None]  # (BLOCK_D, 1)
    q_rows = q_ptr + (b * dim + offs_d) * (2 * DSTATE)
    first = mask_d[:, None] & (offs_s == 0)[None, :]
    zrow = 0 * rows
    dD_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=ACC)
    for cc in range(0, nchunks):
        c = nchunks - 1 - cc
        cvec = c + 0 * offs_dl  # (BLOCK_D,) copy of c for masks
        tl.debug_barrier()  # the previous chunk's q stores (one thread each) before this chunk's loads (all threads)
        t = c * CHUNK + tloc
        m3 = md3 & (t < seqlen)
        u = tl.load(u_base + t, mask=m3, other=0.0).to(ACC)
        dt = tl.load(dt_base + t, mask=m3, other=0.0).to(ACC)
        if HAS_BIAS:
            dt += bias
        if SOFTPLUS:
            dt = _softplus(dt)
        dt = tl.where(m3, dt, 0.0)
        m1 = md3 & ((tloc < CHUNK - 1) & (t + 1 < seqlen))  # delta at t+1 inside the chunk
        dt1 = tl.load(dt_base + t + 1, mask=m1, other=0.0).to(ACC)
        if HAS_BIAS:
            dt1 += bias
        if SOFTPLUS:
            dt1 = _softplus(dt1)
        dt1 = tl.where(m1, dt1, 0.0)
        dy = tl.load(go_base + t, mask=m3, other=0.0).to(ACC)
        if HAS_Z:
            zz = tl.load(z_base + t, mask=m3, other=0.0).to(ACC)
            dy = dy * zz * _sigmoid(zz)
        dtu = dt * u
        y = tl.zeros((SUB, BLOCK_D, SEG), dtype=ACC)
        sgb = tl.zeros((SUB, BLOCK_D, SEG), dtype=ACC)  # sum_n g B
        sahm = tl.zeros((SUB, BLOCK_D, SEG), dtype=ACC)  # sum_n A hm
        q_in = q_rows + ((c + 1) % 2) * DSTATE
        q_out = q_rows + (c % 2) * DSTATE
        k = c * SEG + offs_s[None, :] - 1  # (1, SEG) index of the saved state before each segment
        mk = mask_d[:, None] & (k >= 0) & (k < nsub)  # segments past seqlen: no saved state (h0 = 0)
        for n in range(0, DSTATE):
            A2_n = tl.load(A_rows + n * s_an, mask=mask_d, other=0.0).to(ACC)[None, :, None] * LOG2E
            # full-tile loads (the same B/C for every channel, served by L1) keep the tiles' layout the same as u's
            B_n = tl.load(B_base + n * s_bn + t + zrow, mask=m3, other=0.0).to(ACC)
            C_n = tl.load(C_base + n * s_cn + t + zrow, mask=m3, other=0.0).to(ACC)
            h0 = tl.load(st_rows + k * DSTATE + n, mask=mk, other=0.0)[None, :, :]  # (1, BLOCK_D, SEG)
            q = tl.load(q_in + n, mask=mask_d & (cvec < nchunks - 1), other=0.0)[None, :, None]
            a = tl.exp2(dt * A2_n)
            bu = dtu * B_n
            pa, pb = tl.associative_scan((a, bu), axis=0, combine_fn=_combine)  # in-thread
            hs = pa * h0 + pb
            y += hs * C_n
            a1 = tl.exp2(dt1 * A2_n)
            rhs = C_n * dy + tl.where(tloc == CHUNK - 1, q, 0.0)
            ra, rg = tl.associative_scan((a1, rhs), axis=0, combine_fn=_combine, reverse=True)  # in-thread
            # per-segment maps x -> g at the segment's first step; exclusive reverse scan over segments (lanes)
            sa = tl.sum(tl.where(offs_r == 0, ra, 0.0), axis=0)  # (BLOCK_D, SEG)
            sg = tl.sum(tl.where(offs_r == 0, rg, 0.0), axis=0)
            one = tl.full(sa.shape, 1.0, ACC)
            zero = tl.zeros(sa.shape, ACC)
            _, _, _, gnext = tl.associative_scan((sa, sg, one, zero), axis=1, combine_fn=_combine_adj, reverse=True)
            gs = ra * gnext[None, :, :] + rg
            qv = tl.sum(tl.where(offs_r == 0, a * gs, 0.0), axis=0)  # (BLOCK_D, SEG): a g at each segment start
            tl.store(q_out[:, None] + n + 0 * offs_s[None, :], qv, mask=first)
            hm = gs * (hs - bu)  # g_t exp(delta_t A) h_{t-1}
            sgb += gs * B_n
            sahm += hm * A2_n
            dA_n = tl.sum(tl.sum(hm * dt, axis=0), axis=1)
            tl.store(dA_ptr + ((b * nchunks + c) * dim + offs_d) * DSTATE + n, dA_n, mask=mask_d)
            dBc = tl.sum(gs * dtu, axis=1)  # (SUB, SEG), over this block's channels
            dCc = tl.sum(hs * dy, axis=1)
            tn = c * CHUNK + offs_s[None, :] * SUB + tl.arange(0, SUB)[:, None]  # (SUB, SEG)
            if ATOMIC:
                tl.atomic_add(dB_ptr + r_base + n * s_rn + tn, dBc, mask=tn < seqlen, sem="relaxed")
                tl.atomic_add(dC_ptr + r_base + n * s_rn + tn, dCc, mask=tn < seqlen, sem="relaxed")
            else:
                tl.store(dB_ptr + r_base + n * s_rn + tn, dBc, mask=tn < seqlen)
                tl.store(dC_ptr + r_base + n * s_rn + tn, dCc, mask=tn < seqlen)
        sahm = sahm / LOG2E
        dtr = tl.load(dt_base + t, mask=m3, other=0.0).to(ACC)  # raw delta reloaded, for softplus'
        if HAS_BIAS:
            dtr += bias
        du = dt * sgb
        ddt = u * sgb + sahm
        if HAS_D:
            dyu = dy * u
            dD_acc += tl.sum(tl.sum(dyu, axis=0), axis=1)
            du += dy * Dv
            y += u * Dv
        if HAS_Z:  # dout and z reloaded (L1/L2) instead of kept in registers through the state loop
            go = tl.load(go_base + t, mask=m3, other=0.0).to(ACC)
            zz = tl.load(z_base + t, mask=m3, other=0.0).to(ACC)
            sz = _sigmoid(zz)
            tl.store(dz_base + t, (go * y * sz * (1.0 + zz * (1.0 - sz))).to(dz_ptr.dtype.element_ty), mask=m3)
        if SOFTPLUS:
            ddt = ddt * _sigmoid(dtr)
        ddt = tl.where(m3, ddt, 0.0)
        dbias_acc += tl.sum(tl.sum(ddt, axis=0), axis=1)
        tl.store(du_base + t, du.to(du_ptr.dtype.element_ty), mask=m3)
        tl.store(ddt_base + t, ddt.to(ddt_ptr.dtype.element_ty), mask=m3)
    tl.store(dD_ptr + b * dim + offs_d, dD_acc, mask=mask_d)
    tl.store(dbias_ptr + b * dim + offs_d, dbias_acc, mask=mask_d)
