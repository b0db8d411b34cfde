"""The cost model's FP8 terms (cost/fp8.py): the devices' FP8 rates, which GEMMs convert (asserted against the
trainer's own filter on the real models' modules), the FP8 GEMM time, cast and operand bytes by hand, FSDP's FP8
all-gather, the weight copies autocast no longer makes, the planner's FP8 ranking and its refusals, and MFU against
the dense bf16 peak in the cost model and in a training run."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch

from anytrain.config import ModelConfig, RunConfig, load_config
from anytrain.cost import fp8 as cost_fp8
from anytrain.cost.devices import get_device
from anytrain.cost.model import AMP, FSDP_BF16, Layout, Workload, communication, estimate, memory_phases
from anytrain.cost.planner import choose_layout, fp8_variants, plan
from anytrain.cost.shapes import shape_from_config
from anytrain.errors import ConfigError
from anytrain.models import build_model, spec_of
from anytrain.parallel import fp8 as parallel_fp8

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _shape(arch: str, flavour: str):
    return shape_from_config(RunConfig(model=ModelConfig(arch=arch, flavour=flavour)))


def test_fp8_rates_are_the_dense_datasheet_peaks_and_absent_without_fp8():
    assert get_device("h100").peak_fp8_tflops == get_device("h200").peak_fp8_tflops == 1979.0
    assert get_device("mi300x").peak_fp8_tflops == 2614.9
    for key in ("a100-80", "a100-40", "v100", "mi250x", "mi250x-card"):
        assert get_device(key).peak_fp8_tflops == 0.0, key
    assert get_device("h100").fp8_gemm_efficiency == get_device("h100").efficiency  # unset: the bf16 fraction
    assert get_device("h100", fp8_efficiency=0.5).fp8_gemm_efficiency == 0.5


@pytest.mark.parametrize(
    "arch, flavour", [("transformer", "1.1b"), ("transformer", "125m"), ("mamba", "1.4b"), ("mamba", "130m")]
)
@pytest.mark.parametrize("fp8_filter", ["auto", "aligned"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_gemms_are_the_ones_the_trainer_converts(arch, flavour, fp8_filter, recipe):
    """The real model's candidates (its parallelize plan) through the trainer's filter, as (in, out) widths: the
    cost model's converted linears, L times, never the LM head."""
    cfg = ModelConfig(arch=arch, flavour=flavour)
    with torch.device("meta"):
        model = build_model(cfg)
    candidates = spec_of(model).parallelize_plan.fp8_linears(model)
    assert not any("lm_head" in name or name == "output" for name in candidates)
    converted, _ = parallel_fp8.fp8_layers(model, candidates, recipe, fp8_filter)
    real = Counter((m.in_features, m.out_features) for m in map(model.get_submodule, converted))
    shape = _shape(arch, flavour)
    assert Counter(cost_fp8.converted_linears(shape, recipe, fp8_filter) * shape.n_layers) == real
    assert Counter(shape.fp8_candidates() * shape.n_layers) == Counter(
        (m.in_features, m.out_features) for m in map(model.get_submodule, candidates)
    )


def test_families_without_fp8_layers_have_no_candidates():
    from anytrain.models import REGISTRY

    assert REGISTRY["mamba2"].parallelize_plan.fp8_linears is None
    assert _shape("mamba2", "1.3b").fp8_candidates() is None
    with pytest.raises(ConfigError, match="train.fp8: FP8 training is not implemented for mamba2"):
        estimate(_shape("mamba2", "1.3b"), Layout(micro_batch=1), Workload(2048, 8, fp8="rowwise"), get_device("h100"))


