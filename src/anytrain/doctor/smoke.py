"""The doctor's training checks: the data partition, tiny trainings on one device and on all ranks, and a checkpoint
that survives SIGKILL.

All of them train the ``debug`` Transformer on byte-level windows of the embedded corpus (``corpus_source``: token =
byte, so no tokenizer and no prepared dataset) with ``SEQ_LEN``-token sequences, ``MICRO_BATCH`` sequences per rank and
micro-batch and a global batch of ``MICRO_BATCH × world``, through the real ``Trainer``:

- **all ranks**: every rank trains in this process (DDP over the doctor's process group) for ``SMOKE_STEPS`` steps,
  recording its loss per step, the sample ids the loader gave it, and a fingerprint of its parameters (replicas must
  be bitwise identical);
- **one device**: every rank starts a child process (``python -m anytrain.doctor.child``) that sees only this rank's
  device and trains the same global batches alone (gradient accumulation over ``world`` micro-batches), logging its
  losses; the all-rank run's mean loss per step must agree with it;
- **kill-restart** (rank 0): a second child checkpoints at step ``KILL_STEP`` and waits before its next batch; once the
  checkpoint's COMMITTED marker exists the doctor SIGKILLs it and a third child resumes the run directory to the end:
  its losses must reproduce the uninterrupted one-device run's.

Test hook: ``ANYTRAIN_TEST_OVERLAP_RANK=<rank>`` makes that rank report the sample ids of the next rank's slice in the
data-partition check (a planted overlap; nothing else reads it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

SMOKE_STEPS = 20
KILL_STEP = 10
SEQ_LEN = 32
MICRO_BATCH = 2
OVERLAP_RANK_VAR = "ANYTRAIN_TEST_OVERLAP_RANK"
# what anytrain.parallel.env reads to find a launcher: a child without them is one process
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
)
LAUNCH_PREFIXES = ("TORCHELASTIC_", "OMPI_COMM_WORLD_")


def corpus_source(global_batch: int, seq_len: int = SEQ_LEN, seed: int = 0):
    """The loader (``BatchSource``) over the bytes of the embedded corpus's first play, one token per byte."""
    from anytrain.data.loader import BatchSource, SampleIndex
    from anytrain.data.prepare import embedded_corpus_dir
    from anytrain.data.shards import Split

    text = sorted(embedded_corpus_dir().glob("*_gut.txt"))[0]
    tokens = np.frombuffer(text.read_bytes(), dtype=np.uint8)
    return BatchSource(SampleIndex(Split([tokens]), seq_len, "doctor"), global_batch, seed)


def smoke_config(world: int, device: str = "auto", steps: int = SMOKE_STEPS, checkpoint_interval: int = 0):
    """The run both the one-device and the all-rank trainings use (only the world size differs)."""
    from anytrain.config import RunConfig, from_dict, validate

    cfg = from_dict(
        RunConfig,
        {
            "name": "doctor-smoke",
            "device": device,
            "model": {"arch": "transformer", "flavour": "debug"},
            "data": {"seq_len": SEQ_LEN},
            "parallel": {"strategy": "ddp"},
            "train": {
                "steps": steps,
                "global_batch": MICRO_BATCH * world,
                "micro_batch": MICRO_BATCH,
                "lr": 3e-3,
                "warmup_steps": 2,
                "log_interval": 1,
                "eval_batches": 0,
                "lagged_checks": False,
                "seed": 0,
            },
            "checkpoint": {"interval": checkpoint_interval, "save_final": False, "keep_last": 2},
        },
    )
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------------------------------
# data partition


