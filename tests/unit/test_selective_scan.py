"""Triton selective scan under the CPU interpreter vs the float64 reference: forward, last state, all gradients."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import pytest

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run in the interpreter
pytest.importorskip("triton")
if _TRITON_PREIMPORTED:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from anytrain.kernels.reference import selective_scan_ref  # noqa: E402
from anytrain.kernels.selective_scan import ScanConfig, _fast_math, selective_scan_triton  # noqa: E402
from anytrain.kernels.selective_scan_bwd import _combine, _softplus, _softplus_grad  # noqa: E402
from anytrain.kernels.selective_scan_fwd import _later  # noqa: E402

F64 = torch.float64
# Small tiles so that seqlen crosses several chunks. CFG / CFG_V4: v3 forward with 4-step segments, 2 per chunk (8
# steps), the state saved every 8 steps (every other segment); backward v3 / v4 (bwd_impl 2 / 3) with 2 segments of 8
# steps and 2-channel blocks. CFG_SAME: state saved at every 4-step segment, v3 backward. CFG_V1: v2 forward (chunk 8)
# and v1 backward (state saved every 4 steps).
CFG = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, seg_bwd=2, seg=2, bwd_impl=2
)
CFG_SAME = ScanConfig(
    block_d=4, chunk=4, num_warps=1, block_d_bwd=4, chunk_bwd=4, num_warps_bwd=1, seg_bwd=2, seg=2, bwd_impl=2
)
CFG_V4 = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, seg_bwd=2, seg=2, bwd_impl=3
)
# v4 backward with its options: state loop rotated per program (rot_bwd), flat dB/dC tiles (flat_bwd), B/C loaded as
# full tiles (num_warps_bwd > 1), 4-channel blocks over 2 blocks of dim 6
CFG_V4_ALT = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=4, chunk_bwd=8, num_warps_bwd=2, seg_bwd=2, seg=2, bwd_impl=3,
    rot_bwd=1, flat_bwd=1,
)  # fmt: skip
# v5 backward (bwd_impl 4): 4-step segments, so every other segment starts between two saved states; 4 segments per
# chunk (2 saved states) with 2-channel blocks, and 2 segments per chunk with 1-channel blocks. CFG_V5 also unrolls the
# forward's state loop by 2 and converts B/C on the host (bc_f32)
CFG_V5 = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, seg_bwd=4, seg=2, bwd_impl=4,
    unroll=2, bc_f32=1,
)  # fmt: skip
CFG_V5_ALT = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=1, chunk_bwd=8, num_warps_bwd=1, seg_bwd=2, seg=2, bwd_impl=4
)
# v5 with 4-channel blocks on 2 warps: B/C loaded as full tiles, dB/dC summed across warps
CFG_V5_WARPS = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=4, chunk_bwd=8, num_warps_bwd=2, seg_bwd=4, seg=2, bwd_impl=4
)
# the load-scheduling options: forward with A and the chunk carry in lanes (pf 1), backward
# v5 with late state/carry loads, the next chunk's inputs loaded before the epilogue, A and the adjoint carry in lanes
# (pf_bwd 7); lanes need dstate <= seg, so 16 segments (64-step chunks); CFG_PF_NOLANES: the same without lanes
CFG_PF = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, seg_bwd=16, seg=16, bwd_impl=4,
    pf=1, pf_bwd=7,
)  # fmt: skip
CFG_PF_NOLANES = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, seg_bwd=4, seg=2, bwd_impl=4,
    pf=0, pf_bwd=3,
)  # fmt: skip
# v6 backward (bwd_impl 5): 8-step segments, one channel per thread; blocks of 2, 4 or 8 channels sum dB/dC with the
# lanes' reduce-scatter (CFG_V6: 2 channels, 2 segments per chunk; CFG_V6_LANES: 2 channels on 16 segments, the next
# chunk's inputs loaded early and A / the adjoint carry in lanes, the CUDA default's options before scan pass 15;
# CFG_V6_FOUR / CFG_V6_EIGHT: 2 and 3 halving rounds), one channel the plain sum (CFG_V6_ONE)
CFG_V6 = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, seg_bwd=2, seg=2, bwd_impl=5
)
CFG_V6_LANES = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=2, chunk_bwd=8, num_warps_bwd=1, seg_bwd=16, seg=16, bwd_impl=5,
    pf=1, pf_bwd=6,
)  # fmt: skip
CFG_V6_ONE = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=1, chunk_bwd=8, num_warps_bwd=1, seg_bwd=4, seg=2, bwd_impl=5, pf_bwd=2
)
CFG_V6_FOUR = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=4, chunk_bwd=8, num_warps_bwd=1, seg_bwd=2, seg=2, bwd_impl=5
)
CFG_V6_EIGHT = ScanConfig(
    block_d=2, chunk=4, num_warps=1, block_d_bwd=8, chunk_bwd=8, num_warps_bwd=1, seg_bwd=4, seg=2, bwd_impl=5,
    pf_bwd=6,
)  # fmt: skip
CFG_V1 = ScanConfig(
    block_d=2, chunk=8, num_warps=1, block_d_bwd=2, chunk_bwd=4, num_warps_bwd=1, bwd_impl=0, fwd_impl=0
)


def make_inputs(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, seed=0, dt_scale=0.5):
    g = torch.Generator().manual_seed(seed)
    bshape = (batch, dstate, seqlen) if ngroups is None else (batch, ngroups, dstate, seqlen)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    return {
        "u": rnd(batch, dim, seqlen),
        "delta": dt_scale * rnd(batch, dim, seqlen),
        "A": -torch.rand(dim, dstate, generator=g, dtype=F64) * 2 - 0.1,
        "B": rnd(*bshape),
        "C": rnd(*bshape),
        "D": rnd(dim) if has_d else None,
        "z": rnd(batch, dim, seqlen) if has_z else None,
        "delta_bias": 0.3 * rnd(dim) if has_bias else None,
    }


def run_both(vals, softplus, cfg=CFG, deterministic=False):
    ours = {k: None if v is None else v.clone().requires_grad_() for k, v in vals.items()}
    ref = {k: None if v is None else v.clone().requires_grad_() for k, v in vals.items()}
    out, last = selective_scan_triton(
        **ours, delta_softplus=softplus, return_last_state=True, config=cfg, deterministic=deterministic
    )
    out_ref, last_ref = selective_scan_ref(**ref, delta_softplus=softplus, return_last_state=True)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    out.backward(grad)
    out_ref.backward(grad)
    return ours, ref, (out, last), (out_ref, last_ref)


def assert_match(ours, ref, res, res_ref, tol=1e-9):
    torch.testing.assert_close(res[0], res_ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(res[1], res_ref[1], rtol=tol, atol=tol)
    for k, v in ours.items():
        if v is not None:
            assert v.grad is not None, f"no gradient for {k}"
            torch.testing.assert_close(v.grad, ref[k].grad, rtol=tol, atol=tol, msg=lambda m, k=k: f"d{k}: {m}")


# (batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, softplus): a representative, not cartesian, set.
# chunk 8 / saved every 4: seqlen 1, 7, 8 (= chunk), 9 (= chunk + 1), 27 (3 chunks + 3); dim 5 / 6 vs block_d 2.
CASES = [
    (2, 5, 1, 4, None, True, True, True, True),
    (1, 5, 7, 16, None, False, True, False, False),
    (2, 3, 8, 1, None, True, False, True, False),
    (1, 6, 9, 4, 2, True, True, True, True),
    (2, 5, 27, 4, None, True, True, True, True),
    (1, 6, 27, 16, 2, False, False, False, True),
]


@pytest.mark.parametrize(
    "cfg",
    [
        CFG, CFG_V4, CFG_V4_ALT, CFG_V5, CFG_V5_ALT, CFG_V5_WARPS, CFG_PF, CFG_PF_NOLANES,
        CFG_V6, CFG_V6_LANES, CFG_V6_ONE, CFG_V6_FOUR, CFG_V6_EIGHT, CFG_V1,
    ],
    ids=[
        "bwd3", "bwd4", "bwd4alt", "bwd5", "bwd5alt", "bwd5warps", "pf", "pf_nolanes",
        "bwd6", "bwd6lanes", "bwd6one", "bwd6four", "bwd6eight", "bwd1",
    ],
)  # fmt: skip
@pytest.mark.parametrize("batch,dim,seqlen,dstate,ngroups,has_z,has_d,has_bias,softplus", CASES)
def test_matches_reference(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias, softplus, cfg):
    vals = make_inputs(batch, dim, seqlen, dstate, ngroups, has_z, has_d, has_bias)
    assert_match(*run_both(vals, softplus, cfg=cfg))


@pytest.mark.parametrize("dstate", [16, 4])
@pytest.mark.parametrize("pf_bwd", [7, 4], ids=["all", "lanes-only"])
def test_lanes_carry_across_chunks(dstate, pf_bwd):
    # CFG_PF's 64-step chunks: seqlen 150 crosses two chunk boundaries in both directions, so the carries held in
    # lanes (forward state, backward adjoint) are handed from chunk to chunk for every state
    vals = make_inputs(1, 3, 150, dstate, None, True, True, True)
    assert_match(*run_both(vals, True, cfg=dataclasses.replace(CFG_PF, pf_bwd=pf_bwd)))


_CUDA_PF_BWD = importlib.import_module("anytrain.kernels.selective_scan")._CUDA_CONFIG.pf_bwd


@pytest.mark.parametrize(
    "pf_bwd,dstate",
    [(6, 16), (6 + 80, 16), (6 + 80 + 128, 16), (_CUDA_PF_BWD | 4, 16), (_CUDA_PF_BWD & ~4, 16),
     (_CUDA_PF_BWD | 4, 32)],
    ids=["prefetch", "pipelined", "pipelined-first", "cuda-loads-lanes", "cuda-loads-lanes2", "cuda-loads-lanes2-32"],
)  # fmt: skip
def test_v6_carry_across_chunks(pf_bwd, dstate):
    # 128-step backward chunks (16 segments of 8), seqlen 300: the adjoint carry crosses two chunk boundaries for every
    # state, with a partial last chunk; the per-state loads as a register prefetch, through the software pipeliner
    # (5 stages), pipelined with each chunk's first saved states prefetched during the previous chunk, and the CUDA
    # default's loads (only the saved states pipelined, states rotated per program) with one lane register (bit 4) and
    # with the default's two (dstate 16, and 32 = 2 seg_bwd with bit 4 asked for: the launcher takes the two); the
    # interpreter runs the same loads without the pipelining
    cfg = dataclasses.replace(CFG_V6_LANES, pf_bwd=pf_bwd)
    vals = make_inputs(1, 3, 300, dstate, None, True, True, True)
    assert_match(*run_both(vals, True, cfg=cfg))


# (channels, lanes per channel, dstate, pf_bwd): the CUDA default (A, the adjoint carry and dA in two lane registers,
# states rotated per program), the pass-15 default (scratch, no rotation), the default's bits where the lane carries do
# not apply (8 x 4 at dstate 16: scratch, rotated), one lane register (4), and the two lane registers partly (12) or
# not at all (6 <= 8) filled
V6_WARP_TILES = [(4, 8, 16, _CUDA_PF_BWD), (4, 8, 16, 442), (8, 4, 16, _CUDA_PF_BWD), (4, 8, 8, _CUDA_PF_BWD | 4),
                 (4, 8, 12, _CUDA_PF_BWD), (4, 8, 6, _CUDA_PF_BWD)]  # fmt: skip


@pytest.mark.parametrize(
    "block_d_bwd,seg_bwd,dstate,pf_bwd", V6_WARP_TILES,
    ids=["4x8", "4x8-scratch", "8x4", "4x8-lanes", "4x8-lanes2-12", "4x8-lanes2-6"],
)  # fmt: skip
def test_v6_more_channels_per_warp(block_d_bwd, seg_bwd, dstate, pf_bwd):
    # 4 channels x 8 segments (the CUDA default) or 8 x 4 (one warp's 32 lanes, 64- or 32-step chunks): the dB/dC
    # reduce-scatter in 2 or 3 rounds; dim 10 leaves the last program partly masked and gives 3 or 2 programs (state
    # loops rotated by 0-2), seqlen 196 crosses 3-6 chunk boundaries and ends in half a segment; batch 1 (see the next
    # test for 2)
    cfg = dataclasses.replace(CFG_V6_LANES, block_d_bwd=block_d_bwd, seg_bwd=seg_bwd, pf_bwd=pf_bwd)
    vals = make_inputs(1, 10, 196, dstate, None, True, True, True)
    assert_match(*run_both(vals, True, cfg=cfg))


@pytest.mark.parametrize(
    "pf_bwd", [_CUDA_PF_BWD, _CUDA_PF_BWD & ~112, _CUDA_PF_BWD & ~1024], ids=["cuda", "no-stages", "no-rotation"]
)  # fmt: skip
def test_v6_lane_carries_batches_and_groups(pf_bwd):
    # the CUDA default's 4 x 8 tile on 2 batches and 2 groups of 6 channels (dA's per-batch offset, the rotation per
    # program inside each group), also with the saved states loaded without the pipeliner (the rotated first prefetch
    # of the register path) and without the rotation
    cfg = dataclasses.replace(CFG_V6_LANES, block_d_bwd=4, seg_bwd=8, pf_bwd=pf_bwd)
    vals = make_inputs(2, 12, 78, 16, 2, True, True, True)  # two 64-step chunks (one carry handover), a partial segment
    assert_match(*run_both(vals, True, cfg=cfg))


@pytest.mark.parametrize("seqlen", [64, 48])
def test_v6_whole_chunks_and_bf16_pairs_are_bitwise_the_masked_loads(seqlen):
    # pf_bwd 2048 (no time masks on the B/C loads and dB/dC atomics when seqlen fills whole chunks) and 4096 (with it,
    # bf16 B/C read as int32 pairs) only change how B/C reach registers and how the atomics are guarded: every output
    # must be bitwise the masked kernel's, the flags must reach the kernel exactly where they apply, and the fp64 case
    # must match the reference (4 x 4 tile: 32-step chunks, so seqlen 64 is two whole chunks and 48 is not, though a
    # multiple of 16; dim 8 is two programs, so dB/dC go through the atomics)
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    kernel, flags = scan_mod._ss_bwd_kernel_v6, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                flags.append((kw["EVEN"], kw["BITS"]))
                return kernel[grid](*a, **kw)

            return launch

    base = dataclasses.replace(CFG_V6_LANES, block_d_bwd=4, seg_bwd=4, pf_bwd=_CUDA_PF_BWD & ~(2048 | 4096))
    vals = make_inputs(1, 8, seqlen, 16, None, True, True, True)
    bf = {k: None if v is None else v.to(torch.bfloat16 if k in ("u", "delta", "z", "B", "C") else torch.float32)
          for k, v in vals.items()}  # fmt: skip
    scan_mod._ss_bwd_kernel_v6 = Recorder()
    try:
        assert_match(*run_both(vals, True, cfg=dataclasses.replace(base, pf_bwd=base.pf_bwd | 2048 | 4096)))
        grads = []
        for extra in (0, 2048, 2048 | 4096):
            leaves = {k: None if v is None else v.clone().requires_grad_() for k, v in bf.items()}
            cfg = dataclasses.replace(base, pf_bwd=base.pf_bwd | extra)
            out = selective_scan_triton(**leaves, delta_softplus=True, config=cfg)
            out.backward(torch.ones_like(out))
            grads.append([leaves[k].grad for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")])
    finally:
        scan_mod._ss_bwd_kernel_v6 = kernel
    for got in grads[1:]:
        assert all(torch.equal(x, y) for x, y in zip(got, grads[0], strict=True))
    even = seqlen % 32 == 0
    assert flags == [(even, False), (False, False), (even, False), (even, even)]


def test_cuda_default_backward_tile_is_tested():
    cuda = importlib.import_module("anytrain.kernels.selective_scan")._CUDA_CONFIG
    assert cuda.bwd_impl == 5 and cuda.num_warps_bwd == 1 and cuda.chunk_bwd == 8
    assert (cuda.block_d_bwd, cuda.seg_bwd, 16, cuda.pf_bwd) in V6_WARP_TILES


def test_v6_lane_carries_and_rotation_reach_the_kernel(monkeypatch):
    # pf_bwd 512 -> LANES2 where dstate <= 2 seg_bwd and bit 4's one-register lanes do not apply, with one dA partial
    # per program instead of one per chunk; 1024 -> ROT
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["LANES"], kw["LANES2"], kw["ROT"], a[15].shape[1]))

    monkeypatch.setattr(scan_mod, "_ss_bwd_kernel_v6", Recorder())
    cuda = scan_mod._CUDA_CONFIG
    for dstate, pf_bwd in [(16, cuda.pf_bwd), (17, cuda.pf_bwd), (8, cuda.pf_bwd | 4), (16, 442)]:
        vals = make_inputs(1, 4, 256, dstate, None, True, True, True)
        v = {k: None if x is None else x.float() for k, x in vals.items()}
        Bg, Cg = scan_mod._as_groups(v["B"]), scan_mod._as_groups(v["C"])
        states = torch.zeros(1, 4, dstate, 32)
        cfg = dataclasses.replace(cuda, pf_bwd=pf_bwd)
        scan_mod._bwd(v["u"], v["u"], v["delta"], v["A"], Bg, Cg, v["D"], v["z"], v["delta_bias"], states, True, cfg,
                      False)  # fmt: skip
    assert seen == [(False, True, True, 1), (False, False, True, 4), (True, False, True, 4), (False, False, False, 4)]


def test_v6_batch_sums_in_the_kernel_only_with_atomics_and_lane_carries(monkeypatch):
    # pf_bwd 8192 -> BSUM (dA, dD, dbias summed over the batch by atomic adds; the launcher then allocates them without
    # a batch dimension and zeroes them) only where the kernel's dB/dC are atomic (more than one channel block) and A /
    # the carries sit in two lane registers (512); its sums are checked by test_v6_lane_carries_batches_and_groups
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["BSUM"], *(tuple(x.shape) for x in a[15:18])))

    monkeypatch.setattr(scan_mod, "_ss_bwd_kernel_v6", Recorder())
    cuda = scan_mod._CUDA_CONFIG
    assert cuda.pf_bwd & 8192 and cuda.pf_bwd & 512
    for dim, pf_bwd in [(8, cuda.pf_bwd), (4, cuda.pf_bwd), (8, cuda.pf_bwd & ~8192), (8, cuda.pf_bwd & ~512)]:
        vals = make_inputs(2, dim, 128, 16, None, True, True, True)
        v = {k: None if x is None else x.float() for k, x in vals.items()}
        Bg, Cg = scan_mod._as_groups(v["B"]), scan_mod._as_groups(v["C"])
        states = torch.zeros(2, dim, 16, 16)
        cfg = dataclasses.replace(cuda, pf_bwd=pf_bwd)
        scan_mod._bwd(v["u"], v["u"], v["delta"], v["A"], Bg, Cg, v["D"], v["z"], v["delta_bias"], states, True, cfg,
                      False)  # fmt: skip
    assert seen == [(True, (1, 1, 8, 16), (8,), (8,)), (False, (2, 1, 4, 16), (2, 4), (2, 4)),
                    (False, (2, 1, 8, 16), (2, 8), (2, 8)), (False, (2, 2, 8, 16), (2, 8), (2, 8))]  # fmt: skip
    # deterministic (no atomics; at this size v6 itself, with per-block dB/dC partials): never BSUM
    seen.clear()
    scan_mod._bwd(v["u"], v["u"], v["delta"], v["A"], Bg, Cg, v["D"], v["z"], v["delta_bias"], states, True, cuda, True)
    assert seen == [(False, (2, 1, 8, 16), (2, 8), (2, 8))]


def test_v6_load_options_reach_the_kernel(monkeypatch):
    # pf_bwd bits -> v6's STAGES ((pf_bwd >> 4) & 7), FIRST (128, needs bit 2 and stages), BC_REG (256, needs stages);
    # the CUDA default pipelines the saved states only, with FIRST
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["STAGES"], kw["FIRST"], kw["BC_REG"]))

    monkeypatch.setattr(scan_mod, "_ss_bwd_kernel_v6", Recorder())
    v = {k: None if x is None else x.float() for k, x in make_inputs(1, 4, 64, 16, None, True, True, True).items()}
    Bg, Cg = scan_mod._as_groups(v["B"]), scan_mod._as_groups(v["C"])
    states = torch.zeros(1, 4, 16, 8)
    for pf_bwd in (_CUDA_PF_BWD, 6 + 48 + 128, 4 + 48 + 128, 6 + 128 + 256, 6 + 80 + 256):
        cfg = dataclasses.replace(CFG_V6_LANES, pf_bwd=pf_bwd)
        scan_mod._bwd(v["u"], v["u"], v["delta"], v["A"], Bg, Cg, v["D"], v["z"], v["delta_bias"], states, True, cfg,
                      False)  # fmt: skip
    stages = (_CUDA_PF_BWD >> 4) & 7
    assert stages > 0 and seen == [(stages, True, True), (3, True, False), (3, False, False), (0, False, False),
                                   (5, False, True)]  # fmt: skip


def test_cuda_default_options_run_in_the_interpreter():
    # the CUDA default's option bits (pipelined B/C loads in groups of states, lanes, fast sigmoids asked for: the
    # launchers must drop FAST for CPU tensors, the interpreter has no libdevice) on CFG_PF's small tiles
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    cuda = scan_mod._CUDA_CONFIG
    assert scan_mod.fwd_group(cuda, 16) > 1  # the default groups states (the test below covers the group sizes)
    cfg = dataclasses.replace(CFG_PF, pf=cuda.pf, pf_bwd=15)
    vals = make_inputs(1, 3, 150, 16, None, True, True, True)
    assert_match(*run_both(vals, True, cfg=cfg))


@pytest.mark.parametrize(
    "pf,dstate,group,seqlen",
    [(4096 + 1, 16, 2, 150), (8192 + 96 + 1, 16, 4, 150), (12288 + 1, 8, 8, 150), (8192 + 1, 4, 4, 150),
     (4096 + 1, 6, 2, 150)],
)  # fmt: skip
def test_forward_groups_of_states(pf, dstate, group, seqlen):
    # pf bits 4096-12288: the forward's state loop takes 2-8 states per iteration from a chunk-major copy of B/C
    # (zero-padded: seqlen 150 is two whole 64-step chunks and a partial one)
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    cfg = dataclasses.replace(CFG_PF, pf=pf)
    assert scan_mod.fwd_group(cfg, dstate) == group
    vals = make_inputs(2, 4, seqlen, dstate, 2, True, True, True)
    assert_match(*run_both(vals, True, cfg=cfg))


@pytest.mark.parametrize("pf", [4 + 1, 8192 + 96 + 4 + 1, 4096 + 4 + 2 + 1])
def test_forward_whole_chunks_with_a_masked_channel(pf):
    # pf 4 (whole chunks): no padding mask on delta (_delta's MASK) nor on the B/C loads; dim 3 in 2-channel blocks
    # leaves the second block's second channel masked, whose delta then stays softplus(0) instead of 0: it must reach
    # only that channel's own (unstored) states and outputs
    cfg = dataclasses.replace(CFG_PF, pf=pf)
    assert 128 % (cfg.chunk * cfg.seg) == 0
    vals = make_inputs(2, 3, 128, 16, None, True, True, True)
    assert_match(*run_both(vals, True, cfg=cfg))


def test_forward_groups_keep_mixed_b_and_c_dtypes():
    # the chunk-major copy holds B and C in one tensor: in the dtype both promote to, neither rounded to the other's
    vals = make_inputs(1, 2, 150, 4, None, True, True, True)
    vals["B"] = vals["B"].to(torch.bfloat16).double()  # exactly representable in bf16
    vals_mixed = dict(vals, B=vals["B"].to(torch.bfloat16))
    out, last = selective_scan_triton(
        **vals_mixed, delta_softplus=True, return_last_state=True, config=dataclasses.replace(CFG_PF, pf=4096 + 1)
    )
    out_ref, last_ref = selective_scan_ref(**vals, delta_softplus=True, return_last_state=True)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(last.double(), last_ref, rtol=1e-9, atol=1e-9)


def test_forward_group_register_cap_only_with_groups(monkeypatch):
    # a grouped config's maxnreg was tuned for the grouped kernel: a dstate the group does not divide runs uncapped
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    monkeypatch.setattr(scan_mod.hardware, "vendor", lambda: scan_mod.hardware.CUDA)
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["GROUP"], kw.get("maxnreg")))

    monkeypatch.setattr(scan_mod, "_ss_fwd_kernel_v3", Recorder())
    for cfg, dstate in [(scan_mod._CUDA_CONFIG, 16), (scan_mod._CUDA_CONFIG, 5),
                        (dataclasses.replace(scan_mod._CUDA_CONFIG, pf=151), 16)]:  # fmt: skip
        vals = make_inputs(1, 2, 256, dstate, None, True, True, True)
        v = {k: None if x is None else x.float() for k, x in vals.items()}
        Bg, Cg = scan_mod._as_groups(v["B"]), scan_mod._as_groups(v["C"])
        scan_mod._fwd(v["u"], v["delta"], v["A"], Bg, Cg, v["D"], v["z"], v["delta_bias"], True, cfg)
    cap, group = scan_mod._CUDA_CONFIG.maxnreg, scan_mod.fwd_group(scan_mod._CUDA_CONFIG, 16)
    assert cap and group > 1 and 5 % group and seen == [(group, cap), (1, None), (1, cap)]


def test_forward_groups_need_lanes_and_a_dividing_dstate():
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    fwd_group = scan_mod.fwd_group
    assert fwd_group(dataclasses.replace(CFG_PF, pf=8192 + 1), 16) == 4
    assert fwd_group(dataclasses.replace(CFG_PF, pf=8192), 16) == 1  # no lanes
    assert fwd_group(dataclasses.replace(CFG_PF, pf=8192 + 1), 32) == 1  # dstate > seg (16): no lanes
    assert fwd_group(dataclasses.replace(CFG_PF, pf=12288 + 1), 12) == 1  # 8 does not divide 12
    assert fwd_group(dataclasses.replace(CFG_PF, pf=8192 + 1, fwd_impl=0), 16) == 1
    assert fwd_group(dataclasses.replace(CFG_PF, pf=1), 16) == 1


@pytest.mark.parametrize("seqlen", [128, 100])
def test_chunk_major_copy_of_b_and_c(seqlen):
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
    g = torch.Generator().manual_seed(3)
    B = torch.randn(2, 3, 5, 2 * seqlen, generator=g)[..., ::2]  # (batch, G, N, L), strided in time
    C = torch.randn(2, 3, 5, seqlen, generator=g)
    bc = scan_mod._chunk_major(B, C, 64)
    nch = -(-seqlen // 64)
    assert bc.shape == (2, 3, nch, 5, 2, 64) and bc.is_contiguous()
    for k, x in enumerate((B, C)):
        flat = bc[:, :, :, :, k].transpose(2, 3).reshape(2, 3, 5, nch * 64)
        assert torch.equal(flat[..., :seqlen], x)
        assert not flat[..., seqlen:].any()  # the padding is zero


def test_fast_sigmoid_only_for_fp32_gpu_tensors_outside_the_interpreter(monkeypatch):
    """The libdevice sigmoid (FAST) needs a GPU compile: never for CPU tensors, fp64 or the interpreter."""
    from types import SimpleNamespace

    cpu, gpu = torch.empty(1), SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _fast_math(True, cpu, torch.float32)
    assert _fast_math(True, gpu, torch.float32)
    assert not _fast_math(False, gpu, torch.float32)
    assert not _fast_math(True, gpu, torch.float64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _fast_math(True, gpu, torch.float32)


def test_single_saved_state_per_chunk_and_4d_groups_of_one():
    # chunk == chunk_bwd (no sub-chunk states), B/C given as (batch, 1, dstate, L)
    vals = make_inputs(1, 4, 10, 4, 1, True, True, True)
    assert_match(*run_both(vals, True, cfg=CFG_SAME))


@pytest.mark.parametrize("cfg", [CFG, CFG_V4, CFG_V5, CFG_V6, CFG_V1], ids=["bwd3", "bwd4", "bwd5", "bwd6", "bwd1"])
def test_extreme_decay_underflows_without_nan(cfg):
    # delta*A down to about -1e4: exp underflows to exactly 0; the state then forgets the past completely
    vals = make_inputs(1, 3, 12, 4, None, True, True, False, dt_scale=1.0)
    vals["delta"] = vals["delta"].abs() * 100.0
    vals["A"] = vals["A"] * 50.0
    ours, ref, res, res_ref = run_both(vals, False, cfg=cfg)
    for k, v in ours.items():
        if v is not None:
            assert torch.isfinite(v.grad).all(), k
    assert torch.isfinite(res[0]).all()
    assert_match(ours, ref, res, res_ref, tol=1e-7)


@pytest.mark.parametrize("cfg", [CFG, CFG_V5, CFG_V6], ids=["bwd3", "bwd5", "bwd6"])
def test_float32_and_bfloat16_inputs_keep_dtype(cfg):
    vals = make_inputs(1, 3, 9, 4, None, True, True, True)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        cast = {k: None if v is None else v.to(dtype if k in ("u", "delta", "z", "B", "C") else torch.float32)
                for k, v in vals.items()}  # fmt: skip
        leaves = {k: None if v is None else v.clone().requires_grad_() for k, v in cast.items()}
        out, last = selective_scan_triton(**leaves, delta_softplus=True, return_last_state=True, config=cfg)
        assert out.dtype == dtype and last.dtype == torch.float32
        ref_in = {k: None if v is None else v.double().requires_grad_() for k, v in cast.items()}
        ref = selective_scan_ref(**ref_in, delta_softplus=True)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
        out.backward(grad.to(dtype))
        ref.backward(grad)
        for k, v in leaves.items():  # gradients keep their input's dtype (B/C too with bc_f32)
            if v is not None:
                assert v.grad.dtype == v.dtype, k
                g_ref = ref_in[k].grad
                torch.testing.assert_close(v.grad.double(), g_ref, rtol=tol, atol=tol * g_ref.abs().max().item())


@pytest.mark.parametrize("seqlen", [128, 150, 149])
def test_forward_bf16_pairs_and_unmasked_loads_are_bitwise_the_plain_loads(seqlen):
    # pf 4 (no time mask when seqlen fills whole 64-step chunks) and 2 (with 4: bf16 B/C read as int32 pairs, when
    # strides and seqlen are even) only change how B/C reach registers: out and the saved states must be bitwise equal
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")  # the package attribute is the public op

    vals = make_inputs(1, 2, seqlen, 16, None, True, True, True)
    bf = {k: None if v is None else v.to(torch.bfloat16 if k in ("u", "delta", "z", "B", "C") else torch.float32)
          for k, v in vals.items()}  # fmt: skip
    Bg, Cg = scan_mod._as_groups(bf["B"]), scan_mod._as_groups(bf["C"])
    assert scan_mod._bf16_pairs(Bg, Cg) == (seqlen % 2 == 0)
    args = (bf["u"], bf["delta"], bf["A"], Bg, Cg, bf["D"], bf["z"], bf["delta_bias"], True)
    flags = []
    kernel = scan_mod._ss_fwd_kernel_v3

    class Recorder:  # the launcher's kernel[grid](...) call, recording which load path it chose
        def __getitem__(self, grid):
            def launch(*a, **kw):
                flags.append((kw["BC_BITS"], kw["EVEN"], kw["STAGES"]))
                return kernel[grid](*a, **kw)

            return launch

    scan_mod._ss_fwd_kernel_v3 = Recorder()
    try:
        plain = scan_mod._fwd(*args, dataclasses.replace(CFG_PF, pf=0))
        # the B/C loads inside the state loop for the software pipeliner: 135 = 4 stages with lanes, 102 = 3 stages
        # without (the interpreter ignores num_stages: this checks the in-loop indexing and masks)
        for pf in (1, 5, 6, 7, 135, 102):
            got = scan_mod._fwd(*args, dataclasses.replace(CFG_PF, pf=pf))
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), pf
        # groups of 2 / 4 states from the padded chunk-major copy: int32 pairs at any seqlen
        for pf in (4096 + 135, 8192 + 7, 12288 + 103):
            got = scan_mod._fwd(*args, dataclasses.replace(CFG_PF, pf=pf))
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), pf
    finally:
        scan_mod._ss_fwd_kernel_v3 = kernel
    even = seqlen % 64 == 0  # CFG_PF: 4-step segments x 16 = 64-step chunks
    assert flags == [(False, False, 0), (False, False, 0), (False, even, 0), (even, even, 0), (even, even, 0),
                     (even, even, 4), (even, even, 3), (True, even, 4), (True, even, 0), (True, even, 3)]  # fmt: skip


def test_forward_int32_pairs_need_an_even_chunk():
    # one step per thread (chunk 1) cannot hold a pair: the launcher keeps the plain loads
    scan_mod = importlib.import_module("anytrain.kernels.selective_scan")  # the package attribute is the public op

    vals = make_inputs(1, 2, 32, 4, None, True, True, True)
    bf = {k: None if v is None else v.to(torch.bfloat16 if k in ("u", "delta", "z", "B", "C") else torch.float32)
          for k, v in vals.items()}  # fmt: skip
    args = (bf["u"], bf["delta"], bf["A"], scan_mod._as_groups(bf["B"]), scan_mod._as_groups(bf["C"]), bf["D"],
            bf["z"], bf["delta_bias"], True)  # fmt: skip
    cfg = ScanConfig(block_d=1, chunk=1, num_warps=1, block_d_bwd=2, chunk_bwd=8, seg=16, seg_bwd=4, bwd_impl=4)
    plain = scan_mod._fwd(*args, cfg)
    got = scan_mod._fwd(*args, dataclasses.replace(cfg, pf=6))
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


@pytest.mark.parametrize(
    "cfg",
    [CFG, CFG_V4, CFG_V4_ALT, CFG_V5, CFG_V6, CFG_V6_FOUR, CFG_V6_EIGHT, CFG_V1],
    ids=["bwd3", "bwd4", "bwd4alt", "bwd5", "bwd6", "bwd6four", "bwd6eight", "bwd1"],
)
def test_deterministic_mode_is_bitwise_reproducible_and_matches_atomics(cfg):
    vals = make_inputs(2, 6, 11, 4, 2, True, True, True, seed=5)
    runs = [run_both(vals, True, cfg=cfg, deterministic=True)[0] for _ in range(2)]
    atomic = run_both(vals, True, cfg=cfg, deterministic=False)[0]
    for k in vals:
        if vals[k] is not None:
            assert torch.equal(runs[0][k].grad, runs[1][k].grad), k
            torch.testing.assert_close(atomic[k].grad, runs[0][k].grad, rtol=1e-10, atol=1e-10)


def test_public_dispatch_uses_triton_when_asked(monkeypatch):
    import anytrain.kernels as K

    vals = make_inputs(1, 3, 5, 2, None, False, True, False)
    calls = []
    scan_mod = sys.modules["anytrain.kernels.selective_scan"]
    real = scan_mod.selective_scan_triton
    monkeypatch.setattr(scan_mod, "selective_scan_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    old = K.get_backend()
    try:
        K.set_backend("triton")
        out = K.selective_scan(**vals)
        K.set_backend("reference")
        ref = K.selective_scan(**vals)
    finally:
        K.set_backend(old)
    assert calls == [1]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_rejects_bad_groups():
    vals = make_inputs(1, 5, 4, 2, 2, False, False, False)
    with pytest.raises(ValueError, match="ngroups"):
        selective_scan_triton(**vals, config=CFG)


@pytest.mark.parametrize("cfg", [CFG_V4, CFG_V6_LANES], ids=["bwd4", "bwd6"])
def test_deterministic_many_blocks_falls_back_to_v3_backward(monkeypatch, cfg):
    # bwd_impl 3-5 with 1-2-channel blocks would need dim-many dB/dC partials at real sizes: above _MAX_PARTIALS
    # elements the deterministic backward runs the v3 kernel (4-channel blocks, 32+ segments) on the same saved states
    scan_mod = sys.modules["anytrain.kernels.selective_scan"]
    monkeypatch.setattr(scan_mod, "_MAX_PARTIALS", 0)
    seen = []
    kernel = scan_mod._ss_bwd_kernel_v3

    class Recorder:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append((kw["BLOCK_D"], kw["SEG"]))
                return kernel[grid](*a, **kw)

            return launch

    monkeypatch.setattr(scan_mod, "_ss_bwd_kernel_v3", Recorder())
    vals = make_inputs(1, 5, 19, 4, None, True, True, True, seed=2)
    assert_match(*run_both(vals, True, cfg=cfg, deterministic=True))
    assert seen == [(4, 32)]


@pytest.mark.parametrize("cfg", [CFG, CFG_V1], ids=["fwd_v3", "fwd_v2"])
def test_fwd_launcher_writes_into_strided_out(cfg):
    """``_fwd(..., out=)`` into a (batch, dim, L) view of a (dim, batch·L) matrix (the fused Mamba op's layout), with
    u, delta, z and B/C in such views too: bitwise the same output and states as on contiguous tensors."""
    from anytrain.kernels.selective_scan import _as_groups, _fwd

    batch, dim, seqlen, dstate = 2, 5, 19, 4
    vals = make_inputs(batch, dim, seqlen, dstate, None, True, True, True, seed=3)

    def folded(t):  # (batch, C, L) contiguous -> the same values in the (C, batch·L) layout
        c = t.shape[1]
        return t.transpose(0, 1).reshape(c, batch * seqlen).view(c, batch, seqlen).transpose(0, 1)

    args = (vals["A"], _as_groups(vals["B"]), _as_groups(vals["C"]), vals["D"])
    ref, states_ref = _fwd(vals["u"], vals["delta"], *args, vals["z"], vals["delta_bias"], True, cfg)
    u, delta, z = folded(vals["u"]), folded(vals["delta"]), folded(vals["z"])
    Bg, Cg = folded(vals["B"]).unsqueeze(1), folded(vals["C"]).unsqueeze(1)
    out = folded(torch.zeros_like(ref))
    y, states = _fwd(u, delta, vals["A"], Bg, Cg, vals["D"], z, vals["delta_bias"], True, cfg, out=out)
    assert y is out and out.stride() == (seqlen, batch * seqlen, 1)
    assert torch.equal(out, ref) and torch.equal(states, states_ref)


@triton.jit
def _softplus_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _softplus(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_softplus_polynomial_is_fp32_accurate():
    """The kernels' fp32 softplus (log1p(exp(-|x|)) as exp(-|x|) times a degree-8 polynomial) against float64 over
    [-40, 40], relatively (tiny values included): within 4e-7 plus the fp32 rounding of -|x| log2(e) before exp2
    (|x| 2^-24 relative, as GPUs' exp has); float64 inputs keep the exact log."""
    x = torch.cat([torch.linspace(-40, 40, 4001), torch.tensor([0.0, -1e-6, 1e-6, -87.0, 30.0])])
    exact = x.double().clamp(min=0) + torch.log1p(torch.exp(-x.double().abs()))  # (torch's softplus is x above 20)
    for dtype, rtol, per_x in ((torch.float32, 4e-7, 2.0**-24), (F64, 1e-14, 0.0)):
        y = torch.empty_like(x, dtype=dtype)
        _softplus_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(dtype), y, x.numel(), BLOCK=1024)
        rel = (y.double() - exact).abs() / exact
        assert (rel < rtol + per_x * x.double().abs()).all(), (dtype, rel.max())


@triton.jit
def _softplus_grad_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _softplus_grad(_softplus(tl.load(x_ptr + offs, mask=offs < n))), mask=offs < n)


