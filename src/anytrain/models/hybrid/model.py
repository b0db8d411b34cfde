"""Hybrid Mamba-2 + attention language model: a stack of Mamba-2, attention and MLP blocks in the order a layer
pattern gives (Bamba, Nemotron-H, Zamba-style hybrids without experts or shared blocks).

Single-device ``nn.Module`` only: parallelism is applied from outside (``anytrain.parallel`` with this family's
``parallelize.py``). The blocks' insides are the other families' modules, not copies: the Mamba-2 mixer and block of
``models/mamba2`` and the attention (GQA, RoPE) and MLP (SwiGLU or GELU) of ``models/llama``.

``layers_pattern`` has one character per block, each a pre-norm residual unit ``h + f(RMSNorm(h))``::

    M      Mamba-2 block: f = Mamba2Mixer (in_proj, conv, SSD, gated RMSNorm, out_proj)
    A, *   attention block: f = causal GQA self-attention, with RoPE (optionally on a fraction of each head) or none
    -      MLP block: f = SwiGLU (or GELU) MLP

These are Megatron-Core's hybrid symbols (``hybrid_override_pattern``: M, *, -), so a Nemotron-H pattern is taken as
it is; ``A`` is the same block as ``*``. A Bamba layer (mixer then MLP, two norms, two residuals) is two blocks:
``M-`` or ``A-``.

State-dict keys::

    backbone.embeddings.weight                          (V, D)
    backbone.layers.{i}.norm.weight                     (D,)   every block's pre-norm
    backbone.layers.{i}.mixer.*                         M: the Mamba-2 mixer's names (models/mamba2/model.py)
    backbone.layers.{i}.attention.w{q,k,v,o}.weight     A: (H·E, D), (K·E, D), (K·E, D), (D, H·E)
    backbone.layers.{i}.feed_forward.w{1,3,2}.weight    -: (F, D), (F, D), (D, F)  (no w3 for GELU)
    backbone.norm_f.weight                              (D,)
    lm_head.weight                                      (V, D)   the embedding itself when tied

Shapes in comments: B batch, T sequence, D model width, V vocab, H/K query/key-value heads of E = D / H, F MLP width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from anytrain import hardware
from anytrain.errors import ConfigError
from anytrain.models.layers import (
    BackboneLM,
    RMSNorm,
    document_block_mask,
    document_causal_mask,
    document_ids,
    residual_stream,
)
from anytrain.models.llama.model import Attention, FeedForward, TransformerArgs, rope_tables
from anytrain.models.mamba2.model import Mamba2Args, Mamba2Block, ssd_layer_flops
from anytrain.models.sampling import SamplingMixin

MAMBA, ATTENTION, MLP = "M", "A", "-"
BLOCK_SYMBOLS = {"M": MAMBA, "A": ATTENTION, "*": ATTENTION, "-": MLP}
"""Pattern character -> block kind (``*`` is Megatron-Core's / Nemotron-H's symbol for attention)."""


@dataclass
class HybridArgs:
    vocab_size: int = 8192
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    d_model: int = 256
    """Model width D."""
    layers_pattern: str = "M-M-A-M-"
    """The blocks, one character each, in order: 'M' a Mamba-2 block, 'A' (or '*') an attention block, '-' an MLP
    block; each is h + f(RMSNorm(h)). Megatron-Core's / Nemotron-H's ``hybrid_override_pattern`` strings are taken as
    they are; a Bamba layer is two blocks ('M-' or 'A-'). Its length is the block count (``n_layers``), over which
    pipeline stages split."""
    mamba_d_state: int = 128
    """SSM state size N of each Mamba-2 head (Mamba2Args.d_state)."""
    mamba_d_conv: int = 4
    """Causal depthwise convolution width (2..4)."""
    mamba_expand: int = 2
    """Mamba-2 inner width E = mamba_expand·D."""
    mamba_headdim: int = 64
    """Mamba-2 head dimension P (E / P heads, each with its own decay A, skip D and Δ bias)."""
    mamba_ngroups: int = 1
    """Groups of the Mamba-2 B and C projections (heads per group share one); must divide the head count."""
    mamba_chunk_size: int = 256
    """Chunk length of the chunked SSD (speed and memory only, never the function computed)."""
    mamba_dt_min: float = 0.001
    """Smallest initial Δ of the Mamba-2 heads (dt_bias init, as Mamba2Args.dt_min)."""
    mamba_dt_max: float = 0.1
    """Largest initial Δ."""
    mamba_dt_init_floor: float = 1e-4
    """Lower clamp of the sampled initial Δ."""
    mamba_a_init_min: float = 1.0
    """-A starts uniform in [mamba_a_init_min, mamba_a_init_max] per head."""
    mamba_a_init_max: float = 16.0
    """Upper end of the initial range of -A."""
    attn_heads: int = 8
    """Query heads H of the attention blocks; D must be divisible by H (head dim E = D / H)."""
    attn_kv_heads: int = 0
    """Key/value heads K (grouped-query attention); 0 = attn_heads. attn_heads must be divisible by K."""
    attn_pos_encoding: Literal["rope", "none"] = "rope"
    """Position information in the attention blocks: 'rope' rotates q and k (Bamba), 'none' adds nothing (Jamba,
    Nemotron-H: the Mamba-2 blocks carry the order)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_fraction: float = 1.0
    """Fraction of each head's dims that RoPE rotates (the first rope_fraction·E; the rest pass unrotated): 1.0 all,
    0.5 Bamba's partial rotary. rope_fraction·E must be a positive even integer."""
    ffn_dim: int = 0
    """MLP hidden width F; 0 = 8/3·D rounded up to a multiple of 64 for SwiGLU, 4·D for GELU."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP blocks: 'swiglu' w2(silu(w1 x) · w3 x) or 'gelu' w2(gelu(w1 x))."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (the blocks' pre-norms, the Mamba-2 gated norm, the final norm)."""
    residual_in_fp32: bool = False
    """Keep the residual stream in fp32 under mixed precision (each block adds its output to an fp32 stream). False
    (default, as Bamba and Megatron-Core's hybrids): the stream is in the autocast dtype. No effect in fp32."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head."""
    init_std: float = 0.02
    """Std of the normal init of the embedding, the attention and MLP matrices (and an untied LM head)."""
    max_seq_len: int = 4096
    """Longest sequence: what the RoPE tables cover; bounds data.seq_len."""

    def __post_init__(self) -> None:
        if self.attn_kv_heads == 0:
            self.attn_kv_heads = self.attn_heads
        if self.ffn_dim == 0 and self.mlp == "gelu":
            self.ffn_dim = 4 * self.d_model
        elif self.ffn_dim == 0:
            self.ffn_dim = 64 * math.ceil(int(8 * self.d_model / 3) / 64)

    def validate(self, prefix: str = "model.args.") -> None:
        bad = sorted(set(self.layers_pattern) - set(BLOCK_SYMBOLS))
        if not self.layers_pattern or bad:
            raise ConfigError(
                f"{prefix}layers_pattern: expected a non-empty string of M (Mamba-2), A or * (attention) and - (MLP), "
                f"got {self.layers_pattern!r}"
            )
        for name in ("vocab_size", "d_model", "attn_heads", "attn_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be > 0, got {getattr(self, name)}")
        for name in ("norm_eps", "init_std"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be > 0, got {getattr(self, name)}")
        if self.has(MAMBA):
            try:  # the Mamba-2 family's checks, naming the hybrid's mamba_ field
                self.mamba_args().validate(prefix)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace(prefix, prefix + "mamba_", 1)) from None
        if self.has(ATTENTION):
            attention = self.attention_args()
            if self.d_model % self.attn_heads:
                raise ConfigError(f"{prefix}attn_heads: {self.attn_heads} does not divide d_model {self.d_model}")
            if self.attn_heads % self.attn_kv_heads:
                raise ConfigError(
                    f"{prefix}attn_kv_heads: {self.attn_kv_heads} does not divide attn_heads {self.attn_heads}"
                )
            rotary = self.rope_fraction * attention.head_dim
            if self.attn_pos_encoding == "rope" and not (
                0 < self.rope_fraction <= 1 and rotary == int(rotary) and int(rotary) % 2 == 0
            ):
                raise ConfigError(
                    f"{prefix}rope_fraction: {self.rope_fraction} of head dim {attention.head_dim} must be a "
                    "positive even number of dims (0 < rope_fraction <= 1)"
                )
        choices = {"attn_pos_encoding": ("rope", "none"), "mlp": ("swiglu", "gelu")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{prefix}{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")

    @property
    def kinds(self) -> list[str]:
        """The block kinds in order (MAMBA, ATTENTION or MLP per pattern character)."""
        return [BLOCK_SYMBOLS[c] for c in self.layers_pattern]

    @property
    def n_layers(self) -> int:
        """Blocks in the stack (the pattern's length): what pipeline stages split and FSDP wraps one by one."""
        return len(self.layers_pattern)

    def has(self, kind: str) -> bool:
        return kind in self.kinds

    @property
    def rotary_dim(self) -> int:
        """Dims of each attention head that RoPE rotates (0 without RoPE)."""
        if self.attn_pos_encoding != "rope":
            return 0
        return int(self.rope_fraction * (self.d_model // self.attn_heads))

    def mamba_args(self) -> Mamba2Args:
        """The Mamba-2 family's args that the M blocks are built from (their layer count is that of the M blocks)."""
        return Mamba2Args(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=max(self.kinds.count(MAMBA), 1),
            d_state=self.mamba_d_state,
            d_conv=self.mamba_d_conv,
            expand=self.mamba_expand,
            headdim=self.mamba_headdim,
            ngroups=self.mamba_ngroups,
            chunk_size=self.mamba_chunk_size,
            dt_min=self.mamba_dt_min,
            dt_max=self.mamba_dt_max,
            dt_init_floor=self.mamba_dt_init_floor,
            a_init_min=self.mamba_a_init_min,
            a_init_max=self.mamba_a_init_max,
            norm_eps=self.norm_eps,
            residual_in_fp32=self.residual_in_fp32,
            tie_embeddings=self.tie_embeddings,
            init_std=self.init_std,
            max_seq_len=self.max_seq_len,
        )

    def attention_args(self) -> TransformerArgs:
        """The Transformer family's args that the A and - blocks are built from (RMSNorm, no biases, no QK-norm).
        Without RoPE the attention is given ``pos_encoding='learned'``, for which the Transformer's attention applies
        no position encoding itself (its table is added at the embedding, which the hybrid does not have)."""
        return TransformerArgs(
            vocab_size=self.vocab_size,
            dim=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.attn_heads,
            n_kv_heads=self.attn_kv_heads,
            ffn_dim=self.ffn_dim,
            max_seq_len=self.max_seq_len,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            pos_encoding="rope" if self.attn_pos_encoding == "rope" else "learned",
            mlp=self.mlp,
            init_std=self.init_std,
        )


class MambaLayer(Mamba2Block):
    """M: h + Mamba2Mixer(RMSNorm(h)), the Mamba-2 family's block (its residual dtype handling included)."""

    kind = MAMBA

    def forward(self, h: torch.Tensor, rope: Any = None, mask: Any = None, seq_idx: Any = None) -> torch.Tensor:
        return super().forward(h, seq_idx)

    @torch.no_grad()
    def reset_parameters(self, out_scale: float) -> None:
        self.norm.reset_parameters()
        self.mixer.reset_parameters()
        self.mixer.out_proj.weight.mul_(out_scale)


class _ResidualLayer(nn.Module):
    """h + f(RMSNorm(h)), the residual add in fp32 with ``residual_in_fp32`` (the norm's input then cast to the
    parameters' dtype, as ``Mamba2Block`` does)."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.residual_in_fp32 = args.residual_in_fp32
        self.norm = RMSNorm(args.d_model, args.norm_eps)

    def residual(self, h: torch.Tensor, f) -> torch.Tensor:
        if not self.residual_in_fp32:
            return h + f(self.norm(h))
        return h.float() + f(self.norm(h.to(self.norm.weight.dtype)))


class AttentionLayer(_ResidualLayer):
    """A: h + Attention(RMSNorm(h)) with the Transformer's attention (GQA; RoPE from the backbone's tables)."""

    kind = ATTENTION

    def __init__(self, args: HybridArgs) -> None:
        super().__init__(args)
        self.attention = Attention(args.attention_args())

    def forward(self, h: torch.Tensor, rope: Any = None, mask: Any = None, seq_idx: Any = None) -> torch.Tensor:
        cos, sin = rope if rope is not None else (None, None)
        return self.residual(h, lambda x: self.attention(x, cos, sin, mask=mask))

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        self.norm.reset_parameters()
        for linear in (self.attention.wq, self.attention.wk, self.attention.wv):
            nn.init.normal_(linear.weight, std=std)
        nn.init.normal_(self.attention.wo.weight, std=out_std)


class MLPLayer(_ResidualLayer):
    """-: h + FeedForward(RMSNorm(h)) with the Transformer's MLP."""

    kind = MLP

    def __init__(self, args: HybridArgs) -> None:
        super().__init__(args)
        self.feed_forward = FeedForward(args.d_model, args.ffn_dim, args.mlp)

    def forward(self, h: torch.Tensor, rope: Any = None, mask: Any = None, seq_idx: Any = None) -> torch.Tensor:
        return self.residual(h, self.feed_forward)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        self.norm.reset_parameters()
        for linear in (self.feed_forward.w1, self.feed_forward.w3):
            if linear is not None:
                nn.init.normal_(linear.weight, std=std)
        nn.init.normal_(self.feed_forward.w2.weight, std=out_std)


def partial_rope_tables(args: HybridArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (T, E) for ``apply_rope`` that rotate the first ``rotary_dim`` dims of each head (pairs at angles
    t·theta^(-2i/rotary_dim)) and pass the rest through unchanged (cos 1, sin 0: x·1 + swap(x)·0 = x exactly)."""
    head_dim, rotary = args.d_model // args.attn_heads, args.rotary_dim
    cos, sin = rope_tables(rotary, args.max_seq_len, args.rope_theta, device)  # (T, R) each
    rest = head_dim - rotary
    if rest:
        cos = torch.cat([cos, cos.new_ones(args.max_seq_len, rest)], dim=-1)
        sin = torch.cat([sin, sin.new_zeros(args.max_seq_len, rest)], dim=-1)
    return cos, sin


_LAYERS = {MAMBA: lambda args: MambaLayer(args.mamba_args()), ATTENTION: AttentionLayer, MLP: MLPLayer}


class HybridBackbone(nn.Module):
    """Embeddings, the pattern's blocks and the final norm under ``backbone.`` (as the Mamba families), plus the RoPE
    tables (non-persistent buffers) that every attention block reads."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.d_model)
        # A ModuleDict keyed "0", "1", ... keeps the keys of the whole model on a pipeline stage.
        self.layers = nn.ModuleDict({str(i): _LAYERS[kind](args) for i, kind in enumerate(args.kinds)})
        self.norm_f = RMSNorm(args.d_model, args.norm_eps)
        self.residual_in_fp32 = args.residual_in_fp32
        self.has_attention = args.has(ATTENTION)
        cos, sin = partial_rope_tables(args) if args.has(ATTENTION) and args.rotary_dim else (None, None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE tables' first ``seq_len`` rows, (T, E) each; None without RoPE."""
        return None if self.rope_cos is None else (self.rope_cos[:seq_len], self.rope_sin[:seq_len])

    def forward(self, tokens: torch.Tensor, eos_id: int | None = None) -> torch.Tensor:
        """Token ids (B, T) -> hidden states (B, T, D); with ``eos_id`` every row is split into documents there."""
        documents, positions = (None, None) if eos_id is None else document_ids(tokens, eos_id)  # (B, T) each
        h = self.stream(self.embeddings(tokens))  # (B, T, D)
        return self.final_norm(self.run_layers(h, documents, positions))

    def run_layers(
        self, h: torch.Tensor, documents: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states (B, T, D) through the blocks this module holds. Every block takes (h, rope, mask, seq_idx):
        attention blocks the RoPE tables and the attention mask, Mamba-2 blocks the per-token document index."""
        rope, mask = self.layer_inputs(h.shape[1], documents, positions)
        for block in self.layers.values():
            h = block(h, rope, mask, documents)
        return h

    def layer_inputs(
        self, seq_len: int, documents: torch.Tensor | None, positions: torch.Tensor | None
    ) -> tuple[Any, Any]:
        """(rope, mask) for the attention blocks: the tables' first ``seq_len`` rows (T, E) and None (plain causal
        attention); under document masking ((B, T) document ids and in-document positions) the tables' rows at the
        positions (B, T, E) and the document-causal mask: a flex_attention ``BlockMask`` on GPUs (built here, per
        batch, outside compiled blocks), an explicit (B, 1, T, T) bool tensor elsewhere."""
        if documents is None:
            return self.rope(seq_len), None
        if not self.has_attention:
            return None, None
        gpu = hardware.is_gpu(documents.device)
        mask = document_block_mask(documents) if gpu else document_causal_mask(documents)
        rope = None if self.rope_cos is None else (self.rope_cos[positions], self.rope_sin[positions])
        return rope, mask

    def stream(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream's dtype for hidden states entering the blocks."""
        return residual_stream(h, self.residual_in_fp32)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """norm_f, in the parameters' dtype with the fp32 stream, in the stream's own dtype otherwise."""
        return self.norm_f(h.to(self.norm_f.weight.dtype) if self.residual_in_fp32 else h)  # (B, T, D)


class Hybrid(SamplingMixin, BackboneLM):
    """Token ids (B, T) -> logits (B, T, V) through the blocks of ``args.layers_pattern`` (one block per pattern
    symbol: ``blocks()``).

    Parameters (``num_params``) per block, with D·(…) the norm's D extra: M as ``Mamba2``'s layer; A D·H·E + 2·D·K·E
    + H·E·D; - 3·D·F (SwiGLU) or 2·D·F (GELU). Model: V·D + the blocks + D (norm_f) + V·D when the head is untied."""

    document_eos_id: int | None = None
    """Document masking (``data.document_mask``; the trainer sets it to the data's EOS id): each row is split into
    documents at this token (a document ends with it); attention stays inside each document with RoPE positions
    restarting at its start, and every Mamba-2 block's conv window and SSD state restart there, so a document's
    outputs are those it would have alone. None: one document per row."""

    def __init__(self, args: HybridArgs) -> None:
        super().__init__()
        self.args = args
        self.backbone = HybridBackbone(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self._tie()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter, drawing in module order from the global generator (seeded with ``seed``
        first when given): a pipeline stage's weights come from initialising the whole model.

        Embedding N(0, init_std); M blocks as the Mamba-2 family (``Mamba2Mixer.reset_parameters``); attention q/k/v
        and MLP w1/w3 N(0, init_std); every block's output projection (out_proj, wo, w2) scaled by 1/sqrt(L), L the
        block count (one residual add per block: mamba-ssm's rescale and GPT-2's 1/sqrt(2·layers) for two blocks a
        layer); norms 1; an untied head N(0, init_std). Re-ties the head (``to_empty`` unties it) and rebuilds the
        RoPE tables (non-persistent buffers).
        """
        if seed is not None:
            torch.manual_seed(seed)
        self._tie()
        a = self.args
        std, scale = a.init_std, 1.0 / math.sqrt(a.n_layers)
        nn.init.normal_(self.backbone.embeddings.weight, std=std)
        for block in self.backbone.layers.values():
            if block.kind == MAMBA:
                block.reset_parameters(scale)
            else:
                block.reset_parameters(std, std * scale)
        self.backbone.norm_f.reset_parameters()
        if not a.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        if self.backbone.rope_cos is not None:
            cos, sin = partial_rope_tables(a, self.backbone.rope_cos.device)
            self.backbone.rope_cos.copy_(cos)
            self.backbone.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or with ``targets`` (B, T) the mean next-token loss (a scalar)."""
        self.check_length(tokens)
        return self.head(self.backbone(tokens, self.document_eos_id), targets)  # backbone: (B, T, D)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N + 12·L_A·D·T + L_M · 6·(Q·(G·N_s + E_m) + 2·E_m·N_s).

        6·N as the other families (N without the input embedding, LM head included; 6 = 2 multiply-add × 3 forward +
        backward); L_A attention blocks add the Transformer's 12·D·T (QKᵀ and AV over the full query width H·E = D,
        no causal discount); L_M Mamba-2 blocks add the SSD's chunked matmuls (``mamba2.model.ssd_layer_flops``,
        Q = min(chunk_size, T)). Norms, activations and recomputation are not counted.
        """
        a, kinds = self.args, self.args.kinds
        attention = 12.0 * kinds.count(ATTENTION) * a.d_model * seq_len
        ssd = kinds.count(MAMBA) * ssd_layer_flops(a.mamba_args(), seq_len)
        return 6.0 * self.num_params(exclude_embedding=True) + attention + ssd


def bamba_pattern(n_layers: int, attention: tuple[int, ...]) -> str:
    """The pattern of a Bamba stack: ``n_layers`` layers, each a mixer (attention at the ``attention`` indices,
    Mamba-2 elsewhere) followed by an MLP block."""
    return "".join(("A" if i in attention else "M") + "-" for i in range(n_layers))


HYBRID_FLAVOURS: dict[str, dict[str, Any]] = {
    # For unit and multi-process tests: every block kind, builds and steps in milliseconds (several chunks at seq 32).
    "debug": dict(
        vocab_size=512,
        d_model=64,
        layers_pattern="M-A-",
        mamba_d_state=16,
        mamba_headdim=16,
        mamba_chunk_size=8,
        attn_heads=4,
        attn_kv_heads=2,
        ffn_dim=128,
        max_seq_len=256,
    ),
    # The CPU demo model: 4 Bamba layers (attention third), d 256, 8k vocabulary, tied: 5,170,448 parameters.
    "tiny-hybrid": dict(
        vocab_size=8192,
        d_model=256,
        layers_pattern=bamba_pattern(4, (2,)),
        mamba_d_state=64,
        mamba_headdim=32,
        mamba_chunk_size=64,
        attn_heads=8,
        attn_kv_heads=4,
        rope_fraction=0.5,
        ffn_dim=512,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # Bamba-9B's layout (ibm-ai-platform/Bamba-9B config.json: 32 layers, attention at layers 9, 18 and 27, every
    # layer a mixer then a SwiGLU MLP of 3.5·D; Mamba-2 heads of 64, state 128, one group, expand 2, conv 4, chunk
    # 256; attention heads of 128 with 4 query heads per key-value head, RoPE on half of each head; untied; a
    # 128,256-token vocabulary) at width 1280 instead of 4096, so 10 query heads on 2 key-value heads:
    # 1,187,272,600 parameters.
    "1.2b": dict(
        vocab_size=128256,
        d_model=1280,
        layers_pattern=bamba_pattern(32, (9, 18, 27)),
        mamba_d_state=128,
        mamba_headdim=64,
        attn_heads=10,
        attn_kv_heads=2,
        rope_fraction=0.5,
        ffn_dim=4480,
        max_seq_len=4096,
    ),
}
