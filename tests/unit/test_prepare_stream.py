"""Streaming, parallel, resumable ``anytrain prepare``: every input format, worker-count invariance, kill -9 then
``--resume``, the tokenizer sample, and peak memory on a corpus much larger than the bound."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anytrain.data.prepare import KILL_AT_CHUNK, load_tokenizer, partial_dir, prepare
from anytrain.data.readers import Position, iter_documents, list_inputs
from anytrain.data.shards import TokenDataset
from anytrain.errors import DataError
from tests.conftest import ROOT, cli_env

WORDS = np.array("the of and to in a is that for it as was with be by on not he this are or his from at which".split())


def make_docs(n: int, seed: int, words: int = 60) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {seed}-{i}: " + " ".join(WORDS[rng.integers(0, len(WORDS), words)]) for i in range(n)]


def write_jsonl(path: Path, texts: list, opener=open) -> Path:
    with opener(path, "wt") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text}) + "\n")
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Every input kind in one folder: plain / gzip / zstd JSONL (with a null text and a blank line), Parquet, txt."""
    raw = tmp_path_factory.mktemp("raw")
    write_jsonl(raw / "a.jsonl", make_docs(300, 1)[:150] + [None] + make_docs(300, 1)[150:])
    (raw / "a.jsonl").write_text((raw / "a.jsonl").read_text() + "\n")
    write_jsonl(raw / "b.jsonl.gz", make_docs(200, 2), opener=gzip.open)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": make_docs(200, 3)}), raw / "c.parquet", row_group_size=64)
    for i in range(3):
        (raw / f"d{i}.txt").write_text(" ".join(make_docs(5, 10 + i)))
    return raw