def test_softplus_derivative_from_delta():
    """The backward's softplus'(x) = sigmoid(x), computed from delta = softplus(x) alone (-expm1(-delta): a Taylor
    polynomial for small delta, 1 - exp(-delta) above), against float64's sigmoid over [-40, 40], relatively: fp32
    within the softplus' own error (4e-7 plus |x| 2^-24, passed through for small delta) plus 2e-7; fp64 within 1e-14.
    Both branches and their switches (delta = 1/2 at x = -0.43; 1/16 at x = -2.74) are in the range."""
    x = torch.cat([torch.linspace(-40, 40, 4001), torch.tensor([0.0, -0.4328, -0.4330, -2.7405, -2.7407, -87.0])])
    exact = torch.sigmoid(x.double())
    for dtype, rtol, per_x in ((torch.float32, 6e-7, 2.0**-24), (F64, 1e-14, 0.0)):
        y = torch.empty_like(x, dtype=dtype)
        _softplus_grad_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(dtype), y, x.numel(), BLOCK=1024)
        rel = (y.double() - exact).abs() / exact
        assert (rel < rtol + per_x * x.double().abs()).all(), (dtype, rel.max())


@triton.jit
def _times(a, b):
    return a * b


@triton.jit
def _wide_sum(a, b):
    # returns fp32 for fp16 inputs: the interpreter casts each step's result back to the inputs' dtype (only the
    # interpreter runs this kernel; compiled Triton wants the inputs' dtype back)
    return a.to(tl.float32) + b.to(tl.float32)


