"""data.document_mask: a packed sequence's documents see only themselves (positions restart, attention stays inside),
checked against each document run alone, on the explicit CPU path and on the flex_attention path the GPUs take."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from anytrain import hardware
from anytrain.config import load_config
from anytrain.errors import ConfigError
from anytrain.models import layers
from anytrain.models.llama.model import MPT_OPTIONS, TRANSFORMER_FLAVOURS, Transformer, TransformerArgs
from tests.conftest import run_cli

EOS = 7
POS_ENCODINGS = ("rope", "alibi", "learned")


def packed_batch() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Two rows of 32 tokens, each a different packing of EOS-terminated documents (the last one cut by the window,
    as the loader's windows cut them), and each row's documents as separate tensors."""
    gen = torch.Generator().manual_seed(0)
    rows, pieces = [], []
    for lengths in ((5, 11, 9, 7), (1, 14, 2, 15)):
        docs = [torch.randint(EOS + 1, 512, (n,), generator=gen) for n in lengths]
        for doc in docs[:-1]:
            doc[-1] = EOS
        rows.append(torch.cat(docs))
        pieces.append(docs)
    return torch.stack(rows), pieces


@pytest.fixture(scope="module")
def models() -> dict[str, Transformer]:
    out = {}
    for pos in POS_ENCODINGS:
        torch.manual_seed(0)
        options = MPT_OPTIONS if pos == "alibi" else {"pos_encoding": pos}  # ALiBi as MPT has it
        out[pos] = Transformer(TransformerArgs(**{**TRANSFORMER_FLAVOURS["debug"], **options})).eval()
    return out


@torch.no_grad()
def packed_and_alone(model: Transformer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits of the packed batch with document masking, without it, each document run alone and concatenated)."""
    tokens, pieces = packed_batch()
    model.document_eos_id = EOS
    try:
        masked = model(tokens)
    finally:
        model.document_eos_id = None
    plain = model(tokens)
    alone = torch.stack([torch.cat([model(doc[None])[0] for doc in docs]) for docs in pieces])
    return masked, plain, alone


def test_document_ids():
    tokens = torch.tensor([[3, EOS, 4, 5, EOS, 6], [EOS, EOS, 8, 9, 9, 9]])
    documents, positions = layers.document_ids(tokens, EOS)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]


@pytest.mark.parametrize("pos", POS_ENCODINGS)
def test_packed_documents_equal_documents_alone(models, pos):
    """CPU path (SDPA with an explicit mask): every document's logits as if it were alone; without the option the
    later documents see the earlier ones and their logits differ."""
    masked, plain, alone = packed_and_alone(models[pos])
    torch.testing.assert_close(masked, alone, rtol=0, atol=1e-5)
    first = packed_batch()[1][0][0].numel()  # the first document sees nothing before it either way
    torch.testing.assert_close(plain[0, :first], alone[0, :first], rtol=0, atol=1e-5)
    assert (plain - alone).abs().amax() > 1e-2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("pos", ("rope", "alibi"))
def test_flex_path_equals_documents_alone(models, pos, monkeypatch):
    """The GPU dispatch (document BlockMask, flex_attention; eager flex here: the kernel's math) on CPU tensors."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(layers, "_FLEX_ATTENTION", flex_attention)
    monkeypatch.setattr(hardware, "is_gpu", lambda device=None: True)
    masked, _, _ = packed_and_alone(models[pos])
    monkeypatch.undo()
    _, _, alone = packed_and_alone(models[pos])
    torch.testing.assert_close(masked, alone, rtol=0, atol=1e-5)


def test_document_mask_refused_where_it_cannot_apply(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  document_mask: true\n")
    with pytest.raises(ConfigError, match=r"^data\.document_mask: Mamba carries its scan state"):
        load_config(config, ["--model.arch", "mamba", "--model.flavour", "tiny-mamba"])
    with pytest.raises(ConfigError, match=r"^data\.document_mask: not available with pipeline parallelism"):
        load_config(config, ["--parallel.pp", "2"])


@pytest.mark.parametrize("recipe", ["configs/tiny.yaml", "configs/tiny-hybrid.yaml"])
def test_cli_training_records_document_mask_and_eval_masks_too(many_documents, tmp_path, recipe):
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train",
        recipe,
        "--model.flavour",
        "debug",
        "--data.path",
        str(many_documents),
        "--data.seq_len",
        "64",
        "--data.document_mask",
        "true",
        "--train.steps",
        "2",
        "--train.global_batch",
        "4",
        "--train.eval_batches",
        "2",
        "--run-dir",
        str(run_dir),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["document_mask"] is True
    proc = run_cli("eval", str(run_dir), "--json", "--max-new-tokens", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert abs(json.loads(proc.stdout)["val_loss"] - summary["final_val_loss"]) < 1e-4  # eval masks as training did


@pytest.fixture(scope="module")
def many_documents(tmp_path_factory):
    """A prepared dataset of 1,500 short documents (paragraphs of one play): 64-token windows cross boundaries."""
    from anytrain.data.prepare import embedded_corpus_dir, prepare

    base = tmp_path_factory.mktemp("documents")
    text = sorted(embedded_corpus_dir().glob("*_gut.txt"))[0].read_text(encoding="utf-8", errors="replace")
    raw = base / "raw"
    raw.mkdir()
    for i, paragraph in enumerate([p for p in text.split("\n\n") if p.strip()][:1500]):
        (raw / f"d{i:05d}.txt").write_text(paragraph)
    prepare([str(raw)], base / "data", vocab_size=512, val_fraction=0.1)
    return base / "data"


def losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records for key in ("loss", "val_loss") if r.get(key) is not None]


@pytest.mark.slow
def test_tensor_parallel_training_equals_one_process(many_documents, tmp_path):
    """Tensor parallelism (sequence-parallel blocks, each rank's heads) with the option on: the losses of a 3-step run
    at tp 2 equal those of one process, and differ from the run without the option."""
    runs = {}
    for name, tp, mask in (("tp1", 1, "true"), ("tp2", 2, "true"), ("off", 1, "false")):
        run_dir = tmp_path / name
        proc = run_cli(
            "train",
            "configs/tiny.yaml",
            "--model.flavour",
            "debug",
            "--data.path",
            str(many_documents),
            "--data.seq_len",
            "64",
            "--data.document_mask",
            mask,
            "--train.steps",
            "3",
            "--train.log_interval",
            "1",
            "--train.global_batch",
            "4",
            "--train.eval_batches",
            "1",
            "--parallel.tp",
            str(tp),
            "--run-dir",
            str(run_dir),
            nproc=tp,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = losses(run_dir)
    assert runs["tp2"] == pytest.approx(runs["tp1"], rel=1e-5, abs=0)
    assert runs["off"] != pytest.approx(runs["tp1"], rel=1e-6, abs=0)
