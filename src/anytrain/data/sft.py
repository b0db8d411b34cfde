"""Supervised fine-tuning data: ``anytrain prepare-sft`` and the batches with the loss masked to completions.

Input: JSONL files, one example per line, either ``{"text": ...}`` (every token trained) or ``{"prompt": ...,
"completion": ...}`` (only the completion's tokens, and the EOS after it, are trained). Each example becomes
``encode(prompt) + encode(completion) + [EOS]`` (the two parts encoded separately, with the model's own tokenizer, no
special tokens added) and a parallel 0/1 mask saying which tokens are targets of the loss. The first token of an
example is never a target (nothing of the example precedes it).

Output: a prepared dataset as ``anytrain prepare`` writes it (token shards, index.json, tokenizer.json), so the rest of
the pipeline reads it unchanged, plus ``mask_<split>_NNNNN.bin`` (uint8, aligned token for token with the shards)
described under ``index.json``'s ``meta.sft``. Two layouts:

* ``pack`` (default): examples back to back; training windows of ``data.seq_len + 1`` tokens are cut from the stream
  as for pre-training, so one window may hold the end of one example and the start of the next (attention crosses
  the boundary, as in packed pre-training; the mask decides what is trained).
* ``pad``: each example starts a window of ``--seq-len`` tokens and is followed by pad tokens (mask 0) up to the next
  multiple of it: no window mixes examples (an example longer than a window continues in the next one). Training must
  use ``data.seq_len`` equal to ``--seq-len``.

The trainer (``masked_sources``) draws only windows holding at least one trained target, in the usual seeded order
(the batch stays a function of (seed, step, dp rank)), and sets the targets of untrained positions to -100, which the
loss ignores. The loss of a micro-batch is the mean over its trained tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from anytrain.data.loader import BatchSource, SampleIndex
from anytrain.data.prepare import MARKER, Document, _eos_id, check_out_dir, is_validation, load_tokenizer
from anytrain.data.shards import INDEX, ShardFile, ShardWriter, Split, TokenDataset, token_dtype, write_index
from anytrain.diskio import disk_full_as_error, missing_parents, move_into_place, remove, temp_sibling
from anytrain.errors import ConfigError, DataError

IGNORE_INDEX = -100
LAYOUTS = ("pack", "pad")
MASK_DTYPE = np.dtype(np.uint8)
PAD = "<|pad|>"


@dataclass(frozen=True)
class Example:
    source: str  # "file.jsonl:17": the name hashed for the train/validation split
    prompt: str  # "" for a {"text"} example
    completion: str


# ---------------------------------------------------------------------------------------------------------------------
# reading and encoding


def read_examples(inputs: list[str]) -> Iterator[Example]:
    """Examples of the JSONL files (or folders of them) in ``inputs``; a line that is not one is one DataError
    naming file:line."""
    for file in _jsonl_files(inputs):
        with open(file, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    yield _example(line, f"{file}:{lineno}", f"{file.name}:{lineno}")


def _jsonl_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.rglob("*.jsonl"))
            if not found:
                raise DataError(f"{path}: directory holds no .jsonl files")
            files.extend(found)
        elif path.is_file() and path.suffix == ".jsonl":
            files.append(path)
        else:
            raise DataError(f"{path}: " + ("not a .jsonl file" if path.exists() else "input not found"))
    return files


def _example(line: str, where: str, source: str) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
    elif isinstance(record, dict) and "text" in record:
        prompt, completion = "", record["text"]
    else:
        raise DataError(f'{where}: expected {{"text": ...}} or {{"prompt": ..., "completion": ...}}')
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(f"{where}: prompt, completion and text must be strings")
    if not completion:
        raise DataError(f"{where}: empty completion/text (nothing to train on)")
    return Example(source, prompt, completion)


def encode_example(tokenizer, example: Example, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, mask) of one example: prompt ids (mask 0), completion ids and EOS (mask 1); the first token's mask
    is 0."""
    prompt = tokenizer.encode(example.prompt, add_special_tokens=False).ids if example.prompt else []
    completion = tokenizer.encode(example.completion, add_special_tokens=False).ids
    ids = np.asarray(prompt + completion + [eos_id], dtype=np.int64)
    mask = np.concatenate([np.zeros(len(prompt), MASK_DTYPE), np.ones(len(completion) + 1, MASK_DTYPE)])
    mask[0] = 0
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------------
# prepare-sft


