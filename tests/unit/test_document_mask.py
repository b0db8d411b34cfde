"""data.document_mask: a packed sequence's documents see only themselves (positions restart, attention stays inside),
checked against each document run alone, on the explicit CPU path and on the flex_attention path the GPUs take."""

from __future__ import annotations

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


def test_cli_training_records_document_mask(small_data, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "configs/tiny.yaml", "--model.flavour", "debug", "--data.path", str(small_data),
                   "--data.seq_len", "32", "--data.document_mask", "true", "--train.steps", "2",
                   "--train.global_batch", "4", "--train.eval_batches", "1", "--run-dir", str(run_dir))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["document_mask"] is True