@triton.jit
def _reduce_scan_kernel(x_ptr, o_ptr, h_ptr, R: tl.constexpr, K: tl.constexpr):
    # custom-combine reductions and scans of the shapes the interpreter patch handles: 2-D over each axis (the
    # forward's _later and the scans' _combine), keep_dims, the whole tile (axis None), reverse, a 1-D scan (its
    # elements are scalars), and fp16 inputs whose combine returns fp32 (the cast back after every step)
    rows, cols = tl.arange(0, R)[:, None], tl.arange(0, K)[None, :]
    half = (tl.load(x_ptr + rows * K + cols) * 1000.0).to(tl.float16)
    tl.store(h_ptr + rows * K + cols, tl.associative_scan(half, 1, _wide_sum))
    tl.store(h_ptr + R * K + tl.arange(0, K), tl.reduce(half, 0, _wide_sum))
    x = tl.load(x_ptr + rows * K + cols)
    y = tl.load(x_ptr + R * K + rows * K + cols)
    step = cols + 0 * rows
    last, _ = tl.reduce((x, step), 1, _later)  # (R,)
    first_col, _ = tl.reduce((y, rows + 0 * cols), 0, _later, keep_dims=True)  # (1, K)
    pa, pb = tl.associative_scan((x, y), axis=1, combine_fn=_combine)
    qa, qb = tl.associative_scan((x, y), axis=0, combine_fn=_combine, reverse=True)
    whole_a = tl.reduce(x, None, _times)  # (one input: the interpreter's own axis-None path takes no tuples)
    whole_b = tl.reduce(y, None, _times, keep_dims=True)  # (1, 1)
    line_a, line_b = tl.associative_scan((tl.arange(0, K) * 0.5 + 1.0, tl.arange(0, K) * 0.25), 0, _combine)
    base = o_ptr + rows * K + cols
    tl.store(base, pa)
    tl.store(base + R * K, pb)
    tl.store(base + 2 * R * K, qa)
    tl.store(base + 3 * R * K, qb)
    tl.store(o_ptr + 4 * R * K + tl.arange(0, R), last)
    tl.store(o_ptr + 4 * R * K + R + tl.arange(0, K)[None, :], first_col)
    tl.store(o_ptr + 4 * R * K + R + K + tl.arange(0, K), line_a)
    tl.store(o_ptr + 4 * R * K + R + 2 * K + tl.arange(0, K), line_b)
    tl.store(o_ptr + 4 * R * K + R + 3 * K, whole_a)
    tl.store(o_ptr + 4 * R * K + R + 3 * K + 1 + tl.zeros((1, 1), dtype=tl.int32), whole_b)


