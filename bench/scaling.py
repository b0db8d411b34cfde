"""Multi-GPU scaling study: anytrain's layouts (FSDP, HSDP, DDP, TP, PP) against HF + DDP, on 1..N GPUs of one host.

Every anytrain row is the real product: ``torchrun --standalone -m anytrain train <recipe>`` with overrides, one
process per GPU, steady-state tokens/s from the trainer's own summary (log windows after the first, which holds
compilation). The HF rows run this file as a torchrun worker (``--hf-worker``): transformers' LlamaForCausalLM of the
same shape, fp32 master weights, bf16 autocast, SDPA, fused AdamW, DistributedDataParallel with ``no_sync`` during
gradient accumulation (the anchors' "HF + DDP" setup).

Definitions (per GPU = one process):
- weak scaling: fixed micro-batch and accumulation per GPU (global batch grows with N); efficiency = per-GPU tokens/s
  at N / tokens/s at 1 GPU with the same per-GPU batch;
- strong scaling: fixed global batch (the recipe's 32 sequences); efficiency = T(1) / (N * T(N)) = per-GPU tokens/s at
  N / tokens/s at 1 GPU with the whole global batch.
Baselines and HF references are rows of the same model shape (model, recipe, sequence length, micro-batch:
``shape_key``); vs HF + DDP is per-GPU tokens/s against the HF row on as many GPUs (the 1.1B Transformer only).
Cost model: each transformer row gets the planner's predicted step time and memory (anytrain.cost.estimate) with the
catalogue efficiency and with the efficiency fitted on the 1-GPU strong-scaling row (calibration), and the error.

Rows whose GPU sets are disjoint run at the same time (``--concurrent``, the default when more than one GPU is free):
each job owns its GPUs (CUDA_VISIBLE_DEVICES); the host's NVLink switch gives each pair its own links. Use
``--serial`` to run one job at a time.

``--merge`` joins results files of several runs (oldest first): a later file's row replaces an earlier row of the
same case, except that a failed or skipped row never replaces a measured one and that measured rows of one case from
files of the same host (one machine lease, calls one after another) are repeats, merged into their median (each
file's row counts as one run); every row keeps its source file and machine, and the efficiencies and predictions are
recomputed on the merged set (``--note`` adds free-text notes).

    PYTHONPATH=src python bench/scaling.py --gpus 1 2 4 --out bench/results           # the study (GPU host)
    PYTHONPATH=src python bench/scaling.py --only t-fsdp-2-g32 t-1-g32 --serial       # a subset
    python bench/scaling.py --merge bench/results/scaling_nvidia-h200_2gpu_*.json \\
        bench/results/scaling_nvidia-h200_4gpu.json                                  # several runs -> one file
    python bench/scaling.py --plot bench/results/scaling_nvidia-h200.json --png docs/scaling.png
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RECIPES = {"transformer": "configs/1.1b.yaml", "mamba": "configs/mamba-1.4b.yaml"}
LEGACY_DDP_BUCKET_MB = 25.0
"""DDP's bucket size of rows recorded before the rows carried ``ddp_bucket_mb`` (PyTorch's default, used until then)."""
MODEL_NAMES = {"transformer": "llama-1.1b", "mamba": "mamba-1.4b"}


@dataclass
class Case:
    name: str
    model: str  # "transformer" | "mamba"
    gpus: int
    layout: str  # "single" | "fsdp" | "zero2" | "zero1" | "hsdp" | "ddp" | "tp" | "pp" | "hf-ddp"
    global_batch: int
    micro: int = 4
    seq: int = 2048
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    studies: tuple[str, ...] = ()  # "weak", "strong", "layout"
    extra: list[str] = field(default_factory=list)
    recipe: str = ""  # default: RECIPES[model]

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def accum(self) -> int:
        return self.global_batch // (self.dp * self.micro)


def default_cases(max_gpus: int) -> list[Case]:
    """Priority order (a time budget drops the tail): the 1- and 2-GPU study of issue #6 for both models, the
    cost-model validation's small runs, then 4 GPUs (issue #8)."""
    t, m = "transformer", "mamba"
    gathered = ["--parallel.reshard_during_accumulation", "false"]
    group2, group4 = (["--parallel.fsdp_group_blocks", str(k)] for k in (2, 4))
    profiled = ["--profile.start_step", "4", "--profile.steps", "1"]
    async_tp = ["--parallel.async_tp", "true"]
    interleaved = ["--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_virtual_stages", "2"]
    graphs = ["--train.cuda_graphs", "true"]
    cases = [
        Case("t-1-g32", t, 1, "single", 32, studies=("strong",)),
        Case("t-1-g8", t, 1, "single", 8, studies=("weak",)),
        Case("v-tiny-1", t, 1, "single", 16, micro=16, seq=256, recipe="configs/tiny.yaml", studies=("cost",)),
        Case("v-125m-1", t, 1, "single", 64, micro=16, seq=1024, recipe="configs/125m.yaml", studies=("cost",)),
        Case("t-fsdp-2-g32", t, 2, "fsdp", 32, studies=("strong", "layout")),
        Case("t-fsdp-2-g16", t, 2, "fsdp", 16, studies=("weak",)),
        # FSDP keeping the gathered parameters through the accumulation micro-batches; ZeRO-2's weak scaling; one
        # profiled FSDP step per rank (studies=(): the profiled step's overhead must not enter an efficiency)
        Case("t-fsdpg-2-g32", t, 2, "fsdp", 32, studies=("strong",), extra=gathered),
        Case("t-fsdpg-2-g16", t, 2, "fsdp", 16, studies=("weak",), extra=gathered),
        Case("t-zero2-2-g16", t, 2, "zero2", 16, studies=("weak",)),
        Case("p-fsdp-2-g16", t, 2, "fsdp", 16, extra=profiled),
        Case("p-1-g8", t, 1, "single", 8, extra=profiled),
        Case("hf-ddp-1-g8", t, 1, "hf-ddp", 8, studies=("weak",)),
        Case("hf-ddp-2-g16", t, 2, "hf-ddp", 16, studies=("weak",)),
        Case("t-ddp-2-g32", t, 2, "ddp", 32, studies=("strong", "layout")),
        Case("t-tp2-2-g32", t, 2, "tp", 32, tp=2, studies=("layout",)),
        Case("t-pp2-2-g32", t, 2, "pp", 32, pp=2, studies=("layout",)),
        Case("m-1-g32", m, 1, "single", 32, studies=("strong",)),
        Case("m-1-g8", m, 1, "single", 8, studies=("weak",)),
        Case("m-fsdp-2-g32", m, 2, "fsdp", 32, studies=("strong", "layout")),
        Case("m-fsdp-2-g16", m, 2, "fsdp", 16, studies=("weak",)),
        Case("m-fsdpg-2-g32", m, 2, "fsdp", 32, studies=("strong",), extra=gathered),
        Case("m-fsdpg-2-g16", m, 2, "fsdp", 16, studies=("weak",), extra=gathered),
        # gathered FSDP with 4 Mamba blocks (2 Transformer blocks) per FSDP unit: fewer, larger collectives and fewer
        # per-unit hooks (parallel.fsdp_group_blocks)
        Case("m-fsdpgg-2-g32", m, 2, "fsdp", 32, studies=("strong",), extra=gathered + group4),
        Case("m-fsdpgg-2-g16", m, 2, "fsdp", 16, studies=("weak",), extra=gathered + group4),
        Case("t-fsdpgg-2-g16", t, 2, "fsdp", 16, studies=("weak",), extra=gathered + group2),
        # one profiled step per rank of Mamba's weak-scaling pair (gathered FSDP on 2 GPUs, the 1-GPU reference)
        Case("pm-fsdpg-2-g16", m, 2, "fsdp", 16, extra=gathered + profiled),
        Case("pm-1-g8", m, 1, "single", 8, extra=profiled),
        Case("m-ddp-2-g32", m, 2, "ddp", 32, studies=("layout",)),
        Case("m-pp2-2-g32", m, 2, "pp", 32, pp=2, studies=("layout",), extra=["--model.args.tie_embeddings", "false"]),
        Case("t-zero2-2-g32", t, 2, "zero2", 32, studies=("layout",)),
        Case("t-zero1-2-g32", t, 2, "zero1", 32, studies=("layout",)),
        # 4 GPUs (issue #8), the recommended layouts first: gathered FSDP for both models, then the plain layouts
        Case("t-fsdpg-4-g32", t, 4, "fsdp", 32, studies=("strong", "weak"), extra=gathered),
        Case("m-fsdpg-4-g32", m, 4, "fsdp", 32, studies=("strong", "weak"), extra=gathered),
        Case("t-fsdp-4-g32", t, 4, "fsdp", 32, studies=("strong", "weak", "layout")),
        Case("t-zero2-4-g32", t, 4, "zero2", 32, studies=("strong", "layout")),
        Case("hf-ddp-4-g32", t, 4, "hf-ddp", 32, studies=("weak",)),
        Case("t-hsdp2x2-4-g32", t, 4, "hsdp", 32, dp_replicate=2, studies=("layout",)),
        Case("t-tp4-4-g32", t, 4, "tp", 32, tp=4, studies=("layout",)),
        Case("t-pp4-4-g32", t, 4, "pp", 32, pp=4, studies=("layout",)),
        Case("m-fsdp-4-g32", m, 4, "fsdp", 32, studies=("strong", "weak", "layout")),
        Case("t-tp2-fsdp2-4-g32", t, 4, "tp", 32, tp=2, studies=("layout",)),
        Case("t-zero1-4-g32", t, 4, "zero1", 32, studies=("strong", "layout")),
        Case("t-ddp-4-g32", t, 4, "ddp", 32, studies=("strong", "layout")),
        Case("m-ddp-4-g32", m, 4, "ddp", 32, studies=("strong", "layout")),
        Case("m-pp4-4-g32", m, 4, "pp", 32, pp=4, studies=("layout",), extra=["--model.args.tie_embeddings", "false"]),
        # tensor parallelism with a micro-batch of 16 (TP divides the activations, so the larger micro-batch fits:
        # 4x fewer, 4x larger collectives and host launches per token), and with async TP on top; the interleaved
        # pipeline schedule; the 2D layouts
        Case("t-tp4mb16-4-g32", t, 4, "tp", 32, micro=16, tp=4, studies=("layout",)),
        Case("t-tp4async-4-g32", t, 4, "tp", 32, micro=16, tp=4, studies=("layout",), extra=async_tp),
        Case("t-tp2mb16-2-g32", t, 2, "tp", 32, micro=16, tp=2, studies=("layout",)),
        Case("t-tp2async-2-g32", t, 2, "tp", 32, micro=16, tp=2, studies=("layout",), extra=async_tp),
        # TP's host work replayed from CUDA graphs (tensor parallelism alone is captured, collectives included)
        Case("t-tp4graphs-4-g32", t, 4, "tp", 32, micro=16, tp=4, studies=("layout",), extra=graphs),
        Case("t-tp4mb4graphs-4-g32", t, 4, "tp", 32, tp=4, studies=("layout",), extra=graphs),
        Case("t-tp2graphs-2-g32", t, 2, "tp", 32, micro=16, tp=2, studies=("layout",), extra=graphs),
        Case("t-pp4i-4-g32", t, 4, "pp", 32, pp=4, studies=("layout",), extra=interleaved),
        Case("t-pp2-fsdp2-4-g32", t, 4, "pp", 32, pp=2, studies=("layout",)),
        Case("t-tp2-pp2-4-g32", t, 4, "pp", 32, tp=2, pp=2, studies=("layout",)),
        Case("t-tp2async-fsdp2-4-g32", t, 4, "tp", 32, micro=16, tp=2, studies=("layout",), extra=async_tp),
        # 8 GPUs (issue #8; needs an 8-GPU host): the goal row (FSDP strong at the recipe's global batch of 32, one
        # micro-batch per GPU), the weak rows at 8 sequences per GPU (global 64, vs t-1-g8 / m-1-g8 / hf-ddp-1-g8),
        # the plain layouts and HSDP 2x4
        Case("t-fsdp-8-g32", t, 8, "fsdp", 32, studies=("strong", "layout")),
        Case("t-fsdpg-8-g64", t, 8, "fsdp", 64, studies=("weak",), extra=gathered),
        Case("hf-ddp-8-g64", t, 8, "hf-ddp", 64, studies=("weak",)),
        Case("t-ddp-8-g32", t, 8, "ddp", 32, studies=("strong", "layout")),
        Case("t-zero1-8-g32", t, 8, "zero1", 32, studies=("strong", "layout")),
        Case("t-hsdp2x4-8-g32", t, 8, "hsdp", 32, dp_replicate=2, studies=("strong", "layout")),
        Case("m-ddp-8-g32", m, 8, "ddp", 32, studies=("strong", "layout")),
        Case("m-fsdpg-8-g64", m, 8, "fsdp", 64, studies=("weak",), extra=gathered),
        Case("m-fsdp-8-g32", m, 8, "fsdp", 32, studies=("strong", "layout")),
    ]
    return [c for c in cases if c.gpus <= max_gpus]


