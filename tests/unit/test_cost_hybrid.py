"""Hybrid Mamba-2 + attention models in the cost model: parameters, FLOPs per token and every block's matmuls equal
the model's own for each flavour and for odd patterns; a pattern of Mamba-2 blocks alone is estimated exactly as the
Mamba-2 model of the same args, and pairs of attention and MLP blocks have the Transformer's parameters and FLOPs;
``anytrain plan`` and the trainer's memory check take hybrid configs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from anytrain.config import ModelConfig, RunConfig, load_config
from anytrain.cost.devices import get_device
from anytrain.cost.memory import activation_bytes_per_token, mamba2_activation_bytes_per_token, run_memory_estimate
from anytrain.cost.model import AMP, Layout, Workload, estimate
from anytrain.cost.shapes import HybridShape, Mamba2Shape, ModelShape, shape_from_config
from anytrain.models import build_model
from anytrain.models.hybrid.model import HYBRID_FLAVOURS, HybridArgs
from tests.conftest import ROOT

SMALL = dict(vocab_size=96, d_model=32, mamba_d_state=8, mamba_headdim=8, mamba_chunk_size=16, attn_heads=4)


def built(args: dict) -> nn.Module:
    with torch.device("meta"):
        return build_model(ModelConfig(arch="hybrid", flavour="debug", args=args))


def hybrid_shape(args: dict) -> HybridShape:
    return shape_from_config(RunConfig(model=ModelConfig(arch="hybrid", flavour="debug", args=args)))


@pytest.mark.parametrize("flavour", list(HYBRID_FLAVOURS))
def test_flavour_shapes_match_the_model(flavour):
    cfg = ModelConfig(arch="hybrid", flavour=flavour)
    with torch.device("meta"):
        model = build_model(cfg)
    shape = shape_from_config(RunConfig(model=cfg))
    assert isinstance(shape, HybridShape) and shape.num_params == model.num_params()
    for seq in (1, 100, 2048):
        assert shape.flops_per_token(seq) == pytest.approx(model.flops_per_token(seq), rel=1e-12)


@pytest.mark.parametrize(
    ("pattern", "extra"),
    [("M-M-A-M-", {}), ("MMA*", {"attn_kv_heads": 2, "tie_embeddings": True}), ("-A-", {"mlp": "gelu"}), ("M", {})],
)
def test_odd_patterns_match_the_model_and_its_linear_layers(pattern, extra):
    args = {**SMALL, "layers_pattern": pattern, **extra}
    model, shape = built(args), hybrid_shape(args)
    assert (shape.n_mamba, shape.n_attention, shape.n_mlp) == (
        pattern.count("M"),
        pattern.count("A") + pattern.count("*"),
        pattern.count("-"),
    )
    assert shape.num_params == model.num_params()
    assert shape.flops_per_token(40) == pytest.approx(model.flops_per_token(40), rel=1e-12)
    # every block matmul's weight (the Mamba-2 in_proj pieces are one GEMM, as the mixer runs them)
    weights = sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear) and "layers" in name
    )
    assert sum(k * n for k, n in shape.block_linears()) == weights
    assert shape.fp8_candidates() is None and shape.n_heads == 1


def test_mamba_blocks_alone_are_estimated_as_the_mamba2_model():
    """'MMMM' builds the Mamba-2 model's blocks: the same parameters, FLOPs, activations, memory and step time."""
    args = HybridArgs(**SMALL, layers_pattern="MMMM", residual_in_fp32=True, tie_embeddings=True)
    hybrid = HybridShape.from_args(args)
    mamba2 = dataclasses.replace(Mamba2Shape.from_args(args.mamba_args()), n_layers=4)
    assert hybrid.num_params == mamba2.num_params and hybrid.block_linears() == mamba2.block_linears()
    for compiled in (False, True):
        assert activation_bytes_per_token(hybrid, AMP, compiled, seq_len=64) == mamba2_activation_bytes_per_token(
            mamba2, AMP, 64, compiled=compiled
        )
    device, wl = get_device("h200"), Workload(64, 16)
    for layout in (Layout(micro_batch=4), Layout(micro_batch=8, ac="full"), Layout(dp=2, strategy="fsdp")):
        ours, theirs = estimate(hybrid, layout, wl, device), estimate(mamba2, layout, wl, device)
        assert ours.memory == pytest.approx(theirs.memory, rel=1e-12)
        assert ours.step_s == pytest.approx(theirs.step_s, rel=1e-12)


def test_attention_and_mlp_pairs_have_the_transformers_parameters_and_flops():
    """'A-' x 3 is a Transformer's three blocks (attention, then MLP, each pre-normed): the same parameter count,
    FLOPs per token and matmuls as the ModelShape of the same widths."""
    args = HybridArgs(**SMALL, layers_pattern="A-A-A-", attn_kv_heads=2)
    hybrid = HybridShape.from_args(args)
    transformer = ModelShape(3, 32, 4, 2, args.ffn_dim, 96)
    assert hybrid.num_params == transformer.num_params
    assert hybrid.flops_per_token(128) == transformer.flops_per_token(128)
    assert sorted(hybrid.block_linears()) == sorted(transformer.block_linears())


def test_plan_and_the_trainers_memory_check_take_a_hybrid_config(capsys):
    from tests.conftest import cli_in_process

    code, out, _ = cli_in_process(
        capsys, "plan", "--model", str(ROOT / "configs/hybrid-1.2b.yaml"), "--gpu", "h200", "--gpus", "1"
    )
    assert code == 0, out
    assert "hybrid/1.2b: 1.187B parameters, L=64" in out and "recommended:" in out
    cfg = load_config(ROOT / "configs/tiny-hybrid.yaml")
    dims = type("Dims", (), {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1})()
    gib, phase = run_memory_estimate(cfg, dims, "single", cfg.train.micro_batch or 4, fp32=True)
    assert 0 < gib < 2 and phase in ("forward", "backward", "optimizer")
