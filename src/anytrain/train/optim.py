"""AdamW with weight-decay groups, the learning-rate schedules, gradient clipping and the optimizer step."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from anytrain import hardware
from anytrain.checkpoint.dcp import IMPLEMENTATION_KEYS
from anytrain.config import TrainConfig
from anytrain.parallel.tensor_parallel import reduce_partial_gradients

NO_DECAY_NAMES = ("A_log", "D")  # Mamba's state matrix and skip gain (mamba-ssm exempts them too)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights); never decay vectors (norm gains, biases) or Mamba's A_log / D.

    Decided by shape and name, because marker attributes on tensors do not survive ``to_empty`` or FSDP.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or name.rsplit(".", 1)[-1] in NO_DECAY_NAMES
        (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def use_fused(cfg: TrainConfig, device: torch.device) -> bool:
    """train.optimizer_impl resolved: the fused AdamW kernel or not (auto: on GPUs)."""
    if cfg.optimizer_impl == "auto":
        return hardware.fused_adamw_available(device)
    return cfg.optimizer_impl == "fused"


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, device: torch.device, by_mesh: bool = False
) -> torch.optim.Optimizer:
    """AdamW; the fused kernel on GPU (CUDA and ROCm), the foreach implementation elsewhere.

    ``by_mesh``: for models whose parameters mix DTensors of different meshes with plain tensors (tensor parallelism
    here), which one fused/foreach call cannot batch together: each weight-decay group is split by device mesh and
    every part is updated with the foreach kernels (one DTensor dispatch per operation and group, not per parameter:
    several times less host time than per-parameter updates, bench/tp_optimizer.py; figures: docs/scaling.md).
    """
    if by_mesh:
        groups = [part for group in param_groups(model, cfg.weight_decay) for part in split_by_mesh(group)]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
    fused = use_fused(cfg, device)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


def split_by_mesh(group: dict) -> list[dict]:
    """A param group -> one group per device mesh of its parameters (plain tensors together), in first-seen order."""
    parts: dict[object, list[nn.Parameter]] = {}
    for param in group["params"]:
        mesh = getattr(param, "device_mesh", None)
        key = None if mesh is None else (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)
        parts.setdefault(key, []).append(param)
    return [{**group, "params": params} for params in parts.values()]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for optimizer step ``step`` (0-based): linear warm-up, then the chosen decay.

    cosine: from 1 down to min_lr_ratio over the remaining steps. wsd (warmup-stable-decay): 1 until the last
    ``decay_fraction`` of steps, then linear to min_lr_ratio. constant: 1.
    """
    warmup, total, floor = cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = max(1, round(cfg.decay_fraction * total))
    decay_start = max(warmup, total - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total - decay_start))
    return 1.0 - (1.0 - floor) * progress


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def rewind_scheduler(
    scheduler: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer, steps: int
) -> None:
    """Put the schedule ``steps`` optimizer steps back, through its state_dict (which holds the step count and the
    last LRs), and the optimizer's learning rates with it."""
    state = scheduler.state_dict()
    state["last_epoch"] -= steps
    state["_step_count"] -= steps
    state["_last_lr"] = [
        base * factor(state["last_epoch"])
        for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    scheduler.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, state["_last_lr"], strict=True):
        group["lr"] = lr


# ---------------------------------------------------------------------------------------------------------------------
# clipping and the step