# ---------------------------------------------------------------------------------------------------------------------
# Launching


def layout_overrides(layout: str, tp: int, pp: int, dp_replicate: int) -> list[str]:
    """The trainer options that make a row's layout (``Case.layout`` and its degrees)."""
    strategy = {"single": "auto", "fsdp": "fsdp", "hsdp": "fsdp", "ddp": "ddp", "tp": "fsdp", "pp": "fsdp",
                "zero2": "fsdp", "zero1": "zero1"}[layout]  # fmt: skip
    args = ["--parallel.strategy", strategy, "--parallel.tp", str(tp), "--parallel.pp", str(pp),
            "--parallel.dp_replicate", str(dp_replicate)]  # fmt: skip
    if layout == "zero2":  # FSDP keeping the gathered parameters from forward to backward
        args += ["--parallel.reshard_after_forward", "false"]
    return args


def anytrain_command(case: Case, run_dir: Path, data: str, steps: int, log_interval: int,
                     extra: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    overrides = {
        "data.path": data, "data.seq_len": case.seq, "train.global_batch": case.global_batch,
        "train.micro_batch": case.micro, "train.steps": steps, "train.log_interval": log_interval,
        "train.eval_interval": 0, "train.eval_batches": 0, "checkpoint.interval": 0, "checkpoint.save_final": "false",
    }  # fmt: skip
    args = [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    args += layout_overrides(case.layout, case.tp, case.pp, case.dp_replicate)
    recipe = case.recipe or RECIPES[case.model]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.gpus}",
            "-m", "anytrain", "train", recipe, "--run-dir", str(run_dir), *args, *case.extra, *extra]  # fmt: skip


