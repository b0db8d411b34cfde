"""Closed forms of the cost model against hand-computed values (seed study formulas and anytrain's accounting)."""

import math

import pytest

from anytrain.config import ModelConfig
from anytrain.cost.devices import get_device
from anytrain.cost.model import (
    AMP,
    GIB,
    MEGATRON,
    Layout,
    ModelShape,
    Workload,
    activation_bytes_per_token,
    bubble_fraction,
    collective_time,
    communication,
    estimate,
    fit_efficiency,
    group_bandwidth,
    memory_per_device,
    seed_comm_per_step,
    seed_compute_flops,
    seed_energy_j,
    seed_memory_per_device,
    seed_time_s,
)
from anytrain.models import build_model, resolve_args

LLAMA_1B = ModelShape(22, 2048, 32, 4, 5632, 32000)


def test_seed_memory_closed_forms():
    m_p = 2 * 7e9  # 7B parameters in bf16
    assert seed_memory_per_device(m_p, "ddp", 64) == 6 * m_p
    assert seed_memory_per_device(m_p, "fsdp", 64) == pytest.approx(6 * m_p / 64)
    # 3D on 64 devices: tp 8, pp 2, ZeRO-1 over dp 4: (1+2+1)·M_p/16 + 2·M_p/64
    assert seed_memory_per_device(m_p, "3d", 64, tp=8, pp=2) == pytest.approx(4 * m_p / 16 + 2 * m_p / 64)


def test_seed_comm_fsdp_is_one_and_a_half_ddp():
    m = 14e9
    assert seed_comm_per_step(m, "ddp", 8) == pytest.approx(2 * 7 / 8 * m)
    assert seed_comm_per_step(m, "fsdp", 8) / seed_comm_per_step(m, "ddp", 8) == pytest.approx(1.5)


def test_seed_compute_time_energy():
    p = 175e9
    assert seed_compute_flops(p) == pytest.approx(120 * p * p)
    assert seed_compute_flops(p, 300e9) == pytest.approx(6 * p * 300e9)
    t = seed_time_s(1e24, 1000, 1e15, 0.5)
    assert t == pytest.approx(2e6)
    assert seed_energy_j(t, 1000, 500.0) == pytest.approx(2e6 * 1000 * 500)


def test_shape_matches_the_built_model():
    import torch

    for flavour in ("debug", "125m", "1.1b"):
        cfg = ModelConfig(flavour=flavour)
        with torch.device("meta"):
            model = build_model(cfg)
        shape = ModelShape.from_args(resolve_args(cfg))
        assert shape.num_params == model.num_params()
        assert shape.flops_per_token(1024) == pytest.approx(model.flops_per_token(1024))


def test_activation_count_by_hand():
    d, f = 2048, 5632
    # compiled, fp32 residual (autocast), K/V expanded: 2·4d + 2·2d + 2·3d + 2d + 3·2f
    assert activation_bytes_per_token(LLAMA_1B, AMP, compiled=True) == 8 * d + 4 * d + 6 * d + 2 * d + 6 * f
    # eager: 16d (norms) + 5·2d (autocast casts) + 6d + 2d + 8f = 34d + 8f
    assert activation_bytes_per_token(LLAMA_1B, AMP, compiled=False) == 34 * d + 8 * f
    gpt = ModelShape(96, 12288, 96, 96, 4 * 12288, 51200, mlp="gelu", expand_kv=False)
    h = 12288  # Korthikanti's 34·h minus the two 1-byte dropout masks = 32·h (bf16 residual, flash attention)
    assert activation_bytes_per_token(gpt, MEGATRON, compiled=True) == 32 * h


def test_single_device_memory_by_hand():
    """1.1B, seq 2048, micro-batch 4, autocast over fp32 params + fp32 AdamW, no AC, compiled."""
    wl = Workload(2048, 32, compiled=True)
    mem = memory_per_device(LLAMA_1B, Layout(micro_batch=4), wl, AMP)
    psi = LLAMA_1B.num_params
    assert mem["weights"] == 4 * psi and mem["grads"] == 4 * psi and mem["optimizer"] == 8 * psi
    assert mem["compute_copy"] == 2 * (psi - LLAMA_1B.embedding_params)
    tokens = 4 * 2048
    assert mem["activations"] == pytest.approx(activation_bytes_per_token(LLAMA_1B, AMP, True) * tokens * 22)
    assert mem["transient"] == 12 * 32000 * tokens