class GradClipper:
    """The global gradient norm (every rank gets the same) and clipping to ``max_norm`` (train.grad_clip; 0: none).

    ``clipper(model) -> (norm, grad_scale)``. Clipping happens there, or (``in_optimizer``, where
    ``clip_in_optimizer`` allows it) in the update: ``grad_scale`` is then the factor torch's fused AdamW divides each
    gradient by as it reads it (``optimizer_step``), with no separate pass that scales every gradient in place; until
    then, and on a skipped step, ``.grad`` stays unclipped. ``tp``: the tensor-parallel degree; ``pp_group``: the
    pipeline's process group (None without one)."""

    def __init__(self, max_norm: float, in_optimizer: bool, tp: int, device: torch.device, pp_group=None) -> None:
        self.max_norm = max_norm or math.inf
        self.in_optimizer, self.tp, self.device, self.pp_group = in_optimizer, tp, device, pp_group

    def __call__(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        max_norm, pp_group = self.max_norm, self.pp_group
        if self.tp > 1:
            reduce_partial_gradients(model.parameters())
        if math.isfinite(max_norm) and self.in_optimizer:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            return norm, torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
        if self.tp == 1 and pp_group is None:  # every parameter on one mesh: torch's own clipping
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
            return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm), None  # FSDP2: a DTensor
        # TP/PP: parameters live on different meshes (or stages); sum squared norms per mesh, then over stages
        params = [p for p in model.parameters() if p.grad is not None]
        groups: dict = {}
        for p in params:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
        squared = torch.zeros((), device=self.device)
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, foreach=False)
            squared = squared + (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2
        if pp_group is not None:
            dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
        return total, None


def optimizer_step(
    optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None
) -> None:
    """``optimizer.step()`` with this step's inputs of torch's fused Adam/AdamW kernel: ``grad_scale`` (each gradient
    is divided by it as the kernel reads it: ``GradClipper``'s factor) and ``found_inf`` (nonzero: the update is
    skipped on the device: the lagged checks' verdict). torch reads both as attributes of the optimizer, the contract
    ``torch.amp.GradScaler`` uses; they are set for this call only, so no later step sees them."""
    given = {name: value for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)) if value is not None}
    for name, value in given.items():
        setattr(optimizer, name, value)
    try:
        optimizer.step()
    finally:
        for name in given:
            delattr(optimizer, name)


# ---------------------------------------------------------------------------------------------------------------------
# ZeRO-1: replicated parameters and gradients (DDP), optimizer state sharded over the data-parallel ranks


