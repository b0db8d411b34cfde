"""HF export streams a sharded checkpoint (a 2-rank FSDP run) tensor by tensor with bounded memory, and
``model.init_from`` starts pipeline- and tensor-parallel runs (2 gloo ranks) with the single-process first loss."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

SHARD = 4 * 2**20  # --max-shard-size of the memory test; the big model's weights are ~8.3x this
BIG = [
    "--model.args.dim",
    "256",
    "--model.args.n_layers",
    "8",
    "--model.args.n_heads",
    "4",
    "--model.args.n_kv_heads",
    "4",
    "--model.args.ffn_dim",
    "1024",
]


def write_config(directory: Path, data: Path, *model: str) -> Path:
    config = directory / "run.yaml"
    config.write_text(f"""
model: {{arch: transformer, flavour: debug{"".join(", " + m for m in model)}}}
data: {{path: {data}, seq_len: 32}}
train: {{steps: 1, global_batch: 8, micro_batch: 2, lr: 3.0e-3, warmup_steps: 1, dtype: fp32, log_interval: 1,
        eval_interval: 0, eval_batches: 0, compile: false}}
""")
    return config


def train(config: Path, run_dir: Path, nproc: int, *extra: str) -> list[dict]:
    proc = run_cli("train", str(config), "--run-dir", str(run_dir), *extra, nproc=nproc, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------------------------------
# export


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, small_data) -> Path:
    """A 2-rank FSDP run of the debug model: every weight is split between the ranks' checkpoint files."""
    tmp = tmp_path_factory.mktemp("fsdp")
    train(write_config(tmp, small_data), tmp / "run", 2, "--parallel.strategy", "fsdp")
    return tmp / "run"


@pytest.fixture(scope="module")
def big_fsdp_run(tmp_path_factory, small_data) -> Path:
    """A 2-rank FSDP run of a ~35 MB (fp32) model."""
    tmp = tmp_path_factory.mktemp("fsdp_big")
    train(write_config(tmp, small_data), tmp / "run", 2, *BIG, "--parallel.strategy", "fsdp")
    return tmp / "run"


