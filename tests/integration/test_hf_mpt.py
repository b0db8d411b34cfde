"""MPT in and out of Hugging Face: a Transformer with ALiBi, LayerNorm (no bias) and the GELU MLP is exported as
``MptForCausalLM`` and imported from one with equal logits (fp32, CPU, tiny shapes); options no HF class represents
are refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from anytrain.checkpoint.export import export_hf
from anytrain.checkpoint.hf_import import init_from_hf
from anytrain.checkpoint.run_model import load_run_model
from anytrain.config import load_config
from anytrain.data.resolve import resolve_run_config
from anytrain.errors import ConfigError
from anytrain.models import build_model
from anytrain.models.conversion import hf_family
from anytrain.models.llama.model import TransformerArgs
from tests.conftest import cli_in_process as cli

transformers = pytest.importorskip("transformers")

RECIPE = "configs/mpt-125m.yaml"


def train_args(data: Path, *extra: str) -> list[str]:
    """mpt-debug (d 64, 2 layers, 4 heads) with 6 heads here: ALiBi's slopes for a head count that is not a power of
    two are where MPT's order differs from the ALiBi paper's."""
    return [
        "--model.flavour",
        "mpt-debug",
        "--model.args.dim",
        "48",
        "--model.args.n_heads",
        "6",
        "--data.path",
        str(data),
        "--data.seq_len",
        "32",
        "--train.global_batch",
        "4",
        "--train.micro_batch",
        "0",
        "--train.steps",
        "2",
        "--train.log_interval",
        "1",
        "--train.eval_batches",
        "1",
        "--train.eval_interval",
        "0",
        "--train.dtype",
        "fp32",
        "--train.compile",
        "false",
        "--parallel.strategy",
        "auto",
        "--train.warmup_steps",
        "1",
        "--train.lr",
        "3e-3",
        "--checkpoint.interval",
        "0",
        *extra,
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_data) -> Path:
    from anytrain.train.trainer import run_training

    out = tmp_path_factory.mktemp("mpt") / "run"
    run_training(load_config(RECIPE, train_args(small_data)), run_dir=str(out))
    return out


def test_export_is_mpt_with_equal_logits(run, tmp_path):
    out = export_hf(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MptForCausalLM"] and config["attn_config"]["alibi"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "MptForCausalLM" and hf.config.n_heads == 6
    _, model, _ = load_run_model(run, torch.device("cpu"))
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)


def random_mpt(directory: Path, tie: bool):
    """A tiny random MptForCausalLM (vocabulary 512, as small_data's tokenizer), its norm weights moved off 1."""
    torch.manual_seed(0)
    config = transformers.MptConfig(
        d_model=48,
        n_heads=6,
        n_layers=2,
        expansion_ratio=4,
        max_seq_len=64,
        vocab_size=512,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=tie,
    )
    model = transformers.MptForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize("tie", [True, False])
def test_init_from_mpt_gives_equal_logits(tmp_path, small_data, tie):
    hf = random_mpt(tmp_path / "hf", tie)
    cfg = resolve_run_config(load_config(RECIPE, train_args(small_data, "--model.init_from", str(tmp_path / "hf"))))
    assert cfg.model.args["pos_encoding"] == "alibi" and cfg.model.args["tie_embeddings"] is tie
    model = build_model(cfg.model)
    init_from_hf(model, cfg.model, log=lambda line: None)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-5)


def test_import_refuses_what_anytrain_does_not_compute(tmp_path, small_data):
    random_mpt(tmp_path / "hf", True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["attn_config"]["clip_qkv"] = 6.0
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"attn_config has clip_qkv=6\.0; anytrain's model needs None"):
        resolve_run_config(load_config(RECIPE, train_args(small_data, "--model.init_from", str(tmp_path / "hf"))))


@pytest.mark.parametrize(
    "options",
    [
        {"bias": True},
        {"pos_encoding": "learned"},
        {"qk_norm": True},
        {"n_kv_heads": 2},
        {"mlp": "swiglu"},
        {"norm": "rmsnorm"},
    ],
)
def test_no_hf_class_is_one_clear_error(options):
    mpt = dict(pos_encoding="alibi", norm="layernorm", mlp="gelu", tie_embeddings=True)
    args = TransformerArgs(**{**dict(dim=64, n_heads=4, n_layers=2), **mpt, **options})
    with pytest.raises(ConfigError, match=r"^export --format hf: no transformers class computes this Transformer"):
        hf_family("transformer", args)
    assert hf_family("transformer", TransformerArgs(dim=64, n_heads=4, **mpt)) == "mpt"
    assert hf_family("transformer", TransformerArgs(dim=64, n_heads=4)) == "llama"


def test_export_cli_refusal_writes_nothing(tmp_path, capsys, small_data):
    from anytrain.train.trainer import run_training

    run_dir = tmp_path / "run"
    run_training(
        load_config(RECIPE, train_args(small_data, "--model.args.qk_norm", "true", "--train.steps", "1")),
        run_dir=str(run_dir),
    )
    capsys.readouterr()  # the training's output
    code, _, err = cli(capsys, "export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: export --format hf: no transformers class") and "qk_norm=True" in err
    assert not (tmp_path / "hf").exists()
