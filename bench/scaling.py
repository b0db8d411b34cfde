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

    PYTHONPATH=src python -m bench.scaling --gpus 1 2 4 --out bench/results           # the study (GPU host)
    PYTHONPATH=src python -m bench.scaling --only t-fsdp-2-g32 t-1-g32 --serial       # a subset
    python -m bench.scaling --merge A.json B.json --tag T --out bench/results         # several runs -> one file
    python -m bench.scaling --plot bench/results/scaling_nvidia-h200.json --png docs/scaling.png
"""

from __future__ import annotations

import argparse
import contextlib
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
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import child_env
from bench.scaling_analysis import add_efficiencies, add_predictions, merge_payloads, plot, print_table
from bench.scaling_cases import RECIPES, ROOT, Case, default_cases, layout_overrides

# ---------------------------------------------------------------------------------------------------------------------
# Launching


def anytrain_command(
    case: Case, run_dir: Path, data: str, steps: int, log_interval: int, extra: tuple[str, ...] = ()
) -> list[str]:
    overrides = {
        "data.path": data,
        "data.seq_len": case.seq,
        "train.global_batch": case.global_batch,
        "train.micro_batch": case.micro,
        "train.steps": steps,
        "train.log_interval": log_interval,
        "train.eval_interval": 0,
        "train.eval_batches": 0,
        "checkpoint.interval": 0,
        "checkpoint.save_final": "false",
    }
    args = [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    args += layout_overrides(case.layout, case.tp, case.pp, case.dp_replicate)
    recipe = case.recipe or RECIPES[case.model]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={case.gpus}",
        "-m",
        "anytrain",
        "train",
        recipe,
        "--run-dir",
        str(run_dir),
        *args,
        *case.extra,
        *extra,
    ]


def hf_command(case: Case, out_json: Path, steps: int, warmup: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={case.gpus}",
        "-m",
        "bench.scaling",
        "--hf-worker",
        "--global-batch",
        str(case.global_batch),
        "--micro",
        str(case.micro),
        "--seq",
        str(case.seq),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--worker-out",
        str(out_json),
    ]


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
        cmd = anytrain_command(
            case, job_dir / "run", args.data, args.steps, args.log_interval, tuple(args.train_args.split())
        )
    from anytrain import hardware

    # the job's GPUs as this process numbers them, inside any visible-devices list it was started with
    env = child_env(**hardware.devices_env(gpus), PYTHONUNBUFFERED="1")
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
    row = {
        **asdict(case),
        "dp": case.dp,
        "accum": case.accum,
        "gpu_ids": job.gpus,
        "wall_s": round(time.perf_counter() - job.started, 1),
    }
    text = job.log.read_text(errors="replace") if job.log.exists() else ""
    causes = [
        ln
        for ln in text.splitlines()
        if re.match(r"^(error: |\w*(Error|Exception): )", ln) and "ChildFailedError" not in ln
    ]
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
    row.update(
        {
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
        }
    )
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

    from anytrain import hardware
    from bench import transformer as bench_transformer

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
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )
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
        out = {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_gpu": per_gpu,
            "peak_mem_gib": float(peak.item()),
            "params": info["params"],
            "flops_per_token": fpt,
            "strategy": "hf-ddp",
            "mfu": fpt * per_gpu / hardware.peak_flops(device) if hardware.peak_flops(device) else None,
            "device": hardware.summary(device).get("device"),
        }
        Path(args.worker_out).write_text(json.dumps(out))
    dist.destroy_process_group()


def machine_id(device) -> str:
    """Host name and the first GPU's UUID: lent machines all call themselves ``vm``."""
    from anytrain import hardware

    uuid = hardware.device_uuid(device)
    return f"{socket.gethostname()}/{uuid}" if uuid else socket.gethostname()


def smoke(args: argparse.Namespace) -> None:
    """The launcher, collection and analysis on CPU (gloo): the debug Transformer at 1 and 2 processes."""
    tiny = dict(model="transformer", micro=2, seq=64, recipe="configs/tiny.yaml", extra=["--device", "cpu"])
    cases = [
        Case("t-1-g8", gpus=1, layout="single", global_batch=8, studies=("strong",), **tiny),
        Case("t-1-g4", gpus=1, layout="single", global_batch=4, studies=("weak",), **tiny),
        Case("t-fsdp-2-g8", gpus=2, layout="fsdp", global_batch=8, studies=("strong", "weak"), **tiny),
        Case("t-ddp-2-g8", gpus=2, layout="ddp", global_batch=8, studies=("strong",), **tiny),
    ]
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
    parser.add_argument(
        "--train-args",
        default="",
        help="overrides appended to every anytrain row, e.g. "
        "'--train.gc_interval 0' (A/B runs of a trainer option; record it with --tag)",
    )
    parser.add_argument("--note", action="append", default=[], help="with --merge: a note to record in the file")
    parser.add_argument(
        "--grad-compression",
        default="",
        help="parallel.grad_compression of every anytrain row "
        "(none, bf16, fp16, powersgd:rank=R; PowerSGD from step 2): the compression A/B of "
        "docs/scaling.md; name the run with --tag",
    )
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
    cases = [
        c
        for c in default_cases(n_gpus)
        if c.model in args.models
        and (args.gpus is None or c.gpus in args.gpus)
        and (args.only is None or c.name in args.only)
        and not {c.name, c.layout} & set(args.exclude)
    ]
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
    payload = {
        "date": time.strftime("%Y-%m-%d"),
        "device": env.get("device"),
        "gpus_on_host": n_gpus,
        "host": machine_id(device),  # runs of one machine: repeats when merged
        "versions": env,
        "settings": {
            "steps": args.steps,
            "log_interval": args.log_interval,
            "repeats": args.repeats,
            "concurrent": not args.serial,
            "train_args": args.train_args,
        },
        "rows": rows,
    }
    path.write_text(json.dumps(payload, indent=1, default=str))
    partial.unlink(missing_ok=True)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
