"""Triton SSD (Mamba-2): launchers, tiles and the autograd op; the kernels are in ``ssd_fwd`` and ``ssd_bwd``.

Forward: five launches (Δ and cumulative decays; C·B^T per group; each chunk's end state; the states passed along the
chunks; the outputs). Saved for backward: the inputs, the document counter and, with z, y before the gate (as
mamba-ssm keeps it); everything else (Δ, decays, C·B^T, the chunk states) is recomputed by the same forward kernels,
so the op keeps no (chunks, h, p, n) state tensors between forward and backward.

Backward: those four recomputations, then seven launches (``ssd_bwd``'s docstring has the math). Sums across
programs are partial buffers added in a fixed order, never atomics: the gradients are bitwise reproducible whatever
``deterministic`` says (the argument exists for the common kernel signature).

Every device runs the same tiles (``CONFIG``); the interpreter runs them too, clamped to the problem (a tile is at
least 16 wide, the smallest ``tl.dot`` operand, and at most the next power of two of its dimension). Under the
interpreter bf16 matmul operands are widened to fp32 (its ``tl.dot`` has no bf16); loads and stores keep bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from anytrain import hardware
from anytrain.kernels import ops
from anytrain.kernels.launch import launch
from anytrain.kernels.ssd_bwd import (
    _ssd_bwd_db_kernel,
    _ssd_bwd_dc_kernel,
    _ssd_bwd_dcb_kernel,
    _ssd_bwd_dstate_kernel,
    _ssd_bwd_dx_kernel,
    _ssd_bwd_finish_kernel,
    _ssd_state_bwd_kernel,
)
from anytrain.kernels.ssd_fwd import (
    _ssd_bmm_kernel,
    _ssd_chunk_scan_fwd_kernel,
    _ssd_chunk_state_kernel,
    _ssd_cumsum_kernel,
    _ssd_state_fwd_kernel,
)

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def _pow2(v: int) -> bool:
    return v >= 16 and v & (v - 1) == 0


@dataclass(frozen=True)
class SSDConfig:
    """Tiles of the SSD kernels (powers of two >= 16; each is clamped to its dimension's next power of two)."""

    block_l: int = 64
    """Forward output: positions per program (rows of the C·B^T and state matmuls)."""
    block_s: int = 64
    """Forward output: inner positions per step (the K of the (block_l, block_s) @ (block_s, p) matmul)."""
    block_n: int = 128
    """dstate tile: the K of the entering-state matmul, the n tile of the chunk state and of the backward's dB/dC."""
    block_p: int = 64
    """headdim tile of the chunk state and of the backward's output-side state gradient."""
    block_k: int = 64
    """Chunk state: positions per step; C·B^T: the dstate step."""
    block_state: int = 2048
    """State passing (both directions): state entries (of p·n) per program."""
    block_t: int = 64
    """Backward: position tiles of dCB, dx, dB and dC."""
    heads_per_program: int = 8
    """Backward: heads of a group summed by one dCB / dB / dC program (the runs' partial sums are added after)."""
    num_warps: int = 4
    """Warps of the matmul kernels."""
    num_stages: int = 2
    """Software-pipeline stages of the matmul kernels' loops."""
    scan_warps: int = 0
    """Warps of the forward output kernel (the chunk scan); 0: ``num_warps``."""
    scan_stages: int = 0
    """Software-pipeline stages of the forward output kernel's loop; 0: ``num_stages``."""

    def __post_init__(self) -> None:
        for name in ("block_l", "block_s", "block_n", "block_p", "block_k", "block_state", "block_t"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"SSDConfig.{name} must be a power of 2 >= 16, got {getattr(self, name)}")
        if self.scan_warps < 0 or self.scan_stages < 0:
            raise ValueError(
                f"SSDConfig.scan_warps / scan_stages must be >= 0, got {self.scan_warps} / {self.scan_stages}"
            )
        if self.heads_per_program < 1:
            raise ValueError(f"SSDConfig.heads_per_program must be >= 1, got {self.heads_per_program}")


CONFIG = SSDConfig()


def _fit(block: int, size: int) -> int:
    return min(block, max(16, triton.next_power_of_2(size)))


def _unit_last(t: Tensor | None) -> Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _acc_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def document_counter(seq_idx: Tensor) -> Tensor:
    """(b, L) document ids -> (b, L) int32 counter that starts at 0 and grows by one wherever the id changes: the
    kernels compare it for equality, which then means 'same document' even where an id comes back later."""
    starts = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return torch.cat([starts.new_zeros(seq_idx.shape[0], 1), starts.cumsum(1, dtype=torch.int32)], dim=1).contiguous()


@dataclass
class _Shape:
    """The problem's sizes and the tiles and dtypes the launchers derive from them."""

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    chunk: int
    nchunks: int
    acc: torch.dtype
    dot: torch.dtype
    cfg: SSDConfig

    @classmethod
    def of(cls, x: Tensor, B: Tensor, C: Tensor, chunk: int, acc: torch.dtype, cfg: SSDConfig) -> _Shape:
        b, L, h, p = x.shape
        dot = (
            torch.float64
            if acc == torch.float64
            else torch.promote_types(torch.promote_types(x.dtype, B.dtype), C.dtype)
        )
        if dot == torch.bfloat16 and hardware.triton_interpreted():
            dot = torch.float32  # the interpreter's tl.dot multiplies bf16 as raw integers (numpy has no bf16)
        return cls(b, L, h, p, B.shape[2], B.shape[3], chunk, triton.cdiv(L, chunk), acc, dot, cfg)

    @property
    def per_group(self) -> int:
        return self.nheads // self.ngroups

    @property
    def meta(self) -> dict:
        """The constexprs and launch options every matmul kernel takes."""
        return {
            "DOT": _TL[self.dot],
            "IEEE": self.dot in (torch.float32, torch.float64),
            "ACC": _TL[self.acc],
            "num_warps": self.cfg.num_warps,
            "num_stages": self.cfg.num_stages,
        }

    def block(self, name: str, size: int) -> int:
        return _fit(getattr(self.cfg, name), size)


def _seq_args(seq: Tensor | None, like: Tensor) -> tuple[Tensor, int]:
    return (seq, seq.stride(0)) if seq is not None else (like, 0)


def _head_blocks(chunk: int, nheads: int) -> tuple[int, int]:
    """(BQ, BH) of the per-(b, chunk, block of heads) kernels: the whole chunk and up to 4096 // BQ heads."""
    BQ = triton.next_power_of_2(chunk)
    return BQ, max(1, min(triton.next_power_of_2(nheads), 4096 // BQ))


def _decays(sh: _Shape, dt: Tensor, A: Tensor, dt_bias: Tensor | None, softplus: bool, seq: Tensor | None):
    """Δ and cs (b, h, chunks, Q) and γ (b, h, chunks), in the accumulation dtype."""
    b, h, nc, Q = sh.batch, sh.nheads, sh.nchunks, sh.chunk
    delta = torch.empty((b, h, nc, Q), device=dt.device, dtype=sh.acc)
    cs = torch.empty_like(delta)
    gamma = torch.empty((b, h, nc), device=dt.device, dtype=sh.acc)
    seq_t, s_seq = _seq_args(seq, dt)
    BQ, BH = _head_blocks(Q, h)
    launch(
        _ssd_cumsum_kernel,
        (b, nc, triton.cdiv(h, BH)),
        dt,
        dt_bias if dt_bias is not None else A,
        A,
        seq_t,
        delta,
        cs,
        gamma,
        sh.seqlen,
        h,
        Q,
        nc,
        *dt.stride(),
        s_seq,
        BQ=BQ,
        BH=BH,
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=softplus,
        HAS_SEQ=seq is not None,
        ACC=_TL[sh.acc],
        num_warps=4,
    )
    return delta, cs, gamma


def _cb(sh: _Shape, B: Tensor, C: Tensor) -> Tensor:
    """C_l · B_s per (b, chunk, group): (b, chunks, g, Q, Q) in the accumulation dtype."""
    Q = sh.chunk
    cb = torch.empty((sh.batch, sh.nchunks, sh.ngroups, Q, Q), device=B.device, dtype=sh.acc)
    BT = sh.block("block_t", Q)
    nt = triton.cdiv(Q, BT)
    launch(
        _ssd_bmm_kernel,
        (sh.batch * sh.nchunks, sh.ngroups, nt * nt),
        C,
        B,
        cb,
        sh.seqlen,
        Q,
        sh.nchunks,
        sh.dstate,
        C.stride(0),
        C.stride(1),
        C.stride(2),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        BL=BT,
        BS=BT,
        BN=sh.block("block_k", sh.dstate),
        **sh.meta,
    )
    return cb


def _states(sh: _Shape, x, B, delta, cs, gamma, seq, init) -> tuple[Tensor, Tensor]:
    """The states entering the chunks, (b, chunks, h, p, n) in the matmul dtype, and the final state (b, h, p, n)
    in the accumulation dtype."""
    b, h, p, n, nc = sh.batch, sh.nheads, sh.headdim, sh.dstate, sh.nchunks
    S = torch.empty((b, nc, h, p, n), device=x.device, dtype=sh.acc)
    BP, BN = sh.block("block_p", p), sh.block("block_n", n)
    seq_t, s_seq = _seq_args(seq, x)
    launch(
        _ssd_chunk_state_kernel,
        (b * nc, h, triton.cdiv(p, BP) * triton.cdiv(n, BN)),
        x,
        B,
        delta,
        cs,
        seq_t,
        S,
        sh.seqlen,
        h,
        sh.per_group,
        p,
        n,
        sh.chunk,
        nc,
        *x.stride(),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        s_seq,
        BP=BP,
        BN=BN,
        BK=sh.block("block_k", sh.chunk),
        HAS_SEQ=seq is not None,
        **sh.meta,
    )
    H = torch.empty((b, nc, h, p, n), device=x.device, dtype=sh.dot)
    final = torch.empty((b, h, p, n), device=x.device, dtype=sh.acc)
    BLOCK = _fit(sh.cfg.block_state, p * n)
    launch(
        _ssd_state_fwd_kernel,
        (b, h, triton.cdiv(p * n, BLOCK)),
        S,
        gamma,
        init if init is not None else S,
        H,
        final,
        h,
        nc,
        p * n,
        BLOCK=BLOCK,
        HAS_INIT=init is not None,
        ACC=_TL[sh.acc],
        num_warps=4,
    )
    return H, final


def _forward(x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, cfg, store_y):
    """(out, final state, y before the gate or None, the recomputable intermediates) of the whole forward."""
    acc = _acc_dtype(x, dt, A, B, C, D, z, dt_bias, init)
    sh = _Shape.of(x, B, C, chunk, acc, cfg)
    delta, cs, gamma = _decays(sh, dt, A, dt_bias, softplus, seq)
    cb = _cb(sh, B, C)
    H, final = _states(sh, x, B, delta, cs, gamma, seq, init)
    b, L, h, p = x.shape
    out = torch.empty((b, L, h, p), device=x.device, dtype=x.dtype)
    ypre = torch.empty_like(out) if z is not None and store_y else None
    zz = z if z is not None else x
    BL, BP = sh.block("block_l", chunk), sh.block("block_p", p)
    if b * sh.nchunks > 65535:  # the output kernel's third grid axis
        raise ValueError(f"SSD: batch x chunks is {b * sh.nchunks}, over 65,535; split the micro-batch")
    seq_t, s_seq = _seq_args(seq, x)
    launch(
        _ssd_chunk_scan_fwd_kernel,
        (triton.cdiv(chunk, BL) * triton.cdiv(p, BP), h, b * sh.nchunks),
        x,
        zz,
        C,
        D if D is not None else A,
        cb,
        H,
        delta,
        cs,
        seq_t,
        out,
        ypre if ypre is not None else out,
        L,
        h,
        sh.per_group,
        p,
        sh.dstate,
        chunk,
        sh.nchunks,
        *x.stride(),
        *zz.stride(),
        C.stride(0),
        C.stride(1),
        C.stride(2),
        s_seq,
        BL=BL,
        BS=sh.block("block_s", chunk),
        BP=BP,
        BN=sh.block("block_n", sh.dstate),
        HAS_D=D is not None,
        D_PER_P=D is not None and D.dim() == 2,
        HAS_Z=z is not None,
        STORE_Y=ypre is not None,
        HAS_SEQ=seq is not None,
        **{**sh.meta, "num_warps": cfg.scan_warps or cfg.num_warps, "num_stages": cfg.scan_stages or cfg.num_stages},
    )
    return out, final, ypre


def _backward(dout, dfinal, x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, ypre, cfg):
    """Gradients (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states); None for absent inputs."""
    acc = _acc_dtype(x, dt, A, B, C, D, z, dt_bias, init)
    sh = _Shape.of(x, B, C, chunk, acc, cfg)
    b, L, h, p = x.shape
    g, n, nc, Q, r = sh.ngroups, sh.dstate, sh.nchunks, chunk, sh.per_group
    dev = x.device
    delta, cs, gamma = _decays(sh, dt, A, dt_bias, softplus, seq)
    cb = _cb(sh, B, C)
    H, _ = _states(sh, x, B, delta, cs, gamma, seq, init)
    seq_t, s_seq = _seq_args(seq, x)
    meta = sh.meta
    # dz, dy and the entering states' gradient from the outputs
    if z is not None:
        dz = torch.empty((b, L, h, p), device=dev, dtype=z.dtype)
        dy = torch.empty((b, L, h, p), device=dev, dtype=sh.dot)
    else:
        dz, dy = None, dout
    dH = torch.empty((b, nc, h, p, n), device=dev, dtype=acc)
    BP, BN = sh.block("block_p", p), sh.block("block_n", n)
    zz = z if z is not None else dout
    launch(
        _ssd_bwd_dstate_kernel,
        (b * nc, h, triton.cdiv(p, BP) * triton.cdiv(n, BN)),
        dout,
        zz,
        ypre if ypre is not None else dout,
        C,
        cs,
        seq_t,
        dz if dz is not None else dH,
        dy if z is not None else dH,
        dH,
        L,
        h,
        r,
        p,
        n,
        Q,
        nc,
        *dout.stride(),
        *zz.stride(),
        C.stride(0),
        C.stride(1),
        C.stride(2),
        s_seq,
        BL=sh.block("block_t", Q),
        BP=BP,
        BN=BN,
        HAS_Z=z is not None,
        HAS_SEQ=seq is not None,
        **meta,
    )
    # the state passing backwards: dS_c = dH̄_{c+1}, u_c, d initial state
    BLOCK = _fit(cfg.block_state, p * n)
    nblk = triton.cdiv(p * n, BLOCK)
    dS = torch.empty((b, nc, h, p, n), device=dev, dtype=sh.dot)
    u = torch.empty((b, h, nc, nblk), device=dev, dtype=acc)
    dinit = torch.empty((b, h, p, n), device=dev, dtype=acc) if init is not None else None
    launch(
        _ssd_state_bwd_kernel,
        (b, h, nblk),
        dH,
        H,
        gamma,
        dfinal if dfinal is not None else dH,
        dS,
        u,
        dinit if dinit is not None else dH,
        h,
        nc,
        p * n,
        BLOCK=BLOCK,
        HAS_DFINAL=dfinal is not None,
        HAS_INIT=init is not None,
        ACC=_TL[acc],
        num_warps=4,
    )
    BT = sh.block("block_t", Q)
    nt = triton.cdiv(Q, BT)
    hps = min(cfg.heads_per_program, r)
    nsplit = triton.cdiv(r, hps)
    # dCB per group (summed over runs of heads) and the cs gradients of the C·B^T term
    dcb = torch.empty((nsplit, b, nc, g, Q, Q), device=dev, dtype=acc)
    dcs = torch.empty((b, h, nc, nt, Q), device=dev, dtype=acc)
    BPf = max(16, triton.next_power_of_2(p))

    def launch_runs(kernel, tiles, tensors, sizes, strides, **blocks):
        # the kernels that sum over runs of hps heads of a group: grid (b * chunks, g * splits, tiles)
        launch(
            kernel,
            (b * nc, g * nsplit, tiles),
            *tensors,
            b,
            L,
            h,
            r,
            p,
            *sizes,
            Q,
            nc,
            nsplit,
            *strides,
            s_seq,
            BT=BT,
            BP=_fit(64, p),
            HPS=hps,
            HAS_SEQ=seq is not None,
            **blocks,
            **meta,
        )

    launch_runs(_ssd_bwd_dcb_kernel, nt * nt, (dy, x, cb, delta, cs, seq_t, dcb, dcs), (), (*dy.stride(), *x.stride()))
    dcb = dcb[0] if nsplit == 1 else dcb.sum(0)
    # dx, x · dx̃, q and dD's partials
    dx = torch.empty((b, L, h, p), device=dev, dtype=x.dtype)
    ddelta = torch.empty((b, h, nc, Q), device=dev, dtype=acc)
    q = torch.empty_like(ddelta)
    dD = torch.empty((b, nc, nt, h, p), device=dev, dtype=acc) if D is not None else None
    launch(
        _ssd_bwd_dx_kernel,
        (b * nc, h, nt),
        x,
        dy,
        B,
        D if D is not None else A,
        cb,
        dS,
        delta,
        cs,
        seq_t,
        dx,
        ddelta,
        q,
        dD if dD is not None else q,
        L,
        h,
        r,
        p,
        n,
        Q,
        nc,
        *x.stride(),
        *dy.stride(),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        s_seq,
        BT=BT,
        BP=BPf,
        BN=BN,
        HAS_D=D is not None,
        D_PER_P=D is not None and D.dim() == 2,
        HAS_SEQ=seq is not None,
        **meta,
    )
    # dB and dC, per run of heads
    nnb = triton.cdiv(n, BN)
    part_dtype = B.dtype if nsplit == 1 else acc
    dB = torch.empty((nsplit, b, L, g, n), device=dev, dtype=part_dtype)
    launch_runs(
        _ssd_bwd_db_kernel,
        nt * nnb,
        (x, C, dcb, dS, delta, cs, seq_t, dB),
        (n,),
        (*x.stride(), *C.stride()[:3]),
        BN=BN,
    )
    dC = torch.empty((nsplit, b, L, g, n), device=dev, dtype=C.dtype if nsplit == 1 else acc)
    v = torch.empty((b, h, nc, nnb, Q), device=dev, dtype=acc)
    launch_runs(
        _ssd_bwd_dc_kernel,
        nt * nnb,
        (dy, B, C, dcb, H, cs, seq_t, dC, v),
        (n,),
        (*dy.stride(), *B.stride()[:3], *C.stride()[:3]),
        BN=BN,
    )
    # ddt, dA, d dt_bias
    ddt = torch.empty((b, L, h), device=dev, dtype=dt.dtype)
    dA = torch.empty((b, nc, h), device=dev, dtype=acc)
    dbias = torch.empty_like(dA)
    BQ, BH = _head_blocks(Q, h)
    launch(
        _ssd_bwd_finish_kernel,
        (b, nc, triton.cdiv(h, BH)),
        A,
        delta,
        ddelta,
        dcs,
        v,
        q,
        u,
        ddt,
        dA,
        dbias,
        L,
        h,
        Q,
        nc,
        nt,
        nnb,
        nblk,
        BQ=BQ,
        BH=BH,
        SOFTPLUS=softplus,
        ACC=_TL[acc],
        num_warps=4,
    )
    dB = (dB[0] if nsplit == 1 else dB.sum(0)).to(B.dtype)
    dC = (dC[0] if nsplit == 1 else dC.sum(0)).to(C.dtype)
    if D is not None:
        dD = dD.sum((0, 1, 2))
        dD = (dD if D.dim() == 2 else dD.sum(-1)).to(D.dtype)
    dbias = None if dt_bias is None else dbias.sum((0, 1)).to(dt_bias.dtype)
    dinit = None if dinit is None else dinit.to(init.dtype)
    return dx, ddt, dA.sum((0, 1)).to(A.dtype), dB, dC, dD, dz, dbias, dinit


class _SSDFn(torch.autograd.Function):
    """The op in eager code (and with a non-default ``config``, which the custom ops below do not take)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, return_final, cfg):
        store_y = z is not None and any(ctx.needs_input_grad)
        out, final, ypre = _forward(x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, cfg, store_y)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, seq, init, ypre)
        ctx.chunk, ctx.softplus, ctx.cfg = chunk, softplus, cfg
        if not return_final:
            return out
        return out, final

    @staticmethod
    def backward(ctx, dout, dfinal=None):
        x, dt, A, B, C, D, z, dt_bias, seq, init, ypre = ctx.saved_tensors
        grads = _backward(
            dout, dfinal, x, dt, A, B, C, ctx.chunk, D, z, dt_bias, ctx.softplus, seq, init, ypre, ctx.cfg
        )
        dx, ddt, dA, dB, dC, dD, dz, dbias, dinit = grads
        return dx, ddt, dA, dB, dC, None, dD, dz, dbias, None, None, dinit, None, None


# Under torch.compile the op is the custom ops ``anytrain::ssd_fwd`` / ``anytrain::ssd_bwd`` (torch.library, opaque
# to the compiler, with fake kernels): a compiled block keeps one graph around it, and a checkpointed compiled block
# (train.activation_checkpointing) recomputes inside its graph; a torch.compiler.disable'd op would break the graph
# there, and dynamo then runs the whole checkpointed block eagerly. Absent outputs are 0-element tensors.
_OPTIONAL = "Tensor? D, Tensor? z, Tensor? dt_bias, bool softplus, Tensor? seq, Tensor? init"
_FWD_SCHEMA = f"(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, int chunk, {_OPTIONAL}) -> (Tensor, Tensor, Tensor)"
_BWD_SCHEMA = (
    f"(Tensor dout, Tensor? dfinal, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, int chunk, {_OPTIONAL}, "
    "Tensor? ypre) -> (" + ", ".join(["Tensor"] * 9) + ")"
)


def _none_as_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


def _forward_op(x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init):
    out, final, ypre = _forward(x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, CONFIG, z is not None)
    return out, final, _none_as_empty(ypre, x)


def _backward_op(dout, dfinal, x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, ypre):
    grads = _backward(dout, dfinal, x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, ypre, CONFIG)
    return tuple(_none_as_empty(g, x) for g in grads)


def _register_custom_ops() -> bool:
    """``anytrain::ssd_fwd`` / ``ssd_bwd`` (torch >= 2.4); False where the API is missing."""
    pair = ops.define_op_pair("ssd", _forward_op, _FWD_SCHEMA, _backward_op, _BWD_SCHEMA)
    if pair is None:
        return False
    fwd_op, bwd_op = pair

    @fwd_op.register_fake
    def _(x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init):
        b, _, h, p = x.shape
        acc = _acc_dtype(x, dt, A, B, C, D, z, dt_bias, init)
        ypre = x.new_empty(x.shape) if z is not None else x.new_empty(0)  # contiguous, as the kernels write them
        return x.new_empty(x.shape), x.new_empty((b, h, p, B.shape[3]), dtype=acc), ypre

    @bwd_op.register_fake
    def _(dout, dfinal, x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init, ypre):
        given = (x, dt, A, B, C, D, z, dt_bias, init)
        return tuple(x.new_empty(0) if t is None else t.new_empty(t.shape) for t in given)  # contiguous

    def setup_context(ctx, inputs, output):
        x, dt, A, B, C, chunk, D, z, dt_bias, softplus, seq, init = inputs
        ypre = output[2] if z is not None else None
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, seq, init, ypre)
        ctx.chunk, ctx.softplus = chunk, softplus
        ctx.mark_non_differentiable(output[2])
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, dfinal, _unused):
        x, dt, A, B, C, D, z, dt_bias, seq, init, ypre = ctx.saved_tensors
        grads = torch.ops.anytrain.ssd_bwd(
            dout, dfinal, x, dt, A, B, C, ctx.chunk, D, z, dt_bias, ctx.softplus, seq, init, ypre
        )
        inputs = (x, dt, A, B, C, D, z, dt_bias, init)
        dx, ddt, dA, dB, dC, dD, dz, dbias, dinit = (
            g if t is not None else None for g, t in zip(grads, inputs, strict=True)
        )
        return dx, ddt, dA, dB, dC, None, dD, dz, dbias, None, None, dinit

    torch.library.register_autograd("anytrain::ssd_fwd", backward, setup_context=setup_context)
    return True


HAS_CUSTOM_OP = _register_custom_ops()


@torch.compiler.disable
def _ssd_eager(*args):
    """``_SSDFn`` kept out of compiled graphs (a non-default ``config`` inside compiled code, or no custom-op API)."""
    return _SSDFn.apply(*args)


def ssd_chunk_scan_triton(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    seq_idx: Tensor | None = None,
    initial_states: Tensor | None = None,
    return_final_states: bool = False,
    config: SSDConfig | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Triton SSD; see ``anytrain.kernels.ssd.ssd_chunk_scan`` for the semantics and shapes. ``config`` overrides
    the tiles (benchmarks). The backward has no atomics, so it is deterministic whatever ``kernels.deterministic``
    says. Inside compiled code it is the custom op ``anytrain::ssd_fwd`` (one node of the graph)."""
    B, C = _unit_last(B), _unit_last(C)
    D = None if D is None else D.contiguous()
    dt_bias = None if dt_bias is None else dt_bias.contiguous()
    init = None if initial_states is None else initial_states.contiguous()
    seq = None if seq_idx is None or x.shape[1] < 2 else document_counter(seq_idx)
    args = (x, dt, A.contiguous(), B, C, int(chunk_size), D, z, dt_bias, bool(dt_softplus), seq, init)
    if torch.compiler.is_compiling():
        if HAS_CUSTOM_OP and config is None:
            out, final, _ = torch.ops.anytrain.ssd_fwd(*args)
            return (out, final) if return_final_states else out
        return _ssd_eager(*args, bool(return_final_states), config or CONFIG)
    return _SSDFn.apply(*args, bool(return_final_states), config or CONFIG)
