"""The doctor's all_reduce bus bandwidth next to a raw ``torch.distributed.all_reduce`` loop, in the same processes.

Run under any launcher, e.g. ``torchrun --nproc-per-node 4 -m bench.allreduce_vs_raw --out results/``. For each
message size (default 1 GiB), two figures on the same fp32 buffer size:

- ``doctor``: ``anytrain.doctor.collectives.sweep`` (median of ``--repeats`` timed calls, each after a barrier and
  ended by a device synchronisation; what ``anytrain doctor`` prints);
- ``raw``: ``--iters`` back-to-back ``dist.all_reduce`` calls after a warm-up, one synchronisation at the end,
  seconds / iters (nccl-tests' way of timing; no barrier per call).

busbw = algbw x 2(n-1)/n for both. Rank 0 prints one line per size and writes
``<out>/allreduce_vs_raw_<world>ranks_<vendor>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from anytrain import hardware
from anytrain.doctor.collectives import bus_factor, sweep
from anytrain.parallel.mesh import init_distributed, shutdown


def raw_all_reduce(numel: int, device: torch.device, iters: int, warmup: int = 5) -> float:
    """Seconds per ``dist.all_reduce`` of ``numel`` fp32 elements, back to back."""
    buffer = torch.ones(numel, device=device)
    for _ in range(warmup):
        dist.all_reduce(buffer)
    hardware.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer)
    hardware.synchronize(device)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results", help="Directory for the JSON (rank 0).")
    parser.add_argument("--mib", type=int, nargs="+", default=[1024], help="Message sizes in MiB.")
    parser.add_argument("--repeats", type=int, default=10, help="Timed calls of the doctor's sweep per size.")
    parser.add_argument("--iters", type=int, default=20, help="Back-to-back calls of the raw loop per size.")
    args = parser.parse_args()
    info, device = init_distributed("auto")
    if not info.is_distributed:
        raise SystemExit("error: run under a launcher with at least 2 processes (torchrun --nproc-per-node N ...)")
    world = dist.get_world_size()
    factor = bus_factor("all_reduce", world)
    rows = []
    for mib in args.mib:
        doctor = sweep("all_reduce", device, [mib * 2**20], args.repeats)[0]
        seconds = raw_all_reduce(doctor["bytes"] // 4, device, args.iters)
        raw_algbw = doctor["bytes"] / seconds / 1e9
        rows.append(
            {
                "bytes": doctor["bytes"],
                "doctor": doctor,
                "raw": {"seconds": seconds, "algbw_gb_per_s": raw_algbw, "busbw_gb_per_s": raw_algbw * factor},
                "doctor_over_raw_busbw": doctor["busbw_gb_per_s"] / (raw_algbw * factor),
            }
        )
    if info.is_main:
        summary = hardware.summary(device)
        for row in rows:
            print(
                f"all_reduce {row['bytes'] / 2**20:.0f} MiB over {world} ranks ({dist.get_backend()}): doctor busbw "
                f"{row['doctor']['busbw_gb_per_s']:.1f} GB/s, raw loop {row['raw']['busbw_gb_per_s']:.1f} GB/s "
                f"(ratio {row['doctor_over_raw_busbw']:.3f})"
            )
        out = Path(args.out) / f"allreduce_vs_raw_{world}ranks_{summary['vendor']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {"world_size": world, "backend": dist.get_backend(), "hardware": summary, "rows": rows}, indent=1
            )
        )
        print(f"wrote {out}")
    shutdown()


if __name__ == "__main__":
    main()
