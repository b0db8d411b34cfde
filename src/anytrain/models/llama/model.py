"""Decoder-only Transformer: pre-norm blocks, grouped-query attention, fused linear + cross-entropy loss. The defaults
are Llama (RMSNorm, rotary position embeddings, SwiGLU, no biases); ``TransformerArgs`` options give MPT / GPT shapes
in the same module: position encoding RoPE | ALiBi | learned, RMSNorm | LayerNorm (with or without bias), SwiGLU |
GELU MLP, biases on the linear layers, tied embeddings, GQA / MQA (``n_kv_heads``) and QK-norm (docs/models.md).

Single-device ``nn.Module`` only: parallelism is applied from outside (``anytrain.parallel`` with this family's
``parallelize.py``). Shapes in comments: B batch, T sequence, D model width, H query heads, K key/value heads,
E head dim (D = H*E), F FFN width, V vocab.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from anytrain import hardware
from anytrain.kernels import wide_mm
from anytrain.models.layers import (
    alibi_attention,
    alibi_distance,
    alibi_slopes,
    causal_block_mask,
    document_alibi_distance,
    document_block_mask,
    document_causal_mask,
    document_ids,
    make_norm,
    masked_attention,
    residual_stream,
)
from anytrain.models.losses import lm_cross_entropy
from anytrain.models.sampling import SamplingMixin

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
    """MLP hidden width F; 0 = 8/3·D rounded up to a multiple of ``ffn_multiple_of`` for SwiGLU, 4·D for GELU."""
    ffn_multiple_of: int = 64
    max_seq_len: int = 2048
    """Longest sequence: what the RoPE tables and the learned position table cover."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    pos_encoding: Literal["rope", "alibi", "learned"] = "rope"
    """Position information: 'rope' rotates q and k (Llama); 'alibi' adds slope_h·(j - i) to the attention scores
    (MPT; no position parameters; flex_attention on GPUs, SDPA with an explicit bias on CPU); 'learned' adds a
    trained (max_seq_len, D) table to the token embeddings (GPT-2)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """The blocks' and final normalisation: RMSNorm (Llama) or LayerNorm (MPT, GPT)."""
    norm_bias: bool = False
    """LayerNorm with a bias (GPT-2); False = scale only (MPT). Only with norm 'layernorm'."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """Feed-forward: 'swiglu' w2(silu(w1 x) · w3 x) (3 matrices) or 'gelu' w2(gelu(w1 x)) (2 matrices, exact GELU)."""
    bias: bool = False
    """Biases on every linear layer of the blocks (q, k, v, o and the MLP's); the LM head never has one."""
    qk_norm: bool = False
    """Normalise each head's q and k (over the head dim E, with ``norm``'s kind and its own E-wide weight) before
    the position encoding and the dot product (QK-norm, as OLMo-2 / Qwen3)."""
    init_std: float = 0.02
    residual_in_fp32: bool = False
    """Keep the residual stream in fp32 under autocast (HF's behaviour with fp32 weights). False (default): the
    embedding output is cast to the autocast dtype, so residual adds, norms' inputs/outputs and the activations
    saved for backward are bf16, as under FSDP's bf16 parameters (torchtitan, Megatron's default). No effect
    without autocast (CPU fp32 training)."""

    def __post_init__(self) -> None:
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim == 0 and self.mlp == "gelu":
            self.ffn_dim = 4 * self.dim
        elif self.ffn_dim == 0:
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
        choices = {
            "pos_encoding": ("rope", "alibi", "learned"),
            "norm": ("rmsnorm", "layernorm"),
            "mlp": ("swiglu", "gelu"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{prefix}{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.pos_encoding == "rope" and (self.dim // self.n_heads) % 2:
            raise ConfigError(f"{prefix}n_heads: head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.norm_bias and self.norm != "layernorm":
            raise ConfigError(f"{prefix}norm_bias: RMSNorm has no bias; set norm: layernorm or norm_bias: false")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


MPT_OPTIONS: dict[str, Any] = dict(
    pos_encoding="alibi", norm="layernorm", norm_bias=False, mlp="gelu", bias=False, tie_embeddings=True
)
"""The ``TransformerArgs`` options that make an MPT block (``MptForCausalLM``'s computation)."""

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
    # Llama-3.2-1B's shape (meta-llama/Llama-3.2-1B config.json): 1,235,814,400 parameters, tied embeddings.
    "llama-1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=2048,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    # Llama-3.2-3B's shape (meta-llama/Llama-3.2-3B config.json): 3,212,749,824 parameters, tied embeddings.
    "llama-3b": dict(
        vocab_size=128256,
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=2048,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    # MPT (mosaicml/mpt-7b's config.json; LLM Foundry's scripts/train/yamls/pretrain/mpt-*.yaml shapes): ALiBi, no
    # position embeddings, LayerNorm without bias, exact GELU MLP with F = 4·D, no biases, tied embeddings.
    "mpt-debug": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, max_seq_len=256, **MPT_OPTIONS),
    "mpt-125m": dict(vocab_size=50368, dim=768, n_layers=12, n_heads=12, max_seq_len=2048, **MPT_OPTIONS),
    "mpt-350m": dict(vocab_size=50368, dim=1024, n_layers=24, n_heads=16, max_seq_len=2048, **MPT_OPTIONS),
    "mpt-760m": dict(vocab_size=50368, dim=1536, n_layers=24, n_heads=12, max_seq_len=2048, **MPT_OPTIONS),
    "mpt-1b": dict(vocab_size=50368, dim=2048, n_layers=24, n_heads=16, max_seq_len=2048, **MPT_OPTIONS),
    "mpt-3b": dict(vocab_size=50368, dim=2560, n_layers=32, n_heads=20, max_seq_len=2048, **MPT_OPTIONS),
    "mpt-7b": dict(vocab_size=50368, dim=4096, n_layers=32, n_heads=32, max_seq_len=2048, **MPT_OPTIONS),
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
    cos/sin: (T, E) from ``rope_tables``, or (B, T, E) rows of them picked per token (positions restarting at each
    document under document masking). Math in fp32.

    Written as x·cos + swap(x)·sin (swap exchanging the two elements of each pair), bitwise equal to the pairwise form
    (a stack of the rotated halves), with fewer ops per call."""
    x32 = x.float()
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0, x3, x2, ...)
    return (x32 * cos.unsqueeze(-2) + swapped * sin.unsqueeze(-2)).type_as(x)  # (T|B,T, 1, E) over the heads


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
    """Causal self-attention: q/k/v projections, optional per-head QK-norm, the position encoding (RoPE rotation or
    ALiBi bias; nothing for learned positions, added at the embedding), SDPA or flex_attention, output projection.

    ``forward(x, pos_a, pos_b, mask)``: for RoPE the cos/sin tables (T, E), or (B, T, E) under document masking; for
    ALiBi the causal or document-causal mask (a flex_attention ``BlockMask`` on GPUs, ``alibi_distance`` or
    ``document_alibi_distance`` on CPU) and None; for learned positions None, None. ``mask``: None (causal SDPA), or
    for RoPE and learned positions under document masking the document-causal mask (a ``BlockMask`` on GPUs, a
    (B, 1, T, T) bool tensor on CPU: ``layers.masked_attention``). ``alibi_slopes`` (H,) is a buffer so that tensor
    parallelism can keep each rank's heads' slopes."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.pos_encoding = args.pos_encoding
        self.wq = Linear(args.dim, args.n_heads * self.head_dim, bias=args.bias)
        self.wk = Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.bias)
        self.wv = Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.bias)
        self.wo = Linear(args.n_heads * self.head_dim, args.dim, bias=args.bias)
        self.q_norm = make_norm(args.norm, self.head_dim, args.norm_eps, args.norm_bias) if args.qk_norm else None
        self.k_norm = make_norm(args.norm, self.head_dim, args.norm_eps, args.norm_bias) if args.qk_norm else None
        if args.pos_encoding == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(args.n_heads), persistent=False)
        self.native_gqa = args.n_kv_heads != args.n_heads and _native_gqa()  # decided once, outside compiled code

    def forward(self, x: torch.Tensor, pos_a: Any, pos_b: Any, mask: Any = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds H/tp query and K/tp key/value heads. (One GEMM against
        # [wq; wk; wv], and [w1; w3] below, measured slower: docs/history/kernel-and-benchmark-log.md.)
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, E)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, K, E)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.pos_encoding == "rope":
            q, k = apply_rope(q, pos_a, pos_b), apply_rope(k, pos_a, pos_b)
        gqa = {}
        if self.native_gqa:  # query head h reads K/V head h // (H/K), as the expansion below does
            gqa = {"enable_gqa": True}
        elif self.n_kv_heads != self.n_heads:  # expand K/V to H heads: equal head counts suit every SDPA kernel
            repeat, kv = self.n_heads // self.n_kv_heads, k.shape[2]
            k = k.unsqueeze(3).expand(B, T, kv, repeat, self.head_dim).reshape(B, T, -1, self.head_dim)
            v = v.unsqueeze(3).expand(B, T, kv, repeat, self.head_dim).reshape(B, T, -1, self.head_dim)
        # SDPA wants (B, H, T, E); it picks FlashAttention / memory-efficient kernels on CUDA and ROCm.
        if self.pos_encoding == "alibi":
            out = alibi_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.alibi_slopes, pos_a, **gqa
            )
        elif mask is not None:  # document masking: flex_attention (GPUs) or SDPA with a boolean mask (CPU)
            out = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, **gqa)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, **gqa
            )
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU w2(silu(w1 x) * w3 x), or with ``mlp='gelu'`` w2(gelu(w1 x)) (no w3)."""

    def __init__(self, dim: int, hidden: int, mlp: str = "swiglu", bias: bool = False) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=bias)
        self.w3 = Linear(dim, hidden, bias=bias) if mlp == "swiglu" else None
        self.w2 = Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.attention_norm = make_norm(args.norm, args.dim, args.norm_eps, args.norm_bias)
        self.attention = Attention(args)
        self.ffn_norm = make_norm(args.norm, args.dim, args.norm_eps, args.norm_bias)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, args.mlp, args.bias)

    def forward(self, x: torch.Tensor, pos_a: Any, pos_b: Any, mask: Any = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), pos_a, pos_b, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(SamplingMixin, nn.Module):
    """Token ids (B, T) -> logits (B, T, V)."""

    document_eos_id: int | None = None
    """Document masking (``data.document_mask``; the trainer sets it to the data's EOS id): each sequence is split
    into documents at this token (a document ends with it), positions restart at each document start (RoPE angles,
    learned position rows) and attention stays inside the document. None: plain causal attention over the whole
    sequence. Needs token ids at the input, so not on a pipeline stage after the first."""
    sequence_loss: Any = None
    """``parallel.tp_sequence_loss`` (set by the tensor-parallel plan): an ``anytrain.models.llama.parallelize.
    SequenceShardedLoss`` scoring this TP rank's sequence shard of the final hidden states. None: the whole
    sequence on every rank."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        learned = args.pos_encoding == "learned"
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim) if learned else None
        # A ModuleDict keyed by layer index keeps checkpoint keys stable if layers are split across pipeline stages.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = make_norm(args.norm, args.dim, args.norm_eps, args.norm_bias)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.pos_encoding == "rope":
            cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, init_std) for matrices and embeddings; residual output projections scaled by 1/sqrt(2·n_layers)
        (GPT-2); norm weights 1, biases 0. Rebuilds the non-persistent buffers (RoPE tables, ALiBi slopes).

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
            if name.endswith(".bias"):
                nn.init.zeros_(param)
                continue
            generator = None
            if seed is not None:
                generator = torch.Generator(device=param.device)
                generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.normal_(
                0.0,
                deep_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else std,
                generator=generator,
            )
        if self.args.pos_encoding == "rope":
            cos, sin = rope_tables(
                self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device
            )
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        for block in self.layers.values():
            slopes = getattr(block.attention, "alibi_slopes", None)
            if slopes is not None:  # all heads: tensor parallelism slices them after init
                block.attention.alibi_slopes = alibi_slopes(self.args.n_heads).to(slopes.device)

    def position_inputs(self, seq_len: int, device: torch.device) -> tuple[Any, Any]:
        """What every block's attention takes besides x: RoPE's (cos, sin) tables (T, E); for ALiBi the causal mask
        (a flex_attention ``BlockMask`` on GPUs, the (T, T) ``alibi_distance`` elsewhere: ``hardware.is_gpu``) and
        None; for learned positions (None, None)."""
        if self.args.pos_encoding == "rope":
            return self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        if self.args.pos_encoding == "alibi":
            mask = causal_block_mask(seq_len, device) if hardware.is_gpu(device) else alibi_distance(seq_len, device)
            return mask, None
        return None, None

    def document_inputs(self, documents: torch.Tensor, positions: torch.Tensor) -> tuple[Any, Any, Any]:
        """``position_inputs`` under document masking, from (B, T) document ids and in-document positions: the
        blocks' (pos_a, pos_b, mask). RoPE: per-token rows (B, T, E) of the tables at the in-document positions, and
        the document-causal mask; ALiBi: the document-causal mask in place of the causal one (its distances are
        relative, unchanged inside a document), None, None; learned: None, None, the mask. The mask is a
        flex_attention ``BlockMask`` on GPUs (built here, per batch, outside compiled blocks) and an explicit
        (B, 1, T, T) tensor elsewhere (bool; for ALiBi the fp32 distance with -inf off the document)."""
        gpu = hardware.is_gpu(documents.device)
        if self.args.pos_encoding == "alibi":
            return (document_block_mask(documents) if gpu else document_alibi_distance(documents)), None, None
        mask = document_block_mask(documents) if gpu else document_causal_mask(documents)
        if self.args.pos_encoding == "rope":
            return self.rope_cos[positions], self.rope_sin[positions], mask
        return None, None, mask

    def forward_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T), or hidden states (B, T, D) on a pipeline stage without the embedding, through the
        layers this module holds, then the final norm if it holds it."""
        T = x.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.args.max_seq_len {self.args.max_seq_len}")
        positions, mask = None, None
        if self.document_eos_id is None:
            pos_a, pos_b = self.position_inputs(T, x.device)
        elif x.dim() != 2:
            raise ValueError("document masking needs token ids (B, T) at the input, not hidden states (pipeline)")
        else:
            documents, positions = document_ids(x, self.document_eos_id)  # (B, T) each
            pos_a, pos_b, mask = self.document_inputs(documents, positions)
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, D)
        if self.pos_embeddings is not None:  # (1 or B, T, D), on the first pipeline stage
            h = h + self.pos_embeddings(torch.arange(T, device=x.device)[None] if positions is None else positions)
        h = residual_stream(h, self.args.residual_in_fp32)
        for block in self.layers.values():
            h = block(h, pos_a, pos_b, mask=mask)
        return self.norm(h) if self.norm is not None else h

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or with ``targets`` (B, T) the mean next-token loss (a scalar) — the training path,
        which lets the loss avoid materialising full-precision logits."""
        h = self.forward_hidden(tokens)
        if self.output is None:  # a pipeline stage before the last: hidden states go to the next stage
            return h
        if self.sequence_loss is not None:  # parallel.tp_sequence_loss: h is this TP rank's sequence shard
            if targets is not None:
                return self.sequence_loss(h, self.output.weight, targets)
            h = self.sequence_loss.gather(h)
        if targets is not None:
            return lm_cross_entropy(h, self.output.weight, targets)
        return self.output(h)  # (B, T, V)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (shared tensors once). exclude_embedding drops the input tables (tokens, and learned
        positions: lookups, no matmul), keeps the LM head."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
            if self.pos_embeddings is not None:
                total -= self.pos_embeddings.weight.numel()
            if self.args.tie_embeddings:  # the head still does a full V x D matmul
                total += self.output.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N + 12·L·D·T, for every option.

        N = parameters without the input embeddings (LM head included; norm weights and biases counted as the
        convention does); 6 = 2 (forward multiply-add) × 3 (forward + backward w.r.t. inputs and weights). The
        matrices in N per layer: q, o D·D; k, v D·K·E each (GQA / MQA shrink them); SwiGLU 3·D·F, GELU 2·D·F.
        12·L·D·T is attention scores and weighted sum (QKᵀ and AV, 2·2·T·D per token per layer forward, ×3 for
        backward; D = H·E query width, unchanged by GQA), without the causal discount — the PaLM / torchtitan /
        LLM Foundry convention. RoPE, ALiBi and learned positions add no matmul FLOPs (learned positions are a
        lookup, outside N, like the token embedding). Recomputation (activation checkpointing) is not counted:
        that would be HFU.
        """
        return 6.0 * self.num_params(exclude_embedding=True) + 12.0 * self.args.n_layers * self.args.dim * seq_len

    def blocks(self) -> list[nn.Module]:
        """The repeated units that parallelism wraps (FSDP units, checkpointing, compile)."""
        return list(self.layers.values())

    @property
    def hidden_size(self) -> int:
        return self.args.dim
