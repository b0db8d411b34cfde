"""The run configuration's sections as typed dataclasses (one docstring per field), and their conversion from and to
plain dicts: :func:`from_dict` checks every value against its annotation and raises
:class:`~anytrain.errors.ConfigError` naming the field (``train.steps: expected int, got 'ten'``)."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from anytrain.errors import ConfigError


@dataclass
class ModelConfig:
    arch: str = "transformer"
    """Model family in the registry: 'transformer' (Llama-style), 'mamba', 'mamba2', 'hybrid' (Mamba-2, attention and
    MLP blocks in the order of ``model.args.layers_pattern``, e.g. ``M-M-A-``: docs/models.md), or 'hf' (any
    transformers causal LM in ``hf_path``)."""
    flavour: str = "tiny"
    """Named size of the family (see ``anytrain.models.list_flavours()``), e.g. debug, tiny, 125m, 1.1b."""
    args: dict[str, Any] = field(default_factory=dict)
    """Overrides of the flavour's architecture fields (validated by the family's own args class)."""
    init_from: str = ""
    """A local Hugging Face model folder (config.json + safetensors; LlamaForCausalLM or MptForCausalLM for
    'transformer', MambaForCausalLM for 'mamba', Mamba2ForCausalLM for 'mamba2', BambaForCausalLM for 'hybrid') to
    start training from: its weights replace the initial ones before step 0, and its
    config.json sets ``model.args`` (an explicit field that disagrees is an error; max_seq_len may be changed). The
    data must be prepared with the same tokenizer (``anytrain prepare --tokenizer DIR/tokenizer.json``). Empty = random
    init. See docs/evaluation.md."""
    init_device: Literal["device", "cpu"] = "device"
    """Where the initial weights are drawn: 'device' (on the training device, from its generator: fast, and the same
    on every GPU of one vendor's generator) or 'cpu' (drawn by the CPU generator, then copied to the device: the same
    initial weights on CPUs, NVIDIA and AMD GPUs, for comparing training across hardware; costs ~5 s per billion
    parameters on one core; Megatron's ``--use-cpu-initialization``). Ignored with ``init_from``'s weights."""
    hf_path: str = ""
    """With ``arch: hf``: a local Hugging Face model folder (config.json + safetensors) whose
    ``AutoModelForCausalLM`` class is trained as it is (FSDP2/DDP per decoder layer, bf16, activation checkpointing,
    compile); ``model.args`` takes only ``init`` (pretrained | random) and ``attn_implementation`` (sdpa | eager).
    See docs/hf-models.md."""


@dataclass
class DataConfig:
    path: str = "data/shakespeare"
    """Directory written by ``anytrain prepare`` (holds index.json, tokenizer.json and token shards). A relative path
    is resolved against the current working directory when the config is loaded, and the run's config.yaml records
    the absolute path, so ``anytrain eval RUN`` works from any folder (``--data`` points it elsewhere)."""
    seq_len: int = 256
    """Tokens per training sequence (the model sees seq_len tokens and predicts the next one for each)."""
    sources: list[dict[str, Any]] = field(default_factory=list)
    """A weighted mixture of prepared datasets instead of one ``path``: ``[{path: DIR, weight: W, name: N}, ...]``
    (weight > 0, relative to the others; name optional, default the folder's name). All must share one tokenizer.
    Each global batch takes about ``global_batch·weight`` sequences from each source, in an order that is a function
    of (train.seed, step) only (docs/data.md); the metrics record the realised shares (``data_share/NAME``) and the
    validation loss per source (``val_loss/NAME``; ``val_loss`` is their weighted mean). ``path`` is then replaced
    by the first source's (the tokenizer's home for eval and export)."""
    document_mask: bool = False
    """Keep each document of a packed sequence to itself (model.arch transformer, mamba2, hybrid): the data's EOS token
    (index.json's ``eos_id``, appended by ``prepare`` after every document) ends a document, positions restart at the
    next token (RoPE angles, learned position rows; ALiBi's distances are relative already) and a token attends only
    to earlier tokens of its own document; Mamba-2 blocks restart their conv window and SSD state there. The loss is
    unchanged: every position keeps its target, so the EOS still predicts the next document's first token (from its
    own document's context). Costs a mask per batch: on GPUs
    flex_attention with a document-causal block mask instead of SDPA (bench/packing.py measures it); on CPU SDPA with
    an explicit (B, 1, T, T) mask. Not with pipeline parallelism or Mamba-1; CUDA graphs then run eagerly."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Number of optimizer steps."""
    global_batch: int = 32
    """Sequences per optimizer step, over all data-parallel ranks. Fixed when the world size changes."""
    micro_batch: int = 0
    """Sequences per forward/backward on one rank; 0 = global_batch / dp_world (no accumulation)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """LR schedule after warm-up: cosine decay, warmup-stable-decay, or constant."""
    warmup_steps: int = 20
    """Linear warm-up steps from 0 to ``lr``."""
    decay_fraction: float = 0.2
    """For schedule 'wsd': fraction of the steps spent in the final linear decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not to norms, biases)."""
    beta1: float = 0.9
    """AdamW's first-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """AdamW's second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon, > 0."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    stop_at_step: int = 0
    """End this invocation (with a checkpoint) once this step is reached, keeping the schedule of ``steps``;
    0 = run to ``steps``. For time-sliced jobs and moving a run between machines."""
    seed: int = 1234
    """Seeds weight init and the data order; the batch at a step depends only on (seed, step)."""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute precision: bf16 mixed precision (fp32 master weights and reductions) or fp32. auto = bf16 on GPU."""
    compile: bool = False
    """Compile the model with torch.compile (per block or as a whole: ``compile_scope``)."""
    compile_scope: Literal["blocks", "model", "auto"] = "blocks"
    """With ``compile``: blocks = each block on its own (same-shaped blocks share one graph; composes with every
    parallelism); model = the whole body (embedding, all blocks, final norm) as one graph, so that inductor can fuse
    across block boundaries (one process only; compiles several times longer; measured faster on the 1.1B recipe:
    docs/benchmarks.md);
    auto = model in a one-process run (for model.arch hf only when the model runs no attention-mask code,
    docs/hf-models.md), blocks otherwise. Tested for loss parity on CPU (Transformer, Mamba) and with CUDA graphs
    (mamba-130m and an HF Llama, GPU tests); not tested with activation checkpointing."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel preference on GPUs: auto = PyTorch's own choice; flash / cudnn / efficient put that kernel first
    (the others stay as fallbacks for shapes it cannot take); math = the reference kernel. Ignored on CPU."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute block activations in backward to save memory: full = every block, selective = every other block
    (torchtitan's layer-level selective policy: about half the memory saving for a third of the recompute)."""
    log_interval: int = 10
    """Steps between metric log lines (the only steps that synchronise the host with the device)."""
    eval_interval: int = 100
    """Steps between validation evaluations (also at step 0 and at the end); 0 = only at the end."""
    eval_batches: int = 8
    """Global batches of validation data per evaluation (always the same sequences)."""
    spike_factor: float = 0.0
    """Skip the optimizer step when the step loss exceeds this multiple of the running mean loss; 0 = off."""
    check_finite: bool = True
    """Stop before the optimizer step when the loss or gradient norm is not finite (read one step late with
    ``lagged_checks``, else one host sync per step)."""
    log_sample_ids: bool = False
    """Write the global sample ids each rank consumed to samples_rank<r>.jsonl (for data-order audits)."""
    lagged_checks: bool = True
    """Agree on the per-step checks (non-finite gradients, preemption signal, timed checkpoint) one step late, so the
    host never waits for the device: the flags are reduced and copied to the host asynchronously, a non-finite step's
    update is skipped on the device (fused AdamW's found_inf) and the run stops at the next step (or log/save point)
    with the same checkpoint as the synchronous check would save. A preemption signal or timed checkpoint is acted
    on one step later than with the synchronous check (a SIGTERM during step s saves step s + 2, not s + 1). Needs
    the fused optimizer and spike_factor 0; otherwise (or false) the checks synchronise the host with the device
    every step."""
    optimizer_impl: Literal["auto", "fused", "foreach"] = "auto"
    """AdamW kernel: fused (one kernel per parameter group; CUDA, ROCm and, from torch 2.4, CPU), foreach, or auto =
    fused on GPUs and foreach on CPU. Tensor parallelism always updates per tensor (mixed meshes)."""
    cuda_graphs: bool = False
    """Capture one micro-batch's forward + backward as a CUDA/HIP graph on the first step and replay it for every
    micro-batch (train/cuda_graph.py): removes the host's launch overhead where the host, not the GPU, sets the pace
    (small models such as mamba-130m). One GPU process, or tensor parallelism alone (its collectives captured with the
    step: faster where the host sets the pace, docs/scaling.md), with a fixed micro-batch shape; data-parallel and
    pipeline runs, and CPU runs of the same config, train eagerly and say so. Gradients then stay allocated between
    steps. model.arch hf: only for models that run no attention-mask code (plain causal, SDPA; refused otherwise)."""
    gc_interval: int = 50
    """Python's automatic garbage collection is off during training and a young-generation collection runs every
    this many steps on every rank at once (torchtitan's gc_freq): an automatic collection pauses one rank at a random
    moment and its peers wait for it in the next collective. 0 = leave Python's automatic collection on."""
    clip_in_optimizer: bool = True
    """Clip the gradient norm inside the optimizer step where the run allows it (one process or DDP on one mesh and
    torch's fused AdamW: no separate clip pass); false = ``torch.nn.utils.clip_grad_norm_`` before the step."""
    peak_tflops: float = 0.0
    """The device's dense bf16 peak in TFLOP/s for MFU, for a device missing from hardware.py's table; 0 = the
    table's value (H100/H200 989, A100 312, MI250X die 191.5, MI300X 1307; none on CPU)."""
    fp8: Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "none"
    """FP8 matmuls in the blocks' Linear layers through torchao (``pip install 'anytrain[fp8]'``), by torchao's recipe
    names: tensorwise = one dynamic scale per tensor (the fastest; under FSDP the weights are all-gathered in FP8);
    rowwise = a scale per row, e4m3 for the gradients too, power-of-2 scales; rowwise_with_gw_hp = rowwise with the
    weight gradient in high precision (the most accurate). The LM head and the layers ``fp8_filter`` leaves out stay
    high precision; master weights, optimizer state and checkpoints are unchanged, so a run resumes with another
    setting. Needs NVIDIA compute capability 8.9+ or AMD gfx942 / gfx950 (or ``fp8_emulate``). docs/fp8.md."""
    fp8_emulate: bool = False
    """With ``fp8``: torchao's emulation (the FP8 casts and scales as on hardware, the matmuls in high precision) on
    any device, e.g. CPU tests of the FP8 code path; slow. No effect with fp8 none."""
    fp8_filter: Literal["auto", "aligned"] = "auto"
    """With ``fp8``: which of the family's candidate layers convert. auto = those whose GEMM is large enough to gain
    (torchao's auto-filter thresholds per recipe, torchtitan's auto_filter_small_kn; docs/fp8.md) with in/out features
    multiples of 16; aligned = every candidate with in/out features multiples of 16 (small models, numerics checks)."""


@dataclass
class ParallelConfig:
    strategy: Literal["auto", "ddp", "fsdp", "zero1"] = "auto"
    """Data parallelism over the dp ranks: DDP (replicated), FSDP2 (sharded over dp_shard, replicated over
    dp_replicate: HSDP when both are > 1), or zero1 (DDP's replicated parameters and all-reduced gradients, each
    rank keeping and updating only its dim-0 shard of the AdamW state, then all-gathering the parameters).
    auto = ddp, or fsdp with tensor/pipeline parallelism (DDP does not combine with them)."""
    dp_replicate: int = 1
    """Data-parallel replicas (FSDP: HSDP replica groups; DDP: part of the replicated degree)."""
    dp_shard: int = -1
    """Data-parallel shard degree; -1 = whatever the world size leaves after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree (inside a node)."""
    pp: int = 1
    """Pipeline-parallel ranks; micro-batches per step = per-rank batch / train.micro_batch (must be >= pp)."""
    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble"] = "1F1B"
    """Pipeline schedule: 1F1B and GPipe run one stage per pipeline rank; Interleaved1F1B runs
    ``pp_virtual_stages`` stages per rank (round-robin: rank r holds stages r, r+pp, ...), a smaller bubble;
    InterleavedZeroBubble (PyTorch's ZB1P schedule, Qi et al. 2024) the same placement with each backward split into
    its input-gradient and weight-gradient halves, the weight halves filling the bubble."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank (Interleaved1F1B and InterleavedZeroBubble only; the layers split into pp x
    pp_virtual_stages stages)."""
    async_tp: bool = False
    """Tensor parallelism only (tp > 1, train.compile true, CUDA GPUs): overlap each sequence-parallel all-gather and
    reduce-scatter with the matmul that consumes or produces it (inductor's micro-pipelined TP over symmetric memory,
    torchtitan's async TP): the collective runs in chunks while the GEMM works on the chunks already there. Same
    numerics up to summation order; speed only. See docs/scaling.md for when it pays."""
    tp_sequence_loss: bool = False
    """Tensor parallelism only (tp > 1, no pipeline parallelism; Transformer family): the LM head and the loss run on
    each TP rank's sequence shard (T/tp positions, the whole head weight) instead of on the whole sequence on every
    rank: the head's matmul and the cross-entropy split tp ways instead of repeated, no all-gather of the final hidden
    states; the head weight's gradient is summed over the TP group in the backward (one V x D all-reduce per
    micro-batch, in the compute dtype: under bf16 that sum adds a rounding). The sequence length must be divisible by
    tp. In fp32 the same losses up to summation order."""
    auto: bool = False
    """Let the cost model choose strategy, micro-batch and activation checkpointing for this device and world size
    (``anytrain plan`` shows the ranking); the choice is written into the resolved config.yaml."""
    reshard_after_forward: bool = True
    """FSDP only: free gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2)."""
    cpu_affinity: Literal["none", "cores"] = "none"
    """cores: each process of a host is bound (all its threads, before the process group starts) to its own equal
    share of the host's physical cores (with their SMT siblings), so that two ranks never share a core. For hosts
    with one NUMA node or without numactl; on multi-socket hosts prefer ``torchrun --numa-binding``."""
    fsdp_group_blocks: int = 1
    """FSDP only: consecutive blocks sharded as one FSDP unit (``fully_shard`` on the group): one all-gather and one
    reduce-scatter per group instead of per block, and fewer per-unit hooks on the host; a larger gathered unit."""
    reshard_during_accumulation: bool = True
    """FSDP only: False keeps parameters gathered from the first micro-batch's forward to the last micro-batch's
    backward of each step (one all-gather + one reduce-scatter per step; costs the compute-dtype parameters unsharded
    for the whole step, like ZeRO-2, plus the gradient-accumulation buffers FSDP already keeps unsharded when gradient
    sync is off). No effect without gradient accumulation, or with pipeline parallelism (its schedule does this)."""
    ddp_bucket_mb: float = 100.0
    """DDP / ZeRO-1 only: size of the gradient buckets all-reduced as one collective while backward runs (PyTorch's
    ``bucket_cap_mb``). 100, not PyTorch's 25: measured faster and smaller for the 1.1B under DDP, and 250 no better
    (docs/scaling.md). Larger buckets: fewer, larger collectives, started later in backward."""
    nccl_protocol: Literal["", "Simple", "LL", "LL128"] = ""
    """NCCL's (and RCCL's) protocol for every collective (``NCCL_PROTO``), set in each process before its process
    group starts; '' = the library's own choice per message. A different NCCL_PROTO already in the environment is
    refused."""
    nccl_min_ctas: int = 0
    """Fewest thread blocks (CTAs, SMs) per NCCL communicator (``NCCL_MIN_CTAS``; 0 = NCCL's default)."""
    nccl_max_ctas: int = 0
    """Most thread blocks (CTAs, SMs) per NCCL communicator (``NCCL_MAX_CTAS``; 0 = NCCL's default): fewer leaves more
    SMs to the GEMMs that overlap the collectives. RCCL ignores the CTA fields."""
    ddp_bucket_view: bool = False
    """DDP / ZeRO-1 only: the gradients are views into DDP's all-reduce buckets (PyTorch's
    ``gradient_as_bucket_view``) and are zeroed in place between steps instead of freed: no separate bucket copy of
    the gradients (4 bytes per parameter less at the peak, two gradient-sized copies less per step), the gradients'
    memory held for the whole run. The same sums either way."""
    grad_compression: str = "none"
    """Compression of the data-parallel gradient reduction: none (fp32); bf16 or fp16 (gradients cast to that dtype
    for the reduction: DDP/ZeRO-1 through PyTorch's bf16/fp16_compress_hook, FSDP2 as MixedPrecisionPolicy's
    reduce_dtype; half the bytes); powersgd:rank=R (DDP/ZeRO-1 only: PyTorch's powerSGD_hook, each gradient matrix
    n x m sent as rank-R factors, (n + m)·R values, with error feedback; vectors and matrices it would not shrink 2x
    go uncompressed; PyTorch has no PowerSGD for FSDP, so fsdp refuses it). The PowerSGD state (error feedback, Q
    factors, step count) is part of the checkpoint. No effect in a one-process run. See docs/scaling.md."""
    powersgd_start_step: int = 0
    """With grad_compression powersgd: optimizer steps reduced uncompressed (fp32) before PowerSGD takes over;
    0 = train.warmup_steps (at least 2; PyTorch's PowerSGD needs DDP's first two steps uncompressed)."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save a checkpoint every N steps (and always at the end); 0 = only at the end."""
    interval_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (rank 0's clock decides for all); 0 = off."""
    keep_last: int = 2
    """Committed checkpoints to keep; older ones are deleted by rank 0."""
    auto_resume: bool = False
    """Resume from the newest committed checkpoint in the run dir if there is one (for requeued jobs)."""
    async_save: bool = False
    """Write checkpoints in the background (dcp.async_save), at most one in flight; the final save is synchronous."""
    save_final: bool = True
    """Save a checkpoint at the last step."""
    checksums: bool = True
    """Record a sha256 of every checkpoint file in its COMMITTED marker (sizes are always recorded) and verify them
    before loading; a damaged checkpoint is skipped for the previous committed one. Costs one read of the files by
    rank 0 at each commit and load (about 1-2 s per GB)."""


@dataclass
class ProfileConfig:
    steps: int = 0
    """Profile this many optimizer steps with torch.profiler on GPUs (0 = off): each rank writes
    <run_dir>/profile/rank<r>.json (kernels by name and kind, exposed communication, idle time)."""
    start_step: int = 5
    """First profiled step (0-based, counted from the start of this invocation's first step); after compile."""
    trace: bool = False
    """Also write each rank's Chrome trace, rank<r>.trace.json.gz (hundreds of MB for a 1B-parameter step)."""
    memory_snapshot: bool = False
    """GPUs only: also record the caching allocator's allocations over the profiled steps and write each rank's
    rank<r>.memory_snapshot.pickle (open it in https://pytorch.org/memory_viz) and, in rank<r>.json and the log,
    the peak with the allocations alive at it, summed by the Python line that made them."""


@dataclass
class KernelsConfig:
    """Process-wide kernel options, applied by ``anytrain.kernels.configure`` when the trainer builds the model."""

    backend: Literal["auto", "triton", "reference"] = "auto"
    """Mamba scan/conv kernels and the chunked cross-entropy's row kernel: auto = Triton on GPU tensors and the
    PyTorch reference on CPU (the reference also where Triton is not importable); triton = always Triton (an error where
    it cannot run); reference = always the PyTorch reference (slow; for cross-checks)."""
    deterministic: bool = False
    """Bitwise-reproducible selective-scan gradients: dB/dC summed through per-program partials instead of atomics
    (slower; the partials take dim / 4 times the memory of dB and dC)."""
    fused_mamba_inner: bool = True
    """Run each Mamba mixer as one fused op (in_proj -> conv -> x_proj -> dt_proj -> scan -> out_proj, one autograd
    node) where the Triton kernels run; false = the unfused composition of the public ops."""
    cast_cache: bool = True
    """The fused Mamba mixer casts each weight to the compute dtype once per optimizer step and reuses the copy across
    the micro-batches (more memory: a bf16 copy of the projections); false = cast in every forward and backward."""
    gemm_accumulate: bool = True
    """One-process runs without CUDA graphs: from the second micro-batch of a step, weight gradients are added to
    ``.grad`` by their GEMM (one pass over the gradient instead of three); false = the plain autograd accumulation."""


@dataclass
class WandbConfig:
    """Weights & Biases logging beside metrics.jsonl and TensorBoard, from rank 0 (``pip install 'anytrain[wandb]'``;
    docs/metrics.md)."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    """disabled = no W&B (wandb is not imported); offline = the W&B run is written under ``RUN/wandb`` only, with no
    network access (upload it later with ``wandb sync RUN/wandb/offline-run-*``); online = streamed to the W&B server
    (``wandb login`` or WANDB_API_KEY first). Logged: the resolved config, the run's identity (``anytrain_run``: run
    dir, resumed, start step) and every train / eval record of metrics.jsonl as ``train/KEY`` / ``eval/KEY`` at its
    step. The W&B run id is kept in ``RUN/wandb/run_id``: ``--resume`` continues the same W&B run."""
    project: str = "anytrain"
    """W&B project the run goes to."""
    entity: str = ""
    """W&B team or user owning the project; empty = the default entity of the logged-in account."""
    name: str = ""
    """The run's display name in W&B; empty = the run directory's name."""
    group: str = ""
    """W&B run group (e.g. one sweep or ablation); empty = none."""
    tags: list[str] = field(default_factory=list)
    """W&B run tags, a list of strings."""


@dataclass
class MetricsConfig:
    """Where metric records go besides metrics.jsonl and TensorBoard (always written by rank 0)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases (``metrics.wandb.mode``, ``project``, ...): see the ``metrics.wandb`` table."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    device: str = "auto"
    """auto (GPU if present), cpu, or gpu."""
    run_dir: str = ""
    """Where outputs go; empty = runs/<config name>-<time>. Also settable with --run-dir."""
    name: str = ""
    """Run name shown in logs; defaults to the config file's stem."""


# ---------------------------------------------------------------------------------------------------------------------
# Generic dataclass <-> dict conversion with validation


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against type ``tp`` (int/float/str/bool/Literal/dict/list/Optional); return it (ints→float)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return list(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported field type {_describe(tp)}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types with the field's dotted path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}: unknown field; valid fields are {', '.join(sorted(known))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = from_dict(tp, data[f.name] or {}, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _coerce(data[f.name], tp, f"{prefix}{f.name}")
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


@dataclass(frozen=True)
class BatchPlan:
    """How the fixed global batch splits over data-parallel ranks and micro-batches."""

    global_batch: int
    dp_world: int
    micro_batch: int
    grad_accum: int

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp_world


def plan_batches(train: TrainConfig, dp_world: int) -> BatchPlan:
    """Derive micro-batch and accumulation so that the optimisation does not depend on the world size."""
    if train.global_batch % dp_world:
        raise ConfigError(
            f"train.global_batch: {train.global_batch} is not divisible by the data-parallel world size {dp_world}; "
            f"use a multiple of {dp_world}"
        )
    per_rank = train.global_batch // dp_world
    micro = train.micro_batch or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"train.global_batch: {train.global_batch} is not divisible by world size x micro_batch "
            f"({dp_world} x {micro}); change train.global_batch or train.micro_batch"
        )
    return BatchPlan(train.global_batch, dp_world, micro, per_rank // micro)
