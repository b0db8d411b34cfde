"""Where a training step's GPU time goes: a kernel summary per rank from ``torch.profiler``.

``summarize(prof)`` groups the device kernels of a profile by name and by kind (GEMM, attention, communication, ...)
and measures, on the timeline, how much of the communication ran while no compute kernel did ("exposed") and how long
the device sat idle. The trainer's ``profile.*`` settings profile a few steps of a real run with it
(``StepProfiler``: ``<run_dir>/profile/rank<r>.json``, optionally the Chrome trace); the benchmarks use it for their
kernel tables.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from anytrain import hardware

# (substring of the lower-cased kernel name, kind): the first match wins.
KERNEL_KINDS = (
    ("nccl", "communication"),
    ("rccl", "communication"),
    ("ce_rows", "fused CE row kernel"),
    ("flash", "attention"),
    ("fmha", "attention"),
    ("attention", "attention"),
    ("sdpa", "attention"),
    ("_ss_", "selective scan"),
    ("_conv_", "causal conv1d"),
    ("adam", "optimizer"),
    ("multi_tensor", "optimizer/clip"),
    ("foreach", "optimizer/clip"),
    ("gemm", "GEMM"),
    ("nvjet", "GEMM"),
    ("xmma", "GEMM"),
    ("cutlass", "GEMM"),
    ("cijk", "GEMM"),
    ("triton", "Triton fused elementwise (compile)"),
    ("elementwise", "eager elementwise"),
    ("reduce", "eager reductions"),
    ("copy", "copies"),
    ("memcpy", "copies"),
    ("memset", "memset"),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for key, kind in KERNEL_KINDS if key in low), "other")


def _union_us(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge (start, end) intervals into disjoint sorted ones."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the disjoint sorted intervals ``a`` not covered by the disjoint sorted intervals ``b``."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def timeline(kernels: list[tuple[str, float, float]]) -> dict:
    """From (name, start_us, end_us) device kernels: busy, communication, exposed communication and idle time (ms).

    ``span`` runs from the first kernel's start to the last one's end; ``idle`` is the part of it with no kernel
    running on any stream; ``comm_exposed`` is communication time during which no compute kernel ran."""
    if not kernels:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "comm_ms": 0.0, "comm_exposed_ms": 0.0}
    comm = _union_us([(s, e) for n, s, e in kernels if kernel_kind(n) == "communication"])
    compute = _union_us([(s, e) for n, s, e in kernels if kernel_kind(n) != "communication"])
    busy = _union_us([(s, e) for _, s, e in kernels])
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    return {
        "span_ms": span / 1e3,
        "busy_ms": _length(busy) / 1e3,
        "idle_ms": (span - _length(busy)) / 1e3,
        "comm_ms": _length(comm) / 1e3,
        "comm_exposed_ms": _minus(comm, compute) / 1e3,
    }


def summarize(prof, top: int = 15) -> dict:
    """Kernel summary of a finished ``torch.profiler.profile``: summed kernel time, the ``top`` kernels and the kinds
    (each with its share of the summed kernel time), and the ``timeline`` figures. Without device kernels (a CPU run)
    the rows are operators by self CPU time and the timeline is empty."""
    from torch.autograd import DeviceType

    # user annotations (e.g. "nccl:_all_gather_base", recorded on the GPU timeline too) would count their kernels twice
    averages = [e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)]
    if any(e.device_type == DeviceType.CUDA for e in averages):
        times = [
            (e.key, getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0), e.count)
            for e in averages
            if e.device_type == DeviceType.CUDA
        ]
    else:  # a CPU run: operators by self CPU time (no device timeline)
        times = [(e.key, e.self_cpu_time_total, e.count) for e in averages if e.self_cpu_time_total > 0]
    total_us = sum(t for _, t, _ in times) or 1.0
    kinds: dict[str, float] = {}
    for name, t, _ in times:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + t
    events = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    # host side: operators by self CPU time (where a host-bound step's time goes: dispatch, hooks, Python)
    host = sorted(
        (
            (e.key, e.self_cpu_time_total, e.count)
            for e in averages
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0
        ),
        key=lambda r: -r[1],
    )
    return {
        "host_ms": sum(t for _, t, _ in host) / 1e3,
        "host_top": [{"op": n[:110], "ms": t / 1e3, "calls": c} for n, t, c in host[:top]],
        "kernel_ms": total_us / 1e3,
        "top": [
            {"kernel": n[:110], "ms": t / 1e3, "calls": c, "share": t / total_us}
            for n, t, c in sorted(times, key=lambda r: -r[1])[:top]
        ],
        "kinds": {k: {"ms": t / 1e3, "share": t / total_us} for k, t in sorted(kinds.items(), key=lambda r: -r[1])},
        "timeline": timeline(events),
    }


def format_summary(summary: dict, title: str) -> str:
    t = summary["timeline"]
    lines = [
        f"{title}: kernels {summary['kernel_ms']:.1f} ms summed over streams; timeline {t['span_ms']:.1f} ms, "
        f"idle {t['idle_ms']:.1f} ms, communication {t['comm_ms']:.1f} ms (exposed {t['comm_exposed_ms']:.1f} ms)"
    ]
    lines += [f"  {v['ms']:9.1f} ms {100 * v['share']:5.1f}%  {k}" for k, v in summary["kinds"].items()]
    lines += [
        f"  {r['ms']:9.1f} ms {100 * r['share']:5.1f}% x{r['calls']:<5} {r['kernel'][:90]}" for r in summary["top"]
    ]
    if summary.get("host_top") and t["span_ms"] > 0:  # a GPU profile: the host operators too
        lines.append(f"  host: {summary['host_ms']:.1f} ms of self CPU time in operators; the top ones:")
        lines += [f"  {r['ms']:9.1f} ms x{r['calls']:<6} {r['op'][:90]}" for r in summary["host_top"][:8]]
    if "memory_peak" in summary:
        m = summary["memory_peak"]
        lines.append(
            f"  memory: peak {m['peak_gib']:.2f} GiB ({m['baseline_gib']:.2f} held before); alive at the peak:"
        )
        lines += [f"  {r['gib']:9.2f} GiB x{r['blocks']:<6} {r['site'][-100:]}" for r in m["top"][:8]]
    return "\n".join(lines)


def memory_peak(trace: list[dict], baseline: int, top: int = 20) -> dict:
    """The allocator's peak over a recorded trace (``torch.cuda.memory._snapshot()["device_traces"][i]``): replays
    its ``alloc`` and frees (the first of ``free_requested`` / ``free_completed`` of an address ends its block) on
    top of ``baseline`` bytes held before recording began, and lists the blocks alive at the peak, summed by the
    allocating Python frame (the innermost anytrain frame, else the innermost one), largest first."""

    def replay(events: list[dict]) -> tuple[dict[int, dict], int, int]:
        """The blocks alive after ``events``, and the peak's total and the index of the event that reached it."""
        live: dict[int, dict] = {}
        total = best = where = 0
        for i, event in enumerate(events):
            action, addr = event.get("action"), event.get("addr")
            if action == "alloc":
                live[addr] = event
                total += event["size"]
                if total > best:
                    best, where = total, i
            elif action in ("free_requested", "free_completed") and addr in live:
                total -= live.pop(addr)["size"]
        return live, best, where

    _, best, where = replay(trace)  # one pass for the peak, one up to it for its live set (no copy per new maximum)
    at_peak = replay(trace[: where + 1])[0].values() if best else ()
    sites: dict[str, list[int]] = {}
    for event in at_peak:
        frames = event.get("frames") or []
        ours = [f for f in frames if "anytrain" in f.get("filename", "")]
        frame = (ours or frames or [{}])[0]
        site = f"{frame.get('filename', '?')}:{frame.get('line', '?')} {frame.get('name', '')}".strip()
        entry = sites.setdefault(site, [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "baseline_gib": baseline / 2**30,
        "peak_gib": (baseline + best) / 2**30,
        "recorded_peak_gib": best / 2**30,
        "top": [{"site": site, "gib": b / 2**30, "blocks": n} for site, (b, n) in ranked],
    }


def _activities(device: torch.device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if hardware.is_gpu(device) else [])


def profile_call(fn: Callable[[], None], device: torch.device, top: int = 30) -> dict:
    """``summarize`` of one call of ``fn``, with the device synchronised before the profile ends (the benches' kernel
    tables of one optimizer step)."""
    with profile(activities=_activities(device)) as prof:
        fn()
        hardware.synchronize(device)
    return summarize(prof, top=top)


class StepProfiler:
    """Profiles optimizer steps ``start .. start + steps - 1`` (0-based) of a run on a GPU and writes, per rank,
    ``<out_dir>/rank<r>.json`` (the ``summarize`` dict plus the steps' wall time) and with ``trace`` the Chrome trace
    ``rank<r>.trace.json.gz``. Inactive when ``steps`` is 0; on CPU devices it records operators instead of kernels."""

    def __init__(
        self,
        start: int,
        steps: int,
        out_dir: Path,
        rank: int,
        device: torch.device,
        trace: bool = False,
        memory: bool = False,
    ):
        self.start, self.end = start, start + steps
        self.out_dir, self.rank, self.device, self.trace = Path(out_dir), rank, device, trace
        self.memory = memory
        self.enabled = steps > 0
        self._baseline = 0
        self._prof = None
        self._t0 = 0.0
        self.summary: dict | None = None

    def before_step(self, step: int) -> None:
        if not self.enabled or step != self.start:
            return
        hardware.synchronize(self.device)
        if self.memory:
            self._baseline = hardware.memory_allocated_bytes(self.device)
            hardware.record_memory_history(self.device, True)
        self._prof = profile(activities=_activities(self.device))
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after_step(self, step: int) -> dict | None:
        """``step``: the step just finished (0-based). Returns the summary once the last profiled step is done."""
        if self._prof is None or step + 1 != self.end:
            return None
        hardware.synchronize(self.device)
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        summary = summarize(self._prof)
        summary.update(steps=[self.start, self.end - 1], wall_ms=1e3 * wall, rank=self.rank)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.memory:  # the pickle opens in https://pytorch.org/memory_viz
            snapshot = hardware.memory_snapshot(self.device)
            hardware.record_memory_history(self.device, False)
            with open(self.out_dir / f"rank{self.rank}.memory_snapshot.pickle", "wb") as f:
                pickle.dump(snapshot, f)
            trace = snapshot["device_traces"][self.device.index or 0]
            summary["memory_peak"] = memory_peak(trace, self._baseline)
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.trace:
            self._prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.trace.json.gz"))
        self.summary = summary
        self._prof = None
        return summary
