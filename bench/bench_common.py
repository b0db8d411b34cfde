"""Pieces shared by the single-GPU training benches (``transformer.py``, ``mamba_train.py``)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from anytrain import hardware  # noqa: E402


class RandomBatches:
    """A bank of global batches of random tokens; ``rank_batch`` has the trainer's BatchSource signature."""

    def __init__(self, vocab: int, global_batch: int, seq: int, seed: int = 0, bank: int = 4) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.bank = [torch.randint(0, vocab, (global_batch, seq + 1), generator=gen) for _ in range(bank)]

    def rank_batch(self, step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = self.bank[step % len(self.bank)]  # (G, T+1)
        return tokens[:, :-1], tokens[:, 1:], torch.arange(tokens.shape[0])


def release(device: torch.device) -> None:
    """Free the previous row completely (its closures and reference cycles too) before the next one starts."""
    gc.collect()
    torch._dynamo.reset()
    if hardware.is_gpu(device):
        torch.cuda.empty_cache()
    hardware.reset_peak_memory(device)


def versions(device: torch.device) -> dict:
    """The device summary plus the versions of the libraries a row may use."""
    out = hardware.summary(device)
    for name in ("transformers", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    out["python"] = sys.version.split()[0]
    return out


def row_error(exc: BaseException) -> str:
    """What a failed row records (one failing row must not lose the others): OOM in one line, else type and text."""
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory: {str(exc).splitlines()[0][:200]}"
    return f"{type(exc).__name__}: {str(exc)[:400]}"
