"""``anytrain doctor``: is this machine / cluster fit to train? Inventory, collectives, links, GEMMs and trainings.

Runs as one process or under any launcher (torchrun, srun, mpirun). Every rank reports its host and device
(``inventory``), the collective libraries' environment variables and, once per host, the GPU topology; checks a seeded
GEMM against a float64 reference and times a large one against the device's peak; checks the loader's data partition.
With several ranks it runs every collective once with exact expected values (``collectives.functional_checks``: a
``#wrong`` count per rank, as nccl-tests prints), sweeps them (algbw / busbw) and measures every ordered rank pair's
latency and bandwidth (``p2p``). The full suite adds device ceilings, the sweeps of every collective up to
``max_mib``, and the tiny trainings with a checkpoint killed and resumed (``smoke``). Rank 0 compares the inventory
with ``--expect-gpus`` (per node) and ``--expect-nodes`` and the measurements with the thresholds
(``thresholds.Thresholds``), prints the report (``report``: rich tables, a pass / fail summary of every check with
its failing ranks) and writes it as JSON. Any failure is listed as ``rank <r> (<host>): <check>: <what>``; the CLI
then exits non-zero on every rank.
"""

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
from anytrain.parallel import gather_object, init_distributed, shutdown

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


def expectation_failures(hosts: list[dict], expect_gpus: int | None, expect_nodes: int | None) -> list[str]:
    """Inventory against the expectations: one line per rank whose host shows another GPU count, and one line when
    the ranks span another number of hosts."""
    failures = []
    if expect_gpus is not None:
        for rank, host in enumerate(hosts):
            if host["gpus_visible"] != expect_gpus:
                failures.append(f"rank {rank} ({host['host']}): inventory: {host['gpus_visible']} GPUs visible, "
                                f"expected {expect_gpus} per node")  # fmt: skip
    names = sorted({host["host"] for host in hosts})
    if expect_nodes is not None and len(names) != expect_nodes:
        failures.append(f"rank 0 ({hosts[0]['host']}): inventory: ranks run on {len(names)} node(s) "
                        f"({', '.join(names[:8])}), expected {expect_nodes}")  # fmt: skip
    return failures


def check_failures(hosts: list[dict], gemms: list[dict], functional: list[list[dict]] | None) -> list[str]:
    """``rank <r> (<host>): <check>: <what>`` for every failed GEMM and collective check."""
    failures = []
    for rank, (host, gemm) in enumerate(zip(hosts, gemms, strict=True)):
        if not gemm["ok"]:
            what = "non-finite output" if not gemm["finite"] else f"max relative error {gemm['max_rel_error']:.2e}"
            failures.append(f"rank {rank} ({host['host']}): gemm {gemm['dtype']} {gemm['shape']}^3: {what}")
    for rank, rows in enumerate(functional or []):
        for row in rows:
            if row["error"]:
                failures.append(f"rank {rank} ({hosts[rank]['host']}): {row['name']}: {row['error']}")
            elif row["wrong"]:
                failures.append(f"rank {rank} ({hosts[rank]['host']}): {row['name']}: #wrong {row['wrong']} of "
                                f"{row['elements']} elements")  # fmt: skip
    return failures


def threshold_failures(report: dict, th: Thresholds) -> list[str]:
    """GEMM throughput, all_reduce busbw and p2p latency / bandwidth against the thresholds (0 = not checked)."""
    hosts, failures = report["hosts"], []
    name = [f"rank {r} ({h['host']})" for r, h in enumerate(hosts)]
    for rank, row in enumerate(report["gemm_throughput"]):
        if th.gemm_min_fraction and row["fraction"] is not None and row["fraction"] < th.gemm_min_fraction:
            failures.append(f"{name[rank]}: gemm throughput: {row['tflops']:.1f} TFLOP/s = {row['fraction']:.2f} of "
                            f"the {row['peak_tflops']:.0f} TFLOP/s peak < {th.gemm_min_fraction:g} "
                            "(gemm_min_fraction)")  # fmt: skip
    coll = report.get("collectives")
    if coll and th.busbw_min_gb_per_s and coll["sweep"]:
        last = coll["sweep"][-1]
        if last["busbw_gb_per_s"] < th.busbw_min_gb_per_s:
            failures.append(f"{name[0]}: all_reduce busbw: {last['busbw_gb_per_s']:.2f} GB/s at {last['bytes']} B < "
                            f"{th.busbw_min_gb_per_s:g} GB/s (busbw_min_gb_per_s)")  # fmt: skip
    p2p = report.get("p2p")
    for src, row in enumerate(p2p["latency_us"] if p2p else []):
        for dst, latency in enumerate(row):
            bandwidth = p2p["bandwidth_gb_per_s"][src][dst]
            pair = f"{name[src]}: p2p to {name[dst]}"
            if latency is not None and th.p2p_latency_max_us and latency > th.p2p_latency_max_us:
                failures.append(f"{pair}: latency {latency:.1f} us > {th.p2p_latency_max_us:g} us "
                                "(p2p_latency_max_us)")  # fmt: skip
            if bandwidth is not None and th.p2p_bandwidth_min_gb_per_s and bandwidth < th.p2p_bandwidth_min_gb_per_s:
                failures.append(f"{pair}: bandwidth {bandwidth:.2f} GB/s < {th.p2p_bandwidth_min_gb_per_s:g} GB/s "
                                "(p2p_bandwidth_min_gb_per_s)")  # fmt: skip
    return failures