def test_fp8_step_by_hand_on_one_h200():
    """1.1B, tensorwise, auto filter: wq, wo, w1, w3, w2 convert (wk, wv are 2048 -> 256, too small). Their 6·K·N FLOPs
    per token run at 1979 TFLOP/s x efficiency; the casts add (2a + 2)·(K + N) per token and (3·4 + 2)·K·N per
    micro-batch (the fp32 master weights), the FP8 operands save 2·(K + N) per token and 2·K·N per micro-batch, and
    autocast's 6-byte weight cast is not made."""
    shape, h200 = _shape("transformer", "1.1b"), get_device("h200")
    d, f, L = 2048, 5632, 22
    converted = [(d, d), (d, d), (d, f), (d, f), (f, d)]
    assert cost_fp8.converted_linears(shape, "tensorwise", "auto") == [(d, d), (d, d), (d, f), (d, f), (f, d)]
    lay, wl = Layout(micro_batch=4), Workload(2048, 8)
    bf16, tw = estimate(shape, lay, wl, h200), estimate(shape, lay, replace(wl, fp8="tensorwise"), h200)
    kn, widths = sum(k * n for k, n in converted), sum(k + n for k, n in converted)
    tokens, micro_batches = 8 * 2048, 2
    fp8_flops = 6 * L * kn * tokens
    gemm = fp8_flops * (1 / (1979e12 * h200.efficiency) - 1 / (989e12 * h200.efficiency))
    per_token = L * (6 - 2) * widths
    per_micro_batch = L * (14 - 2 - 6) * kn
    hbm = h200.hbm_tb_per_s * 1e12 * h200.hbm_efficiency
    assert tw.compute_s - bf16.compute_s == pytest.approx(
        gemm + (tokens * per_token + micro_batches * per_micro_batch) / hbm
    )
    assert tw.step_s < bf16.step_s and tw.flops_per_step == bf16.flops_per_step
    # MFU stays model FLOPs / (time x dense bf16 peak): a faster FP8 step is a higher MFU on the same scale
    assert tw.mfu == pytest.approx(tw.flops_per_step / (tw.step_s * 989e12)) and tw.mfu > bf16.mfu


def test_cast_bytes_differ_by_recipe_as_torchaos_roofline():
    shape = _shape("transformer", "llama-7b")  # every projection converts under every recipe
    widths = shape.n_layers * sum(k + n for k, n in shape.linears())
    params = shape.n_layers * sum(k * n for k, n in shape.linears())
    assert all(len(cost_fp8.converted_linears(shape, r, "auto")) == 7 for r in RECIPES)
    assert [cost_fp8.cast_bytes_per_token(shape, r, "auto", 2) for r in RECIPES] == [6 * widths, 8 * widths, 3 * widths]
    assert [cost_fp8.cast_weight_bytes(shape, r, "auto", 2, False) for r in RECIPES] == [
        8 * params,
        10 * params,
        6 * params,
    ]
    assert cost_fp8.cast_weight_bytes(shape, "tensorwise", "auto", 2, True) == 2 * params  # gathered in FP8
    assert cost_fp8.operand_bytes_per_token(shape, "rowwise_with_gw_hp", "auto", 2) == -widths


def test_fsdp_gathers_tensorwise_weights_in_fp8():
    shape, h100 = _shape("transformer", "1.1b"), get_device("h100")
    lay, wl = Layout(dp=8, strategy="fsdp", micro_batch=4), Workload(2048, 64)
    psi = shape.n_layers * shape.layer_params + max(shape.embedding_params, shape.head_params)
    conv = shape.n_layers * cost_fp8.converted_params_per_layer(shape, "tensorwise", "auto")

    def gathers(recipe):
        comms = communication(shape, lay, replace(wl, fp8=recipe), FSDP_BF16, h100, 1.0)
        return {c.collective: c for c in comms if c.axis == "dp_shard"}

    assert gathers("none")["all_gather"].message_bytes == 2 * psi
    assert gathers("tensorwise")["all_gather"].message_bytes == 2 * psi - conv  # half the bytes of converted weights
    assert gathers("rowwise")["all_gather"].message_bytes == 2 * psi  # torchao gathers row-wise recipes in bf16
    assert "all_reduce" in gathers("tensorwise") and "all_reduce" not in gathers("none")  # the scales, once a step
    layer = shape.layer_params
    conv_layer = conv // shape.n_layers
    mem = {r: memory_phases(shape, lay, replace(wl, fp8=r), FSDP_BF16)["forward"] for r in ("none", "tensorwise")}
    assert mem["none"]["gathered_params"] - mem["tensorwise"]["gathered_params"] == conv_layer  # the last block
    assert mem["none"]["gathered_params"] > layer