def _split(examples: list[Example], val_fraction: float, inputs: list[str]) -> dict[str, list[Example]]:
    val = [e for e in examples if is_validation(Document(e.source, None), val_fraction)]
    if not val:  # few examples: hold out the one that hashes lowest, so a validation split always exists
        val = [min(examples, key=lambda e: hashlib.sha256(e.source.encode()).digest())]
    held_out = {e.source for e in val}
    train = [e for e in examples if e.source not in held_out]
    if not train:
        raise DataError(f"{', '.join(inputs)}: every example went to validation; add data or lower --val-fraction")
    return {"train": train, "val": val}


def _tokenizer_file(path: str) -> Path:
    file = Path(path)
    return file / "tokenizer.json" if file.is_dir() else file


def _write_split(
    out: Path,
    name: str,
    examples: list[Example],
    tokenizer,
    eos_id: int,
    pad_id: int,
    dtype,
    layout: str,
    seq_len: int,
    shard_tokens: int,
) -> tuple[list[dict], list[dict], dict]:
    """Token and mask shards of one split; pad layout keeps shard sizes multiples of ``seq_len`` so every window
    still starts at an example."""
    if layout == "pad":
        shard_tokens = max(seq_len, shard_tokens // seq_len * seq_len)
    tokens = ShardWriter(out, name, dtype, shard_tokens)
    masks = ShardWriter(out, f"mask_{name}", MASK_DTYPE, shard_tokens)
    trained = 0
    try:
        for example in examples:
            ids, mask = encode_example(tokenizer, example, eos_id)
            if layout == "pad":
                pad = -len(ids) % seq_len
                ids = np.concatenate([ids, np.full(pad, pad_id, np.int64)])
                mask = np.concatenate([mask, np.zeros(pad, MASK_DTYPE)])
            tokens.write(ids)
            masks.write(mask)
            trained += int(mask.sum())
    finally:
        tokens.close()
        masks.close()
    stats = {"examples": len(examples), "tokens": sum(s["tokens"] for s in tokens.shards), "trained_tokens": trained}
    return tokens.shards, masks.shards, stats


def prepare_sft(
    inputs: list[str],
    out_dir: str | Path,
    tokenizer_path: str,
    val_fraction: float = 0.05,
    layout: str = "pack",
    seq_len: int = 0,
    shard_tokens: int = 100_000_000,
    overwrite: bool = False,
) -> dict:
    """Tokenize the examples of ``inputs`` into ``out_dir`` (see the module docstring); returns the index written.
    Built in a hidden sibling folder and renamed into place, as ``anytrain prepare`` does."""
    if layout not in LAYOUTS:
        raise DataError(f"--layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "pad" and seq_len < 1:
        raise DataError("--seq-len: the pad layout needs the training data.seq_len (>= 1)")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction: must be in (0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens: must be >= 1, got {shard_tokens}")
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    tokenizer_file = _tokenizer_file(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_file)
    examples = list(read_examples(inputs))
    if not examples:
        raise DataError(f"{', '.join(inputs)}: no examples found")
    eos_id = _eos_id(tokenizer, str(tokenizer_file))
    pad_id = tokenizer.token_to_id(PAD)
    pad_id = eos_id if pad_id is None else pad_id
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    created, tmp = missing_parents(out), temp_sibling(out, "prepare")
    try:
        with disk_full_as_error(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            (tmp / MARKER).write_text(json.dumps({"written_by": "anytrain prepare-sft", "format": 1}) + "\n")
            tokenizer.save(str(tmp / "tokenizer.json"))
            splits, masks, stats = {}, {}, {}
            for name, chosen in _split(examples, val_fraction, inputs).items():
                splits[name], masks[name], stats[name] = _write_split(
                    tmp, name, chosen, tokenizer, eos_id, pad_id, token_dtype(vocab), layout, seq_len, shard_tokens
                )
            sft = {"layout": layout, "seq_len": seq_len if layout == "pad" else 0, "masks": masks}
            write_index(
                tmp,
                token_dtype(vocab),
                vocab,
                eos_id,
                splits,
                {"inputs": inputs, "val_fraction": val_fraction, "stats": stats, "sft": sft},
            )
    except BaseException:
        remove(tmp)
        if created is not None:
            remove(created)
        raise
    check_out_dir(out, overwrite)
    move_into_place(tmp, out)
    return json.loads((out / INDEX).read_text())


# ---------------------------------------------------------------------------------------------------------------------
# batches


class TrainedWindows:
    """The windows of a split (as ``SampleIndex`` cuts them) that hold at least one trained target, renumbered
    0..n-1: what ``BatchSource`` orders and batches. ``targets`` gives a window's targets with -100 where the mask
    is 0."""

    def __init__(self, tokens: SampleIndex, masks: SampleIndex, name: str) -> None:
        self.tokens_index, self.masks_index, self.seq_len = tokens, masks, tokens.seq_len
        keep = []
        first = 0
        for array in masks.split.arrays:
            n = max(0, (array.size - 1) // self.seq_len)
            targets = np.asarray(array[1 : 1 + n * self.seq_len]).reshape(n, self.seq_len)  # (windows, T)
            keep.append(first + np.flatnonzero(targets.any(axis=1)))
            first += n
        self.keep = np.concatenate(keep).astype(np.int64) if keep else np.zeros(0, np.int64)
        self.num_samples = int(self.keep.size)
        if self.num_samples == 0:
            raise DataError(f"data.seq_len: no window of the {name} split holds a trained (completion) token")

    def tokens(self, sample_ids: np.ndarray) -> np.ndarray:
        """(n,) ids -> (n, seq_len + 1) int64 tokens."""
        return self.tokens_index.tokens(self.keep[sample_ids])

    def mask(self, sample_ids: np.ndarray) -> np.ndarray:
        """(n,) ids -> (n, seq_len + 1) 0/1 mask."""
        return self.masks_index.tokens(self.keep[sample_ids])


class MaskedBatchSource(BatchSource):
    """``BatchSource`` over ``TrainedWindows``: targets of untrained positions are -100."""

    index: TrainedWindows

    def rank_batch(self, step: int, dp_rank: int, dp_world: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        ids = self.rank_sample_ids(step, dp_rank, dp_world)
        tokens = torch.from_numpy(self.index.tokens(ids))
        trained = torch.from_numpy(self.index.mask(ids)[:, 1:] != 0)  # (b, T): target t is token t + 1
        return tokens[:, :-1], tokens[:, 1:].masked_fill(~trained, IGNORE_INDEX), ids


def sft_meta(dataset: TokenDataset) -> dict | None:
    """``meta.sft`` of a dataset written by ``prepare-sft``, else None."""
    return (dataset.index.get("meta") or {}).get("sft")


def _mask_split(dataset: TokenDataset, meta: dict, name: str) -> Split:
    arrays = []
    tokens = dataset.split(name).arrays
    for entry, token_array in zip(meta["masks"].get(name, []), tokens, strict=False):
        file = dataset.path / entry["file"]
        if not file.is_file() or file.stat().st_size != token_array.size * MASK_DTYPE.itemsize:
            raise DataError(
                f"{file}: missing, or not one mask byte per token of its shard; re-run anytrain prepare-sft"
            )
        # read with pread (not memory-mapped): a mask file cut while training is one DataError, not a SIGBUS
        arrays.append(ShardFile(file, MASK_DTYPE, token_array.size) if token_array.size else np.zeros(0, MASK_DTYPE))
    if len(arrays) != len(tokens):
        raise DataError(
            f"{dataset.index_file}: meta.sft lists {len(arrays)} {name} mask shards for {len(tokens)} "
            "token shards; re-run anytrain prepare-sft"
        )
    return Split(arrays)


def masked_sources(
    dataset: TokenDataset, seq_len: int, global_batch: int, seed: int
) -> tuple[MaskedBatchSource, MaskedBatchSource] | None:
    """(train, validation) sources with the loss mask for a ``prepare-sft`` dataset; None for token-only data. The
    pad layout needs ``seq_len`` equal to the one it was prepared for."""
    meta = sft_meta(dataset)
    if meta is None:
        return None
    if meta.get("layout") == "pad" and meta.get("seq_len") != seq_len:
        raise ConfigError(
            f"data.seq_len: {seq_len}, but {dataset.path} was prepared with --layout pad --seq-len "
            f"{meta.get('seq_len')}; set --data.seq_len {meta.get('seq_len')}"
        )
    sources = []
    for name, shuffle in (("train", True), ("val", False)):
        windows = TrainedWindows(
            SampleIndex(dataset.split(name), seq_len, name),
            SampleIndex(_mask_split(dataset, meta, name), seq_len, name),
            name,
        )
        sources.append(MaskedBatchSource(windows, global_batch, seed, shuffle=shuffle))
    return sources[0], sources[1]
