"""Mamba-2 end to end on the CPU: ``anytrain train configs/tiny-mamba2.yaml`` trains with falling loss and resumes
bitwise; Hugging Face ``Mamba2ForCausalLM`` in (``model.init_from``) and out (``anytrain export --format hf``) with
equal logits (fp32, 1e-5); document masking trains; what anytrain does not compute is refused with one line."""

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

transformers = pytest.importorskip("transformers")

RECIPE = "configs/tiny-mamba2.yaml"
MEASURED = {
    "tokens_per_s",
    "tokens_per_s_per_device",
    "mfu",
    "window_s",
    "eta_s",
    "peak_mem_gib",
    "avg_watts",
    "joules",
    "tokens_per_joule",
    "tflops_per_watt",
    "checkpoint",
}


def recipe_args(data: Path, steps: int, *extra: str, shape: bool = True) -> list[str]:
    """The recipe on the small corpus, shortened: seq 48, global batch 4; with ``shape`` 2 layers and chunk 16 (three
    chunks per sequence)."""
    layers = ["--model.args.n_layers", "2", "--model.args.chunk_size", "16"] if shape else []
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


def cli_train(run_dir: Path, data: Path, steps: int, *extra: str) -> list[dict]:
    proc = run_cli("train", RECIPE, "--run-dir", str(run_dir), *recipe_args(data, steps, *extra), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_records(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in records if r["kind"] == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> dict[str, Path]:
    """An 8-step run (checkpoints every 4) and the same run stopped at step 4 and resumed."""
    tmp = tmp_path_factory.mktemp("mamba2")
    flags = ("--checkpoint.interval", "4")
    cli_train(tmp / "whole", small_data, 8, *flags)
    cli_train(tmp / "resumed", small_data, 8, *flags, "--train.stop_at_step", "4")
    cli_train(tmp / "resumed", small_data, 8, *flags, "--resume")
    return {"whole": tmp / "whole", "resumed": tmp / "resumed"}


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_recipe_trains_and_resumes_bitwise(runs):
    whole, resumed = read_records(runs["whole"]), read_records(runs["resumed"])
    losses = [r["loss"] for r in whole if r["kind"] == "train"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses
    assert train_records(resumed) == train_records(whole)  # steps 5-8 after the resume: the same losses, bit for bit
    assert [r["step"] for r in resumed if r["kind"] == "resume"] == [4]


def test_export_is_mamba2_with_equal_logits(runs, tmp_path):
    out = export_hf(runs["whole"], tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Mamba2ForCausalLM"] and config["model_type"] == "mamba2"
    assert (config["num_hidden_layers"], config["chunk_size"], config["tie_word_embeddings"]) == (2, 16, True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Mamba2ForCausalLM"
    _, model, _ = load_run_model(runs["whole"], torch.device("cpu"))
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)


def random_mamba2(directory: Path, tie: bool, groups: int = 2, **extra) -> torch.nn.Module:
    """A tiny random Mamba2ForCausalLM (vocabulary 512, as small_data's tokenizer), its norms, D, dt_bias and conv
    bias moved off their init, saved with save_pretrained (no hub)."""
    torch.manual_seed(0)
    config = transformers.Mamba2Config(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        head_dim=8,
        num_heads=8,
        n_groups=groups,
        expand=2,
        conv_kernel=3,
        chunk_size=8,
        tie_word_embeddings=tie,
        **extra,
    )
    model = transformers.Mamba2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "dt_bias", "conv1d.bias")):
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize("tie", [True, False])
def test_init_from_mamba2_gives_equal_logits_and_exports_back(tmp_path, small_data, tie):
    from anytrain.train.trainer import run_training

    hf = random_mamba2(tmp_path / "hf", tie)
    cfg = resolve_run_config(
        load_config(RECIPE, recipe_args(small_data, 1, "--model.init_from", str(tmp_path / "hf"), shape=False))
    )
    assert (cfg.model.args["ngroups"], cfg.model.args["chunk_size"], cfg.model.args["tie_embeddings"]) == (2, 8, tie)
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


def test_import_refuses_what_anytrain_does_not_compute(tmp_path, small_data):
    random_mamba2(tmp_path / "hf", True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    base = ["--data.path", str(small_data), "--model.init_from", str(tmp_path / "hf")]
    for change, message in (
        ({"time_step_limit": [0.0, 0.5]}, r"time_step_limit=\[0\.0, 0\.5\]"),
        ({"use_conv_bias": False}, r"use_conv_bias=False; anytrain's Mamba-2 needs True"),
        ({"num_heads": 4}, r"num_heads·head_dim = 4·8 != expand·hidden_size"),
    ):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=rf"^model\.init_from: .*config\.json has {message}"):
            resolve_run_config(load_config(RECIPE, base))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"^model\.arch: 'mamba', but model\.init_from .* holds a 'mamba2' model"):
        resolve_run_config(load_config("configs/tiny-mamba.yaml", base))
    with pytest.raises(ConfigError, match=r"^model\.args\.headdim: 16 differs from 8"):
        resolve_run_config(load_config(RECIPE, [*base, "--model.args.headdim", "16"]))


def test_document_mask_trains_and_a_tensor_parallel_degree_not_dividing_the_heads_is_refused(tmp_path, small_data):
    records = cli_train(tmp_path / "docs", small_data, 3, "--data.document_mask", "true")
    assert len([r for r in records if r["kind"] == "train"]) == 3
    proc = run_cli(
        "train",
        RECIPE,
        "--run-dir",
        str(tmp_path / "tp"),
        *recipe_args(small_data, 1),
        "--model.args.headdim",
        "512",  # one head of the inner width 512
        "--parallel.tp",
        "2",
        nproc=2,
        timeout=300,
    )
    assert proc.returncode != 0
    assert set(proc.stderr.strip().splitlines()) == {
        "error: parallel.tp: 2 does not divide the Mamba-2 head count 1 (expand·d_model / model.args.headdim); "
        "choose a divisor"
    }  # one line per rank, before anything is built
