"""Token shards on disk: flat little-endian uint16/uint32 arrays (``*.bin``) described by ``index.json``.

Layout of a prepared dataset directory::

    index.json        {"format": 1, "dtype": "uint16", "vocab_size": ..., "eos_id": ..., "splits": {
                        "train": [{"file": "train_00000.bin", "tokens": N}, ...], "val": [...]}}
    tokenizer.json    the HF tokenizers file used to make the shards
    train_00000.bin   documents' tokens back to back, each document followed by EOS
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anytrain.errors import DataError

INDEX = "index.json"
FORMAT_VERSION = 1


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
        self.shards.append({"file": name, "tokens": 0})
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
            tokens = tokens[take:]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_index(out_dir: Path, dtype: np.dtype, vocab_size: int, eos_id: int, splits: dict[str, list[dict]],
                meta: dict | None = None) -> None:  # fmt: skip
    index = {"format": FORMAT_VERSION, "dtype": dtype.name, "vocab_size": vocab_size, "eos_id": eos_id,
             "splits": splits, "meta": meta or {}}  # fmt: skip
    tmp = out_dir / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out_dir / INDEX)  # the index appears only once every shard is complete


@dataclass
class Split:
    """A split's shards as read-only memory maps."""

    arrays: list[np.memmap]

    @property
    def num_tokens(self) -> int:
        return sum(a.size for a in self.arrays)


class TokenDataset:
    """Read side of a prepared dataset directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_file = self.path / INDEX
        if not index_file.is_file():
            raise DataError(
                f"data.path: {self.path} has no {INDEX}; run `anytrain prepare` first (or `make demo` for the corpus)"
            )
        try:
            self.index = json.loads(index_file.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{index_file}: not valid JSON ({exc})") from None
        if self.index.get("format") != FORMAT_VERSION:
            raise DataError(f"{index_file}: unsupported format {self.index.get('format')!r}; re-run anytrain prepare")
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size = int(self.index["vocab_size"])
        self.eos_id = int(self.index["eos_id"])
        self._splits: dict[str, Split] = {}

    def split(self, name: str) -> Split:
        if name not in self._splits:
            entries = self.index["splits"].get(name)
            if not entries:
                raise DataError(f"{self.path / INDEX}: no {name!r} split; re-run anytrain prepare")
            arrays = []
            for entry in entries:
                file = self.path / entry["file"]
                if not file.is_file():
                    raise DataError(f"{file}: shard listed in {INDEX} is missing")
                expected = entry["tokens"] * self.dtype.itemsize
                if file.stat().st_size != expected:
                    raise DataError(f"{file}: size {file.stat().st_size} bytes, index says {expected}; re-run prepare")
                arrays.append(np.memmap(file, dtype=self.dtype, mode="r"))
            self._splits[name] = Split(arrays)
        return self._splits[name]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.json"
