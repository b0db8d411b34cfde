"""What the cost model is asked about: the model's shape, the precision/framework preset, the parallel layout and the
workload. Plain frozen dataclasses (no torch), shared by ``memory`` and ``model``; ``anytrain.cost.model`` re-exports
every name here. A shape comes from a RunConfig (``shape_from_config``), a bare parameter count (``shape_from_params``)
or whichever of those and a flavour name ``anytrain plan --model`` was given (``resolve_model``).

Notation: Ψ parameters, L layers, d width, F FFN width, V vocabulary, s sequence length, b micro-batch,
m micro-batches per step, t/p/n tensor-, pipeline-, data-parallel degrees.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytrain.errors import ConfigError

GIB = 2**30
MIB = 2**20
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zerobubble")  # zerobubble: parallel.pp_schedule InterleavedZeroBubble


class _LanguageModelParams:
    """Parameter counts shared by the shapes: token embedding V·d, LM head (V·d unless tied) + final norm, blocks."""

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """LM head (V·d unless tied) + final norm."""
        return (0 if self.tie_embeddings else self.vocab_size * self.dim) + self.dim

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.n_layers * self.layer_params + self.head_params

    def dense_params(self) -> int:
        """N of 6·N: parameters without the input embedding, the LM head's V·d counted even when tied."""
        return self.num_params - self.embedding_params + (self.vocab_size * self.dim if self.tie_embeddings else 0)

    def block_linears(self) -> list[tuple[int, int]]:
        """(in, out) widths of every block's matmuls, all blocks (each block's ``linears`` L times)."""
        return self.linears() * self.n_layers


@dataclass(frozen=True)
class ModelShape(_LanguageModelParams):
    """Decoder shape. ``mlp``: 'swiglu' (Llama: 3 matrices) or 'gelu' (GPT, MPT: 2). The other options of
    anytrain's Transformer (``TransformerArgs``): ``norm`` 'rmsnorm' | 'layernorm' with ``norm_bias``, ``bias`` on
    the block's linear layers, ``qk_norm`` (E-wide q and k norms), ``pos_encoding`` 'rope' | 'alibi' | 'learned' (a
    learned table of ``max_seq_len``·d counts with the embeddings). ``expand_kv``: K/V heads expanded to
    H before attention, so attention saves full-width K and V; None = what anytrain's Transformer does on the device
    (native grouped-query SDPA on NVIDIA and CPU, expanded on ROCm: ``estimate`` resolves it from the device).
    ``residual_fp32``: the residual stream stays fp32 under autocast (``model.args.residual_in_fp32``; anytrain's
    default is False: bf16 residual)."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    expand_kv: bool | None = None
    name: str = ""
    residual_fp32: bool = False
    norm: str = "rmsnorm"
    norm_bias: bool = False
    bias: bool = False
    qk_norm: bool = False
    pos_encoding: str = "rope"
    max_seq_len: int = 0

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.dim // self.n_heads)

    @property
    def _norm_width(self) -> int:
        """Parameters per normalised element: 1 (scale), 2 with a LayerNorm bias."""
        return 2 if self.norm_bias else 1

    @property
    def layer_params(self) -> int:
        """2·d² (Q, O) + 2·d·d_kv (K, V) + (3 or 2)·d·F (MLP) + 2·d·n (norms; n = 2 with norm_bias, else 1)
        + 2·E·n (QK-norm) + with ``bias``: 2·d + 2·d_kv (attention) + 2·F + d (SwiGLU) or F + d (GELU)."""
        d, f, kv, n = self.dim, self.ffn_dim, self.kv_dim, self._norm_width
        swiglu = self.mlp == "swiglu"
        params = 2 * d * d + 2 * d * kv + (3 if swiglu else 2) * d * f + 2 * d * n
        if self.qk_norm:
            params += 2 * (d // self.n_heads) * n
        if self.bias:
            params += 2 * d + 2 * kv + (2 if swiglu else 1) * f + d
        return params

    @property
    def embedding_params(self) -> int:
        """Token embedding V·d, plus a learned position table max_seq_len·d."""
        return self.vocab_size * self.dim + (self.max_seq_len * self.dim if self.pos_encoding == "learned" else 0)

    @property
    def head_params(self) -> int:
        """LM head (V·d unless tied) + final norm (d, 2·d with norm_bias)."""
        return (0 if self.tie_embeddings else self.vocab_size * self.dim) + self.dim * self._norm_width

    @property
    def norm_stat_bytes(self) -> int:
        """fp32 statistics the two block norms save per token for backward: 1/rms (RMSNorm) or mean and 1/std."""
        return 2 * 4 * (2 if self.norm == "layernorm" else 1)

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) widths of a block's matmuls: q, k, v, o, then the MLP's."""
        d, kv, f = self.dim, self.kv_dim, self.ffn_dim
        mlp = [(d, f), (d, f), (f, d)] if self.mlp == "swiglu" else [(d, f), (f, d)]
        return [(d, d), (d, kv), (d, kv), (d, d), *mlp]

    def fp8_candidates(self) -> list[tuple[int, int]]:
        """The linears ``train.fp8`` may convert (``models/llama/parallelize.fp8_linears``): every block projection."""
        return self.linears()

    @property
    def eager_ops_per_block(self) -> int:
        """Non-view ATen ops one eager block dispatches, forward + backward under autocast (counted with a
        TorchDispatchMode on CPU, tests/unit/test_cost_model.py): the host's work per block and micro-batch."""
        return 121

    def eager_ops(self, seq_len: int) -> int:
        """``eager_ops_per_block`` (independent of the sequence length)."""
        return self.eager_ops_per_block

    def flops_per_token(self, seq_len: int) -> float:
        """6·N + 12·L·d·s with N = parameters without the input embeddings (token and learned-position tables), LM
        head included (as the model's own; position encodings add no matmul FLOPs)."""
        return 6.0 * self.dense_params() + 12.0 * self.n_layers * self.dim * seq_len

    @classmethod
    def from_args(cls, args: object, name: str = "", expand_kv: bool | None = None) -> ModelShape:
        """From anytrain's TransformerArgs (or anything with the same field names)."""
        return cls(
            args.n_layers,
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.ffn_dim,
            args.vocab_size,
            mlp=getattr(args, "mlp", "swiglu"),
            tie_embeddings=bool(getattr(args, "tie_embeddings", False)),
            expand_kv=expand_kv,
            name=name,
            residual_fp32=bool(getattr(args, "residual_in_fp32", False)),
            norm=getattr(args, "norm", "rmsnorm"),
            norm_bias=bool(getattr(args, "norm_bias", False)),
            bias=bool(getattr(args, "bias", False)),
            qk_norm=bool(getattr(args, "qk_norm", False)),
            pos_encoding=getattr(args, "pos_encoding", "rope"),
            max_seq_len=int(getattr(args, "max_seq_len", 0)),
        )