def test_sanity_against_measured_h200_peaks():
    """bench/results/train_check_nvidia-h200.json: 33.84 GiB (1.1B) and 14.04 GiB (125m), compiled blocks."""
    dev = get_device("h200")
    big = estimate(LLAMA_1B, Layout(micro_batch=4), Workload(2048, 32), dev)
    assert big.allocated_gib == pytest.approx(33.84, rel=0.05)
    small_shape = ModelShape.from_args(resolve_args(ModelConfig(flavour="125m")))
    small = estimate(small_shape, Layout(micro_batch=16), Workload(1024, 64), dev)
    assert small.allocated_gib == pytest.approx(14.04, rel=0.10)


def test_sharding_divides_states():
    wl = Workload(2048, 64)
    ddp = memory_per_device(LLAMA_1B, Layout(dp=8, strategy="ddp", micro_batch=1), wl, MEGATRON)
    z1 = memory_per_device(LLAMA_1B, Layout(dp=8, strategy="zero1", micro_batch=1), wl, MEGATRON)
    z3 = memory_per_device(LLAMA_1B, Layout(dp=8, strategy="fsdp", micro_batch=1), wl, MEGATRON)
    assert z1["optimizer"] == pytest.approx(ddp["optimizer"] / 8)
    assert z1["grads"] == ddp["grads"]
    assert z3["weights"] == pytest.approx(ddp["weights"] / 8) and z3["grads"] == pytest.approx(ddp["grads"] / 8)
    tp = memory_per_device(LLAMA_1B, Layout(dp=1, tp=4, strategy="ddp", micro_batch=1), Workload(2048, 8), MEGATRON)
    one = memory_per_device(LLAMA_1B, Layout(dp=1, strategy="ddp", micro_batch=1), Workload(2048, 8), MEGATRON)
    assert tp["weights"] == pytest.approx(one["weights"] / 4)
    assert tp["activations"] == pytest.approx(one["activations"] / 4)


def test_full_ac_keeps_block_inputs_only():
    wl = Workload(2048, 4)
    mem = memory_per_device(LLAMA_1B, Layout(micro_batch=4, ac="full"), wl, AMP)
    assert mem["activations"] == 4 * 2048 * 4 * 2048 * 22  # r·d·b·s per layer


def test_pipeline_bubble_and_in_flight():
    assert bubble_fraction(Layout(pp=4, micro_batch=1), 16) == pytest.approx(3 / 16)
    assert bubble_fraction(Layout(pp=4, pp_schedule="interleaved", pp_chunks=2), 16) == pytest.approx(3 / 32)
    assert bubble_fraction(Layout(pp=1), 16) == 0.0
    wl = Workload(2048, 64)
    shape = ModelShape(32, 4096, 32, 32, 11008, 32000)
    one_f = memory_per_device(shape, Layout(pp=4, micro_batch=1), wl, MEGATRON)
    gpipe = memory_per_device(shape, Layout(pp=4, micro_batch=1, pp_schedule="gpipe"), wl, MEGATRON)
    assert gpipe["activations"] == pytest.approx(one_f["activations"] * 64 / 4)  # m vs min(p, m) in flight


def test_ring_collectives_and_bandwidth():
    sent, sec = collective_time("all_reduce", 8e9, 8, 100e9, 0.0)
    assert sent == pytest.approx(2 * 7 / 8 * 8e9) and sec == pytest.approx(sent / 100e9)
    sent, _ = collective_time("all_gather", 8e9, 8, 100e9, 0.0)
    assert sent == pytest.approx(7 / 8 * 8e9)
    dev = get_device("h100")
    assert group_bandwidth(dev, 8, 1)[0] == 450e9 and not group_bandwidth(dev, 8, 1)[2]
    assert group_bandwidth(dev, 16, 1)[0] == pytest.approx(8 * 50e9)  # 8 members per node drive 8 NICs
    assert group_bandwidth(dev, 16, 8)[0] == pytest.approx(50e9)  # one member per node: one NIC


def test_fsdp_traffic_is_one_and_a_half_ddp_at_equal_dtypes():
    from dataclasses import replace

    prec = replace(MEGATRON, reduce=2.0, gather=2.0)
    wl = Workload(2048, 8)
    dev = get_device("h100")
    ddp = communication(LLAMA_1B, Layout(dp=8, strategy="ddp"), wl, prec, dev, 1.0)
    fsdp = communication(LLAMA_1B, Layout(dp=8, strategy="fsdp"), wl, prec, dev, 1.0)
    assert sum(c.bytes_per_step for c in fsdp) / sum(c.bytes_per_step for c in ddp) == pytest.approx(1.5)


