"""The hybrid end to end on the CPU: ``anytrain train configs/tiny-hybrid.yaml`` trains with falling loss and resumes
bitwise; a tiny random transformers ``BambaForCausalLM`` in (``model.init_from``) and out (``anytrain export --format
hf``) with equal logits (fp32, 1e-5); a pattern Bamba cannot hold is refused on export with one line."""

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
from tests.conftest import run_cli
from tests.integration.test_hf_mamba2 import read_records, train_records

transformers = pytest.importorskip("transformers")

RECIPE = "configs/tiny-hybrid.yaml"


def recipe_args(data: Path, steps: int, *extra: str, shape: bool = True) -> list[str]:
    """The recipe on the small corpus, shortened: seq 48, global batch 4; with ``shape`` two Bamba layers (Mamba-2
    then attention, pattern M-A-) and Mamba-2 chunk 16 (three chunks per sequence)."""
    layers = ["--model.args.layers_pattern", "M-A-", "--model.args.mamba_chunk_size", "16"] if shape else []
    return [
        "--data.path",
        str(data),
        "--data.seq_len",
        "48",
        *layers,
        "--train.steps",
        str(steps),
        "--train.global_batch",
        "4",
        "--train.log_interval",
        "1",
        "--train.eval_interval",
        "0",
        "--train.eval_batches",
        "1",
        "--train.warmup_steps",
        "2",
        "--train.lr",
        "3e-3",
        "--train.dtype",
        "fp32",
        *extra,
    ]


def cli_train(run_dir: Path, data: Path, steps: int, *extra: str) -> None:
    proc = run_cli("train", RECIPE, "--run-dir", str(run_dir), *recipe_args(data, steps, *extra), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> dict[str, Path]:
    """An 8-step run (checkpoints every 4) and the same run stopped at step 4 and resumed."""
    tmp = tmp_path_factory.mktemp("hybrid")
    flags = ("--checkpoint.interval", "4")
    cli_train(tmp / "whole", small_data, 8, *flags)
    cli_train(tmp / "resumed", small_data, 8, *flags, "--train.stop_at_step", "4")
    cli_train(tmp / "resumed", small_data, 8, *flags, "--resume")
    return {"whole": tmp / "whole", "resumed": tmp / "resumed"}


def test_the_recipe_trains_and_resumes_bitwise(runs):
    whole, resumed = read_records(runs["whole"]), read_records(runs["resumed"])
    losses = [r["loss"] for r in whole if r["kind"] == "train"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses
    assert train_records(resumed) == train_records(whole)  # steps 5-8 after the resume: the same losses, bit for bit
    assert [r["step"] for r in resumed if r["kind"] == "resume"] == [4]
    summary = json.loads((runs["whole"] / "summary.json").read_text())
    _, model, _ = load_run_model(runs["whole"], torch.device("cpu"))
    assert summary["flops_per_token"] == model.flops_per_token(48) > 6 * summary["params_non_embedding"]  # for MFU


def test_export_is_bamba_with_equal_logits(runs, tmp_path):
    out = export_hf(runs["whole"], tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BambaForCausalLM"] and config["model_type"] == "bamba"
    assert (config["num_hidden_layers"], config["attn_layer_indices"], config["tie_word_embeddings"]) == (2, [1], True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "BambaForCausalLM"
    _, model, _ = load_run_model(runs["whole"], torch.device("cpu"))
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)


def random_bamba(directory: Path) -> torch.nn.Module:
    """A tiny random BambaForCausalLM (vocabulary 512, as small_data's tokenizer; layers Mamba-2, attention, Mamba-2;
    two groups; untied), its norms, D, dt_bias and conv bias moved off their init, saved with save_pretrained."""
    torch.manual_seed(0)
    config = transformers.BambaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_chunk_size=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = transformers.BambaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".D", "dt_bias", "conv1d.bias")):
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model.eval()


def test_init_from_bamba_gives_equal_logits_and_exports_back(tmp_path, small_data):
    from anytrain.train.trainer import run_training

    hf = random_bamba(tmp_path / "hf")
    cfg = resolve_run_config(
        load_config(RECIPE, recipe_args(small_data, 1, "--model.init_from", str(tmp_path / "hf"), shape=False))
    )
    args = cfg.model.args
    assert (args["layers_pattern"], args["mamba_ngroups"], args["rope_fraction"]) == ("M-A-M-", 2, 0.5)
    model = build_model(cfg.model)
    init_from_hf(model, cfg.model, log=lambda line: None)
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-5)
    # a step of training from these weights, then out again: transformers computes what the run's model computes
    run_training(cfg, run_dir=str(tmp_path / "run"))
    out = export_hf(tmp_path / "run", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    _, trained, _ = load_run_model(tmp_path / "run", torch.device("cpu"))
    with torch.no_grad():
        theirs, ours = back(ids).logits, trained(ids)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
        assert not torch.allclose(ours, hf(ids).logits, atol=1e-4)  # it did train


def test_export_refuses_a_pattern_bamba_cannot_hold(tmp_path, small_data):
    cli_train(tmp_path / "run", small_data, 1, "--model.args.layers_pattern", "MA-")
    with pytest.raises(ConfigError, match=r"^export --format hf: BambaForCausalLM cannot hold this hybrid: "):
        export_hf(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()
