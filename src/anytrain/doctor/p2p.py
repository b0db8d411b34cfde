"""Point-to-point latency and bandwidth between every ordered pair of ranks (send / recv).

The pairs are scheduled as a round-robin tournament (the circle method): W - 1 rounds (W rounds for an odd W) of
disjoint pairs, so no rank is in two pairs at once and the whole matrix takes O(W) rounds, not O(W²). In each round
both ranks of a pair take the initiator's role in turn:

- latency a -> b: a sends ``small_bytes`` to b, b sends them back; half the round trip, median over ``repeats``;
- bandwidth a -> b: a sends ``large_bytes`` to b, b answers with ``small_bytes``; large_bytes / time (GB/s = 1e9 B/s),
  median over ``repeats`` (the answer's latency is small next to a large message's transfer).

Pairs of one round run at the same time, so ranks that share a NIC or a PCIe switch share it here as in training.

Every send and receive is a one-operation ``batch_isend_irecv``: NCCL runs it on the group's communicator as a batched
point-to-point op, where an unbatched ``send`` / ``recv`` makes it warn on every rank (in eager initialisation mode)
and serialise the op with all other collectives of the group. The exchange itself is unchanged: the initiator's
receive starts after its send, the partner's answer after its receive (gloo runs the same ops directly).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from anytrain import hardware


def round_robin(world: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint unordered pairs covering every pair of ``range(world)`` exactly once."""
    players: list[int | None] = list(range(world)) + ([None] if world % 2 else [])
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = [(players[i], players[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def _one(op, tensor: torch.Tensor, peer: int) -> None:
    """``op`` (``dist.isend`` / ``dist.irecv``) with ``peer`` as a batch of one, waited for."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]):
        work.wait()


def _ping(partner: int, initiator: bool, out: torch.Tensor, back: torch.Tensor, device: torch.device) -> float:
    """One exchange: the initiator sends ``out`` and waits for ``back``; the partner mirrors it. Seconds on the
    initiator (0.0 on the partner)."""
    start = time.perf_counter()
    if initiator:
        _one(dist.isend, out, partner)
        _one(dist.irecv, back, partner)
    else:
        _one(dist.irecv, out, partner)
        _one(dist.isend, back, partner)
    hardware.synchronize(device)
    return time.perf_counter() - start


def _measure(
    partner: int, initiator: bool, out: torch.Tensor, back: torch.Tensor, device: torch.device, repeats: int
) -> float:
    for _ in range(2):  # warm-up: the first send between two ranks sets up their connection
        _ping(partner, initiator, out, back, device)
    return _median([_ping(partner, initiator, out, back, device) for _ in range(repeats)])


def p2p_matrix(device: torch.device, small_bytes: int = 8, large_bytes: int = 64 * 2**20, repeats: int = 5) -> dict:
    """This rank's row of the matrices: {"latency_us": {dst: µs}, "bandwidth_gb_per_s": {dst: GB/s}} for every other
    rank dst (this rank initiating). Every rank must call it (it steps through the rounds with barriers)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    small = torch.ones(max(1, small_bytes // 4), device=device)
    small_back = torch.empty_like(small)
    large = torch.ones(max(1, large_bytes // 4), device=device)
    latency, bandwidth = {}, {}
    for pairs in round_robin(world):
        partner = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        for first in (True, False):  # the lower rank initiates first, then the higher one
            dist.barrier()
            if partner is None:
                continue
            initiator = (rank < partner) == first
            seconds = _measure(partner, initiator, small, small_back, device, repeats)
            if initiator:
                latency[partner] = 1e6 * seconds / 2
            seconds = _measure(partner, initiator, large, small_back, device, repeats)
            if initiator:
                bandwidth[partner] = large.numel() * 4 / seconds / 1e9
    dist.barrier()
    return {
        "latency_us": latency,
        "bandwidth_gb_per_s": bandwidth,
        "small_bytes": small.numel() * 4,
        "large_bytes": large.numel() * 4,
    }


def as_matrices(rows: list[dict]) -> dict:
    """Gathered rows -> {"latency_us": [[src][dst]], "bandwidth_gb_per_s": [[src][dst]], sizes}; None on the
    diagonal."""
    world = len(rows)
    out: dict = {"small_bytes": rows[0]["small_bytes"], "large_bytes": rows[0]["large_bytes"]}
    for key in ("latency_us", "bandwidth_gb_per_s"):
        out[key] = [[rows[src][key].get(dst) for dst in range(world)] for src in range(world)]
    return out