def hf_command(case: Case, out_json: Path, steps: int, warmup: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.gpus}",
            str(Path(__file__).resolve()), "--hf-worker", "--global-batch", str(case.global_batch),
            "--micro", str(case.micro), "--seq", str(case.seq), "--steps", str(steps), "--warmup", str(warmup),
            "--worker-out", str(out_json)]  # fmt: skip


@dataclass
class Job:
    case: Case
    gpus: list[int]
    proc: subprocess.Popen
    started: float
    work: Path
    log: Path


def start_job(case: Case, gpus: list[int], work: Path, args: argparse.Namespace) -> Job:
    job_dir = work / case.name
    job_dir.mkdir(parents=True, exist_ok=True)
    if case.layout == "hf-ddp":
        cmd = hf_command(case, job_dir / "hf.json", args.steps - args.log_interval, args.log_interval)
    else:
        cmd = anytrain_command(case, job_dir / "run", args.data, args.steps, args.log_interval,
                               tuple(args.train_args.split()))  # fmt: skip
    from anytrain import hardware

    # the job's GPUs as this process numbers them, inside any visible-devices list it was started with
    env = dict(os.environ, **hardware.devices_env(gpus), PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    log = job_dir / "log.txt"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return Job(case, gpus, proc, time.perf_counter(), job_dir, log)


def run_setting(run_dir: Path, section: str, name: str):
    """One field of the config a run recorded in its directory (config.yaml), None if absent."""
    import yaml

    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}).get(section, {}).get(name) if path.exists() else None


def collect(job: Job, timed_out: bool) -> dict:
    case = job.case
    row = {**asdict(case), "dp": case.dp, "accum": case.accum, "gpu_ids": job.gpus,
           "wall_s": round(time.perf_counter() - job.started, 1)}  # fmt: skip
    text = job.log.read_text(errors="replace") if job.log.exists() else ""
    causes = [ln for ln in text.splitlines() if re.match(r"^(error: |\w*(Error|Exception): )", ln)
              and "ChildFailedError" not in ln]  # fmt: skip
    tail = " | ".join(causes[:3]) if causes else text[-1500:]
    if timed_out:
        row["error"] = f"timed out after {row['wall_s']} s; log tail: {tail[-600:]}"
        return row
    if job.proc.returncode != 0:
        row["error"] = f"exit {job.proc.returncode}: {tail[-900:]}"
        return row
    if case.layout == "hf-ddp":
        row.update(json.loads((job.work / "hf.json").read_text()))
        return row
    summary = json.loads((job.work / "run" / "summary.json").read_text())
    row.update({
        "tokens_per_s": summary["tokens_per_s"],
        "tokens_per_s_per_gpu": summary["tokens_per_s_per_device"],
        "mfu": summary["mfu"],
        "peak_mem_gib": summary["peak_mem_gib"],
        # every log window's rate (the first holds compilation): shows whether a slow row was slow throughout or hit
        # by one stall
        "window_tokens_per_s": summary.get("window_tokens_per_s"),
        "params": summary["params"],
        "flops_per_token": summary["flops_per_token"],
        "strategy": summary["strategy"],
        "device": summary["hardware"].get("device"),
        "ddp_bucket_mb": run_setting(job.work / "run", "parallel", "ddp_bucket_mb"),
    })  # fmt: skip
    profiles = sorted((job.work / "run" / "profile").glob("rank*.json"))  # cases run with --profile.steps
    if profiles:
        row["profile"] = [json.loads(p.read_text()) for p in profiles]
    return row


REPEAT_MARK = "#"  # a repeated case runs as "<name>#2", "<name>#3", ...; aggregate_repeats folds them back


def with_repeats(cases: list[Case], repeats: int) -> list[Case]:
    """Every case ``repeats`` times, round-robin (all cases once, then all again: drift of the host touches every
    case alike); repeat k > 1 is named ``<name>#k``."""
    from dataclasses import replace

    return [c if k == 1 else replace(c, name=f"{c.name}{REPEAT_MARK}{k}") for k in range(1, repeats + 1) for c in cases]


