"""Analytic cost model of one training step: memory per device, communication by collective and mesh axis, time,
energy. Pure arithmetic (no torch), so the planner can evaluate thousands of layouts in well under a second.

Notation: Ψ parameters, L layers, d width, F FFN width, V vocabulary, s sequence length, b micro-batch,
m micro-batches per step (gradient accumulation or pipeline micro-batches), t/p/n tensor-, pipeline-, data-parallel
degrees. Mesh order (innermost first): tp, dp-shard, dp-replicate, pp — TP takes consecutive ranks (inside a node).
Every formula is in the docstring of the function computing it and in docs/cost-model.md. The shapes, precision
presets, layouts and workloads live in ``cost/shapes.py``, the memory accounting in ``cost/memory.py``; both are
re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from anytrain.cost import fp8
from anytrain.cost.devices import Device
from anytrain.cost.memory import (  # noqa: F401  (re-exported)
    AC_POLICIES,
    ac_fraction,
    activation_bytes_per_token,
    head_activation_bytes_per_token,
    loss_bytes_per_token,
    loss_chunk_bytes,
    mamba_activation_bytes_per_token,
    memory_per_device,
    memory_phases,
    pp_in_flight,
    residual_bytes,
)
from anytrain.cost.shapes import (  # noqa: F401  (re-exported)
    AMP,
    FP32,
    FSDP_BF16,
    GIB,
    MEGATRON,
    MIB,
    PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    HybridShape,
    Layout,
    Mamba2Shape,
    MambaShape,
    ModelShape,
    Precision,
    Workload,
    gradient_reduce_bytes,
    sequence_loss_applies,
    trainer_precision,
)

HEAD_EAGER_OPS = 55  # host ops per micro-batch outside the blocks: embedding, casts, final norm, fused loss (fwd+bwd)


@dataclass
class Comm:
    axis: str
    collective: str
    count: int  # calls per step
    message_bytes: float  # full (unsharded) size of one call
    bytes_per_step: float  # bytes each device sends per step
    seconds: float
    exposed_seconds: float = 0.0
    gradients: bool = False  # the data-parallel gradient reduction (what parallel.grad_compression compresses)


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
    memory_phase: str = ""  # when the memory peak happens: 'forward', 'backward' or 'optimizer' (cost/memory.py)
    optimizer_s: float = 0.0  # clipping + AdamW (part of elementwise_s)
    fp8_gemm_s: float = 0.0  # the FP8 GEMMs' share of compute_s (``Workload.fp8``)

    @property
    def allocated_gib(self) -> float:
        """Predicted allocator peak (what torch.cuda.max_memory_allocated reports)."""
        return sum(self.memory.values()) / GIB

    @property
    def exposed_comm_s(self) -> float:
        return sum(c.exposed_seconds for c in self.comm)

    @property
    def grad_reduce_bytes(self) -> float:
        """Bytes one device hands to the gradient reduction per step (message sizes, as the trainer's
        grad_comm_bytes; the wire carries the collectives' ring factors on top)."""
        return sum(c.message_bytes * c.count for c in self.comm if c.gradients)

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
            "memory_phase": self.memory_phase,
            "allocated_gib": self.allocated_gib,
            "required_gib": self.required_gib,
            "device_memory_gib": self.device.memory_gib,
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "host_s": self.host_s,
            "elementwise_s": self.elementwise_s,
            "optimizer_s": self.optimizer_s,
            "fp8_gemm_s": self.fp8_gemm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "grad_reduce_bytes": self.grad_reduce_bytes,
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
    ``wl.grad_compression`` sets the reduce bytes of the gradient collectives (``gradient_reduce_bytes``): 2 for
    bf16 / fp16, 4 × PowerSGD's (Σ (n + m)·r + uncompressed) / Ψ for powersgd:rank=r (its matmuls, ~6·n·m·r FLOPs
    per matrix and step, are not counted).
    dp (zero1/2): reduce_scatter of gradients + all_gather of bf16 params, once per step.
    dp (fsdp): per micro-batch all_gather in forward and again in backward (once if not resharding; once per step
    with ``reshard_during_accumulation`` off), plus one reduce_scatter per step: ≈ 1.5 × DDP's volume at equal
    dtypes. hsdp: that within the shard group plus an all_reduce of the Ψ_dev/z shard across replicas. With
    ``wl.fp8`` tensorwise the converted weights are gathered in FP8 (1 byte) and their scales take one fp32
    all-reduce of their amaxes per step, exposed (cost/fp8.py).
    tp (sequence parallel): per layer and micro-batch 4 all_gather + 4 reduce_scatter of a·b·s·d (6 + 6 with
    full AC, which replays the forward); under anytrain's TP (DTensor) these run at ``tp_link_efficiency`` of the
    link and cost ``tp_collective_us`` each on top, plus one fp32 all-reduce per step of the norm weights' gradients
    (2L + 1 vectors; one each under FSDP, which reduces them itself), and with ``wl.tp_sequence_loss`` an a·V·d
    all-reduce of the head weight's gradient per micro-batch — Megatron-style precisions keep the plain link
    terms. pp: per micro-batch one activation send forward and one gradient back.
    Exposure: tp and pp are on the critical path; dp hides in ``overlap`` × (the last micro-batch's backward for
    ddp/zero, all compute for fsdp) — what is left is exposed.
    """
    t, p, dp, z = layout.tp, layout.pp, layout.dp, layout.shard_size
    m = wl.global_batch // (dp * layout.micro_batch)
    psi = (shape.n_layers / p * shape.layer_params + max(shape.embedding_params, shape.head_params)) / t
    act_msg = prec.act * layout.micro_batch * wl.seq_len * shape.dim
    reduce = gradient_reduce_bytes(shape, prec, wl.grad_compression, layout.strategy)
    converted = shape.n_layers / p * fp8.converted_params_per_layer(shape, wl.fp8, wl.fp8_filter) / t
    gather_fp8 = fp8.gather_bytes_per_param(prec.gather, wl.fp8, layout.strategy)
    gathered = (psi - converted) * prec.gather + converted * gather_fp8  # FSDP's all-gather message
    out: list[Comm] = []

    def add_on(dev: Device, axis: str, kind: str, count: int, msg: float, n: int, stride: int = 1) -> Comm:
        bw, lat, _ = group_bandwidth(dev, n, stride)
        sent, sec = collective_time(kind, msg, n, bw, lat)
        comm = Comm(axis, kind, count, msg, sent * count, sec * count)
        out.append(comm)
        return comm

    def add(axis: str, kind: str, count: int, msg: float, n: int, stride: int) -> Comm:
        return add_on(device, axis, kind, count, msg, n, stride)

    dp_comms: list[Comm] = []
    if dp > 1:
        if layout.strategy == "ddp":
            dp_comms.append(add("dp", "all_reduce", 1, psi * reduce, dp, t))
        elif layout.strategy in ("zero1", "zero2"):
            dp_comms.append(add("dp", "reduce_scatter", 1, psi * reduce, dp, t))
            dp_comms.append(add("dp", "all_gather", 1, psi * prec.gather, dp, t))
        elif z > 1:
            gathers = layout.gathers_per_step(m)
            dp_comms.append(add("dp_shard", "all_gather", gathers, gathered, z, t))
            dp_comms.append(add("dp_shard", "reduce_scatter", 1, psi * reduce, z, t))
            if dp // z > 1:
                dp_comms.append(add("dp_replicate", "all_reduce", 1, psi / z * reduce, dp // z, t * z))
        for comm in dp_comms:
            comm.gradients = comm.collective != "all_gather"
    window = compute_s * (1.0 if layout.strategy in ("fsdp", "hsdp") else 2.0 / 3.0 / m)
    hidden = wl.overlap * window
    for comm in dp_comms:
        comm.exposed_seconds = max(0.0, comm.seconds - hidden)
        hidden = max(0.0, hidden - comm.seconds)
    if converted and gather_fp8 < prec.gather and z > 1 and dp > 1:  # the FP8 weights' scales: one all-reduce of
        # their amaxes per step, after the optimizer and before the next forward (on the critical path)
        scales = 4.0 * shape.n_layers / p * len(fp8.converted_linears(shape, wl.fp8, wl.fp8_filter))
        add("dp_shard", "all_reduce", 1, scales, z, t).exposed_seconds = out[-1].seconds
    if t > 1 and isinstance(shape, (Mamba2Shape, HybridShape)):
        _ssm_tp_comms(shape, layout, wl, prec, device, m, add_on)
    elif t > 1:
        per_layer = 4 + 2 * ac_fraction(layout.ac)  # recomputed blocks replay their forward collectives
        layers = math.ceil(shape.n_layers / p)
        count = per_layer * m * layers
        measured, tp_device = _tp_link(prec, device)
        tp_comms = [add_on(tp_device, "tp", kind, count, act_msg, t) for kind in ("all_gather", "reduce_scatter")]
        if measured:  # the sequence-parallel norms' weight gradients (Partial on every TP rank): summed in one fp32
            # all-reduce per step (parallel.tensor_parallel.reduce_partial_gradients), or one each where FSDP2 reduces
            # them itself
            norms = 2 * layers + 1
            fsdp = dp > 1 and layout.strategy in ("fsdp", "hsdp")
            count, msg = (norms, 4.0 * shape.dim) if fsdp else (1, 4.0 * shape.dim * norms)
            tp_comms.append(add_on(tp_device, "tp", "all_reduce", count, msg, t))
        if measured and sequence_loss_applies(layout, wl):  # the head weight's gradient, summed over the TP group in
            # each micro-batch's backward (the sequence-sharded loss), in the compute dtype
            tp_comms.append(add_on(tp_device, "tp", "all_reduce", m, prec.act * shape.vocab_size * shape.dim, t))
        for comm in tp_comms:
            comm.seconds += comm.count * device.tp_collective_us * 1e-6 * measured
            comm.exposed_seconds = comm.seconds
    if p > 1:
        comm = add("pp", "p2p", 2 * m, act_msg / t, 2, t * dp)
        comm.exposed_seconds = comm.seconds
    return out


def replicated_bc(shape: Mamba2Shape, tp: int) -> bool:
    """Mamba-2's B and C projections (and their conv channels) are whole on every TP rank unless tp divides the
    groups (``models/mamba2/parallelize.py``)."""
    return tp > 1 and shape.ngroups % tp != 0


def _tp_link(prec: Precision, device: Device) -> tuple[bool, Device]:
    """(anytrain's DTensor TP?, the device its TP collectives see): under anytrain the measured link share
    (``tp_link_efficiency``; the per-call cost is added by the caller), Megatron-style precisions the plain link."""
    measured = prec.framework == "anytrain"
    scaled = device.replace(intra_node_gb_per_s=device.intra_node_gb_per_s * device.tp_link_efficiency)
    return measured, scaled if measured else device


def _ssm_tp_comms(shape, layout: Layout, wl: Workload, prec: Precision, device: Device, m: int, add_on) -> None:
    """Mamba-2 and hybrid TP (Megatron's, without sequence parallelism; ``models/mamba2/parallelize.py``,
    ``models/hybrid/parallelize.py``), per block and micro-batch: the output all-reduced in the forward (the
    row-parallel projection) and the input's gradient in the backward, a·b·s·d each (a recomputed block replays its
    forward one); a Mamba-2 mixer whose group spans the ranks (tp not dividing ngroups) also all-reduces its gated
    norm's fp32 sums of squares (b·s·G) each way, and its B/C weights' gradients are Partial: one fp32 all-reduce per
    step of them (one per tensor under FSDP). All exposed; under anytrain's DTensor TP at the measured link share and
    per-call cost, as the Transformer's."""
    t, f = layout.tp, ac_fraction(layout.ac)
    blocks = math.ceil(shape.n_layers / layout.pp)
    mamba = shape if isinstance(shape, Mamba2Shape) else shape.mamba
    mixers = blocks if isinstance(shape, Mamba2Shape) else math.ceil(shape.n_mamba / layout.pp)
    tokens = layout.micro_batch * wl.seq_len
    measured, tp_device = _tp_link(prec, device)
    comms = [add_on(tp_device, "tp", "all_reduce", (2 + f) * m * blocks, prec.act * tokens * shape.dim, t)]
    if mixers and replicated_bc(mamba, t):
        comms.append(add_on(tp_device, "tp", "all_reduce", (2 + f) * m * mixers, 4.0 * tokens * mamba.ngroups, t))
        if measured:  # the B/C projections and conv channels: Partial gradients (reduce_partial_gradients)
            gn = 2 * mamba.ngroups * mamba.d_state
            params = mixers * (mamba.dim * gn + gn * (mamba.d_conv + 1))
            fsdp = layout.dp > 1 and layout.strategy in ("fsdp", "hsdp")
            count, msg = (4 * mixers, 4.0 * params / (4 * mixers)) if fsdp else (1, 4.0 * params)
            comms.append(add_on(tp_device, "tp", "all_reduce", count, msg, t))
    for comm in comms:
        comm.seconds += comm.count * device.tp_collective_us * 1e-6 * measured
        comm.exposed_seconds = comm.seconds