def test_vectorized_interpreter_reduce_and_scan_are_bitwise_the_originals():
    """tests/triton_interpreter.py runs the interpreter's custom-combine reduce / scan on whole slices and skips its
    nested language patches: every result must be bitwise the interpreter's own, for a kernel of the shapes it handles
    and for a forward + backward of the scan (the CUDA default's options on small tiles: groups, lanes, v6)."""
    from tests import triton_interpreter

    if not triton_interpreter.installed():  # (installed by tests/conftest.py's session fixture)
        pytest.skip("this Triton's interpreter is not the layout tests/triton_interpreter.py knows: nothing patched")
    R, K = 4, 8
    x = torch.rand(2 * R * K, generator=torch.Generator().manual_seed(3)) + 0.5

    def both(fn):
        got = []
        for fast in (True, False):
            if fast:
                triton_interpreter.install()
            else:
                triton_interpreter.uninstall()
            try:
                assert triton_interpreter.installed() == fast
                got.append(fn())
            finally:
                triton_interpreter.install()
        return got

    def kernel():
        out, half = torch.zeros(4 * R * K + R + 3 * K + 2), torch.zeros(R * K + K, dtype=torch.float16)
        _reduce_scan_kernel[(1,)](x, out, half, R=R, K=K)
        return [out, half]

    def scan():
        cfg = dataclasses.replace(CFG_V6_LANES, pf=importlib.import_module("anytrain.kernels.selective_scan").
                                  _CUDA_CONFIG.pf, block_d_bwd=4, seg_bwd=8)  # fmt: skip
        vals = make_inputs(2, 4, 70, 8, 2, True, True, True)
        ours, _, (out, last), _ = run_both(vals, True, cfg=cfg)
        return [out, last, *(v.grad for v in ours.values() if v is not None)]

    for fn in (kernel, scan):
        fast, slow = both(fn)
        assert len(fast) == len(slow) and all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True)), fn.__name__
        assert all(t.abs().sum() > 0 for t in fast), fn.__name__
