"""The default process group, the parallel degrees of a run and the one DeviceMesh built from them.

``init_distributed`` forms the process group from the launcher's environment (``parallel.env``) and picks this rank's
device; ``ParallelDims`` validates the degrees and builds the mesh over them.

World = pp × dp_replicate × dp_shard × tp, laid out in that order (tensor parallel innermost, so TP groups are
consecutive ranks and stay inside a node when ``tp`` divides the GPUs per node). Data parallelism is the product
``dp_replicate × dp_shard``: ranks that share a data-parallel coordinate (TP peers, pipeline stages) read the same
batch. ``-1`` infers a degree from the world size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.config import ParallelConfig
from anytrain.errors import ConfigError
from anytrain.parallel.env import DistInfo, bind_to_cores, launch_env, local_world_size

ORDER = ("pp", "dp_replicate", "dp_shard", "tp")


def init_distributed(
    device_request: str = "auto", timeout_s: int = 600, cpu_affinity: str = "none", comm_env: dict | None = None
) -> tuple[DistInfo, torch.device]:
    """Initialise the default process group if launched with several processes; pick this rank's device. With
    ``cpu_affinity="cores"`` the process is bound to its cores first, so the communication threads inherit it.
    ``comm_env``: the ``parallel.nccl_*`` fields' variables (``hardware.communication_env``), set before the group."""
    hardware.apply_env_defaults()
    hardware.apply_communication_env(comm_env or {})
    info = launch_env()
    if cpu_affinity == "cores":
        bind_to_cores(info.local_rank, local_world_size())
    device = hardware.resolve_device(device_request, info.local_rank)
    if info.is_distributed and not dist.is_initialized():
        kwargs = {"device_id": device} if hardware.is_gpu(device) else {}
        dist.init_process_group(hardware.dist_backend(device), timeout=timedelta(seconds=timeout_s), **kwargs)
    return info, device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        degrees = {name: getattr(cfg, name) for name in ORDER}
        for name, value in degrees.items():
            if value == 0 or value < -1:
                raise ConfigError(f"parallel.{name}: must be a positive degree or -1 (infer), got {value}")
        unknown = [name for name, value in degrees.items() if value == -1]
        if len(unknown) > 1:
            raise ConfigError(f"parallel: only one degree may be -1 (inferred), got {', '.join(unknown)}")
        known = 1
        for value in degrees.values():
            known *= value if value != -1 else 1
        if unknown:
            if world_size % known:
                raise ConfigError(
                    f"parallel.{unknown[0]}: cannot infer; the other degrees' product {known} does not "
                    f"divide the world size {world_size}"
                )
            degrees[unknown[0]] = world_size // known
        product = degrees["pp"] * degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"]
        if product != world_size:
            shown = " x ".join(f"{n}={degrees[n]}" for n in ORDER)
            raise ConfigError(
                f"parallel: {shown} = {product} processes, but the world size is {world_size}; "
                "make the product equal the number of processes (or set one degree to -1)"
            )
        return cls(world_size=world_size, **degrees)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(name for name in ORDER if getattr(self, name) > 1)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over ORDER)."""
        coords, rest = {}, rank
        for name in reversed(ORDER):
            size = getattr(self, name)
            coords[name] = rest % size
            rest //= size
        return coords

    def dp_rank(self, rank: int) -> int:
        """Index of this rank's data-parallel replica/shard in [0, dp): selects its slice of each global batch."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    @cached_property
    def _mesh_cache(self) -> dict:
        return {}

    def build_mesh(self, device_type: str):
        """The run's DeviceMesh over every dimension of size > 1 (built once), with a flattened 'dp' dimension."""
        if device_type in self._mesh_cache:
            return self._mesh_cache[device_type]
        from torch.distributed.device_mesh import init_device_mesh

        names = self.active or ("dp_shard",)
        mesh = init_device_mesh(device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=names)
        dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
        if len(dp_names) == 2:
            mesh[dp_names]._flatten("dp")
        self._mesh_cache[device_type] = mesh
        return mesh


def validate_for_model(
    dims: ParallelDims,
    n_layers: int,
    n_heads: int | None,
    n_kv_heads: int | None,
    cfg: ParallelConfig | None = None,
    n_microbatches: int | None = None,
    tied_embeddings: bool = False,
    tp_check: Callable[[int], None] | None = None,
) -> None:
    """Layouts the model cannot take: TP not dividing the heads (``tp_check``: the family's own check of a TP degree,
    ``ParallelizePlan.check_tensor_parallel``), more pipeline stages than layers, fewer
    micro-batches than pipeline ranks, a schedule that does not fit the virtual stages, a pipeline over tied
    embeddings, ZeRO-1 with model parallelism. Checked before any process group or run-dir work."""
    from anytrain.parallel.pipeline import check_pipeline_layout

    if dims.tp > 1 and tp_check is not None:
        tp_check(dims.tp)
    elif dims.tp > 1:
        if n_heads is None:
            raise ConfigError(
                "parallel.tp: tensor parallelism is implemented for the transformer, mamba2 and hybrid only; set tp 1"
            )
        if n_heads % dims.tp or (n_kv_heads or n_heads) % dims.tp:
            raise ConfigError(
                f"parallel.tp: {dims.tp} does not divide the model's {n_heads} query / "
                f"{n_kv_heads or n_heads} key-value heads; choose a divisor"
            )
    if dims.pp > 1 and tied_embeddings:
        raise ConfigError(
            "parallel.pp: tied embeddings put the embedding and the head on one stage; "
            "set --model.args.tie_embeddings false (or pp 1)"
        )
    if dims.pp > n_layers:
        raise ConfigError(f"parallel.pp: {dims.pp} pipeline stages for {n_layers} layers; use at most {n_layers}")
    if cfg is not None:
        check_pipeline_layout(
            n_layers, dims.pp, cfg.pp_virtual_stages, cfg.pp_schedule, n_microbatches if dims.pp > 1 else None
        )
        if cfg.strategy in ("ddp", "zero1") and dims.dp > 1 and (dims.tp > 1 or dims.pp > 1):
            raise ConfigError(
                f"parallel.strategy: {cfg.strategy} does not combine with tensor/pipeline parallelism; "
                "use --parallel.strategy fsdp (or auto)"
            )
