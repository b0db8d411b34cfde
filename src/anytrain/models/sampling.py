"""Text sampling shared by every model family (re-runs the whole window each token: for demos, not serving)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 0.8,
    top_k: int = 50,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue ``prompt`` (B, T0) token by token with temperature and top-k sampling; returns (B, T0 + new)."""
    tokens = prompt
    for _ in range(max_new_tokens):
        window = tokens[:, -max_seq_len:]
        logits = model(window)[:, -1, :].float() / max(temperature, 1e-5)  # (B, V)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


class SamplingMixin:
    """``generate`` and ``tie_embeddings`` for a family whose ``args`` has ``max_seq_len`` and ``tie_embeddings``."""

    args: object

    @property
    def tie_embeddings(self) -> bool:
        return self.args.tie_embeddings

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int = 50,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample continuations of ``prompt`` (B, T0) by re-running the whole window for each token (no KV or
        recurrent cache: for demos and evaluation samples; export to Hugging Face for serving)."""
        return sample(self, prompt, max_new_tokens, self.args.max_seq_len, temperature, top_k, generator)
