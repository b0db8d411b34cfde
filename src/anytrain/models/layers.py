"""Building blocks shared by the model families."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from anytrain.models.losses import lm_cross_entropy


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def residual_stream(h: torch.Tensor, keep_fp32: bool) -> torch.Tensor:
    """Hidden states entering the blocks in the residual stream's dtype: the autocast dtype unless ``keep_fp32`` (the
    models' ``residual_in_fp32``) or autocast is off."""
    device_type = h.device.type
    if keep_fp32 or not torch.is_autocast_enabled(device_type):
        return h
    return h.to(torch.get_autocast_dtype(device_type))


class LayerNorm(nn.Module):
    """(x - mean(x)) / sqrt(var(x) + eps) * weight (+ bias), computed in fp32 and cast back to the input dtype (as
    ``RMSNorm``; ``nn.LayerNorm`` under autocast would return fp32). ``bias=False``: no bias parameter (MPT)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def make_norm(kind: str, dim: int, eps: float, bias: bool = False) -> nn.Module:
    """'rmsnorm' -> ``RMSNorm`` (no bias), 'layernorm' -> ``LayerNorm`` with or without ``bias``."""
    return RMSNorm(dim, eps) if kind == "rmsnorm" else LayerNorm(dim, eps, bias)


def alibi_slopes(n_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """ALiBi slopes (H,) in fp32: head h of a power-of-two H gets 2^(-bias_max·(h+1)/H) (Press et al. 2022); other H
    take the odd then even slopes of the next power of two, first H of them — MPT's and transformers'
    ``build_mpt_alibi_tensor`` order, so exported weights mean the same thing there."""
    n_pow2 = 2 ** math.ceil(math.log2(n_heads))
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, n_pow2 + 1, dtype=torch.float32) * (bias_max / n_pow2))
    if n_pow2 != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


def alibi_distance(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, T) fp32: j - i at query i, key j <= i (0 on the diagonal, negative before it), -inf after it (causal).
    slope · this is ALiBi's additive bias; the explicit-bias attention path multiplies it by each head's slope."""
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    dist = pos[None, :] - pos[:, None]  # (T, T): key index minus query index
    return dist.masked_fill(dist > 0, float("-inf"))


_FLEX_ATTENTION: Any = None
_BLOCK_MASKS: dict[tuple[int, str], Any] = {}


def _compiled_flex() -> Any:
    """``flex_attention`` compiled once per process (the fused Triton kernel; eager flex would materialise scores)."""
    global _FLEX_ATTENTION
    if _FLEX_ATTENTION is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX_ATTENTION = torch.compile(flex_attention, dynamic=False)
    return _FLEX_ATTENTION


@torch.compiler.disable
def causal_block_mask(seq_len: int, device: torch.device) -> Any:
    """flex_attention's causal ``BlockMask`` for (T, T), built once per (T, device) and cached (outside compiled
    graphs: the model asks for it before its blocks run)."""
    key = (seq_len, str(device))
    if key not in _BLOCK_MASKS:
        from torch.nn.attention.flex_attention import create_block_mask

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        _BLOCK_MASKS[key] = create_block_mask(causal, None, None, seq_len, seq_len, device=device)
    return _BLOCK_MASKS[key]


def alibi_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, mask: Any, enable_gqa: bool = False
) -> torch.Tensor:
    """Causal attention with ALiBi bias slope_h·(j - i), q (B, H, T, E), k/v (B, K, T, E) -> (B, H, T, E).

    ``mask`` picks the kernel: a flex_attention ``BlockMask`` (``causal_block_mask`` or ``document_block_mask``;
    GPUs) runs compiled flex_attention with the bias as a ``score_mod`` (flash-style tiles, no (T, T) tensor); a
    tensor (``alibi_distance`` (T, T), or ``document_alibi_distance`` (B, 1, T, T); CPU) is scaled by the slopes into
    an explicit (H, T, T) or (B, H, T, T) additive mask for SDPA."""
    if isinstance(mask, torch.Tensor):
        bias = (slopes[:, None, None] * mask).to(q.dtype)  # (H, T, T) or (B, H, T, T); -inf where masked
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=enable_gqa)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=enable_gqa)


# ---------------------------------------------------------------------------------------------------------------------
# Document masking (data.document_mask): attention kept inside each document of a packed sequence.