def test_step_time_and_energy():
    dev = get_device("h100", efficiency=0.5)
    est = estimate(LLAMA_1B, Layout(micro_batch=4), Workload(2048, 4, tokens=8192 * 100), dev)
    flops = LLAMA_1B.flops_per_token(2048) * 8192
    # GEMMs at the efficiency plus the memory-bound part: per token 22 blocks x 3 x (4+2 + 4 + 4*256 ... ) bytes
    d, kv, f = 2048, 256, 5632
    per_token = 22 * 3 * ((4 + 2) * d + 4 * d + 4 * kv + 10 * d + (4 + 2) * d + 6 * f + 10 * d) + 16 * 32000
    params = 22 * LLAMA_1B.layer_params + LLAMA_1B.head_params
    elementwise = (8192 * per_token + 16 * params) / (3.35e12 * 0.85)
    assert est.elementwise_s == pytest.approx(elementwise)
    assert est.compute_s == pytest.approx(flops / (989e12 * 0.5) + elementwise)
    assert est.step_s == pytest.approx(est.compute_s) and est.mfu < 0.5
    assert fit_efficiency(est, est.step_s) == pytest.approx(0.5)  # refitting on its own prediction is a fixed point
    assert est.steps == 100
    assert est.energy_j == pytest.approx(100 * est.step_s * dev.tdp_watts * dev.power_fraction)
    assert est.tflops_per_watt == pytest.approx(989 * est.mfu / dev.avg_watts)
    assert math.isclose(est.allocated_gib, sum(est.memory.values()) / GIB)


def test_host_floor_binds_small_models_only():
    h200 = get_device("h200")
    tiny = ModelShape(4, 256, 4, 4, 688, 8192)
    one = Layout(dp=1, micro_batch=16)
    est_tiny = estimate(tiny, one, Workload(256, 16, compiled=False), h200)
    # eager: 1 micro-batch x 4 blocks x 2300 us + 2000 us per step, far above the GPU's ~0.1 ms of arithmetic
    assert est_tiny.host_s == pytest.approx((4 * 2300 + 2000) * 1e-6)
    assert est_tiny.step_s == pytest.approx(est_tiny.host_s) and est_tiny.notes
    # compiled blocks cost less host time; accumulation multiplies it
    four = estimate(tiny, Layout(dp=1, micro_batch=4), Workload(256, 16, compiled=True), h200)
    assert four.host_s == pytest.approx((4 * 4 * 450 + 2000) * 1e-6)
    # the 1.1B model is compute-bound: the floor does not change its step time
    big = estimate(LLAMA_1B, Layout(dp=1, micro_batch=4), Workload(2048, 32), h200)
    assert big.host_s < big.compute_s and big.step_s == pytest.approx(big.compute_s) and not big.notes


@pytest.mark.parametrize("flavour", ["tiny-mamba", "130m", "1.4b"])
def test_mamba_shape_matches_the_model(flavour):
    import torch

    from anytrain.cost.model import MambaShape

    cfg = ModelConfig(arch="mamba", flavour=flavour)
    with torch.device("meta"):
        model = build_model(cfg)
    shape = MambaShape.from_args(resolve_args(cfg))
    assert shape.num_params == model.num_params()
    assert shape.flops_per_token(2048) == pytest.approx(model.flops_per_token(2048))


def test_mamba_estimate_adds_the_scan_and_never_uses_tp():
    from anytrain.cost.model import MambaShape
    from anytrain.cost.planner import candidate_layouts

    shape = MambaShape.from_args(resolve_args(ModelConfig(arch="mamba", flavour="1.4b")))
    h200 = get_device("h200")
    est = estimate(shape, Layout(dp=1, micro_batch=4), Workload(2048, 32, compiled=False), h200)
    scan = 32 * 2048 * shape.n_layers * shape.d_inner * h200.scan_ns * 1e-9
    assert est.elementwise_s > scan > 0.1 * est.compute_s  # the scan is a visible share of a 1.4B step
    assert {lay.tp for lay in candidate_layouts(shape, 8, 8, 32)} == {1}
    fsdp = estimate(shape, Layout(dp=2, strategy="fsdp", micro_batch=4), Workload(2048, 32, compiled=False), h200)
    assert fsdp.allocated_gib < est.allocated_gib and fsdp.compute_s < est.compute_s


def test_selective_checkpointing_sits_between_none_and_full():
    h200 = get_device("h200")
    wl = Workload(2048, 32)
    est = {ac: estimate(LLAMA_1B, Layout(micro_batch=8, ac=ac), wl, h200) for ac in ("none", "selective", "full")}
    act = {ac: e.memory["activations"] for ac, e in est.items()}
    assert act["full"] < act["selective"] < act["none"]
    assert act["selective"] == pytest.approx((act["none"] + act["full"]) / 2)  # every other block checkpointed
    gemm = {ac: e.compute_s - e.elementwise_s for ac, e in est.items()}
    assert gemm["selective"] == pytest.approx(gemm["none"] * (1 + 0.5 / 3))
    assert gemm["full"] == pytest.approx(gemm["none"] * 4 / 3)
