"""Bad input to prepare and to a prepared dataset: one DataError naming the file/field, and nothing lost or left."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from anytrain.data.prepare import MARKER, PrepareInterrupted, prepare
from anytrain.data.shards import INDEX, ShardWriter, TokenDataset, write_index
from anytrain.diskio import DiskFullError
from anytrain.errors import DataError

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 5


def raw_dir(tmp_path, n=4):
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(n):
        (raw / f"d{i}.txt").write_text(f"Document {i}. " + TEXT)
    return raw


def listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_overwrite_refuses_a_folder_with_index_json_but_no_marker(tmp_path):
    raw = raw_dir(tmp_path)
    web = tmp_path / "webapp"
    (web / "assets").mkdir(parents=True)
    (web / "index.html").write_text("<html>")
    (web / "assets" / "app.js").write_text("x")
    (web / INDEX).write_text("{}")
    with pytest.raises(DataError, match=f"webapp: not empty and not a dataset written by anytrain prepare.*{MARKER}"):
        prepare([str(raw)], web, vocab_size=300, overwrite=True)
    assert listing(web) == ["assets", "assets/app.js", "index.html", INDEX]


def test_overwrite_replaces_a_marked_dataset_and_nothing_partial_is_left(tmp_path):
    raw = raw_dir(tmp_path)
    out = tmp_path / "out"
    prepare([str(raw)], out, vocab_size=300)
    assert (out / MARKER).is_file()
    (raw / "d9.txt").write_text("more text " + TEXT)
    index = prepare([str(raw)], out, vocab_size=300, overwrite=True)
    assert sum(s["documents"] for s in index["meta"]["stats"].values()) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]  # no temp or old sibling left


def test_failure_midway_leaves_the_previous_dataset_untouched(tmp_path, monkeypatch):
    raw = raw_dir(tmp_path)
    out = tmp_path / "out"
    prepare([str(raw)], out, vocab_size=300)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("anytrain.data.prepare.write_index", boom)
    with pytest.raises(PrepareInterrupted, match="kept in .*out.prepare-partial: run the same command with --resume"):
        prepare([str(raw)], out, vocab_size=300, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.prepare-partial", "out", "raw"]
    monkeypatch.undo()  # the interrupted prepare continues and replaces the dataset with the same bytes
    prepare([str(raw)], out, vocab_size=300, overwrite=True, resume=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]


def test_failure_leaves_no_new_output_folder(tmp_path, monkeypatch):
    raw = raw_dir(tmp_path)
    monkeypatch.setattr("anytrain.data.prepare.write_index", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        prepare([str(raw)], tmp_path / "new" / "out", vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shard_tokens": 0}, "--shard-tokens: must be >= 1, got 0"),
        ({"shard_tokens": -1}, "--shard-tokens: must be >= 1, got -1"),
        ({"vocab_size": 10}, "--vocab-size: must be at least 258"),
        ({"vocab_size": 2**40}, "--vocab-size: must be at least 258 .* at most"),
        ({"val_fraction": 1.0}, r"--val-fraction: must be in \(0, 1\)"),
        ({"val_fraction": float("nan")}, "--val-fraction"),
        ({"text_field": ""}, "--text-field: must not be empty"),
        ({"encoding_errors": "ignore"}, "--encoding-errors: expected one of strict, replace"),
        ({"batch_docs": 0}, "batch_docs: must be >= 1"),
    ],
)
def test_prepare_options_are_validated_before_anything_is_written(tmp_path, kwargs, message):
    raw = raw_dir(tmp_path)
    with pytest.raises(DataError, match=message):
        prepare([str(raw)], tmp_path / "out", **{"vocab_size": 300, **kwargs})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_non_utf8_text_is_refused_with_offset_or_replaced_on_request(tmp_path):
    raw = raw_dir(tmp_path)
    (raw / "bad.txt").write_bytes(b"caf\xe9 " + TEXT.encode())
    with pytest.raises(DataError, match=r"bad.txt: not UTF-8 at byte 3; .*--encoding-errors replace"):
        prepare([str(raw)], tmp_path / "out", vocab_size=300)
    assert not (tmp_path / "out").exists()
    prepare([str(raw)], tmp_path / "out", vocab_size=300, encoding_errors="replace")
    assert TokenDataset(tmp_path / "out").split("train").num_tokens > 0


def test_non_utf8_jsonl_names_the_line(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: not UTF-8 at byte 13"):
        prepare([str(bad)], tmp_path / "out", vocab_size=300)
    assert not (tmp_path / "out").exists()


def test_jsonl_nulls_are_skipped_and_counted_and_non_strings_refused(tmp_path):
    good = tmp_path / "x.jsonl"
    lines = [{"text": f"{i} {TEXT}"} for i in range(6)] + [{"text": None}, {"text": None}]
    good.write_text("".join(json.dumps(r) + "\n" for r in lines))
    index = prepare([str(good)], tmp_path / "out", vocab_size=300)
    assert index["meta"]["skipped_null"] == 2
    assert sum(s["documents"] for s in index["meta"]["stats"].values()) == 6
    bad = tmp_path / "y.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 5}\n')
    with pytest.raises(DataError, match=r"y.jsonl:2: field 'text' is a int, expected a string"):
        prepare([str(bad)], tmp_path / "out2", vocab_size=300)


def test_parquet_integer_column_is_refused_and_nulls_skipped(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match=r"ints.parquet: column 'text' holds int64, not strings; set --text-field"):
        prepare([str(tmp_path / "ints.parquet")], tmp_path / "out", vocab_size=300)
    pq.write_table(pa.table({"text": [f"{i} {TEXT}" for i in range(5)] + [None]}), tmp_path / "s.parquet")
    index = prepare([str(tmp_path / "s.parquet")], tmp_path / "out", vocab_size=300)
    assert index["meta"]["skipped_null"] == 1


def dataset(tmp_path, tokens=np.arange(100), vocab=200):
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16))
    writer.write(tokens)
    writer.close()
    write_index(tmp_path, np.dtype(np.uint16), vocab, 0, {"train": writer.shards, "val": writer.shards})
    return json.loads((tmp_path / INDEX).read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda i: "{not json", "index.json: not valid JSON"),
        (lambda i: "[]", "index.json: expected a JSON object"),
        (lambda i: {k: v for k, v in i.items() if k != "vocab_size"}, "index.json: vocab_size must be an integer"),
        (lambda i: {**i, "dtype": "float64"}, "index.json: dtype must be one of uint16, uint32"),
        (lambda i: {**i, "eos_id": 500}, r"index.json: eos_id must be an integer in \[0, 199\]"),
        (lambda i: {**i, "vocab_size": 100000}, r"index.json: vocab_size must be an integer in \[1, 65536\]"),
        (lambda i: {**i, "splits": None}, "index.json: 'splits' missing"),
        (lambda i: {**i, "splits": {"train": [{"tokens": 100}]}}, r"splits.train\[0\].file must be a shard file"),
        (lambda i: {**i, "splits": {"train": [{"file": "../x.bin", "tokens": 1}]}}, r"train\[0\].file must be"),
        (lambda i: {**i, "splits": {"train": [{"file": "train_00000.bin"}]}}, r"train\[0\].tokens must be"),
        (
            lambda i: {**i, "splits": {"train": [{"file": "train_00000.bin", "tokens": 100, "max_id": 300}]}},
            r"train\[0\].max_id must be an integer in \[-1, 199\]",
        ),
    ],
)
def test_garbage_or_incomplete_index_is_one_error(tmp_path, edit, message):
    index = dataset(tmp_path)
    edited = edit(index)
    (tmp_path / INDEX).write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(DataError, match=message):
        TokenDataset(tmp_path)


def test_token_ids_outside_the_vocabulary_are_caught_at_open(tmp_path):
    index = dataset(tmp_path, tokens=np.arange(100), vocab=200)
    for entry in index["splits"]["train"] + index["splits"]["val"]:
        del entry["max_id"]  # an index from before max_id was recorded: the sample check still sees the ids
    index["vocab_size"] = 50
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"train_00000.bin: token id 99 is outside the vocabulary of 50"):
        TokenDataset(tmp_path).split("train")


def test_recorded_max_id_above_the_vocabulary_is_caught(tmp_path):
    index = dataset(tmp_path, tokens=np.arange(100), vocab=200)
    index["vocab_size"] = 60
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"max_id must be an integer in \[-1, 59\], got 99"):
        TokenDataset(tmp_path)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 256 KiB tmpfs (root only): a real full disk."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_disk_full_while_preparing_is_one_line_and_leaves_nothing(tmp_path, tiny_fs):
    raw = raw_dir(tmp_path, n=2)
    (raw / "big.txt").write_text(TEXT * 1000)  # ~450k tokens of uint16: more than the 256 KiB filesystem holds
    with pytest.raises(DiskFullError, match=f"disk full while writing {tiny_fs / 'out'}"):
        prepare([str(raw)], tiny_fs / "out", vocab_size=300)
    assert list(tiny_fs.iterdir()) == []
