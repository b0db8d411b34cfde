"""Mamba-1 language model (Gu & Dao 2023), numerically and by state-dict names the same as HF ``MambaForCausalLM``.

Single-device ``nn.Module`` only: parallelism is applied from outside (``anytrain.parallel`` with this family's
``parallelize.py``). The selective scan and the causal depthwise conv come from ``anytrain.kernels`` (Triton on GPU
tensors, the PyTorch reference on CPU).

State-dict keys equal HF's (export is a rename-free copy)::

    backbone.embeddings.weight                      (V, D)
    backbone.layers.{i}.norm.weight                 (D,)
    backbone.layers.{i}.mixer.A_log                 (E, S)   fp32 in mamba-ssm; A = -exp(A_log)
    backbone.layers.{i}.mixer.D                     (E,)
    backbone.layers.{i}.mixer.conv1d.{weight,bias}  (E, 1, K), (E,)
    backbone.layers.{i}.mixer.in_proj.weight        (2E, D)
    backbone.layers.{i}.mixer.x_proj.weight         (R + 2S, E)
    backbone.layers.{i}.mixer.dt_proj.{weight,bias} (E, R), (E,)
    backbone.layers.{i}.mixer.out_proj.weight       (D, E)
    backbone.norm_f.weight                          (D,)
    lm_head.weight                                  (V, D)   the embedding itself when tied

Shapes in comments: B batch, T sequence, D model width, E inner width (expand·D), S SSM state size (d_state),
R dt rank, K conv width, V vocab, L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from anytrain.errors import ConfigError
from anytrain.kernels import causal_conv1d, selective_scan
from anytrain.kernels.mamba_inner import mamba_inner_triton, mixer_composition, use_mamba_inner
from anytrain.models.layers import BackboneLM, RMSNorm, residual_stream
from anytrain.models.sampling import SamplingMixin


@dataclass
class MambaArgs:
    vocab_size: int = 8192
    """Embedding rows; must be >= the tokenizer's vocabulary (kept as given, not padded)."""
    d_model: int = 256
    """Model width D (HF: hidden_size)."""
    n_layers: int = 8
    """Number of Mamba blocks L (HF: num_hidden_layers)."""
    d_state: int = 16
    """SSM state size S per channel (HF: state_size)."""
    d_conv: int = 4
    """Causal depthwise convolution width K (the kernels support 2..4)."""
    expand: int = 2
    """Inner width E = expand·D."""
    dt_rank: int = 0
    """Rank R of the Δ projection; 0 = ceil(D / 16) as in mamba-ssm ('auto')."""
    dt_min: float = 0.001
    """Smallest initial Δ (the dt_proj bias is inverse-softplus of Δ sampled log-uniformly in [dt_min, dt_max])."""
    dt_max: float = 0.1
    """Largest initial Δ."""
    dt_init_floor: float = 1e-4
    """Lower clamp of the sampled initial Δ."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (HF: layer_norm_epsilon)."""
    residual_in_fp32: bool = True
    """Keep each block's residual addition in fp32 under mixed precision (mamba-ssm / HF default). False: under
    autocast the embedding output takes the autocast dtype, so the residual stream, the norms' inputs and outputs
    and their saved activations are bf16 (as under FSDP's bf16 parameters, and as the Transformer's default); no
    effect in fp32 training; with bf16 parameters (FSDP) it only drops the blocks' fp32 upcast of the residual."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head (all released Mamba checkpoints do)."""
    init_std: float = 0.02
    """Std of the normal init of the token embedding."""
    max_seq_len: int = 4096
    """Longest sequence accepted. Mamba has no positional table; this only bounds data.seq_len and the window that
    ``generate`` re-reads."""

    def __post_init__(self) -> None:
        if self.dt_rank == 0:
            self.dt_rank = math.ceil(self.d_model / 16)

    def validate(self, prefix: str = "model.args.") -> None:
        for name in ("vocab_size", "d_model", "n_layers", "d_state", "expand", "dt_rank", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be > 0, got {getattr(self, name)}")
        if not 2 <= self.d_conv <= 4:
            raise ConfigError(f"{prefix}d_conv: the causal conv kernels support widths 2..4, got {self.d_conv}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ConfigError(f"{prefix}dt_min: need 0 < dt_min <= dt_max, got {self.dt_min} and {self.dt_max}")
        if not 0 < self.dt_init_floor:
            raise ConfigError(f"{prefix}dt_init_floor: must be > 0, got {self.dt_init_floor}")
        for name in ("norm_eps", "init_std"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be > 0, got {getattr(self, name)}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model


MAMBA_FLAVOURS: dict[str, dict[str, Any]] = {
    # For unit and multi-process tests: builds and steps in milliseconds.
    "debug": dict(vocab_size=512, d_model=64, n_layers=2, d_state=8),
    # The CPU demo model (~5.6M parameters with an 8k tied vocabulary, ~3.5M of them in the 8 layers).
    "tiny-mamba": dict(vocab_size=8192, d_model=256, n_layers=8, d_state=16),
    # The released state-spaces/mamba-* shapes (vocab 50277 padded to a multiple of 8 by mamba-ssm).
    "130m": dict(vocab_size=50280, d_model=768, n_layers=24, d_state=16),
    "370m": dict(vocab_size=50280, d_model=1024, n_layers=48, d_state=16),
    "1.4b": dict(vocab_size=50280, d_model=2048, n_layers=48, d_state=16),
}


class MambaMixer(nn.Module):
    """The selective SSM: in_proj -> causal conv + SiLU -> input-dependent (Δ, B, C) -> scan (D skip, SiLU(z) gate)
    -> out_proj. Same computation as mamba-ssm's ``Mamba.forward`` without the inference cache."""

    def __init__(self, args: MambaArgs) -> None:
        super().__init__()
        D, E, S, R, K = args.d_model, args.d_inner, args.d_state, args.dt_rank, args.d_conv
        self.args = args
        # state_dict lists a module's own parameters (A_log, D) before its submodules', as for HF's MambaMixer.
        self.A_log = nn.Parameter(torch.empty(E, S))  # (E, S); A = -exp(A_log) < 0
        self.D = nn.Parameter(torch.empty(E))  # (E,) skip connection
        self.conv1d = nn.Conv1d(E, E, kernel_size=K, groups=E, padding=K - 1, bias=True)  # weight (E, 1, K)
        self.in_proj = nn.Linear(D, 2 * E, bias=False)
        self.x_proj = nn.Linear(E, R + 2 * S, bias=False)
        self.dt_proj = nn.Linear(R, E, bias=True)  # the bias is Δ's bias, applied inside the scan (pre-softplus)
        self.out_proj = nn.Linear(E, D, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba-ssm's init (everything but the 1/sqrt(L) rescale of out_proj, which ``Mamba.init_weights`` does)."""
        args, E, S = self.args, self.args.d_inner, self.args.d_state
        # Linear / conv layers: PyTorch's default (kaiming-uniform) init, as mamba-ssm leaves them.
        for module in (self.conv1d, self.in_proj, self.x_proj, self.out_proj):
            module.reset_parameters()
        # Δ projection: weight U(-R^-0.5, R^-0.5); bias = softplus^-1(Δ0), Δ0 log-uniform in [dt_min, dt_max].
        dt_std = args.dt_rank**-0.5
        nn.init.uniform_(self.dt_proj.weight, -dt_std, dt_std)
        device = self.dt_proj.bias.device
        log_min, log_max = math.log(args.dt_min), math.log(args.dt_max)
        dt = torch.exp(torch.rand(E, device=device) * (log_max - log_min) + log_min).clamp(min=args.dt_init_floor)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        # S4D-real init: A[e, s] = -(s + 1) for every channel e.
        a = torch.arange(1, S + 1, dtype=torch.float32, device=device).repeat(E, 1)  # (E, S)
        self.A_log.copy_(torch.log(a))
        nn.init.ones_(self.D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) -> (B, T, D)."""
        if type(self.in_proj) is not nn.Linear or type(self.out_proj) is not nn.Linear:
            # projections replaced by Linear layers that compute otherwise (FP8 training's): called as modules, unfused
            projections = (self.in_proj, self.out_proj)
            return mixer_composition(h, *self._weights(), causal_conv1d, selective_scan, projections=projections)
        if use_mamba_inner(h, self.args.d_inner):  # GPU (Triton) path: the mixer as one fused op owning the layouts
            return mamba_inner_triton(h, *self._weights())
        # elsewhere (CPU, or the fused op switched off): the same computation on the public dispatching ops
        return mixer_composition(h, *self._weights(), causal_conv1d, selective_scan)

    def _weights(self) -> tuple[torch.Tensor, ...]:
        """The mixer's parameters in the order of ``kernels.mamba_inner`` (weights as held, fetched at call time)."""
        return (
            self.in_proj.weight,
            self.conv1d.weight,
            self.conv1d.bias,
            self.x_proj.weight,
            self.dt_proj.weight,
            self.dt_proj.bias,
            self.A_log,
            self.D,
            self.out_proj.weight,
        )


class MambaBlock(nn.Module):
    """Pre-norm residual block: h + mixer(norm(h)) (HF ``MambaBlock``; the residual add is in fp32 by default)."""

    def __init__(self, args: MambaArgs) -> None:
        super().__init__()
        self.residual_in_fp32 = args.residual_in_fp32
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        self.mixer = MambaMixer(args)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.residual_in_fp32:  # the stream's own dtype throughout (bf16 under autocast, see MambaArgs)
            return h + self.mixer(self.norm(h))
        # Cast to the parameters' dtype first (bf16 under FSDP mixed precision, else fp32) as HF does.
        return h.float() + self.mixer(self.norm(h.to(self.norm.weight.dtype)))


class MambaBackbone(nn.Module):
    """Holds embeddings, layers and the final norm under ``backbone.`` (HF ``MambaModel``)."""

    def __init__(self, args: MambaArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.d_model)
        # A ModuleDict keyed "0", "1", ... gives the same keys as HF's ModuleList (backbone.layers.{i}.*).
        self.layers = nn.ModuleDict({str(i): MambaBlock(args) for i in range(args.n_layers)})
        self.norm_f = RMSNorm(args.d_model, args.norm_eps)
        self.residual_in_fp32 = args.residual_in_fp32

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.stream(self.embeddings(tokens))  # (B, T, D)
        for block in self.layers.values():
            h = block(h)
        return self.final_norm(h)

    def stream(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream's dtype for hidden states entering the layers (the embedding output, or a pipeline
        stage's input): the autocast dtype when ``residual_in_fp32`` is off under autocast, else unchanged."""
        return residual_stream(h, self.residual_in_fp32)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """norm_f, in the parameters' dtype as HF does with the fp32 stream, in the stream's own dtype otherwise."""
        return self.norm_f(h.to(self.norm_f.weight.dtype) if self.residual_in_fp32 else h)  # (B, T, D)


class Mamba(SamplingMixin, BackboneLM):
    """Token ids (B, T) -> logits (B, T, V). The Mamba-1 LM of mamba-ssm's ``MambaLMHeadModel``.

    Parameters (``num_params``) per layer: 3·D·E (in_proj 2·D·E, out_proj E·D) + E·(K + 1) (conv) + E·(R + 2S)
    (x_proj) + E·(R + 1) (dt_proj) + E·S (A_log) + E (D) + D (norm) = 3·D·E + E·(K + 2R + 3S + 3) + D. Model: V·D +
    L·layer + D (norm_f) + V·D when the head is untied."""

    def __init__(self, args: MambaArgs) -> None:
        super().__init__()
        self.args = args
        self.backbone = MambaBackbone(args)
        self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self._tie()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter as mamba-ssm does, drawing in module order from the global generator
        (seeded with ``seed`` first when given): a pipeline stage's weights come from initialising the whole model.

        Embedding N(0, init_std); in_proj / x_proj / conv1d PyTorch defaults; dt_proj and A_log / D as in
        ``MambaMixer.reset_parameters``; out_proj default init divided by sqrt(L) (mamba-ssm's
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
        h = self.backbone(tokens)  # (B, T, D): the parameters' dtype, or the stream's (residual_in_fp32 false)
        return self.head(h, targets)

    def scan_flops_per_token(self) -> float:
        """Training FLOPs per token of the selective scans' elementwise work: 3·L·E·(8·S + 10).

        Forward, per token, channel e and state s (8): Δ·A (1), exp (1), Δ·B·u (2), h = exp(ΔA)·h + ΔBu (2), y += C·h
        (2). Per token and channel (10): Δ bias add (1), softplus (3), D·u skip (2), SiLU(z) gate (4). ×3 for forward +
        backward (the same convention as the matmuls' 6 = 2·3).
        """
        a = self.args
        return 3.0 * a.n_layers * a.d_inner * (8 * a.d_state + 10)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N + 3·L·E·(8·S + 10).

        N = parameters without the input embedding (LM head included); 6 = 2 (forward multiply-add) × 3 (forward +
        backward w.r.t. inputs and weights). 6·N covers the in/x/dt/out projections and the LM head, and also the
        depthwise conv: its E·K weights are each used in one multiply-add per token, so its 2·E·K forward FLOPs ×3
        are exactly the conv's share of 6·N (not added again). The small vector parameters (A_log, D, biases, norms)
        are inside N too, an over-count of about 0.6% at 130m. 3·L·E·(8·S + 10) is the selective scan's elementwise
        work (see ``scan_flops_per_token``). Mamba is linear-time: there is no seq_len term (the argument keeps the
        Transformer's interface). Norms, SiLU after the conv and recomputation (activation checkpointing) are not
        counted.
        """
        del seq_len  # no sequence-length dependent term
        return 6.0 * self.num_params(exclude_embedding=True) + self.scan_flops_per_token()
