"""The cost model's gradient compression (``Workload.grad_compression``): bf16 / fp16 halve the gradient reduction,
PowerSGD sends (n + m)·r per compressed matrix, counted over the same matrices the trainer's hook compresses; PowerSGD
is offered for ddp / zero1 only; ``anytrain plan`` takes ``--grad-compression`` and shows the bytes."""

from __future__ import annotations

import pytest
import torch

from anytrain.config import ModelConfig, RunConfig
from anytrain.cost.devices import get_device
from anytrain.cost.model import AMP, FSDP_BF16, Layout, ModelShape, Workload, communication, estimate
from anytrain.cost.planner import plan
from anytrain.cost.shapes import gradient_matrices, powersgd_fraction, shape_from_config
from anytrain.errors import ConfigError
from anytrain.models import build_model
from anytrain.parallel.compression import powersgd_values

LLAMA_1B = ModelShape(22, 2048, 32, 4, 5632, 32000)
H100 = get_device("h100")


def grad_bytes(shape, layout: Layout, compression: str, prec=AMP) -> float:
    comms = communication(shape, layout, Workload(2048, 32, grad_compression=compression), prec, H100, 1.0)
    return sum(c.message_bytes * c.count for c in comms if c.gradients)


def test_powersgd_fraction_by_hand():
    """One block of width 64 (4 heads, 2 KV heads of 16), FFN 128, vocabulary 512, untied; rank 4."""
    shape = ModelShape(1, 64, 4, 2, 128, 512)
    whole = shape.num_params
    # q, o: 64 x 64 -> (64 + 64)·4; k, v: 32 x 64 -> 96·4; w1, w3: 128 x 64 and w2: 64 x 128 -> 192·4;
    # embedding and head: 512 x 64 -> 576·4; each is below half of n·m, so all are compressed
    sent = whole - (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64 + 2 * 512 * 64)
    sent += 4 * (2 * 128 + 2 * 96 + 3 * 192 + 2 * 576)
    assert powersgd_fraction(shape, 4) == pytest.approx(sent / whole)
    # rank 16: 64 x 64 -> (128)·16 = 2048, not below half of 4096: sent whole; 32 x 64 -> 96·16 = 1536 >= 1024 too
    assert powersgd_fraction(shape, 16) > powersgd_fraction(shape, 4)


@pytest.mark.parametrize("flavour, rank", [("debug", 4), ("debug", 1), ("tiny", 8)])
def test_the_cost_model_counts_the_matrices_the_hook_compresses(flavour, rank):
    cfg = RunConfig(model=ModelConfig(flavour=flavour))
    with torch.device("meta"):
        model = build_model(cfg.model)
    shapes = [p.shape for p in model.parameters()]
    shape = shape_from_config(cfg)
    assert len(gradient_matrices(shape)) == sum(1 for s in shapes if len(s) == 2)
    assert powersgd_fraction(shape, rank) * shape.num_params == pytest.approx(powersgd_values(shapes, rank))


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_gradient_bytes_scale_with_the_compression(strategy):
    layout = Layout(dp=4, strategy=strategy)
    fp32 = grad_bytes(LLAMA_1B, layout, "none")
    assert fp32 > 0
    assert grad_bytes(LLAMA_1B, layout, "bf16") == pytest.approx(fp32 / 2)
    assert grad_bytes(LLAMA_1B, layout, "fp16") == pytest.approx(fp32 / 2)
    powersgd = grad_bytes(LLAMA_1B, layout, "powersgd:rank=4")
    assert powersgd == pytest.approx(fp32 * powersgd_fraction(LLAMA_1B, 4))
    assert powersgd < fp32 / 100  # 1.1B: mostly 2048-wide matrices, 2048·2048 / (4096·4) = 256x smaller


def test_fsdp_reduces_in_bf16_and_refuses_powersgd():
    layout = Layout(dp=4, strategy="fsdp")
    assert grad_bytes(LLAMA_1B, layout, "bf16", FSDP_BF16) == pytest.approx(
        grad_bytes(LLAMA_1B, layout, "none", FSDP_BF16) / 2
    )
    with pytest.raises(ConfigError, match="powersgd runs with ddp or zero1 only"):
        grad_bytes(LLAMA_1B, layout, "powersgd:rank=4", FSDP_BF16)


def test_compression_makes_inter_node_ddp_faster_and_the_planner_keeps_to_ddp_zero1():
    layout = Layout(dp=16, strategy="ddp", micro_batch=2)  # two nodes: the all-reduce crosses the network
    times = {
        c: estimate(LLAMA_1B, layout, Workload(2048, 32, overlap=0.0, grad_compression=c), H100)
        for c in ("none", "bf16", "powersgd:rank=4")
    }  # fmt: skip (overlap 0: every byte is exposed)
    assert times["none"].step_s > times["bf16"].step_s > times["powersgd:rank=4"].step_s
    assert times["none"].exposed_comm_s == pytest.approx(2 * times["bf16"].exposed_comm_s, rel=0.01)
    assert times["bf16"].grad_reduce_bytes == pytest.approx(times["none"].grad_reduce_bytes / 2)
    result = plan(LLAMA_1B, H100, 16, Workload(2048, 32, grad_compression="powersgd:rank=4"), tp=1, pp=1)
    assert {e.layout.strategy for e in result.ranked} <= {"ddp", "zero1"}
    with pytest.raises(ConfigError, match="--grad-compression: powersgd runs with the ddp or zero1 strategy only"):
        plan(LLAMA_1B, H100, 16, Workload(2048, 32, grad_compression="powersgd:rank=4"), strategies=("fsdp",))


def test_plan_shows_the_gradient_bytes(capsys):
    from tests.conftest import cli_in_process

    args = ("plan", "--model", "1.1b", "--gpu", "h100", "--gpus", "4", "--strategy", "ddp", "--top", "1")
    _, plain, _ = cli_in_process(capsys, *args)
    code, out, _ = cli_in_process(capsys, *args, "--grad-compression", "bf16")
    assert code == 0 and "grad compression bf16" in out and "grad MiB" in out

    def grad_mib(text: str) -> float:
        row = next(line for line in text.splitlines() if line.startswith(" 1 "))
        return float(row.split("%")[1].split()[0])

    assert grad_mib(out) == pytest.approx(grad_mib(plain) / 2, abs=0.1)
    code, _, err = cli_in_process(capsys, *args, "--grad-compression", "powersgd:rank=0")
    assert code != 0 and err.startswith("error: --grad-compression: expected none, bf16, fp16 or powersgd:rank=R")
