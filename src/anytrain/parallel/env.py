"""The launcher's environment: which launcher started this process, its rank / world size / local rank / master
address, and the binding of the process to its share of the host's CPU cores.

Precedence (the first that applies wins):

1. **torchrun** (``TORCHELASTIC_RUN_ID`` set): its RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR are used as they are,
   also when torchrun itself runs under srun (``srun --ntasks-per-node 1 torchrun --nproc-per-node 8 ...``).
2. **MPI**: Open MPI (``OMPI_COMM_WORLD_*``) or MPICH / Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``).
   MPI does not publish the first rank's host: MASTER_ADDR comes from the environment (``anytrain launch mpi`` passes
   it with ``-x``), else 127.0.0.1 when every rank runs on this host. Checked before SLURM because mpirun inside an
   allocation starts its daemons with srun (their SLURM_* describe the daemons, not the ranks).
3. **SLURM** (an srun step: ``SLURM_STEP_NUM_TASKS`` set; a batch script without srun is one process): rank
   SLURM_PROCID, world SLURM_STEP_NUM_TASKS, local rank SLURM_LOCALID, master = the first host of
   SLURM_STEP_NODELIST (what ``scontrol show hostnames`` prints first), port derived from the job and step ids.
4. **Plain environment**: RANK and WORLD_SIZE exported by hand (MASTER_ADDR / MASTER_PORT must be too).

RANK / WORLD_SIZE / LOCAL_RANK exported next to SLURM or MPI must agree with them: a mismatch (a stale
``export WORLD_SIZE=8`` in a job script, ``srun -n 2`` on a 4-rank config) is a one-line error naming both variables.

``launch_env`` exports what it found as RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, the variables
``init_process_group`` reads (``parallel.mesh.init_distributed``).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from anytrain.errors import ConfigError

TORCHRUN, MPI, SLURM, ENV, SINGLE = "torchrun", "mpi", "slurm", "env", "single"
# (launcher name shown in errors, rank, world size, local rank, local world size) per MPI flavour
MPI_KEYS = (
    (
        "mpirun (Open MPI)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpirun (MPICH / Intel MPI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process. ``master_addr`` / ``master_port`` are None for a single process."""

    launcher: str = SINGLE
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Write the torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT) for ``init_process_group(init_method='env://')``; nothing for a single process."""
        environ = os.environ if environ is None else environ
        if not self.is_distributed:
            return
        values = {
            "RANK": self.rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_RANK": self.local_rank,
            "LOCAL_WORLD_SIZE": self.local_world_size,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
        }
        environ.update({key: str(value) for key, value in values.items() if value is not None})


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None or value.strip() == "":
        if default is None:
            raise ConfigError(f"launcher environment: {key} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"launcher environment: {key}={value!r} is not an integer") from None


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list in full, like ``scontrol show hostnames``: ``gpu[01-03,7],login1`` ->
    gpu01, gpu02, gpu03, gpu7, login1 (zero padding kept; several bracket groups in one name multiply)."""
    hosts: list[str] = []
    for name in _split_top_level(hostlist):
        hosts.extend(_expand_one(name))
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if not match:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    out = []
    for item in match.group(1).split(","):
        lo, _, hi = item.partition("-")
        if not hi:
            numbers = [lo]
        else:
            width = len(lo) if lo.startswith("0") else 0
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        out.extend(head + n + rest for n in numbers for rest in _expand_one(tail))
    return out


def tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """Entry ``node_index`` of SLURM's tasks-per-node list: ``2(x3),1`` -> 2, 2, 2, 1."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match:
            counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node_index] if 0 <= node_index < len(counts) else (counts[0] if counts else 1)


def slurm_port(job_id: int, step_id: int) -> int:
    """A port every task of a SLURM step derives alike (15000-34999), distinct for neighbouring jobs and steps."""
    return 15000 + (job_id * 8 + step_id) % 20000


def discover(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's launch facts from ``env`` (default ``os.environ``); see the module docstring for the rules."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env and "WORLD_SIZE" in env:
        found = _from_torchrun(env)
    elif (mpi := _from_mpi(env)) is not None:
        found = mpi
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        found = _from_slurm(env)
    elif "RANK" in env and "WORLD_SIZE" in env:
        found = LaunchEnv(
            ENV,
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK", 0),
            _int(env, "LOCAL_WORLD_SIZE", 1),
            env.get("MASTER_ADDR"),
            _int(env, "MASTER_PORT", DEFAULT_PORT),
        )
    else:
        return LaunchEnv()
    _check(found)
    return found


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv(
        TORCHRUN,
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        _int(env, "LOCAL_RANK", 0),
        _int(env, "LOCAL_WORLD_SIZE", 1),
        env.get("MASTER_ADDR"),
        _int(env, "MASTER_PORT", DEFAULT_PORT),
    )


def _from_mpi(env: Mapping[str, str]) -> LaunchEnv | None:
    for name, rank_key, world_key, local_key, local_world_key in MPI_KEYS:
        if rank_key not in env or world_key not in env:
            continue
        rank, world = _int(env, rank_key), _int(env, world_key)
        local_world = _int(env, local_world_key, 1)
        addr = env.get("MASTER_ADDR")
        if addr is None and world > 1:
            if local_world != world:
                raise ConfigError(
                    f"{name}: ranks span several hosts but MASTER_ADDR is not set; pass the first "
                    "host with mpirun -x MASTER_ADDR=<host> (anytrain launch mpi does)"
                )
            addr = "127.0.0.1"
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or env.get("PMI_JOBID") or ""
        default_port = 15000 + int(job) % 20000 if job.isdigit() else DEFAULT_PORT
        found = LaunchEnv(
            MPI, rank, world, _int(env, local_key, 0), local_world, addr, _int(env, "MASTER_PORT", default_port)
        )
        _check_exported(env, found, name, rank_key, world_key, local_key)
        return found
    return None


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    if "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS") != world:
        raise ConfigError(
            f"srun: SLURM_NTASKS={env['SLURM_NTASKS']} but SLURM_STEP_NUM_TASKS={world}; the step "
            "environment is inconsistent (a SLURM_NTASKS exported by hand?)"
        )
    local_world = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), _int(env, "SLURM_NODEID", 0))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_hostlist(nodelist)
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
    if addr is None and world > 1:
        raise ConfigError("srun: no SLURM_STEP_NODELIST to take the first host from; export MASTER_ADDR")
    port = _int(env, "MASTER_PORT", slurm_port(_int(env, "SLURM_JOB_ID", 0), _int(env, "SLURM_STEP_ID", 0)))
    found = LaunchEnv(SLURM, _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0), local_world, addr, port)
    _check_exported(env, found, "srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
    return found


def _check_exported(
    env: Mapping[str, str], found: LaunchEnv, name: str, rank_key: str, world_key: str, local_key: str
) -> None:
    """RANK / WORLD_SIZE / LOCAL_RANK set by hand next to a launcher must say what the launcher says."""
    for key, own_key, value in (
        ("WORLD_SIZE", world_key, found.world_size),
        ("RANK", rank_key, found.rank),
        ("LOCAL_RANK", local_key, found.local_rank),
    ):
        if key in env and env[key].strip() != str(value):
            fix = f"unset {key} (anytrain reads {own_key})" + (
                f" or launch {env[key]} tasks" if key == "WORLD_SIZE" else ""
            )
            raise ConfigError(f"{name}: {key}={env[key]} but {own_key}={value}; the launchers disagree: {fix}")


def _check(found: LaunchEnv) -> None:
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        raise ConfigError(f"{found.launcher}: rank {found.rank} is outside world size {found.world_size}")
    if not 0 <= found.local_rank < max(found.local_world_size, 1) and found.local_world_size > 1:
        raise ConfigError(
            f"{found.launcher}: local rank {found.local_rank} is outside the {found.local_world_size} "
            "processes of this host"
        )


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_env() -> DistInfo:
    """Rank facts from torchrun, MPI (mpirun) or SLURM (srun), exported as RANK / WORLD_SIZE / LOCAL_RANK /
    MASTER_ADDR / MASTER_PORT for ``init_process_group``; single process otherwise."""
    found = discover()
    found.export()
    return DistInfo(found.rank, found.world_size, found.local_rank)


def local_world_size() -> int:
    """Processes of this job on this host, from the launcher's environment (1 when it does not say)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 1


def physical_cores(cpus: set[int], sysfs: str = "/sys/devices/system/cpu") -> list[list[int]]:
    """``cpus`` grouped by physical core (package, core id; SMT siblings together), cores ordered by lowest CPU."""
    groups: dict[tuple, list[int]] = {}
    for cpu in sorted(cpus):
        topo = f"{sysfs}/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f_pkg, open(f"{topo}/core_id") as f_core:
                key = (int(f_pkg.read()), int(f_core.read()))
        except (OSError, ValueError):
            key = (-1, cpu)  # no topology: every CPU its own core
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values(), key=min)


def core_share(cores: list[list[int]], local_rank: int, local_world: int) -> list[int] | None:
    """Local rank ``local_rank``'s CPUs: the ``local_rank``-th of ``local_world`` equal runs of whole cores (the
    remainder unused), or None when there are fewer cores than processes."""
    per = len(cores) // max(local_world, 1)
    if per == 0:
        return None
    return sorted(c for core in cores[local_rank * per : (local_rank + 1) * per] for c in core)


def bind_to_cores(local_rank: int, local_world: int, sysfs: str = "/sys/devices/system/cpu") -> list[int] | None:
    """Bind every thread of this process to local rank ``local_rank``'s share of the allowed physical cores
    (``parallel.cpu_affinity: cores``). Returns the CPUs, or None (nothing changed) when there are fewer physical
    cores than local processes or the OS has no affinity API."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    mine = core_share(physical_cores(os.sched_getaffinity(0), sysfs), local_rank, local_world)
    if mine is None:
        return None
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), mine)
    return mine
