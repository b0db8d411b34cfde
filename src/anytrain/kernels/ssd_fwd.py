"""Triton forward kernels of Mamba-2's SSD (launched by ``ssd_triton``), the chunked algorithm of the Mamba-2 paper.

Per (batch b, head h) the sequence is cut into chunks of Q positions; inside a chunk l and s index positions, E is the
chunk's last position inside the sequence. With Δ the step (after dt_bias and softplus), a = Δ·A and cs the cumulative
sum of a inside the chunk (``_ssd_cumsum_kernel``; the padding past the sequence has Δ = 0, so cs stays flat there):

  CB[l, s] = C_l · B_s                                   per group, ``_ssd_bmm_kernel``
  S_c = sum_s exp(cs_E - cs_s) Δ_s x_s B_s^T              the chunk's end state from zero, ``_ssd_chunk_state_kernel``
  H_{c+1} = γ_c H_c + S_c,  γ_c = exp(cs_E)               the states entering the chunks, ``_ssd_state_fwd_kernel``
  y_l = exp(cs_l) H_c C_l + sum_{s<=l} CB[l, s] exp(cs_l - cs_s) Δ_s x_s + D x_l,  out = y · silu(z)
                                                          ``_ssd_chunk_scan_fwd_kernel``

Document boundaries come as ``seq``, a per-position document counter (it increases by one where ``seq_idx`` changes):
a pair (l, s) contributes only inside one document, the end state only takes positions of E's document, the entering
state reaches only positions of the document of the position before the chunk, and γ_c is 0 when a document starts
inside chunk c. Per-position buffers (Δ, cs) are (b, h, chunks, Q), per-chunk states (b, chunks, h, p, n), CB
(b, chunks, g, Q, Q); all accumulation in ``ACC`` (fp32, fp64 for fp64 inputs), matmul operands in ``DOT`` (the inputs'
dtype: bf16/fp16 on the tensor cores, fp32/fp64 at full precision).
"""

from __future__ import annotations

import triton
import triton.language as tl