def training_failures(hosts: list[dict], training: dict, th: Thresholds) -> list[str]:
    """The one-device runs (each against rank 0's), the all-rank run (mean loss against rank 0's one-device run,
    identical replicas, the ids it trained on) and the kill-restart (against the uninterrupted run)."""
    name = [f"rank {r} ({h['host']})" for r, h in enumerate(hosts)]
    steps, failures = smoke.SMOKE_STEPS, []
    runs, all_ranks = training["one_device"], training["all_ranks"]
    ref = smoke.as_list(runs[0]["losses"], steps) if runs[0]["losses"] else None
    for rank, run in enumerate(runs):
        if run["error"]:
            failures.append(f"{name[rank]}: training (one device): {run['error']}")
            continue
        losses = smoke.as_list(run["losses"], steps)
        problem = smoke.curve_problem(losses, th.min_loss_drop)
        if problem:
            failures.append(f"{name[rank]}: training (one device): {problem}")
        mismatch = smoke.loss_mismatch(losses, ref, th.loss_rtol) if rank and ref else None
        if mismatch:
            failures.append(f"{name[rank]}: training (one device): against rank 0's run: {mismatch} (loss_rtol)")
    if all_ranks:
        n = min(len(r["losses"]) for r in all_ranks)
        mean = [sum(r["losses"][i] for r in all_ranks) / len(all_ranks) for i in range(n)]
        problem = smoke.curve_problem(mean, th.min_loss_drop)
        if problem:
            failures.append(f"{name[0]}: training (all ranks): {problem}")
        mismatch = smoke.loss_mismatch(mean, ref, th.loss_rtol) if ref else None
        if mismatch:
            failures.append(f"{name[0]}: training (all ranks): mean loss against rank 0's one-device run: {mismatch} "
                            "(loss_rtol)")  # fmt: skip
        for rank, run in enumerate(all_ranks):
            if run["fingerprint"] != all_ranks[0]["fingerprint"]:
                failures.append(f"{name[rank]}: training (all ranks): parameters differ from rank 0's after {n} steps "
                                "(the replicas diverged)")  # fmt: skip
        failures += smoke.partition_failures([r["ids"] for r in all_ranks], training["global_ids"], hosts,
                                             "training data partition")  # fmt: skip
    kill = runs[0]["kill_restart"]
    if kill and kill["error"]:
        failures.append(f"{name[0]}: checkpoint kill-restart: {kill['error']}")
    elif kill and ref:
        mismatch = smoke.loss_mismatch(smoke.as_list(kill["losses"], steps), ref, th.resume_rtol)
        if mismatch:
            failures.append(f"{name[0]}: checkpoint kill-restart: resumed run against the uninterrupted one: "
                            f"{mismatch} (resume_rtol)")  # fmt: skip
    return failures


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
    report["collectives"] = {"world_size": world, "backend": dist.get_backend(),
                             "all_reduce_correct": not any(r[0]["wrong"] for r in report["functional"]),
                             "sweep": sweep("all_reduce", device, sizes, repeats)}  # fmt: skip
    if suite == "full":
        report["sweeps"] = {name: sweep(name, device, sizes, repeats) for name in CHECKS if name != "all_reduce"}
    large = min(sizes[-1], 64 * 2**20)
    report["p2p"] = as_matrices(gather_object(p2p_matrix(device, 8, large, repeats)))


def run_doctor(out: str | None = None, max_mib: int = 1024, repeats: int = 5, suite: str = "full",
               expect_gpus: int | None = None, expect_nodes: int | None = None, min_bytes: int = 8,
               thresholds: Thresholds | None = None, work_dir: str | None = None) -> dict:  # fmt: skip
    """Run the checks on every rank; returns the report (identical ``failures`` on every rank)."""
    if suite not in SUITES:
        raise ConfigError(f"--suite: expected one of {', '.join(SUITES)}, got {suite!r}")
    if min_bytes < 1 or min_bytes > max(1, max_mib) * 2**20:
        raise ConfigError(f"--min-bytes: must be between 1 and --max-mib ({max_mib} MiB), got {min_bytes}")
    th = thresholds or Thresholds()
    from anytrain.launch.env import discover

    launch = discover()
    info, device = init_distributed("auto")
    try:
        hosts = gather_object(host_inventory(device))
        envs = gather_object(collective_env())
        partition = gather_object(smoke.data_partition(info.world_size, info.rank))
        report = {"suite": suite, "hardware": hardware.summary(device), "launch": vars(launch).copy(),
                  "hosts": hosts, "thresholds": dataclasses.asdict(th), "collective_env": envs[0],
                  "collective_env_differs": _env_differences(envs),
                  "topology": [t for t in gather_object(topology() if launch.local_rank == 0 else None) if t],
                  "gemm": gather_object(gemm_check(device)),
                  "gemm_throughput": gather_object(gemm_throughput(device, GEMM_SIZE[suite], repeats)),
                  "slurm": slurm_allocation(), "network": network_interfaces(), "rank_devices": None,
                  "functional": None,
                  "expectations": {"gpus_per_node": expect_gpus, "nodes": expect_nodes}}  # fmt: skip
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