def partition_steps(source) -> list[int]:
    """Steps whose partition the doctor checks: the first two and the one that wraps into the second epoch."""
    return sorted({0, 1, source.index.num_samples // source.global_batch})


def rank_partition(source, steps: list[int], rank: int, world: int) -> dict[int, list[int]]:
    """This rank's sample ids of each step, as the loader gives them (the planted fault takes the next rank's)."""
    dp_rank = (rank + 1) % world if os.environ.get(OVERLAP_RANK_VAR, "") == str(rank) else rank
    return {step: source.rank_sample_ids(step, dp_rank, world).tolist() for step in steps}


def partition_failures(
    per_rank: list[dict[int, list[int]]],
    global_ids: dict[int, list[int]],
    hosts: list[dict],
    check: str = "data partition",
) -> list[str]:
    """Every step's rank slices against rank 0's global batch, counted as multisets (a batch that wraps into the next
    epoch may hold an id twice): ids that no rank holds, ids a rank holds beyond the global batch's count (taken by a
    lower rank already), ids that are not in the global batch at all."""
    failures = []
    for step, expected in global_ids.items():
        counts, seen = Counter(expected), Counter()
        for rank, steps in enumerate(per_rank):
            where = f"rank {rank} ({hosts[rank]['host']}): {check}: step {step}"
            ids = steps[step]
            foreign = sum(1 for i in ids if i not in counts)
            taken = 0
            for i in ids:
                if i in counts:
                    seen[i] += 1
                    taken += seen[i] > counts[i]
            if taken:
                failures.append(f"{where}: {taken} of its {len(ids)} sample ids are already on a lower rank")
            if foreign:
                failures.append(f"{where}: {foreign} of its {len(ids)} sample ids are not in the global batch")
        missing = sum((counts - seen).values())
        if missing:
            failures.append(
                f"rank 0 ({hosts[0]['host']}): {check}: step {step}: {missing} of the {len(expected)} "
                "global-batch sample ids are on no rank"
            )
    return failures


def data_partition(world: int, rank: int) -> dict:
    """This rank's part of the quick check: its slices of a few steps of a ``MICRO_BATCH × world`` global batch."""
    source = corpus_source(MICRO_BATCH * world)
    steps = partition_steps(source)
    return {
        "ids": rank_partition(source, steps, rank, world),
        "global": {s: source.global_sample_ids(s).tolist() for s in steps} if rank == 0 else None,
    }


# ----------------------------------------------------------------------------------------------------------------------
# the all-rank training, in the doctor's processes


class RecordingSource:
    """A batch provider that passes another one through and keeps the sample ids it handed out, per step."""

    def __init__(self, source) -> None:
        self.source, self.ids = source, {}

    def rank_batch(self, step: int, dp_rank: int, dp_world: int):
        inputs, targets, ids = self.source.rank_batch(step, dp_rank, dp_world)
        self.ids[step] = ids.tolist()
        return inputs, targets, ids


def fingerprint(model: torch.nn.Module) -> list[float]:
    """Sum and sum of squares of every parameter, in float64 (identical replicas give identical numbers)."""
    params = [p.detach().double() for p in model.parameters()]
    return [float(sum(p.sum() for p in params)), float(sum((p * p).sum() for p in params))]


def train_all_ranks(world: int, device: torch.device, steps: int = SMOKE_STEPS) -> dict:
    """This rank's share of the all-rank run: its loss per step, the ids it trained on, its parameters' fingerprint."""
    from anytrain.train.trainer import Trainer

    cfg = smoke_config(world, "cpu" if device.type == "cpu" else "auto", steps)
    source = RecordingSource(corpus_source(cfg.train.global_batch))
    trainer = Trainer(cfg, batches=source)
    losses: list[float] = []
    try:
        for step in range(steps):
            loss, _, status = trainer.train_step(step)
            losses.append(float(loss))
            if status.nonfinite:
                break
        return {"losses": losses, "ids": source.ids, "fingerprint": fingerprint(trainer.model)}
    finally:
        trainer.close()


# ----------------------------------------------------------------------------------------------------------------------
# one-device runs and the kill-restart, in child processes


def child_env(device: torch.device) -> dict[str, str]:
    """This environment without the launcher's variables (the child is one process), seeing only ``device``."""
    from anytrain import hardware

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(LAUNCH_PREFIXES)}
    env.update(hardware.single_device_env(device))
    src = str(Path(__file__).resolve().parents[2])  # the anytrain this process runs, also when not installed
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Child:
    """One ``python -m anytrain.doctor.child`` process; its output goes to ``<run-dir>.log``."""

    def __init__(self, device: torch.device, world: int, run_dir: Path, *args: str) -> None:
        self.run_dir, self.out = run_dir, run_dir.with_suffix(".json")
        self.log = run_dir.with_suffix(".log")
        command = [
            sys.executable,
            "-m",
            "anytrain.doctor.child",
            "--world",
            str(world),
            "--run-dir",
            str(run_dir),
            "--out",
            str(self.out),
            "--device",
            "cpu" if device.type == "cpu" else "auto",
            *args,
        ]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                command, env=child_env(device), stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
            )

    def last_line(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else "(no output)"

    def finish(self, timeout: float) -> tuple[dict | None, str | None]:
        """(losses by step, None), or (None, why not)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None, f"no result within {timeout:.0f} s (log {self.log})"
        if self.proc.stdin:
            self.proc.stdin.close()
        if code != 0 or not self.out.is_file():
            return None, f"child exited {code}: {self.last_line()} (log {self.log})"
        return {int(k): v for k, v in json.loads(self.out.read_text())["losses"].items()}, None


def _kill_restart(device: torch.device, world: int, work: Path, timeout: float) -> dict:
    """Checkpoint at KILL_STEP, SIGKILL once it is committed, resume to the end: {"losses"} or {"error"}."""
    from anytrain.checkpoint.dcp import COMMIT_MARKER, PREFIX

    run_dir = work / "killed"
    interval = ["--checkpoint-interval", str(KILL_STEP)]
    child = Child(device, world, run_dir, *interval, "--pause-at-step", str(KILL_STEP))
    marker = run_dir / "checkpoints" / f"{PREFIX}{KILL_STEP:08d}" / COMMIT_MARKER
    deadline = time.monotonic() + timeout
    while not marker.is_file() and child.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    committed = marker.is_file()
    if child.proc.poll() is None:
        child.proc.send_signal(signal.SIGKILL)
    code = child.proc.wait()
    if not committed:
        why = f"child exited {code}: {child.last_line()}" if code != -signal.SIGKILL else f"not within {timeout:.0f} s"
        return {"error": f"no committed checkpoint of step {KILL_STEP} ({why}; log {child.log})"}
    losses, error = Child(device, world, run_dir, *interval, "--resume").finish(timeout)
    return {"killed_at_step": KILL_STEP, "exit_code": code, "losses": losses, "error": error and f"resume: {error}"}


def one_device_runs(device: torch.device, world: int, work: Path, kill_restart: bool, timeout: float = 600) -> dict:
    """This rank's one-device run (and on the rank with ``kill_restart``, the kill-restart) in ``work``, which is
    removed afterwards unless something failed."""
    work.mkdir(parents=True, exist_ok=True)
    alone = Child(device, world, work / "alone")
    result: dict = {
        "work_dir": str(work),
        "kill_restart": _kill_restart(device, world, work, timeout) if kill_restart else None,
    }
    result["losses"], result["error"] = alone.finish(timeout)
    if result["error"] is None and not (result["kill_restart"] or {}).get("error"):
        shutil.rmtree(work, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------------------------------------------------
# checks on the gathered results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def loss_mismatch(got: list[float], reference: list[float], rtol: float) -> str | None:
    """The worst step where ``got`` differs from ``reference`` by more than ``rtol`` (relative), or None."""
    if len(got) != len(reference):
        return f"{len(got)} losses, expected {len(reference)}"
    worst = max(range(len(got)), key=lambda i: _rel(got[i], reference[i]), default=None)
    if worst is None or _rel(got[worst], reference[worst]) <= rtol:
        return None
    return (
        f"step {worst + 1} loss {got[worst]:.6g} vs {reference[worst]:.6g}: relative difference "
        f"{_rel(got[worst], reference[worst]):.2e} > {rtol:g}"
    )


def curve_problem(losses: list[float], min_drop: float) -> str | None:
    """A non-finite loss, or a fall over the run smaller than ``min_drop`` of the first loss."""
    bad = next((i for i, x in enumerate(losses) if not np.isfinite(x)), None)
    if bad is not None:
        return f"non-finite loss at step {bad + 1}"
    drop = (losses[0] - losses[-1]) / losses[0] if losses else 0.0
    if drop < min_drop:
        return (
            f"loss fell {100 * drop:.1f}% in {len(losses)} steps ({losses[0]:.4g} -> {losses[-1]:.4g}), expected "
            f">= {100 * min_drop:g}% (min_loss_drop)"
        )
    return None


def as_list(losses: dict[int, float], steps: int) -> list[float]:
    return [losses.get(step, float("nan")) for step in range(1, steps + 1)]
