"""Hugging Face in and out: ``anytrain export --format hf`` loads in transformers with equal logits, and
``model.init_from`` starts a run from an HF folder with equal logits (fp32, CPU, tiny shapes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from anytrain.checkpoint.export import MARKER, export_hf
from anytrain.checkpoint.hf_import import init_from_hf
from anytrain.checkpoint.run_model import load_run_model
from anytrain.config import load_config
from anytrain.data.resolve import resolve_run_config
from anytrain.errors import ConfigError, RunDirError
from anytrain.evals import validation_loss
from anytrain.models import build_model
from anytrain.models.conversion import INDEX_FILE
from tests.conftest import cli_in_process as cli

transformers = pytest.importorskip("transformers")

RECIPES = {"transformer": "configs/tiny.yaml", "mamba": "configs/tiny-mamba.yaml"}
# non-default values of the fields the export must carry over (theta, eps, GQA, untied head, FFN width)
SHAPES = {
    "transformer": [
        "--model.args.n_layers",
        "2",
        "--model.args.rope_theta",
        "5000",
        "--model.args.norm_eps",
        "1e-6",
        "--model.args.ffn_dim",
        "96",
        "--model.args.tie_embeddings",
        "false",
    ],
    "mamba": ["--model.args.n_layers", "2", "--model.args.d_state", "4", "--model.args.d_conv", "3"],
}


def train_args(data: Path, steps: int = 2) -> list[str]:
    return [
        "--model.flavour",
        "debug",
        "--data.path",
        str(data),
        "--data.seq_len",
        "32",
        "--train.global_batch",
        "4",
        "--train.steps",
        str(steps),
        "--train.log_interval",
        "1",
        "--train.eval_batches",
        "1",
        "--train.dtype",
        "fp32",
        "--train.warmup_steps",
        "1",
        "--train.lr",
        "3e-3",
    ]


def train(arch: str, run_dir: Path, data: Path, *extra: str, steps: int = 2) -> list[dict]:
    from anytrain.train.trainer import run_training

    run_training(load_config(RECIPES[arch], train_args(data, steps) + list(extra)), run_dir=str(run_dir))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> dict[str, Path]:
    """One trained tiny run per architecture (2 steps), shared by the module."""
    out = {}
    for arch in RECIPES:
        out[arch] = tmp_path_factory.mktemp("hf") / arch
        train(arch, out[arch], small_data, *SHAPES[arch])
    return out


def logits_pair(run_dir: Path, hf_dir: Path, vocab: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    _, model, _ = load_run_model(run_dir, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids), hf(ids).logits


@pytest.mark.parametrize("arch, cls", [("transformer", "LlamaForCausalLM"), ("mamba", "MambaForCausalLM")])
def test_export_loads_in_transformers_with_equal_logits(runs, tmp_path, arch, cls):
    out = export_hf(runs[arch], tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER,
    } <= names
    ours, theirs = logits_pair(runs[arch], out)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == cls
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    config = json.loads((out / "config.json").read_text())
    if arch == "transformer":
        assert (config["rope_theta"], config["rms_norm_eps"], config["num_key_value_heads"]) == (5000, 1e-6, 2)
        assert (config["intermediate_size"], config["tie_word_embeddings"]) == (96, False)
    else:
        assert (config["state_size"], config["conv_kernel"], config["tie_word_embeddings"]) == (4, 3, True)


def test_export_of_a_checkpoint_dir_sharded(runs, tmp_path):
    checkpoint = sorted((runs["transformer"] / "checkpoints").iterdir())[-1]
    out = export_hf(checkpoint, tmp_path / "hf", dtype="bf16", max_shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert json.loads((out / MARKER).read_text())["source"] == str(checkpoint)


def test_tokenizer_round_trip(runs, tmp_path, small_data):
    from anytrain.data.prepare import EOS, load_tokenizer

    out = export_hf(runs["mamba"], tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(small_data / "tokenizer.json")
    text = "ROMEO.\nBut, soft! what light through yonder window breaks?  Ça va"
    ids = ours.encode(text, add_special_tokens=False).ids
    assert tokenizer(text)["input_ids"] == ids  # no BOS added, as the data pipeline
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == tokenizer.bos_token == EOS and tokenizer.eos_token_id == ours.token_to_id(EOS)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == ours.token_to_id(EOS)


def test_export_refuses_to_replace_what_it_did_not_write(runs, tmp_path):
    out = export_hf(runs["mamba"], tmp_path / "hf")
    with pytest.raises(RunDirError, match="pass --overwrite"):
        export_hf(runs["mamba"], out)
    export_hf(runs["mamba"], out, overwrite=True)  # our own export: replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=f"no {MARKER}"):
        export_hf(runs["mamba"], other, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "other"]  # no temporary folders left


def test_export_cli(runs, tmp_path, capsys):
    code, out, err = cli(capsys, "export", str(runs["transformer"]), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert (tmp_path / "hf" / "config.json").is_file() and str(tmp_path / "hf") in out
    code, out, err = cli(capsys, "export", str(runs["transformer"]), "--out", str(tmp_path / "hf"))
    assert code == 2 and err.strip().startswith("error: --out:") and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------------------------------
# import


def random_hf_model(arch: str, directory: Path):
    """A tiny random HF model (vocabulary 512, as small_data's tokenizer) saved with save_pretrained."""
    torch.manual_seed(0)
    if arch == "transformer":
        config = transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=2000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MambaConfig(
            vocab_size=512,
            hidden_size=32,
            state_size=4,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=3,
            tie_word_embeddings=False,
        )
        model = transformers.MambaForCausalLM(config)
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize("arch", ["transformer", "mamba"])
def test_init_from_hf_gives_equal_logits_and_training_continues(tmp_path, small_data, arch):
    hf = random_hf_model(arch, tmp_path / "hf")
    cfg = resolve_run_config(
        load_config(RECIPES[arch], train_args(small_data) + ["--model.init_from", str(tmp_path / "hf")])
    )
    assert cfg.model.args["vocab_size"] == 512 and cfg.model.args["n_layers"] == 2
    model = build_model(cfg.model)
    init_from_hf(model, cfg.model, log=lambda line: None)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-5)
    # the trainer starts from these weights: its step-0 validation loss is transformers' loss on the same batch
    records = train(
        arch,
        tmp_path / "run",
        small_data,
        "--model.init_from",
        str(tmp_path / "hf"),
        "--train.lr",
        "1e-2",
        "--train.schedule",
        "constant",
        steps=2,
    )
    evals = [r for r in records if r["kind"] == "eval"]
    from anytrain.data.shards import TokenDataset

    hf_loss, _ = validation_loss(
        lambda x: hf(x).logits, TokenDataset(small_data), 32, 1, 4, torch.device("cpu"), torch.float32
    )
    assert evals[0]["step"] == 0 and evals[0]["val_loss"] == pytest.approx(hf_loss, abs=1e-4)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.02  # training goes on from them


