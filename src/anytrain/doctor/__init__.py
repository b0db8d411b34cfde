"""``anytrain doctor``: is this machine / cluster fit to train? Inventory, ceilings, and collectives.

Runs as one process or under any launcher (torchrun, srun, mpirun). Every rank reports its host and device
(``inventory``), checks a seeded GEMM against a float64 reference, and, with several ranks, runs every collective once
with exact expected values (``collectives.functional_checks``: a ``#wrong`` count per rank, as nccl-tests prints)
and times them (algbw / busbw). Rank 0 compares the inventory with ``--expect-gpus`` (per node) and
``--expect-nodes``, prints the report and writes it as JSON. Any failure is listed as ``rank <r> (<host>): <check>:
<what>``; the CLI then exits non-zero on every rank.

Suites: ``quick`` (inventory, GEMM, functional collectives, an all_reduce sweep up to 4 MiB, no ceilings) takes
seconds; ``full`` adds the matmul / copy ceilings and sweeps every collective up to ``max_mib``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.doctor.collectives import CHECKS, bus_factor, functional_checks, sweep
from anytrain.doctor.inventory import gemm_check, host_inventory, network_interfaces, slurm_allocation
from anytrain.errors import ConfigError
from anytrain.parallel import gather_object, init_distributed, shutdown

SUITES = ("quick", "full")
QUICK_MAX_MIB = 4


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


def device_ceilings(device: torch.device, size: int = 8192) -> dict:
    """Measured bf16 (GPU) / fp32 (CPU) matmul rate and copy bandwidth, on random data."""
    dtype = torch.bfloat16 if hardware.is_gpu(device) else torch.float32
    n = size if hardware.is_gpu(device) else min(size, 1024)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = _time(lambda: a @ b, device, 10)
    src = torch.randn(256 * 2**20 // 4 if hardware.is_gpu(device) else 2**22, device=device)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), device, 10)
    return {
        "matmul_tflops": 2 * n**3 / seconds / 1e12,
        "matmul_shape": n,
        "matmul_dtype": str(dtype).replace("torch.", ""),
        "copy_gb_per_s": 2 * src.numel() * 4 / copy_s / 1e9,  # read + write
    }


def _sizes(max_mib: int) -> list[int]:
    sizes, mib = [], 1
    while mib <= max(1, max_mib):  # 1 MiB, 2 MiB, ... up to max_mib
        sizes.append(mib * 2**20)
        mib *= 2
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


def run_doctor(out: str | None = None, max_mib: int = 1024, repeats: int = 5, suite: str = "full",
               expect_gpus: int | None = None, expect_nodes: int | None = None) -> dict:  # fmt: skip
    """Run the checks on every rank; returns the report (identical ``failures`` on every rank)."""
    if suite not in SUITES:
        raise ConfigError(f"--suite: expected one of {', '.join(SUITES)}, got {suite!r}")
    from anytrain.launch.env import discover

    launch = discover()
    info, device = init_distributed("auto")
    try:
        hosts = gather_object(host_inventory(device))
        gemms = gather_object(gemm_check(device))
        report = {"suite": suite, "hardware": hardware.summary(device), "launch": vars(launch).copy(),
                  "hosts": hosts, "gemm": gemms, "slurm": slurm_allocation(),
                  "network": network_interfaces(), "rank_devices": None, "functional": None}  # fmt: skip
        if suite == "full":
            report["ceilings"] = device_ceilings(device)
        functional = None
        if info.is_distributed:
            report["rank_devices"] = [host["device"] for host in hosts]
            functional = gather_object(functional_checks(device))
            report["functional"] = functional  # [rank][check]
            sizes = _sizes(min(max_mib, QUICK_MAX_MIB) if suite == "quick" else max_mib)
            rows = sweep("all_reduce", device, sizes, repeats)
            report["collectives"] = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
                                     "all_reduce_correct": not any(r[0]["wrong"] for r in functional),
                                     "sweep": rows}  # fmt: skip
            if suite == "full":
                report["sweeps"] = {
                    name: sweep(name, device, sizes, repeats) for name in CHECKS if name != "all_reduce"
                }
        report["failures"] = expectation_failures(hosts, expect_gpus, expect_nodes) + check_failures(
            hosts, gemms, functional
        )
        if info.is_main:
            _print(report)
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(report, indent=1))
        return report
    finally:
        shutdown()


def _print(report: dict) -> None:
    hw, hosts = report["hardware"], report["hosts"]
    print(f"device: {hw['device']} ({hw['vendor']}), torch {hw['torch']}, cuda {hw['cuda']}, hip {hw['hip']}, "
          f"driver {hosts[0].get('driver')}, triton {hw['triton']}")  # fmt: skip
    launch = report["launch"]
    names = sorted({h["host"] for h in hosts})
    print(f"launcher: {launch['launcher']}, {launch['world_size']} rank(s) on {len(names)} host(s): "
          f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")  # fmt: skip
    if report["slurm"]:
        s = report["slurm"]
        print(f"slurm: job {s['job_id']} on {s['nodelist']} ({s['nodes']} node(s), {s['tasks']} task(s))")
    up = [f"{n['name']}{' ' + str(n['speed_mbps']) + 'Mb/s' if n['speed_mbps'] else ''}" for n in report["network"]
          if n["state"] in ("up", "rdma", "unknown")]  # fmt: skip
    print(f"network: {', '.join(up) or 'no interface up besides loopback'}")
    bad_gemm = sum(not g["ok"] for g in report["gemm"])
    print(f"gemm {report['gemm'][0]['dtype']} vs float64: {'ok' if not bad_gemm else f'WRONG on {bad_gemm} rank(s)'}")
    c = report.get("ceilings")
    if c:
        peak = hw["peak_bf16_tflops"]
        share = f" = {100 * c['matmul_tflops'] / peak:.0f}% of the {peak:.0f} TFLOP/s peak" if peak else ""
        print(f"matmul {c['matmul_shape']}^3 {c['matmul_dtype']}: {c['matmul_tflops']:.1f} TFLOP/s{share}")
        print(f"device copy: {c['copy_gb_per_s']:.1f} GB/s (read + write)")
    coll = report.get("collectives")
    if coll:
        _print_functional(report["functional"])
        ok = "ok" if coll["all_reduce_correct"] else "WRONG SUM on at least one rank"
        print(f"all_reduce over {coll['world_size']} ranks ({coll['backend']}): {ok}")
        for name, rows in [("all_reduce", coll["sweep"]), *report.get("sweeps", {}).items()]:
            print(f"{name} (busbw = algbw x {bus_factor(name, coll['world_size']):.3g})")
            print(f"{'size':>10} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
            for row in rows:
                print(f"{row['bytes'] / 2**20:>8.0f}Mi {1e3 * row['seconds']:>10.3f} {row['algbw_gb_per_s']:>11.2f} "
                      f"{row['busbw_gb_per_s']:>11.2f}")  # fmt: skip
    for line in report["failures"]:
        print(f"FAILED {line}")


def _print_functional(functional: list[list[dict]]) -> None:
    """nccl-tests' ``#wrong`` column: one row per collective, one column per rank."""
    ranks = len(functional)
    print(f"{'#wrong':<16}" + "".join(f"{'rank ' + str(r):>8}" for r in range(ranks)))
    for i, row in enumerate(functional[0]):
        cells = ["err" if functional[r][i]["error"] else str(functional[r][i]["wrong"]) for r in range(ranks)]
        print(f"{row['name']:<16}" + "".join(f"{cell:>8}" for cell in cells))
