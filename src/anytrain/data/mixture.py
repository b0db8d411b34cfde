"""Weighted mixtures of prepared datasets (``data.sources``): the batch is still a pure function of (seed, step).

Each global batch of G sequences takes ``n_k(step)`` sequences from source k: ``floor(G·w_k)`` plus one for the R
sources picked by systematic sampling over the fractional parts ``G·w_k - floor(G·w_k)`` (R = G minus the floors; a
seeded uniform start per step), so every step is within one sequence of ``G·w_k`` and the long-run share of source k
is exactly ``w_k`` in expectation. The G slots are then shuffled by a generator keyed by (seed, step), and source k's
slots take the next ``n_k`` positions of that source's own seeded epoch order (stream k). Source k's position at a
step is the sum of its counts over the steps before: computed in blocks of :data:`BLOCK` steps (one generator per
block), so jumping to any step on resume costs milliseconds. Data-parallel ranks slice the global batch as for one
dataset, so the order does not depend on the world size.
"""

from __future__ import annotations

import numpy as np
import torch

from anytrain.data.loader import BatchSource

BLOCK = 1024  # steps whose per-source counts come from one generator
MIX_STREAM = 0x6D6978  # keys the count and slot generators apart from the sources' epoch orders


class MixtureSource:
    """Global batches drawn from several :class:`BatchSource` orders in proportions ``weights``."""

    def __init__(
        self, sources: list[BatchSource], weights: list[float], names: list[str], global_batch: int, seed: int
    ) -> None:
        self.sources, self.names, self.global_batch, self.seed = sources, names, global_batch, seed
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        exact = global_batch * self.weights
        self._base = np.floor(exact).astype(np.int64)  # (K,) sequences every step
        frac = exact - self._base
        self._extra = int(global_batch - self._base.sum())  # R: one more sequence for R of the sources
        self._edges = np.cumsum(frac) * (self._extra / frac.sum()) if self._extra else np.zeros_like(frac)
        self._offsets = np.concatenate([[0], np.cumsum([s.index.num_samples for s in sources])])  # global id ranges
        self._block_totals: list[np.ndarray] = []  # (K,) sequences per source in each full block, cached

    def _block_counts(self, block: int) -> np.ndarray:
        """(BLOCK, K) sequences per source for the steps of ``block``."""
        counts = np.tile(self._base, (BLOCK, 1))
        if self._extra:
            start = np.random.default_rng([self.seed, MIX_STREAM, block]).random(BLOCK)[:, None]  # (BLOCK, 1)
            # points start, start + 1, ..., start + R - 1 over the fractional parts' edges: 0 or 1 per source
            upper = np.ceil(self._edges[None, :] - start)
            lower = np.ceil(np.concatenate([[0.0], self._edges[:-1]])[None, :] - start)
            counts += (upper - lower).astype(np.int64)
        return counts

    def counts(self, step: int) -> np.ndarray:
        """(K,) sequences each source gives to global batch ``step``."""
        return self._block_counts(step // BLOCK)[step % BLOCK]

    def consumed(self, step: int) -> np.ndarray:
        """(K,) sequences each source gave to the global batches before ``step``."""
        block, within = divmod(step, BLOCK)
        while len(self._block_totals) < block:
            self._block_totals.append(self._block_counts(len(self._block_totals)).sum(axis=0))
        done = np.zeros(len(self.sources), dtype=np.int64)
        for totals in self._block_totals[:block]:
            done += totals
        return done + self._block_counts(block)[:within].sum(axis=0)

    def shares(self, step: int) -> dict[str, float]:
        """Fraction of the sequences of steps [0, step) that came from each source."""
        total = max(step * self.global_batch, 1)
        return {name: float(n) / total for name, n in zip(self.names, self.consumed(step), strict=True)}

    def global_assignment(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot (G,), that source's sample id (G,)) for global batch ``step``."""
        counts, start = self.counts(step), self.consumed(step)
        slots = np.repeat(np.arange(len(self.sources)), counts)
        slots = slots[np.random.default_rng([self.seed, MIX_STREAM, step, 1]).permutation(self.global_batch)]
        local = np.empty(self.global_batch, dtype=np.int64)
        for k, source in enumerate(self.sources):
            mask = slots == k
            local[mask] = source.ids_at(np.arange(start[k], start[k] + counts[k], dtype=np.int64))
        return slots, local

    def global_sample_ids(self, step: int) -> np.ndarray:
        """Ids unique over the mixture: source k's sample i is ``offset_k + i`` (sources in config order)."""
        slots, local = self.global_assignment(step)
        return self._offsets[slots] + local

    def rank_batch(self, step: int, dp_rank: int, dp_world: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """This rank's slice of global batch ``step``: (inputs, targets) (G/W, seq_len) int64, and the global ids."""
        per_rank = self.global_batch // dp_world
        slots, local = self.global_assignment(step)
        part = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        slots, local = slots[part], local[part]
        seq = self.sources[0].index.seq_len
        tokens = np.empty((per_rank, seq + 1), dtype=np.int64)
        for k, source in enumerate(self.sources):
            mask = slots == k
            if mask.any():
                tokens[mask] = source.index.tokens(local[mask])
        tokens = torch.from_numpy(tokens)
        return tokens[:, :-1], tokens[:, 1:], self._offsets[slots] + local


def open_mixture(
    sources: list[dict], first, seq_len: int, global_batch: int, seed: int
) -> tuple[MixtureSource, dict[str, BatchSource]]:
    """The training mixture of ``data.sources`` and each source's validation batches (storage order). ``first`` is
    the already opened dataset of the first source; every other must have its vocabulary (the same tokenizer)."""
    from anytrain.data.loader import SampleIndex
    from anytrain.data.prepare import load_tokenizer
    from anytrain.data.shards import TokenDataset
    from anytrain.errors import DataError

    datasets = [first] + [TokenDataset(s["path"]) for s in sources[1:]]
    vocab = load_tokenizer(first.tokenizer_path).get_vocab(with_added_tokens=True)
    for i, (source, ds) in enumerate(zip(sources, datasets, strict=True)):
        same = (ds.vocab_size, ds.eos_id) == (first.vocab_size, first.eos_id) and (
            i == 0 or load_tokenizer(ds.tokenizer_path).get_vocab(with_added_tokens=True) == vocab
        )
        if not same:
            raise DataError(
                f"data.sources[{i}].path: {source['path']} was prepared with another tokenizer than "
                f"data.sources[0] ({sources[0]['path']}); prepare every source with the same --tokenizer "
                "tokenizer.json"
            )
    train = [
        BatchSource(SampleIndex(ds.split("train"), seq_len, f"{s['name']} train"), 1, seed, stream=k)
        for k, (s, ds) in enumerate(zip(sources, datasets, strict=True))
    ]
    val = {
        s["name"]: BatchSource(
            SampleIndex(ds.split("val"), seq_len, f"{s['name']} val"), global_batch, seed, shuffle=False
        )
        for s, ds in zip(sources, datasets, strict=True)
    }
    mixture = MixtureSource(train, [s["weight"] for s in sources], [s["name"] for s in sources], global_batch, seed)
    return mixture, val
