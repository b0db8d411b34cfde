"""Throughput accounting (``RunMeter``: every rank) and metric sinks (JSONL, TensorBoard, rich console/progress bar;
``MetricsLogger``: rank 0 only).

tokens_per_s counts the tokens of all ranks; MFU = flops_per_token × tokens/s per device / peak FLOP/s of the
device (dense bf16, from ``hardware``). On CPU there is no honest peak, so ``mfu`` is null ("n/a" on screen).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from anytrain import hardware
from anytrain.train.energy import EnergyMeter, energy_metrics
from anytrain.train.wandb_sink import WandbSink

if TYPE_CHECKING:
    from anytrain.config import RunConfig


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None without a known peak."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_s_per_device / peak_flops


class ThroughputMeter:
    """Tokens/s over the window between two log steps (the caller synchronises the device before ``lap``)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def lap(self) -> tuple[float, float]:
        """(tokens/s, seconds) since the previous lap; resets the window."""
        now = time.perf_counter()
        seconds = max(now - self._t0, 1e-9)
        rate = self._tokens / seconds
        self._t0, self._tokens = now, 0
        return rate, seconds

    def reset(self) -> None:
        self._t0, self._tokens = time.perf_counter(), 0


class MetricWindow:
    """This rank's loss sum and step count since the last log line. Saved in checkpoints (TrainState.metrics), so
    that the first record after a resume averages the same steps as the uninterrupted run."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self._before_last = torch.zeros((), device=device)  # the sum before the last ``add`` (``drop_last``)
        self.steps = 0

    def add(self, loss: torch.Tensor) -> None:
        self._before_last.copy_(self.loss)  # on the device: no host sync
        self.loss += loss
        self.steps += 1

    def drop_last(self) -> None:
        """Take back the last ``add`` (a step found non-finite after it was counted: its loss may be NaN)."""
        self.loss.copy_(self._before_last)
        self.steps -= 1

    def mean(self) -> torch.Tensor:
        return self.loss / max(self.steps, 1)

    def reset(self) -> None:
        self.loss.zero_()
        self.steps = 0

    def restore(self, loss_sum: float, steps: int) -> None:
        self.loss.fill_(loss_sum)
        self.steps = steps

    @classmethod
    def restored(
        cls, device: torch.device, saved: dict | None, rank: int, world_size: int, loss_ranks: int
    ) -> MetricWindow:
        """The window a checkpoint's ``TrainState.metrics`` saved (every rank's loss sum; empty without one). At the
        saving world size and loss ranks each rank takes its own loss sum back (exact); otherwise the ranks share the
        total, so that the logged global mean is the same."""
        window = cls(device)
        if saved and saved["window_steps"]:
            sums, steps = saved["window_loss"], saved["window_steps"]
            if len(sums) == world_size and saved["loss_ranks"] == loss_ranks:
                window.restore(sums[rank], steps)
            else:
                window.restore(sum(sums) * loss_ranks / (saved["loss_ranks"] * world_size), steps)
        return window


def global_mean(loss: torch.Tensor, loss_ranks: int) -> torch.Tensor:
    """Mean of a per-rank loss over the ``loss_ranks`` ranks that hold one (non-final pipeline stages contribute 0)."""
    if not dist.is_initialized():
        return loss
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / loss_ranks


class RunMeter:
    """This invocation's speed and resource figures, for the log records and summary.json: tokens/s of all ranks and
    per device, MFU, peak memory, energy since training started, and the ETA from this invocation's pace.
    ``energy``: the power reader of this rank's device (None on the CPU: the energy figures are null)."""

    def __init__(
        self,
        device: torch.device,
        world_size: int,
        flops_per_token: float,
        peak_flops: float | None,
        energy: EnergyMeter | None,
    ) -> None:
        self.device, self.world_size = device, world_size
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.energy = energy
        self.throughput = ThroughputMeter()
        self.rates: list[float] = []  # tokens/s of each window since ``start`` (summary.json: window_tokens_per_s)
        self._energy_start = self._pace_start = (time.perf_counter(), 0)

    def start(self, step: int, tokens_seen: int) -> None:
        """Training starts at ``step``, ``tokens_seen`` tokens in: throughput, peak memory, energy and pace count from
        here."""
        self.throughput = ThroughputMeter()
        hardware.reset_peak_memory(self.device)
        self.rates = []
        self._energy_start = (time.perf_counter(), tokens_seen)
        if self.energy is not None:
            self.energy.start()
        self._pace_start = (time.perf_counter(), step)

    def lap(self, step: int, total_steps: int) -> dict:
        """A log step's figures for the window since the previous lap (synchronises the device first)."""
        hardware.synchronize(self.device)
        tokens_per_s, seconds = self.throughput.lap()
        self.rates.append(tokens_per_s)
        per_device = tokens_per_s / self.world_size
        started, start_step = self._pace_start
        pace = (time.perf_counter() - started) / max(step - start_step, 1)  # seconds per step in this invocation
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "mfu": mfu(self.flops_per_token, per_device, self.peak_flops),
            "peak_mem_gib": self.peak_memory_gib(),
            "window_s": seconds,
            "eta_s": (total_steps - step) * pace,
        }

    def end_lap(self) -> None:
        """The invocation's last steps after the last log step: their rate counts in the summary's throughput."""
        hardware.synchronize(self.device)
        self.rates.append(self.throughput.lap()[0])

    def peak_memory_gib(self) -> float:
        """GPU: the allocator's peak since ``start``; CPU: this process's peak resident set size (its tensors live
        there; the console calls it rss)."""
        return hardware.peak_memory_gib(self.device) if hardware.is_gpu(self.device) else process_peak_rss_gib()

    def energy_figures(self, tokens_seen: int) -> dict:
        """avg_watts, joules, tokens_per_joule, tflops_per_watt since ``start``; rank 0 scales them to the job."""
        reading = self.energy.read() if self.energy is not None else {"joules": None}
        started, tokens_at_start = self._energy_start
        tokens = tokens_seen - tokens_at_start
        return energy_metrics(
            reading["joules"],
            time.perf_counter() - started,
            tokens,
            tokens * self.flops_per_token,
            devices=self.world_size,
        )

    def summary(self, tokens_seen: int) -> dict:
        """summary.json's throughput, MFU, memory and energy entries (the first window holds warm-up and
        compilation: the mean leaves it out where there are others)."""
        steady = self.rates[1:] or self.rates
        tokens_per_s = sum(steady) / len(steady) if steady else 0.0
        per_device = tokens_per_s / self.world_size
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "window_tokens_per_s": self.rates,
            "mfu": mfu(self.flops_per_token, per_device, self.peak_flops),
            "peak_mem_gib": self.peak_memory_gib(),
            "peak_reserved_gib": hardware.peak_memory_gib(self.device, reserved=True),
            "energy": self.energy_figures(tokens_seen),
        }

    def close(self) -> None:
        if self.energy is not None:
            self.energy.stop()