def gemm_bytes_per_token(shape: ModelShape | MambaShape, prec: Precision) -> float:
    """HBM traffic of the matmuls' activation operands per token, forward + backward: each linear (K → N) reads its
    input and writes its output in forward, reads the output gradient and writes the input gradient (dgrad), reads
    both for the weight gradient (wgrad): 3·a·(K + N); summed over every block's linears (``block_linears``), plus
    the LM head 3·a·(d + V). Added to the GEMMs' arithmetic time (an additive roofline): small-width models (K, N ≲
    1k) spend a visibly larger share of their GEMM time on it."""
    a = prec.act
    blocks = sum(3 * a * (k + n) for k, n in shape.block_linears())
    return blocks + 3 * a * (shape.dim + shape.vocab_size)


def gemm_weight_bytes(shape: ModelShape | MambaShape, prec: Precision) -> float:
    """The matmuls' weight operands per micro-batch: each weight read in forward and in dgrad, its gradient written
    in wgrad (3·a·K·N per linear), blocks and LM head."""
    a = prec.act
    return 3 * a * (sum(k * n for k, n in shape.block_linears()) + shape.vocab_size * shape.dim)


def elementwise_bytes_per_token(shape: ModelShape | MambaShape, prec: Precision, compiled: bool) -> float:
    """Bytes the memory-bound (non-GEMM) kernels move per token, forward + backward.

    Per block, forward, with fused (compiled) kernels and r = residual bytes: attention norm (r+2)·d, RoPE on q and k
    4·d + 4·d_kv, residual add after attention (2r+2)·d, FFN norm (r+2)·d, SwiGLU product 6·F, residual add after the
    FFN (2r+2)·d; backward ≈ 2 × forward. Eager (each op its own kernel, fp32 norm internals) ≈ 2.5 × that. Plus the
    loss over the vocabulary: anytrain's fused linear + cross-entropy row kernel reads the logits twice and writes
    them once (3·a·V; the GEMMs' logits traffic is in ``gemm_bytes_per_token``), Megatron's full-logits loss 16·V.
    FlashAttention is counted as arithmetic (in the FLOPs), not here.
    """
    r = residual_bytes(shape, prec)
    loss = 3.0 * prec.act * shape.vocab_size if prec.framework == "anytrain" else 16.0 * shape.vocab_size
    if isinstance(shape, MambaShape):  # norm (r+2)·d, residual add (2r+2)·d, conv in/out + SiLU and gate 8·E
        forward = (3 * r + 4) * shape.dim + 8 * shape.d_inner
        return shape.n_layers * 3.0 * forward * (1.0 if compiled else 2.5) + loss
    if isinstance(shape, Mamba2Shape):  # norm, residual add, conv in/out a·C each, gated norm y, z in and out 3·a·E
        return shape.n_layers * 3.0 * _mamba2_block_bytes(shape, r, prec.act) * (1.0 if compiled else 2.5) + loss
    if isinstance(shape, HybridShape):  # each kind's part of the Transformer's or Mamba-2's block, per block
        d = shape.dim
        attention = (r + 2) * d + 4 * d + 4 * shape.kv_dim + (2 * r + 2) * d  # norm, RoPE on q and k, residual add
        mlp = (r + 2) * d + (6 if shape.mlp == "swiglu" else 4) * shape.ffn_dim + (2 * r + 2) * d
        forward = shape.n_mamba * _mamba2_block_bytes(shape.mamba, r, prec.act)
        forward += shape.n_attention * attention + shape.n_mlp * mlp
        return 3.0 * forward * (1.0 if compiled else 2.5) + loss
    d, f = shape.dim, shape.ffn_dim
    forward = (r + 2) * d + 4 * d + 4 * shape.kv_dim + (2 * r + 2) * d + (r + 2) * d + 6 * f + (2 * r + 2) * d
    per_block = 3.0 * forward * (1.0 if compiled else 2.5)
    return shape.n_layers * per_block + loss


