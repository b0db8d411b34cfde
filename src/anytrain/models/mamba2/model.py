"""Mamba-2 language model (Dao & Gu 2024), numerically the same as HF ``Mamba2ForCausalLM`` (its names, but pieces).

Single-device ``nn.Module`` only: parallelism is applied from outside (``anytrain.parallel`` with this family's
``parallelize.py``). The causal depthwise conv comes from ``anytrain.kernels`` (Triton on GPU tensors, its PyTorch
twin on CPU), the SSD from ``anytrain.kernels.ssd``.

The mixer (mamba-ssm's ``Mamba2`` without its optional MLP part, d_ssm = E)::

    in_proj: h (B, T, D) -> z (E) | xBC (E + 2·G·N) | dt (H)
    xBC -> causal depthwise conv (width K) + SiLU -> x (H, P) | B (G, N) | C (G, N)
    y = SSD(x, dt, A = -exp(A_log), B, C; D skip, Δ = softplus(dt + dt_bias))         (B, T, H, P)
    out_proj(gated RMSNorm(y · silu(z)))  (the norm over each group's E / G channels: norm_before_gate false)

State-dict keys are HF's but for in_proj and conv1d, held one piece per parameter (``hf.py`` stacks them)::

    backbone.embeddings.weight                      (V, D)
    backbone.layers.{i}.norm.weight                 (D,)
    backbone.layers.{i}.mixer.dt_bias               (H,)
    backbone.layers.{i}.mixer.A_log                 (H,)   A = -exp(A_log), one scalar decay per head
    backbone.layers.{i}.mixer.D                     (H,)
    backbone.layers.{i}.mixer.conv_{x,B,C}.weight   (E | GN | GN, 1, K)   HF: conv1d.weight, the three stacked
    backbone.layers.{i}.mixer.conv_{x,B,C}.bias     (E | GN | GN,)
    backbone.layers.{i}.mixer.in_proj_{z,x,B,C,dt}.weight  (E | E | GN | GN | H, D)  HF: in_proj.weight, stacked
    backbone.layers.{i}.mixer.norm.weight           (E,)
    backbone.layers.{i}.mixer.out_proj.weight       (D, E)
    backbone.norm_f.weight                          (D,)
    lm_head.weight                                  (V, D)   the embedding itself when tied

Shapes in comments: B batch, T sequence, D model width, E inner width (expand·D), H heads (E / P), P head dim,
G groups of B and C, N state size (d_state), K conv width, V vocab, L layers, Q chunk size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from anytrain.errors import ConfigError
from anytrain.kernels.ssd import causal_conv1d_documents, ssd_chunk_scan
from anytrain.models.layers import BackboneLM, RMSNorm, document_ids, residual_stream
from anytrain.models.sampling import SamplingMixin


@dataclass
class Mamba2Args:
    vocab_size: int = 8192
    """Embedding rows; must be >= the tokenizer's vocabulary (kept as given, not padded)."""
    d_model: int = 256
    """Model width D (HF: hidden_size)."""
    n_layers: int = 8
    """Number of Mamba-2 blocks L (HF: num_hidden_layers)."""
    d_state: int = 128
    """SSM state size N per head (HF: state_size)."""
    d_conv: int = 4
    """Causal depthwise convolution width K (the kernels support 2..4)."""
    expand: int = 2
    """Inner width E = expand·D."""
    headdim: int = 64
    """Head dimension P; the mixer has H = E / P heads, each with its own decay A, skip D and Δ bias (HF: head_dim)."""
    ngroups: int = 1
    """Groups G of the input-dependent B and C (H / G heads share one), as key/value groups in GQA (HF: n_groups)."""
    chunk_size: int = 256
    """Chunk length Q of the chunked SSD: quadratic attention-like work inside a chunk, a state passed between
    chunks. Changes speed and memory only, never the function computed (HF: chunk_size)."""
    dt_min: float = 0.001
    """Smallest initial Δ (dt_bias is inverse-softplus of Δ sampled log-uniformly in [dt_min, dt_max])."""
    dt_max: float = 0.1
    """Largest initial Δ."""
    dt_init_floor: float = 1e-4
    """Lower clamp of the sampled initial Δ."""
    a_init_min: float = 1.0
    """A = -exp(A_log) starts uniform in -[a_init_min, a_init_max] per head (mamba-ssm's A_init_range)."""
    a_init_max: float = 16.0
    """Upper end of the initial range of -A."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms, the gated one included (HF: layer_norm_epsilon)."""
    residual_in_fp32: bool = True
    """Keep each block's residual addition in fp32 under mixed precision (mamba-ssm / HF default). False: under
    autocast the residual stream, the norms' inputs and outputs are in the autocast dtype (as the Transformer's
    default); no effect in fp32 training."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head (the released Mamba-2 checkpoints do)."""
    init_std: float = 0.02
    """Std of the normal init of the token embedding."""
    max_seq_len: int = 4096
    """Longest sequence accepted. Mamba-2 has no positional table; this only bounds data.seq_len and the window that
    ``generate`` re-reads."""

    def validate(self, prefix: str = "model.args.") -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "d_state",
            "expand",
            "headdim",
            "ngroups",
            "chunk_size",
            "max_seq_len",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be > 0, got {getattr(self, name)}")
        if self.d_inner % self.headdim:
            raise ConfigError(
                f"{prefix}headdim: must divide the inner width expand·d_model = {self.d_inner}, got {self.headdim}"
            )
        if self.nheads % self.ngroups:
            raise ConfigError(
                f"{prefix}ngroups: must divide the head count {self.nheads} (expand·d_model / "
                f"headdim), got {self.ngroups}"
            )
        if not 2 <= self.d_conv <= 4:
            raise ConfigError(f"{prefix}d_conv: the causal conv kernels support widths 2..4, got {self.d_conv}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ConfigError(f"{prefix}dt_min: need 0 < dt_min <= dt_max, got {self.dt_min} and {self.dt_max}")
        if not 0 < self.a_init_min <= self.a_init_max:
            raise ConfigError(
                f"{prefix}a_init_min: need 0 < a_init_min <= a_init_max, got {self.a_init_min} and {self.a_init_max}"
            )
        for name in ("dt_init_floor", "norm_eps", "init_std"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be > 0, got {getattr(self, name)}")

    @property
    def d_inner(self) -> int:
        """E = expand·D."""
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        """H = E / P."""
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C, E + 2·G·N."""
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def in_proj_dim(self) -> int:
        """Rows of in_proj: z, xBC and dt, 2E + 2·G·N + H."""
        return self.d_inner + self.conv_dim + self.nheads


# The released state-spaces/mamba2-* shapes: vocab 50277 padded to a multiple of 16 (mamba-ssm's
# pad_vocab_size_multiple), d_state 128, headdim 64, expand 2, one group, conv 4, chunk 256, tied embeddings.
_RELEASED = dict(vocab_size=50288)
MAMBA2_FLAVOURS: dict[str, dict[str, Any]] = {
    # For unit and multi-process tests: builds and steps in milliseconds (several chunks at seq 32).
    "debug": dict(vocab_size=512, d_model=64, n_layers=2, d_state=16, headdim=16, chunk_size=8),
    # The CPU demo model (~5.6M parameters with an 8k tied vocabulary, ~3.5M of them in the 8 layers).
    "tiny-mamba2": dict(vocab_size=8192, d_model=256, n_layers=8, d_state=64, headdim=32, chunk_size=64),
    "130m": dict(**_RELEASED, d_model=768, n_layers=24),
    "370m": dict(**_RELEASED, d_model=1024, n_layers=48),
    "780m": dict(**_RELEASED, d_model=1536, n_layers=48),
    "1.3b": dict(**_RELEASED, d_model=2048, n_layers=48),
    "2.7b": dict(**_RELEASED, d_model=2560, n_layers=64),
}


def ssd_layer_flops(args: Mamba2Args, seq_len: int) -> float:
    """Training FLOPs per token of one mixer's chunked SSD matmuls: 6·(Q·(G·N + E) + 2·E·N), Q = min(chunk_size,
    seq_len).

    Forward, per token: C·Bᵀ inside its chunk, 2·Q·G·N (the full Q x Q block, no causal discount); the masked scores
    times Δx, 2·Q·H·P = 2·Q·E; its contribution to the chunk's end state, 2·E·N; the entering state read through C,
    2·E·N. ×3 for forward + backward (the matmuls' 6 = 2·3). The state passing between chunks (2·E·N per chunk, not
    per token), the decays' exp and segment sums, the softplus, the D skip and the gate are elementwise and not
    counted.
    """
    Q = min(args.chunk_size, max(seq_len, 1))
    return 6.0 * (Q * (args.ngroups * args.d_state + args.d_inner) + 2 * args.d_inner * args.d_state)


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter as the forward uses it: itself on one device (``Mamba2Mixer.local`` under tensor parallelism)."""
    return param


class GatedRMSNorm(nn.Module):
    """norm(y · silu(z)) · weight, the RMS taken over each of G groups of E / G channels (HF ``MambaRMSNormGated``,
    mamba-ssm's ``RMSNormGated`` with norm_before_gate false); fp32 inside, returned in y's dtype.

    Under tensor parallelism (set from outside) ``local`` gives this rank's channels of the weight and, when one group
    spans the ranks (G = 1), ``sum_over_ranks`` sums each token's squares over them."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.group_size, self.eps = dim // groups, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.local: Callable[[torch.Tensor], torch.Tensor] = _whole
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z (B, T, E) -> (B, T, E) (E / tp channels of each under tensor parallelism)."""
        gated = y.float() * F.silu(z.float())
        if self.sum_over_ranks is None:
            grouped = gated.unflatten(-1, (-1, self.group_size))  # (B, T, G, E / G)
            normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        else:  # the one group's squares summed over the TP ranks' channels
            square_sum = self.sum_over_ranks(gated.pow(2).sum(-1, keepdim=True))  # (B, T, 1)
            normed = gated * torch.rsqrt(square_sum / self.group_size + self.eps)
        return (normed * self.local(self.weight).float()).to(y.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class _StackedLinear(torch.autograd.Function):
    """F.linear(h, cat(weights)) as one GEMM that saves the pieces, not their concatenation: the stacked weight is made
    again in backward, so a step keeps no extra weight-sized copy (under autocast it saves the bf16 casts of h and
    of the pieces, as F.linear on one weight saves autocast's casts)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        device = h.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            h, weights = h.to(dtype), tuple(w.to(dtype) for w in weights)
        ctx.save_for_backward(h, *weights)
        with torch.autocast(device, enabled=False):
            return F.linear(h, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, *weights = ctx.saved_tensors
        grad = grad.to(h.dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])  # (B·T, rows)
        grad_h = grad_2d.mm(torch.cat(weights)).view(*grad.shape[:-1], h.shape[-1])  # (B, T, D)
        grad_w = grad_2d.t().mm(h.reshape(-1, h.shape[-1]))  # (rows, D)
        grads_w = grad_w.split([w.shape[0] for w in weights])
        return grad_h, *grads_w


def stacked_linear(h: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """h (..., D) @ cat(weights)ᵀ: one GEMM over weights held apart (``_StackedLinear``)."""
    return _StackedLinear.apply(h, *weights)


IN_PROJ_SEGMENTS = ("z", "x", "B", "C", "dt")
"""The pieces of HF's ``in_proj`` rows, in its order: ``in_proj_{z,x,B,C,dt}`` (E, E, G·N, G·N, H rows)."""
CONV_SEGMENTS = ("x", "B", "C")
"""The pieces of HF's ``conv1d`` channels, in its order: ``conv_{x,B,C}`` (E, G·N, G·N channels)."""


def in_proj_rows(args: Mamba2Args) -> list[int]:
    """Rows of in_proj_z, _x, _B, _C, _dt: E, E, G·N, G·N, H."""
    gn = args.ngroups * args.d_state
    return [args.d_inner, args.d_inner, gn, gn, args.nheads]


def conv_channels(args: Mamba2Args) -> list[int]:
    """Channels of conv_x, _B, _C: E, G·N, G·N."""
    gn = args.ngroups * args.d_state
    return [args.d_inner, gn, gn]


class Mamba2Mixer(nn.Module):
    """The Mamba-2 SSM layer: in_proj -> conv + SiLU over x, B, C -> SSD (per-head A, D, Δ bias + softplus) -> gated
    RMSNorm -> out_proj. Same computation as mamba-ssm's ``Mamba2.forward`` and HF ``Mamba2Mixer`` without caches.

    HF's ``in_proj`` (rows z, x, B, C, dt) and ``conv1d`` (channels x, B, C) are held as one parameter per piece
    (``in_proj_z`` ... ``in_proj_dt``, ``conv_x`` ... ``conv_C``; Megatron-Core's split), so that tensor parallelism
    can shard each piece over heads (or groups) as one DTensor dimension and a checkpoint loads at any TP degree;
    the forward concatenates the weights back into one GEMM and one conv (``models/mamba2/hf.py`` stacks them for
    HF). ``local`` (identity on one device) is how the forward reads every parameter but out_proj's: the tensor-
    parallel plan sets it to this rank's shard."""

    def __init__(self, args: Mamba2Args) -> None:
        super().__init__()
        self.args = args
        D, E, H, K = args.d_model, args.d_inner, args.nheads, args.d_conv
        self.local: Callable[[torch.Tensor], torch.Tensor] = _whole
        # state_dict lists a module's own parameters before its submodules', as for HF's Mamba2Mixer.
        self.dt_bias = nn.Parameter(torch.empty(H))  # (H,) Δ bias, added before the softplus
        self.A_log = nn.Parameter(torch.empty(H))  # (H,) A = -exp(A_log) < 0
        self.D = nn.Parameter(torch.empty(H))  # (H,) skip connection
        for name, channels in zip(CONV_SEGMENTS, conv_channels(args), strict=True):  # depthwise: (C, 1, K), (C,)
            self.add_module(f"conv_{name}", nn.Conv1d(channels, channels, K, groups=channels, bias=True))
        for name, rows in zip(IN_PROJ_SEGMENTS, in_proj_rows(args), strict=True):  # (rows, D) each
            self.add_module(f"in_proj_{name}", nn.Linear(D, rows, bias=False))
        self.norm = GatedRMSNorm(E, args.ngroups, args.norm_eps)
        self.out_proj = nn.Linear(E, D, bias=False)

    def in_proj_weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"in_proj_{name}").weight for name in IN_PROJ_SEGMENTS]

    def convs(self) -> list[nn.Conv1d]:
        return [getattr(self, f"conv_{name}") for name in CONV_SEGMENTS]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba-ssm's init (everything but the 1/sqrt(L) rescale of out_proj, which ``Mamba2.init_weights`` does):
        in_proj and conv1d PyTorch's defaults drawn for the whole stacked tensors (as one module each) and cut into
        the pieces, so the weights of a seed are those of the unsplit layer."""
        args, H, device, dtype = self.args, self.args.nheads, self.dt_bias.device, self.dt_bias.dtype
        conv = torch.empty(args.conv_dim, 1, args.d_conv, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(conv, a=math.sqrt(5))  # nn.Conv1d.reset_parameters: fan_in = K
        conv_bias = torch.empty(args.conv_dim, device=device, dtype=dtype).uniform_(
            -1 / math.sqrt(args.d_conv), 1 / math.sqrt(args.d_conv)
        )
        for module, w, b in zip(
            self.convs(), conv.split(conv_channels(args)), conv_bias.split(conv_channels(args)), strict=True
        ):
            module.weight.copy_(w)
            module.bias.copy_(b)
        in_proj = torch.empty(args.in_proj_dim, args.d_model, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(in_proj, a=math.sqrt(5))  # nn.Linear.reset_parameters
        for weight, rows in zip(self.in_proj_weights(), in_proj.split(in_proj_rows(args)), strict=True):
            weight.copy_(rows)
        self.out_proj.reset_parameters()
        log_min, log_max = math.log(args.dt_min), math.log(args.dt_max)
        dt = torch.exp(torch.rand(H, device=device) * (log_max - log_min) + log_min).clamp(min=args.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        self.A_log.copy_(torch.empty(H, device=device).uniform_(args.a_init_min, args.a_init_max).log())
        nn.init.ones_(self.D)
        self.norm.reset_parameters()

    def forward(self, h: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """h (B, T, D) -> (B, T, D); ``seq_idx`` (B, T) document ids keep each document's conv window and state to
        itself (None: one document per row). Under tensor parallelism E, H and G below are this rank's share."""
        a, local = self.args, self.local
        Bsz, T, _ = h.shape
        weights = [local(w) for w in self.in_proj_weights()]
        rows = [w.shape[0] for w in weights]  # E, E, GN, GN, H
        E, GN, H, N = rows[0], rows[2], rows[4], a.d_state
        # one GEMM for the five pieces (their weights are what HF's in_proj stacks)
        z, xBC, dt = stacked_linear(h, weights).split([E, E + 2 * GN, H], dim=-1)  # (B, T, E|E + 2GN|H)
        convs = self.convs()
        conv_weight = torch.cat([local(c.weight) for c in convs]).squeeze(1)  # (E + 2GN, K)
        conv_bias = torch.cat([local(c.bias) for c in convs])
        xBC = causal_conv1d_documents(xBC.transpose(1, 2), conv_weight, conv_bias, seq_idx, "silu")
        x, B, C = xBC.transpose(1, 2).split([E, GN, GN], dim=-1)  # (B, T, E), (B, T, GN), (B, T, GN)
        y = ssd_chunk_scan(
            x.unflatten(-1, (H, a.headdim)),
            dt,
            -torch.exp(local(self.A_log).float()),
            B.unflatten(-1, (GN // N, N)),
            C.unflatten(-1, (GN // N, N)),
            a.chunk_size,
            D=local(self.D),
            dt_bias=local(self.dt_bias),
            dt_softplus=True,
            seq_idx=seq_idx,
        )
        return self.out_proj(self.norm(y.reshape(Bsz, T, E), z))  # (B, T, D)


class Mamba2Block(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)) (HF ``Mamba2Block``; the residual add is in fp32 by default)."""

    def __init__(self, args: Mamba2Args) -> None:
        super().__init__()
        self.residual_in_fp32 = args.residual_in_fp32
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        self.mixer = Mamba2Mixer(args)

    def forward(self, h: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        if not self.residual_in_fp32:  # the stream's own dtype throughout (bf16 under autocast)
            return h + self.mixer(self.norm(h), seq_idx)
        # Cast to the parameters' dtype first (bf16 under FSDP mixed precision, else fp32) as HF does.
        return h.float() + self.mixer(self.norm(h.to(self.norm.weight.dtype)), seq_idx)


class Mamba2Backbone(nn.Module):
    """Holds embeddings, layers and the final norm under ``backbone.`` (HF ``Mamba2Model``)."""

    def __init__(self, args: Mamba2Args) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.d_model)
        # A ModuleDict keyed "0", "1", ... gives the same keys as HF's ModuleList (backbone.layers.{i}.*).
        self.layers = nn.ModuleDict({str(i): Mamba2Block(args) for i in range(args.n_layers)})
        self.norm_f = RMSNorm(args.d_model, args.norm_eps)
        self.residual_in_fp32 = args.residual_in_fp32

    def forward(self, tokens: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        h = self.stream(self.embeddings(tokens))  # (B, T, D)
        for block in self.layers.values():
            h = block(h, seq_idx)
        return self.final_norm(h)

    def stream(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream's dtype for hidden states entering the layers (see ``MambaBackbone.stream``)."""
        return residual_stream(h, self.residual_in_fp32)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """norm_f, in the parameters' dtype with the fp32 stream (as HF), in the stream's own dtype otherwise."""
        return self.norm_f(h.to(self.norm_f.weight.dtype) if self.residual_in_fp32 else h)  # (B, T, D)


class Mamba2(SamplingMixin, BackboneLM):
    """Token ids (B, T) -> logits (B, T, V). The Mamba-2 LM of mamba-ssm's ``MambaLMHeadModel`` (ssm_cfg layer
    Mamba2, no attention layers, no MLP).

    Parameters (``num_params``) per layer: D·(2E + 2GN + H) (in_proj) + (E + 2GN)·(K + 1) (conv) + 3H (dt_bias,
    A_log, D) + E (gated norm) + E·D (out_proj) + D (norm). Model: V·D + L·layer + D (norm_f) + V·D when the head is
    untied."""

    document_eos_id: int | None = None
    """Document masking (``data.document_mask``; the trainer sets it to the data's EOS id): each row is split into
    documents at this token (a document ends with it) and every mixer's conv window and SSD state restart at each
    document start, so a document's outputs are those it would have alone. None: one document per row."""

    def __init__(self, args: Mamba2Args) -> None:
        super().__init__()
        self.args = args
        self.backbone = Mamba2Backbone(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self._tie()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter as mamba-ssm does, drawing in module order from the global generator
        (seeded with ``seed`` first when given): a pipeline stage's weights come from initialising the whole model.

        Embedding N(0, init_std); in_proj / conv1d PyTorch defaults; dt_bias, A_log, D as in
        ``Mamba2Mixer.reset_parameters``; out_proj default init divided by sqrt(L) (mamba-ssm's
        ``rescale_prenorm_residual`` with one residual per layer); norms to 1; an untied LM head PyTorch's default.
        Re-ties the LM head first, because ``to_empty`` from the meta device gives the two names separate tensors.
        """
        if seed is not None:
            torch.manual_seed(seed)
        self._init_mamba()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or with ``targets`` (B, T) the mean next-token loss (a scalar) — the training path,
        which lets the loss avoid materialising full-precision logits."""
        self.check_length(tokens)
        seq_idx = None if self.document_eos_id is None else document_ids(tokens, self.document_eos_id)[0]  # (B, T)
        return self.head(self.backbone(tokens, seq_idx), targets)  # backbone: (B, T, D)

    def ssd_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the chunked SSD's matmuls over the L layers: L · ``ssd_layer_flops``."""
        return self.args.n_layers * ssd_layer_flops(self.args, seq_len)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N + 6·L·(Q·(G·N + E) + 2·E·N), Q = min(chunk_size, seq_len).

        N = parameters without the input embedding (LM head included); 6 = 2 (forward multiply-add) × 3 (forward +
        backward w.r.t. inputs and weights). 6·N covers in_proj, out_proj and the LM head, and the depthwise conv
        (each of its weights is one multiply-add per token); the vector parameters (dt_bias, A_log, D, norms,
        conv bias) are inside N too, as the convention counts them. The second term is the SSD's matmul work (see
        ``ssd_flops_per_token``): linear in the sequence, with a per-token cost that grows with the chunk length up
        to chunk_size. Norms, SiLU and recomputation (activation checkpointing) are not counted.
        """
        return 6.0 * self.num_params(exclude_embedding=True) + self.ssd_flops_per_token(seq_len)
