"""Peak memory per device: what each tensor the training step holds costs, and when the allocator peaks.

Every count below was checked against the tensors the code really saves (``torch.autograd.graph.saved_tensors_hooks``
on CPU, eager and torch.compile, in tests/unit/test_cost_model.py) and against measured allocator peaks
(docs/cost-model.md, "Validation against H200 measurements"). Notation: a activation bytes, r residual bytes, d
width, d_kv K/V width seen by attention, F FFN width, H heads, V vocabulary, N tokens of a micro-batch, t/p/z
tensor-, pipeline-parallel and ZeRO shard-group sizes. The peak is the largest of three moments of a step:

- ``forward``: the end of a micro-batch's forward, in the loss (every activation saved, the loss's chunk of logits);
- ``backward``: the start of its backward (the loss's weight-gradient temporaries; FSDP's prefetched block; under
  activation checkpointing, one recomputed block);
- ``optimizer``: the optimizer step (activations freed, full gradients, the ZeRO-1 all-gather buffers).

With gradient accumulation (m > 1) every micro-batch after the first runs its forward with the accumulated gradients
alive; with m = 1 the trainer's ``zero_grad(set_to_none=True)`` means the forward runs without gradients.
"""

from __future__ import annotations

import math

from anytrain.cost import fp8
from anytrain.cost.shapes import (
    MIB,
    HybridShape,
    Layout,
    Mamba2Shape,
    MambaShape,
    ModelShape,
    Precision,
    Workload,
    sequence_loss_applies,
)

LOGITS_CHUNK_BYTES = 256 * MIB  # anytrain.kernels.fused_linear_ce.LOGITS_CHUNK_BYTES
BLAS_WORKSPACES = 2  # cuBLAS/hipBLAS workspaces: one per (thread, stream): the forward thread and autograd's thread
AC_POLICIES = {"none": 0.0, "selective": 0.5, "full": 1.0}


def ac_fraction(policy: str) -> float:
    """Share of blocks under activation checkpointing: none 0, selective 1/2 (every other block), full 1."""
    return AC_POLICIES[policy]


def residual_bytes(shape: ModelShape | MambaShape, prec: Precision) -> int:
    """Bytes of the residual stream. Transformer: 4 when ``residual_fp32`` meets autocast, else the activation dtype
    (anytrain casts the embedding output to the autocast dtype). Mamba: 4 when ``residual_fp32`` (its blocks upcast
    the residual, also under FSDP's bf16 parameters), else the activation dtype (the embedding output is cast to the
    autocast dtype, as for the Transformer). Mamba-2 and hybrids as Mamba."""
    if isinstance(shape, (MambaShape, Mamba2Shape, HybridShape)):
        return 4 if shape.residual_fp32 else prec.act
    return 4 if shape.residual_fp32 and prec.autocast else prec.residual


def kv_width(shape: ModelShape) -> int:
    """K/V width that attention saves: d when K/V heads are expanded to H heads, d_kv with native GQA."""
    return shape.dim if shape.expand_kv else shape.kv_dim


