"""Token shards on disk: flat little-endian uint16/uint32 arrays (``*.bin``) described by ``index.json``.

Layout of a prepared dataset directory::

    .anytrain-dataset.json   marker: this folder was written by ``anytrain prepare`` (``--overwrite`` may replace it)
    index.json               {"format": 1, "dtype": "uint16", "vocab_size": ..., "eos_id": ..., "splits": {
                               "train": [{"file": "train_00000.bin", "tokens": N, "max_id": M}, ...], "val": [...]}}
    tokenizer.json           the HF tokenizers file used to make the shards
    train_00000.bin          documents' tokens back to back, each document followed by EOS
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anytrain.diskio import write_text_atomic
from anytrain.errors import DataError

INDEX = "index.json"
FORMAT_VERSION = 1
DTYPES = ("uint16", "uint32")
SAMPLE_TOKENS = 4096  # tokens read from each end of a shard at open to catch ids outside the vocabulary


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: uint16 up to 65,536 entries, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token arrays to ``<split>_NNNNN.bin`` files of at most ``shard_tokens`` tokens each."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int = 100_000_000) -> None:
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._count = 0

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self.shards.append({"file": name, "tokens": 0, "max_id": -1})
        self._file = open(self.out_dir / name, "wb")  # noqa: SIM115 - closed in close()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and int(tokens.max()) > np.iinfo(self.dtype).max:
            raise DataError(f"token id {int(tokens.max())} does not fit {self.dtype}")
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None or self._count >= self.shard_tokens:
                self._open_next()
            take = min(tokens.size, self.shard_tokens - self._count)
            self._file.write(tokens[:take].tobytes())
            self._count += take
            self.shards[-1]["tokens"] = self._count
            self.shards[-1]["max_id"] = max(self.shards[-1]["max_id"], int(tokens[:take].max()))
            tokens = tokens[take:]

    def flush(self) -> None:
        """Hand everything written so far to the operating system and the disk (a resume point may follow)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None

    @classmethod
    def resume(cls, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, shards: list[dict]) -> ShardWriter:
        """A writer continuing after the committed ``shards`` (index entries): the last shard file is cut back to its
        committed size, and later files of the split (written after the commit) are deleted."""
        writer = cls(out_dir, split, dtype, shard_tokens)
        writer.shards = [dict(s) for s in shards]
        for path in out_dir.glob(f"{split}_*.bin"):
            if path.name not in {s["file"] for s in shards}:
                path.unlink()
        if shards:
            last = out_dir / shards[-1]["file"]
            size = shards[-1]["tokens"] * dtype.itemsize
            if not last.is_file() or last.stat().st_size < size:
                raise DataError(
                    f"{last}: shorter than its committed {size} bytes; cannot resume, pass --overwrite to start over"
                )
            with open(last, "r+b") as fh:
                fh.truncate(size)
            writer._file = open(last, "ab")  # noqa: SIM115 - closed in close()
            writer._count = shards[-1]["tokens"]
        return writer


def write_index(
    out_dir: Path,
    dtype: np.dtype,
    vocab_size: int,
    eos_id: int,
    splits: dict[str, list[dict]],
    meta: dict | None = None,
) -> None:
    index = {
        "format": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "splits": splits,
        "meta": meta or {},
    }
    write_text_atomic(out_dir / INDEX, json.dumps(index, indent=1))  # appears only once every shard is complete


