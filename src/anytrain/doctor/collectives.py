"""Collective checks in the nccl-tests manner: exact expected values with a ``#wrong`` count per rank, and timed
sweeps reported as algorithm and bus bandwidth.

Every functional check fills its inputs with small integers whose sums are exact in float32, so any mismatch is a
fault (a bad link, a miscomputing device, a library bug), never rounding. Bus bandwidth = algbw x the collective's
factor (nccl-tests' PERFORMANCE.md), which makes the numbers comparable with the link speed whatever the rank count:
all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast and send/recv 1. The message size of
all_gather / all_to_all / reduce_scatter is the full (gathered / scattered) buffer, as in nccl-tests.

Test hook: ``ANYTRAIN_TEST_CORRUPT_RANK=<rank>`` makes that rank change one element of its all_reduce result before
checking it (fault injection for the test of the ``#wrong`` count and the exit code; nothing else reads it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from anytrain import hardware

CORRUPT_RANK_VAR = "ANYTRAIN_TEST_CORRUPT_RANK"
# reduce_scatter_tensor's and all_gather_into_tensor's new names from torch 2.13 (the old one warns there)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def bus_factor(name: str, world: int) -> float:
    """nccl-tests' busbw / algbw for ``name`` over ``world`` ranks."""
    if name == "all_reduce":
        return 2 * (world - 1) / world
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) / world
    return 1.0  # broadcast, send/recv


def _pattern(numel: int, device: torch.device) -> torch.Tensor:
    """1..7 repeating: small integers, so sums over thousands of ranks stay exact in float32."""
    return (torch.arange(numel, device=device) % 7 + 1).to(torch.float32)


def _wrong(got: torch.Tensor, expected: torch.Tensor) -> int:
    return int((got != expected).sum().item())


def _all_reduce(rank: int, world: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    base = _pattern(n, device)
    got = base * (rank + 1)
    dist.all_reduce(got)
    if os.environ.get(CORRUPT_RANK_VAR, "") == str(rank):
        got[n // 2] += 1.0  # the planted fault (tests only)
    return got, base * (world * (world + 1) / 2)


def _all_gather(rank: int, world: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    base = _pattern(n, device)
    got = torch.empty(world * n, device=device)
    _ALL_GATHER(got, base + rank)
    return got, torch.cat([base + r for r in range(world)])


def _reduce_scatter(rank: int, world: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    base = _pattern(n, device)
    chunks = torch.cat([base * (rank + 1) + j for j in range(world)])  # chunk j goes to rank j
    got = torch.empty(n, device=device)
    _REDUCE_SCATTER(got, chunks)
    return got, base * (world * (world + 1) / 2) + world * rank


def _broadcast(rank: int, world: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    expected = _pattern(n, device) + 3
    got = expected.clone() if rank == 0 else torch.zeros(n, device=device)
    dist.broadcast(got, src=0)
    return got, expected


def _all_to_all(rank: int, world: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    base = _pattern(n, device)
    sent = torch.cat([base + rank * world + j for j in range(world)])  # chunk j goes to rank j
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent)
    return got, torch.cat([base + src * world + rank for src in range(world)])


def _send_recv(rank: int, world: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A ring: each rank sends to rank + 1 and receives from rank - 1."""
    base = _pattern(n, device)
    got = torch.zeros(n, device=device)
    ops = [dist.P2POp(dist.isend, base + rank, (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return got, base + (rank - 1) % world


CHECKS: dict[str, Callable[[int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]] = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "all_to_all": _all_to_all,
    "send_recv": _send_recv,
}


def functional_checks(device: torch.device, numel: int = 4096) -> list[dict]:
    """Every collective once with exact expected values: one row per collective with this rank's ``wrong`` count
    (elements that differ), or ``error`` where the backend refused the collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for name, check in CHECKS.items():
        row: dict = {"name": name, "elements": numel, "wrong": 0, "error": None}
        try:
            got, expected = check(rank, world, numel, device)
            hardware.synchronize(device)
            row["wrong"] = _wrong(got, expected)
        except (RuntimeError, NotImplementedError, ValueError) as exc:  # e.g. a collective gloo does not implement
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    for _ in range(2):
        fn()
    hardware.synchronize(device)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        hardware.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _timed_op(name: str, numel: int, world: int, rank: int, device: torch.device) -> Callable[[], object]:
    """The collective ``name`` on a message of ``numel`` float32 elements (the whole buffer, nccl-tests' size)."""
    per_rank = max(1, numel // world)
    if name == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t)
    if name == "all_gather":
        out, inp = torch.empty(per_rank * world, device=device), torch.ones(per_rank, device=device)
        return lambda: _ALL_GATHER(out, inp)
    if name == "reduce_scatter":
        inp, out = torch.ones(per_rank * world, device=device), torch.empty(per_rank, device=device)
        return lambda: _REDUCE_SCATTER(out, inp)
    if name == "broadcast":
        t = torch.ones(numel, device=device)
        return lambda: dist.broadcast(t, src=0)
    if name == "all_to_all":
        inp, out = torch.ones(per_rank * world, device=device), torch.empty(per_rank * world, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return ring


def message_numels(name: str, sizes_bytes: list[int], world: int) -> list[int]:
    """The float32 element counts ``name`` is swept at: each size in whole elements, at least one per rank, a
    multiple of ``world`` for the collectives that split the buffer over the ranks; sizes that round to the same count
    (8 B and 16 B over 4 ranks are both 4 elements) appear once."""
    numels: list[int] = []
    for size in sizes_bytes:
        numel = max(world, size // 4)
        if name in ("all_gather", "reduce_scatter", "all_to_all"):
            numel = numel // world * world
        if numel not in numels:
            numels.append(numel)
    return numels


def sweep(name: str, device: torch.device, sizes_bytes: list[int], repeats: int) -> list[dict]:
    """Median time, algbw and busbw of ``name`` at each message size (``message_numels``; GB/s = 1e9 bytes per
    second)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for numel in message_numels(name, sizes_bytes, world):
        seconds = _median_seconds(_timed_op(name, numel, world, rank, device), device, repeats)
        algbw = numel * 4 / seconds / 1e9
        rows.append(
            {
                "bytes": numel * 4,
                "seconds": seconds,
                "algbw_gb_per_s": algbw,
                "busbw_gb_per_s": algbw * bus_factor(name, world),
            }
        )
    return rows