def document_ids(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) -> (documents, positions), both (B, T) int64. A document ends with its EOS token and the
    token after an EOS starts the next one; the sequence's first token starts document 0 (also when the window
    begins inside a document). ``documents``: the document index of each token within its sequence; ``positions``:
    each token's position inside its document (0 at a document start)."""
    is_eos = (tokens == eos_id).long()
    documents = is_eos.cumsum(1) - is_eos  # an EOS belongs to the document it ends
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)  # (B, T)
    starts = torch.ones_like(is_eos, dtype=torch.bool)
    starts[:, 1:] = is_eos[:, :-1].bool()  # (B, T): True at the first token of each document
    first = torch.where(starts, index, 0).cummax(1).values  # index of the current document's first token
    return documents, index - first


def document_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) bool, True where query i may attend key j: j <= i in the same document.
    SDPA's ``attn_mask`` for the explicit (CPU) path; the diagonal is always True, so no row is empty."""
    T = documents.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def document_alibi_distance(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, 1, T, T) fp32: ``alibi_distance`` with -inf also between documents (ALiBi's
    relative distance needs no reset at a document start: inside one document it is the same as in a lone run)."""
    distance = alibi_distance(documents.shape[1], documents.device)
    return distance.masked_fill(~document_causal_mask(documents), float("-inf"))


@torch.compiler.disable
def document_block_mask(documents: torch.Tensor) -> Any:
    """flex_attention's document-causal ``BlockMask`` for (B, T) document ids: query i attends key j when j <= i and
    both are in the same document. Built per batch, outside compiled graphs (the model builds it before its blocks
    run); tiles wholly across a document boundary are skipped by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = documents.shape

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    return create_block_mask(document_causal, B, None, T, T, device=documents.device)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, enable_gqa: bool = False
) -> torch.Tensor:
    """Attention under an explicit mask, q (B, H, T, E), k/v (B, K, T, E) -> (B, H, T, E). ``mask``: a
    flex_attention ``BlockMask`` (``document_block_mask``; GPUs) runs compiled flex_attention; a bool tensor
    (``document_causal_mask`` (B, 1, T, T); CPU) is SDPA's ``attn_mask``, the reference."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=enable_gqa)


class BackboneLM(nn.Module):
    """The LM around a ``backbone.{embeddings, layers, norm_f}`` + ``lm_head`` layout (Mamba, Mamba-2, the hybrid):
    the head tied to the embedding with ``args.tie_embeddings``, the length check, the head or the fused loss, the
    parameter count, ``blocks()`` and ``hidden_size``. A family sets ``args``, ``backbone`` and ``lm_head`` and
    writes its own ``init_weights`` and ``forward``."""

    args: Any
    backbone: nn.Module
    lm_head: nn.Linear

    def _tie(self) -> None:
        if self.args.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @torch.no_grad()
    def _init_mamba(self) -> None:
        """mamba-ssm's init of the layout (the LM head re-tied first: ``to_empty`` from the meta device gives the two
        names separate tensors): embedding N(0, init_std); each block's norm and mixer reset
        (``mixer.reset_parameters``), out_proj divided by sqrt(L) (``rescale_prenorm_residual``, one residual per
        layer); norm_f to 1; an untied LM head PyTorch's default."""
        self._tie()
        nn.init.normal_(self.backbone.embeddings.weight, std=self.args.init_std)
        for block in self.backbone.layers.values():
            block.norm.reset_parameters()
            block.mixer.reset_parameters()
            block.mixer.out_proj.weight.div_(math.sqrt(self.args.n_layers))
        self.backbone.norm_f.reset_parameters()
        if not self.args.tie_embeddings:
            self.lm_head.reset_parameters()

    def check_length(self, tokens: torch.Tensor) -> None:
        """A ValueError for token ids (B, T) longer than ``args.max_seq_len``."""
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds model.args.max_seq_len {self.args.max_seq_len}"
            )

    def head(self, h: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states (B, T, D) -> logits (B, T, V), or with ``targets`` (B, T) the mean next-token loss
        (a scalar) through the fused linear + cross-entropy, which forms no full-precision logits."""
        if targets is not None:
            return lm_cross_entropy(h, self.lm_head.weight, targets)
        return self.lm_head(h)  # (B, T, V)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (shared tensors once). exclude_embedding drops the input table, keeps the LM head (the
        family's docstring gives its per-layer count)."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_embedding:
            total -= self.backbone.embeddings.weight.numel()
            if self.args.tie_embeddings:  # the head still does a full V x D matmul
                total += self.lm_head.weight.numel()
        return total

    def blocks(self) -> list[nn.Module]:
        """The repeated units that parallelism wraps (FSDP units, checkpointing, compile)."""
        return list(self.backbone.layers.values())

    @property
    def hidden_size(self) -> int:
        return self.args.d_model
