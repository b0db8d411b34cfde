"""Compressed gradient reduction (``parallel.grad_compression``) and the bytes the reduction sends per step.

- **DDP and ZeRO-1** (both reduce through DDP's buckets): PyTorch's DDP communication hooks,
  ``bf16_compress_hook`` / ``fp16_compress_hook`` (each bucket cast to 16 bits, divided by the world size,
  all-reduced, cast back) and ``powerSGD_hook`` with a ``PowerSGDState`` (each gradient matrix M (n x m) sent as
  P = M·Q (n x r) and Q = Mᵀ·P (m x r) after orthogonalising P, with error feedback; vectors and matrices that
  (n + m)·r would not shrink ``MIN_COMPRESSION_RATE`` times go uncompressed in one all-reduce). ``CompressionHook``
  wraps the hook: it counts the bytes each call hands to all-reduce (computed from the bucket's tensors by the
  hook's own rules; the distributed tests check the count against every all-reduce issued) and keeps PowerSGD's
  state independent of DDP's bucket layout (below).
- **FSDP2**: bf16 / fp16 are ``MixedPrecisionPolicy(reduce_dtype=...)`` (``parallel.data_parallel.apply_fsdp``);
  PyTorch has no PowerSGD for FSDP, so the config refuses it (``config.check_grad_compression``).

PowerSGD state across checkpoints: torch's PowerSGD keys its error-feedback vectors and Q factors by bucket index,
and DDP builds its buckets twice in every process (in reverse parameter order, then, after the first iteration, in
the order gradients became ready). A run resumed past the start step would otherwise apply state laid out for one
bucket layout to the other. ``CompressionHook`` therefore converts the state to one entry per parameter (error
feedback, Q) when it is saved and when DDP rebuilds its buckets (the process's second iteration), and lays it out
again for each bucket when that bucket is first reduced. Fresh Q factors come from a generator seeded by
(``train.seed``, parameter name), not from the order in which buckets are reduced, so an uninterrupted run and a
resumed one draw the same ones. ``PowerSGDCheckpoint`` is the trainer's Stateful view of that state.
"""

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.checkpoint.stateful import Stateful

from anytrain.config import ParallelConfig, TrainConfig, parse_grad_compression

REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MIN_COMPRESSION_RATE = 2.0  # PowerSGDState's default: a matrix is compressed only if (n + m)·r·2 < n·m
HOOK_ATTR = "_anytrain_compression_hook"  # the CompressionHook registered on a DDP module
WRAPPER_TOKENS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing / compile prefixes


def reduce_dtype(parallel: ParallelConfig) -> torch.dtype | None:
    """The dtype of the gradient reduction for bf16 / fp16, None otherwise (fp32, or PowerSGD's own scheme)."""
    return REDUCE_DTYPES.get(parse_grad_compression(parallel.grad_compression)[0])


def powersgd_start_step(parallel: ParallelConfig, train: TrainConfig) -> int:
    """``parallel.powersgd_start_step``; 0 = the LR warm-up's steps, at least 2 (DDP's first two iterations)."""
    return parallel.powersgd_start_step or max(2, train.warmup_steps)


