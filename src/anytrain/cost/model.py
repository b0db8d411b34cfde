"""Analytic cost model of one training step: memory per device, communication by collective and mesh axis, time,
energy. Pure arithmetic (no torch), so the planner can evaluate thousands of layouts in well under a second.

Notation: Ψ parameters, L layers, d width, F FFN width, V vocabulary, s sequence length, b micro-batch,
m micro-batches per step (gradient accumulation or pipeline micro-batches), t/p/n tensor-, pipeline-, data-parallel
degrees. Mesh order (innermost first): tp, dp-shard, dp-replicate, pp — TP takes consecutive ranks (inside a node).
Every formula is in the docstring of the function computing it and in docs/cost-model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from anytrain.cost.devices import Device

GIB = 2**30
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


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


@dataclass(frozen=True)
class ModelShape(_LanguageModelParams):
    """Decoder shape. ``mlp``: 'swiglu' (Llama: 3 matrices) or 'gelu' (GPT: 2). ``expand_kv``: K/V heads are
    expanded to H before attention (what anytrain's Transformer does), so attention saves full-width K and V."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    mlp: str = "swiglu"
    tie_embeddings: bool = False
    expand_kv: bool = True
    name: str = ""

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.dim // self.n_heads)

    @property
    def layer_params(self) -> int:
        """2·d² (Q, O) + 2·d·d_kv (K, V) + (3 or 2)·d·F (MLP) + 2·d (norms)."""
        d, f = self.dim, self.ffn_dim
        return 2 * d * d + 2 * d * self.kv_dim + (3 if self.mlp == "swiglu" else 2) * d * f + 2 * d

    def flops_per_token(self, seq_len: int) -> float:
        """6·N + 12·L·d·s with N = parameters without the input embedding, LM head included (as the model's own)."""
        return 6.0 * self.dense_params() + 12.0 * self.n_layers * self.dim * seq_len

    @classmethod
    def from_args(cls, args: object, name: str = "") -> ModelShape:
        """From anytrain's TransformerArgs (or anything with the same field names)."""
        return cls(
            args.n_layers,
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.ffn_dim,
            args.vocab_size,
            tie_embeddings=bool(getattr(args, "tie_embeddings", False)),
            name=name,
        )


@dataclass(frozen=True)
class MambaShape(_LanguageModelParams):
    """Mamba-1 LM shape for the cost model (anytrain's models/mamba.py). E = expand·d inner width, S state size,
    R Δ rank, K conv width. No attention: tensor parallelism is not offered (``n_heads`` = 1 keeps tp = 1)."""

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

    @property
    def layer_params(self) -> int:
        """3·D·E + E·(K + 2R + 3S + 3) + D (as ``Mamba.num_params``)."""
        d, e = self.dim, self.d_inner
        return 3 * d * e + e * (self.d_conv + 2 * self.dt_rank + 3 * self.d_state + 3) + d

    def flops_per_token(self, seq_len: int) -> float:
        """6·N (N without the input embedding, the LM head's V·D counted even when tied) + 3·L·E·(8·S + 10)."""
        del seq_len
        return 6.0 * self.dense_params() + 3.0 * self.n_layers * self.d_inner * (8 * self.d_state + 10)

    @classmethod
    def from_args(cls, args: object, name: str = "") -> MambaShape:
        return cls(args.n_layers, args.d_model, args.expand * args.d_model, args.d_state, args.dt_rank, args.d_conv,
                   args.vocab_size, bool(args.tie_embeddings), bool(args.residual_in_fp32), name=name)  # fmt: skip


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each state, and the dtypes of activations.

    ``weight``: the parameter tensors kept (fp32 master under autocast/FSDP, bf16 under Megatron-style mixed
    precision); ``grad``: gradient buffer; ``optimizer``: AdamW m and v (+ the fp32 master copy when weights are
    low precision); ``compute_copy``: bf16 working copy of the weights used by the matmuls (autocast's weight cache,
    FSDP's gathered params); ``reduce``: dtype of the gradient reduction; ``ddp_bucket``: DDP's bucket copy of the
    gradients (PyTorch DDP without gradient_as_bucket_view); ``nosync_grad``: FSDP's unsharded accumulated gradient
    while gradient sync is off between micro-batches; ``residual``: bytes of the residual stream (4 when fp32 params
    meet autocast: the embedding output stays fp32).
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
    residual: int = 4
    cast: float = 0.0  # bytes moved per local parameter per micro-batch by dtype casts (see elementwise_seconds)


# This trainer: fp32 params + autocast bf16 + fp32 AdamW (DDP/single); FSDP2 with bf16 params and fp32 reduction.
AMP = Precision("amp-fp32-master", weight=4, grad=4, optimizer=8, ddp_bucket=4, cast=16)
FSDP_BF16 = Precision("fsdp2-bf16", weight=4, grad=4, optimizer=8, nosync_grad=4, residual=2, cast=6)
# Megatron-style: bf16 params, fp32 main grads, fp32 master + Adam (12 B, sharded by the distributed optimizer).
MEGATRON = Precision("megatron-bf16", weight=2, grad=4, optimizer=12, compute_copy=0, residual=2)
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

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shard_size(self) -> int:
        return self.shard or self.dp if self.strategy in ("zero1", "zero2", "fsdp", "hsdp") else 1

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
    overlap: float = 0.8  # fraction of the overlap window in which data-parallel traffic hides
    fragmentation: float = 0.05
    overhead_gib: float = 1.0  # CUDA/HIP context, library workspaces, NCCL buffers (not in allocator peaks)


@dataclass
class Comm:
    axis: str
    collective: str
    count: int  # calls per step
    message_bytes: float  # full (unsharded) size of one call
    bytes_per_step: float  # bytes each device sends per step
    seconds: float
    exposed_seconds: float = 0.0


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float]  # bytes per device, by component (the most loaded pipeline stage)
    comm: list[Comm]
    compute_s: float
    bubble_s: float
    step_s: float
    steps: int
    flops_per_step: float
    world: int
    device: Device
    fits: bool
    required_gib: float = 0.0  # allocated × (1 + fragmentation) + overhead: compared with the device's memory
    notes: list[str] = field(default_factory=list)
    host_s: float = 0.0  # the host's kernel-launch floor for one step
    elementwise_s: float = 0.0  # memory-bound part of compute_s (the rest is GEMM/attention at ``efficiency``)

    @property
    def allocated_gib(self) -> float:
        """Predicted allocator peak (what torch.cuda.max_memory_allocated reports)."""
        return sum(self.memory.values()) / GIB

    @property
    def exposed_comm_s(self) -> float:
        return sum(c.exposed_seconds for c in self.comm)

    @property
    def comm_share(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    @property
    def mfu(self) -> float:
        return self.flops_per_step / (self.step_s * self.world * self.device.peak_flops)

    @property
    def total_s(self) -> float:
        return self.steps * self.step_s

    @property
    def energy_j(self) -> float:
        return self.total_s * self.world * self.device.avg_watts

    @property
    def tflops_per_watt(self) -> float:
        return self.flops_per_step / self.step_s / self.world / self.device.avg_watts / 1e12

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "layout": lay.label,
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "strategy": lay.strategy,
            "shard": lay.shard_size,
            "micro_batch": lay.micro_batch,
            "activation_checkpointing": lay.ac,
            "pp_schedule": lay.pp_schedule if lay.pp > 1 else None,
            "fits": self.fits,
            "memory_gib": {k: v / GIB for k, v in self.memory.items()},
            "allocated_gib": self.allocated_gib,
            "required_gib": self.required_gib,
            "device_memory_gib": self.device.memory_gib,
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "host_s": self.host_s,
            "elementwise_s": self.elementwise_s,
            "exposed_comm_s": self.exposed_comm_s,
            "step_s": self.step_s,
            "comm_share": self.comm_share,
            "mfu": self.mfu,
            "steps": self.steps,
            "total_s": self.total_s,
            "energy_kwh": self.energy_j / 3.6e6,
            "tflops_per_watt": self.tflops_per_watt,
            "comm": [vars(c) for c in self.comm],
            "notes": self.notes,
        }


# ---------------------------------------------------------------------------------------------------------------------
# Memory


def activation_bytes_per_token(shape: ModelShape, prec: Precision, compiled: bool) -> float:
    """Bytes one block saves for backward per token (no checkpointing, no TP), flash attention (no s² term).

    a = activation bytes (2 in bf16), r = residual-stream bytes, d_kv = K/V width seen by attention (d when K/V
    heads are expanded), F = FFN width.

    compiled (fused norms, each saved tensor once):
        2·r·d (both sublayer inputs) + 2·a·d (norm outputs = matmul inputs) + a·(d + 2·d_kv) (q, k, v)
        + a·d (attention output) + 3·a·F SwiGLU (gate, up, product) | 2·a·F GELU (fc1 output, gelu output)
    eager (every op saves its own inputs):
        2·8·d (each RMSNorm keeps its fp32 input and fp32 normalised output) + c·a·d (autocast casts the fp32 norm
        output once per consuming matmul: c = 5 SwiGLU / 4 GELU under fp32 residual, else 2)
        + a·(d + 2·d_kv) + a·d + 4·a·F SwiGLU (w1 out, silu out, w3 out, product) | 2·a·F GELU
    Korthikanti et al.'s 34·s·b·h for GPT (bf16, with dropout masks) is the same count: 2d (LN in) + 2d (QKV in)
    + 6d (QKV) + 2d (out) + 1d mask + 2d (LN) + 2d (fc1 in) + 16d (fc1 out, gelu out) + 1d mask.
    """
    if isinstance(shape, MambaShape):
        return mamba_activation_bytes_per_token(shape, prec)
    d, f, a, r = shape.dim, shape.ffn_dim, prec.act, prec.residual
    kv = d if shape.expand_kv else shape.kv_dim
    attn = a * (d + 2 * kv) + a * d
    if compiled:
        mlp = (3 if shape.mlp == "swiglu" else 2) * a * f
        return 2 * r * d + 2 * a * d + attn + mlp
    casts = (5 if shape.mlp == "swiglu" else 4) if r == 4 and prec.act == 2 else 2
    mlp = (4 if shape.mlp == "swiglu" else 2) * a * f
    return 2 * 8 * d + casts * a * d + attn + mlp


def mamba_activation_bytes_per_token(shape: MambaShape, prec: Precision) -> float:
    """Bytes one Mamba block saves per token: residual input r·d, normed input a·d, in_proj output x and z 2·a·E,
    conv output a·E, x_proj output a·(R + 2S), Δ a·E, the gated scan output a·E (out_proj input), and the scan's saved
    state every 16 steps (4·E·S/16 bytes; the kernel recomputes the rest). r = 4 with the fp32 residual."""
    d, e, a = shape.dim, shape.d_inner, prec.act
    r = 4 if shape.residual_fp32 else prec.residual
    return r * d + a * d + a * (2 * e + e + shape.dt_rank + 2 * shape.d_state + e + e) + 4 * e * shape.d_state / 16


def loss_bytes_per_token(shape: ModelShape) -> float:
    """12·V: fp32 log-probabilities saved by the cross-entropy (4·V) plus, in its backward, the gradient w.r.t. the
    log-probabilities and w.r.t. the logits (2 × 4·V), as anytrain's lm_cross_entropy (logits.float()) does."""
    return 12.0 * shape.vocab_size


AC_POLICIES = {"none": 0.0, "selective": 0.5, "full": 1.0}


def ac_fraction(policy: str) -> float:
    """Share of blocks under activation checkpointing: none 0, selective 1/2 (every other block), full 1."""
    return AC_POLICIES[policy]


def pp_in_flight(layout: Layout, micro_batches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: GPipe m; 1F1B min(p, m);
    interleaved 1F1B min(m, p·(1 + (p−1)/(p·v))) (Korthikanti et al. 2022, §4.2.3)."""
    p, m = layout.pp, micro_batches
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    if layout.pp_schedule == "interleaved":
        return min(m, p * (1 + (p - 1) / (p * layout.pp_chunks)))
    return float(min(p, m))


def memory_per_device(shape: ModelShape, layout: Layout, wl: Workload, prec: Precision) -> dict[str, float]:
    """Peak bytes on the most loaded device, by component.

    Ψ_dev = (L/p layers + embedding on the first stage / head on the last) / t. With ZeRO shard group size z:
      weights Ψ_dev·w / (z if ZeRO-3) ; grads Ψ_dev·g / (z if ZeRO-2/3) ; optimizer Ψ_dev·o / (z if ZeRO-1/2/3)
      compute copy: Ψ_dev·2 (autocast cache) | FSDP gathered units: 2 blocks + root (reshard) or all (no reshard)
      DDP buckets Ψ_dev·4 ; FSDP no-sync accumulated grads Ψ_dev·4 when m > 1
      activations: A·b·s/t per layer (sequence parallel) × L/p × in-flight micro-batches; full AC keeps r·d·b·s/t
      per layer plus one recomputed layer; loss 12·V·b·s/t on the last stage.
    The returned figure is the larger of the first and last pipeline stage.
    """
    t, p, z = layout.tp, layout.pp, layout.shard_size
    layers = shape.n_layers / p
    m = wl.global_batch // (layout.dp * layout.micro_batch)
    tokens = layout.micro_batch * wl.seq_len
    act_layer = activation_bytes_per_token(shape, prec, wl.compiled) * tokens / t
    stages = [(True, p == 1)] if p == 1 else [(True, False), (False, True)]
    best: dict[str, float] = {}
    for first, last in stages:
        psi = (layers * shape.layer_params + first * shape.embedding_params + last * shape.head_params) / t
        mem: dict[str, float] = {
            "weights": psi * prec.weight / (z if layout.strategy in ("fsdp", "hsdp") else 1),
            "grads": psi * prec.grad / (z if layout.strategy in ("zero2", "fsdp", "hsdp") else 1),
            "optimizer": psi * prec.optimizer / (z if layout.strategy != "ddp" else 1),
        }
        if layout.strategy in ("fsdp", "hsdp") and z > 1:
            root = (first * shape.embedding_params + last * shape.head_params) / t
            units = 2 * shape.layer_params / t if layout.reshard_after_forward else layers * shape.layer_params / t
            mem["gathered_params"] = (units + root) * prec.gather + 2 * shape.layer_params / t * prec.reduce
            if m > 1 and prec.nosync_grad:
                mem["nosync_grads"] = psi * prec.nosync_grad
        else:
            mem["compute_copy"] = (psi - first * shape.embedding_params / t) * prec.compute_copy
        if layout.strategy == "ddp" and layout.dp > 1:
            mem["ddp_buckets"] = psi * prec.ddp_bucket
        in_flight = pp_in_flight(layout, m) if first else 1.0
        f = ac_fraction(layout.ac)  # share of blocks that keep only their input and recompute in backward
        checkpointed = prec.residual * shape.dim * tokens / t
        stored = (f * checkpointed + (1 - f) * act_layer) * layers * in_flight
        transient = act_layer if f else 0.0
        mem["activations"] = stored
        loss = loss_bytes_per_token(shape) * tokens / t if last else 0.0
        mem["transient"] = max(loss, transient)
        if sum(mem.values()) > sum(best.values()):
            best = mem
    return {k: v for k, v in best.items() if v}


# ---------------------------------------------------------------------------------------------------------------------
# Communication and time


def group_bandwidth(device: Device, size: int, stride: int) -> tuple[float, float, bool]:
    """(bytes/s per device, latency s, crosses nodes) of a group of ``size`` ranks ``stride`` apart.

    Inside a node: the intra-node link. Across nodes with k group members per node: min(intra, k × per-device NIC
    share) — NCCL/RCCL run one ring/tree per NIC, so k members drive k NICs in parallel."""
    g = device.gpus_per_node
    if size * stride <= g:
        return device.intra_node_gb_per_s * 1e9, device.intra_latency_us * 1e-6, False
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    bw = min(device.intra_node_gb_per_s, per_node * device.inter_node_gb_per_s) * 1e9
    return bw, device.inter_latency_us * 1e-6, True


def collective_time(kind: str, message: float, n: int, bw: float, latency: float) -> tuple[float, float]:
    """(bytes sent per device, seconds). Ring bandwidth terms, tree latency terms:
    all_reduce 2(n−1)/n·M, 2·⌈log2 n⌉·α ; all_gather / reduce_scatter (n−1)/n·M, ⌈log2 n⌉·α ; p2p M, α."""
    if kind == "p2p":
        return message, latency + message / bw
    if n <= 1:
        return 0.0, 0.0
    steps = math.ceil(math.log2(n))
    factor = 2.0 if kind == "all_reduce" else 1.0
    sent = factor * (n - 1) / n * message
    return sent, factor * steps * latency + sent / bw


def communication(
    shape: ModelShape, layout: Layout, wl: Workload, prec: Precision, device: Device, compute_s: float
) -> list[Comm]:
    """Per-step collectives of one device.

    dp (ddp): all_reduce of Ψ_dev·reduce bytes once per step (accumulation defers sync to the last micro-batch).
    dp (zero1/2): reduce_scatter of gradients + all_gather of bf16 params, once per step.
    dp (fsdp): per micro-batch all_gather in forward and again in backward (once if not resharding), plus one
    reduce_scatter per step: ≈ 1.5 × DDP's volume at equal dtypes. hsdp: that within the shard group plus an
    all_reduce of the Ψ_dev/z shard across replicas.
    tp (sequence parallel): per layer and micro-batch 4 all_gather + 4 reduce_scatter of a·b·s·d (6 + 6 with
    full AC, which replays the forward). pp: per micro-batch one activation send forward and one gradient back.
    Exposure: tp and pp are on the critical path; dp hides in ``overlap`` × (the last micro-batch's backward for
    ddp/zero, all compute for fsdp) — what is left is exposed.
    """
    t, p, dp, z = layout.tp, layout.pp, layout.dp, layout.shard_size
    m = wl.global_batch // (dp * layout.micro_batch)
    psi = (shape.n_layers / p * shape.layer_params + max(shape.embedding_params, shape.head_params)) / t
    act_msg = prec.act * layout.micro_batch * wl.seq_len * shape.dim
    out: list[Comm] = []

    def add(axis: str, kind: str, count: int, msg: float, n: int, stride: int) -> Comm:
        bw, lat, _ = group_bandwidth(device, n, stride)
        sent, sec = collective_time(kind, msg, n, bw, lat)
        comm = Comm(axis, kind, count, msg, sent * count, sec * count)
        out.append(comm)
        return comm

    dp_comms: list[Comm] = []
    if dp > 1:
        if layout.strategy == "ddp":
            dp_comms.append(add("dp", "all_reduce", 1, psi * prec.reduce, dp, t))
        elif layout.strategy in ("zero1", "zero2"):
            dp_comms.append(add("dp", "reduce_scatter", 1, psi * prec.reduce, dp, t))
            dp_comms.append(add("dp", "all_gather", 1, psi * prec.gather, dp, t))
        elif z > 1:
            gathers = m * (2 if layout.reshard_after_forward else 1)
            dp_comms.append(add("dp_shard", "all_gather", gathers, psi * prec.gather, z, t))
            dp_comms.append(add("dp_shard", "reduce_scatter", 1, psi * prec.reduce, z, t))
            if dp // z > 1:
                dp_comms.append(add("dp_replicate", "all_reduce", 1, psi / z * prec.reduce, dp // z, t * z))
    window = compute_s * (1.0 if layout.strategy in ("fsdp", "hsdp") else 2.0 / 3.0 / m)
    hidden = wl.overlap * window
    for comm in dp_comms:
        comm.exposed_seconds = max(0.0, comm.seconds - hidden)
        hidden = max(0.0, hidden - comm.seconds)
    if t > 1:
        per_layer = 4 + 2 * ac_fraction(layout.ac)  # recomputed blocks replay their forward collectives
        count = per_layer * m * math.ceil(shape.n_layers / p)
        for kind in ("all_gather", "reduce_scatter"):
            comm = add("tp", kind, count, act_msg, t, 1)
            comm.exposed_seconds = comm.seconds
    if p > 1:
        comm = add("pp", "p2p", 2 * m, act_msg / t, 2, t * dp)
        comm.exposed_seconds = comm.seconds
    return out


def elementwise_bytes_per_token(shape: ModelShape, prec: Precision, compiled: bool) -> float:
    """Bytes the memory-bound (non-GEMM) kernels move per token, forward + backward.

    Per block, forward, with fused (compiled) kernels and r = residual bytes: attention norm (r+2)·d, RoPE on q and k
    4·d + 4·d_kv, residual add after attention (2r+2)·d, FFN norm (r+2)·d, SwiGLU product 6·F, residual add after the
    FFN (2r+2)·d; backward ≈ 2 × forward. Eager (each op its own kernel, fp32 norm internals) ≈ 2.5 × that. Plus the
    loss over the vocabulary: 16·V (chunked fused linear + cross-entropy: fp32 logits written and read, forward and
    backward). FlashAttention is counted as arithmetic (in the FLOPs), not here.
    """
    if isinstance(shape, MambaShape):  # norm (r+2)·d, residual add (2r+2)·d, conv in/out + SiLU and gate 8·E
        r, e = (4 if shape.residual_fp32 else prec.residual), shape.d_inner
        forward = (3 * r + 4) * shape.dim + 8 * e
        return shape.n_layers * 3.0 * forward * (1.0 if compiled else 2.5) + 16.0 * shape.vocab_size
    d, f, r = shape.dim, shape.ffn_dim, prec.residual
    forward = (r + 2) * d + 4 * d + 4 * shape.kv_dim + (2 * r + 2) * d + (r + 2) * d + 6 * f + (2 * r + 2) * d
    per_block = 3.0 * forward * (1.0 if compiled else 2.5)
    return shape.n_layers * per_block + 16.0 * shape.vocab_size


def elementwise_seconds(shape: ModelShape, layout: Layout, wl: Workload, prec: Precision, device: Device) -> float:
    """Memory-bound time of one step on one device: elementwise traffic of its tokens plus the per-micro-batch
    dtype casts of its parameters (autocast: fp32 weights read, bf16 copies written, bf16 weight grads added into
    fp32 = 16 B/param; FSDP2 bf16 params: the fp32 upcast of gradients for the reduction = 6 B/param), at
    ``hbm_efficiency`` × the HBM bandwidth. Tensor parallelism splits both; pipeline stages hold L/p blocks."""
    m = wl.global_batch // (layout.dp * layout.micro_batch)
    tokens = layout.micro_batch * wl.seq_len * m
    per_token = elementwise_bytes_per_token(shape, prec, wl.compiled)
    per_token = (per_token - 16.0 * shape.vocab_size) / layout.pp + 16.0 * shape.vocab_size / layout.pp
    psi = (shape.n_layers / layout.pp * shape.layer_params + shape.head_params / layout.pp) / layout.tp
    total = tokens * per_token / layout.tp + m * prec.cast * psi
    return total / (device.hbm_tb_per_s * 1e12 * device.hbm_efficiency)


def fit_efficiency(est: Estimate, measured_step_s: float) -> float:
    """The efficiency that makes ``est`` (a compute-bound run without exposed communication, e.g. one GPU) take
    ``measured_step_s``: only the GEMM/attention part scales with efficiency, the memory-bound part stays."""
    gemm_s = est.compute_s - est.elementwise_s
    return est.device.efficiency * gemm_s / max(measured_step_s - est.elementwise_s, 1e-12)


def bubble_fraction(layout: Layout, micro_batches: int) -> float:
    """Pipeline idle time / compute: (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) for interleaved 1F1B (v chunks)."""
    if layout.pp == 1:
        return 0.0
    v = layout.pp_chunks if layout.pp_schedule == "interleaved" else 1
    return (layout.pp - 1) / (v * micro_batches)


def estimate(
    shape: ModelShape, layout: Layout, wl: Workload, device: Device, prec: Precision | None = None
) -> Estimate:
    """Memory, step time and totals of one layout.

    compute_s = flops_per_token(s)·B·s·(4/3 with full AC) / (world · peak · efficiency) + elementwise_seconds
    host_s = m · (L/p) · host_layer_us (compiled or eager) + host_step_us   (the host's kernel-launch floor)
    step_s = max(compute_s · (1 + bubble), host_s) + exposed communication;  steps = D / (B·s);
    energy = total_s·world·watts.
    """
    prec = prec or trainer_precision(layout.strategy)
    m = wl.global_batch // (layout.dp * layout.micro_batch)
    tokens_per_step = wl.global_batch * wl.seq_len
    flops = shape.flops_per_token(wl.seq_len) * tokens_per_step
    recompute = 1.0 + ac_fraction(layout.ac) / 3.0  # a recomputed forward is a third of forward + backward
    gemm_s = flops * recompute / (layout.world * device.peak_flops * device.efficiency)
    elementwise_s = elementwise_seconds(shape, layout, wl, prec, device) * recompute
    if isinstance(shape, MambaShape):  # the selective scan (forward + backward) at its benchmarked rate
        tokens_per_device = wl.global_batch * wl.seq_len / layout.dp
        elementwise_s += tokens_per_device * shape.n_layers / layout.pp * shape.d_inner * device.scan_ns * 1e-9
    compute_s = gemm_s + elementwise_s
    bubble_s = compute_s * bubble_fraction(layout, m)
    comm = communication(shape, layout, wl, prec, device, compute_s)
    layer_us = device.host_layer_us_compiled if wl.compiled else device.host_layer_us
    host_s = (m * shape.n_layers / layout.pp * layer_us + device.host_step_us) * 1e-6
    notes = ["host-bound: kernel launches take longer than the GPU's work"] if host_s > compute_s + bubble_s else []
    step_s = max(compute_s + bubble_s, host_s) + sum(c.exposed_seconds for c in comm)
    tokens = wl.tokens or 20.0 * shape.num_params
    memory = memory_per_device(shape, layout, wl, prec)
    allocated = sum(memory.values()) / GIB
    required = allocated * (1 + wl.fragmentation) + wl.overhead_gib + (0.5 if layout.world > 1 else 0.0)
    return Estimate(
        layout,
        memory,
        comm,
        compute_s,
        bubble_s,
        step_s,
        math.ceil(tokens / tokens_per_step),
        flops,
        layout.world,
        device,
        required <= device.memory_gib,
        required,
        notes,
        host_s,
        elementwise_s,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The seed study's closed forms (its own accounting, for cross-checks and the projection report)


def seed_memory_per_device(params_bytes: float, strategy: str, n: int, tp: int = 1, pp: int = 1) -> float:
    """Model-state memory per device with M_o = 2·M_p, M_g = 2·M_p, M_e = M_p (total 6·M_p):
    ddp 6·M_p; fsdp 6·M_p / n; 3d (TP in a node, PP across nodes, ZeRO-1 over dp = n/(tp·pp)):
    (M_p + M_g + M_e) / (tp·pp) + M_o / (tp·pp·dp) = 4·M_p/(tp·pp) + 2·M_p/n."""
    m_p = params_bytes
    if strategy == "ddp":
        return 6 * m_p
    if strategy == "fsdp":
        return 6 * m_p / n
    if strategy == "3d":
        return 4 * m_p / (tp * pp) + 2 * m_p / n
    raise ValueError(f"strategy {strategy!r}: expected ddp, fsdp or 3d")


def seed_comm_per_step(params_bytes: float, strategy: str, n: int) -> float:
    """Bytes each device sends per step (ring): ddp all_reduce 2(n−1)/n·M; fsdp all_gather ×2 + reduce_scatter
    3(n−1)/n·M = 1.5 × ddp."""
    ring = (n - 1) / n * params_bytes
    return {"ddp": 2 * ring, "fsdp": 3 * ring}[strategy]


def seed_compute_flops(params: float, tokens: float | None = None) -> float:
    """6·P·D; with Chinchilla's D = 20·P this is 120·P²."""
    return 6.0 * params * (20.0 * params if tokens is None else tokens)


def seed_time_s(flops: float, n: int, peak_flops: float, efficiency: float) -> float:
    """time = FLOPs / achieved FLOP/s = FLOPs / (n · peak · efficiency)."""
    return flops / (n * peak_flops * efficiency)


def seed_energy_j(time_s: float, n: int, avg_watts: float) -> float:
    """energy = time × n × average power per device."""
    return time_s * n * avg_watts