from anytrain.kernels.selective_scan_common import _softplus


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 / fp64 operands at full precision (no TF32): the results match the PyTorch twin's fp32 einsums
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _chunk_program(nchunks):
    """(b, c) of a program whose first grid axis runs over batch x chunks; b as int64 for the large offsets."""
    pid = tl.program_id(0)
    return (pid // nchunks).to(tl.int64), pid % nchunks


@triton.jit
def _head_program(nchunks, heads_per_group):
    """(b, c, head, group) of a program whose grid axes run over batch x chunks and heads."""
    b, c = _chunk_program(nchunks)
    hh = tl.program_id(1)
    return b, c, hh, hh // heads_per_group


@triton.jit
def _last_in_chunk(c, chunk, seqlen):
    """The chunk's last position inside the sequence, relative to the chunk start."""
    return tl.minimum(chunk, seqlen - c * chunk) - 1


@triton.jit
def _decay(cs_row, cs_col, keep):
    # exp(cs_row - cs_col) where keep, else exactly 0 (exp(-inf)); masked pairs never overflow
    return tl.exp(tl.where(keep, cs_row - cs_col, float("-inf")))


@triton.jit
def _split_pid(size, BLOCK: tl.constexpr):
    """(outer, inner) of a third grid axis that runs over (outer tiles) x cdiv(size, BLOCK), and cdiv(size, BLOCK)."""
    nb = tl.cdiv(size, BLOCK)
    return tl.program_id(2) // nb, tl.program_id(2) % nb, nb


@triton.jit
def _positions(c, chunk, offs, seqlen):
    """Sequence positions of the offsets offs of chunk c, and where they lie inside both the chunk and the sequence."""
    pos = c * chunk + offs
    return pos, (offs < chunk) & (pos < seqlen)


@triton.jit
def _head_block(seqlen, nheads, chunk, BQ: tl.constexpr, BH: tl.constexpr):
    """The positions and heads of a (b, chunk, block of BH heads) program (grid (b, chunks, cdiv(h, BH))): b, c, the
    chunk offsets, positions, inside the chunk, inside the sequence, heads and valid heads."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_q = tl.arange(0, BQ)
    pos = c * chunk + offs_q
    in_chunk = offs_q < chunk
    valid = in_chunk & (pos < seqlen)
    offs_h = tl.program_id(2) * BH + tl.arange(0, BH)
    mh = offs_h < nheads
    return b, c, offs_q, pos, in_chunk, valid, offs_h, mh


@triton.jit
def _row_start(b, hh, nheads, nchunks, c, chunk):
    """Offset of the (b, head, chunk) row of a per-position (b, h, chunks, Q) buffer."""
    return ((b * nheads + hh) * nchunks + c) * chunk


@triton.jit
def _row_load(ptr, offs, chunk):
    """Offsets offs of a per-position row that starts at ptr; 0 past the chunk."""
    return tl.load(ptr + offs, mask=offs < chunk, other=0.0)


@triton.jit
def _state_base(ptr, b, c, nchunks, nheads, hh, headdim, dstate):
    """The (p, n) state of a (b, chunk, head) in a (b, chunks, h, p, n) buffer."""
    return ptr + ((b * nchunks + c) * nheads + hh) * headdim * dstate


@triton.jit
def _cb_base(ptr, b, c, nchunks, ngroups, g, chunk):
    """The (Q, Q) matrix of a (b, chunk, group) in a (b, chunks, g, Q, Q) buffer."""
    return ptr + ((b * nchunks + c) * ngroups + g) * chunk * chunk


@triton.jit
def _tile(ptr, offs_r, s_r, offs_c, s_c, m_r, m_c):
    """The (rows, columns) tile at ptr + offs_r * s_r + offs_c * s_c; 0 outside m_r x m_c."""
    return tl.load(ptr + offs_r[:, None] * s_r + offs_c[None, :] * s_c, mask=m_r[:, None] & m_c[None, :], other=0.0)


@triton.jit
def _square_tile(base, offs_l, offs_s, chunk, TRANS: tl.constexpr):
    """The (l, s) tile of a (Q, Q) matrix at base, or with TRANS its (s, l) transpose; 0 past the chunk."""
    if TRANS:
        return tl.load(
            base + offs_l[None, :] * chunk + offs_s[:, None],
            mask=(offs_l < chunk)[None, :] & (offs_s < chunk)[:, None],
            other=0.0,
        )
    return tl.load(
        base + offs_l[:, None] * chunk + offs_s[None, :],
        mask=(offs_l < chunk)[:, None] & (offs_s < chunk)[None, :],
        other=0.0,
    )


@triton.jit
def _doc_of(seq_ptr, b, s_seq_b, pos, m):
    """The documents of positions pos of sequence b (-1 outside m)."""
    return tl.load(seq_ptr + b * s_seq_b + pos, mask=m, other=-1)


@triton.jit
def _doc_before(seq_ptr, b, s_seq_b, c, chunk):
    """The document of the position before chunk c (of position 0 for the first chunk): the entering state's."""
    return tl.load(seq_ptr + b * s_seq_b + tl.maximum(c * chunk - 1, 0))


@triton.jit
def _doc_last(seq_ptr, b, s_seq_b, c, chunk, last):
    """The document of the chunk's last position inside the sequence: the end state's."""
    return tl.load(seq_ptr + b * s_seq_b + c * chunk + last)


@triton.jit
def _dot_over_n(
    a_base,
    m_a,
    b_base,
    m_b,
    dstate,
    BA: tl.constexpr,
    BB: tl.constexpr,
    BN: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    """sum over the dstate columns n of (a_base + n)[a, n] (b_base + n)[n, b]: a (BA, BB) product in ACC whose
    operands are masked by m_a (rows of a) and m_b (columns of b)."""
    acc = tl.zeros((BA, BB), dtype=ACC)
    for n0 in range(0, dstate, BN):
        offs_n = n0 + tl.arange(0, BN)
        mn = offs_n < dstate
        at = tl.load(a_base + offs_n[None, :], mask=m_a[:, None] & mn[None, :], other=0.0).to(DOT)
        bt = tl.load(b_base + offs_n[:, None], mask=mn[:, None] & m_b[None, :], other=0.0).to(DOT)
        acc += _dot(at, bt, IEEE)
    return acc


@triton.jit
def _store_state_tile(out, acc, offs_p, offs_n, mp, mn, dstate):
    """Store a (BP, BN) tile of a (p, n) state at out."""
    tl.store(out + offs_p[:, None] * dstate + offs_n[None, :], acc, mask=mp[:, None] & mn[None, :])


@triton.jit
def _ssd_cumsum_kernel(
    dt_ptr,
    bias_ptr,
    A_ptr,
    seq_ptr,
    delta_ptr,
    cs_ptr,
    gamma_ptr,
    seqlen,
    nheads,
    chunk,
    nchunks,
    s_dt_b,
    s_dt_l,
    s_dt_h,
    s_seq_b,
    BQ: tl.constexpr,
    BH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    ACC: tl.constexpr,
):
    # one (b, chunk, block of BH heads): Δ, cs = cumsum(Δ A) over the chunk, and γ = exp(cs_E) (0 across a document
    # start). Grid (b, chunks, cdiv(h, BH)).
    b, c, offs_q, pos, in_chunk, valid, offs_h, mh = _head_block(seqlen, nheads, chunk, BQ, BH)
    m = valid[:, None] & mh[None, :]
    dt = tl.load(dt_ptr + b * s_dt_b + pos[:, None] * s_dt_l + offs_h[None, :] * s_dt_h, mask=m, other=0.0).to(ACC)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + offs_h, mask=mh, other=0.0).to(ACC)[None, :]
    if SOFTPLUS:
        dt = _softplus(dt)
    dt = tl.where(m, dt, 0.0)  # (BQ, BH): 0 past the sequence (a = 0: the state passes unchanged)
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(ACC)
    cs = tl.cumsum(dt * A[None, :], axis=0)
    row = (b * nheads + offs_h) * nchunks + c  # (BH,): the row of the (b, h, chunks) buffers
    ptrs = row[None, :] * chunk + offs_q[:, None]
    keep = in_chunk[:, None] & mh[None, :]
    tl.store(delta_ptr + ptrs, dt, mask=keep)
    tl.store(cs_ptr + ptrs, cs, mask=keep)
    last = _last_in_chunk(c, chunk, seqlen)
    gamma = tl.exp(tl.sum(tl.where(offs_q[:, None] == last, cs, 0.0), axis=0))  # (BH,)
    if HAS_SEQ:
        seq_last = _doc_last(seq_ptr, b, s_seq_b, c, chunk, last)
        gamma = tl.where(seq_last == _doc_before(seq_ptr, b, s_seq_b, c, chunk), gamma, 0.0)
    tl.store(gamma_ptr + row, gamma, mask=mh)


@triton.jit
def _ssd_bmm_kernel(
    C_ptr,
    B_ptr,
    cb_ptr,
    seqlen,
    chunk,
    nchunks,
    dstate,
    s_c_b,
    s_c_l,
    s_c_g,
    s_b_b,
    s_b_l,
    s_b_g,
    BL: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # one (BL, BS) tile of CB[l, s] = C_l · B_s for a (b, chunk, group); zero past the sequence.
    # Grid (b * chunks, groups, cdiv(Q, BL) * cdiv(Q, BS)).
    b, c = _chunk_program(nchunks)
    g = tl.program_id(1)
    lb, sb, _ = _split_pid(chunk, BS)
    offs_l = lb * BL + tl.arange(0, BL)
    offs_s = sb * BS + tl.arange(0, BS)
    pos_l, ml = _positions(c, chunk, offs_l, seqlen)
    pos_s, ms = _positions(c, chunk, offs_s, seqlen)
    C_base = C_ptr + b * s_c_b + g * s_c_g + pos_l[:, None] * s_c_l  # (BL, n)
    B_base = B_ptr + b * s_b_b + g * s_b_g + pos_s[None, :] * s_b_l  # (n, BS)
    acc = _dot_over_n(C_base, ml, B_base, ms, dstate, BL, BS, BN, DOT, IEEE, ACC)
    out = _cb_base(cb_ptr, b, c, nchunks, tl.num_programs(1), g, chunk)
    tl.store(
        out + offs_l[:, None] * chunk + offs_s[None, :], acc, mask=(offs_l < chunk)[:, None] & (offs_s < chunk)[None, :]
    )


@triton.jit
def _ssd_chunk_state_kernel(
    x_ptr,
    B_ptr,
    delta_ptr,
    cs_ptr,
    seq_ptr,
    S_ptr,
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
    s_b_b,
    s_b_l,
    s_b_g,
    s_seq_b,
    BP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # one (BP, BN) tile of S_c = sum_s exp(cs_E - cs_s) Δ_s x_s B_s^T (positions of E's document only) for a
    # (b, chunk, head). Grid (b * chunks, h, cdiv(p, BP) * cdiv(n, BN)).
    b, c, hh, g = _head_program(nchunks, heads_per_group)
    pb, nb, _ = _split_pid(dstate, BN)
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = nb * BN + tl.arange(0, BN)
    mp, mn = offs_p < headdim, offs_n < dstate
    row = _row_start(b, hh, nheads, nchunks, c, chunk)
    last = _last_in_chunk(c, chunk, seqlen)
    cs_last = tl.load(cs_ptr + row + last)
    if HAS_SEQ:
        seq_last = _doc_last(seq_ptr, b, s_seq_b, c, chunk, last)
    acc = tl.zeros((BP, BN), dtype=ACC)
    for k0 in range(0, chunk, BK):
        offs_k = k0 + tl.arange(0, BK)
        pos, mk = _positions(c, chunk, offs_k, seqlen)
        xt = _tile(x_ptr + b * s_x_b + hh * s_x_h, pos, s_x_l, offs_p, s_x_p, mk, mp)  # (BK, BP)
        bt = _tile(B_ptr + b * s_b_b + g * s_b_g, pos, s_b_l, offs_n, 1, mk, mn)  # (BK, BN)
        keep = mk
        if HAS_SEQ:
            keep &= _doc_of(seq_ptr, b, s_seq_b, pos, mk) == seq_last
        cs = tl.load(cs_ptr + row + offs_k, mask=mk, other=0.0)
        w = tl.load(delta_ptr + row + offs_k, mask=mk, other=0.0) * _decay(cs_last, cs, keep)  # (BK,)
        acc += _dot(tl.trans((xt * w[:, None]).to(DOT)), bt.to(DOT), IEEE)
    out = _state_base(S_ptr, b, c, nchunks, nheads, hh, headdim, dstate)
    _store_state_tile(out, acc, offs_p, offs_n, mp, mn, dstate)


@triton.jit
def _ssd_state_fwd_kernel(
    S_ptr,
    gamma_ptr,
    init_ptr,
    H_ptr,
    final_ptr,
    nheads,
    nchunks,
    state_size,
    BLOCK: tl.constexpr,
    HAS_INIT: tl.constexpr,
    ACC: tl.constexpr,
):
    # the states entering the chunks, H_0 = initial state (or 0), H_{c+1} = γ_c H_c + S_c, for BLOCK of the p·n state
    # entries of a (b, head); H_c stored in H's dtype (a matmul operand), the state after the last chunk in ACC.
    # Grid (b, h, cdiv(p·n, BLOCK)).
    b = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = offs < state_size
    if HAS_INIT:
        state = tl.load(init_ptr + (b * nheads + hh) * state_size + offs, mask=m, other=0.0).to(ACC)
    else:
        state = tl.zeros((BLOCK,), dtype=ACC)
    for c in range(nchunks):
        base = ((b * nchunks + c) * nheads + hh) * state_size
        tl.store(H_ptr + base + offs, state.to(H_ptr.dtype.element_ty), mask=m)
        gamma = tl.load(gamma_ptr + (b * nheads + hh) * nchunks + c)
        state = gamma * state + tl.load(S_ptr + base + offs, mask=m, other=0.0)
    tl.store(final_ptr + (b * nheads + hh) * state_size + offs, state, mask=m)


@triton.jit
def _ssd_chunk_scan_fwd_kernel(
    x_ptr,
    z_ptr,
    C_ptr,
    D_ptr,
    cb_ptr,
    H_ptr,
    delta_ptr,
    cs_ptr,
    seq_ptr,
    out_ptr,
    ypre_ptr,
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
    s_z_b,
    s_z_l,
    s_z_h,
    s_z_p,
    s_c_b,
    s_c_l,
    s_c_g,
    s_seq_b,
    BL: tl.constexpr,
    BS: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_D: tl.constexpr,
    D_PER_P: tl.constexpr,
    HAS_Z: tl.constexpr,
    STORE_Y: tl.constexpr,
    HAS_SEQ: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    ACC: tl.constexpr,
):
    # one (BL, BP) tile of the output of a (b, chunk, head): the entering state's part exp(cs_l) H_c C_l, the
    # chunk's own inputs sum_{s<=l} CB[l, s] exp(cs_l - cs_s) Δ_s x_s, + D x, then · silu(z). ``out`` and ``ypre``
    # (y before the gate, kept for the backward when STORE_Y) are contiguous (b, L, h, p).
    # Grid (cdiv(Q, BL) * cdiv(p, BP), h, b * chunks): the tiles of one (b, chunk, head) run next to each other (they
    # read its entering state and inputs while these are in L2), and then the group's other heads (its C·B^T).
    bc = tl.program_id(2)
    b, c = (bc // nchunks).to(tl.int64), bc % nchunks
    hh = tl.program_id(1)
    g = hh // heads_per_group
    nbp = tl.cdiv(headdim, BP)
    lb, pb = tl.program_id(0) // nbp, tl.program_id(0) % nbp
    l0 = lb * BL
    offs_l = l0 + tl.arange(0, BL)
    offs_p = pb * BP + tl.arange(0, BP)
    pos_l, ml = _positions(c, chunk, offs_l, seqlen)
    mp = offs_p < headdim
    row = _row_start(b, hh, nheads, nchunks, c, chunk)
    cs_l = _row_load(cs_ptr + row, offs_l, chunk)
    keep_l = ml
    if HAS_SEQ:
        seq_l = _doc_of(seq_ptr, b, s_seq_b, pos_l, ml)
        keep_l &= seq_l == _doc_before(seq_ptr, b, s_seq_b, c, chunk)
    # the entering state: (BL, n) @ (n, BP)
    C_base = C_ptr + b * s_c_b + g * s_c_g + pos_l[:, None] * s_c_l
    H_base = _state_base(H_ptr, b, c, nchunks, nheads, hh, headdim, dstate) + offs_p[None, :] * dstate
    acc = _dot_over_n(C_base, ml, H_base, mp, dstate, BL, BP, BN, DOT, IEEE, ACC)
    acc = acc * tl.where(keep_l, tl.exp(cs_l), 0.0)[:, None]
    # the chunk's own inputs: (BL, BS) @ (BS, BP) for s up to the tile's last row (and the sequence's end). The
    # operand pointers step by BS; one mask, offs_k < limit - s0, bounds every load (limit: the chunk's positions
    # inside the sequence); padding loads as 0 (Δ = 0 there), so the pair mask is the causal one (and the documents')
    limit = tl.minimum(chunk, seqlen - c * chunk)
    offs_k = tl.arange(0, BS)
    cb_ptrs = _cb_base(cb_ptr, b, c, nchunks, nheads // heads_per_group, g, chunk) + offs_l[:, None] * chunk
    cb_ptrs += offs_k[None, :]
    x_base = x_ptr + b * s_x_b + hh * s_x_h
    x_ptrs = x_base + (c * chunk + offs_k)[:, None] * s_x_l + offs_p[None, :] * s_x_p
    cs_ptrs = cs_ptr + row + offs_k
    dl_ptrs = delta_ptr + row + offs_k
    if HAS_SEQ:
        sq_ptrs = seq_ptr + b * s_seq_b + c * chunk + offs_k
    for s0 in range(0, tl.minimum(limit, l0 + BL), BS):
        mk = offs_k < limit - s0
        cb = tl.load(cb_ptrs, mask=ml[:, None] & mk[None, :], other=0.0)
        cs_s = tl.load(cs_ptrs, mask=mk, other=0.0)
        dl_s = tl.load(dl_ptrs, mask=mk, other=0.0)
        keep = (s0 + offs_k)[None, :] <= offs_l[:, None]
        if HAS_SEQ:
            keep &= tl.load(sq_ptrs, mask=mk, other=-1)[None, :] == seq_l[:, None]
            sq_ptrs += BS
        w = cb * _decay(cs_l[:, None], cs_s[None, :], keep) * dl_s[None, :]
        xs = tl.load(x_ptrs, mask=mk[:, None] & mp[None, :], other=0.0)
        acc += _dot(w.to(DOT), xs.to(DOT), IEEE)
        cb_ptrs += BS
        x_ptrs += BS * s_x_l
        cs_ptrs += BS
        dl_ptrs += BS
    m = ml[:, None] & mp[None, :]
    if HAS_D:
        xl = _tile(x_base, pos_l, s_x_l, offs_p, s_x_p, ml, mp).to(ACC)
        if D_PER_P:
            acc += xl * tl.load(D_ptr + hh * headdim + offs_p, mask=mp, other=0.0).to(ACC)[None, :]
        else:
            acc += xl * tl.load(D_ptr + hh).to(ACC)
    out_offs = ((b * seqlen + pos_l[:, None]) * nheads + hh) * headdim + offs_p[None, :]
    if HAS_Z:
        if STORE_Y:
            tl.store(ypre_ptr + out_offs, acc.to(ypre_ptr.dtype.element_ty), mask=m)
        zt = _tile(z_ptr + b * s_z_b + hh * s_z_h, pos_l, s_z_l, offs_p, s_z_p, ml, mp).to(ACC)
        acc = acc * zt / (1.0 + tl.exp(-zt))
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=m)