@dataclass(frozen=True)
class MambaShape(_LanguageModelParams):
    """Mamba-1 LM shape for the cost model (anytrain's models/mamba/model.py). E = expand·d inner width, S state size,
    R Δ rank, K conv width. No attention: tensor parallelism is not offered (``n_heads`` = 1 keeps tp = 1).
    ``state_every``: the fused scan saves its fp32 state every ``state_every`` steps (``ScanConfig.chunk_bwd``)."""

    n_layers: int
    dim: int
    d_inner: int
    d_state: int
    dt_rank: int
    d_conv: int
    vocab_size: int
    tie_embeddings: bool = True
    residual_fp32: bool = True
    name: str = ""
    n_heads: int = 1
    n_kv_heads: int = 1
    expand_kv: bool = True
    kind: str = "mamba"
    state_every: int = 8

    @property
    def layer_params(self) -> int:
        """3·D·E + E·(K + 2R + 3S + 3) + D (as ``Mamba.num_params``)."""
        d, e = self.dim, self.d_inner
        return 3 * d * e + e * (self.d_conv + 2 * self.dt_rank + 3 * self.d_state + 3) + d

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) widths of a block's matmuls: in_proj, x_proj, dt_proj, out_proj."""
        d, e = self.dim, self.d_inner
        return [(d, 2 * e), (e, self.dt_rank + 2 * self.d_state), (self.dt_rank, e), (e, d)]

    def fp8_candidates(self) -> list[tuple[int, int]]:
        """The linears ``train.fp8`` may convert (``models/mamba/parallelize.fp8_linears``): in_proj and out_proj."""
        return [(self.dim, 2 * self.d_inner), (self.d_inner, self.dim)]

    @property
    def eager_ops_per_block(self) -> int:
        """Host-side ops of one eager block, forward + backward: the eager RMSNorm and residual (~30 ATen ops) and
        the fused mixer op (~40 launches: weight casts, 4 + 10 GEMMs, conv and scan kernels, buffers)."""
        return 70

    def eager_ops(self, seq_len: int) -> int:
        """``eager_ops_per_block`` (independent of the sequence length)."""
        return self.eager_ops_per_block

    def flops_per_token(self, seq_len: int) -> float:
        """6·N (N without the input embedding, the LM head's V·D counted even when tied) + 3·L·E·(8·S + 10)."""
        del seq_len
        return 6.0 * self.dense_params() + 3.0 * self.n_layers * self.d_inner * (8 * self.d_state + 10)

    @classmethod
    def from_args(cls, args: object, name: str = "") -> MambaShape:
        return cls(
            args.n_layers,
            args.d_model,
            args.expand * args.d_model,
            args.d_state,
            args.dt_rank,
            args.d_conv,
            args.vocab_size,
            bool(args.tie_embeddings),
            bool(args.residual_in_fp32),
            name=name,
        )