def read_export(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_export_of_an_fsdp_checkpoint_equals_the_whole_model_export(fsdp_run, tmp_path):
    import torch.distributed.checkpoint as dcp

    from anytrain.checkpoint.export import export_hf
    from anytrain.checkpoint.run_model import load_run_model
    from anytrain.models import resolve_args
    from anytrain.models.conversion import INDEX_FILE, hf_family, to_hf_tensors

    checkpoint = sorted((fsdp_run / "checkpoints").iterdir())[-1]
    assert len(list(checkpoint.glob("*.distcp"))) == 2
    chunks = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata["train.model.output.weight"]
    assert len(chunks.chunks) == 2  # sharded across the two ranks' files
    out = export_hf(fsdp_run, tmp_path / "hf", max_shard_bytes=60_000)
    index = json.loads((out / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 4
    # the reference: the whole model loaded into one process (as `anytrain eval` does), converted in memory
    cfg, model, _ = load_run_model(fsdp_run, torch.device("cpu"))
    args = resolve_args(cfg.model)
    expected = dict(to_hf_tensors(hf_family(cfg.model.arch, args), args, model.state_dict()))
    exported = read_export(out)
    assert sorted(exported) == sorted(expected) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in expected.values()
    )
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name


def _export_peak(source: str, warm_source: str, out: str, shard: int, queue) -> None:
    """In a fresh process: export ``warm_source`` (a tiny run: the code's first use), then ``source``; the peak RSS
    (ru_maxrss, KiB) before and after the second export."""
    from anytrain.checkpoint.export import export_hf

    export_hf(warm_source, out + "-warm", max_shard_bytes=shard)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    export_hf(source, out, max_shard_bytes=shard)
    queue.put((before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))


@pytest.mark.slow
def test_export_peak_memory_is_about_one_shard(big_fsdp_run, fsdp_run, tmp_path):
    """Exporting ~35 MB of weights with 4 MiB shards raises the process's peak RSS by < 3 shards (12 MiB); reading
    the whole state dict first (the model plus the converted copies) raises it by ~40 MB."""
    import torch.distributed.checkpoint as dcp

    from tests import forklaunch

    checkpoint = sorted((big_fsdp_run / "checkpoints").iterdir())[-1]
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = sum(4 * v.size.numel() for k, v in saved.items() if k.startswith("train.model."))
    assert weights >= 8 * SHARD
    context = forklaunch._ctx()  # processes forked from a clean server (a fork of pytest may hold others' locks)
    queue = context.Queue()
    child = context.Process(
        target=_export_peak, args=(str(big_fsdp_run), str(fsdp_run), str(tmp_path / "hf"), SHARD, queue)
    )
    child.start()
    before, after = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    growth = (after - before) * 1024
    assert growth < 3 * SHARD, f"peak RSS grew by {growth / 2**20:.1f} MiB exporting {weights / 2**20:.0f} MiB"


# --------------------------------------------------------------------------------------------------------------------
# model.init_from under pipeline and tensor parallelism


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    """A tiny random untied LlamaForCausalLM (GQA; vocabulary 512 as small_data's) saved with save_pretrained."""
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
        rope_theta=2000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(out, max_shard_size="40KB")  # several files, an index
    return out


INIT_LAYOUTS = {"single": (1, ()), "pp2": (2, ("--parallel.pp", "2")), "tp2": (2, ("--parallel.tp", "2"))}


@pytest.fixture(scope="module")
def init_run(tmp_path_factory, small_data, hf_llama):
    """name -> the run dir of the init_from run with that layout (INIT_LAYOUTS), trained on first use."""
    tmp = tmp_path_factory.mktemp("init")
    config = write_config(tmp, small_data, f"init_from: {hf_llama}")

    def get(name: str) -> Path:
        if not (tmp / name).is_dir():
            nproc, extra = INIT_LAYOUTS[name]
            train(config, tmp / name, nproc, *extra)
        return tmp / name

    return get


def first_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in rows if r["kind"] == "train")


@pytest.mark.parametrize("name", ["pp2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_init_from_first_loss_matches_single_process(init_run, name):
    assert first_loss(init_run(name)) == pytest.approx(first_loss(init_run("single")), abs=1e-5)


def test_a_stage_reads_only_its_tensors_and_checks_them_all(hf_llama, small_data, tmp_path):
    from anytrain.checkpoint.hf_import import init_from_hf
    from anytrain.config import load_config
    from anytrain.data.resolve import resolve_run_config
    from anytrain.errors import ConfigError
    from anytrain.models import build_model
    from anytrain.parallel.pipeline import prune_to_stage

    cfg = resolve_run_config(
        load_config(
            None,
            [
                "--model.flavour",
                "debug",
                "--model.init_from",
                str(hf_llama),
                "--parallel.pp",
                "2",
                "--data.seq_len",
                "32",
            ],
        )
    )
    whole = build_model(cfg.model)
    init_from_hf(whole, cfg.model, log=lambda line: None)
    stage = prune_to_stage(build_model(cfg.model), 1, 2)
    lines = []
    init_from_hf(stage, cfg.model, log=lines.append)
    assert lines == [f"model.init_from: weights of {hf_llama} (11 tensors)"]  # layer 1 (9), norm, head
    reference = dict(whole.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, reference[name]), name
    # a tensor of stage 0 with another shape is refused by stage 1 too (every rank checks the whole folder)
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in hf_llama.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    from safetensors.torch import load_file, save_file

    file = bad / index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:16]
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg.model.init_from = str(bad)
    with pytest.raises(
        ConfigError,
        match=r"^model\.init_from: model\.layers\.0\.self_attn\.q_proj\.weight in .* has "
        r"shape \(16, 32\), the model expects \(32, 32\)$",
    ):
        init_from_hf(prune_to_stage(build_model(cfg.model), 1, 2), cfg.model, log=lambda line: None)
