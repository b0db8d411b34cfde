"""train.fp8 on the CPU through torchao's emulation: which Linear layers convert, exactly, for each family and recipe
(the small-GEMM thresholds are torchao's own); state-dict names unchanged; Mamba's module path equals its weight path;
Mamba and a tiny HF model train with falling loss; every refusal is one line with exit code 2."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from anytrain.config import ModelConfig, load_config
from anytrain.errors import ConfigError
from anytrain.models import MAMBA_FLAVOURS, TRANSFORMER_FLAVOURS, Mamba, MambaArgs, Transformer, TransformerArgs
from anytrain.parallel import fp8
from tests.conftest import cli_in_process

CPU = torch.device("cpu")
ATTENTION, MLP = ("wq", "wk", "wv", "wo"), ("w1", "w2", "w3")


def _transformer(flavour: str, meta: bool = True, **overrides) -> Transformer:
    args = TransformerArgs(**{**TRANSFORMER_FLAVOURS[flavour], **overrides})
    with torch.device("meta" if meta else "cpu"):
        return Transformer(args)


def _mamba(flavour: str, meta: bool = True) -> Mamba:
    with torch.device("meta" if meta else "cpu"):
        return Mamba(MambaArgs(**MAMBA_FLAVOURS[flavour]))


def _convert(model: nn.Module, recipe: str, fp8_filter: str) -> list[str]:
    from anytrain.models import spec_of

    return fp8.apply_fp8(model, spec_of(model).parallelize_plan.fp8_linears(model), recipe, True, fp8_filter, CPU)


def _float8(model: nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}


def _names(layers: int, per_layer) -> set[str]:
    return {
        f"layers.{i}.{'attention' if p in ATTENTION else 'feed_forward'}.{p}" for i in range(layers) for p in per_layer
    }


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_small_gemm_filter_is_torchaos_auto_filter(recipe):
    """Our thresholds against torchao's ``_auto_filter_for_recipe`` (torchtitan's auto_filter_small_kn) on a grid
    around every threshold, plus misaligned shapes."""
    from torchao.float8 import _auto_filter_for_recipe

    theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
    sizes = [16, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 8200]
    for n in sizes:
        for k in sizes:
            with torch.device("meta"):
                layer = nn.Linear(k, n, bias=False)
            assert theirs(layer, "layer") == (fp8.keep_reason(layer, recipe, "auto") is None), (recipe, n, k)
    with torch.device("meta"):
        assert fp8.keep_reason(nn.Linear(8200, 8192), recipe, "aligned") == "misaligned"
        assert fp8.keep_reason(nn.Linear(1024, 1024), recipe, "aligned") is None


def test_transformer_converts_exactly_the_block_projections_the_filter_passes():
    # debug (D 64, 2 KV heads, F 192), aligned: every projection of both blocks; the head and embeddings never
    model = _transformer("debug", meta=False)
    keys = list(model.state_dict())
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(_convert(model, "tensorwise", "aligned")) == _float8(model) == _names(2, ATTENTION + MLP)
    assert list(model.state_dict()) == keys and type(model.output) is nn.Linear  # names unchanged, head untouched
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())  # the same tensors
    # a misaligned MLP width (F 200): w1, w3 (out 200) and w2 (in 200) stay high precision
    model = _transformer("debug", ffn_dim=200)
    assert set(_convert(model, "rowwise", "aligned")) == _names(2, ATTENTION)
    # 1.1b (D 2048, 4 KV heads of 64: wk/wv 2048 -> 256, F 5632) under the small-GEMM filter
    assert _float8_of("1.1b", "tensorwise") == _names(22, ("wq", "wo", *MLP))
    assert _float8_of("1.1b", "rowwise") == _float8_of("1.1b", "rowwise_with_gw_hp") == _names(22, ("w1", "w3"))


def _float8_of(flavour: str, recipe: str) -> set[str]:
    model = _transformer(flavour)
    _convert(model, recipe, "auto")
    return _float8(model)


def test_mamba_converts_in_and_out_projections_only():
    model = _mamba("debug")
    converted = _convert(model, "tensorwise", "aligned")
    assert (
        set(converted)
        == _float8(model)
        == {f"backbone.layers.{i}.mixer.{p}" for i in range(2) for p in ("in_proj", "out_proj")}
    )
    # 1.4b (D 2048, E 4096): in_proj 2048 -> 8192 passes both filters, out_proj 4096 -> 2048 only tensorwise's
    model = _mamba("1.4b")
    assert _convert(model, "tensorwise", "auto") == [
        f"backbone.layers.{i}.mixer.{p}" for i in range(48) for p in ("in_proj", "out_proj")
    ]
    model = _mamba("1.4b")
    assert _convert(model, "rowwise", "auto") == [f"backbone.layers.{i}.mixer.in_proj" for i in range(48)]


def test_no_convertible_layer_is_one_line():
    with pytest.raises(ConfigError) as info:
        _convert(_mamba("130m"), "rowwise", "auto")  # in_proj K 768, out_proj N 768: all below rowwise's thresholds
    message = str(info.value)
    assert "\n" not in message and message.startswith("train.fp8: none of the model's 48 candidate Linear layers")
    assert "48 small" in message and "--train.fp8_filter aligned" in message


def test_mamba_module_path_equals_the_weight_path():
    """The mixer's path for replaced projections (FP8 layers are called as modules) computes what the weight path
    does: plain Linear modules given as ``projections`` give the same output and gradients in float64."""
    from anytrain.kernels import causal_conv1d_ref, selective_scan_ref
    from anytrain.kernels.mamba_inner import mixer_composition

    torch.manual_seed(0)
    mixer = _mamba("debug", meta=False).double().backbone.layers["0"].mixer
    h = torch.randn(2, 24, 64, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for projections in (None, (mixer.in_proj, mixer.out_proj)):
        out = mixer_composition(h, *mixer._weights(), causal_conv1d_ref, selective_scan_ref, projections=projections)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [h, mixer.in_proj.weight, mixer.out_proj.weight]))
    torch.testing.assert_close(outs[1], outs[0])
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b)


def _hf_llama(folder) -> str:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def test_hf_converts_every_linear_of_the_decoder_layers(tmp_path):
    from anytrain.models.hf import HFCausalLM, resolve_args

    model = HFCausalLM(resolve_args(ModelConfig(arch="hf", hf_path=_hf_llama(tmp_path / "llama"))))
    projections = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    keys = list(model.state_dict())
    assert (
        set(_convert(model, "tensorwise", "aligned"))
        == _float8(model)
        == {f"hf.model.layers.{i}.{p}" for i in range(2) for p in projections}
    )
    assert list(model.state_dict()) == keys and type(model.hf.lm_head) is nn.Linear


SHORT_RUN = (
    "--data.seq_len 32 --device cpu --model.flavour debug --train.steps 6 --train.global_batch 4 --train.lr 3e-3 "
    "--train.warmup_steps 1 --train.eval_interval 0 --train.eval_batches 1 --train.log_interval 1"
).split()


def _train(small_data, tmp_path, *args: str) -> dict:
    from anytrain.train.trainer import Trainer

    fp8_args = ["--train.fp8_emulate", "true", "--train.fp8_filter", "aligned", "--checkpoint.save_final", "false"]
    cfg = load_config(None, ["--data.path", str(small_data), *SHORT_RUN, *fp8_args, *args])
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"))
    assert _float8(trainer.model)
    summary = trainer.train()
    trainer.close()
    return summary


def test_emulated_fp8_trains_mamba(small_data, tmp_path):
    summary = _train(small_data, tmp_path, "--model.arch", "mamba", "--train.fp8", "rowwise")
    assert summary["final_val_loss"] < summary["first_val_loss"]


def test_emulated_fp8_trains_an_hf_model(small_data, tmp_path):
    hf = ("--model.arch", "hf", "--model.hf_path", _hf_llama(tmp_path / "llama"), "--model.args.init", "random")
    summary = _train(small_data, tmp_path, *hf, "--train.fp8", "rowwise_with_gw_hp")
    assert summary["final_val_loss"] < summary["first_val_loss"]


REFUSALS = [
    ((), "train.fp8: the CPU has no FP8 matmul; set --train.fp8 none, or --train.fp8_emulate true"),
    (
        ("--train.fp8_emulate", "true"),
        "train.fp8: none of the model's 14 candidate Linear layers can take FP8 (14 small",
    ),
    (
        ("--train.cuda_graphs", "true", "--parallel.tp", "2"),
        "train.cuda_graphs: not run with train.fp8 under tensor parallelism yet",
    ),
    (
        ("--parallel.async_tp", "true", "--parallel.tp", "2", "--train.compile", "true"),
        "parallel.async_tp: not run with train.fp8 yet",
    ),
]


@pytest.mark.parametrize("extra, message", REFUSALS)
def test_refusals_are_one_line_with_exit_2(capsys, small_data, tmp_path, extra, message):
    args = ["train", "configs/tiny.yaml", "--data.path", str(small_data), "--run-dir", str(tmp_path / "run")]
    code, _, err = cli_in_process(capsys, *args, *SHORT_RUN, "--train.fp8", "tensorwise", *extra)
    assert code == 2 and err.strip().startswith(f"error: {message}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_recipe_and_missing_torchao_are_one_line(monkeypatch, small_data):
    with pytest.raises(ConfigError, match=r"^train.fp8: expected one of 'none', 'tensorwise', 'rowwise', "):
        load_config(None, ["--data.path", str(small_data), "--data.seq_len", "32", "--train.fp8", "fp8"])
    monkeypatch.setitem(sys.modules, "torchao", None)  # what Python does for a package that cannot be imported
    with pytest.raises(ConfigError, match=r"^train.fp8: needs the torchao package: pip install 'anytrain\[fp8\]'"):
        fp8.convert_model(_transformer("debug"), load_config(None, ["--train.fp8", "rowwise"]).train, "single", CPU)
