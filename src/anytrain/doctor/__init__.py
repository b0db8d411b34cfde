"""``anytrain doctor``: is this machine / cluster fit to train? Devices, ceilings, and collectives.

Single process: device facts, a bf16 matmul and a device-to-device copy (the two ceilings MFU and kernels are
judged against). Under torchrun / srun / mpirun: all_reduce correctness on every rank and a bus-bandwidth sweep
(NCCL-tests convention: busbw = algbw × 2(n−1)/n for all_reduce), printed by rank 0 and written as JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.parallel import gather_object, init_distributed, shutdown


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


def collectives(device: torch.device, sizes_bytes: list[int], repeats: int = 5) -> dict:
    """all_reduce correctness and bus bandwidth over the default group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    probe = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    expected = world * (world + 1) / 2
    correct = bool(torch.all(probe == expected))
    flags = torch.tensor([0.0 if correct else 1.0], device=device)
    dist.all_reduce(flags)  # every rank learns whether any rank saw a wrong sum
    rows = []
    for size in sizes_bytes:
        tensor = torch.ones(max(1, size // 4), device=device)
        seconds = _time(lambda t=tensor: dist.all_reduce(t), device, repeats)
        algbw = tensor.numel() * 4 / seconds / 1e9
        rows.append({"bytes": tensor.numel() * 4, "seconds": seconds, "algbw_gb_per_s": algbw,
                     "busbw_gb_per_s": algbw * 2 * (world - 1) / world})  # fmt: skip
    return {"world_size": world, "backend": dist.get_backend(), "all_reduce_correct": flags.item() == 0, "sweep": rows}


def run_doctor(out: str | None = None, max_mib: int = 1024, repeats: int = 5) -> dict:
    info, device = init_distributed("auto")
    try:
        report = {"hardware": hardware.summary(device), "rank_devices": None}
        report["ceilings"] = device_ceilings(device)
        if info.is_distributed:
            report["rank_devices"] = gather_object(hardware.device_name(device))
            sizes, mib = [], 1
            while mib <= max(1, max_mib):  # 1 MiB, 2 MiB, ... up to max_mib
                sizes.append(mib * 2**20)
                mib *= 2
            report["collectives"] = collectives(device, sizes, repeats)
        if info.is_main:
            _print(report)
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(report, indent=1))
        return report
    finally:
        shutdown()


def _print(report: dict) -> None:
    hw, c = report["hardware"], report["ceilings"]
    print(f"device: {hw['device']} ({hw['vendor']}), torch {hw['torch']}, triton {hw['triton']}")
    peak = hw["peak_bf16_tflops"]
    share = f" = {100 * c['matmul_tflops'] / peak:.0f}% of the {peak:.0f} TFLOP/s peak" if peak else ""
    print(f"matmul {c['matmul_shape']}^3 {c['matmul_dtype']}: {c['matmul_tflops']:.1f} TFLOP/s{share}")
    print(f"device copy: {c['copy_gb_per_s']:.1f} GB/s (read + write)")
    coll = report.get("collectives")
    if coll:
        ok = "ok" if coll["all_reduce_correct"] else "WRONG SUM on at least one rank"
        print(f"all_reduce over {coll['world_size']} ranks ({coll['backend']}): {ok}")
        print(f"{'size':>10} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for row in coll["sweep"]:
            print(f"{row['bytes'] / 2**20:>8.0f}Mi {1e3 * row['seconds']:>10.3f} {row['algbw_gb_per_s']:>11.2f} "
                  f"{row['busbw_gb_per_s']:>11.2f}")  # fmt: skip
