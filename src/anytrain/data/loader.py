"""Deterministic batches: the batch at a step is a pure function of (seed, step, dp rank).

A split is cut into non-overlapping windows of ``seq_len + 1`` tokens (inputs and their next-token targets share
``seq_len`` tokens), never crossing a shard boundary. Window ``i`` is sample id ``i``. The *global* order is an
endless sequence of epochs, each a seeded permutation of all sample ids; global step ``s`` takes positions
``[s·G, (s+1)·G)`` of that sequence (G = global batch in sequences). Data-parallel rank ``r`` of ``W`` takes the
contiguous slice ``[r·G/W, (r+1)·G/W)`` of the global batch, so the global order does not depend on the world size,
ranks never overlap, and resuming at step ``s`` needs no iterator state — only ``s``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import numpy as np
import torch

from anytrain.data.shards import INDEX, ShardFile, Split
from anytrain.errors import DataError


class SampleIndex:
    """Maps sample ids to (shard, token offset) for windows of ``seq_len + 1`` tokens."""

    def __init__(self, split: Split, seq_len: int, name: str = "train") -> None:
        self.split, self.seq_len = split, seq_len
        per_shard = [max(0, (a.size - 1) // seq_len) for a in split.arrays]
        self.num_samples = int(sum(per_shard))
        if self.num_samples == 0:
            raise DataError(
                f"data.seq_len: the {name} split ({split.num_tokens} tokens) is too short for one sequence of "
                f"{seq_len + 1} tokens; lower data.seq_len or prepare more data"
            )
        self._starts = np.concatenate([[0], np.cumsum(per_shard)])  # first sample id of each shard
        self._dtype = np.result_type(*(a.dtype for a in split.arrays))  # the shards' token dtype (uint16 / uint32)

    def tokens(self, sample_ids: np.ndarray) -> np.ndarray:
        """(n,) sample ids -> (n, seq_len + 1) int64 tokens. The windows are read in the shards' own dtype and, when
        the split has a ``vocab_size``, checked against it (one max over the batch, on the host): an id outside is one
        DataError naming the shard and the token's offset in it."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        shards = np.searchsorted(self._starts, ids, side="right") - 1
        starts = (ids - self._starts[shards]) * self.seq_len  # (n,) first token of each window in its shard
        raw = np.empty((len(ids), self.seq_len + 1), dtype=self._dtype)
        for row, (shard, start) in enumerate(zip(shards.tolist(), starts.tolist(), strict=True)):
            array = self.split.arrays[shard]
            if isinstance(array, ShardFile):
                array.read_into(raw[row], start)
            else:
                raw[row] = array[start : start + self.seq_len + 1]
        vocab = self.split.vocab_size
        if vocab is not None and raw.size and int(raw.max()) >= vocab:
            row, col = np.argwhere(raw >= vocab)[0]
            array = self.split.arrays[shards[row]]
            where = getattr(array, "path", f"shard {shards[row]}")
            raise DataError(
                f"{where}: token id {int(raw[row, col])} at token {int(starts[row] + col)} is outside the "
                f"vocabulary of {vocab} in {INDEX}; the shard is damaged or was not written with this "
                "dataset's tokenizer: re-run anytrain prepare"
            )
        return raw.astype(np.int64, copy=False)


class BatchProvider(Protocol):
    """What the trainer reads its training batches from (``BatchSource`` over a prepared split, or a benchmark's
    random batches): data-parallel rank ``dp_rank``'s slice of global batch ``step``."""

    def rank_batch(self, step: int, dp_rank: int, dp_world: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """(inputs (b, T) int64, targets (b, T) int64, sample ids (b,)) with b = global batch / dp_world."""
        ...


class BatchSource:
    """Global batches of a split in a seeded, epoch-wise shuffled order (or in storage order with shuffle=False)."""

    def __init__(self, index: SampleIndex, global_batch: int, seed: int, shuffle: bool = True, stream: int = 0) -> None:
        self.index, self.global_batch, self.seed, self.shuffle = index, global_batch, seed, shuffle
        self.stream = stream  # > 0: another seeded order for the same seed (one per source of a mixture)
        self._order = lru_cache(maxsize=2)(self._epoch_order)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = self.index.num_samples
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        key = [self.seed, epoch] if self.stream == 0 else [self.seed, epoch, self.stream]
        return np.random.default_rng(key).permutation(n).astype(np.int64)

    def global_sample_ids(self, step: int) -> np.ndarray:
        """Sample ids of global batch ``step`` (G,), possibly wrapping into the next epoch."""
        return self.ids_at(np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64))

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids at ``positions`` of the endless order (epoch after epoch)."""
        n = self.index.num_samples
        epochs, offsets = positions // n, positions % n
        ids = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self._order(int(epoch))[offsets[mask]]
        return ids

    def rank_sample_ids(self, step: int, dp_rank: int, dp_world: int) -> np.ndarray:
        per_rank = self.global_batch // dp_world
        return self.global_sample_ids(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]

    def rank_batch(self, step: int, dp_rank: int, dp_world: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """This rank's (inputs, targets) of shape (G/W, seq_len) as int64 CPU tensors, plus the sample ids."""
        ids = self.rank_sample_ids(step, dp_rank, dp_world)
        tokens = torch.from_numpy(self.index.tokens(ids))
        return tokens[:, :-1], tokens[:, 1:], ids


def epoch_of(step: int, global_batch: int, num_samples: int) -> float:
    """Fractional epochs completed after ``step`` optimizer steps."""
    return step * global_batch / num_samples