def test_autocast_makes_no_bf16_copy_of_fp8_weights():
    """Under autocast the converted layers cast fp32 -> FP8 themselves: the blocks' saved bf16 weight copies lose the
    converted weights (2 bytes each), in the cost model and in what autograd saves (torchao emulated on CPU); with bf16
    parameters the saved tensors are the same with and without FP8."""
    pytest.importorskip("torchao")
    from anytrain.cost.shapes import ModelShape
    from anytrain.models.llama.model import Transformer, TransformerArgs
    from tests.unit.test_cost_model import TINY_ARGS, _saved_bytes

    args = TransformerArgs(**TINY_ARGS)
    shape = ModelShape.from_args(args)
    wl, lay = Workload(32, 2), Layout(micro_batch=2)
    copies = {
        r: memory_phases(shape, lay, replace(wl, fp8=r, fp8_filter="aligned"), AMP)["forward"]
        for r in ("none", "rowwise")
    }
    conv = shape.n_layers * cost_fp8.converted_params_per_layer(shape, "rowwise", "aligned")
    assert conv == shape.n_layers * sum(k * n for k, n in shape.linears())  # aligned: every projection
    assert copies["none"]["compute_copy"] - copies["rowwise"].get("compute_copy", 0.0) == 2 * conv

    def saved(mode: str, recipe: str | None) -> int:
        torch.manual_seed(0)
        model = Transformer(args)
        if mode == "bf16":
            model = model.to(torch.bfloat16)
        if recipe:
            candidates = spec_of(model).parallelize_plan.fp8_linears(model)
            parallel_fp8.apply_fp8(model, candidates, recipe, True, "aligned", torch.device("cpu"))
        tokens = torch.randint(0, TINY_ARGS["vocab_size"], (2, 32))

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "amp"):
                return model(tokens, tokens)

        return _saved_bytes(step, [*model.parameters(), *model.buffers()])

    assert saved("amp", None) - saved("amp", "rowwise") == 2 * conv
    assert saved("bf16", None) == saved("bf16", "tensorwise")


def test_plan_ranks_fp8_on_h100_and_refuses_it_without_fp8():
    shape = _shape("transformer", "1.1b")
    wl = Workload(2048, 64)
    base = plan(shape, get_device("h100"), 8, wl)
    tensorwise = plan(shape, get_device("h100"), 8, replace(wl, fp8="tensorwise"))
    assert tensorwise.recommended.step_s < base.recommended.step_s
    variants = {v["fp8"]: v for v in fp8_variants(shape, get_device("h100"), 8, wl, base.recommended)}
    assert set(variants) == set(RECIPES)
    assert variants["tensorwise"]["speedup"] == pytest.approx(base.recommended.step_s / tensorwise.recommended.step_s)
    assert variants["tensorwise"]["converted_per_block"] == 5 and variants["rowwise"]["converted_per_block"] == 2
    assert variants["tensorwise"]["speedup"] > variants["rowwise"]["speedup"] > 1.0
    a100 = get_device("a100-80")
    assert fp8_variants(shape, a100, 8, wl, plan(shape, a100, 8, wl).recommended) == []
    with pytest.raises(ConfigError, match=r"^train.fp8: A100 80GB has no FP8 matmuls"):
        plan(shape, a100, 8, replace(wl, fp8="tensorwise"))
    small = _shape("transformer", "debug")  # nothing passes the auto filter: refused as the trainer refuses it
    with pytest.raises(ConfigError, match="none of the model's candidate Linear layers"):
        plan(small, get_device("h100"), 1, Workload(256, 4, fp8="tensorwise"))


def test_parallel_auto_plans_the_runs_fp8_recipe():
    cfg = load_config("configs/1.1b.yaml", ["--train.fp8", "tensorwise"])
    bf16 = choose_layout(load_config("configs/1.1b.yaml"), 8, get_device("h100"))
    choice = choose_layout(cfg, 8, get_device("h100"))
    assert choice["predicted"]["fp8"] == "tensorwise" and choice["predicted"]["step_s"] < bf16["predicted"]["step_s"]
    with pytest.raises(ConfigError, match="train.fp8: A100 80GB has no FP8 matmuls"):
        choose_layout(cfg, 8, get_device("a100-80"))