def test_init_from_mismatches_are_one_line_naming_the_field(tmp_path, small_data):
    random_hf_model("transformer", tmp_path / "hf")
    base = train_args(small_data) + ["--model.init_from", str(tmp_path / "hf")]
    with pytest.raises(ConfigError, match=r"^model\.args\.dim: 64 differs from 32 in .*config\.json"):
        resolve_run_config(load_config(RECIPES["transformer"], base + ["--model.args.dim", "64"]))
    with pytest.raises(ConfigError, match=r"^model\.arch: 'mamba', but model\.init_from"):
        resolve_run_config(load_config(RECIPES["mamba"], base))
    with pytest.raises(ConfigError, match=r"^model\.init_from: .* has no config\.json"):
        resolve_run_config(
            load_config(RECIPES["transformer"], train_args(small_data) + ["--model.init_from", str(tmp_path)])
        )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"hidden_act='gelu'; anytrain's model needs 'silu'"):
        resolve_run_config(load_config(RECIPES["transformer"], base))


@pytest.mark.parametrize("name", ["../x.safetensors", "sub/../../x.safetensors", "ABSOLUTE"])
def test_an_index_naming_a_weight_file_outside_the_folder_is_one_line(tmp_path, small_data, name):
    """model.safetensors.index.json's weight_map names files of the model's folder only: one outside (present and
    loadable) is refused, by model.init_from and by arch hf (model.hf_path), before any tensor is read."""
    from safetensors import safe_open

    from anytrain.models.hf.adapter import safetensors_files

    folder = tmp_path / "hf"
    random_hf_model("transformer", folder)
    outside = (folder / "model.safetensors").rename(tmp_path / "x.safetensors")
    name = str(outside) if name == "ABSOLUTE" else name
    with safe_open(str(outside), framework="pt") as handle:
        (folder / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(handle.keys(), name)}))
    cfg = resolve_run_config(
        load_config(RECIPES["transformer"], train_args(small_data) + ["--model.init_from", str(folder)])
    )
    why = f"{folder / INDEX_FILE} names the weight file {name!r}, outside {folder}; only files of the model's folder"
    with pytest.raises(ConfigError, match=r"^model\.init_from: " + re.escape(why)):
        init_from_hf(build_model(cfg.model), cfg.model, log=lambda line: None)
    with pytest.raises(ConfigError, match=r"^model\.hf_path: " + re.escape(why)):
        safetensors_files(folder)
    (folder / INDEX_FILE).unlink()  # no weights at all: one line for each, with its own fix
    with pytest.raises(ConfigError, match=r"^model\.init_from: .* has neither model\.safetensors .*save_pretrained"):
        init_from_hf(build_model(cfg.model), cfg.model, log=lambda line: None)
    with pytest.raises(ConfigError, match=r"^model\.hf_path: .* has neither .*--model\.args\.init random"):
        safetensors_files(folder)