def _mamba2_block_bytes(shape: Mamba2Shape, r: int, a: int) -> float:
    """One Mamba-2 block's elementwise bytes per token, forward, fused: norm and residual add (3r + 4)·d, the conv's
    input and output a·C each, the gated norm's y, z in and out 3·a·E."""
    return (3 * r + 4) * shape.dim + 2 * a * shape.conv_dim + 3 * a * shape.d_inner


def parameter_traffic_bytes(shape: ModelShape | MambaShape, layout: Layout, wl: Workload, prec: Precision) -> float:
    """Bytes per step that move parameters and gradients around, per device (Ψ_dev = its unsharded parameters):
    per micro-batch the dtype casts (``prec.cast``: autocast's weight casts and the fp32 gradient accumulation, 16 B
    per parameter; FSDP2: the bf16 → fp32 gradient upcast and accumulation, 10 B) and, for FSDP2, each all-gather's
    copy-in (6/z), NCCL's output (2) and copy-out (4) B per parameter; per step DDP's bucket copies (gradient →
    bucket → gradient, 16 B; none with ``wl.ddp_bucket_view``) and ZeRO-1's all-gather packing (8 + 8/z B). FP8
    (``wl.fp8``): under autocast the converted weights skip autocast's cast (−6 B each per micro-batch); FSDP's FP8
    all-gather moves 1 byte per converted parameter where bf16 moves 2, after one amax read of each fp32 shard (4/z
    B) per step."""
    m = max(1, wl.global_batch // (layout.dp * layout.micro_batch))
    z = layout.shard_size
    psi = (shape.n_layers / layout.pp * shape.layer_params + shape.head_params / layout.pp) / layout.tp
    total = m * prec.cast * psi
    anytrain = prec.framework == "anytrain"
    converted = shape.n_layers / layout.pp * fp8.converted_params_per_layer(shape, wl.fp8, wl.fp8_filter) / layout.tp
    if prec.autocast:  # FP8 layers cast their fp32 weights themselves (cast_weight_bytes): no autocast cast, 6 B
        total -= m * 6.0 * converted
    if layout.strategy in ("fsdp", "hsdp") and z > 1 and anytrain:
        gather_fp8 = fp8.gather_bytes_per_param(prec.gather, wl.fp8, layout.strategy)
        gathered = (psi - converted) * prec.gather + converted * gather_fp8
        total += layout.gathers_per_step(m) * (6.0 + 8.0 / z) * gathered / 2
        if gather_fp8 < prec.gather:  # the scales' amax over each fp32 shard, once per step
            total += 4.0 / z * converted
    if layout.strategy in ("ddp", "zero1") and layout.dp > 1 and prec.ddp_bucket and not wl.ddp_bucket_view:
        total += 4 * prec.ddp_bucket * psi
    if layout.strategy == "zero1" and anytrain and z > 1:
        total += (8.0 + 8.0 / z) * psi
    return total


def ssd_bytes_per_token(shape: Mamba2Shape, seq_len: int, ssd_kernel: str) -> float:
    """HBM traffic of one Mamba-2 SSD per token, forward + backward (its matmuls' arithmetic is in the FLOPs).
    'triton': none apart (the kernels' measured rate, ``Device.ssd_efficiency``, includes their traffic).
    'torch' (the PyTorch twin): its fp32 (H, Q, Q) tensors dominate;
    counting the kernels of ``ssd_chunk_scan_torch`` that read or write one such tensor, 11 passes forward
    (segment sums: four; the decays' exp; the scores' product; the matmul operand copy) and 17 backward, 4·H·Q
    bytes each."""
    if ssd_kernel == "triton":
        return 0.0
    return 28.0 * 4 * shape.nheads * shape.chunk(seq_len)


def elementwise_seconds(shape: ModelShape, layout: Layout, wl: Workload, prec: Precision, device: Device) -> float:
    """Memory-bound time of one step on one device, at ``hbm_efficiency`` × the HBM bandwidth: the elementwise
    kernels' and the GEMM operands' traffic of its tokens, the weight operands per micro-batch, and the parameter
    traffic (casts, FSDP copies, DDP buckets: ``parameter_traffic_bytes``). Tensor parallelism splits all of it;
    pipeline stages hold L/p blocks. With ``wl.fp8``: the converted linears' cast traffic and their FP8 operands
    (cost/fp8.py); Mamba-2 (and a hybrid's Mamba-2 blocks): the SSD's traffic (``ssd_bytes_per_token``)."""
    m = max(1, wl.global_batch // (layout.dp * layout.micro_batch))
    tokens = layout.micro_batch * wl.seq_len * m
    per_token = elementwise_bytes_per_token(shape, prec, wl.compiled) + gemm_bytes_per_token(shape, prec)
    recipe, rule, a = wl.fp8, wl.fp8_filter, prec.act
    per_token += fp8.cast_bytes_per_token(shape, recipe, rule, a) + fp8.operand_bytes_per_token(shape, recipe, rule, a)
    if isinstance(shape, (Mamba2Shape, HybridShape)):
        ssd = shape if isinstance(shape, Mamba2Shape) else shape.mamba  # its n_layers: the Mamba-2 blocks
        per_token += ssd.n_layers * ssd_bytes_per_token(ssd, wl.seq_len, wl.ssd_kernel)
    gathered_fp8 = fp8.gather_bytes_per_param(prec.gather, recipe, layout.strategy) < prec.gather
    gathered_fp8 = gathered_fp8 and layout.shard_size > 1 and layout.strategy in ("fsdp", "hsdp")
    # the converted weights' cast reads their fp32 master (autocast, fp32) or FSDP's bf16 gathered parameters
    weight_source = 2 if layout.strategy in ("fsdp", "hsdp") and prec.gather == 2 else int(prec.weight)
    cast_weights = fp8.cast_weight_bytes(shape, recipe, rule, weight_source, gathered_fp8)
    weights = m * (gemm_weight_bytes(shape, prec) + fp8.operand_weight_bytes(shape, recipe, rule, a) + cast_weights)
    total = (tokens * per_token + weights) / (layout.pp * layout.tp) + parameter_traffic_bytes(shape, layout, wl, prec)
    return total / (device.hbm_tb_per_s * 1e12 * device.hbm_efficiency)


def optimizer_seconds(shape: ModelShape | MambaShape, layout: Layout, prec: Precision, device: Device) -> float:
    """Gradient clipping + AdamW over this device's optimizer shard: Ψ_opt × ``device.optimizer_bytes_per_param``
    (fused AdamW + foreach clipping, fitted: docs/cost-model.md) — Ψ_opt = Ψ_dev (all of its parameters, embedding
    included), / z under ZeRO/FSDP."""
    psi = shape.num_params / (layout.pp * layout.tp)
    if layout.strategy != "ddp":
        psi /= layout.shard_size
    return psi * device.optimizer_bytes_per_param / (device.hbm_tb_per_s * 1e12 * device.hbm_efficiency)


def host_seconds(
    shape: ModelShape | MambaShape, layout: Layout, wl: Workload, device: Device, dtensor_tp: bool = True
) -> float:
    """The host's floor for one step: m·(L/p·per-block + outside the blocks) + per step.

    Eager blocks: ``shape.eager_ops_per_block`` ATen ops (121 per Llama block, forward + backward) × ``host_op_us``
    (the host's cost of one eager op with autocast and autograd; fitted on the tiny run, which is host-bound);
    compiled blocks: ``host_layer_us_compiled`` per block (a few graph launches); tensor-parallel blocks
    ``host_tp_layer_us`` (fitted: TP blocks are host-bound on DTensor's hooks and their collectives' issue and
    wait). Outside the blocks
    ``HEAD_EAGER_OPS`` ops per micro-batch; per step ``host_step_us`` (optimizer, clipping, the guard's check).
    ``wl.cuda_graphs`` on one device or tensor parallelism alone (the runs the trainer captures): ``host_graph_us`` per
    micro-batch (copy the ids in, launch the graph) instead of the blocks' and head's launches."""
    m = max(1, wl.global_batch // (layout.dp * layout.micro_batch))
    if wl.cuda_graphs and layout.dp == layout.pp == 1:
        return (m * device.host_graph_us + device.host_step_us) * 1e-6
    if layout.tp > 1 and dtensor_tp:  # DTensor's sequence-parallel hooks and collectives dominate a TP block's host
        block_us = device.host_tp_layer_us
    elif wl.compiled:
        block_us = device.host_layer_us_compiled
    else:
        block_us = device.host_layer_us or shape.eager_ops(wl.seq_len) * device.host_op_us
    per_micro_batch = math.ceil(shape.n_layers / layout.pp) * block_us + HEAD_EAGER_OPS * device.host_op_us
    return (m * per_micro_batch + device.host_step_us) * 1e-6


def fit_efficiency(est: Estimate, measured_step_s: float) -> float:
    """The efficiency that makes ``est`` (a compute-bound run without exposed communication, e.g. one GPU) take
    ``measured_step_s``: only the GEMM/attention arithmetic scales with efficiency, the memory-bound part stays."""
    gemm_s = est.compute_s - est.elementwise_s
    return est.device.efficiency * gemm_s / max(measured_step_s - est.elementwise_s, 1e-12)


def fit_fp8_efficiency(est: Estimate, measured_step_s: float) -> float:
    """The ``fp8_efficiency`` that makes a compute-bound FP8 ``est`` (one GPU) take ``measured_step_s``: only its FP8
    GEMMs (``est.fp8_gemm_s``) scale with it; the bf16 GEMMs (at the fitted ``efficiency``), the casts and the rest
    stay."""
    other = est.step_s - est.fp8_gemm_s
    return est.device.fp8_gemm_efficiency * est.fp8_gemm_s / max(measured_step_s - other, 1e-12)


def fit_host_op_us(est: Estimate, measured_step_s: float) -> float:
    """The ``host_op_us`` that makes a host-bound eager ``est`` (``est.host_s`` ≥ its compute) take
    ``measured_step_s``: the per-step part stays, the per-op part scales."""
    device = est.device
    fixed = device.host_step_us * 1e-6
    return device.host_op_us * (measured_step_s - fixed) / max(est.host_s - fixed, 1e-12)


def bubble_fraction(layout: Layout, micro_batches: int) -> float:
    """Pipeline idle time / compute: (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) for interleaved 1F1B (v chunks), a
    third of that for interleaved zero-bubble (ZB-H1's bubble with equal forward, input-gradient and weight-gradient
    times, Qi et al. 2024; not measured here)."""
    if layout.pp == 1:
        return 0.0
    v = layout.pp_chunks if layout.pp_schedule in ("interleaved", "zerobubble") else 1
    share = 1 / 3 if layout.pp_schedule == "zerobubble" else 1.0
    return share * (layout.pp - 1) / (v * micro_batches)


def resolve_shape(shape: ModelShape | MambaShape, device: Device) -> ModelShape | MambaShape:
    """``expand_kv=None`` → what the trainer does on the device: K/V expanded on ROCm, native GQA elsewhere."""
    if isinstance(shape, ModelShape) and shape.expand_kv is None:
        return dataclasses.replace(shape, expand_kv=device.vendor == "rocm")
    return shape


def estimate(
    shape: ModelShape, layout: Layout, wl: Workload, device: Device, prec: Precision | None = None
) -> Estimate:
    """Memory, step time and totals of one layout.

    compute_s = flops_per_token(s)·B·s·(4/3 with full AC) / (world · peak · efficiency), the converted linears'
                FLOPs (``wl.fp8``) at the FP8 peak · fp8 efficiency instead (cost/fp8.py), the Triton SSD's
                (Mamba-2) at ``ssd_efficiency``
                + memory-bound time (elementwise_seconds, × the same recompute factor; Mamba's scan at ``scan_ns``)
                + optimizer_seconds
                (+ under anytrain's TP the LM head's share that every TP rank repeats: 6·V·d and its traffic, and
                Mamba-2's B/C projections where tp does not divide the groups;
                none with ``wl.tp_sequence_loss``, which adds an exposed V·d·a all-reduce per micro-batch instead)
    host_s = host_seconds (the host's launch floor)
    step_s = max(compute_s · (1 + bubble) + exposed communication, host_s) (the GPU's time or the host's launch
             floor, whichever is longer: docs/cost-model.md, "What still misses");  steps = D / (B·s);
    energy = total_s·world·watts.
    A ``wl.fp8`` recipe the trainer would refuse (a device without FP8, a family without FP8 layers, no layer left by
    the filter) is a ConfigError naming ``train.fp8``. MFU (``Estimate.mfu``) stays against the dense bf16 peak.
    """
    prec = prec or trainer_precision(layout.strategy)
    shape = resolve_shape(shape, device)
    fp8.check_fp8(shape, device, wl.fp8, wl.fp8_filter)
    m = wl.global_batch // (layout.dp * layout.micro_batch)
    tokens_per_step = wl.global_batch * wl.seq_len
    flops = shape.flops_per_token(wl.seq_len) * tokens_per_step
    recompute = 1.0 + ac_fraction(layout.ac) / 3.0  # a recomputed forward is a third of forward + backward
    fp8_flops = fp8.gemm_split_per_token(shape, wl.fp8, wl.fp8_filter) * tokens_per_step
    mamba2 = shape if isinstance(shape, Mamba2Shape) else shape.mamba if isinstance(shape, HybridShape) else None
    ssd_flops = 0.0
    if mamba2 is not None and wl.ssd_kernel == "triton":  # the SSD's chunked matmuls at their benchmarked rate
        ssd_flops = mamba2.ssd_flops_per_token(wl.seq_len) * tokens_per_step
    gemm_s = (flops - fp8_flops - ssd_flops) * recompute / (layout.world * device.peak_flops * device.efficiency)
    gemm_s += ssd_flops * recompute / (layout.world * device.peak_flops * device.ssd_efficiency)
    fp8_gemm_s = 0.0
    if fp8_flops:  # the converted linears' GEMMs at the FP8 rate
        fp8_rate = device.peak_fp8_tflops * 1e12 * device.fp8_gemm_efficiency
        fp8_gemm_s = fp8_flops * recompute / (layout.world * fp8_rate)
    gemm_s += fp8_gemm_s
    elementwise_s = elementwise_seconds(shape, layout, wl, prec, device) * recompute
    repeated_head = layout.tp > 1 and prec.framework == "anytrain" and not sequence_loss_applies(layout, wl)
    if repeated_head:  # every TP rank runs the whole (unsplit) LM head and loss
        head_tokens = tokens_per_step / (layout.dp * layout.pp) * (1 - 1 / layout.tp)
        gemm_s += 6.0 * shape.vocab_size * shape.dim * head_tokens / (device.peak_flops * device.efficiency)
        head_bytes = 3 * prec.act * (shape.dim + 2 * shape.vocab_size)  # head GEMM operands + the CE row kernel
        elementwise_s += head_bytes * head_tokens / (device.hbm_tb_per_s * 1e12 * device.hbm_efficiency)
    if mamba2 is not None and replicated_bc(mamba2, layout.tp):  # every TP rank computes the whole B and C
        # projections (6·d·2GN per token and Mamba-2 block) instead of its 1/tp of them
        gn_flops = 6.0 * mamba2.dim * 2 * mamba2.ngroups * mamba2.d_state * mamba2.n_layers / layout.pp
        gemm_s += gn_flops * tokens_per_step / layout.dp * (1 - 1 / layout.tp) / (device.peak_flops * device.efficiency)
    if isinstance(shape, MambaShape):  # the selective scan (forward + backward) at its benchmarked rate
        tokens_per_device = wl.global_batch * wl.seq_len / layout.dp
        elementwise_s += tokens_per_device * shape.n_layers / layout.pp * shape.d_inner * device.scan_ns * 1e-9
    optimizer_s = optimizer_seconds(shape, layout, prec, device)
    elementwise_s += optimizer_s
    compute_s = gemm_s + elementwise_s
    bubble_s = (compute_s - optimizer_s) * bubble_fraction(layout, m)
    comm = communication(shape, layout, wl, prec, device, compute_s)
    dtensor_tp = layout.tp > 1 and prec.framework == "anytrain"  # anytrain's TP: DTensor (not Megatron's kernels)
    host_s = host_seconds(shape, layout, wl, device, dtensor_tp)
    gpu_s = compute_s + bubble_s + sum(c.exposed_seconds for c in comm)
    notes = ["host-bound: kernel launches take longer than the GPU's work"] if host_s > gpu_s else []
    step_s = max(gpu_s, host_s)
    tokens = wl.tokens or 20.0 * shape.num_params
    phases = memory_phases(shape, layout, wl, prec, device.blas_workspace_mib)
    phase = max(phases, key=lambda name: sum(phases[name].values()))
    memory = phases[phase]
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
        phase,
        optimizer_s,
        fp8_gemm_s,
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
