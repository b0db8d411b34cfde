import json

import numpy as np
import pytest

from anytrain.data.loader import BatchSource, SampleIndex
from anytrain.data.prepare import load_tokenizer, prepare
from anytrain.data.shards import ShardWriter, TokenDataset, token_dtype, write_index
from anytrain.errors import DataError

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 20


def test_token_dtype_by_vocab():
    assert token_dtype(8192) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(200_000) == np.uint32


@pytest.mark.parametrize("vocab", [1000, 100_000])
def test_shard_writer_reader_round_trip(tmp_path, vocab):
    dtype = token_dtype(vocab)
    rng = np.random.default_rng(0)
    data = rng.integers(0, vocab, size=2500)
    writer = ShardWriter(tmp_path, "train", dtype, shard_tokens=1000)
    for chunk in np.array_split(data, 7):
        writer.write(chunk)
    writer.close()
    assert [s["tokens"] for s in writer.shards] == [1000, 1000, 500]
    write_index(tmp_path, dtype, vocab, 0, {"train": writer.shards, "val": writer.shards[:1]})
    ds = TokenDataset(tmp_path)
    split = ds.split("train")
    assert split.num_tokens == 2500 and split.arrays[0].dtype == dtype
    assert np.array_equal(np.concatenate(split.arrays), data)


def test_truncated_shard_is_detected(tmp_path):
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16))
    writer.write(np.arange(100))
    writer.close()
    write_index(tmp_path, np.dtype(np.uint16), 200, 0, {"train": writer.shards})
    with open(tmp_path / "train_00000.bin", "r+b") as fh:
        fh.truncate(50)
    with pytest.raises(DataError, match="index says 200"):
        TokenDataset(tmp_path).split("train")


def test_missing_dataset_error(tmp_path):
    with pytest.raises(DataError, match="data.path: .* has no index.json; run `anytrain prepare`"):
        TokenDataset(tmp_path / "nowhere")


def test_prepare_txt_jsonl_parquet_and_tokenizer_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(8):
        (raw / f"doc{i}.txt").write_text(f"Document {i}. " + TEXT)
    with open(raw / "more.jsonl", "w") as fh:
        for i in range(10):
            fh.write(json.dumps({"body": f"json record {i} " + TEXT}) + "\n")
    pq.write_table(pa.table({"body": [f"parquet row {i} " + TEXT for i in range(10)]}), raw / "rows.parquet")
    out = tmp_path / "out"
    index = prepare([str(raw)], out, vocab_size=300, val_fraction=0.2, text_field="body")
    stats = index["meta"]["stats"]
    assert stats["train"]["documents"] + stats["val"]["documents"] == 28
    assert stats["val"]["documents"] >= 1 and stats["train"]["documents"] >= 1
    tok = load_tokenizer(out / "tokenizer.json")
    sample = "that a single man, in possession!\n  Of a good fortune"
    assert tok.decode(tok.encode(sample).ids) == sample  # byte-level BPE: lossless
    ds = TokenDataset(out)
    assert ds.vocab_size == tok.get_vocab_size() <= 300
    train = np.concatenate(ds.split("train").arrays)
    assert (train == ds.eos_id).sum() == stats["train"]["documents"]  # one EOS after each document
    # the split is a function of document names only: preparing again gives identical shards
    again = prepare([str(raw)], tmp_path / "again", vocab_size=300, val_fraction=0.2, text_field="body")
    assert again["splits"] == index["splits"]
    assert np.array_equal(np.concatenate(TokenDataset(tmp_path / "again").split("train").arrays), train)