def parameter_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name without activation-checkpoint / compile wrapper prefixes (stable across layouts)."""
    names = {}
    for name, param in module.named_parameters():
        for token in WRAPPER_TOKENS:
            name = name.replace(token, "")
        names[id(param)] = name
    return names


def compressed_matrices(shapes: list[torch.Size], rank: int) -> list[tuple[int, int, int, int]]:
    """(position, n, m, r) of the gradients ``powerSGD_hook`` compresses, in the order of its P and Q buffers.

    As the hook does: each gradient is viewed as a matrix (dim 0) x (the rest), r = min(n, m, rank); it is
    compressed when (n + m)·r·MIN_COMPRESSION_RATE < n·m; the compressed ones are grouped by matrix shape (groups in
    order of first appearance, bucket order within a group), which is how its P and Q buffers are laid out."""
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for position, shape in enumerate(shapes):
        n = shape[0]
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * MIN_COMPRESSION_RATE < n * m:
            groups.setdefault((n, m), []).append((position, n, m, r))
    return [entry for group in groups.values() for entry in group]


def powersgd_values(shapes: list[torch.Size], rank: int) -> int:
    """Values one PowerSGD step all-reduces for gradients of these shapes: the uncompressed ones whole, (n + m)·r
    for each compressed matrix (its P and Q)."""
    compressed = compressed_matrices(shapes, rank)
    whole = sum(math.prod(s) for s in shapes) - sum(n * m for _, n, m, _ in compressed)
    return whole + sum((n + m) * r for _, n, m, r in compressed)


@dataclass(frozen=True)
class BucketLayout:
    """One DDP bucket as the hook sees it: its parameters (ids, names, shapes, offsets into the flat buffer), the
    matrices PowerSGD compresses, and the bytes a plain and a PowerSGD reduction of it send."""

    ids: tuple[int, ...]
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    compressed: tuple[tuple[int, int, int, int], ...]
    element_size: int
    powersgd_bytes: int

    @classmethod
    def of(cls, bucket, names: dict[int, str], rank: int) -> "BucketLayout":
        params, grads, buffer = bucket.parameters(), bucket.gradients(), bucket.buffer()
        shapes = tuple(p.shape for p in params)
        offsets = tuple(g.storage_offset() - buffer.storage_offset() for g in grads)
        compressed = tuple(compressed_matrices(list(shapes), rank)) if rank else ()
        values = powersgd_values(list(shapes), rank) if rank else buffer.numel()
        return cls(
            tuple(map(id, params)),
            tuple(names[id(p)] for p in params),
            shapes,
            offsets,
            buffer.numel(),
            compressed,
            buffer.element_size(),
            values * buffer.element_size(),
        )


def fresh_q(name: str, m: int, r: int, seed: int) -> torch.Tensor:
    """A new PowerSGD Q factor (m x r, standard normal) for parameter ``name``: a function of (seed, name) only."""
    generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(m, r, generator=generator)


class CompressionHook:
    """The DDP communication hook of ``parallel.grad_compression`` (bf16, fp16 or PowerSGD), counting the bytes
    it hands to all-reduce: the 16-bit copy of each bucket; for PowerSGD before its start step the fp32 bucket,
    after it the uncompressed tensors + every compressed matrix's P and Q."""

    def __init__(self, kind: str, group, module: nn.Module, rank: int = 0, start_step: int = 2, seed: int = 0) -> None:
        self.kind, self.group, self.rank, self.seed = kind, group, rank, seed
        self.names = parameter_names(module)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.state = None
        if kind == "powersgd":
            self.state = PowerSGDState(
                group,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=start_step,
                min_compression_rate=MIN_COMPRESSION_RATE,
                random_seed=seed,
            )
        self.bytes_sent = 0  # since the last ``take_bytes_per_step``
        self.steps = 0
        self._layouts: dict[int, BucketLayout] = {}  # bucket index -> its layout (as last seen)
        self._held: dict[int, BucketLayout] = {}  # bucket index -> the layout of the PowerSGD state held for it
        self.loose: dict[str, dict[str, torch.Tensor]] = {}  # parameter name -> {"error", "q"}: not laid out yet
        self._iterations = 0  # reductions (synchronising backwards) in this process
        self._first_call = True  # the next call is the first of an iteration
        # gloo completes collectives on its worker threads, where powerSGD_hook's callbacks then issue the bucket's
        # next all-reduces: with several buckets in flight, two ranks could issue them in different orders and
        # deadlock. There each bucket's reduction finishes before the next starts (NCCL completes a future when the
        # work is enqueued, so the callbacks run in order in the calling thread).
        self.serial = kind == "powersgd" and dist.get_backend(group) == "gloo"

    def register(self, ddp: nn.Module) -> None:
        def anytrain_compression_hook(state, bucket):  # DDP wants a function (it reads its name and signature)
            return self(state, bucket)

        ddp.register_comm_hook(self.state if self.state is not None else self.group, anytrain_compression_hook)
        setattr(ddp, HOOK_ATTR, self)

    def __call__(self, state, bucket):  # no annotations: DDP checks them against dist.GradBucket / Future
        layout = self._layout(bucket)
        if self.kind != "powersgd":
            self.bytes_sent += layout.numel * REDUCE_DTYPES[self.kind].itemsize
            fut = (bf16_compress_hook if self.kind == "bf16" else fp16_compress_hook)(state, bucket)
        else:
            fut = self._powersgd(bucket, layout)
        if bucket.is_last():
            self.steps += 1
            self._iterations += 1
            self._first_call = True
        return fut

    def _layout(self, bucket) -> BucketLayout:
        index, layout = bucket.index(), self._layouts.get(bucket.index())
        if layout is None or layout.ids != tuple(map(id, bucket.parameters())):
            layout = self._layouts[index] = BucketLayout.of(bucket, self.names, self.rank)
        return layout

    def _powersgd(self, bucket, layout: BucketLayout):
        state, index = self.state, bucket.index()
        if self._first_call:
            self._first_call = False
            if self._iterations == 1:  # DDP rebuilt its buckets after the first iteration: lay the state out anew
                self.unbucket()
        held = self._held.get(index)
        if held is not None and held.ids != layout.ids:
            raise RuntimeError(
                f"parallel.grad_compression: DDP bucket {index} changed its parameters after the "
                "first iteration's rebuild; its PowerSGD state would be misapplied"
            )
        active = state.iter >= state.start_powerSGD_iter
        if active:
            if held is None:
                self._lay_out(index, layout, bucket.buffer())
            self.bytes_sent += layout.powersgd_bytes
            if bucket.is_last():
                self.loose = {}  # every bucket of this iteration has taken its share
        else:
            self.bytes_sent += layout.numel * layout.element_size
        fut = powerSGD_hook(state, bucket)
        if self.serial:
            fut.wait()
        return fut

    def _lay_out(self, index: int, layout: BucketLayout, buffer: torch.Tensor) -> None:
        """PowerSGD state for bucket ``index`` from the per-parameter state (loaded or unbucketed); Q factors of
        parameters without state are drawn fresh (``fresh_q``), the error feedback then starts at zero."""
        state, like = self.state, buffer
        if layout.names and all("error" in self.loose.get(name, {}) for name in layout.names):
            error = torch.zeros_like(like)
            for name, offset, shape in zip(layout.names, layout.offsets, layout.shapes, strict=True):
                error[offset : offset + math.prod(shape)].copy_(self.loose[name]["error"].reshape(-1))
            state.error_dict[index] = error
        qs = []
        for position, _, m, r in layout.compressed:
            name = layout.names[position]
            q = self.loose.get(name, {}).get("q")
            qs.append((q if q is not None else fresh_q(name, m, r, self.seed)).to(like).reshape(-1))
        state.q_memory_dict[index] = torch.cat(qs) if qs else like.new_empty(0)
        state.p_memory_dict[index] = like.new_zeros(sum(n * r for _, n, _, r in layout.compressed))
        self._held[index] = layout

    def per_parameter(self) -> dict[str, dict[str, torch.Tensor]]:
        """The PowerSGD state per parameter name, {"error": flat, "q": m x r}: ``loose`` plus views of what is held
        per bucket."""
        state, out = self.state, {name: dict(entry) for name, entry in self.loose.items()}
        for index, layout in self._held.items():
            error, q = state.error_dict.get(index), state.q_memory_dict.get(index)
            if error is not None:
                for name, offset, shape in zip(layout.names, layout.offsets, layout.shapes, strict=True):
                    out.setdefault(name, {})["error"] = error[offset : offset + math.prod(shape)]
            offset = 0
            for position, _, m, r in layout.compressed:
                out.setdefault(layout.names[position], {})["q"] = q[offset : offset + m * r].view(m, r)
                offset += m * r
        return out

    def unbucket(self) -> None:
        """Move the PowerSGD state held per bucket into ``loose`` (per parameter, views of the same tensors)."""
        state = self.state
        self.loose = self.per_parameter()
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        self._held.clear()

    def take_bytes_per_step(self) -> float | None:
        """Mean bytes handed to all-reduce per step since the last call (None: no step since)."""
        steps, sent = self.steps, self.bytes_sent
        self.steps, self.bytes_sent = 0, 0
        return sent / steps if steps else None


