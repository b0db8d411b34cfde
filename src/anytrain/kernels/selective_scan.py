"""Triton selective scan (Mamba-1 SSM) with a recomputing backward.

Forward, two kernels (``ScanConfig.fwd_impl``); state math is fp32 (fp64 for fp64 inputs, interpreter tests):
  1: ``_ss_fwd_kernel_v3`` (default, ``selective_scan_fwd.py``). (channel, segment, step) tiles: a thread owns a
     segment of ``chunk`` steps, the ``seg`` segments of a chunk sit on the lanes of one warp; a runtime loop over the
     states accumulates y in registers; per state an in-thread scan per segment, one cross-lane scan of the segment
     aggregates and a ``tl.gather`` for each segment's start state; on CUDA 4 states per pipelined iteration.
  0: ``_ss_fwd_kernel`` (v2): (time, state, channel) tiles, ``tl.associative_scan`` over time in registers, y summed
     over states across warps; kept for comparison.

Saved for backward: the inputs and the state every chunk_bwd steps, (batch, dim, dstate, nsub) fp32 (unit stride over
nsub); entry k is the state after step (k + 1) chunk_bwd - 1, the last one the final state (``last_state``).

Backward, five kernels (``ScanConfig.bwd_impl``), all recomputing the states from the saved ones:
  5: ``_ss_bwd_kernel_v6`` (default on CUDA, ``selective_scan_bwd_v6.py``). v5's algorithm with one channel per thread
     and 8-step segments (one per saved state): the program's channels sit on lane groups of one warp (on CUDA 4
     channels x 8 lanes, 64-step chunks), so the cross-lane scan and the dA sum take 3 rounds over 8 elements instead
     of 2 x 5; dB/dC are summed over the channels by a reduce-scatter across the lane groups (2 halving rounds) before
     one 2-wide atomic per lane. On CUDA the saved states reach the state loop through Triton's software pipeliner
     (``pf_bwd`` bits 16-256, docs/kernels.md scan passes 14-15), and A, the adjoint carry and dA sit in two lane
     registers with each program's state loop starting at its block index (512, 1024; scan pass 16).
  4: ``_ss_bwd_kernel_v5`` (``selective_scan_bwd_v5.py``; ROCm default). v4's algorithm with 4-step segments (two per
     saved state; the odd ones start from the even neighbour's end state), lane-reversed so that the adjoint's
     cross-lane scan runs forward, and loads/stores/atomics whose layouts need no conversion on any Triton version:
     2 channels per one-warp program at about v4's 1-channel register count.
  3: ``_ss_bwd_kernel_v4``. The forward v3's layout with 8-step segments split into registers: explicit
     sequential forward rescan and adjoint per segment (no shifted delta, one exp per element), one cross-lane scan
     of segment maps; 1-2 channels per one-warp program.
  2: ``_ss_bwd_kernel_v3``: (step, channel, segment) tiles, in-thread ``associative_scan``s (a reverse one for the
     adjoint, with the shifted delta), channels on warps; used for deterministic mode when v4's per-block dB/dC
     partials would be too large.
  0: ``_ss_bwd_kernel_v1`` (first kernel): lane-parallel scans over (channel, state, time) tiles; kept for comparison.
  Adjoint g_t = exp(delta_{t+1} A) g_{t+1} + C_t dy_t, hm = g_t (h_t - delta_t B_t u_t), and
  du_t = delta_t sum_n g B + D dy,   ddelta_t = u_t sum_n g B + sum_n A hm,   dA = sum_{b,t} delta hm,
  dB_t = sum_d g delta u,   dC_t = sum_d dy h.
dB/dC reduce over the channels of a group: per program in registers, then across programs either with fp32 atomics
(default) or, in deterministic mode, through per-block partials summed in torch. dA/dD/ddelta_bias are per-batch
partials (no atomics) summed in torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from anytrain import hardware
from anytrain.kernels import _make_callable
from anytrain.kernels.fastmath import fast_math_ok
from anytrain.kernels.selective_scan_bwd import (
    LOG2E,
    _combine,
    _delta,
    _sigmoid,
    _ss_bwd_kernel_v1,
    _ss_bwd_kernel_v3,
    _ss_bwd_kernel_v4,
)
from anytrain.kernels.selective_scan_bwd_v5 import _ss_bwd_kernel_v5
from anytrain.kernels.selective_scan_bwd_v6 import _ss_bwd_kernel_v6
from anytrain.kernels.selective_scan_fwd import _ss_fwd_kernel_v3


@dataclass(frozen=True)
class ScanConfig:
    """Tiles of the forward (``fwd_impl``) and backward (``bwd_impl``) kernels.

    fwd_impl 1 (v3): programs of ``block_d`` channels walk chunks of ``chunk`` x ``seg`` steps (``chunk`` steps per
    thread, ``seg`` segments on lanes); needs chunk_bwd % chunk == 0 and (chunk * seg) % chunk_bwd == 0. Layouts are
    conversion-free when ``chunk`` steps are one 16-byte vector (8 for bf16) and ``seg`` x ``num_warps`` = lanes.
    fwd_impl 0 (v2): tiles of ``chunk`` steps x next_pow2(dstate) states x ``block_d`` channels.
    bwd_impl 5 (v6): ``block_d_bwd`` channels, each on ``seg_bwd`` lanes, x 8 steps per thread (needs chunk_bwd == 8;
    conversion-free when block_d_bwd x seg_bwd = the lanes of one warp, 4 x 8 on CUDA; 2, 4 or 8 channels take the
    lanes' dB/dC reduce-scatter);
    bwd_impl 4 (v5): ``block_d_bwd`` channels (``block_d_bwd / num_warps_bwd`` per warp) x ``seg_bwd`` segments x 4
    steps (needs chunk_bwd == 8 and an even seg_bwd);
    bwd_impl 3 (v4): ``block_d_bwd`` channels x ``seg_bwd`` segments x 8 steps (needs chunk_bwd == 8);
    bwd_impl 2 (v3): ``chunk_bwd`` steps per thread x ``seg_bwd`` segments x ``block_d_bwd`` channels;
    bwd_impl 0 (v1): ``chunk_bwd`` steps x states x ``block_d_bwd`` channels (needs chunk % chunk_bwd == 0 with v2).
    The forward saves the state every ``chunk_bwd`` steps.
    """

    block_d: int = 1
    chunk: int = 8
    num_warps: int = 1
    block_d_bwd: int = 2
    chunk_bwd: int = 8
    num_warps_bwd: int = 1
    bwd_impl: int = 3  # 5: _ss_bwd_kernel_v6; 4: _v5; 3: _v4; 2: _v3; 0: _v1
    seg_bwd: int = 32  # bwd_impl 2-5: segments per backward chunk and channel (one per lane)
    fwd_impl: int = 1  # 1: _ss_fwd_kernel_v3 (state loop, segments on lanes); 0: _ss_fwd_kernel (v2)
    seg: int = 32  # fwd_impl 1: segments of chunk steps per forward chunk (one per lane)
    rot_bwd: int = 0  # bwd_impl 3: 1 = each program starts its state loop at its block index (spreads the atomics)
    flat_bwd: int = 0  # bwd_impl 3: 1 = dB/dC atomics on (chunk,) tiles in the coalesced layout (values cross lanes)
    maxnreg_bwd: int = 0  # CUDA only: register cap per thread for the backward kernel (0: the compiler's choice)
    unroll: int = 1  # fwd_impl 1: state-loop unroll factor (independent states interleaved by the compiler)
    bc_f32: int = 0  # 1 = B and C converted to the accumulation dtype once on the host (no per-state conversion)
    pf: int = 0  # fwd_impl 1 bits: 1 = A and the chunk carry held in lanes (needs dstate <= seg), 4 = no time mask on
    # the per-state B/C loads when seqlen fills whole chunks, 2 = with 4, bf16 B/C loaded as int32 pairs (when their
    # strides allow; masked pair loads are split by the compiler, so 2 applies only where 4 does), 16 = the gate's
    # sigmoid with the approximate exp and division (fp32 accumulation on a GPU only); bits 32-224 = the software
    # pipeline's stages for the per-state B/C loads ((pf >> 5) & 7; 0: a register prefetch one state ahead); bits
    # 4096-12288 = 2, 4 or 8 states per pipelined iteration (``fwd_group``; B/C from a chunk-major copy, their rows one
    # tile per group; needs 1 and applies where the group size divides dstate; with it, 2 needs no 4; where a group
    # falls back to single states, ``maxnreg`` is not applied: the cap belongs to the grouped kernel)
    pf_bwd: int = 0  # bwd_impl 4 bits: 1 = saved-state/carry loads after their last use, 2 = next chunk's inputs
    # loaded before this chunk's epilogue, 4 = A and the adjoint carry held in lanes (needs dstate <= seg_bwd)
    # (bwd_impl 5: bits 2 and 4); 8 (bwd_impl 4, 5) = the gate's sigmoid with the approximate exp and division (fp32
    # accumulation on a GPU only); bwd_impl 5: bits 16-112 = the software pipeline's stages for the per-state B/C and
    # saved-state loads ((pf_bwd >> 4) & 7; 0: a register prefetch one state ahead), 128 (with 2 and stages) = each
    # chunk's first state's saved states loaded into a register during the previous chunk, not in the pipeline's
    # prologue, 256 (with stages) = only the saved states pipelined, B/C kept in the register prefetch (L1-cached
    # loads), 512 (dstate <= 2 seg_bwd, without 4's lanes) = A, the adjoint carry and dA in two lane registers each,
    # 1024 = each program's states visited from its block index on (mod dstate), 2048 = no time masks on the B/C loads
    # and dB/dC atomics when seqlen fills whole chunks, 4096 = with 2048, bf16 B/C read as int32 pairs (when their
    # strides allow), 8192 = with 512 and atomics, dA / dD / dbias summed over the batch by atomic adds in the kernel
    maxnreg: int = 0  # CUDA only: register cap per thread for the forward kernel fwd_impl 1 (0: the compiler's choice)


# Per-vendor defaults. CUDA: fastest of bench/mamba_kernels.py --sweep on an H200 (bench/results/, Triton 3.6):
# forward 1 channel per one-warp program; scan pass 8: backward v6, 2 channels per one-warp program (16 lanes each)
# capped at 152 registers (12 warps per SM, see scan pass 17), the next chunk's inputs loaded before the epilogue and A
# / the adjoint carry in lanes (pf_bwd 6): 1.905 / 1.920 ms against 1.972 / 1.992 for v5 (pf_bwd 7, 168 registers),
# two H200 calls.
# Forward: unmasked B/C loads for whole chunks, bf16 B/C read as int32 pairs (pf 6: 0.655 against 0.685 ms, H200).
# Both: the sigmoids with the approximate exp and division (pf 16, pf_bwd 8): backward 1.873 / 1.874 against 1.918 /
# 1.918 ms, forward 0.645 against 0.647 / 0.649 (one H200 call, scan pass 11). Forward: B/C loads software-pipelined
# over 4 stages with A and the carry in lanes (pf 128 + 16 + 7 = 151): 0.575-0.577 against 0.638-0.646 (three calls).
# ROCm: not run (untuned; 64 segments fill a 64-wide wavefront; v5 compiles to 206 VGPRs for gfx942 against v4's 291).
# Forward, scan pass 13: 4 states per pipelined iteration, 2 stages (the next group's B/C copied while this one runs),
# capped at 72 registers (28 warps per SM; pf 8192 + 64 + 23 = 8279): 0.542-0.543 against 0.546-0.547 for groups of 2
# at 3 stages (pf 4215) in one H200 call, and 0.547-0.550 (4215) against 0.574-0.578 for pf 151 (docs/kernels.md).
# Backward, scan pass 14: the saved states through the software pipeliner (3 stages), each chunk's state-0 saved states
# prefetched during the previous chunk, B/C kept in the register prefetch (pf_bwd 256 + 128 + 48 + 14 = 446):
# 1.886-1.904 against 1.864-1.882 ms at the benchmark shape (H200), but +0.2-1.0% tokens/s on mamba-1.4b-mb16 and
# +0.2-0.7% on mamba-130m in three alternating pairs; B/C pipelined as well (pf_bwd 222 at 144 registers) took the
# benchmark to 1.777 ms but trained 2% slower (its backward 5.09 against 4.86 ms inside the step). docs/kernels.md.
# Backward, scan pass 15: 4 channels per one-warp program on 8 lanes each (64-step chunks), dB/dC reduce-scattered in
# two rounds to one 2-wide atomic per lane (half the atomic traffic), A and the carry not in lanes (dstate 16 > 8
# lanes; pf_bwd 442 = 446 - 4): 1.664-1.702 against 1.888-1.892 ms at the benchmark shape, +7.9-9.4% tokens/s on
# mamba-130m, -0.1 to +0.4% (a tie) on mamba-1.4b-mb16 (whose step runs at the H200's 700 W power limit) in
# alternating pairs (H200); 1.736 against 1.756 ms and +6.7-7.6% on mamba-130m on an H100.
# Backward, scan pass 16: A, the adjoint carry and dA in two lane registers each (no scratch, no barrier, no per-state
# A/carry loads or dA stores; pf_bwd 512), each program's state loop rotated by its block index (1024: with the lane
# carries, programs in lockstep otherwise add dB/dC into the same rows at once: 1.776-1.858 ms without it), the saved
# states 4 stages deep (1994 = 442 + 512 + 1024 + 16): 1.625-1.626 against 1.666-1.668 ms at the benchmark shape,
# 4.220 against 4.284 ms at the 1.4b mixer shape, 0.427 against 0.445 at the 130m one; end to end +1.4% (mamba-130m)
# and +1.2% (mamba-1.4b-mb16) on an H200, +2.3% (130m) on an H100, one alternating pair each (docs/kernels.md).
# Backward, scan pass 17: the register file is split over the SM's 4 schedulers, so 129-168 registers all give 3 warps
# per scheduler (12 per SM, Nsight Compute's register block limit; 152 was thought to give 13); the cap is 168, the
# most that keeps 12: 1.593-1.596 against 1.625-1.630 ms at the benchmark shape, 4.133 against 4.226 ms at the 1.4b
# mixer shape, 0.418 against 0.427 at the 130m one; end to end a tie (+0.5% / +0.2%, two alternating pairs, H200).
# Scan pass 19: backward without time masks for whole chunks and with bf16 B/C as int32 pairs (pf_bwd 8138 = 1994 +
# 2048 + 4096): 1.562 against 1.594 ms at the benchmark shape, 4.055 against 4.133 at the 1.4b mixer shape, 0.410
# against 0.418-0.419 at the 130m one; forward with the chunk carry folded into the cross-lane scan (no config bit):
# 0.535-0.537 against 0.540-0.544 ms (H200, docs/kernels.md). Scan pass 20: dA / dD / dbias summed over the batch
# by atomic adds in the kernel (pf_bwd 16330 = 8138 + 8192): the launcher 1.551 against 1.560 ms at the benchmark
# shape (the kernel's time unchanged; one zeroing launch instead of two fills and three reductions).
_CUDA_CONFIG = ScanConfig(
    1, 8, 1, block_d_bwd=4, chunk_bwd=8, num_warps_bwd=1, bwd_impl=5, seg_bwd=8, seg=32, maxnreg_bwd=168, pf=8279,
    pf_bwd=16330, maxnreg=72,
)  # fmt: skip
_VENDOR_CONFIGS = {
    hardware.CUDA: _CUDA_CONFIG,
    hardware.ROCM: ScanConfig(1, 8, 1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, bwd_impl=4, seg_bwd=64, seg=64),
    hardware.CPU: ScanConfig(4, 8, 1, block_d_bwd=4, chunk_bwd=8, num_warps_bwd=1, bwd_impl=3, seg_bwd=4, seg=4),
}
_MAX_PARTIALS = 1 << 26  # deterministic mode: largest dB (or dC) partial buffer, in elements, for bwd_impl 3
_DIAG_SKIP_DBDC = False  # bench/mamba_kernels.py only: time bwd_impl 3 without its dB/dC reduction (wrong dB/dC)


def default_config() -> ScanConfig:
    """Per-vendor tiles; env ANYTRAIN_SCAN_CONFIG = the ScanConfig fields in order, comma-separated (at least 6)."""
    env = os.environ.get("ANYTRAIN_SCAN_CONFIG")
    if env:
        return ScanConfig(*(int(v) for v in env.split(",")))
    return _VENDOR_CONFIGS[hardware.vendor()]


@triton.jit
def _ss_fwd_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, state_ptr,
    dpg, seqlen, nchunks, nsub,
    s_ub, s_ud, s_tb, s_td, s_ad, s_an, s_bb, s_bg, s_bn, s_cb, s_cg, s_cn, s_zb, s_zd, s_ob, s_od,
    DSTATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
    ACC: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
):  # fmt: skip
    # Tiles are (time, state, channel): the default layout spreads lanes/warps over channel and state and keeps the
    # CHUNK time steps of a (state, channel) pair inside one thread, so the scan over time runs sequentially in
    # registers (no cross-lane shuffles).
    pid_blk = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    dim = dpg * tl.num_programs(1)
    offs_dl = pid_blk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_dl < dpg
    offs_d = g * dpg + offs_dl  # (BLOCK_D,) channel ids
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < DSTATE
    offs_t = tl.arange(0, CHUNK)
    mask_nd = mask_n[:, None] & mask_d[None, :]  # (BLOCK_N, BLOCK_D)

    A2 = tl.load(A_ptr + offs_d[None, :] * s_ad + offs_n[:, None] * s_an, mask=mask_nd, other=0.0).to(ACC) * LOG2E
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)
    bias = tl.zeros((BLOCK_D,), dtype=ACC)  # (unused without HAS_BIAS)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(ACC)
    u_base = u_ptr + b * s_ub + offs_d * s_ud  # (BLOCK_D,)
    dt_base = dt_ptr + b * s_tb + offs_d * s_td
    z_base = z_ptr + b * s_zb + offs_d * s_zd
    o_base = out_ptr + b * s_ob + offs_d * s_od
    B_base = B_ptr + b * s_bb + g * s_bg + offs_n * s_bn  # (BLOCK_N,)
    C_base = C_ptr + b * s_cb + g * s_cg + offs_n * s_cn
    st_base = state_ptr + (b * dim + offs_d[None, :]) * (nsub * DSTATE) + offs_n[:, None] * nsub  # (BLOCK_N, BLOCK_D)

    h = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    for c in range(0, nchunks):
        t = c * CHUNK + offs_t
        mask_t = t < seqlen
        m2 = mask_t[:, None] & mask_d[None, :]  # (CHUNK, BLOCK_D)
        mtn = mask_t[:, None] & mask_n[None, :]  # (CHUNK, BLOCK_N)
        u = tl.load(u_base[None, :] + t[:, None], mask=m2, other=0.0).to(ACC)
        dt = tl.load(dt_base[None, :] + t[:, None], mask=m2, other=0.0).to(ACC)
        dt = _delta(dt, bias[None, :], m2, HAS_BIAS, SOFTPLUS)
        Bt = tl.load(B_base[None, :] + t[:, None], mask=mtn, other=0.0).to(ACC)
        Ct = tl.load(C_base[None, :] + t[:, None], mask=mtn, other=0.0).to(ACC)
        a = tl.exp2(dt[:, None, :] * A2[None, :, :])  # (CHUNK, BLOCK_N, BLOCK_D)
        bu = (dt * u)[:, None, :] * Bt[:, :, None]
        pa, pb = tl.associative_scan((a, bu), axis=0, combine_fn=_combine)
        hs = pa * h[None, :, :] + pb  # states h_t of this chunk
        y = tl.sum(hs * Ct[:, :, None], axis=1)  # (CHUNK, BLOCK_D)
        if SUB >= CHUNK:
            h = tl.sum(tl.where(offs_t[:, None, None] == CHUNK - 1, hs, 0.0), axis=0)
            if SUB == CHUNK:
                tl.store(st_base + c, h, mask=mask_nd)
            else:  # save every SUB // CHUNK chunks, and the final state
                cvec = c + 0 * offs_dl  # (BLOCK_D,) copy of c for the mask
                keep = ((cvec + 1) % (SUB // CHUNK) == 0) | (cvec == nchunks - 1)
                tl.store(st_base + c // (SUB // CHUNK), h, mask=mask_nd & keep[None, :])
        else:  # save the state every SUB steps (the backward's chunk)
            offs_s = tl.arange(0, SUB)
            offs_k = tl.arange(0, CHUNK // SUB)
            hs4 = tl.reshape(hs, (CHUNK // SUB, SUB, BLOCK_N, BLOCK_D))
            hk = tl.sum(tl.where(offs_s[None, :, None, None] == SUB - 1, hs4, 0.0), axis=1)  # (CHUNK//SUB, N, D)
            k = c * (CHUNK // SUB) + offs_k
            tl.store(
                st_base[None, :, :] + k[:, None, None],
                hk,
                mask=mask_nd[None, :, :] & (k < nsub)[:, None, None],
            )
            h = tl.sum(tl.where(offs_k[:, None, None] == CHUNK // SUB - 1, hk, 0.0), axis=0)
        if HAS_D:
            y += u * Dv[None, :]
        if HAS_Z:
            zz = tl.load(z_base[None, :] + t[:, None], mask=m2, other=0.0).to(ACC)
            y = y * zz * _sigmoid(zz)
        tl.store(o_base[None, :] + t[:, None], y.to(out_ptr.dtype.element_ty), mask=m2)


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _acc_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}


def _bf16_pairs(*xs: Tensor) -> bool:
    """bf16 tensors whose every row starts on a 4-byte boundary with an even length: readable as int32 pairs."""
    return all(
        x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0 and x.shape[-1] % 2 == 0
        and all(s % 2 == 0 for s in x.stride()[:-1])
        for x in xs
    )  # fmt: skip


def _as_groups(x: Tensor) -> Tensor:
    """(batch, N, L) -> (batch, 1, N, L) view; (batch, G, N, L) unchanged. Unit stride along L."""
    return _unit_last(x.unsqueeze(1) if x.dim() == 3 else x)


def fwd_group(cfg: ScanConfig, dstate: int) -> int:
    """States per pipelined iteration of the v3 forward (``pf`` bits 4096-12288: 2, 4, 8; 1 = one state per
    iteration). Groups need the states' carries in lanes (``pf`` bit 1, dstate <= seg) and a dstate they divide."""
    group = 1 << ((cfg.pf >> 12) & 3)
    return group if cfg.fwd_impl == 1 and cfg.pf & 1 and dstate <= cfg.seg and dstate % group == 0 else 1


@triton.jit
def _bc_chunk_major_kernel(
    B_ptr, C_ptr, out_ptr, seqlen, s_bb, s_bg, s_bn, s_bl, s_cb, s_cg, s_cn, s_cl,
    DSTATE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
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
    _bc_chunk_major_kernel[(nch, batch, ngroups)](
        Bg, Cg, bc, seqlen, *Bg.stride(), *Cg.stride(),
        DSTATE=dstate, BLOCK_N=triton.next_power_of_2(dstate), CHUNK=chunk, num_warps=4,
    )  # fmt: skip
    return bc


def _fast_math(on: bool, u: Tensor, acc: torch.dtype) -> bool:
    """The kernels' FAST constexpr (approximate exp and division in the sigmoids): asked for by the config and
    ``fastmath.fast_math_ok`` (fp32 accumulation, a GPU tensor, not under the Triton interpreter)."""
    return on and fast_math_ok(u, acc == torch.float32)


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
    if cfg.bc_f32:
        Bg, Cg = Bg.to(acc), Cg.to(acc)  # (batch, G, N, L): small next to the (batch, dim, L) inputs
    nsub = triton.cdiv(seqlen, cfg.chunk_bwd)
    if out is None:
        out = torch.empty((batch, dim, seqlen), device=u.device, dtype=u.dtype)
    # the state every chunk_bwd steps, (batch, dim, N, nsub): unit stride over nsub (coalesced stores and loads)
    states = torch.empty((batch, dim, dstate, nsub), device=u.device, dtype=acc)
    zz = z if z is not None else u
    grid = (triton.cdiv(dpg, cfg.block_d), ngroups, batch)
    ptrs = (
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
    )
    strides = (
        u.stride(0), u.stride(1), delta.stride(0), delta.stride(1), A.stride(0), A.stride(1),
        Bg.stride(0), Bg.stride(1), Bg.stride(2), Cg.stride(0), Cg.stride(1), Cg.stride(2),
        zz.stride(0), zz.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    flags = dict(
        ACC=_TL_DTYPE[acc], HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus, num_warps=cfg.num_warps,
    )  # fmt: skip
    if cfg.fwd_impl == 1:
        chunk = cfg.chunk * cfg.seg
        even = bool(cfg.pf & 4) and seqlen % chunk == 0  # whole chunks: unmasked B/C loads
        lanes = bool(cfg.pf & 1) and dstate <= cfg.seg
        group = fwd_group(cfg, dstate)
        if group > 1:  # B/C rows of a group of states as one block: (batch, G, nchunks, N, 2, chunk), zero-padded
            Bg = _chunk_major(Bg, Cg, chunk)
            ptrs = (*ptrs[:3], Bg, Bg, *ptrs[5:])
            strides = (*strides[:6], Bg.stride(0), Bg.stride(1), 0, Bg.stride(0), Bg.stride(1), 0, *strides[12:])
            pairs = _bf16_pairs(Bg)
        else:
            pairs = even and _bf16_pairs(Bg, Cg)
        _ss_fwd_kernel_v3[grid](
            *ptrs, dpg, seqlen, nsub, *strides, states.stride(2), states.stride(3),
            DSTATE=dstate, BLOCK_D=cfg.block_d, SUB=cfg.chunk, SEG=cfg.seg, SAVE=cfg.chunk_bwd // cfg.chunk,
            UNROLL=cfg.unroll, LANES=lanes, FAST=_fast_math(bool(cfg.pf & 16), u, acc), STAGES=(cfg.pf >> 5) & 7,
            GROUP=group, BC_BITS=bool(cfg.pf & 2) and pairs and cfg.chunk % 2 == 0, EVEN=even, **flags,
            **_maxnreg(cfg.maxnreg if group > 1 or not (cfg.pf >> 12) & 3 else 0),  # (see ScanConfig.pf)
        )  # fmt: skip
        return out, states
    _ss_fwd_kernel[grid](
        *ptrs, dpg, seqlen, triton.cdiv(seqlen, cfg.chunk), nsub, *strides,
        DSTATE=dstate, BLOCK_N=triton.next_power_of_2(dstate), BLOCK_D=cfg.block_d, CHUNK=cfg.chunk, SUB=cfg.chunk_bwd,
        **flags,
    )  # fmt: skip
    return out, states


def _bwd(dout, u, delta, A, Bg, Cg, D, z, delta_bias, states, softplus: bool, cfg: ScanConfig, deterministic: bool):
    batch, dim, seqlen = u.shape
    ngroups, dstate = Bg.shape[1], A.shape[1]
    dpg = dim // ngroups
    acc = _acc_dtype(u, delta, A, Bg, Cg)
    if cfg.bc_f32:
        Bg, Cg = Bg.to(acc), Cg.to(acc)
    nchunks = states.shape[3]  # the forward saved the state every cfg.chunk_bwd steps
    chunk = cfg.chunk_bwd
    nblk = triton.cdiv(dpg, cfg.block_d_bwd)
    if deterministic and cfg.bwd_impl in (3, 4, 5) and nblk * batch * ngroups * dstate * seqlen > _MAX_PARTIALS:
        # per-block dB/dC partials of 1-channel blocks would take dim x the size of dB: use the v3 kernel's
        # 4-channel blocks (the forward saved the state every chunk_bwd = 8 steps, which v3 reads as well)
        # v3 tiles as measured for this fallback (4.86 ms at the bench shape on an H200): 32+ segments of 8 steps and,
        # where the default caps registers, the cap of 168 (v6's 16 segments and 152 registers took v3 to 6.6 ms)
        cfg = dataclasses.replace(
            cfg, bwd_impl=2, block_d_bwd=max(cfg.block_d_bwd, 4), num_warps_bwd=4, seg_bwd=max(cfg.seg_bwd, 32),
            maxnreg_bwd=168 if cfg.maxnreg_bwd else 0,
        )  # fmt: skip
        nblk = triton.cdiv(dpg, cfg.block_d_bwd)
    atomic = not deterministic and nblk > 1
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    kdim = 1 if atomic else nblk
    # v6: A and the adjoint carry in one lane register (pf_bwd 4, dstate <= seg_bwd), or with dA in two (512)
    lanes = cfg.bwd_impl == 5 and bool(cfg.pf_bwd & 4) and dstate <= cfg.seg_bwd
    lanes2 = cfg.bwd_impl == 5 and bool(cfg.pf_bwd & 512) and not lanes and dstate <= 2 * cfg.seg_bwd
    # v6 with the two-register lane carries and atomics (pf_bwd 8192): dA, dD and dbias summed over the batch in the
    # kernel by atomic adds, all five atomic targets zeroed by one multi-tensor launch (no per-batch partials summed by
    # three more kernels afterwards)
    bsum = atomic and lanes2 and bool(cfg.pf_bwd & 8192)
    dB = torch.empty((batch, ngroups, kdim, dstate, seqlen), device=u.device, dtype=acc)  # (batch, G, K, N, L)
    dC = torch.empty((batch, ngroups, kdim, dstate, seqlen), device=u.device, dtype=acc)
    dA = torch.empty((batch, dim, dstate), device=u.device, dtype=acc)
    dD = torch.empty((dim,) if bsum else (batch, dim), device=u.device, dtype=acc)
    dbias = torch.empty((dim,) if bsum else (batch, dim), device=u.device, dtype=acc)
    zz, dzz = (z, dz) if z is not None else (u, du)
    grid = (nblk, ngroups, batch)
    common = dict(
        DSTATE=dstate, BLOCK_D=cfg.block_d_bwd, ACC=_TL_DTYPE[acc], HAS_D=D is not None,
        HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus, ATOMIC=atomic,
        num_warps=cfg.num_warps_bwd,
    )  # fmt: skip
    common.update(_maxnreg(cfg.maxnreg_bwd))

    def launch(kernel, dA: Tensor, *scratch: Tensor, extra_strides: tuple = (), **meta) -> None:
        """The three backward kernels share their leading arguments; v3/v4 add the adjoint scratch, v4 state strides."""
        kernel[grid](
            u, delta, A, Bg, Cg, D if D is not None else A, zz, delta_bias if delta_bias is not None else A, states,
            dout, du, ddelta, dzz, dB, dC, dA, dD, dbias, *scratch,
            dpg, seqlen, nchunks,
            u.stride(0), u.stride(1), delta.stride(0), delta.stride(1), A.stride(0), A.stride(1),
            Bg.stride(0), Bg.stride(1), Bg.stride(2), Cg.stride(0), Cg.stride(1), Cg.stride(2),
            zz.stride(0), zz.stride(1), dout.stride(0), dout.stride(1),
            dB.stride(0), dB.stride(1), dB.stride(2), dB.stride(3), *extra_strides, **meta, **common,
        )  # fmt: skip

    if cfg.bwd_impl in (2, 3, 4, 5):  # v6 / v5 / v4 / v3: dA partials (batch, nchunks, dim, N); bsum: (1, 1, dim, N)
        sub = 4 if cfg.bwd_impl == 4 else chunk  # steps per segment (v5: half the saved-state interval)
        dA_chunks = 1 if lanes2 else triton.cdiv(seqlen, sub * cfg.seg_bwd)  # (lanes2: summed in the kernel)
        dA = torch.empty((1, 1, dim, dstate) if bsum else (batch, dA_chunks, dim, dstate), device=u.device, dtype=acc)
        if bsum:
            torch._foreach_zero_([dB, dC, dA, dD, dbias])
        elif atomic:
            torch._foreach_zero_([dB, dC])
        # the adjoint carry scratch (unused where v6 holds the carry in lanes)
        q = torch.empty((batch, dim, 2, dstate) if not (lanes or lanes2) else (1,), device=u.device, dtype=acc)
        if cfg.bwd_impl == 5:
            stages = (cfg.pf_bwd >> 4) & 7  # the per-state loads' pipeline stages (0: register prefetch)
            even = bool(cfg.pf_bwd & 2048) and seqlen % (8 * cfg.seg_bwd) == 0  # whole chunks: no time masks
            bits = bool(cfg.pf_bwd & 4096) and _bf16_pairs(Bg, Cg)  # (with even) bf16 B/C read as int32 pairs
            launch(_ss_bwd_kernel_v6, dA, q, extra_strides=(states.stride(2), states.stride(3), 1), SEG=cfg.seg_bwd,
                   DBDC=not _DIAG_SKIP_DBDC, PIPE=bool(cfg.pf_bwd & 2),
                   LANES=lanes, LANES2=lanes2, ROT=bool(cfg.pf_bwd & 1024),
                   FAST=_fast_math(bool(cfg.pf_bwd & 8), u, acc), STAGES=stages,
                   FIRST=bool(cfg.pf_bwd & 128) and bool(cfg.pf_bwd & 2) and stages > 0,
                   BC_REG=bool(cfg.pf_bwd & 256) and stages > 0, EVEN=even, BITS=even and bits,
                   BSUM=bsum)  # fmt: skip
        elif cfg.bwd_impl == 4:
            launch(_ss_bwd_kernel_v5, dA, q, extra_strides=(states.stride(2), states.stride(3), 1), SEG=cfg.seg_bwd,
                   DBDC=not _DIAG_SKIP_DBDC, BC_TILE=cfg.num_warps_bwd > 1, LATE=bool(cfg.pf_bwd & 1),
                   PIPE=bool(cfg.pf_bwd & 2), LANES=bool(cfg.pf_bwd & 4) and dstate <= cfg.seg_bwd,
                   FAST=_fast_math(bool(cfg.pf_bwd & 8), u, acc))  # fmt: skip
        elif cfg.bwd_impl == 3:
            launch(_ss_bwd_kernel_v4, dA, q, extra_strides=(states.stride(2), states.stride(3)), SUB=chunk,
                   SEG=cfg.seg_bwd, DBDC=not _DIAG_SKIP_DBDC, ROT=bool(cfg.rot_bwd),
                   FLAT=bool(cfg.flat_bwd), BC_TILE=cfg.num_warps_bwd > 1)  # fmt: skip
        else:
            launch(_ss_bwd_kernel_v3, dA, q, SUB=chunk, SEG=cfg.seg_bwd)
        dA = dA[0, 0] if bsum else dA.sum((0, 1))
    else:
        if atomic:
            torch._foreach_zero_([dB, dC])
        launch(_ss_bwd_kernel_v1, dA, BLOCK_N=triton.next_power_of_2(dstate), CHUNK=chunk)
        dA = dA.sum(0)
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
            du, ddelta, dA.to(A.dtype), dB, dC,
            None if D is None else dD.to(D.dtype),
            dz,
            None if delta_bias is None else dbias.to(delta_bias.dtype),
            None, None, None, None,
        )  # fmt: skip


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
    """Triton selective scan; see ``anytrain.kernels.selective_scan`` for the semantics. ``config`` overrides tiles."""
    cfg = config or default_config()
    if any(triton.next_power_of_2(v) != v for v in (cfg.chunk, cfg.chunk_bwd, cfg.seg_bwd, cfg.seg)):
        raise ValueError(f"ScanConfig: chunk, chunk_bwd, seg_bwd and seg must be powers of 2, got {cfg}")
    if cfg.fwd_impl == 1 and (cfg.chunk_bwd % cfg.chunk or (cfg.chunk * cfg.seg) % cfg.chunk_bwd):
        raise ValueError(
            f"ScanConfig: fwd_impl 1 needs chunk_bwd % chunk == 0 and (chunk * seg) % chunk_bwd == 0: {cfg}"
        )
    if cfg.bwd_impl in (3, 4, 5) and cfg.chunk_bwd != 8:
        raise ValueError(f"ScanConfig: bwd_impl {cfg.bwd_impl} needs chunk_bwd == 8, got {cfg.chunk_bwd}")
    if cfg.bwd_impl == 4 and cfg.seg_bwd < 2:
        raise ValueError(f"ScanConfig: bwd_impl 4 needs seg_bwd >= 2, got {cfg.seg_bwd}")
    if cfg.fwd_impl == 0 and cfg.bwd_impl != 2 and cfg.chunk % cfg.chunk_bwd != 0:
        raise ValueError(f"ScanConfig: bwd_impl {cfg.bwd_impl} needs chunk ({cfg.chunk}) % chunk_bwd == 0")
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


_make_callable(__name__)  # this module's package attribute also acts as the public op (see kernels/__init__.py)