def test_prepare_with_given_tokenizer_and_refuses_overwrite(tmp_path, small_data):
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(4):
        (raw / f"d{i}.txt").write_text(TEXT)
    out = tmp_path / "out"
    prepare([str(raw)], out, tokenizer_path=str(small_data / "tokenizer.json"), val_fraction=0.3)
    assert TokenDataset(out).vocab_size == TokenDataset(small_data).vocab_size
    before = (out / "index.json").read_text()
    with pytest.raises(DataError, match="not empty; pass --overwrite"):
        prepare([str(raw)], out, vocab_size=300)
    assert (out / "index.json").read_text() == before


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.txt", "input not found"),
        (lambda d: (d / "x.csv").write_text("a") and d / "x.csv", "unsupported file type"),
        (lambda d: (d / "x.jsonl").write_text('{"content": "a"}\n') and d / "x.jsonl", "no 'text' field"),
        (lambda d: (d / "x.jsonl").write_text("{oops\n") and d / "x.jsonl", r"x.jsonl:1: not valid JSON"),
    ],
)
def test_prepare_bad_inputs(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        prepare([str(make(tmp_path))], tmp_path / "out", vocab_size=300)
    assert not (tmp_path / "out" / "index.json").exists()


def test_sample_index_windows(small_data):
    split = TokenDataset(small_data).split("train")
    index = SampleIndex(split, seq_len=16)
    tokens = index.tokens(np.array([0, 1, index.num_samples - 1]))
    flat = np.concatenate(split.arrays).astype(np.int64)
    assert np.array_equal(tokens[0], flat[:17]) and np.array_equal(tokens[1], flat[16:33])
    assert tokens[1][0] == tokens[0][-1]  # next window starts at the previous window's last target


def test_batch_order_is_a_function_of_seed_and_step(small_data):
    index = SampleIndex(TokenDataset(small_data).split("train"), seq_len=32)
    a, b = BatchSource(index, 8, seed=1), BatchSource(index, 8, seed=1)
    assert np.array_equal(a.global_sample_ids(5), b.global_sample_ids(5))
    assert not np.array_equal(a.global_sample_ids(5), BatchSource(index, 8, seed=2).global_sample_ids(5))
    # one epoch visits every sample once
    steps = index.num_samples // 8
    seen = np.concatenate([a.global_sample_ids(s) for s in range(steps)])
    assert len(np.unique(seen)) == len(seen) == steps * 8


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_slices_are_disjoint_and_cover_the_global_batch(small_data, world):
    index = SampleIndex(TokenDataset(small_data).split("train"), seq_len=32)
    source = BatchSource(index, 8, seed=3)
    for step in (0, 7):
        parts = [source.rank_sample_ids(step, r, world) for r in range(world)]
        joined = np.concatenate(parts)
        assert len(np.unique(joined)) == 8
        assert np.array_equal(joined, source.global_sample_ids(step))
        x, y, ids = source.rank_batch(step, world - 1, world)
        assert x.shape == (8 // world, 32) and np.array_equal(ids, parts[-1])
        assert (x[:, 1:] == y[:, :-1]).all()


def test_too_short_split(tmp_path):
    writer = ShardWriter(tmp_path, "val", np.dtype(np.uint16))
    writer.write(np.arange(10))
    writer.close()
    write_index(tmp_path, np.dtype(np.uint16), 20, 0, {"train": writer.shards, "val": writer.shards})
    with pytest.raises(DataError, match="data.seq_len: the val split"):
        SampleIndex(TokenDataset(tmp_path).split("val"), 64, "val")


# ---------------------------------------------------------------------------------------------------------------------
# mixtures (data.sources)


def _mixture(small_data, weights, global_batch=8, seed=11):
    from anytrain.data.mixture import MixtureSource

    split = TokenDataset(small_data).split("train")
    sources = [BatchSource(SampleIndex(split, 16), 1, seed, stream=k) for k in range(3)]
    return MixtureSource(sources[: len(weights)], weights, ["a", "b", "c"][: len(weights)], global_batch, seed)


def test_mixture_proportions_and_a_pure_function_of_seed_and_step(small_data):
    weights = [0.55, 0.3, 0.15]
    mix = _mixture(small_data, weights)
    counts = np.array([mix.counts(s) for s in range(5000)])
    assert (counts.sum(axis=1) == 8).all()
    assert (np.abs(counts - 8 * np.array(weights)) < 1).all()  # every step within one sequence of its share
    np.testing.assert_allclose(counts.sum(axis=0) / counts.sum(), weights, atol=2e-3)
    assert mix.shares(5000) == pytest.approx(dict(zip("abc", counts.sum(axis=0) / counts.sum(), strict=True)))
    # a fresh mixture jumps straight to a step (resume) and draws what the running one drew
    late = [mix.global_sample_ids(s) for s in (0, 1, 4999)]
    again = _mixture(small_data, weights)
    assert all(np.array_equal(a, again.global_sample_ids(s)) for a, s in zip(late, (0, 1, 4999), strict=True))
    # each source's samples come from its own epoch order without repeats until it is used up
    slots = [mix.global_assignment(s) for s in range(200)]
    taken = np.concatenate([local[src == 2] for src, local in slots])
    assert len(taken) == mix.consumed(200)[2] and len(np.unique(taken)) == len(taken)
    assert not np.array_equal(_mixture(small_data, weights, seed=12).global_sample_ids(3), mix.global_sample_ids(3))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mixture_rank_slices_form_the_global_batch(small_data, world):
    mix = _mixture(small_data, [2.0, 1.0])
    for step in (0, 9):
        parts = [mix.rank_batch(step, r, world) for r in range(world)]
        assert np.array_equal(np.concatenate([p[2] for p in parts]), mix.global_sample_ids(step))
        assert all(x.shape == (8 // world, 16) and (x[:, 1:] == y[:, :-1]).all() for x, y, _ in parts)


def test_mixture_refuses_sources_with_another_tokenizer(tmp_path, small_data):
    from anytrain.data.mixture import open_mixture

    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(6):
        (raw / f"d{i}.txt").write_text(f"{i} " + TEXT)
    prepare([str(raw)], tmp_path / "other", vocab_size=300, val_fraction=0.3)
    sources = [
        {"path": str(small_data), "weight": 1.0, "name": "a"},
        {"path": str(tmp_path / "other"), "weight": 1.0, "name": "b"},
    ]
    with pytest.raises(DataError, match=r"data.sources\[1\].path: .*other was prepared with another tokenizer"):
        open_mixture(sources, TokenDataset(small_data), 16, 8, 0)
