"""Llama-style decoder: RMSNorm pre-norm blocks, rotary position embeddings, grouped-query SDPA attention, SwiGLU.

Single-device ``nn.Module`` only: parallelism is applied from outside (``anytrain.parallel`` with this family's
``parallelize.py``). Shapes in comments: B batch, T sequence, D model width, H query heads, K key/value heads,
E head dim (D = H*E), F FFN width, V vocab.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from anytrain import hardware
from anytrain.kernels import wide_mm
from anytrain.models.layers import RMSNorm, residual_stream
from anytrain.models.losses import lm_cross_entropy
from anytrain.models.sampling import sample

SDPA_NATIVE_GQA: bool | None = None
"""Grouped-query attention inside SDPA (``enable_gqa=True``, torch >= 2.5) instead of expanding K/V to H heads.
None = auto: on for NVIDIA (FlashAttention-2 takes K < H heads natively) and CPU, off on ROCm (its flash kernel
path is not known to accept unequal head counts, and a fallback to the math kernel would be slow)."""


WIDE_GRAD_LINEAR = True
"""The blocks' projections produce their fp32 weight gradients straight from the GEMM under bf16/fp16 autocast
(``Linear``); False = plain ``F.linear`` (autocast's bf16 gradient, then a copy to fp32). A switch for benchmarks."""


def _native_gqa() -> bool:
    if SDPA_NATIVE_GQA is not None:
        return SDPA_NATIVE_GQA
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5) and hardware.vendor() != hardware.ROCM