def aggregate_repeats(rows: list[dict]) -> list[dict]:
    """One row per case: the run with the median tokens/s per GPU (the lower middle one for an even count), with every
    run's rate in ``repeat_tokens_per_s_per_gpu``; a case none of whose runs measured keeps its first run's error."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["name"].split(REPEAT_MARK)[0], []).append(r)
    out = []
    for name, runs in groups.items():
        measured = [r for r in runs if "tokens_per_s_per_gpu" in r]
        if not measured:
            out.append({**runs[0], "name": name})
            continue
        rates = [r["tokens_per_s_per_gpu"] for r in measured]
        middle = statistics.median_low(rates)
        row = next(r for r in measured if r["tokens_per_s_per_gpu"] == middle)
        out.append(
            {**row, "name": name, "repeat_tokens_per_s_per_gpu": rates, "repeats_failed": len(runs) - len(rates)}
        )
    return out


def tag_suffix(tag: str) -> str:
    """``--tag 4gpu`` -> ``_4gpu`` (a tag that already starts with ``_`` or ``-`` is kept as given)."""
    return tag if not tag or tag[0] in "_-" else f"_{tag}"


def run_cases(cases: list[Case], args: argparse.Namespace, n_gpus: int, partial: Path | None = None) -> list[dict]:
    """Greedy packing of jobs onto free GPUs (disjoint sets), in priority order; one job at a time with --serial.
    With ``partial``, the rows measured so far are rewritten there after every job (a killed run keeps them)."""
    rows: dict[str, dict] = {}
    pending, running, free = list(cases), [], list(range(n_gpus))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        while pending or running:
            for case in list(pending):
                if args.budget_s and time.perf_counter() - started > args.budget_s:
                    rows[case.name] = {**asdict(case), "error": "skipped: time budget"}
                    pending.remove(case)
                    continue
                if case.gpus <= len(free) and not (args.serial and running):
                    gpus, free = free[: case.gpus], free[case.gpus :]
                    running.append(start_job(case, gpus, Path(tmp), args))
                    pending.remove(case)
                    print(f"[{time.perf_counter() - started:6.0f}s] start {case.name} on GPUs {gpus}", flush=True)
            time.sleep(1.0)
            for job in list(running):
                timed_out = time.perf_counter() - job.started > args.job_timeout_s
                if job.proc.poll() is None and not timed_out:
                    continue
                if timed_out and job.proc.poll() is None:
                    os.killpg(job.proc.pid, signal.SIGKILL)
                    job.proc.wait()
                running.remove(job)
                free = sorted(free + job.gpus)
                rows[job.case.name] = collect(job, timed_out)
                r = rows[job.case.name]
                ok = "tokens_per_s_per_gpu" in r
                state = f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU" if ok else r["error"][:300]
                print(f"[{time.perf_counter() - started:6.0f}s] done  {job.case.name}: {state}", flush=True)
                if partial is not None:
                    partial.write_text(json.dumps({"rows": list(rows.values())}, indent=1, default=str))
    return [rows[c.name] for c in cases]


# ---------------------------------------------------------------------------------------------------------------------
# HF + DDP worker (one process per GPU under torchrun)


def hf_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    spec = importlib.util.spec_from_file_location("bench_transformer", Path(__file__).parent / "transformer.py")
    bench_transformer = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench_transformer  # @dataclass looks its module up in sys.modules
    spec.loader.exec_module(bench_transformer)
    from anytrain import hardware

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    per_rank = args.global_batch // world
    case = bench_transformer.Case("hf", "1.1b", args.seq, args.micro, per_rank, "hf-eager")
    batches = bench_transformer.RandomBatches(32000, args.global_batch, args.seq, seed=0)
    _, info, (model, optimizer, _) = bench_transformer.hf_step_fn(case, device, batches)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)  # fmt: skip
    accum = per_rank // args.micro

    def step(i: int) -> None:
        inputs, _, _ = batches.rank_batch(i)
        inputs = inputs[rank * per_rank : (rank + 1) * per_rank].to(device, non_blocking=True)
        for k in range(accum):
            x = inputs[k * args.micro : (k + 1) * args.micro]
            with ddp.no_sync() if k < accum - 1 else contextlib.nullcontext():  # all-reduce on the last micro-batch
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = ddp(input_ids=x, labels=x).loss / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = bench_transformer.measure(step, device, args.warmup, args.steps)
    tokens_per_s = args.steps * args.global_batch * args.seq / result["seconds"]
    peak = torch.tensor([result["peak_mem_gib"]], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        from anytrain.config import ModelConfig
        from anytrain.models import resolve_args
        from anytrain.models.llama import model as transformer

        with torch.device("meta"):
            fpt = transformer.Transformer(resolve_args(ModelConfig(flavour="1.1b"))).flops_per_token(args.seq)
        per_gpu = tokens_per_s / world
        out = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": per_gpu, "peak_mem_gib": float(peak.item()),
               "params": info["params"], "flops_per_token": fpt, "strategy": "hf-ddp",
               "mfu": fpt * per_gpu / hardware.peak_flops(device) if hardware.peak_flops(device) else None,
               "device": hardware.summary(device).get("device")}  # fmt: skip
        Path(args.worker_out).write_text(json.dumps(out))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# Analysis: efficiencies, cost-model predictions, table, plot


def shape_key(row: dict) -> tuple:
    """What makes two rows the same training problem apart from GPUs and batch: model, recipe, sequence length and
    micro-batch (HF + DDP runs the 1.1B recipe's shape). Efficiency baselines and HF references must share it."""
    return (row["model"], row.get("recipe") or RECIPES[row["model"]], row["seq"], row["micro"])


def add_efficiencies(rows: list[dict]) -> None:
    """Weak / strong scaling efficiency and the ratio to HF + DDP, with the name of each reference row.

    weak: vs the 1-GPU row of the same stack and shape whose global batch is this row's per-GPU batch (dp == GPUs
    only); strong: vs the 1-GPU row of the same stack and shape at the same global batch; vs HF + DDP: per-GPU
    tokens/s vs the HF row of the same shape on as many GPUs, at the same global batch when there is one
    (``vs_hf_ddp_batch_matched`` says whether it was), else the HF row of that GPU count."""
    good = [r for r in rows if "tokens_per_s_per_gpu" in r]

    def base(row: dict, global_batch: int) -> dict | None:
        """The same-shape 1-GPU row; for a model-parallel row whose micro-batch one GPU cannot hold (TP at 16), the
        1-GPU row of the same model, recipe and sequence at another micro-batch (its name is recorded as the ref)."""
        hf = row["layout"] == "hf-ddp"
        found = [r for r in good if r["gpus"] == 1 and (r["layout"] == "hf-ddp") == hf
                 and shape_key(r) == shape_key(row) and r["global_batch"] == global_batch]  # fmt: skip
        if not found and (row["tp"] > 1 or row["pp"] > 1):
            found = [r for r in good if r["gpus"] == 1 and (r["layout"] == "hf-ddp") == hf
                     and shape_key(r)[:3] == shape_key(row)[:3] and r["global_batch"] == global_batch]  # fmt: skip
        return found[0] if found else None

    for r in good:
        hf = r["layout"] == "hf-ddp"
        per_gpu_batch = r["global_batch"] // r["gpus"] if r["dp"] == r["gpus"] else -1
        for study, ref in (("weak", base(r, per_gpu_batch)), ("strong", base(r, r["global_batch"]))):
            r[f"{study}_efficiency"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"] if ref else None
            r[f"{study}_ref"] = ref["name"] if ref else None
        hf_rows = [x for x in good if x["layout"] == "hf-ddp" and x["gpus"] == r["gpus"] and not hf
                   and shape_key(x) == shape_key(r)]  # fmt: skip
        same_batch = [x for x in hf_rows if x["global_batch"] == r["global_batch"]]
        ref = (same_batch or hf_rows or [None])[0]
        r["vs_hf_ddp_same_gpus"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"] if ref else None
        r["vs_hf_ddp_ref"] = ref["name"] if ref else None
        r["vs_hf_ddp_batch_matched"] = bool(same_batch) if ref else None


def cost_layout(row: dict, cfg=None):
    """The cost model's Layout of a row: what the trainer builds from the row's config (``run_config``, or ``cfg``)
    on its number of GPUs."""
    from anytrain.cost import Layout
    from anytrain.parallel import resolve_strategy
    from anytrain.parallel.dims import ParallelDims

    cfg = cfg or run_config(row)
    dims = ParallelDims.from_config(cfg.parallel, row["gpus"])
    return Layout.from_config(cfg, dims, resolve_strategy(cfg, dims), row["micro"])


def run_config(case: dict, overrides: list[str] | tuple[str, ...] = ()):
    """The RunConfig a row trained with (recipe + the row's layout and options + ``overrides``), for the cost
    model."""
    from anytrain.config import load_config

    recipe = case.get("recipe") or RECIPES[case["model"]]
    layout = case["layout"]
    degrees = (case.get("tp", 1), case.get("pp", 1), case.get("dp_replicate", 1))
    args = [] if layout == "hf-ddp" else layout_overrides(layout, *degrees)
    args += [*case.get("extra", []), "--data.seq_len", str(case["seq"]), "--train.global_batch",
             str(case["global_batch"]), "--train.micro_batch", str(case["micro"]), *overrides]  # fmt: skip
    return load_config(ROOT / recipe, [o for o in args if o not in ("--device", "cpu")])


def predict_row(row: dict, device, overrides: list[str] | tuple[str, ...] = ()):
    """anytrain.cost.estimate for the model, layout and batch of one row (its config + ``overrides``)."""
    from anytrain.cost import Workload, estimate
    from anytrain.cost.cli import shape_from_config

    cfg = run_config(row, overrides)  # the bucket size the row recorded (rows from before the field: PyTorch's)
    wl = Workload.from_config(cfg, ddp_bucket_mib=row.get("ddp_bucket_mb") or LEGACY_DDP_BUCKET_MB)
    return estimate(shape_from_config(cfg), cost_layout(row, cfg), wl, device)


def add_predictions(rows: list[dict], device_key: str, gpus_per_node: int, calibrate: str = "t-1-g32") -> None:
    """Planner predictions for every anytrain row: catalogue efficiency, and efficiency fitted on ONE run (the 1.1B
    Transformer on one GPU) — the other rows, Mamba included, are predictions."""
    from anytrain.cost import get_device
    from anytrain.cost.model import fit_efficiency

    device = get_device(device_key).replace(gpus_per_node=gpus_per_node)
    candidates = [r for r in rows if r["layout"] != "hf-ddp"]
    calib = next((r for r in candidates if r["name"] == calibrate and "tokens_per_s" in r), None)
    fitted = None
    if calib:
        measured = calib["global_batch"] * calib["seq"] / calib["tokens_per_s"]
        fitted = device.replace(efficiency=fit_efficiency(predict_row(calib, device), measured))
    for r in candidates:
        r["predicted"] = {}
        for label, dev in (("catalogue", device), ("calibrated", fitted)):
            if dev is None:
                continue
            try:
                est = predict_row(r, dev)
            except Exception as exc:  # a row the cost model cannot take must not cost the file its measured rows
                r["predicted"][label] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            pred = {"step_s": est.step_s, "allocated_gib": est.allocated_gib, "efficiency": dev.efficiency,
                    "exposed_comm_s": est.exposed_comm_s, "bubble_s": est.bubble_s, "host_s": est.host_s,
                    "elementwise_s": est.elementwise_s, "calibration_run": r["name"] == calibrate}  # fmt: skip
            if "tokens_per_s" in r:
                measured = r["global_batch"] * r["seq"] / r["tokens_per_s"]
                pred["measured_step_s"] = measured
                pred["step_error"] = est.step_s / measured - 1
                pred["memory_error"] = est.allocated_gib / r["peak_mem_gib"] - 1 if r.get("peak_mem_gib") else None
            r["predicted"][label] = pred


DERIVED = ("weak_efficiency", "strong_efficiency", "weak_ref", "strong_ref", "vs_hf_ddp_same_gpus", "vs_hf_ddp_ref",
           "vs_hf_ddp_batch_matched", "predicted")  # fmt: skip


def _outcome(row: dict) -> dict:
    got = {"tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"]} if "tokens_per_s_per_gpu" in row else {}
    return {"source": row.get("source"), **(got or {"error": row.get("error", "not run")})}


def machine_id(device) -> str:
    """Host name and the first GPU's UUID: lent machines all call themselves ``vm``."""
    from anytrain import hardware

    uuid = hardware.device_uuid(device)
    return f"{socket.gethostname()}/{uuid}" if uuid else socket.gethostname()


def merge_rows(sources: list[tuple[str, dict]]) -> list[dict]:
    """One row per case name from several results files (``(file name, payload)``, oldest first): a later file's row
    replaces an earlier one of the same name, except that an error row never replaces a measured row, and measured
    runs of one case from files of the same ``host`` (one machine lease, run after run) are repeats: the row is their
    median run (the lower middle one for an even count) with every run's rate in ``repeat_tokens_per_s_per_gpu``.
    Each kept row records its ``source`` file, ``machine`` and ``date``, and the runs of the same case it was preferred
    to (``other_runs``); derived columns are dropped, to be recomputed on the merged set."""
    merged: dict[str, dict] = {}
    repeats: dict[str, list[dict]] = {}  # name -> measured runs of the kept row's host
    for src, payload in sources:
        machine = f"{payload.get('gpus_on_host', '?')}x {payload.get('device', '?')}"
        for row in payload["rows"]:
            new = {k: v for k, v in row.items() if k not in DERIVED and k != "other_runs"}
            new.update(source=src, machine=machine, date=payload.get("date"), host=payload.get("host"))
            name, old = row["name"], merged.get(row["name"])
            if old is None:
                merged[name] = new
                repeats[name] = [new] if "tokens_per_s_per_gpu" in new else []
            elif "tokens_per_s_per_gpu" in old and "tokens_per_s_per_gpu" not in new:
                old.setdefault("other_runs", []).append(_outcome(new))  # a failed rerun keeps the measurement
            elif "tokens_per_s_per_gpu" in old and new["host"] is not None and new["host"] == old["host"]:
                runs = [*repeats[name], new]
                repeats[name] = runs
                rates = [r["tokens_per_s_per_gpu"] for r in runs]
                median = next(r for r in runs if r["tokens_per_s_per_gpu"] == statistics.median_low(rates))
                merged[name] = {**median, "repeat_tokens_per_s_per_gpu": rates,
                                "other_runs": old.get("other_runs", [])}  # fmt: skip
            else:
                replaced = repeats[name] or [old]  # every run of the replaced host
                new["other_runs"] = [*old.get("other_runs", []), *map(_outcome, replaced)]
                merged[name] = new
                repeats[name] = [new] if "tokens_per_s_per_gpu" in new else []
    canonical = {c.name: i for i, c in enumerate(default_cases(1 << 10))}

    def order(r: dict) -> tuple:  # anytrain Transformer, HF + DDP, Mamba, then the cost-model validation rows
        group = 3 if r.get("recipe") else 1 if r["layout"] == "hf-ddp" else 0 if r["model"] == "transformer" else 2
        return group, r["gpus"], canonical.get(r["name"], len(canonical)), r["name"]

    return sorted(merged.values(), key=order)


def merge_payloads(sources: list[tuple[str, dict]], notes: list[str] | tuple[str, ...] = ()) -> dict:
    """The merged results: rows (``merge_rows``), efficiencies and cost-model predictions recomputed on them."""
    rows = merge_rows(sources)
    add_efficiencies(rows)
    payloads = [p for _, p in sources]
    devices = sorted({p.get("device") or "" for p in payloads})
    gpus_per_node = max(p.get("gpus_on_host") or 1 for p in payloads)
    device_key = "h200" if "H200" in devices[0] else "h100"
    add_predictions(rows, device_key, gpus_per_node)
    by_name = {r["name"]: r for r in rows}
    auto = []
    if len(devices) > 1:
        auto.append(f"sources ran on different devices: {devices}")
    cross: dict[tuple[str, str], list[str]] = {}  # (row file, reference file) -> "row (kind ref)"
    for r in rows:
        refs = {k: r.get(f"{k}_ref") for k in ("weak", "strong")} | {"vs HF": r.get("vs_hf_ddp_ref")}
        for kind, n in refs.items():
            if n and n != r["name"] and by_name[n]["source"] != r["source"]:
                cross.setdefault((r["source"], by_name[n]["source"]), []).append(f"{r['name']} ({kind} {n})")
    for (src, ref_src), items in cross.items():
        auto.append(f"reference rows from another results file (another run; merged_from names the machines): {src} "
                    f"rows against {ref_src}: {', '.join(items)}")  # fmt: skip
    loose = [f"{r['name']} vs {r['vs_hf_ddp_ref']}" for r in rows if r.get("vs_hf_ddp_batch_matched") is False]
    if loose:
        auto.append("vs HF + DDP at a different global batch (no HF row of the same batch on that GPU count): "
                    + ", ".join(loose))  # fmt: skip
    dates = sorted({p.get("date") for p in payloads})
    versions = [p.get("versions") for p in payloads]
    settings = [p.get("settings") for p in payloads]
    return {
        "date": dates[0] if len(dates) == 1 else dates,
        "device": devices[0] if len(devices) == 1 else devices,
        "gpus_on_host": gpus_per_node,
        "versions": versions[0] if all(v == versions[0] for v in versions) else versions,
        "settings": settings[0] if all(s == settings[0] for s in settings) else settings,
        "merged_from": [
            {
                "file": src,
                "machine": f"{p.get('gpus_on_host')}x {p.get('device')}",
                "date": p.get("date"),
                "rows_kept": [r["name"] for r in rows if r["source"] == src],
                "rows_not_kept": [r["name"] for r in p["rows"] if by_name[r["name"]]["source"] != src],
            }
            for src, p in sources
        ],  # fmt: skip
        "analysis": {
            "recomputed_by": "bench/scaling.py --merge",
            "cost_model_device": device_key,
            "gpus_per_node": gpus_per_node,
            "calibration_run": "t-1-g32",
        },  # fmt: skip
        "notes": [*notes, *auto],
        "rows": rows,
    }


def print_table(rows: list[dict]) -> None:
    """The results table; ``host`` is the machine a merged row came from, ``~`` marks a vs-HF ratio taken against an
    HF row of another global batch."""
    head = (f"{'case':<20}{'GPUs':>5}{'layout':>8}{'gbs':>5}{'acc':>4}{'tok/s/GPU':>11}{'MFU':>7}{'GiB':>7}"
            f"{'weak':>7}{'strong':>8}{'vs HF':>8}{'pred err':>9}{'host':>6}")  # fmt: skip
    print("\n" + head + "\n" + "-" * len(head))
    pct = lambda v: "" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for r in rows:
        host = r["machine"].split("x")[0] + "x" if r.get("machine") else ""
        if "tokens_per_s_per_gpu" not in r:
            print(f"{r['name']:<20}{r['gpus']:>5}{r['layout']:>8}  {r.get('error', 'not run')[:120]!r}")
            continue
        pred = (r.get("predicted") or {}).get("calibrated", {}).get("step_error")
        vs = r.get("vs_hf_ddp_same_gpus")
        vs = "" if vs is None else f"{vs:.2f}x" + ("~" if r.get("vs_hf_ddp_batch_matched") is False else " ")
        print(f"{r['name']:<20}{r['gpus']:>5}{r['layout']:>8}{r['global_batch']:>5}{r['accum']:>4}"
              f"{r['tokens_per_s_per_gpu']:>11,.0f}{pct(r.get('mfu')):>7}{r['peak_mem_gib']:>7.1f}"
              f"{pct(r.get('weak_efficiency')):>7}{pct(r.get('strong_efficiency')):>8}{vs:>8}"
              f"{'' if pred is None else format(100 * pred, '+.0f') + '%':>9}{host:>6}")  # fmt: skip


LAYOUT_STYLE = {"fsdp": ("FSDP", "tab:blue", "o"), "zero2": ("ZeRO-2", "tab:orange", "s"),
                "zero1": ("ZeRO-1", "tab:green", "D"), "ddp": ("DDP", "tab:red", "^"),
                "hsdp": ("HSDP 2x2", "tab:purple", "v"), "tp": ("TP", "tab:brown", "P"),
                "pp": ("PP", "tab:pink", "X")}  # fmt: skip


def row_variant(row: dict) -> str:
    """The label suffix of a row's option variant: FSDP kept gathered through accumulation, blocks per FSDP unit;
    profiled rows (``--profile.*``) are not plotted."""
    extra = " ".join(row.get("extra", []))
    out = " gathered" if "reshard_during_accumulation false" in extra else ""
    group = re.search(r"fsdp_group_blocks (\d+)", extra)
    return out + (f", {group.group(1)} blocks/unit" if group else "") + (" profiled" if "--profile." in extra else "")


def variant_styles(rows: list[dict]) -> list:
    """(layout, variant) -> (name, color, marker) for every layout in LAYOUT_STYLE and each variant present."""
    out = []
    for layout, style in LAYOUT_STYLE.items():
        variants = sorted({row_variant(r) for r in rows if r["layout"] == layout} | {""})
        out += [((layout, v), style) for v in variants if "profiled" not in v]
    return out


def plot_series(rows: list[dict], model: str) -> list[dict]:
    """Lines for one model's panel: per layout, the 1-GPU run at the study's global batch then the layout's rows at
    that batch (labelled with strong efficiency); FSDP and HF + DDP also at a fixed per-GPU batch (weak efficiency)."""
    rows = [r for r in rows if "tokens_per_s_per_gpu" in r and r["model"] == model and not r.get("recipe")]
    singles = {r["global_batch"]: r for r in rows if r["gpus"] == 1 and r["layout"] == "single"}
    strong_gbs = max(singles, default=None)
    series = []
    for (layout, variant), (name, color, marker) in variant_styles(rows):
        mine = sorted((r for r in rows if r["layout"] == layout and row_variant(r) == variant and r["gpus"] > 1),
                      key=lambda r: r["gpus"])  # fmt: skip
        name = f"{name}{variant}"
        strong = [r for r in mine if r["global_batch"] == strong_gbs]
        if strong:
            untied = any("tie_embeddings" in " ".join(r.get("extra", [])) for r in strong)
            series.append({"label": f"{name}{' (untied emb.)' if untied else ''}, {strong_gbs} seq global",
                           "rows": [singles[strong_gbs], *strong], "eff": "strong", "color": color,
                           "marker": marker, "style": "-" if not variant else "-."})  # fmt: skip
        weak_batches = {r["global_batch"] // r["gpus"] for r in mine if r["global_batch"] != strong_gbs}
        for b in sorted(weak_batches & set(singles)):
            weak = [r for r in mine if r["dp"] == r["gpus"] and r["global_batch"] == b * r["gpus"]]
            series.append({"label": f"{name}, {b} seq per GPU", "rows": [singles[b], *weak], "eff": "weak",
                           "color": color, "marker": marker, "style": ":"})  # fmt: skip
    hf = sorted((r for r in rows if r["layout"] == "hf-ddp"), key=lambda r: r["gpus"])
    if hf:
        b = hf[0]["global_batch"] // hf[0]["gpus"]
        series.append({"label": f"HF + DDP, {b} seq per GPU", "rows": hf, "eff": "weak", "color": "dimgray",
                       "marker": "o", "style": "--"})  # fmt: skip
    return series


def plot(payload: dict, png: Path) -> None:
    """Per-GPU tokens/s against GPUs, one panel per model, efficiency labels at each multi-GPU point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    models = [m for m in MODEL_NAMES if any(r["model"] == m and "tokens_per_s_per_gpu" in r for r in rows)]
    widths = [1.6 if m == "transformer" else 1.0 for m in models]  # the Transformer panel has more lines and labels
    fig, axes = plt.subplots(1, len(models), figsize=(6.6 * sum(widths), 7.2), squeeze=False,
                             gridspec_kw={"width_ratios": widths})  # fmt: skip
    for ax, model in zip(axes[0], models, strict=True):
        series = plot_series(rows, model)
        labels: dict[int, list[tuple[float, str, str]]] = {}
        for s in series:
            xs = [r["gpus"] for r in s["rows"]]
            ys = [r["tokens_per_s_per_gpu"] / 1e3 for r in s["rows"]]
            ax.plot(xs, ys, linestyle=s["style"], marker=s["marker"], color=s["color"], label=s["label"],
                    linewidth=2.2 if s["color"] == "dimgray" else 1.6, markersize=7)  # fmt: skip
            for r in s["rows"][1:]:
                eff = r.get(f"{s['eff']}_efficiency")
                if eff is not None:
                    name = s["label"].split(",")[0].replace(" (untied emb.)", "")
                    text = f"{name} {100 * eff:.1f}% {s['eff']}"
                    if r.get("vs_hf_ddp_batch_matched"):  # the ratio only where HF ran the same batch
                        text += f", {r['vs_hf_ddp_same_gpus']:.2f}x HF"
                    labels.setdefault(r["gpus"], []).append((r["tokens_per_s_per_gpu"] / 1e3, text, s["color"]))
        top = max((r["tokens_per_s_per_gpu"] / 1e3 for s in series for r in s["rows"]), default=1.0) * 1.12
        gap = top * 0.042
        for gpus, items in labels.items():  # spread the labels of one GPU count so that none overlap
            items.sort()
            placed: list[float] = []
            for y, _, _ in items:
                placed.append(max(y, placed[-1] + gap) if placed else y)
            shift = max(0.0, placed[-1] - (top - gap / 2))
            for (y, text, color), ly in zip(items, placed, strict=True):
                ax.annotate(text, (gpus, y), xytext=(gpus * 1.1, ly - shift), fontsize=8.5, color=color, va="center",
                            bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9},
                            arrowprops={"arrowstyle": "-", "color": color, "lw": 0.6}, zorder=5)  # fmt: skip
        counts = sorted({r["gpus"] for s in series for r in s["rows"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlim(0.85, max(counts) * 2.3)
        ax.set_ylim(0, top)
        ax.set_xlabel("GPUs (one host, NVLink)")
        ax.set_ylabel("tokens/s per GPU (thousands), seq 2048")
        ax.set_title(f"anytrain {MODEL_NAMES[model]}" + (" vs HF + DDP (dashed)" if model == "transformer" else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    date = payload.get("date")
    date = ", ".join(date) if isinstance(date, list) else date
    fig.suptitle(f"Per-GPU throughput and scaling efficiency: {payload.get('device')}, {date} "
                 "(strong: vs 1 GPU at the same global batch; weak: vs 1 GPU at the same per-GPU batch)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def smoke(args: argparse.Namespace) -> None:
    """The launcher, collection and analysis on CPU (gloo): the debug Transformer at 1 and 2 processes."""
    tiny = dict(model="transformer", micro=2, seq=64, recipe="configs/tiny.yaml",
                extra=["--device", "cpu"])  # fmt: skip
    cases = [Case("t-1-g8", gpus=1, layout="single", global_batch=8, studies=("strong",), **tiny),
             Case("t-1-g4", gpus=1, layout="single", global_batch=4, studies=("weak",), **tiny),
             Case("t-fsdp-2-g8", gpus=2, layout="fsdp", global_batch=8, studies=("strong", "weak"), **tiny),
             Case("t-ddp-2-g8", gpus=2, layout="ddp", global_batch=8, studies=("strong",), **tiny)]  # fmt: skip
    args.steps, args.log_interval = 4, 2
    rows = run_cases(cases, args, 2)
    add_efficiencies(rows)
    print_table(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "scaling_smoke.json").write_text(json.dumps({"rows": rows}, indent=1, default=str))
    bad = [r["name"] for r in rows if "tokens_per_s_per_gpu" not in r]
    if bad:
        sys.exit(f"error: smoke rows failed: {', '.join(bad)}")


def merge_main(args: argparse.Namespace) -> None:
    sources = [(Path(f).name, json.loads(Path(f).read_text())) for f in args.merge]
    payload = merge_payloads(sources, args.note)
    print_table(payload["rows"])
    for note in payload["notes"]:
        print(f"note: {note}")
    device = payload["device"] if isinstance(payload["device"], str) else "mixed"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    path = Path(args.out) / f"scaling_{slug}{tag_suffix(args.tag)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
    print(f"\nwrote {path}")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="*", default=None, help="GPU counts to include (default: all fit)")
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    parser.add_argument("--models", nargs="*", default=["transformer", "mamba"])
    parser.add_argument("--exclude", nargs="*", default=[], help="case names or layouts (e.g. pp) to leave out")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per anytrain row")
    parser.add_argument("--log-interval", type=int, default=2, help="log window; the first window is warm-up")
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--serial", action="store_true", help="one job at a time (no concurrent disjoint jobs)")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no job after this many seconds (0 = none)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per case, round-robin; each row is the median run")
    parser.add_argument("--job-timeout-s", type=float, default=200.0)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="", help="suffix for the results file name")
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny model, 1 and 2 gloo processes")
    parser.add_argument("--plot", default=None, help="only plot an existing results JSON")
    parser.add_argument("--png", default="docs/scaling.png")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="merge results files (oldest first; a later row replaces an earlier one of the same case "
        "unless it failed), recompute the analysis, write scaling_<device><tag>.json in --out",
    )
    parser.add_argument("--train-args", default="", help="overrides appended to every anytrain row, e.g. "
                        "'--train.gc_interval 0' (A/B runs of a trainer option; record it with --tag)")  # fmt: skip
    parser.add_argument("--note", action="append", default=[], help="with --merge: a note to record in the file")
    parser.add_argument("--grad-compression", default="", help="parallel.grad_compression of every anytrain row "
                        "(none, bf16, fp16, powersgd:rank=R; PowerSGD from step 2): the compression A/B of "
                        "docs/scaling.md; name the run with --tag")  # fmt: skip
    # worker mode (internal)
    parser.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--global-batch", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        hf_worker(args)
        return
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.png))
        return
    if args.smoke:
        smoke(args)
        return
    if args.merge:
        merge_main(args)
        return
    if args.grad_compression:  # appended to --train-args, so the results file's settings record it
        start = " --parallel.powersgd_start_step 2" if args.grad_compression.startswith("powersgd") else ""
        args.train_args = f"{args.train_args} --parallel.grad_compression {args.grad_compression}{start}".strip()
    n_gpus = gpu_count()
    if n_gpus == 0:
        sys.exit("error: bench/scaling.py needs CUDA/ROCm GPUs (found none); use --plot to redraw a results file")
    cases = [c for c in default_cases(n_gpus) if c.model in args.models and (args.gpus is None or c.gpus in args.gpus)
             and (args.only is None or c.name in args.only) and not {c.name, c.layout} & set(args.exclude)]  # fmt: skip
    from anytrain import hardware

    device = hardware.resolve_device("auto")
    env = hardware.summary(device)
    print(json.dumps({"gpus": n_gpus, **env}), flush=True)
    slug = re.sub(r"[^a-z0-9]+", "-", env.get("device", "unknown").lower()).strip("-")
    path = Path(args.out) / f"scaling_{slug}{tag_suffix(args.tag)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.json")
    rows = aggregate_repeats(run_cases(with_repeats(cases, args.repeats), args, n_gpus, partial))
    add_efficiencies(rows)
    add_predictions(rows, "h200" if "H200" in env.get("device", "") else "h100", n_gpus)
    print_table(rows)
    payload = {"date": time.strftime("%Y-%m-%d"), "device": env.get("device"), "gpus_on_host": n_gpus,
               "host": machine_id(device),  # runs of one machine: repeats when merged
               "versions": env, "settings": {"steps": args.steps, "log_interval": args.log_interval,
                                             "repeats": args.repeats, "concurrent": not args.serial,
                                             "train_args": args.train_args},
               "rows": rows}  # fmt: skip
    path.write_text(json.dumps(payload, indent=1, default=str))
    partial.unlink(missing_ok=True)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
