"""prepare-sft and the masked batches: masks mark exactly the completion tokens (and EOS), the loss of a masked batch
equals a hand-computed masked cross-entropy, the pad layout starts every window at an example, bad input is one
line naming file:line or the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from anytrain.data.prepare import load_tokenizer
from anytrain.data.sft import IGNORE_INDEX, Example, encode_example, masked_sources, prepare_sft
from anytrain.data.shards import TokenDataset
from anytrain.errors import ConfigError, DataError

EXAMPLES = [{"prompt": f"Q{i}: what says ROMEO?", "completion": f" But soft, light number {i}."} for i in range(30)] + [
    {"text": "JULIET. O Romeo, Romeo!"}
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer_file(small_data) -> Path:
    return small_data / "tokenizer.json"


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tokenizer_file) -> Path:
    tmp = tmp_path_factory.mktemp("sft")
    prepare_sft([str(write_jsonl(tmp / "a.jsonl", EXAMPLES))], tmp / "packed", str(tokenizer_file), val_fraction=0.2)
    return tmp / "packed"


def test_mask_marks_completion_and_eos(tokenizer_file):
    tokenizer = load_tokenizer(tokenizer_file)
    ids, mask = encode_example(tokenizer, Example("x:1", "Q: who?", " ROMEO."), eos_id=0)
    prompt = tokenizer.encode("Q: who?", add_special_tokens=False).ids
    assert ids.tolist()[: len(prompt)] == prompt and ids[-1] == 0
    assert mask.tolist() == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    assert tokenizer.decode(ids[mask == 1][:-1].tolist()) == " ROMEO."
    _, text_mask = encode_example(tokenizer, Example("x:2", "", "ROMEO."), eos_id=0)
    assert text_mask[0] == 0 and text_mask[1:].all()  # a text example: all but its first token


def test_masked_batch_loss_is_the_hand_computed_masked_cross_entropy(packed):
    """The trainer's batch: targets of prompt tokens are -100; the model's training loss (fused linear + CE) equals a
    mean of per-token CE over the completion positions only, computed from the logits by hand."""
    from anytrain.config import ModelConfig
    from anytrain.models import build_model

    dataset = TokenDataset(packed)
    train, _ = masked_sources(dataset, seq_len=24, global_batch=4, seed=0)
    inputs, targets, ids = train.rank_batch(0, 0, 1)
    mask = train.index.mask(ids)[:, 1:]  # (b, T): target t is token t + 1
    tokens = train.index.tokens(ids)
    assert torch.equal(targets, torch.from_numpy(np.where(mask == 1, tokens[:, 1:], IGNORE_INDEX)))
    assert 0 < mask.sum() < mask.size

    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="transformer", flavour="debug"))
    loss = model(inputs, targets)
    with torch.no_grad():
        logits = model(inputs).double()  # (b, T, V)
    picked = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]  # (b, T)
    trained = torch.from_numpy(mask == 1)
    expected = -(picked * trained).sum() / trained.sum()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    unmasked = model(inputs, torch.from_numpy(tokens[:, 1:]))
    assert not torch.allclose(unmasked, loss)  # the mask changes the loss


def test_every_window_holds_a_trained_token_and_order_is_a_function_of_seed_and_step(packed):
    dataset = TokenDataset(packed)
    a, _ = masked_sources(dataset, 24, 4, seed=3)
    b, _ = masked_sources(dataset, 24, 4, seed=3)
    assert np.asarray(a.index.mask(np.arange(a.index.num_samples))[:, 1:].any(axis=1)).all()
    for step in (0, 5):
        xa, ya, ia = a.rank_batch(step, 1, 2)
        xb, yb, ib = b.rank_batch(step, 1, 2)
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and (ia == ib).all()


def test_pad_layout_starts_every_window_at_an_example(tmp_path, tokenizer_file):
    out = tmp_path / "pad"
    index = prepare_sft(
        [str(write_jsonl(tmp_path / "a.jsonl", EXAMPLES))],
        out,
        str(tokenizer_file),
        val_fraction=0.2,
        layout="pad",
        seq_len=16,
        shard_tokens=40,
    )
    assert all(s["tokens"] % 16 == 0 for s in index["splits"]["train"][:-1])  # shards hold whole windows
    tokenizer = load_tokenizer(tokenizer_file)
    train, _ = masked_sources(TokenDataset(out), 16, 2, seed=0)
    starts = {tokenizer.encode(e.get("prompt", e.get("text")), add_special_tokens=False).ids[0] for e in EXAMPLES}
    all_ids = np.arange(train.index.num_samples)
    first_tokens = train.index.tokens(all_ids)[:, 0]
    continuing = train.index.mask(all_ids)[:, 0] == 1  # windows continuing an example longer than 16 tokens
    assert set(first_tokens[~continuing].tolist()) <= starts
    with pytest.raises(ConfigError, match=r"data\.seq_len: 32, but .* --layout pad --seq-len 16"):
        masked_sources(TokenDataset(out), 32, 2, seed=0)


def test_plain_token_data_has_no_mask(small_data):
    assert masked_sources(TokenDataset(small_data), 32, 4, 0) is None


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", "a.jsonl:2: not valid JSON"),
        ({"question": "x"}, 'a.jsonl:2: expected {"text": ...} or {"prompt": ..., "completion": ...}'),
        ({"prompt": "x", "completion": 3}, "a.jsonl:2: prompt, completion and text must be strings"),
        ({"prompt": "x", "completion": ""}, "a.jsonl:2: empty completion"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, tokenizer_file, row, message):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [EXAMPLES[0], row])
    with pytest.raises(DataError, match=message.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")):
        prepare_sft([str(jsonl)], tmp_path / "out", str(tokenizer_file))
    assert not (tmp_path / "out").exists()


def test_option_errors(tmp_path, tokenizer_file):
    jsonl = str(write_jsonl(tmp_path / "a.jsonl", EXAMPLES))
    with pytest.raises(DataError, match=r"--seq-len: the pad layout needs"):
        prepare_sft([jsonl], tmp_path / "out", str(tokenizer_file), layout="pad")
    with pytest.raises(DataError, match=r"--layout: expected one of pack, pad"):
        prepare_sft([jsonl], tmp_path / "out", str(tokenizer_file), layout="chat")
    with pytest.raises(DataError, match=r"tokenizer file not found"):
        prepare_sft([jsonl], tmp_path / "out", str(tmp_path / "none.json"))


def test_mask_file_cut_while_training_is_one_line(tmp_path, packed):
    """Masks are read with pread, like token shards: a mask file cut after the sources are opened is one DataError
    naming it at the next read (a memory map's read past the end was a SIGBUS)."""
    import shutil

    data = shutil.copytree(packed, tmp_path / "packed")
    train, _ = masked_sources(TokenDataset(data), seq_len=24, global_batch=4, seed=0)
    entry = json.loads((data / "index.json").read_text())["meta"]["sft"]["masks"]["train"][0]
    with open(data / entry["file"], "r+b") as fh:
        fh.truncate(8)
    with pytest.raises(DataError, match=rf"{data / entry['file']}: 8 bytes, index.json says \d+ .*restore it"):
        train.index.mask(np.arange(train.index.num_samples))