@dataclass
class TransformerArgs:
    vocab_size: int = 8192
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    dim: int = 256
    """Model width D."""
    n_layers: int = 6
    n_heads: int = 8
    """Query heads H; D must be divisible by H."""
    n_kv_heads: int = 0
    """Key/value heads K for grouped-query attention; 0 = n_heads (multi-head). H must be divisible by K."""
    ffn_dim: int = 0
    """SwiGLU hidden width F; 0 = 8/3·D rounded up to a multiple of ``ffn_multiple_of``."""
    ffn_multiple_of: int = 64
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables cover."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    init_std: float = 0.02
    residual_in_fp32: bool = False
    """Keep the residual stream in fp32 under autocast (HF's behaviour with fp32 weights). False (default): the
    embedding output is cast to the autocast dtype, so residual adds, norms' inputs/outputs and the activations
    saved for backward are bf16, as under FSDP's bf16 parameters (torchtitan, Megatron's default). No effect
    without autocast (CPU fp32 training)."""

    def __post_init__(self) -> None:
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim == 0:
            hidden = int(8 * self.dim / 3)
            self.ffn_dim = self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)

    def validate(self, prefix: str = "model.args.") -> None:
        from anytrain.errors import ConfigError

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ConfigError(f"{prefix}n_heads: {self.n_heads} does not divide dim {self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{prefix}n_kv_heads: {self.n_kv_heads} does not divide n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"{prefix}n_heads: head dim {self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


TRANSFORMER_FLAVOURS: dict[str, dict[str, Any]] = {
    # For unit and multi-process tests: builds and steps in milliseconds.
    "debug": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256),
    # The CPU demo model (~7M parameters with an 8k vocabulary).
    "tiny": dict(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=512),
    "125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_dim=2048, max_seq_len=4096),
    "350m": dict(vocab_size=32000, dim=1024, n_layers=24, n_heads=16, ffn_dim=2816, max_seq_len=4096),
    # TinyLlama-1.1B shape: the reference shape of the throughput benchmarks.
    "1.1b": dict(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, max_seq_len=4096),
    "llama-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096),
}


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables (T, E) in fp32 for rotating pairs (x[2i], x[2i+1]) by angle a = t·theta^(-2i/E): cos a at both
    positions of pair i, and (-sin a, sin a)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, E/2)
    cos, sin = angles.cos(), angles.sin()
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the last dim: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos). x: (B, T, H, E);
    cos/sin: (T, E) from ``rope_tables``. Math in fp32.

    Written as x·cos + swap(x)·sin (swap exchanging the two elements of each pair), bitwise equal to the pairwise form
    (a stack of the rotated halves), with fewer ops per call."""
    x32 = x.float()
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    return (x32 * cos[None, :, None, :] + swapped * sin[None, :, None, :]).type_as(x)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) whose weight gradient, for an fp32 weight under bf16/fp16
    autocast, comes out of the GEMM in fp32 (``wide_mm.wide_linear``) instead of a bf16 product copied to fp32 by
    autocast's cast node. Plain ``F.linear`` otherwise: no autocast, bf16 parameters (FSDP mixed precision), sharded
    (DTensor) weights under tensor parallelism, a bias, no gradients, ``WIDE_GRAD_LINEAR`` off, or ``wide_grads``
    False on the instance (the trainer's eager pipeline stages, where autocast's cache shares one weight cast between
    micro-batches)."""

    wide_grads = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = WIDE_GRAD_LINEAR and self.wide_grads and self.bias is None
        dtype = wide_mm.wide_linear_dtype(x, self.weight) if use else None
        if dtype is None:
            return F.linear(x, self.weight, self.bias)
        return wide_mm.wide_linear(x, self.weight, dtype)


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.native_gqa = args.n_kv_heads != args.n_heads and _native_gqa()  # decided once, outside compiled code

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds H/tp query and K/tp key/value heads. (One GEMM against
        # [wq; wk; wv], and [w1; w3] below, measured 2% slower on an H200: docs/benchmarks.md.)
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, E)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, K, E)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = {}
        if self.native_gqa:  # query head h reads K/V head h // (H/K), as the expansion below does
            gqa = {"enable_gqa": True}
        elif self.n_kv_heads != self.n_heads:  # expand K/V to H heads: equal head counts suit every SDPA kernel
            repeat, kv = self.n_heads // self.n_kv_heads, k.shape[2]
            k = k.unsqueeze(3).expand(B, T, kv, repeat, self.head_dim).reshape(B, T, -1, self.head_dim)
            v = v.unsqueeze(3).expand(B, T, kv, repeat, self.head_dim).reshape(B, T, -1, self.head_dim)
        # SDPA wants (B, H, T, E); it picks FlashAttention / memory-efficient kernels on CUDA and ROCm.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             **gqa)  # fmt: skip
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V)."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps checkpoint keys stable if layers are split across pipeline stages.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, init_std) for matrices; residual output projections scaled by 1/sqrt(2·n_layers) (GPT-2).

        With ``seed``, every parameter draws from its own generator seeded by (seed, its name), so the weights do
        not depend on how the model is split (pipeline stages build only their own layers). Modules a pipeline
        stage does not hold are None and skipped. Also re-ties the head after ``to_empty`` untied it.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        std, deep_std = self.args.init_std, self.args.init_std / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
                continue
            generator = None
            if seed is not None:
                generator = torch.Generator(device=param.device)
                generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.normal_(0.0, deep_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else std,
                          generator=generator)  # fmt: skip
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T), or hidden states (B, T, D) on a pipeline stage without the embedding, through the
        layers this module holds, then the final norm if it holds it."""
        T = x.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.args.max_seq_len {self.args.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, D)
        h = residual_stream(h, self.args.residual_in_fp32)
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.norm(h) if self.norm is not None else h

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or with ``targets`` (B, T) the mean next-token loss (a scalar) — the training path,
        which lets the loss avoid materialising full-precision logits."""
        h = self.forward_hidden(tokens)
        if self.output is None:  # a pipeline stage before the last: hidden states go to the next stage
            return h
        if targets is not None:
            return lm_cross_entropy(h, self.output.weight, targets)
        return self.output(h)  # (B, T, V)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (shared tensors once). exclude_embedding drops the input table, keeps the LM head."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
            if self.args.tie_embeddings:  # the head still does a full V x D matmul
                total += self.output.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N + 12·L·D·T.

        N = parameters without the input embedding (LM head included); 6 = 2 (forward multiply-add) × 3 (forward +
        backward w.r.t. inputs and weights). 12·L·D·T is attention scores and weighted sum (QKᵀ and AV, 2·2·T·D per
        token per layer forward, ×3 for backward), without the causal discount — the PaLM / torchtitan /
        LLM Foundry convention. Recomputation (activation checkpointing) is not counted: that would be HFU.
        """
        return 6.0 * self.num_params(exclude_embedding=True) + 12.0 * self.args.n_layers * self.args.dim * seq_len

    def blocks(self) -> list[nn.Module]:
        """The repeated units that parallelism wraps (FSDP units, checkpointing, compile)."""
        return list(self.layers.values())

    @property
    def hidden_size(self) -> int:
        return self.args.dim

    @property
    def tie_embeddings(self) -> bool:
        return self.args.tie_embeddings

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int = 50,
                 generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
        """Sample continuations of ``prompt`` (B, T0) without a KV cache (for demos, not serving)."""
        return sample(self, prompt, max_new_tokens, self.args.max_seq_len, temperature, top_k, generator)