class ShardFile:
    """One shard's ``size`` tokens of ``dtype``, read with ``pread`` from a file held open (not memory-mapped: a shard
    cut short while it is read is one DataError naming it, where a memory map's read past the end is a SIGBUS that
    kills the process without a word). Slicing (step 1) returns a new array; ``read_into`` fills a given one."""

    def __init__(self, path: Path, dtype: np.dtype, size: int) -> None:
        self.path, self.dtype, self.size = Path(path), np.dtype(dtype), size
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def __len__(self) -> int:
        return self.size

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:  # noqa: ARG002
        """The whole shard, read into memory (``np.asarray(shard)``)."""
        return self[:] if dtype is None else self[:].astype(dtype)

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"ShardFile: only slices with step 1, got {key!r}")
        start, stop, _ = key.indices(self.size)
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        self.read_into(out, start)
        return out

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Fill ``out`` (C-contiguous, of ``dtype``) with tokens ``[start, start + out.size)``."""
        view, offset, done = memoryview(out).cast("B"), start * self.dtype.itemsize, 0
        while done < view.nbytes:
            try:
                got = _pread_into(self._fd, view[done:], offset + done)
            except OSError as exc:
                raise DataError(
                    f"{self.path}: cannot be read at byte {offset + done} ({exc.strerror}); check the "
                    "disk, or re-run anytrain prepare"
                ) from None
            if got == 0:
                size, expected = os.fstat(self._fd).st_size, self.size * self.dtype.itemsize
                raise DataError(
                    f"{self.path}: {size} bytes, {INDEX} says {expected} (byte {offset + done} wanted): "
                    "the shard was cut or changed after prepare; restore it or re-run anytrain "
                    "prepare"
                )
            done += got


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, view.nbytes, offset)
    view[: len(data)] = data
    return len(data)


@dataclass
class Split:
    """A split's shards: :class:`ShardFile` readers of a prepared dataset (or in-memory arrays). ``vocab_size``, when
    set, bounds the token ids: ``SampleIndex`` checks every window it reads against it."""

    arrays: list[ShardFile | np.ndarray]
    vocab_size: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(a.size for a in self.arrays)


class TokenDataset:
    """Read side of a prepared dataset directory. Opening checks index.json's fields, each shard's size against it,
    and the token ids against the vocabulary (the recorded maximum and a sample from both ends of each shard; the
    loader checks every window it reads)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.index_file = self.path / INDEX
        if not self.index_file.is_file():
            raise DataError(
                f"data.path: {self.path} has no {INDEX}; run `anytrain prepare` first (or `make demo` for the corpus)"
            )
        self.index = _read_index(self.index_file)
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size = self.index["vocab_size"]
        self.eos_id = self.index["eos_id"]
        self._splits: dict[str, Split] = {}
        for name, entries in self.index["splits"].items():  # every shard checked now, before anything is written
            if entries:
                self.split(name)

    def split(self, name: str) -> Split:
        if name not in self._splits:
            entries = self.index["splits"].get(name)
            if not entries:
                raise DataError(f"{self.index_file}: no {name!r} split; re-run anytrain prepare")
            self._splits[name] = Split([self._open_shard(entry) for entry in entries], self.vocab_size)
        return self._splits[name]

    def _open_shard(self, entry: dict) -> ShardFile | np.ndarray:
        file = self.path / entry["file"]
        if not file.is_file():
            raise DataError(f"{file}: shard listed in {INDEX} is missing; re-run anytrain prepare")
        expected = entry["tokens"] * self.dtype.itemsize
        if file.stat().st_size != expected:
            raise DataError(f"{file}: size {file.stat().st_size} bytes, index says {expected}; re-run prepare")
        if expected == 0:
            return np.zeros(0, dtype=self.dtype)
        array = ShardFile(file, self.dtype, entry["tokens"])
        sample = max(int(array[:SAMPLE_TOKENS].max()), int(array[-SAMPLE_TOKENS:].max()))
        if sample >= self.vocab_size:
            raise DataError(
                f"{file}: token id {sample} is outside the vocabulary of {self.vocab_size} in {INDEX}; "
                "the shard does not belong to this tokenizer: re-run anytrain prepare"
            )
        return array

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.json"


def read_index(path: str | Path) -> dict:
    """index.json of the prepared dataset folder ``path``, checked (no shard is opened); one DataError otherwise."""
    return _read_index(Path(path) / INDEX)


def _read_index(index_file: Path) -> dict:
    """index.json, parsed and checked field by field; any problem is one DataError naming the file and the field."""
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{index_file}: not valid JSON ({exc}); re-run anytrain prepare") from None
    if not isinstance(index, dict):
        raise DataError(f"{index_file}: expected a JSON object; re-run anytrain prepare")
    if index.get("format") != FORMAT_VERSION:
        raise DataError(f"{index_file}: unsupported format {index.get('format')!r}; re-run anytrain prepare")
    if index.get("dtype") not in DTYPES:
        raise DataError(f"{index_file}: dtype must be one of {', '.join(DTYPES)}, got {index.get('dtype')!r}")
    vocab = _index_int(index, "vocab_size", index_file, 1, np.iinfo(index["dtype"]).max + 1)
    _index_int(index, "eos_id", index_file, 0, vocab - 1)
    splits = index.get("splits")
    if not isinstance(splits, dict):
        raise DataError(f"{index_file}: 'splits' missing or not an object; re-run anytrain prepare")
    for name, entries in splits.items():
        if not isinstance(entries, list):
            raise DataError(f"{index_file}: splits.{name} is not a list of shards; re-run anytrain prepare")
        for i, entry in enumerate(entries):
            _check_entry(entry, f"splits.{name}[{i}]", index_file, vocab)
    return index


def _index_int(obj: dict, key: str, index_file: Path, low: int, high: int, where: str = "") -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DataError(
            f"{index_file}: {where}{key} must be an integer in [{low}, {high}], got {value!r}; re-run anytrain prepare"
        )
    return value


def _check_entry(entry: object, where: str, index_file: Path, vocab: int) -> None:
    file = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(file, str) or not file or Path(file).name != file:
        raise DataError(f"{index_file}: {where}.file must be a shard file name; re-run anytrain prepare")
    _index_int(entry, "tokens", index_file, 0, 2**62, f"{where}.")
    if "max_id" in entry:
        _index_int(entry, "max_id", index_file, -1, vocab - 1, f"{where}.")


def check_seq_len(path: str | Path, seq_len: int) -> None:
    """Refuse a ``seq_len`` that no shard of a split can hold (windows never cross shards), from index.json alone.
    A missing or unreadable dataset is left for :class:`TokenDataset` to report when it is opened."""
    index_file = Path(path) / INDEX
    if not index_file.is_file():
        return
    try:
        index = _read_index(index_file)
    except DataError:
        return
    for name, entries in index["splits"].items():
        longest = max((entry["tokens"] for entry in entries), default=0)
        if entries and longest - 1 < seq_len:
            raise DataError(
                f"data.seq_len: {seq_len} is too long for the {name} split of {path} (longest shard "
                f"{longest} tokens, a sequence needs {seq_len + 1}); lower data.seq_len or prepare more "
                "data"
            )