def activation_bytes_per_token(
    shape: ModelShape | MambaShape | Mamba2Shape,
    prec: Precision,
    compiled: bool,
    tp: int = 1,
    ddp_split: bool = False,
    seq_len: int = 0,
    ssd_kernel: str = "triton",
) -> float:
    """Bytes one block saves for backward per token of its micro-batch, on one of ``tp`` tensor-parallel ranks
    (Mamba: ``mamba_activation_bytes_per_token``; Mamba-2, at ``seq_len`` with ``ssd_kernel``:
    ``mamba2_activation_bytes_per_token``).

    Transformer, compiled block (the AOT partitioner recomputes norms, RoPE and residual adds from what it saves):
        r·d (block input) + 5·a·d (the two norm outputs, q, the attention output, the o-projection output from
        which the mid residual is recomputed) + 2·a·d_kv (k, v) + 3·a·F (SwiGLU gate, up, product; GELU 2·a·F)
        + 4·H (flash attention's fp32 log-sum-exp) + 2·4 (the norms' fp32 1/rms; LayerNorm 2·8: mean and 1/std)
        (+ with QK-norm: q and k before their norms, a·(d + d_kv), and 4·(H + K) statistics)
    eager block (every op saves its inputs):
        2·(4·d + 4·d) (each RMSNorm keeps its fp32 input and fp32 normalised output) + the matmul inputs: 2·a·d when
        the residual has the compute dtype, else c·a·d (autocast casts the norm output once per consuming matmul:
        c = 5 SwiGLU / 4 GELU) + a·d (q) + 2·a·d_kv + a·d (attention output) + 4·a·F (w1 out, silu out, w3 out,
        product; GELU 2·a·F) + 4·H + 2·4
    ``ddp_split``: torch.compile under DDP splits each block's graph at DDP's bucket boundaries (dynamo's
    DDPOptimizer); when the down projection has a bucket to itself the SwiGLU saves one more a·F (silu output).
    Tensor parallelism (sequence parallel) divides everything by t except, for anytrain's DTensor plan, the two
    all-gathered norm outputs (the column-parallel matmuls save the full-sequence input); Megatron re-gathers them
    in backward, so all of it divides by t (Korthikanti et al. 2022).
    For GPT (GELU, MHA, bf16 residual) the compiled count is Korthikanti's 34·s·b·h without the two dropout masks
    (and without the s² attention matrix: flash attention), i.e. 32·d + 4·H + 8.
    """
    if isinstance(shape, MambaShape):
        return mamba_activation_bytes_per_token(shape, prec, compiled)
    if isinstance(shape, Mamba2Shape):
        return mamba2_activation_bytes_per_token(shape, prec, seq_len, ssd_kernel, tp, compiled)
    if isinstance(shape, HybridShape):
        return hybrid_activation_bytes_per_token(shape, prec, seq_len, ssd_kernel, tp, compiled)
    d, f, a, r = shape.dim, shape.ffn_dim, prec.act, residual_bytes(shape, prec)
    kv, swiglu = kv_width(shape), shape.mlp == "swiglu"
    small = 4 * shape.n_heads + shape.norm_stat_bytes  # log-sum-exp, the norms' fp32 1/rms (LayerNorm: mean, 1/std)
    if shape.qk_norm:  # q and k before their norms, and the norms' fp32 statistics per head
        small += a * (d // shape.n_heads) * (shape.n_heads + shape.n_kv_heads) + 4 * (shape.n_heads + shape.n_kv_heads)
    gathered = 2 * a * d if prec.framework == "anytrain" and tp > 1 else 0.0  # norm outputs, full sequence
    if compiled:
        mlp = (3 if swiglu else 2) * a * f + (a * f if ddp_split and swiglu else 0)
        sharded = r * d + 5 * a * d + 2 * a * kv + mlp + small
        return (sharded - gathered) / tp + gathered
    casts = 2 if r == a else (5 if swiglu else 4)
    mlp = (4 if swiglu else 2) * a * f
    sharded = 16 * d + casts * a * d + 2 * a * d + 2 * a * kv + mlp + small
    return (sharded - gathered) / tp + gathered


def mamba_activation_bytes_per_token(shape: MambaShape, prec: Precision, compiled: bool = True) -> float:
    """Bytes one Mamba block saves per token.

    The fused mixer op (kernels/mamba_inner.py) saves its input h (a·d), xz (2·a·E), x_dbl (a·(R + 2S)), the scan
    output y (a·E) and the scan's fp32 state every ``state_every`` steps (4·E·S/state_every per token); it recomputes
    the conv output and Δ. Around it, compiled: the block input (r·d) and the norm's 1/rms; eager: the RMSNorm's fp32
    input and fp32 normalised output (8·d)."""
    d, e, a = shape.dim, shape.d_inner, prec.act
    mixer = a * d + a * (2 * e + shape.dt_rank + 2 * shape.d_state + e) + 4 * e * shape.d_state / shape.state_every
    around = residual_bytes(shape, prec) * d + 4 if compiled else 8 * d + 4
    return around + mixer


def hybrid_activation_bytes_per_token(
    shape: HybridShape,
    prec: Precision,
    seq_len: int,
    ssd_kernel: str = "triton",
    tp: int = 1,
    compiled: bool = False,
) -> float:
    """Mean bytes one hybrid block saves per token, on one of ``tp`` TP ranks. Mamba-2 blocks:
    ``mamba2_activation_bytes_per_token`` (with ``compiled``); attention and MLP blocks: their parts of the compiled
    Transformer block's count, each with its own input r·d and norm output a·d (whole on every TP rank: no sequence
    parallelism) — attention q, its output and k, v (3·a·d + 2·a·d_kv), flash attention's fp32 log-sum-exp 4·H and
    the norm's 1/rms; the MLP a·F per saved SwiGLU tensor (3·a·F; GELU 2·a·F) and the norm's 1/rms; the parts after
    the column-parallel projections divided by tp."""
    d, a, r, t = shape.dim, prec.act, residual_bytes(shape, prec), tp
    attention = r * d + a * d + (3 * a * d + 2 * a * shape.kv_dim + 4 * shape.attn_heads) / t + 4
    mlp = r * d + a * d + (3 if shape.mlp == "swiglu" else 2) * a * shape.ffn_dim / t + 4
    mamba = (
        mamba2_activation_bytes_per_token(shape.mamba, prec, seq_len, ssd_kernel, tp, compiled)
        if shape.n_mamba
        else 0.0
    )
    return (shape.n_mamba * mamba + shape.n_attention * attention + shape.n_mlp * mlp) / shape.n_layers


def mamba2_activation_bytes_per_token(
    shape: Mamba2Shape,
    prec: Precision,
    seq_len: int,
    ssd_kernel: str = "triton",
    tp: int = 1,
    compiled: bool = False,
) -> float:
    """Bytes one Mamba-2 block saves per token, eager, at sequence length s (counted byte-exact against the tensors
    autograd saves, tests/unit/test_cost_mamba2.py; G = 1 groups, H > G).

    Around the SSD (a activation bytes): the RMSNorm's fp32 input and output and 1/rms 8·D + 4; in_proj's input
    a·D; the gated RMSNorm's fp32 y, z, silu(z), their product and the normalised product 20·E and its 1/rms 4·G;
    out_proj's input a·E. ``ssd_kernel`` 'triton' (the GPU's kernels): the Triton conv's input a·C (C = E + 2GN
    channels) and the Triton SSD's (``kernels.ssd_triton``) inputs, which keep two storages alive: in_proj's whole
    output a·(2E + 2GN + H) (through Δ, a view of it) and the conv's output a·C (through x), plus B and C copies
    2·a·G·N. 'torch' (CPU tensors: the PyTorch twins, e = 2 under autocast, else 4): the conv's zero-padded input
    e·C·(s + K − 1)/s and its pre-activation e·C, and ``ssd_activation_bytes_per_token`` with einsum operands of e
    bytes.

    On one of ``tp`` TP ranks (the mixer split over heads, no sequence parallelism): the norm, in_proj's input and
    the gated norm's statistics are whole; the head-sized parts (E, H) are divided by tp, and so are B and C (2GN)
    where tp divides the groups, else whole (replicated); the twin's SSD count is divided by tp (its per-head
    terms dominate).

    ``compiled`` (torch.compile'd blocks: inductor fuses both norms and recomputes their fp32 intermediates): the
    RMSNorm keeps the block input r·D and 1/rms instead of 8·D, and the gated norm the SSD's output y, a·E, instead
    of its five fp32 tensors 20·E (z is in in_proj's output, already kept). Measured: the mamba2-1.3b recipe without
    checkpointing (bench/results/mamba2_train_nvidia-h200.json) keeps 1.02x this count."""
    d, e, a, c, t = shape.dim, shape.d_inner, prec.act, shape.conv_dim, tp
    gn = 2 * shape.ngroups * shape.d_state
    gn_t = gn / t if shape.ngroups % t == 0 else gn
    norm = residual_bytes(shape, prec) * d + 4 if compiled else 8 * d + 4
    gated = a * e / t if compiled else 20 * e / t
    around = norm + a * d + gated + 4 * shape.ngroups + a * e / t
    if ssd_kernel == "triton":
        conv_t, in_proj_t = e / t + gn_t, (2 * e + shape.nheads) / t + gn_t
        return around + a * conv_t + a * (in_proj_t + conv_t + gn_t)
    p, s = 2 if prec.autocast else 4, max(seq_len, 1)  # the PyTorch conv: padded input and pre-activation
    conv = (p * c * (s + shape.d_conv - 1) / s + p * c) * (e / t + gn_t) / c
    return around + conv + ssd_activation_bytes_per_token(shape, p, seq_len) / t


def ssd_activation_bytes_per_token(shape: Mamba2Shape, operand_bytes: int, seq_len: int) -> float:
    """Bytes the chunked SSD (``kernels.ssd.ssd_chunk_scan_torch``, autograd through its PyTorch ops) saves per
    token, at sequence length s padded to c·Q positions (c = ⌈s/Q⌉ chunks, Q = min(chunk_size, s)), e the einsum
    operands' bytes (2 under autocast, which runs the einsums' batched matmuls in bf16; 4 without):
    per padded position 4·H·Q (the decays exp(segment sums), fp32) + e·H·Q (the masked scores as the matmul's
    operand) + e·H·N (B times the last row of decays, the end-state einsum's intermediate) + 3·e·E (Δx and its two
    matmul layouts) + e·G·Q (C·Bᵀ) + (4 + 3·e)·G·N (B and C in fp32 and their operand copies) + 4·H (the decay's
    per-position factor from the chunk start); per real position 4·E (x in fp32) + 8·H (Δ before and after the
    softplus); per chunk (4 + e)·E·N (the state entering it, as the state-passing loop's product saves it and as
    the stacked operand of the output einsum)."""
    q = shape.chunk(seq_len)
    s = max(seq_len, 1)
    chunks = -(-s // q)
    h, e, n, g, p = shape.nheads, shape.d_inner, shape.d_state, shape.ngroups, operand_bytes
    padded = 4 * h * q + p * h * q + p * h * n + 3 * p * e + p * g * q + (4 + 3 * p) * g * n + 4 * h
    per_chunk = (4 + p) * e * n
    return (padded * chunks * q + (4 * e + 8 * h) * s + per_chunk * chunks) / s


def compiled_checkpoint_kept(shape: object, prec: Precision, tp: int = 1) -> tuple[float, float]:
    """(bytes per token, bytes) a compiled, checkpointed block keeps beside its input, mean over the blocks:
    inductor's partitioner does not recompute a matmul inside a checkpointed region, so what the ops after one need
    for backward stays saved. Mamba-2 (measured: the memory snapshot of the mamba2-1.3b recipe's profiled step,
    bench/results/mamba2_train_nvidia-h200.json, key memory_snapshot): in_proj's output a·(2E + 2GN + H) and its
    input in the compute dtype a·D per token, and in_proj's weight in the compute dtype twice (the cast pieces
    ``_StackedLinear`` saves and their concatenation); the head-sized parts divided by tp. Hybrids, by the same rule
    (checked by the hybrid-1.2b recipe's peak in that file, not by a snapshot): their Mamba-2 blocks as Mamba-2's,
    attention blocks q, k, v and the attention output a·(2D + 2·D_kv) and its fp32 log-sum-exp 4·H, MLP blocks the
    two SwiGLU projections' outputs 2·a·F (GELU a·F; the product is recomputed). Other families: 0 (their
    checkpointed compiled blocks are not measured)."""
    if isinstance(shape, HybridShape):
        a, t = prec.act, tp
        mamba, weights = compiled_checkpoint_kept(shape.mamba, prec, tp) if shape.n_mamba else (0.0, 0.0)
        attention = (a * (2 * shape.dim + 2 * shape.kv_dim) + 4 * shape.attn_heads) / t
        mlp = (2 if shape.mlp == "swiglu" else 1) * a * shape.ffn_dim / t
        per_token = shape.n_mamba * mamba + shape.n_attention * attention + shape.n_mlp * mlp
        return per_token / shape.n_layers, weights * shape.n_mamba / shape.n_layers
    if not isinstance(shape, Mamba2Shape):
        return 0.0, 0.0
    a, t = prec.act, tp
    gn = 2 * shape.ngroups * shape.d_state
    gn_t = gn / t if shape.ngroups % t == 0 else gn
    in_proj_t = (2 * shape.d_inner + shape.nheads) / t + gn_t
    return a * (in_proj_t + shape.dim), 2 * a * shape.dim * in_proj_t


def loss_bytes_per_token(shape: ModelShape | MambaShape) -> float:
    """Full-logits cross-entropy (Megatron's accounting): 12·V — fp32 log-probabilities saved (4·V) plus, in
    backward, the gradients w.r.t. the log-probabilities and the logits (2 × 4·V)."""
    return 12.0 * shape.vocab_size


def head_activation_bytes_per_token(
    shape: ModelShape | MambaShape, prec: Precision, tp: int = 1, sequence_loss: bool = False
) -> float:
    """anytrain's last stage outside the blocks, per token: the eager final RMSNorm's fp32 input, normalised output and
    1/rms (8·d + 4, sequence-parallel under TP) and the fused loss's saved input gradient (a·d, full sequence; the
    rank's shard of it with ``parallel.tp_sequence_loss``)."""
    return (8 * shape.dim + 4) / tp + prec.act * shape.dim / (tp if sequence_loss else 1)


def loss_chunk_bytes(tokens: int, vocab: int, act: int) -> float:
    """One chunk of logits of the fused linear + cross-entropy: rows·V·a with the chunk count
    ⌈N·V·a / 256 MiB⌉ and rows = ⌈N / chunks⌉ (``fused_linear_ce.default_chunk_rows``)."""
    chunks = max(1, math.ceil(tokens * vocab * act / LOGITS_CHUNK_BYTES))
    return math.ceil(tokens / chunks) * vocab * act


def pp_in_flight(layout: Layout, micro_batches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: GPipe m; 1F1B min(p, m);
    interleaved 1F1B min(m, p·(1 + (p−1)/(p·v))) (Korthikanti et al. 2022, §4.2.3); interleaved zero-bubble as
    interleaved 1F1B (ZB1P keeps 1F1B's activation memory, Qi et al. 2024)."""
    p, m = layout.pp, micro_batches
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    if layout.pp_schedule in ("interleaved", "zerobubble"):
        return min(m, p * (1 + (p - 1) / (p * layout.pp_chunks)))
    return float(min(p, m))


def ddp_splits_blocks(shape: ModelShape | MambaShape, layout: Layout, wl: Workload, prec: Precision) -> bool:
    """torch.compile'd blocks inside DDP are split at DDP's buckets; the SwiGLU saves one more tensor when the down
    projection's fp32 weight (4·d·F/t bytes) fills a bucket alone (checked on CPU with gloo DDP)."""
    if not isinstance(shape, ModelShape) or shape.mlp != "swiglu" or not wl.compiled or prec.framework != "anytrain":
        return False
    wrapped = layout.strategy in ("ddp", "zero1") and layout.dp > 1
    return wrapped and prec.ddp_bucket > 0 and 4 * shape.dim * shape.ffn_dim / layout.tp >= wl.ddp_bucket_mib * MIB


def memory_phases(
    shape: ModelShape | MambaShape, layout: Layout, wl: Workload, prec: Precision, workspace_mib: float = 32.0
) -> dict[str, dict[str, float]]:
    """Bytes on the most loaded device at the forward / backward / optimizer moments, by component (see the module
    docstring). Pipeline parallelism: the first stage (ceil(L/p) blocks, the embedding, min(p, m) micro-batches in
    flight under 1F1B) and the last (the head and the loss) are both evaluated; the one with the larger peak is
    returned. ``workspace_mib``: one BLAS workspace (32 MiB on Hopper: ``Device.blas_workspace_mib``)."""
    stages = [(True, True)] if layout.pp == 1 else [(True, False), (False, True)]
    best: dict[str, dict[str, float]] = {}
    for first, last in stages:
        phases = _stage_phases(shape, layout, wl, prec, workspace_mib, first, last)
        if max(sum(v.values()) for v in phases.values()) > max((sum(v.values()) for v in best.values()), default=-1):
            best = phases
    return best


def _stage_phases(
    shape, layout: Layout, wl: Workload, prec: Precision, workspace_mib: float, first: bool, last: bool
) -> dict[str, dict[str, float]]:
    t, p, z, anytrain = layout.tp, layout.pp, layout.shard_size, prec.framework == "anytrain"
    layers = math.ceil(shape.n_layers / p) if first else shape.n_layers // p
    m = max(1, wl.global_batch // (layout.dp * layout.micro_batch))
    tokens = layout.micro_batch * wl.seq_len
    v, d, a = shape.vocab_size, shape.dim, prec.act
    sharded_params = layout.strategy in ("fsdp", "hsdp") and z > 1
    wrapped = layout.strategy in ("ddp", "zero1") and layout.dp > 1
    bucket_views = wrapped and wl.ddp_bucket_view  # the gradients are DDP's buckets: no copy, never freed
    # parameters on this device: blocks / t; embedding / t (row-parallel); anytrain's LM head is not split by TP
    blocks = layers * shape.layer_params / t
    root = first * shape.embedding_params / t + last * shape.head_params / (1 if anytrain else t)
    psi = blocks + root

    persistent = {
        "weights": psi * prec.weight / (z if sharded_params else 1),
        "optimizer": psi * prec.optimizer / (z if layout.strategy != "ddp" else 1),
        "ddp_buckets": psi * prec.ddp_bucket if wrapped and not bucket_views else 0.0,
        "workspace": BLAS_WORKSPACES * workspace_mib * MIB,
    }
    grads_final = psi * prec.grad / (z if layout.strategy in ("zero2", "fsdp", "hsdp") else 1)
    # anytrain frees gradients after each step (Megatron keeps its buffers; so do anytrain's CUDA-graph runs)
    # (nor when they are DDP's buckets, zeroed in place: parallel.ddp_bucket_view)
    accumulating = m > 1 or not anytrain or (wl.cuda_graphs and layout.dp == layout.pp == 1) or bucket_views
    grads_fwd = {}
    if accumulating and sharded_params and prec.nosync_grad:
        grads_fwd["nosync_grads"] = psi * prec.nosync_grad  # FSDP2: unsharded, in the reduce dtype
    elif accumulating:
        grads_fwd["grads"] = grads_final

    # activations: blocks (× micro-batches in flight on the first stage), then the head and the loss
    f = ac_fraction(layout.ac)
    in_flight = pp_in_flight(layout, m) if first else 1.0
    split = ddp_splits_blocks(shape, layout, wl, prec)
    per_token = activation_bytes_per_token(shape, prec, wl.compiled, t, split, wl.seq_len, wl.ssd_kernel)
    per_token -= fp8.saved_input_savings_per_token(shape, wl.fp8, wl.fp8_filter, prec.act, wl.compiled) / t
    checkpointed = residual_bytes(shape, prec) * d / t
    acts = {"activations": (f * checkpointed + (1 - f) * per_token) * tokens * layers * in_flight}
    kept_per_token, kept_weights = compiled_checkpoint_kept(shape, prec, t) if wl.compiled and f else (0.0, 0.0)
    if kept_per_token:
        acts["compiled_checkpoint_kept"] = f * (kept_per_token * tokens + kept_weights) * layers * in_flight
    loss_fwd = loss_bwd = 0.0
    if last and anytrain:
        sharded_loss = sequence_loss_applies(layout, wl)
        head = head_activation_bytes_per_token(shape, prec, t, sharded_loss)
        acts["head_activations"] = head * tokens + 4 * v * d  # + dW fp32
        narrow = a < 4  # bf16 compute: the chunk's dW product and the returned weight gradient are separate tensors
        scored = tokens // t if sharded_loss else tokens  # the positions this rank's loss scores
        loss_fwd = loss_chunk_bytes(scored, v, a) + narrow * a * v * d + prec.autocast * a * v * d  # + cast head
        loss_bwd = 4 * v * d + narrow * a * v * d + sharded_loss * a * v * d  # + the head gradient's all-reduce copy
    elif last:
        loss_fwd = loss_bwd = loss_bytes_per_token(shape) * tokens / t

    # bf16 weights the blocks use: autocast's copies saved per micro-batch in flight, or FSDP's gathered units
    copies: dict[str, float] = {}
    copies_bwd: dict[str, float] = {}
    if sharded_params:
        converted = fp8.converted_params_per_layer(shape, wl.fp8, wl.fp8_filter) / t  # FP8 all-gather: 1 byte each
        gather_fp8 = fp8.gather_bytes_per_param(prec.gather, wl.fp8, layout.strategy)
        unit = (shape.layer_params / t - converted) * prec.gather + converted * gather_fp8
        root_gathered = root * prec.gather  # the root module is never resharded after forward
        all_kept = not layout.reshard_after_forward or layout.keeps_gathered(m)  # ZeRO-2, or gathered all step
        kept = layers * unit if all_kept else unit  # else the last block stays gathered
        copies["gathered_params"] = kept + root_gathered
        copies_bwd["gathered_params"] = (kept if all_kept else 2 * unit) + root_gathered
    elif prec.compute_copy and not isinstance(shape, MambaShape):  # the fused mixer casts inside, saves fp32 weights
        per_mb = in_flight if (wl.compiled or p == 1) else 1.0  # eager PP: one autocast cache for the whole step
        # FP8 layers cast their fp32 weights straight to FP8 inside: no bf16 copy of those (cost/fp8.py)
        copied = blocks - layers * fp8.converted_params_per_layer(shape, wl.fp8, wl.fp8_filter) / t
        copies["compute_copy"] = copied * prec.compute_copy * (1 - f) * per_mb
        copies_bwd["compute_copy"] = copies["compute_copy"]
    recompute = 0.0
    if f:  # backward recomputes one checkpointed block: its activations and its weight copy
        recompute = per_token * tokens + (shape.layer_params / t * prec.compute_copy if not sharded_params else 0.0)

    forward = {**persistent, **grads_fwd, **copies, **acts, "transient": loss_fwd}
    backward = {**persistent, **grads_fwd, **copies_bwd, **acts, "transient": max(loss_bwd, recompute)}
    optimizer = {**persistent, "grads": grads_final}
    if layout.strategy == "zero1" and anytrain and z > 1:  # Zero1AdamW's all-gather: own segment + gathered flat
        optimizer["zero1_gather"] = psi * prec.weight * (1 + 1 / z)
    return {
        name: {k: val for k, val in phase.items() if val}
        for name, phase in (("forward", forward), ("backward", backward), ("optimizer", optimizer))
    }


def memory_per_device(
    shape: ModelShape | MambaShape, layout: Layout, wl: Workload, prec: Precision, workspace_mib: float = 32.0
) -> dict[str, float]:
    """Peak bytes on the most loaded device, by component: the largest of ``memory_phases``.

    Ψ_dev = (L/p blocks + the embedding on the first stage + the head on the last) / t (anytrain's head is not split
    by TP). With ZeRO shard-group size z: weights Ψ_dev·w / (z if ZeRO-3); optimizer Ψ_dev·o / (z unless DDP);
    gradients Ψ_dev·g (/ z if ZeRO-2/3) — for FSDP2 while accumulating, the unsharded fp32 Ψ_dev·4 instead; DDP
    buckets Ψ_dev·4; the bf16 weight copies of the blocks (autocast) or FSDP's gathered units; activations
    A·b·s × L/p × micro-batches in flight; the head's and the loss's tensors; two BLAS workspaces.
    """
    phases = memory_phases(shape, layout, wl, prec, workspace_mib)
    return max(phases.values(), key=lambda mem: sum(mem.values()))


def peak_phase(shape, layout: Layout, wl: Workload, prec: Precision, workspace_mib: float = 32.0) -> str:
    """Which moment holds the peak: 'forward', 'backward' or 'optimizer'."""
    phases = memory_phases(shape, layout, wl, prec, workspace_mib)
    return max(phases, key=lambda name: sum(phases[name].values()))


def run_memory_estimate(
    cfg: object, dims: object, strategy: str, micro_batch: int, fp32: bool, workspace_mib: float = 0.0
) -> tuple[float, str] | None:
    """(peak allocated GiB per device, the step's moment it occurs) that the cost model predicts for a run about to
    start: ``cfg`` a RunConfig, ``dims`` its ParallelDims, ``strategy`` the trainer's resolved one ('single' is one
    process). None for a model family the cost model does not cover."""
    from anytrain.cost.shapes import FP32, GIB, shape_from_config, trainer_precision
    from anytrain.errors import ConfigError

    try:
        shape = shape_from_config(cfg)
    except ConfigError:
        return None
    if isinstance(shape, ModelShape) and shape.expand_kv is None:  # as models/llama: expanded K/V only on ROCm
        import dataclasses

        from anytrain import hardware

        shape = dataclasses.replace(shape, expand_kv=hardware.vendor() == hardware.ROCM)
    layout = Layout.from_config(cfg, dims, strategy, micro_batch)
    from anytrain import hardware as hw  # Mamba-2's SSD: Triton on GPU tensors, the PyTorch twin on the CPU

    wl = Workload.from_config(cfg, ssd_kernel="triton" if hw.vendor() != hw.CPU else "torch")
    prec = FP32 if fp32 else trainer_precision(layout.strategy)
    phases = memory_phases(shape, layout, wl, prec, workspace_mib)
    phase = max(phases, key=lambda key: sum(phases[key].values()))
    return sum(phases[phase].values()) / GIB, phase