def test_plan_cli_lists_fp8_variants_and_refuses_fp8_on_a100(capsys):
    from tests.conftest import cli_in_process

    plan_1b = ("plan", "--model", "configs/1.1b.yaml", "--gpus", "8", "--top", "2")
    code, out, _ = cli_in_process(capsys, *plan_1b, "--gpu", "h100")
    assert code == 0 and "--fp8 tensorwise: " in out and "x the bf16 plan" in out
    code, out, _ = cli_in_process(capsys, *plan_1b, "--gpu", "a100")
    assert code == 0 and "--fp8" not in out
    code, out, err = cli_in_process(capsys, *plan_1b, "--gpu", "a100", "--fp8", "rowwise")
    assert code == 2 and "--fp8: A100 80GB has no FP8 matmuls" in out + err


def test_training_mfu_of_an_fp8_run_is_against_the_bf16_peak(small_data, tmp_path):
    """An emulated FP8 run logs MFU = the model's FLOPs per token (unchanged by FP8) × tokens/s per device / the
    dense bf16 peak (here train.peak_tflops), the formula of every bf16 run."""
    pytest.importorskip("torchao")
    from anytrain.train.trainer import Trainer

    args = "--data.seq_len 32 --device cpu --model.flavour debug --train.steps 2 --train.global_batch 4 "
    args += "--train.eval_interval 0 --train.log_interval 1 --checkpoint.save_final false --train.peak_tflops 0.5 "
    args += "--train.fp8 tensorwise --train.fp8_emulate true --train.fp8_filter aligned"
    cfg = load_config(None, ["--data.path", str(small_data), *args.split()])
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"))
    flops = trainer.built.accounting_model.flops_per_token(32)
    with torch.device("meta"):
        assert flops == build_model(ModelConfig(flavour="debug")).flops_per_token(32)  # the bf16 model's count
    trainer.train()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert train and all(r["mfu"] == pytest.approx(flops * r["tokens_per_s_per_device"] / 0.5e12) for r in train)


def test_one_gpu_fp8_and_bf16_rows_of_the_h200_are_predicted_within_the_validation_bounds():
    """The anytrain rows of bench/results/one_gpu_check_nvidia-h200.json (key fp8_side: the 1.1B, Llama-3.2-1B and 3B
    shapes, bf16 and each FP8 recipe, one H200) against the cost model with the shipped h200 table: peak allocated
    memory within ±10% and step time within ±20% (the bounds of bench/cost_model_validation.py). Without the compiled
    tensorwise blocks' FP8-saved inputs (cost/fp8.py, "Memory") the tensorwise rows are 12-20% over."""
    from anytrain.cost.shapes import GIB
    from tests.conftest import ROOT

    calls = json.loads((ROOT / "bench/results/one_gpu_check_nvidia-h200.json").read_text())["fp8_side"]
    rows = [(r, part["settings"]["steps"]) for c in calls for part in c["parts"].values() for r in part["rows"]]
    rows = [(r, steps) for r, steps in rows if r["stack"] == "anytrain" and r.get("tokens_per_s")]
    assert {r["precision"] for r, _ in rows} == {"bf16", "fp8-tensorwise", "fp8-rowwise"} and len(rows) >= 9
    device = get_device("h200")
    for r, steps in rows:
        shape = shape_from_config(RunConfig(model=ModelConfig(flavour=r["flavour"])))
        shape = replace(shape, expand_kv=False)  # native GQA on NVIDIA, as the rows ran
        recipe = "none" if r["precision"] == "bf16" else r["precision"].removeprefix("fp8-")
        est = estimate(shape, Layout(micro_batch=r["micro"]), Workload(r["seq"], r["global_batch"], fp8=recipe), device)
        memory, step = sum(est.memory.values()) / GIB / r["peak_mem_gib"], est.step_s * steps / r["seconds"]
        assert 0.9 <= memory <= 1.1 and 0.8 <= step <= 1.2, (r["label"], r["flavour"], memory, step)
