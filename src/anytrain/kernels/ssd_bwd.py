"""Triton backward kernels of Mamba-2's SSD (launched by ``ssd_triton``); notation of ``ssd_fwd``.

The backward recomputes Δ, cs, CB and the entering states H_c with the forward kernels, then, with dy the gradient of
y before the gate (dout · silu(z)) and dH̄ the gradient of the entering states:

  dz, dy, dH_c from the outputs = sum_l exp(cs_l) dy_l^T C_l                     ``_ssd_bwd_dstate_kernel``
  dH̄_c = dH_c + γ_c dH̄_{c+1} (dH̄ after the last chunk = d final state), dS_c = dH̄_{c+1}, u_c = γ_c <dH̄_{c+1}, H_c>,
  d initial state = dH̄_0                                                      ``_ssd_state_bwd_kernel``
  dCB[l, s] = sum_{heads of the group} exp(cs_l - cs_s) Δ_s dy_l · x_s, and per head the rows' and columns' sums of
  G = dCB_head · CB (the gradient of cs_l - cs_s)                            ``_ssd_bwd_dcb_kernel``
  dx̃_s = sum_{l>=s} CB[l, s] exp(cs_l - cs_s) dy_l + exp(cs_E - cs_s) dS_c B_s,  dx = Δ dx̃ + D dy,  dΔ ∋ x · dx̃,
  q_s = Δ_s x_s · (the dS_c part of dx̃_s), dD                                ``_ssd_bwd_dx_kernel``
  dB_s = sum_{heads} exp(cs_E - cs_s) Δ_s dS_c^T x_s + sum_{l>=s} dCB[l, s] C_l  ``_ssd_bwd_db_kernel``
  dC_l = sum_{heads} exp(cs_l) dy_l H_c + sum_{s<=l} dCB[l, s] B_s, and v_l = C_l · (its head's state part)
                                                                             ``_ssd_bwd_dc_kernel``
  d(cs) inside a chunk: the gradient of a_k = Δ_k A is the sum over l >= k of the positions' cs gradients (rows minus
  columns of G, v) plus sum_{s<k} q_s plus u_c (the end state's and γ's terms, summed in their stable forms);
  dΔ = dΔ(x̃) + A da, ddt = dΔ · softplus', dA, d dt_bias                       ``_ssd_bwd_finish_kernel``

Every sum across programs goes through per-program partial buffers (summed in PyTorch or by a later kernel in a fixed
order): there are no atomics, so the gradients are bitwise reproducible. The kernels that sum over the heads of a group
(dCB, dB, dC) split those heads into runs of ``HPS`` per program; the runs' partial sums are added afterwards.
"""

from __future__ import annotations

import triton
import triton.language as tl

from anytrain.kernels.selective_scan_common import _softplus_grad
from anytrain.kernels.ssd_fwd import (
    _cb_base,
    _chunk_program,
    _decay,
    _doc_before,
    _doc_last,
    _doc_of,
    _dot,
    _dot_over_n,
    _head_block,
    _head_program,
    _last_in_chunk,
    _positions,
    _row_load,
    _row_start,
    _split_pid,
    _square_tile,
    _state_base,
    _store_state_tile,
    _tile,
)


@triton.jit
def _head_run(nheads, heads_per_group, nsplit, HPS: tl.constexpr):
    """(group, split, first head, end head) of a program whose second grid axis runs over groups x splits."""
    pid = tl.program_id(1)
    g, sp = pid // nsplit, pid % nsplit
    h0 = g * heads_per_group + sp * HPS
    return g, sp, h0, tl.minimum(h0 + HPS, (g + 1) * heads_per_group)