def process_peak_rss_gib() -> float:
    """This process's peak resident set size in GiB (``getrusage`` ``ru_maxrss``: KiB on Linux, bytes on macOS): the
    memory figure of a CPU run, whose tensors live in it."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (``M:SS`` under an hour); ``n/a`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _num(value, spec: str) -> str:
    """``value`` formatted with ``spec``; a non-finite value (kept as the string 'nan' / 'inf' in the records) or
    None prints as it is."""
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec)
    return str(value)


class MetricsLogger:
    memory_label = "mem"  # the console's name of peak_mem_gib: "rss" where it is the process's peak resident set

    def __init__(
        self,
        run_dir: Path | None,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        run_config: RunConfig | None = None,
    ) -> None:
        """``enabled``: this rank prints and records (rank 0). ``run_dir`` None: console only, no files.
        ``run_config``: its ``metrics.wandb`` adds the W&B sink (train/wandb_sink.py)."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.console = Console(stderr=True, soft_wrap=True)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._progress = None
        if not enabled or run_dir is None:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError:
                self.console.print(
                    "[yellow]tensorboard not installed: metrics go to metrics.jsonl only "
                    "(pip install 'anytrain[tb]')[/]"
                )
        if run_config is not None and run_config.metrics.wandb.mode != "disabled":
            self._wandb = WandbSink(run_config, run_dir, self.print)
        if sys.stderr.isatty():
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self._progress.start()

    def print(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)

    def log(self, record: dict, kind: str = "train") -> None:
        """Write one record (must hold 'step') to every sink."""
        if not self.enabled:
            return
        record = {k: _clean(v) for k, v in record.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"kind": kind, **record}) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, record["step"])
        if self._wandb is not None:
            self._wandb.log(record, kind)
        self.console.print(self._format(record, kind), highlight=False)

    def _format(self, r: dict, kind: str) -> str:
        if kind == "eval":
            return f"step {r['step']:>6} | val_loss {_num(r['val_loss'], '.4f')} | val_ppl {_num(r['val_ppl'], '.2f')}"
        if kind != "train":
            return f"step {r['step']:>6} | {kind}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "step")
        mfu = r.get("mfu")
        mfu_text = _num(100 * mfu, ".1f") + "%" if isinstance(mfu, (int, float)) else _num(mfu, "")
        tok_s = _num(r.get("tokens_per_s"), ",.0f")
        width = len(str(self.total_steps))
        text = (
            f"step {r['step']:>{width}}/{self.total_steps} | loss {_num(r.get('loss'), '.4f')} | lr "
            f"{_num(r.get('lr'), '.2e')} | gnorm {_num(r.get('grad_norm'), '.3f')} | {tok_s} tok/s | mfu "
            f"{mfu_text} | {self.memory_label} {_num(r.get('peak_mem_gib'), '.2f')} GiB | eta "
            f"{format_duration(r.get('eta_s'))}"
        )
        if self._progress is not None:
            stats = f"loss {_num(r.get('loss'), '.3f')} {tok_s} tok/s mfu {mfu_text}"
            self._progress.update(self._task, completed=r["step"], stats=stats)
        return text

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
