"""The doctor's suite runner: every rank gathers its inventory and runs the checks and measurements of the suite
(quick or full), rank 0 derives the failures (``checks``), prints the report and writes it as JSON."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.doctor import smoke
from anytrain.doctor.checks import check_failures, expectation_failures, threshold_failures, training_failures
from anytrain.doctor.collectives import CHECKS, functional_checks, sweep
from anytrain.doctor.inventory import (
    VISIBLE_DEVICES_VARS,
    collective_env,
    gemm_check,
    gemm_throughput,
    host_inventory,
    network_interfaces,
    slurm_allocation,
    topology,
)
from anytrain.doctor.p2p import as_matrices, p2p_matrix
from anytrain.doctor.report import print_report, summarize
from anytrain.doctor.thresholds import Thresholds
from anytrain.errors import ConfigError
from anytrain.parallel.collectives import gather_object
from anytrain.parallel.env import discover
from anytrain.parallel.mesh import init_distributed, shutdown

SUITES = ("quick", "full")
QUICK_MAX_MIB = 4
GEMM_SIZE = {"quick": 4096, "full": 8192}


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after two warm-ups (device-synchronised)."""
    for _ in range(2):
        fn()
    hardware.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        hardware.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def device_ceilings(device: torch.device) -> dict:
    """Measured device copy bandwidth (read + write) on random data."""
    src = torch.randn(256 * 2**20 // 4 if hardware.is_gpu(device) else 2**22, device=device)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), device, 10)
    return {"copy_gb_per_s": 2 * src.numel() * 4 / copy_s / 1e9}


def sweep_sizes(min_bytes: int, max_mib: int) -> list[int]:
    """min_bytes, 2 x min_bytes, ... up to max_mib MiB (nccl-tests' -b/-e/-f 2); ``collectives.message_numels``
    rounds them per collective and drops the repeats."""
    sizes, size = [], max(1, min_bytes)
    while size <= max(1, max_mib) * 2**20:
        sizes.append(size)
        size *= 2
    return sizes


def _env_differences(envs: list[dict[str, str]]) -> dict[int, list[str]]:
    """Ranks whose collective variables differ from rank 0's (visible-device lists aside): the differing names."""
    diffs = {}
    for rank, env in enumerate(envs[1:], start=1):
        keys = sorted(k for k in set(env) | set(envs[0]) if env.get(k) != envs[0].get(k))
        keys = [k for k in keys if k not in VISIBLE_DEVICES_VARS]
        if keys:
            diffs[rank] = keys
    return diffs


def _training(device: torch.device, rank: int, world: int, work_dir: str | None) -> dict:
    """The full suite's trainings: the all-rank run here, then every rank's one-device child (and rank 0's
    kill-restart) in ``work_dir``/rank<r> (default a temporary folder, removed when the checks pass)."""
    all_ranks = gather_object(smoke.train_all_ranks(world, device)) if world > 1 else None
    base = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="anytrain-doctor-"))
    runs = gather_object(smoke.one_device_runs(device, world, base / f"rank{rank}", kill_restart=rank == 0))
    if not work_dir:
        with contextlib.suppress(OSError):
            base.rmdir()  # empty unless a failed run's folder was kept
    source = smoke.corpus_source(smoke.MICRO_BATCH * world)
    global_ids = {s: source.global_sample_ids(s).tolist() for s in range(smoke.SMOKE_STEPS)}
    return {"steps": smoke.SMOKE_STEPS, "one_device": runs, "all_ranks": all_ranks, "global_ids": global_ids}


def _distributed_checks(report: dict, device: torch.device, suite: str, sizes: list[int], repeats: int) -> None:
    """Functional collectives, the sweeps and the p2p matrix, into ``report``."""
    world = dist.get_world_size()
    report["rank_devices"] = [host["device"] for host in report["hosts"]]
    report["functional"] = gather_object(functional_checks(device))  # [rank][check]
    report["collectives"] = {
        "world_size": world,
        "backend": dist.get_backend(),
        "all_reduce_correct": not any(r[0]["wrong"] for r in report["functional"]),
        "sweep": sweep("all_reduce", device, sizes, repeats),
    }
    if suite == "full":
        report["sweeps"] = {name: sweep(name, device, sizes, repeats) for name in CHECKS if name != "all_reduce"}
    large = min(sizes[-1], 64 * 2**20)
    report["p2p"] = as_matrices(gather_object(p2p_matrix(device, 8, large, repeats)))


def run_doctor(
    out: str | None = None,
    max_mib: int = 1024,
    repeats: int = 5,
    suite: str = "full",
    expect_gpus: int | None = None,
    expect_nodes: int | None = None,
    min_bytes: int = 8,
    thresholds: Thresholds | None = None,
    work_dir: str | None = None,
) -> dict:
    """Run the checks on every rank; returns the report (identical ``failures`` on every rank)."""
    if suite not in SUITES:
        raise ConfigError(f"--suite: expected one of {', '.join(SUITES)}, got {suite!r}")
    if min_bytes < 1 or min_bytes > max(1, max_mib) * 2**20:
        raise ConfigError(f"--min-bytes: must be between 1 and --max-mib ({max_mib} MiB), got {min_bytes}")
    th = thresholds or Thresholds()
    launch = discover()
    info, device = init_distributed("auto")
    try:
        hosts = gather_object(host_inventory(device))
        envs = gather_object(collective_env())
        partition = gather_object(smoke.data_partition(info.world_size, info.rank))
        report = {
            "suite": suite,
            "hardware": hardware.summary(device),
            "launch": vars(launch).copy(),
            "hosts": hosts,
            "thresholds": dataclasses.asdict(th),
            "collective_env": envs[0],
            "collective_env_differs": _env_differences(envs),
            "topology": [t for t in gather_object(topology() if launch.local_rank == 0 else None) if t],
            "gemm": gather_object(gemm_check(device)),
            "gemm_throughput": gather_object(gemm_throughput(device, GEMM_SIZE[suite], repeats)),
            "slurm": slurm_allocation(),
            "network": network_interfaces(),
            "rank_devices": None,
            "functional": None,
            "expectations": {"gpus_per_node": expect_gpus, "nodes": expect_nodes},
        }
        report["data_partition"] = {"steps": sorted(partition[0]["ids"]), "ranks": info.world_size}
        if suite == "full":
            report["ceilings"] = device_ceilings(device)
        if info.is_distributed:
            sizes = sweep_sizes(min_bytes, min(max_mib, QUICK_MAX_MIB) if suite == "quick" else max_mib)
            _distributed_checks(report, device, suite, sizes, repeats)
        if suite == "full":
            report["training"] = _training(device, info.rank, info.world_size, work_dir)
        report["failures"] = (
            expectation_failures(hosts, expect_gpus, expect_nodes)
            + check_failures(hosts, report["gemm"], report["functional"])
            + smoke.partition_failures([p["ids"] for p in partition], partition[0]["global"], hosts)
            + threshold_failures(report, th)
            + (training_failures(hosts, report["training"], th) if "training" in report else [])
        )
        report["summary"] = summarize(report)
        if info.is_main:
            print_report(report)
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(report, indent=1))
        return report
    finally:
        shutdown()