def _row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of dim 0 held by ``rank``: torch.chunk's split (ceil-sized chunks, the last ones may be short or
    empty), the same rule as DTensor's Shard(0), so the state can be described as a Shard(0) DTensor."""
    size = -(-rows // world)
    return min(rows, rank * size), min(rows, (rank + 1) * size)


class Zero1AdamW(torch.optim.AdamW):
    """AdamW over this rank's dim-0 shard of every parameter (ZeRO stage 1).

    The model is DDP-wrapped, so every rank holds full parameters and all-reduced gradients. The optimizer's params
    are row-slice *views* into the parameters (rank r owns rows chunk r of each one), so AdamW keeps exp_avg /
    exp_avg_sq for 1/dp of the model and updates the parameters' own storage in place; one all-gather per step then
    sends each rank's updated rows to every rank. ``checkpoint_state`` describes the state as Shard(0) DTensors of the
    parameters' full shapes under the parameters' names (the flattened layout of ``get_optimizer_state_dict``), so DCP
    loads it under DDP, FSDP, a single process or another dp degree, and loads their checkpoints.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, mesh) -> None:
        self.mesh = mesh
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(
                f"parallel.strategy zero1: parameters of one dtype expected, got {sorted(map(str, dtypes))}"
            )
        self.entries = []  # (name, full parameter, shard view)
        shard_of = {}
        for name, p in named:
            lo, hi = _row_range(p.shape[0], self.rank, self.world) if p.ndim else (0, 0)
            view = p.detach()[lo:hi] if p.ndim else p.detach()
            self.entries.append((name, p, view))
            shard_of[id(p)] = view
        groups = [
            {**g, "params": [shard_of[id(p)] for p in g["params"]]} for g in param_groups(model, cfg.weight_decay)
        ]
        fused = use_fused(cfg, device)
        super().__init__(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=fused or None,
            foreach=None if fused else True,
        )
        self._build_gather_layout()

    def _build_gather_layout(self) -> None:
        """Flat all-gather layout: rank q's segment packs its row-slices of every parameter, padded to the longest."""
        self.segments = []  # per rank: list of (entry index, lo, hi, numel)
        for q in range(self.world):
            seg = []
            for i, (_, p, _) in enumerate(self.entries):
                lo, hi = _row_range(p.shape[0], q, self.world) if p.ndim else (0, 0)
                seg.append((i, lo, hi, (hi - lo) * (p[0].numel() if p.ndim else 0)))
            self.segments.append(seg)
        self.segment_numel = max(sum(s[3] for s in seg) for seg in self.segments)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - same signature as Optimizer.step
        for _, p, view in self.entries:  # the shard's gradient: a view into DDP's all-reduced gradient
            rows = slice(*_row_range(p.shape[0], self.rank, self.world)) if p.ndim else slice(None)
            view.grad = None if p.grad is None else (p.grad[rows] if p.ndim else p.grad)
        super().step()
        self._all_gather()

    def _all_gather(self) -> None:
        """Every rank's updated rows to every rank: one all_gather_into_tensor of padded flat segments, then one
        batched copy into the parameters (no host sync)."""
        import torch.distributed as dist

        dtype, device = self.entries[0][1].dtype, self.entries[0][1].device
        local = torch.empty(self.segment_numel, dtype=dtype, device=device)  # the padding is never read
        own = [self.entries[i][2].reshape(-1) for i, _, _, numel in self.segments[self.rank] if numel]
        if own:
            torch.cat(own, out=local[: sum(t.numel() for t in own)])
        gathered = torch.empty(self.world * self.segment_numel, dtype=dtype, device=device)
        dist.all_gather_into_tensor(gathered, local, group=self.group)
        dsts, srcs = [], []
        for q, seg in enumerate(self.segments):
            offset = q * self.segment_numel
            for i, lo, hi, numel in seg:
                if numel and q != self.rank:
                    p = self.entries[i][1]
                    dsts.append(p.detach()[lo:hi])
                    srcs.append(gathered[offset : offset + numel].view(hi - lo, *p.shape[1:]))
                offset += numel
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for _, p, _ in self.entries:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # checkpoints ----------------------------------------------------------------------------------------------------

    def _init_state(self) -> None:
        """Materialise empty AdamW state (what the first step creates) so a checkpoint can be loaded into it."""
        for group in self.param_groups:
            for view in group["params"]:
                if not self.state[view]:
                    step_device = view.device if group["fused"] or group["capturable"] else torch.device("cpu")
                    self.state[view] = {
                        "step": torch.zeros((), dtype=torch.float32, device=step_device),
                        "exp_avg": torch.zeros_like(view),
                        "exp_avg_sq": torch.zeros_like(view),
                    }

    def checkpoint_state(self) -> dict:
        """Flattened optimizer state under the parameters' names; moment tensors as Shard(0) DTensors."""
        from torch.distributed.tensor import DTensor, Shard

        self._init_state()
        group_of = {id(v): g for g in self.param_groups for v in g["params"]}
        out = {}
        for name, p, view in self.entries:
            for key, value in self.state[view].items():
                if isinstance(value, torch.Tensor) and value.ndim and p.ndim:
                    value = DTensor.from_local(
                        value, self.mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
                    )
                out[f"state.{name}.{key}"] = value
            for key, value in group_of[id(view)].items():
                if key != "params":
                    out[f"param_groups.{name}.{key}"] = value
        return out

    def load_checkpoint_state(self, flat: dict) -> None:
        """Take a loaded ``checkpoint_state`` dict (DCP filled its tensors in place; copy to be safe)."""
        group_of = {id(v): g for g in self.param_groups for v in g["params"]}
        for name, _, view in self.entries:
            for key, value in self.state[view].items():
                loaded = flat[f"state.{name}.{key}"]
                loaded = loaded.to_local() if hasattr(loaded, "to_local") else loaded
                if loaded is not value:
                    value.copy_(loaded)
            group = group_of[id(view)]
            for key in group:
                if key not in ("params", *IMPLEMENTATION_KEYS):
                    group[key] = flat[f"param_groups.{name}.{key}"]