@triton.jit
def _ssd_bwd_dstate_kernel(
    dout_ptr,
    z_ptr,
    ypre_ptr,
    C_ptr,
    cs_ptr,
    seq_ptr,
    dz_ptr,
    dy_ptr,
    dH_ptr,
    seqlen,
    nheads,
    heads_per_group,
    headdim,
    dstate,
    chunk,
    nchunks,
    s_o_b,
    s_o_l,
    s_o_h,
    s_o_p,
    s_z_b,
    s_z_l,
    s_z_h,
    s_z_p,
    s_c_b,
    s_c_l,
    s_c_g,
    s_seq_b,
    BL: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # for a (b, chunk, head) and a (BP, BN) tile of the state: with z, dy = dout silu(z) and dz (stored by the
    # programs of the first n tile into contiguous (b, L, h, p) buffers); the (BP, BN) tile of
    # dH_c = sum_l exp(cs_l) dy_l^T C_l (positions of the entering state's document). Grid (b * chunks, h,
    # cdiv(p, BP) * cdiv(n, BN)).
    b, c, hh, g = _head_program(nchunks, heads_per_group)
    pb, nb, _ = _split_pid(dstate, BN)
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = nb * BN + tl.arange(0, BN)
    mp, mn = offs_p < headdim, offs_n < dstate
    row = _row_start(b, hh, nheads, nchunks, c, chunk)
    if HAS_SEQ:
        seq_prev = _doc_before(seq_ptr, b, s_seq_b, c, chunk)
    acc = tl.zeros((BP, BN), dtype=ACC)
    for l0 in range(0, chunk, BL):
        offs_l = l0 + tl.arange(0, BL)
        pos_l, ml = _positions(c, chunk, offs_l, seqlen)
        m = ml[:, None] & mp[None, :]
        dy = _tile(dout_ptr + b * s_o_b + hh * s_o_h, pos_l, s_o_l, offs_p, s_o_p, ml, mp).to(ACC)
        if HAS_Z:
            zt = _tile(z_ptr + b * s_z_b + hh * s_z_h, pos_l, s_z_l, offs_p, s_z_p, ml, mp).to(ACC)
            offs = ((b * seqlen + pos_l[:, None]) * nheads + hh) * headdim + offs_p[None, :]
            sig = 1.0 / (1.0 + tl.exp(-zt))
            yt = tl.load(ypre_ptr + offs, mask=m, other=0.0).to(ACC)
            first = m & (offs_p * 0 + nb == 0)[None, :]  # (the first n tile's programs)
            tl.store(dz_ptr + offs, (dy * yt * sig * (1.0 + zt * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=first)
            dy = dy * zt * sig
            tl.store(dy_ptr + offs, dy.to(dy_ptr.dtype.element_ty), mask=first)
        keep = ml
        if HAS_SEQ:
            keep &= _doc_of(seq_ptr, b, s_seq_b, pos_l, ml) == seq_prev
        scale = tl.where(keep, tl.exp(_row_load(cs_ptr + row, offs_l, chunk)), 0.0)
        ct = _tile(C_ptr + b * s_c_b + g * s_c_g, pos_l, s_c_l, offs_n, 1, ml, mn).to(ACC)
        acc += _dot(tl.trans(dy.to(DOT)), (ct * scale[:, None]).to(DOT), IEEE)
    out = _state_base(dH_ptr, b, c, nchunks, nheads, hh, headdim, dstate)
    _store_state_tile(out, acc, offs_p, offs_n, mp, mn, dstate)


@triton.jit
def _ssd_state_bwd_kernel(
    dH_ptr,
    H_ptr,
    gamma_ptr,
    dfinal_ptr,
    dS_ptr,
    u_ptr,
    dinit_ptr,
    nheads,
    nchunks,
    state_size,
    BLOCK: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    HAS_INIT: tl.constexpr,
    ACC: tl.constexpr,
):
    # the state passing backwards over BLOCK of the p·n entries of a (b, head): dS_c = dH̄_{c+1} (in dS's dtype),
    # this block's part of u_c (b, h, chunks, blocks), dH̄_0 as the initial state's gradient. Grid (b, h, blocks).
    b = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1)
    blk = tl.program_id(2)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < state_size
    if HAS_DFINAL:
        dstate = tl.load(dfinal_ptr + (b * nheads + hh) * state_size + offs, mask=m, other=0.0).to(ACC)
    else:
        dstate = tl.zeros((BLOCK,), dtype=ACC)
    for k in range(nchunks):
        c = nchunks - 1 - k
        base = ((b * nchunks + c) * nheads + hh) * state_size
        tl.store(dS_ptr + base + offs, dstate.to(dS_ptr.dtype.element_ty), mask=m)
        row = (b * nheads + hh) * nchunks + c
        gamma = tl.load(gamma_ptr + row)
        h = tl.load(H_ptr + base + offs, mask=m, other=0.0).to(ACC)
        tl.store(u_ptr + row * tl.num_programs(2) + blk, gamma * tl.sum(dstate * h, axis=0))
        dstate = tl.load(dH_ptr + base + offs, mask=m, other=0.0) + gamma * dstate
    if HAS_INIT:
        tl.store(dinit_ptr + (b * nheads + hh) * state_size + offs, dstate, mask=m)


@triton.jit
def _ssd_bwd_dcb_kernel(
    dy_ptr,
    x_ptr,
    cb_ptr,
    delta_ptr,
    cs_ptr,
    seq_ptr,
    dcb_ptr,
    dcs_ptr,
    batch,
    seqlen,
    nheads,
    heads_per_group,
    headdim,
    chunk,
    nchunks,
    nsplit,
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    s_x_b,
    s_x_l,
    s_x_h,
    s_x_p,
    s_seq_b,
    BT: tl.constexpr,
    BP: tl.constexpr,
    HPS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # the (i, j) tile (rows l, columns s, j <= i) of dCB for a (b, chunk, group) summed over a run of heads, into
    # this run's slice of (splits, b, chunks, g, Q, Q); per head the rows' sums of G into slot j of its (b, h, chunk,
    # tiles, Q) cs-gradient partials and minus the columns' sums into slot i (slot i alone on the diagonal: every
    # (slot, position) is written by exactly one tile). Grid (b * chunks, g * splits, tiles²).
    b, c = _chunk_program(nchunks)
    g, sp, h0, h1 = _head_run(nheads, heads_per_group, nsplit, HPS)
    nt = tl.cdiv(chunk, BT)
    i = tl.program_id(2) // nt
    j = tl.program_id(2) % nt
    if j > i:
        return
    offs_l = i * BT + tl.arange(0, BT)
    offs_s = j * BT + tl.arange(0, BT)
    pos_l, ml = _positions(c, chunk, offs_l, seqlen)
    pos_s, ms = _positions(c, chunk, offs_s, seqlen)
    keep = (offs_s[None, :] <= offs_l[:, None]) & ml[:, None] & ms[None, :]
    if HAS_SEQ:
        seq_l = _doc_of(seq_ptr, b, s_seq_b, pos_l, ml)
        keep &= _doc_of(seq_ptr, b, s_seq_b, pos_s, ms)[None, :] == seq_l[:, None]
    ngroups = nheads // heads_per_group
    tile = offs_l[:, None] * chunk + offs_s[None, :]
    in_tile = (offs_l < chunk)[:, None] & (offs_s < chunk)[None, :]
    cb = _square_tile(_cb_base(cb_ptr, b, c, nchunks, ngroups, g, chunk), offs_l, offs_s, chunk, False)
    acc = tl.zeros((BT, BT), dtype=ACC)
    for hh in range(h0, h1):
        d1 = tl.zeros((BT, BT), dtype=ACC)
        for p0 in range(0, headdim, BP):
            offs_p = p0 + tl.arange(0, BP)
            mp = offs_p < headdim
            dyt = _tile(dy_ptr + b * s_y_b + hh * s_y_h, pos_l, s_y_l, offs_p, s_y_p, ml, mp).to(DOT)
            xt = tl.load(
                x_ptr + b * s_x_b + hh * s_x_h + pos_s[None, :] * s_x_l + offs_p[:, None] * s_x_p,
                mask=ms[None, :] & mp[:, None],
                other=0.0,
            ).to(DOT)  # (BP, BT): x_s transposed
            d1 += _dot(dyt, xt, IEEE)
        row = _row_start(b, hh, nheads, nchunks, c, chunk)
        cs_l = _row_load(cs_ptr + row, offs_l, chunk)
        cs_s = _row_load(cs_ptr + row, offs_s, chunk)
        dl_s = _row_load(delta_ptr + row, offs_s, chunk)
        dcb = d1 * _decay(cs_l[:, None], cs_s[None, :], keep) * dl_s[None, :]
        acc += dcb
        grad = dcb * cb
        rows = tl.sum(grad, axis=1)
        cols = tl.sum(grad, axis=0)
        slots = dcs_ptr + row * nt  # (tiles, Q) for this (b, h, chunk)
        if i == j:
            tl.store(slots + i * chunk + offs_l, rows - cols, mask=offs_l < chunk)
        else:
            tl.store(slots + j * chunk + offs_l, rows, mask=offs_l < chunk)
            tl.store(slots + i * chunk + offs_s, -cols, mask=offs_s < chunk)
    out = dcb_ptr + (((sp * batch + b) * nchunks + c) * ngroups + g) * chunk * chunk
    tl.store(out + tile, acc, mask=in_tile)


@triton.jit
def _ssd_bwd_dx_kernel(
    x_ptr,
    dy_ptr,
    B_ptr,
    D_ptr,
    cb_ptr,
    dS_ptr,
    delta_ptr,
    cs_ptr,
    seq_ptr,
    dx_ptr,
    ddelta_ptr,
    q_ptr,
    dD_ptr,
    seqlen,
    nheads,
    heads_per_group,
    headdim,
    dstate,
    chunk,
    nchunks,
    s_x_b,
    s_x_l,
    s_x_h,
    s_x_p,
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    s_b_b,
    s_b_l,
    s_b_g,
    s_seq_b,
    BT: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_D: tl.constexpr,
    D_PER_P: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # positions s of tile j of a (b, chunk, head), all of p (BP >= p): dx̃ from the later positions of the chunk and
    # from the end state's gradient; dx (contiguous (b, L, h, p)), x · dx̃ and q into (b, h, chunks, Q), the tile's
    # sum of dy · x into dD's partials (b, chunks, tiles, h, p). Grid (b * chunks, h, tiles).
    b, c, hh, g = _head_program(nchunks, heads_per_group)
    j = tl.program_id(2)
    nt = tl.num_programs(2)
    offs_s = j * BT + tl.arange(0, BT)
    offs_p = tl.arange(0, BP)
    pos_s, ms = _positions(c, chunk, offs_s, seqlen)
    mp = offs_p < headdim
    row = _row_start(b, hh, nheads, nchunks, c, chunk)
    cs_s = _row_load(cs_ptr + row, offs_s, chunk)
    dl_s = _row_load(delta_ptr + row, offs_s, chunk)
    last = _last_in_chunk(c, chunk, seqlen)
    keep_end = ms
    if HAS_SEQ:
        seq_s = _doc_of(seq_ptr, b, s_seq_b, pos_s, ms)
        keep_end &= seq_s == _doc_last(seq_ptr, b, s_seq_b, c, chunk, last)
    # the end state's part: (BT, n) @ (n, BP)
    B_base = B_ptr + b * s_b_b + g * s_b_g + pos_s[:, None] * s_b_l
    dS_base = _state_base(dS_ptr, b, c, nchunks, nheads, hh, headdim, dstate) + offs_p[None, :] * dstate
    from_end = _dot_over_n(B_base, ms, dS_base, mp, dstate, BT, BP, BN, DOT, IEEE, ACC)
    from_end = from_end * _decay(tl.load(cs_ptr + row + last), cs_s, keep_end)[:, None]
    # the later positions of the chunk: (BT_s, BT_l) @ (BT_l, BP)
    ngroups = nheads // heads_per_group
    cb_base = _cb_base(cb_ptr, b, c, nchunks, ngroups, g, chunk)
    dy_base = dy_ptr + b * s_y_b + hh * s_y_h
    acc = from_end
    for l0 in range(j * BT, chunk, BT):
        offs_l = l0 + tl.arange(0, BT)
        pos_l, ml = _positions(c, chunk, offs_l, seqlen)
        keep = (offs_l[None, :] >= offs_s[:, None]) & ml[None, :] & ms[:, None]
        if HAS_SEQ:
            keep &= _doc_of(seq_ptr, b, s_seq_b, pos_l, ml)[None, :] == seq_s[:, None]
        cbt = _square_tile(cb_base, offs_l, offs_s, chunk, True)  # (BT_s, BT_l): CB[l, s]
        cs_l = _row_load(cs_ptr + row, offs_l, chunk)
        mt = cbt * _decay(cs_l[None, :], cs_s[:, None], keep)
        dyt = _tile(dy_base, pos_l, s_y_l, offs_p, s_y_p, ml, mp)
        acc += _dot(mt.to(DOT), dyt.to(DOT), IEEE)
    m = ms[:, None] & mp[None, :]
    xs = _tile(x_ptr + b * s_x_b + hh * s_x_h, pos_s, s_x_l, offs_p, s_x_p, ms, mp).to(ACC)
    dx = acc * dl_s[:, None]
    if HAS_D:
        dys = _tile(dy_base, pos_s, s_y_l, offs_p, s_y_p, ms, mp).to(ACC)
        if D_PER_P:
            dx += dys * tl.load(D_ptr + hh * headdim + offs_p, mask=mp, other=0.0).to(ACC)[None, :]
        else:
            dx += dys * tl.load(D_ptr + hh).to(ACC)
        dD_offs = (((b * nchunks + c) * nt + j) * nheads + hh) * headdim + offs_p
        tl.store(dD_ptr + dD_offs, tl.sum(dys * xs, axis=0), mask=mp)
    tl.store(dx_ptr + ((b * seqlen + pos_s[:, None]) * nheads + hh) * headdim + offs_p[None, :], dx, mask=m)
    tl.store(ddelta_ptr + row + offs_s, tl.sum(xs * acc, axis=1), mask=offs_s < chunk)
    tl.store(q_ptr + row + offs_s, dl_s * tl.sum(xs * from_end, axis=1), mask=offs_s < chunk)


@triton.jit
def _ssd_bwd_db_kernel(
    x_ptr,
    C_ptr,
    dcb_ptr,
    dS_ptr,
    delta_ptr,
    cs_ptr,
    seq_ptr,
    dB_ptr,
    batch,
    seqlen,
    nheads,
    heads_per_group,
    headdim,
    dstate,
    chunk,
    nchunks,
    nsplit,
    s_x_b,
    s_x_l,
    s_x_h,
    s_x_p,
    s_c_b,
    s_c_l,
    s_c_g,
    s_seq_b,
    BT: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HPS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # a (BT, BN) tile of dB at the positions s of tile j of a (b, chunk, group): the end state's part over a run of
    # heads, and (the first run only) sum_{l>=s} dCB[l, s] C_l; into this run's slice of (splits, b, L, g, n).
    # Grid (b * chunks, g * splits, tiles * cdiv(n, BN)).
    b, c = _chunk_program(nchunks)
    g, sp, h0, h1 = _head_run(nheads, heads_per_group, nsplit, HPS)
    j, nb, _ = _split_pid(dstate, BN)
    offs_n = nb * BN + tl.arange(0, BN)
    offs_s = j * BT + tl.arange(0, BT)
    pos_s, ms = _positions(c, chunk, offs_s, seqlen)
    mn = offs_n < dstate
    last = _last_in_chunk(c, chunk, seqlen)
    keep_end = ms
    if HAS_SEQ:
        seq_s = _doc_of(seq_ptr, b, s_seq_b, pos_s, ms)
        keep_end &= seq_s == _doc_last(seq_ptr, b, s_seq_b, c, chunk, last)
    acc = tl.zeros((BT, BN), dtype=ACC)
    for hh in range(h0, h1):
        row = _row_start(b, hh, nheads, nchunks, c, chunk)
        cs_s = _row_load(cs_ptr + row, offs_s, chunk)
        w = _row_load(delta_ptr + row, offs_s, chunk)
        w = w * _decay(tl.load(cs_ptr + row + last), cs_s, keep_end)
        dS_base = _state_base(dS_ptr, b, c, nchunks, nheads, hh, headdim, dstate) + offs_n[None, :]
        for p0 in range(0, headdim, BP):
            offs_p = p0 + tl.arange(0, BP)
            mp = offs_p < headdim
            xt = _tile(x_ptr + b * s_x_b + hh * s_x_h, pos_s, s_x_l, offs_p, s_x_p, ms, mp)
            dst = tl.load(dS_base + offs_p[:, None] * dstate, mask=mp[:, None] & mn[None, :], other=0.0).to(DOT)
            acc += _dot((xt * w[:, None]).to(DOT), dst, IEEE)
    ngroups = nheads // heads_per_group
    if sp == 0:
        dcb_base = _cb_base(dcb_ptr, b, c, nchunks, ngroups, g, chunk)
        for l0 in range(j * BT, chunk, BT):
            offs_l = l0 + tl.arange(0, BT)
            pos_l, ml = _positions(c, chunk, offs_l, seqlen)
            dcbt = _square_tile(dcb_base, offs_l, offs_s, chunk, True).to(DOT)  # (BT_s, BT_l): dCB[l, s]
            ct = _tile(C_ptr + b * s_c_b + g * s_c_g, pos_l, s_c_l, offs_n, 1, ml, mn).to(DOT)
            acc += _dot(dcbt, ct, IEEE)
    out = dB_ptr + ((sp * batch + b) * seqlen + pos_s[:, None]) * ngroups * dstate + g * dstate + offs_n[None, :]
    tl.store(out, acc.to(dB_ptr.dtype.element_ty), mask=ms[:, None] & mn[None, :])


@triton.jit
def _ssd_bwd_dc_kernel(
    dy_ptr,
    B_ptr,
    C_ptr,
    dcb_ptr,
    H_ptr,
    cs_ptr,
    seq_ptr,
    dC_ptr,
    v_ptr,
    batch,
    seqlen,
    nheads,
    heads_per_group,
    headdim,
    dstate,
    chunk,
    nchunks,
    nsplit,
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    s_b_b,
    s_b_l,
    s_b_g,
    s_c_b,
    s_c_l,
    s_c_g,
    s_seq_b,
    BT: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HPS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # a (BT, BN) tile of dC at the positions l of tile i of a (b, chunk, group): the entering state's part over a run
    # of heads (and per head v_l = C_l · that part, this n tile's share, into (b, h, chunks, n tiles, Q)), and (the
    # first run only) sum_{s<=l} dCB[l, s] B_s; into this run's slice of (splits, b, L, g, n).
    # Grid (b * chunks, g * splits, tiles * cdiv(n, BN)).
    b, c = _chunk_program(nchunks)
    g, sp, h0, h1 = _head_run(nheads, heads_per_group, nsplit, HPS)
    i, nb, nnb = _split_pid(dstate, BN)
    offs_n = nb * BN + tl.arange(0, BN)
    offs_l = i * BT + tl.arange(0, BT)
    pos_l, ml = _positions(c, chunk, offs_l, seqlen)
    mn = offs_n < dstate
    keep_l = ml
    if HAS_SEQ:
        keep_l &= _doc_of(seq_ptr, b, s_seq_b, pos_l, ml) == _doc_before(seq_ptr, b, s_seq_b, c, chunk)
    ct = _tile(C_ptr + b * s_c_b + g * s_c_g, pos_l, s_c_l, offs_n, 1, ml, mn).to(ACC)
    acc = tl.zeros((BT, BN), dtype=ACC)
    for hh in range(h0, h1):
        row = _row_start(b, hh, nheads, nchunks, c, chunk)
        H_base = _state_base(H_ptr, b, c, nchunks, nheads, hh, headdim, dstate) + offs_n[None, :]
        part = tl.zeros((BT, BN), dtype=ACC)
        for p0 in range(0, headdim, BP):
            offs_p = p0 + tl.arange(0, BP)
            mp = offs_p < headdim
            dyt = _tile(dy_ptr + b * s_y_b + hh * s_y_h, pos_l, s_y_l, offs_p, s_y_p, ml, mp).to(DOT)
            ht = tl.load(H_base + offs_p[:, None] * dstate, mask=mp[:, None] & mn[None, :], other=0.0).to(DOT)
            part += _dot(dyt, ht, IEEE)
        cs_l = _row_load(cs_ptr + row, offs_l, chunk)
        part = part * tl.where(keep_l, tl.exp(cs_l), 0.0)[:, None]
        tl.store(v_ptr + (row // chunk * nnb + nb) * chunk + offs_l, tl.sum(part * ct, axis=1), mask=offs_l < chunk)
        acc += part
    ngroups = nheads // heads_per_group
    if sp == 0:
        dcb_base = _cb_base(dcb_ptr, b, c, nchunks, ngroups, g, chunk)
        for s0 in range(0, tl.minimum(chunk, i * BT + BT), BT):
            offs_s = s0 + tl.arange(0, BT)
            pos_s, ms = _positions(c, chunk, offs_s, seqlen)
            dcbt = _square_tile(dcb_base, offs_l, offs_s, chunk, False).to(DOT)
            bt = _tile(B_ptr + b * s_b_b + g * s_b_g, pos_s, s_b_l, offs_n, 1, ms, mn).to(DOT)
            acc += _dot(dcbt, bt, IEEE)
    out = dC_ptr + ((sp * batch + b) * seqlen + pos_l[:, None]) * ngroups * dstate + g * dstate + offs_n[None, :]
    tl.store(out, acc.to(dC_ptr.dtype.element_ty), mask=ml[:, None] & mn[None, :])


@triton.jit
def _ssd_bwd_finish_kernel(
    A_ptr,
    delta_ptr,
    ddelta_ptr,
    dcs_ptr,
    v_ptr,
    q_ptr,
    u_ptr,
    ddt_ptr,
    dA_ptr,
    dbias_ptr,
    seqlen,
    nheads,
    chunk,
    nchunks,
    ntiles,
    nvparts,
    nuparts,
    BQ: tl.constexpr,
    BH: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    ACC: tl.constexpr,
):
    # one (b, chunk, block of BH heads): da_k = sum_{l>=k} (the cs gradients of G and v at l) + sum_{s<k} q_s + u_c,
    # dΔ = x · dx̃ + A da, ddt (contiguous (b, L, h), dt's dtype), and the chunk's sums of Δ da (for dA) and of ddt
    # (for d dt_bias) into (b, chunks, h). Grid (b, chunks, cdiv(h, BH)).
    b, c, offs_q, pos, in_chunk, valid, offs_h, mh = _head_block(seqlen, nheads, chunk, BQ, BH)
    keep = in_chunk[:, None] & mh[None, :]
    row = (b * nheads + offs_h) * nchunks + c  # (BH,)
    dcs = tl.zeros((BQ, BH), dtype=ACC)
    for k in range(ntiles):
        dcs += tl.load(dcs_ptr + (row[None, :] * ntiles + k) * chunk + offs_q[:, None], mask=keep, other=0.0)
    for k in range(nvparts):
        dcs += tl.load(v_ptr + (row[None, :] * nvparts + k) * chunk + offs_q[:, None], mask=keep, other=0.0)
    u = tl.zeros((BH,), dtype=ACC)
    for k in range(nuparts):
        u += tl.load(u_ptr + row * nuparts + k, mask=mh, other=0.0)
    ptrs = row[None, :] * chunk + offs_q[:, None]
    q = tl.load(q_ptr + ptrs, mask=keep, other=0.0)
    da = tl.cumsum(dcs, axis=0, reverse=True) + (tl.cumsum(q, axis=0) - q) + u[None, :]
    delta = tl.load(delta_ptr + ptrs, mask=keep, other=0.0)
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(ACC)
    ddelta = tl.load(ddelta_ptr + ptrs, mask=keep, other=0.0) + A[None, :] * da
    if SOFTPLUS:
        ddelta = ddelta * _softplus_grad(delta)
    m = valid[:, None] & mh[None, :]
    ddelta = tl.where(m, ddelta, 0.0)
    tl.store(ddt_ptr + (b * seqlen + pos[:, None]) * nheads + offs_h[None, :], ddelta, mask=m)
    out = (b * nchunks + c) * nheads + offs_h
    tl.store(dA_ptr + out, tl.sum(tl.where(m, delta * da, 0.0), axis=0), mask=mh)
    tl.store(dbias_ptr + out, tl.sum(ddelta, axis=0), mask=mh)