@dataclass(frozen=True)
class Mamba2Shape(_LanguageModelParams):
    """Mamba-2 LM shape for the cost model (anytrain's models/mamba2/model.py). E = expand·d inner width, N state
    size, P head dim (H = E / P heads), G groups of B and C, K conv width, Q chunk size of the chunked SSD. No
    attention and no tensor-parallel plan (``n_heads`` = 1 keeps tp = 1); no FP8 candidates (its parallelize plan has
    no ``fp8_linears``)."""

    n_layers: int
    dim: int
    d_inner: int
    d_state: int
    headdim: int
    ngroups: int
    d_conv: int
    chunk_size: int
    vocab_size: int
    tie_embeddings: bool = True
    residual_fp32: bool = True
    name: str = ""
    n_heads: int = 1
    n_kv_heads: int = 1
    expand_kv: bool = True
    kind: str = "mamba2"

    @property
    def nheads(self) -> int:
        """H = E / P."""
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv (x, B, C): E + 2·G·N."""
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def in_proj_dim(self) -> int:
        """Rows of in_proj (z, xBC, dt): 2E + 2·G·N + H."""
        return self.d_inner + self.conv_dim + self.nheads

    @property
    def layer_params(self) -> int:
        """D·(2E + 2GN + H) + (E + 2GN)·(K + 1) + 3H + E + E·D + D (as ``Mamba2.num_params``)."""
        d, e, h = self.dim, self.d_inner, self.nheads
        return d * self.in_proj_dim + self.conv_dim * (self.d_conv + 1) + 3 * h + e + e * d + d

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) widths of a block's matmuls: in_proj and out_proj."""
        return [(self.dim, self.in_proj_dim), (self.d_inner, self.dim)]

    def fp8_candidates(self) -> None:
        """None: ``train.fp8`` is not implemented for Mamba-2 (its ``ParallelizePlan`` has no ``fp8_linears``)."""
        return None

    def chunk(self, seq_len: int) -> int:
        """Q as the SSD runs it: min(chunk_size, seq_len)."""
        return min(self.chunk_size, max(seq_len, 1))

    @property
    def eager_ops_per_block(self) -> int:
        """``eager_ops`` of a one-chunk sequence."""
        return self.eager_ops(0)

    def eager_ops(self, seq_len: int) -> int:
        """Host-side ATen ops of one eager block at sequence length s, forward + backward: 211 + 11 per SSD chunk
        (its state-passing loop), counted with a TorchDispatchMode on CPU with the PyTorch SSD
        (tests/unit/test_cost_mamba2.py); the GPU's Triton SSD dispatches fewer."""
        return 211 + 11 * -(-max(seq_len, 1) // self.chunk(seq_len))

    def ssd_flops_per_token(self, seq_len: int) -> float:
        """6·L·(Q·(G·N + E) + 2·E·N): the chunked SSD's matmuls, forward + backward (``Mamba2.ssd_flops_per_token``:
        C·Bᵀ in its chunk, the masked scores times Δx, each chunk's end state and the entering state read by C)."""
        q = self.chunk(seq_len)
        return (
            6.0 * self.n_layers * (q * (self.ngroups * self.d_state + self.d_inner) + 2 * self.d_inner * self.d_state)
        )

    def flops_per_token(self, seq_len: int) -> float:
        """6·N (N without the input embedding, the LM head's V·D counted even when tied) + the SSD's matmuls
        (``ssd_flops_per_token``), as ``Mamba2.flops_per_token``."""
        return 6.0 * self.dense_params() + self.ssd_flops_per_token(seq_len)

    @classmethod
    def from_args(cls, args: Any, name: str = "") -> Mamba2Shape:
        """From anytrain's Mamba2Args."""
        return cls(
            args.n_layers,
            args.d_model,
            args.expand * args.d_model,
            args.d_state,
            args.headdim,
            args.ngroups,
            args.d_conv,
            args.chunk_size,
            args.vocab_size,
            bool(args.tie_embeddings),
            bool(args.residual_in_fp32),
            name=name,
        )


@dataclass(frozen=True)
class HybridShape(_LanguageModelParams):
    """Hybrid Mamba-2 + attention LM shape (anytrain's models/hybrid/model.py): ``n_layers`` pre-norm blocks, of which
    ``n_mamba`` Mamba-2 blocks (``mamba``: their Mamba2Shape, its ``n_layers`` = n_mamba), ``n_attention`` attention
    blocks (H query / K key-value heads of d / H, no biases) and ``n_mlp`` MLP blocks (``mlp`` 'swiglu' 3 matrices or
    'gelu' 2, width F). The per-block quantities the cost model multiplies by a block count (``layer_params``,
    ``eager_ops``, ``memory.activation_bytes_per_token``) are means over the blocks; what differs by kind
    (``block_linears``, FLOPs, the elementwise and SSD traffic) is summed per kind. No tensor-parallel or FP8 terms
    (``n_heads`` = 1 keeps tp = 1; no FP8 candidates: the family's parallelize plan has no ``fp8_linears``)."""

    n_layers: int
    dim: int
    vocab_size: int
    n_mamba: int
    n_attention: int
    n_mlp: int
    mamba: Mamba2Shape
    attn_heads: int
    attn_kv_heads: int
    ffn_dim: int
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    residual_fp32: bool = False
    name: str = ""
    n_heads: int = 1
    n_kv_heads: int = 1
    expand_kv: bool = True
    kind: str = "hybrid"

    @property
    def kv_dim(self) -> int:
        return self.attn_kv_heads * (self.dim // self.attn_heads)

    def attention_linears(self) -> list[tuple[int, int]]:
        """(in, out) of an attention block's matmuls: q, k, v, o."""
        d, kv = self.dim, self.kv_dim
        return [(d, d), (d, kv), (d, kv), (d, d)]

    def mlp_linears(self) -> list[tuple[int, int]]:
        """(in, out) of an MLP block's matmuls: w1, w3, w2 (SwiGLU) or w1, w2 (GELU)."""
        d, f = self.dim, self.ffn_dim
        return [(d, f), (d, f), (f, d)] if self.mlp == "swiglu" else [(d, f), (f, d)]

    def block_linears(self) -> list[tuple[int, int]]:
        return (
            self.mamba.linears() * self.n_mamba
            + self.attention_linears() * self.n_attention
            + self.mlp_linears() * self.n_mlp
        )

    @property
    def block_params(self) -> int:
        """Parameters of all blocks: each Mamba-2 block's (``Mamba2Shape.layer_params``, its norm included); each
        attention and MLP block its matmuls plus its pre-norm d."""
        attention = sum(k * n for k, n in self.attention_linears()) + self.dim
        mlp = sum(k * n for k, n in self.mlp_linears()) + self.dim
        return self.n_mamba * self.mamba.layer_params + self.n_attention * attention + self.n_mlp * mlp

    @property
    def layer_params(self) -> float:
        """Mean parameters per block (``block_params`` / L)."""
        return self.block_params / self.n_layers

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.block_params + self.head_params

    def fp8_candidates(self) -> None:
        """None: ``train.fp8`` is not implemented for hybrids."""
        return None

    def eager_ops(self, seq_len: int) -> float:
        """Mean host-side ATen ops of one eager block: Mamba-2 blocks as ``Mamba2Shape.eager_ops``, attention and MLP
        blocks half of the Transformer block's 121 each (not counted apart)."""
        ops = self.n_mamba * self.mamba.eager_ops(seq_len) + (self.n_attention + self.n_mlp) * 121 / 2
        return ops / self.n_layers

    @property
    def eager_ops_per_block(self) -> float:
        return self.eager_ops(0)

    def flops_per_token(self, seq_len: int) -> float:
        """6·N + 12·L_A·d·s + the Mamba-2 blocks' SSD matmuls (as ``Hybrid.flops_per_token``)."""
        attention = 12.0 * self.n_attention * self.dim * seq_len
        return 6.0 * self.dense_params() + attention + self.mamba.ssd_flops_per_token(seq_len)

    @classmethod
    def from_args(cls, args: Any, name: str = "") -> HybridShape:
        """From anytrain's HybridArgs."""
        kinds = args.kinds
        n_mamba = kinds.count("M")
        mamba = dataclasses.replace(Mamba2Shape.from_args(args.mamba_args()), n_layers=n_mamba)
        return cls(
            args.n_layers,
            args.d_model,
            args.vocab_size,
            n_mamba,
            kinds.count("A"),
            kinds.count("-"),
            mamba,
            args.attn_heads,
            args.attn_kv_heads,
            args.ffn_dim,
            mlp=args.mlp,
            tie_embeddings=bool(args.tie_embeddings),
            residual_fp32=bool(args.residual_in_fp32),
            name=name,
        )


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each state, the dtypes of activations, and whose training loop it describes.

    ``weight``: the parameter tensors kept (fp32 master under autocast/FSDP, bf16 under Megatron-style mixed
    precision); ``grad``: gradient buffer; ``optimizer``: AdamW m and v (+ the fp32 master copy when weights are
    low precision); ``compute_copy``: bf16 copy of a block's weights that its matmuls use and that is saved for
    backward (autocast's casts inside a compiled block, autocast's weight cache in eager); ``reduce``: dtype of the
    gradient reduction; ``gather``: dtype of FSDP's gathered parameters; ``ddp_bucket``: DDP's bucket copy of the
    gradients (PyTorch DDP without gradient_as_bucket_view); ``nosync_grad``: FSDP's unsharded accumulated gradient
    while gradient sync is off between micro-batches; ``act``: activation bytes; ``residual``: residual-stream bytes
    (a shape with ``residual_fp32`` under ``autocast`` keeps 4); ``autocast``: fp32 weights cast to bf16 per use;
    ``cast``: bytes moved per local parameter per micro-batch by dtype casts (see ``elementwise_seconds``).

    ``framework``: 'anytrain' = this trainer's loop (gradients freed by ``zero_grad(set_to_none=True)``, the chunked
    fused linear + cross-entropy, DTensor tensor parallelism that saves the gathered matmul inputs, an unsplit LM
    head under TP); 'megatron' = Megatron-LM's (persistent gradient buffers, vocab-parallel cross-entropy over full
    logits, sequence parallelism that re-gathers in backward).
    """

    name: str
    weight: float
    grad: float
    optimizer: float
    compute_copy: float = 2.0
    reduce: float = 4.0
    gather: float = 2.0
    ddp_bucket: float = 0.0
    nosync_grad: float = 0.0
    act: int = 2
    residual: int = 2
    cast: float = 0.0
    autocast: bool = False
    framework: str = "anytrain"


# This trainer: fp32 params + autocast bf16 + fp32 AdamW (DDP/single); FSDP2 with bf16 params and fp32 reduction.
AMP = Precision("amp-fp32-master", weight=4, grad=4, optimizer=8, ddp_bucket=4, cast=16, autocast=True)
FSDP_BF16 = Precision("fsdp2-bf16", weight=4, grad=4, optimizer=8, nosync_grad=4, cast=10)
# Megatron-style: bf16 params, fp32 main grads, fp32 master + Adam (12 B, sharded by the distributed optimizer).
MEGATRON = Precision("megatron-bf16", weight=2, grad=4, optimizer=12, compute_copy=0, framework="megatron")
FP32 = Precision("fp32", weight=4, grad=4, optimizer=8, compute_copy=0, reduce=4, gather=4, act=4, residual=4)
PRECISIONS = {p.name: p for p in (AMP, FSDP_BF16, MEGATRON, FP32)}


def trainer_precision(strategy: str) -> Precision:
    """What anytrain's trainer does: FSDP2 casts params to bf16; everything else runs autocast over fp32 params."""
    return FSDP_BF16 if strategy in ("fsdp", "hsdp") else AMP


