"""Triton selective scan (Mamba-1 SSM): launchers, tiles and the autograd op.

Forward (``selective_scan_fwd._ss_fwd_kernel``): programs of ``block_d`` channels walk chunks of
``segments`` x ``steps_per_thread`` steps, one segment per lane; a runtime loop over the states accumulates the output
in registers; per state an in-thread scan per segment, one cross-lane scan of the segment aggregates and a
``tl.gather`` for each segment's start state. State math is fp32 (fp64 for fp64 inputs, interpreter tests).

Saved for backward: the inputs and the state every ``SAVE_EVERY`` = 8 steps, (batch, dim, dstate, nsub) fp32 (unit
stride over nsub); entry k is the state after step 8 (k + 1) - 1, the last one the final state (``last_state``).

Backward (``selective_scan_bwd._ss_bwd_kernel``): recomputes the states from the saved ones, 8 steps per thread
(one saved-state interval), ``segments_bwd`` lanes per channel, ``block_d_bwd`` channels per program.
  Adjoint g_t = exp(delta_{t+1} A) g_{t+1} + C_t dy_t, hm_t = g_t exp(delta_t A) h_{t-1}, and
  du_t = delta_t sum_n g B + D dy,   ddelta_t = u_t sum_n g B + sum_n A hm,   dA = sum_{b,t} delta hm,
  dB_t = sum_d g delta u,   dC_t = sum_d dy h.
dB/dC reduce over the channels of a group: per program in registers, then across programs with fp32 atomics
(default) or, in deterministic mode, through per-program partials (batch, groups, programs, dstate, seqlen) summed in
torch (bitwise reproducible; memory: dim / block_d_bwd times the size of dB). With atomics and dstate <= 2
segments_bwd, dA / dD / ddelta_bias are summed over the batch by atomic adds in the kernel, otherwise per-batch
partials are summed in torch.

Every device runs the same tiles (``CONFIG``): the CUDA-tuned ones. ROCm runs them untuned; the CPU (the Triton
interpreter, tests) runs them so that the tests cover exactly the code the GPUs run. The register caps apply on CUDA
only, the approximate sigmoid (``fastmath``) on GPUs only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from anytrain import hardware
from anytrain.kernels.fastmath import fast_math_ok
from anytrain.kernels.launch import launch
from anytrain.kernels.selective_scan_bwd import _ss_bwd_kernel
from anytrain.kernels.selective_scan_fwd import _ss_fwd_kernel

SAVE_EVERY = 8
"""Steps between the states the forward saves: one backward segment (8 steps per thread, a 16-byte bf16 vector)."""


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class ScanConfig:
    """Tiles of the forward and backward kernels. The defaults are the tuned CUDA tiles (docs/kernels.md), run on every
    device. Layouts are conversion-free when a forward segment is one 16-byte vector (8 bf16 steps) and
    ``segments`` x ``num_warps`` = the lanes of a warp, and when ``block_d_bwd`` x ``segments_bwd`` = the lanes of a
    warp (4 x 8); other powers of two are correct too (the compiler then converts layouts)."""

    block_d: int = 1
    """Forward: channels per program."""
    steps_per_thread: int = 8
    """Forward: steps of a segment, scanned in-thread; divides ``SAVE_EVERY``."""
    segments: int = 32
    """Forward: segments per chunk, one per lane (chunk = segments x steps_per_thread steps). dstate <= segments keeps
    A and the carry between chunks in lanes (no per-state loads, no barrier)."""
    num_warps: int = 1
    """Forward: warps per program."""
    pipeline_stages: int = 2
    """Forward: software-pipeline stages of the per-state B/C loads (asynchronous copies ``stages - 1`` iterations
    ahead)."""
    states_per_iteration: int = 4
    """Forward: states per pipelined iteration (1, 2, 4 or 8), their B/C rows one tile of a chunk-major copy of B and C.
    Applies where it divides dstate and dstate <= ``segments``; otherwise one state per iteration."""
    max_registers: int = 72
    """Forward: register cap per thread (CUDA; 0: the compiler's choice). Applied only to the kernel with
    ``states_per_iteration`` states per iteration (the one it was tuned for)."""
    block_d_bwd: int = 4
    """Backward: channels per program, each on ``segments_bwd`` lanes; 2, 4 or 8 sum dB/dC by a reduce-scatter across
    the lanes before one vector atomic per lane."""
    segments_bwd: int = 8
    """Backward: 8-step segments per chunk and channel, one per lane. dstate <= 2 segments_bwd keeps A, the adjoint
    carry and dA in two lane registers each."""
    num_warps_bwd: int = 1
    """Backward: warps per program."""
    pipeline_stages_bwd: int = 4
    """Backward: software-pipeline stages of the per-state saved-state loads."""
    max_registers_bwd: int = 168
    """Backward: register cap per thread (CUDA; 0: the compiler's choice). 129-168 registers all give 3 warps per
    scheduler on Hopper; 168 is the most that does."""

    def __post_init__(self) -> None:
        for name in ("block_d", "steps_per_thread", "segments", "block_d_bwd", "segments_bwd"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"ScanConfig.{name} must be a power of 2, got {getattr(self, name)}")
        if SAVE_EVERY % self.steps_per_thread or (self.steps_per_thread * self.segments) % SAVE_EVERY:
            raise ValueError(
                f"ScanConfig: steps_per_thread must divide {SAVE_EVERY} and a forward chunk be a multiple of it: {self}"
            )
        if self.states_per_iteration not in (1, 2, 4, 8):
            raise ValueError(f"ScanConfig.states_per_iteration must be 1, 2, 4 or 8, got {self.states_per_iteration}")
        if self.pipeline_stages < 1 or self.pipeline_stages_bwd < 1:
            raise ValueError(f"ScanConfig: pipeline stages must be >= 1: {self}")


CONFIG = ScanConfig()


def default_config() -> ScanConfig:
    """The tiles every device runs (see the module docstring)."""
    return CONFIG


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _acc_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}


def _bf16_pairs(*xs: Tensor) -> bool:
    """bf16 tensors whose every row starts on a 4-byte boundary with an even length: readable as int32 pairs."""
    return all(
        x.dtype == torch.bfloat16
        and x.data_ptr() % 4 == 0
        and x.shape[-1] % 2 == 0
        and all(s % 2 == 0 for s in x.stride()[:-1])
        for x in xs
    )


def _as_groups(x: Tensor) -> Tensor:
    """(batch, N, L) -> (batch, 1, N, L) view; (batch, G, N, L) unchanged. Unit stride along L."""
    return _unit_last(x.unsqueeze(1) if x.dim() == 3 else x)


def _states_per_iteration(cfg: ScanConfig, dstate: int) -> int:
    """The forward's states per pipelined iteration at this dstate: ``cfg.states_per_iteration`` where the carries
    sit in lanes (dstate <= segments) and it divides dstate, else 1."""
    group = cfg.states_per_iteration
    return group if dstate <= cfg.segments and dstate % group == 0 else 1


@triton.jit
def _bc_chunk_major_kernel(
    B_ptr,
    C_ptr,
    out_ptr,
    seqlen,
    s_bb,
    s_bg,
    s_bn,
    s_bl,
    s_cb,
    s_cg,
    s_cn,
    s_cl,
    DSTATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # one (chunk, batch, group) tile of _chunk_major: the B and C rows of all states, zero past seqlen
    c = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2).to(tl.int64)
    n = tl.arange(0, BLOCK_N)[:, None]
    t = c * CHUNK + tl.arange(0, CHUNK)[None, :]
    m = (n < DSTATE) & (t < seqlen)
    row = ((b * tl.num_programs(2) + g) * tl.num_programs(0) + c) * DSTATE + n  # the (batch, G, nchunks, N) row
    out = out_ptr + row * (2 * CHUNK) + tl.arange(0, CHUNK)[None, :]
    x = tl.load(B_ptr + b * s_bb + g * s_bg + n * s_bn + t * s_bl, mask=m, other=0)
    tl.store(out, x.to(out_ptr.dtype.element_ty), mask=n < DSTATE)
    x = tl.load(C_ptr + b * s_cb + g * s_cg + n * s_cn + t * s_cl, mask=m, other=0)
    tl.store(out + CHUNK, x.to(out_ptr.dtype.element_ty), mask=n < DSTATE)


def _chunk_major(Bg: Tensor, Cg: Tensor, chunk: int) -> Tensor:
    """(batch, G, N, L) B and C -> one (batch, G, nchunks, N, 2, chunk) tensor, zero-padded to whole chunks: the B
    and C rows of all states of a chunk in one contiguous block (the grouped forward loads a group's rows as one tile).
    Small next to the (batch, dim, L) inputs: 2 x batch x G x N x L elements; one Triton launch."""
    batch, ngroups, dstate, seqlen = Bg.shape
    nch = triton.cdiv(seqlen, chunk)
    dtype = torch.promote_types(Bg.dtype, Cg.dtype)  # (B and C may differ: neither is rounded to the other's dtype)
    bc = torch.empty((batch, ngroups, nch, dstate, 2, chunk), device=Bg.device, dtype=dtype)
    launch(
        _bc_chunk_major_kernel,
        (nch, batch, ngroups),
        Bg,
        Cg,
        bc,
        seqlen,
        *Bg.stride(),
        *Cg.stride(),
        DSTATE=dstate,
        BLOCK_N=triton.next_power_of_2(dstate),
        CHUNK=chunk,
        num_warps=4,
    )
    return bc


def _fast_math(u: Tensor, acc: torch.dtype) -> bool:
    """The kernels' FAST constexpr (approximate exp and division in the gate's sigmoid): ``fastmath.fast_math_ok``
    (fp32 accumulation, a GPU tensor, not under the Triton interpreter)."""
    return fast_math_ok(u, acc == torch.float32)


def _maxnreg(cap: int) -> dict:
    """The launch option for a per-thread register cap (CUDA only; ``cap`` 0: none)."""
    return {"maxnreg": cap} if cap and hardware.vendor() == hardware.CUDA else {}


def _fwd(
    u, delta, A, Bg, Cg, D, z, delta_bias, softplus: bool, cfg: ScanConfig, *, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Launch the forward: (out, states). u, delta, z and out (batch, dim, L) and Bg, Cg (batch, G, N, L): any
    batch/channel(/group/state) strides, unit stride in time; D, delta_bias: unit stride. ``out`` defaults to a new
    contiguous tensor (it must not overlap the inputs); states are always allocated here."""
    batch, dim, seqlen = u.shape
    ngroups, dstate = Bg.shape[1], A.shape[1]
    dpg = dim // ngroups
    acc = _acc_dtype(u, delta, A, Bg, Cg)
    nsub = triton.cdiv(seqlen, SAVE_EVERY)
    if out is None:
        out = torch.empty((batch, dim, seqlen), device=u.device, dtype=u.dtype)
    # the state every SAVE_EVERY steps, (batch, dim, N, nsub): unit stride over nsub (coalesced stores and loads)
    states = torch.empty((batch, dim, dstate, nsub), device=u.device, dtype=acc)
    zz = z if z is not None else u
    grid = (triton.cdiv(dpg, cfg.block_d), ngroups, batch)
    sub = cfg.steps_per_thread
    chunk = sub * cfg.segments
    even = seqlen % chunk == 0  # whole chunks: unmasked B/C loads
    group = _states_per_iteration(cfg, dstate)
    b_strides = (Bg.stride(0), Bg.stride(1), Bg.stride(2), Cg.stride(0), Cg.stride(1), Cg.stride(2))
    if group > 1:  # B/C rows of a group of states as one block: (batch, G, nchunks, N, 2, chunk), zero-padded
        Bg = Cg = _chunk_major(Bg, Cg, chunk)
        b_strides = (Bg.stride(0), Bg.stride(1), 0, Bg.stride(0), Bg.stride(1), 0)
        pairs = _bf16_pairs(Bg)
    else:
        pairs = even and _bf16_pairs(Bg, Cg)
    launch(
        _ss_fwd_kernel,
        grid,
        u,
        delta,
        A,
        Bg,
        Cg,
        D if D is not None else A,
        zz,
        delta_bias if delta_bias is not None else A,
        out,
        states,
        dpg,
        seqlen,
        nsub,
        u.stride(0),
        u.stride(1),
        delta.stride(0),
        delta.stride(1),
        A.stride(0),
        A.stride(1),
        *b_strides,
        zz.stride(0),
        zz.stride(1),
        out.stride(0),
        out.stride(1),
        states.stride(2),
        states.stride(3),
        DSTATE=dstate,
        BLOCK_D=cfg.block_d,
        SUB=sub,
        SEG=cfg.segments,
        SAVE=SAVE_EVERY // sub,
        ACC=_TL_DTYPE[acc],
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus,
        LANES=dstate <= cfg.segments,
        BC_BITS=pairs and sub % 2 == 0,
        EVEN=even,
        FAST=_fast_math(u, acc),
        STAGES=cfg.pipeline_stages,
        GROUP=group,
        num_warps=cfg.num_warps,
        **_maxnreg(cfg.max_registers if group == cfg.states_per_iteration else 0),
    )
    return out, states


def _bwd(dout, u, delta, A, Bg, Cg, D, z, delta_bias, states, softplus: bool, cfg: ScanConfig, deterministic: bool):
    batch, dim, seqlen = u.shape
    ngroups, dstate = Bg.shape[1], A.shape[1]
    dpg = dim // ngroups
    acc = _acc_dtype(u, delta, A, Bg, Cg)
    nsub = states.shape[3]  # the forward saved the state every SAVE_EVERY steps
    seg = cfg.segments_bwd
    nblk = triton.cdiv(dpg, cfg.block_d_bwd)
    atomic = not deterministic and nblk > 1
    kdim = 1 if atomic else nblk
    lanes = dstate <= 2 * seg  # A, the adjoint carry and dA in lanes (no scratch, dA summed over the chunks)
    bsum = atomic and lanes  # dA, dD, dbias summed over the batch in the kernel
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    dB = torch.empty((batch, ngroups, kdim, dstate, seqlen), device=u.device, dtype=acc)  # (batch, G, K, N, L)
    dC = torch.empty((batch, ngroups, kdim, dstate, seqlen), device=u.device, dtype=acc)
    dA_chunks = 1 if lanes else triton.cdiv(seqlen, SAVE_EVERY * seg)
    dA = torch.empty((1, 1, dim, dstate) if bsum else (batch, dA_chunks, dim, dstate), device=u.device, dtype=acc)
    dD = torch.empty((dim,) if bsum else (batch, dim), device=u.device, dtype=acc)
    dbias = torch.empty((dim,) if bsum else (batch, dim), device=u.device, dtype=acc)
    if bsum:
        torch._foreach_zero_([dB, dC, dA, dD, dbias])
    elif atomic:
        torch._foreach_zero_([dB, dC])
    q = torch.empty((1,) if lanes else (batch, dim, 2, dstate), device=u.device, dtype=acc)  # the adjoint carry
    even = seqlen % (SAVE_EVERY * seg) == 0  # whole chunks: no time masks
    zz, dzz = (z, dz) if z is not None else (u, du)
    launch(
        _ss_bwd_kernel,
        (nblk, ngroups, batch),
        u,
        delta,
        A,
        Bg,
        Cg,
        D if D is not None else A,
        zz,
        delta_bias if delta_bias is not None else A,
        states,
        dout,
        du,
        ddelta,
        dzz,
        dB,
        dC,
        dA,
        dD,
        dbias,
        q,
        dpg,
        seqlen,
        nsub,
        u.stride(0),
        u.stride(1),
        delta.stride(0),
        delta.stride(1),
        A.stride(0),
        A.stride(1),
        Bg.stride(0),
        Bg.stride(1),
        Bg.stride(2),
        Cg.stride(0),
        Cg.stride(1),
        Cg.stride(2),
        zz.stride(0),
        zz.stride(1),
        dout.stride(0),
        dout.stride(1),
        dB.stride(0),
        dB.stride(1),
        dB.stride(2),
        dB.stride(3),
        states.stride(2),
        states.stride(3),
        1,
        DSTATE=dstate,
        BLOCK_D=cfg.block_d_bwd,
        SEG=seg,
        ACC=_TL_DTYPE[acc],
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus,
        ATOMIC=atomic,
        STAGES=cfg.pipeline_stages_bwd,
        LANES=lanes,
        FAST=_fast_math(u, acc),
        EVEN=even,
        BITS=even and _bf16_pairs(Bg, Cg),
        BSUM=bsum,
        num_warps=cfg.num_warps_bwd,
        **_maxnreg(cfg.max_registers_bwd),
    )
    dA = dA[0, 0] if bsum else dA.sum((0, 1))
    dB = dB.sum(2) if kdim > 1 else dB.squeeze(2)  # (batch, G, N, L)
    dC = dC.sum(2) if kdim > 1 else dC.squeeze(2)
    if not bsum:
        dD, dbias = dD.sum(0), dbias.sum(0)
    return du, ddelta, dz, dB, dC, dA, dD, dbias


class _SelectiveScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, cfg, deterministic):
        Bg, Cg = _as_groups(B), _as_groups(C)
        out, states = _fwd(u, delta, A, Bg, Cg, D, z, delta_bias, delta_softplus, cfg)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states)
        ctx.softplus, ctx.cfg, ctx.deterministic = delta_softplus, cfg, deterministic
        if not return_last_state:
            return out
        last_state = states[..., -1].contiguous()  # (batch, dim, dstate) fp32 (fp64 for fp64 inputs)
        ctx.mark_non_differentiable(last_state)
        return out, last_state

    @staticmethod
    def backward(ctx, dout, *unused):
        u, delta, A, B, C, D, z, delta_bias, states = ctx.saved_tensors
        Bg, Cg = _as_groups(B), _as_groups(C)
        du, ddelta, dz, dB, dC, dA, dD, dbias = _bwd(
            _unit_last(dout), u, delta, A, Bg, Cg, D, z, delta_bias, states, ctx.softplus, ctx.cfg, ctx.deterministic
        )
        dB = dB.reshape(B.shape).to(B.dtype)
        dC = dC.reshape(C.shape).to(C.dtype)
        return (
            du,
            ddelta,
            dA.to(A.dtype),
            dB,
            dC,
            None if D is None else dD.to(D.dtype),
            dz,
            None if delta_bias is None else dbias.to(delta_bias.dtype),
            None,
            None,
            None,
            None,
        )


def selective_scan_triton(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    config: ScanConfig | None = None,
    deterministic: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Triton selective scan; see ``anytrain.kernels.selective_scan`` for the semantics. ``config`` overrides the
    tiles (benchmarks); ``deterministic``: dB/dC through per-program partials instead of atomics."""
    cfg = config or default_config()
    batch, dim, seqlen = u.shape
    if seqlen == 0:
        raise ValueError("selective_scan: seqlen must be >= 1")
    if A.shape[0] != dim or B.shape[0] != batch or B.shape[-1] != seqlen or C.shape != B.shape:
        raise ValueError(f"selective_scan: bad shapes u {tuple(u.shape)} A {tuple(A.shape)} B {tuple(B.shape)}")
    if B.dim() == 4 and dim % B.shape[1] != 0:
        raise ValueError(f"selective_scan: dim {dim} is not divisible by ngroups {B.shape[1]}")
    u, delta = _unit_last(u), _unit_last(delta)
    z = None if z is None else _unit_last(z)
    D = None if D is None else D.contiguous()
    delta_bias = None if delta_bias is None else delta_bias.contiguous()
    return _SelectiveScanFn.apply(
        u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), bool(return_last_state), cfg, bool(deterministic)
    )
