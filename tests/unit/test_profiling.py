"""The kernel summary's timeline arithmetic (exposed communication, idle time) and kernel kinds."""

from __future__ import annotations

import json

import pytest
import torch

from anytrain.train.profiling import StepProfiler, _minus, _union_us, kernel_kind, summarize, timeline


def test_kernel_kinds_cover_communication_gemm_and_the_mamba_kernels():
    assert kernel_kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "communication"
    assert kernel_kind("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "communication"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert kernel_kind("Cijk_Alik_Bljk_BBS_BH_MT128x128x64") == "GEMM"  # rocBLAS / hipBLASLt
    assert kernel_kind("_ss_bwd_kernel_v4") == "selective scan"
    assert kernel_kind("triton_poi_fused_mul_silu_7") == "Triton fused elementwise (compile)"
    assert kernel_kind("something_new") == "other"


def test_union_and_minus():
    u = _union_us([(5, 7), (0, 2), (1, 3), (7, 8)])
    assert u == [(0, 3), (5, 8)]
    # [0,10) minus [2,3) and [5,12) -> [0,2) + [3,5) = 4
    assert _minus([(0, 10)], [(2, 3), (5, 12)]) == pytest.approx(4)
    # several a-intervals sharing one b-interval
    assert _minus([(0, 2), (3, 6), (8, 9)], [(1, 4)]) == pytest.approx(1 + 2 + 1)
    assert _minus([(0, 1)], []) == pytest.approx(1)


def test_timeline_exposed_communication_and_idle():
    kernels = [
        ("nvjet_gemm", 0.0, 100.0),
        ("ncclDevKernel_AllGather", 50.0, 130.0),  # 50..100 hidden under the GEMM, 100..130 exposed
        ("triton_poi_fused_add", 140.0, 150.0),  # 130..140 idle
        ("ncclDevKernel_ReduceScatter", 145.0, 160.0),  # 150..160 exposed
    ]
    t = timeline(kernels)
    assert t["span_ms"] == pytest.approx(0.160)
    assert t["comm_ms"] == pytest.approx(0.095)
    assert t["comm_exposed_ms"] == pytest.approx(0.040)
    assert t["idle_ms"] == pytest.approx(0.010)
    assert t["busy_ms"] == pytest.approx(0.150)
    assert timeline([])["span_ms"] == 0.0


def test_summarize_a_cpu_profile_and_the_step_profiler_window(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    s = summarize(prof)
    assert any("mm" in r["kernel"] for r in s["top"]) and s["timeline"]["span_ms"] == 0.0
    assert any("mm" in r["op"] for r in s["host_top"]) and s["host_ms"] >= max(r["ms"] for r in s["host_top"])
    p = StepProfiler(start=1, steps=2, out_dir=tmp_path, rank=3, device=torch.device("cpu"))
    for step in range(4):
        p.before_step(step)
        torch.ones(32, 32) @ torch.ones(32, 32)
        done = p.after_step(step)
        assert (done is not None) == (step == 2)
    out = json.loads((tmp_path / "rank3.json").read_text())
    assert out["steps"] == [1, 2] and out["rank"] == 3 and out["wall_ms"] > 0
    off = StepProfiler(start=0, steps=0, out_dir=tmp_path / "off", rank=0, device=torch.device("cpu"))
    off.before_step(0)
    assert off.after_step(0) is None and not (tmp_path / "off").exists()