@dataclass(frozen=True)
class Layout:
    """Parallel degrees and per-device knobs. ``shard``: ZeRO shard-group size (0 = all of dp; < dp is HSDP)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    strategy: str = "ddp"
    shard: int = 0
    micro_batch: int = 1
    ac: str = "none"
    pp_schedule: str = "1f1b"
    pp_chunks: int = 1
    reshard_after_forward: bool = True
    reshard_during_accumulation: bool = True  # FSDP: False keeps parameters gathered across a step's micro-batches

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def keeps_gathered(self, micro_batches: int) -> bool:
        """FSDP with ``reshard_during_accumulation`` off and several micro-batches: the parameters stay gathered from
        the first forward to the last backward of the step (the trainer's pipeline schedules do not use it)."""
        return (
            not self.reshard_during_accumulation
            and micro_batches > 1
            and self.pp == 1
            and self.strategy in ("fsdp", "hsdp")
        )

    def gathers_per_step(self, micro_batches: int) -> int:
        """FSDP parameter all-gathers per step: per micro-batch one in forward and, when resharding after forward,
        one more in backward; one per step when the parameters stay gathered through accumulation."""
        if self.keeps_gathered(micro_batches):
            return 1
        return micro_batches * (2 if self.reshard_after_forward else 1)

    @property
    def shard_size(self) -> int:
        return self.shard or self.dp if self.strategy in ("zero1", "zero2", "fsdp", "hsdp") else 1

    @classmethod
    def from_config(cls, cfg: Any, dims: Any, strategy: str, micro_batch: int) -> Layout:
        """The layout a run trains with: ``cfg`` a RunConfig, ``dims`` its ParallelDims, ``strategy`` the trainer's
        resolved one ('single': one process; 'none': model parallelism only, nothing replicated or sharded; 'fsdp'
        with a replicate degree > 1 is HSDP), ``micro_batch`` the micro-batch it runs."""
        hsdp = strategy == "fsdp" and dims.dp_replicate > 1
        name = "hsdp" if hsdp else {"single": "ddp", "none": "ddp"}.get(strategy, strategy)
        return cls(
            dp=dims.dp_replicate * dims.dp_shard,
            tp=dims.tp,
            pp=dims.pp,
            strategy=name,
            shard=dims.dp_shard if hsdp else 0,
            micro_batch=micro_batch,
            ac=cfg.train.activation_checkpointing,
            pp_schedule={"interleaved1f1b": "interleaved", "interleavedzerobubble": "zerobubble"}.get(
                cfg.parallel.pp_schedule.lower(), cfg.parallel.pp_schedule.lower()
            ),
            pp_chunks=cfg.parallel.pp_virtual_stages,
            reshard_after_forward=cfg.parallel.reshard_after_forward,
            reshard_during_accumulation=cfg.parallel.reshard_during_accumulation,
        )

    @property
    def label(self) -> str:
        parts = [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"pp{self.pp}"] if self.pp > 1 else []
        dp = (
            f"dp{self.dp}"
            if self.strategy != "hsdp"
            else f"dp{self.dp}({self.dp // self.shard_size}x{self.shard_size})"
        )
        name = {"fsdp": "fsdp" if self.reshard_after_forward else "fsdp-noreshard"}.get(self.strategy, self.strategy)
        return "·".join([*parts, dp]) + f" {name}"


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int  # sequences per optimizer step
    tokens: float = 0.0  # training tokens; 0 = 20·Ψ (Chinchilla)
    compiled: bool = True  # torch.compile'd blocks save fewer activations (see activation_bytes_per_token)
    cuda_graphs: bool = False  # train.cuda_graphs: one process replays each micro-batch from a graph (host_seconds)
    overlap: float = 0.8  # fraction of the overlap window in which data-parallel traffic hides
    fragmentation: float = 0.05
    overhead_gib: float = 1.0  # CUDA/HIP context, NCCL buffers: outside the allocator (not in its peak)
    ddp_bucket_mib: float = 100.0  # parallel.ddp_bucket_mb (DDP's bucket cap); torch.compile splits blocks at buckets
    ddp_bucket_view: bool = False  # parallel.ddp_bucket_view: gradients are DDP's buckets, zeroed in place, kept
    grad_compression: str = "none"  # parallel.grad_compression: none | bf16 | fp16 | powersgd:rank=R
    fp8: str = "none"  # train.fp8: none | tensorwise | rowwise | rowwise_with_gw_hp (cost/fp8.py)
    fp8_filter: str = "auto"  # train.fp8_filter: auto | aligned
    tp_sequence_loss: bool = False  # parallel.tp_sequence_loss: the LM head and loss on each TP rank's sequence shard
    # (where a layout can run it: sequence_loss_applies)
    ssd_kernel: str = "triton"  # Mamba-2's SSD: 'triton' (GPU tensors) or 'torch' (the PyTorch twin, CPU tensors)

    @classmethod
    def from_config(cls, cfg: Any, **fields: Any) -> Workload:
        """A run config's sequence length, global batch, compile and CUDA-graph switches, DDP bucket size and bucket
        views, gradient compression, FP8 recipe and filter and the TP sequence-sharded loss, plus ``fields``."""
        base = dict(
            compiled=cfg.train.compile,
            cuda_graphs=cfg.train.cuda_graphs,
            ddp_bucket_mib=cfg.parallel.ddp_bucket_mb,
            ddp_bucket_view=cfg.parallel.ddp_bucket_view,
            grad_compression=cfg.parallel.grad_compression,
            fp8=cfg.train.fp8,
            fp8_filter=cfg.train.fp8_filter,
            tp_sequence_loss=cfg.parallel.tp_sequence_loss,
        )
        return cls(cfg.data.seq_len, cfg.train.global_batch, **{**base, **fields})


def gradient_matrices(shape: ModelShape | MambaShape | Mamba2Shape) -> list[tuple[int, int]]:
    """(rows, columns) of every weight matrix: each block's linears (out x in) L times, the token embedding and the
    LM head (V x d; one matrix when tied). The other parameters (norms, biases, Mamba's conv, A_log, D) are vectors
    or thin matrices that PowerSGD sends whole."""
    blocks = [(n_out, n_in) for n_in, n_out in shape.block_linears()]
    return blocks + [(shape.vocab_size, shape.dim)] * (1 if shape.tie_embeddings else 2)


def powersgd_fraction(shape: ModelShape | MambaShape | Mamba2Shape, rank: int) -> float:
    """Values PowerSGD all-reduces per step / parameters: a matrix n x m goes as its rank-r factors P (n x r) and
    Q (m x r), (n + m)·r values with r = min(n, m, rank), where that is less than half of n·m (PyTorch's
    min_compression_rate 2), else whole; everything else whole (``gradient_matrices``)."""
    values = shape.num_params
    for n, m in gradient_matrices(shape):
        r = min(n, m, rank)
        if 2 * (n + m) * r < n * m:
            values -= n * m - (n + m) * r
    return values / shape.num_params


def gradient_reduce_bytes(
    shape: ModelShape | MambaShape | Mamba2Shape, prec: Precision, grad_compression: str, strategy: str
) -> float:
    """Bytes per gradient value in the data-parallel reduction: ``prec.reduce`` uncompressed, 2 for bf16 / fp16,
    4 × ``powersgd_fraction`` for PowerSGD (fp32 factors; DDP and ZeRO-1 only, as in the trainer)."""
    from anytrain.config import parse_grad_compression

    kind, rank = parse_grad_compression(grad_compression)
    if kind in ("bf16", "fp16"):
        return 2.0
    if kind == "powersgd":
        if strategy not in ("ddp", "zero1"):
            raise ConfigError(
                f"parallel.grad_compression: powersgd runs with ddp or zero1 only (PyTorch has no "
                f"PowerSGD for FSDP), not {strategy}"
            )
        return 4.0 * powersgd_fraction(shape, rank)
    return prec.reduce


def shape_from_config(cfg: object) -> ModelShape | MambaShape | Mamba2Shape | HybridShape:
    """Shape of the model a RunConfig builds, read from its resolved args (exact parameter count as built)."""
    from anytrain.models import resolve_args

    name = f"{cfg.model.arch}/{cfg.model.flavour}"
    if cfg.model.arch not in ("transformer", "mamba", "mamba2", "hybrid"):
        raise ConfigError(
            f"model.arch: the cost model covers transformer, mamba, mamba2 and hybrid models, not {cfg.model.arch!r}"
        )
    args = resolve_args(cfg.model)
    if cfg.model.arch == "mamba":
        return MambaShape.from_args(args, name=name)
    if cfg.model.arch == "mamba2":
        return Mamba2Shape.from_args(args, name=name)
    if cfg.model.arch == "hybrid":
        return HybridShape.from_args(args, name=name)
    return ModelShape.from_args(args, name=name)


# Published shapes for bare parameter counts: (layers, hidden, heads, mlp, ffn, vocab).
KNOWN_SHAPES: dict[float, tuple[int, int, int, str, int, int]] = {
    175e9: (96, 12288, 96, "gelu", 4 * 12288, 51200),  # GPT-3 175B
    1e12: (128, 25600, 160, "gelu", 4 * 25600, 51200),  # Megatron / ORNL 1T
}


def parse_count(text: str) -> float:
    """'7e9', '7B', '175b', '1.3T', '350M' -> a float number of parameters."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not match:
        raise ConfigError(f"--model: {text!r} is neither a config file, a flavour, nor a parameter count like 7e9")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2)]
    return float(match.group(1)) * scale


def shape_from_params(
    params: float,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int = 32000,
) -> ModelShape:
    """A Llama-style shape with about ``params`` parameters. Published shapes for 175B and 1T (GPT); otherwise
    hidden = (128·Ψ/12)^(1/3) rounded to 128 (GPT-3's d/L ≈ 128), L = Ψ/(12·d²), and the SwiGLU width solves
    Ψ = 2·V·d + L·(4·d² + 3·d·F)."""
    for known, (kl, kd, kh, mlp, kf, kv) in KNOWN_SHAPES.items():
        if abs(params / known - 1) < 0.02 and layers in (None, kl) and hidden in (None, kd):
            return ModelShape(
                kl,
                kd,
                heads or kh,
                kv_heads or heads or kh,
                ffn or kf,
                kv,
                mlp=mlp,
                expand_kv=False,
                name=f"GPT {params / 1e12:g}T" if params >= 1e12 else f"GPT {params / 1e9:g}B",
            )
    if hidden is None:
        hidden = max(128, 128 * round((128 * params / 12) ** (1 / 3) / 128))
    if layers is None:
        layers = max(1, round(params / (12 * hidden * hidden)))
    heads = heads or max(1, hidden // 128)
    if hidden % heads:
        raise ConfigError(f"--heads: {heads} does not divide --hidden {hidden}")
    kv_heads = kv_heads or heads
    if ffn is None:
        body = params - 2 * vocab * hidden - layers * (2 * hidden * hidden + 2 * hidden * hidden * kv_heads // heads)
        ffn = 64 * math.ceil(body / (3 * layers * hidden) / 64) if body > 0 else 0
        if ffn <= 0:
            raise ConfigError(
                f"--model: {params:.3g} parameters is too few for --layers {layers} --hidden {hidden} "
                f"(embeddings and attention alone exceed it)"
            )
    return ModelShape(layers, hidden, heads, kv_heads, ffn, vocab, name=f"{params / 1e9:.3g}B")


def resolve_model(
    model: str,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    kv_heads: int | None,
    ffn: int | None,
    vocab: int,
) -> tuple[ModelShape, object | None]:
    """(shape, RunConfig or None) from ``--model``: a config YAML (the RunConfig comes back too), a flavour name, or a
    parameter count (``7e9``, ``175B``) shaped by ``shape_from_params`` with the optional layers / hidden / ..."""
    from anytrain.config import ModelConfig, RunConfig, load_config
    from anytrain.data.resolve import resolve_run_config
    from anytrain.models import TRANSFORMER_FLAVOURS

    if model.endswith((".yaml", ".yml")) or Path(model).is_file():
        cfg = resolve_run_config(load_config(model))
        return shape_from_config(cfg), cfg
    if model in TRANSFORMER_FLAVOURS:
        cfg = RunConfig(model=ModelConfig(flavour=model))
        return shape_from_config(cfg), None
    return shape_from_params(parse_count(model), layers, hidden, heads, kv_heads, ffn, vocab), None


def plan_workload(
    cfg: Any | None,
    gpus: int | None,
    seq: int | None,
    global_batch: int | None,
    tokens: float | None,
    compiled: bool,
    grad_compression: str | None,
    fp8: str | None = None,
) -> Workload:
    """``anytrain plan``'s workload: its options over the config's values (a bare model: seq 2048, a global batch of
    max(--gpus, 8) sequences, or about 4 Mi tokens per step when sizing the job; ``fp8``: --fp8, else the config's
    train.fp8 and train.fp8_filter)."""
    from anytrain.config import parse_grad_compression

    seq_len = seq or (cfg.data.seq_len if cfg else 2048)
    batch = global_batch or (cfg.train.global_batch if cfg else max(gpus, 8) if gpus else max(1, 2**22 // seq_len))
    graphs = bool(cfg and cfg.train.cuda_graphs)  # train.cuda_graphs: one device or TP alone replays graphs
    compression = grad_compression or (cfg.parallel.grad_compression if cfg else "none")
    try:
        parse_grad_compression(compression)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("parallel.grad_compression", "--grad-compression")) from None
    bucket = (
        {"ddp_bucket_mib": cfg.parallel.ddp_bucket_mb, "ddp_bucket_view": cfg.parallel.ddp_bucket_view} if cfg else {}
    )
    recipe = fp8 or (cfg.train.fp8 if cfg else "none")
    fp8_filter = cfg.train.fp8_filter if cfg else "auto"
    return Workload(
        seq_len,
        batch,
        tokens=tokens or 0.0,
        compiled=compiled,
        cuda_graphs=graphs,
        grad_compression=compression,
        fp8=recipe,
        fp8_filter=fp8_filter,
        tp_sequence_loss=bool(cfg and cfg.parallel.tp_sequence_loss),
        **bucket,
    )


def sequence_loss_applies(layout: Any, wl: Workload) -> bool:
    """``parallel.tp_sequence_loss`` in effect for this layout: TP without pipeline stages (the trainer refuses it with
    pp > 1, and a layout without TP has no sequence shards)."""
    return wl.tp_sequence_loss and layout.tp > 1 and layout.pp == 1