OPTIONS = dict(vocab_size=300, val_fraction=0.1, shard_tokens=3000, chunk_bytes=8000, progress=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> Path:
    """The corpus prepared by one in-process worker: the bytes every other way of preparing it must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "data"
    prepare([str(corpus)], out, workers=1, **OPTIONS)
    return out


def test_every_format_streams_the_same_documents_and_resumes_mid_file(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = make_docs(50, 7)
    write_jsonl(tmp_path / "x.jsonl", texts)
    write_jsonl(tmp_path / "x.jsonl.gz", texts, opener=gzip.open)
    (tmp_path / "x.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress((tmp_path / "x.jsonl").read_bytes()))
    pq.write_table(pa.table({"text": texts}), tmp_path / "x.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    splits = {"train": texts[:30], "test": texts[30:]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "dd")
    )
    for name in ("x.jsonl", "x.jsonl.gz", "x.jsonl.zst", "x.parquet", "hf", "dd"):
        files = list_inputs([str(tmp_path / name)])
        read = list(iter_documents(files, None, "text", "strict"))
        assert [d.text for d, _ in read] == texts, name
        middle = read[22][1]  # the position after document 23: reading resumes with document 24
        tail = list(iter_documents(files, Position.from_list(middle.to_list()), "text", "strict"))
        assert [d.text for d, _ in tail] == texts[23:], name
        assert [d.source for d, _ in tail] == [d.source for d, _ in read[23:]], name


def test_one_and_two_workers_write_identical_bytes(tmp_path, corpus, reference):
    index = json.loads((reference / "index.json").read_text())
    stats = index["meta"]["stats"]
    assert stats["train"]["documents"] + stats["val"]["documents"] == 300 + 200 + 200 + 3
    assert index["meta"]["skipped_null"] == 1 and len(index["splits"]["train"]) > 3
    prepare([str(corpus)], tmp_path / "two", workers=2, **OPTIONS)
    assert snapshot(tmp_path / "two") == snapshot(reference)
    assert not partial_dir(tmp_path / "two").exists()
    ds = TokenDataset(tmp_path / "two")
    train = np.concatenate(ds.split("train").arrays)
    assert (train == ds.eos_id).sum() == stats["train"]["documents"]


def test_kill_9_then_resume_gives_the_uninterrupted_bytes(tmp_path, corpus, reference):
    out = tmp_path / "data"
    code = (
        f"from anytrain.data.prepare import prepare; prepare([{str(corpus)!r}], {str(out)!r}, workers=2, **{OPTIONS!r})"
    )
    env = {**cli_env(), KILL_AT_CHUNK: "9"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = partial_dir(out)
    progress = json.loads((partial / "progress.json").read_text())
    assert 0 < progress["chunks"] < 9 and not out.exists()
    with pytest.raises(DataError, match="an interrupted prepare is in .*pass --resume to continue it"):
        prepare([str(corpus)], out, workers=1, **OPTIONS)
    with pytest.raises(DataError, match="--resume: the interrupted prepare .* another val_fraction"):
        prepare([str(corpus)], out, workers=1, resume=True, **{**OPTIONS, "val_fraction": 0.2})
    prepare([str(corpus)], out, workers=1, resume=True, **OPTIONS)
    assert snapshot(out) == snapshot(reference) and not partial.exists()


def test_tokenizer_is_trained_on_a_sample_from_every_file(tmp_path):
    for name, word in (("a.jsonl", "alphabetical"), ("b.jsonl", "zygomorphic")):
        texts = [f"{word} " * 20 + text for text in make_docs(200, len(name))]
        texts[-1] = "uncharacteristically " * 50  # only at the end of a.jsonl: outside the sample
        write_jsonl(tmp_path / name, texts)
    size = sum(p.stat().st_size for p in tmp_path.glob("*.jsonl"))
    prepare([str(tmp_path)], tmp_path / "sampled", vocab_size=400, tokenizer_sample_bytes=size // 4, progress=False)
    prepare([str(tmp_path)], tmp_path / "whole", vocab_size=400, tokenizer_sample_bytes=size, progress=False)
    sampled = load_tokenizer(tmp_path / "sampled" / "tokenizer.json").get_vocab()
    whole = load_tokenizer(tmp_path / "whole" / "tokenizer.json").get_vocab()
    assert "Ġalphabetical" in sampled and "Ġzygomorphic" in sampled  # both files contribute their share
    assert "uncharacteristically" in whole and "uncharacteristically" not in sampled


MEMORY_PROBE = """
import json, resource, sys
from anytrain.data.prepare import prepare
raw, out = sys.argv[1], sys.argv[2]
opts = dict(tokenizer_path=raw + "/tokenizer.json", shard_tokens=1 << 20, chunk_bytes=16 << 10, batch_docs=64,
            workers=2, progress=False)
maxrss = lambda: [resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
prepare([raw + "/warm"], out + "/warm", **opts)  # every allocation of a prepare once, on a small corpus
before = maxrss()
prepare([raw + "/big"], out + "/big", **opts)
print(json.dumps({"before_kib": before, "after_kib": maxrss()}))
"""


@pytest.mark.parametrize("corpus_mb, fraction", [(6, 3), pytest.param(40, 10, marks=pytest.mark.slow)])
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path, corpus_mb, fraction):
    """Peak RSS of the main process and of each of 2 workers grows, over a warm-up prepare, by less than
    1/``fraction`` of the corpus (40 MB in the slow case: a 4 MB bound, 10x smaller than the corpus). What stays in
    memory is the chunks in flight and each worker's bounded piece cache (filled to its bound by the warm-up); the
    whole-corpus reader this replaced grew by more than the corpus."""
    from anytrain.data.encoding import PIECE_CACHE
    from anytrain.data.prepare import train_tokenizer

    (tmp_path / "warm").mkdir()
    (tmp_path / "big").mkdir()
    warm = make_docs(12_000, 0, words=3)  # more distinct words than the tokenizer's word cache holds
    numbers = [" ".join(map(str, range(i, i + 2000))) for i in range(0, 2 * PIECE_CACHE + 50_000, 2000)]
    write_jsonl(tmp_path / "warm" / "w.jsonl", numbers + warm)  # more distinct pieces than each worker caches
    train_tokenizer(iter(warm[:2000]), 300).save(str(tmp_path / "tokenizer.json"))
    big = make_docs(corpus_mb * 1350, 1, words=200)
    for i in range(4):
        write_jsonl(tmp_path / "big" / f"part{i}.jsonl", big[i::4])
    corpus_kib = sum(len(t) for t in big) // 1024
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path), str(tmp_path / "out")],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = [after - before for before, after in zip(rss["before_kib"], rss["after_kib"], strict=True)]
    assert corpus_kib > corpus_mb * 900 and max(grown) < corpus_kib / fraction, (grown, corpus_kib, rss)


def test_piece_cache_gives_the_tokenizer_ids_on_any_whitespace_and_added_tokens():
    """The workers' TextEncoder (pieces looked up in a cache) gives exactly ``encode_batch_fast``'s ids: on random
    texts mixing every kind of whitespace (Unicode spaces, NEL, separators), contractions, digits, combining marks and
    added tokens, for a byte-level BPE trained on such texts; a tokenizer with a normalizer is encoded whole."""
    import random

    from tokenizers import normalizers

    from anytrain.data.encoding import TextEncoder
    from anytrain.data.prepare import train_tokenizer

    alphabet = [
        *" \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u1680\u2003\u2028\u2029\u3000\u180e",
        *"abcXYZ019'.,!?-_\"#",
        "'s",
        "'ll",
        "'re",
        "e\u0301",
        "日本語",
        "😀",
        "٣",
        "Ⅻ",
        "<|endoftext|>",
        "<|pad|>",
        "<|",
        "  ",
        "\n\n",
        " \n",
        "\t ",
    ]
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    tokenizer = train_tokenizer(iter(texts[:1000]), 500)
    lowercase = train_tokenizer(iter(texts[:1000]), 500)
    lowercase.normalizer = normalizers.Lowercase()
    for tok, cached in ((tokenizer, True), (lowercase, False)):
        encodings = tok.encode_batch_fast(texts, add_special_tokens=False)
        expected = [np.array(e.ids, np.uint16).tobytes() for e in encodings]
        encoder = TextEncoder(tok, np.dtype(np.uint16), batch_docs=256)
        assert (encoder.cache is not None) == cached
        assert encoder(texts) == expected and encoder(texts) == expected  # cold cache, then warm