def attach(ddp: nn.Module, parallel: ParallelConfig, train: TrainConfig, group) -> CompressionHook | None:
    """Register ``parallel.grad_compression``'s hook on a DDP module (nothing for none); returns it."""
    kind, rank = parse_grad_compression(parallel.grad_compression)
    if kind == "none":
        return None
    hook = CompressionHook(kind, group, ddp.module, rank, powersgd_start_step(parallel, train), train.seed)
    hook.register(ddp)
    return hook


def reduction_bytes(
    model: nn.Module, strategy: str, parallel: ParallelConfig, dp_replicate: int = 1, dp_shard: int = 1
) -> int:
    """Bytes per step one rank hands to the gradient reduction without a counting hook, from the parameter sizes:
    DDP / ZeRO-1 all-reduce every gradient (fp32) once per step; FSDP2 reduce-scatters each unsharded gradient in its
    reduce dtype (fp32, or bf16 / fp16) and, under HSDP, all-reduces the 1/dp_shard shard across replicas (FSDP2's
    padding of dim 0 to a multiple of dp_shard is not counted; tensor-parallel shards count at their local size).
    One process or no data parallelism: 0."""
    if strategy in ("single", "none"):
        return 0
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy in ("ddp", "zero1"):
        return sum(p.numel() * p.element_size() for p in params)
    itemsize = (reduce_dtype(parallel) or torch.float32).itemsize
    values = sum(p.numel() // _tp_shards(p) for p in params)
    replicas = values // dp_shard if dp_replicate > 1 and dp_shard > 1 else 0
    return (values + replicas) * itemsize


def _tp_shards(param: torch.Tensor) -> int:
    """How many tensor-parallel shards a (DTensor) parameter is split into (1 for a plain tensor)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return 1
    names = mesh.mesh_dim_names or ()
    shards = 1
    for dim, placement in enumerate(param.placements):
        if placement.is_shard() and dim < len(names) and names[dim] == "tp":
            shards *= mesh.size(dim)
    return shards


class GradCommMeter:
    """``grad_comm_bytes`` of the log records: bytes per step one rank hands to the gradient reduction (message
    sizes; a ring all-reduce puts 2(n-1)/n times that on the wire). Counted by the compression hook where one is
    registered, else ``reduction_bytes``."""

    def __init__(
        self, model: nn.Module, strategy: str, parallel: ParallelConfig, dp_replicate: int = 1, dp_shard: int = 1
    ) -> None:
        self.hook: CompressionHook | None = getattr(model, HOOK_ATTR, None)
        self.fixed = (
            None if self.hook is not None else reduction_bytes(model, strategy, parallel, dp_replicate, dp_shard)
        )

    def bytes_per_step(self) -> float | None:
        return self.hook.take_bytes_per_step() if self.hook is not None else self.fixed

    def checkpoint_state(self, progress: dict, log=print) -> dict[str, Stateful]:
        """The trainer's checkpoint extras: the PowerSGD state when PowerSGD runs, else nothing."""
        if self.hook is None or self.hook.state is None:
            return {}
        return {"compression": PowerSGDCheckpoint(self.hook, progress, log)}


class PowerSGDCheckpoint(Stateful):
    """PowerSGD's state in the trainer's DCP checkpoint: the step count, and per rank and parameter the error
    feedback (flat, the parameter's size) and, for compressed matrices, Q (m x r).

    Keys are ``<powersgd-rank{R}-dp{W}>.rank{r}.…``: each rank writes and reads its own error feedback (it differs
    between ranks). A checkpoint without this layout's keys (another rank R or data-parallel size, or no PowerSGD)
    leaves PowerSGD starting afresh at the resumed step (zero error feedback, new Q factors), said on one line."""

    def __init__(self, hook: CompressionHook, progress: dict, log=print) -> None:
        self.hook, self.progress, self.log = hook, progress, log
        group = hook.group if hook.group is not None else dist.group.WORLD
        self.prefix = f"powersgd-rank{hook.rank}-dp{group.size()}"
        self.member = f"rank{group.rank()}"
        self.params = {hook.names[id(p)]: p for p in hook.params}

    def state_dict(self) -> dict:
        """Every parameter's entries (zeros where PowerSGD holds nothing yet), so that a load has each tensor to fill
        in; ``active`` says whether they hold state."""
        loose = self.hook.per_parameter()  # views: DCP copies them (the step has finished: nothing writes to them)
        error, q = {}, {}
        for name, param in self.params.items():
            held = loose.get(name, {})
            error[name] = held["error"] if "error" in held else param.new_zeros(param.numel())
            for _, _, m, r in compressed_matrices([param.shape], self.hook.rank):
                q[name] = held["q"] if "q" in held else param.new_zeros(m, r)
        active = int(any("error" in v or "q" in v for v in loose.values()))
        return {self.prefix: {self.member: {"step": self.hook.state.iter, "active": active, "error": error, "q": q}}}

    def load_state_dict(self, state: dict) -> None:
        mine = state.get(self.prefix, {}).get(self.member)
        hook = self.hook
        hook.unbucket()
        hook.loose = {}
        if mine is None or "step" not in mine:
            hook.state.iter = self.progress["step"]
            if hook.state.iter > hook.state.start_powerSGD_iter:
                self.log(
                    f"parallel.grad_compression: the checkpoint holds no PowerSGD state for rank "
                    f"{hook.rank} at this data-parallel size ({self.prefix}); PowerSGD continues from step "
                    f"{hook.state.iter} with zero error feedback and new Q factors"
                )
            return
        hook.state.iter = int(mine["step"])
        if not mine.get("active"):
            return
        for name, tensor in mine.get("error", {}).items():
            hook.loose.setdefault(name, {})["error"] = tensor
        for name, tensor in mine.get("q", {}).items():
            hook.loose.setdefault(name, {})["q"] = tensor
