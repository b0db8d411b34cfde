"""Pieces shared by the benches: random batches, timing, result files, rows in child processes."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from anytrain import hardware

ROOT = Path(__file__).resolve().parents[1]


class RandomBatches:
    """A bank of global batches of random tokens; ``rank_batch`` has the trainer's BatchSource signature."""

    def __init__(self, vocab: int, global_batch: int, seq: int, seed: int = 0, bank: int = 4) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.bank = [torch.randint(0, vocab, (global_batch, seq + 1), generator=gen) for _ in range(bank)]

    def rank_batch(self, step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = self.bank[step % len(self.bank)]  # (G, T+1)
        return tokens[:, :-1], tokens[:, 1:], torch.arange(tokens.shape[0])


def bench_device(smoke: bool = False) -> torch.device:
    """The device a bench row runs on (the CPU for a smoke run), with TF32 allowed for fp32 matmuls outside autocast
    on GPUs: the same for every row and stack."""
    device = hardware.resolve_device("cpu" if smoke else "auto")
    if hardware.is_gpu(device):
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def release(device: torch.device) -> None:
    """Free the previous row completely (its closures and reference cycles too) before the next one starts."""
    gc.collect()
    torch._dynamo.reset()
    if hardware.is_gpu(device):
        torch.cuda.empty_cache()
    hardware.reset_peak_memory(device)


def versions(device: torch.device) -> dict:
    """The device summary plus the versions of the libraries a row may use."""
    out = hardware.summary(device)
    for name in ("transformers", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    out["python"] = sys.version.split()[0]
    return out


def results_path(out: str, bench: str, env: dict, smoke: bool = False) -> Path:
    """``<out>/<bench>_<device slug>.json`` (``<bench>_smoke.json`` for a CPU smoke run), its folder created."""
    slug = "smoke" if smoke else re.sub(r"[^a-z0-9]+", "-", str(env["device"]).lower()).strip("-")
    path = Path(out) / f"{bench}_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_rows(bench: str, out: str, rows: list[dict], smoke: bool = False) -> None:
    """Write ``{"device": versions, "rows": rows}`` to :func:`results_path` and exit 1 when a row failed."""
    env = versions(hardware.resolve_device("cpu" if smoke else "auto"))
    path = results_path(out, bench, env, smoke)
    path.write_text(json.dumps({"device": env, "rows": rows}, indent=1, default=str))
    print(f"\nwrote {path}")
    if any("error" in r for r in rows):
        sys.exit(1)


def row_error(exc: BaseException) -> str:
    """What a failed row records (one failing row must not lose the others): OOM in one line, else type and text."""
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory: {str(exc).splitlines()[0][:200]}"
    return f"{type(exc).__name__}: {str(exc)[:400]}"


ROW_MARK = "ROW-JSON "
"""A child process prints its row as this prefix + JSON (``print_row``); the parent reads the last such line."""


def timed(step, device: torch.device, warmup: int, steps: int) -> dict:
    """``step(i)`` for ``warmup`` untimed then ``steps`` timed iterations: seconds per step and the peak memory of
    the timed ones."""
    for i in range(warmup):
        step(i)
    hardware.synchronize(device)
    hardware.reset_peak_memory(device)
    started = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    hardware.synchronize(device)
    return {
        "seconds_per_step": (time.perf_counter() - started) / steps,
        "peak_mem_gib": hardware.peak_memory_gib(device),
    }


def print_row(row: dict) -> None:
    print(ROW_MARK + json.dumps(row, default=str), flush=True)


def print_profile(name: str, step_s: float, profile: dict) -> None:
    """The top kernels of one profiled step (``train.profiling.profile_call``) beside the timed steps' wall time."""
    print(f"\nprofile of one step of {name}: wall {1e3 * step_s:.0f} ms, kernels {profile['kernel_ms']:.0f} ms")
    for k in profile["top"]:
        print(f"  {k['ms']:>9.1f} ms {100 * k['share']:>5.1f}% x{k['calls']:<5} {k['kernel'][:90]}")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH`` (``bench`` and ``src``), so that a child
    ``python -m bench.<name>`` runs this tree's benches and anytrain from any working directory."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_row_in_child(module: str, argv: list[str], name: str) -> dict:
    """``python -m MODULE ARGV --one-row NAME`` in a fresh process with its own empty inductor cache (a shared process
    or cache biases compiled rows); the row it printed with ``print_row``, or ``{"row": name, "error": ...}``."""
    cmd = [sys.executable, "-m", module, *argv, "--one-row", name]
    with tempfile.TemporaryDirectory(prefix="anytrain-bench-inductor-") as cache:
        env = child_env(TORCHINDUCTOR_CACHE_DIR=cache)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(ROW_MARK)]
    if not lines:
        return {"row": name, "error": f"child exited {proc.returncode}: {proc.stdout[-600:]}"}
    return json.loads(lines[-1][len(ROW_MARK) :])
