"""Mamba training throughput on one GPU: anytrain (Triton scan + conv kernels) vs HF transformers MambaForCausalLM.

All rows run in ONE process, one after another, on identical random token batches (a bank of 4 global batches drawn
once from a seeded generator and cycled), with bf16 autocast over fp32 weights, fused AdamW and gradient clipping. A
step is one optimizer step (all micro-batches of the global batch). Each row runs ``warmup`` untimed steps (Triton
autotuning / compilation happen there), then its timed steps, each between two ``torch.cuda.Event``s; tokens/s uses
the summed event time. Peak memory is the caching allocator's max allocated bytes over the timed steps (the previous
row is garbage-collected and the counter reset first).

The anytrain rows run the product's own code: the Trainer's build (train/build.py ``build_model``: meta-device
build, init, ``parallelize``, ``build_optimizer``, autocast) and ``Trainer.train_step`` on a Trainer whose data source
yields the random batches. If that Trainer cannot be assembled (its internals change), the row falls back to the
same pieces called directly (``build_model`` + ``parallelize`` + ``build_optimizer`` + autocast + clip) and says so
in its ``driver`` field.

The HF row builds ``MambaForCausalLM`` from a ``MambaConfig`` of the same shape (no download). Without mamba-ssm and
causal-conv1d installed HF runs its pure-PyTorch slow path (a Python loop over time steps), so it gets 1 warm-up and
2 timed steps of one micro-batch each. That slow path needs about 80 GiB at mamba-130m x micro-batch 8: where it runs
out of memory (an 80 GB H100), the row halves its micro-batch (the same global batch in more micro-steps) and lists
the micro-batches that did not fit in ``micro_out_of_memory``.

MFU = anytrain's ``Mamba.flops_per_token`` (6·N + the scan's elementwise FLOPs) × tokens/s / the device's dense bf16
peak (``anytrain.hardware.peak_flops``), the same formula for every row.

    PYTHONPATH=src python3 -m bench.mamba_train                       # all rows (GPU)
    PYTHONPATH=src python3 -m bench.mamba_train --rows 130m hf-130m   # some rows
    PYTHONPATH=src python3 -m bench.mamba_train --quick               # CPU smoke run: debug shape, 2 steps
    PYTHONPATH=src python3 -m bench.mamba_train --cpu-scan            # CPU: reference scan, loop vs chunked

``--cpu-scan`` times one forward + backward of the tiny-mamba LM on CPU with the reference selective scan as the
plain per-step loop (``impl="loop"``) and as the chunked two-level scan (the default), interleaved, best of 3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from anytrain import hardware
from anytrain.config import ModelConfig, RunConfig
from anytrain.models import build_model, resolve_args
from anytrain.parallel import parallelize
from anytrain.train.optim import build_optimizer
from anytrain.train.profiling import profile_call
from bench.common import RandomBatches, print_profile, release, row_error, versions


@dataclass
class Case:
    name: str  # the --rows key
    flavour: str
    seq: int
    micro: int
    global_batch: int
    stack: str  # "anytrain" | "hf"
    label: str
    compile: bool = False  # anytrain: torch.compile (train.compile; per block unless scope says otherwise)
    graphs: bool = False  # anytrain: micro-steps replayed from a CUDA graph (train.cuda_graphs)
    scope: str = "blocks"  # anytrain with compile: train.compile_scope (blocks | model | auto)
    warmup: int = 2
    steps: int = 10
    model_args: tuple = ()  # anytrain: (name, value) overrides of model.args


BF16_RESIDUAL = (("residual_in_fp32", False),)  # model.args of the 1.4b recipes: the residual stream in bf16


def default_cases() -> list[Case]:
    """In run order (the slow HF row last, so a time budget drops it first)."""
    return [
        # configs/mamba-130m.yaml: micro-steps replayed from a CUDA graph (host-bound otherwise), the model compiled
        Case("130m", "130m", 1024, 8, 64, "anytrain", "anytrain recipe (mamba-130m.yaml)", True, True, "auto"),
        Case("130m-graphs", "130m", 1024, 8, 64, "anytrain", "anytrain 130m, CUDA graphs, no compile", graphs=True),
        Case("130m-eager", "130m", 1024, 8, 64, "anytrain", "anytrain 130m, eager (the recipe before graphs)"),
        # mamba-1.4b at micro-batch 4 with global batch 8 instead of 32 (2 micro-batches per step, not 8), so that 10
        # timed steps fit a short GPU lease; the optimizer step (~5% of such a step on an H200) is then amortised over
        # 4x fewer tokens than in the recipe, which "1.4b-recipe" runs as configured (micro-batch 8; "1.4b-mb4c" is
        # the recipe at micro-batch 4, for cards below 80 GB).
        Case("1.4b", "1.4b", 2048, 4, 8, "anytrain", "anytrain 1.4b, micro-batch 4, global batch 8"),
        Case(
            "1.4b-recipe",
            "1.4b",
            2048,
            8,
            32,
            "anytrain",
            "recipe (mamba-1.4b.yaml)",
            True,
            False,
            "auto",
            2,
            5,
            BF16_RESIDUAL,
        ),
        Case(
            "1.4b-mb4c",
            "1.4b",
            2048,
            4,
            32,
            "anytrain",
            "recipe at micro-batch 4",
            True,
            False,
            "auto",
            2,
            5,
            BF16_RESIDUAL,
        ),
        # cards of 141 GB or more (H200): micro-batch 16 (configs/mamba-1.4b-mb16.yaml, 122 GiB)
        Case(
            "1.4b-mb16",
            "1.4b",
            2048,
            16,
            32,
            "anytrain",
            "recipe mb16 (mamba-1.4b-mb16.yaml)",
            True,
            False,
            "auto",
            2,
            5,
            BF16_RESIDUAL,
        ),
        # the fp32 residual stream (mamba-ssm's and HF's default)
        Case(
            "1.4b-fp32res", "1.4b", 2048, 8, 32, "anytrain", "recipe, fp32 residual stream", True, False, "auto", 2, 5
        ),
        Case(
            "1.4b-mb16-fp32res",
            "1.4b",
            2048,
            16,
            32,
            "anytrain",
            "recipe mb16, fp32 residual",
            True,
            False,
            "auto",
            2,
            5,
        ),
        Case("1.4b-mb8", "1.4b", 2048, 8, 16, "anytrain", "anytrain micro-batch 8"),
        Case(
            "1.4b-blocks",
            "1.4b",
            2048,
            8,
            32,
            "anytrain",
            "recipe, per-block compile",
            compile=True,
            steps=5,
            model_args=BF16_RESIDUAL,
        ),
        Case("130m-blocks", "130m", 1024, 8, 64, "anytrain", "130m recipe, per-block compile", True, True, "blocks"),
        Case("1.4b-compile", "1.4b", 2048, 4, 8, "anytrain", "anytrain + per-block torch.compile", compile=True),
        Case("1.4b-graphs", "1.4b", 2048, 4, 8, "anytrain", "+ compile + CUDA graphs", compile=True, graphs=True),
        Case("130m-compile", "130m", 1024, 8, 64, "anytrain", "anytrain + per-block torch.compile", compile=True),
        Case("hf-130m", "130m", 1024, 8, 8, "hf", "HF MambaForCausalLM (slow path)", warmup=1, steps=2),
    ]


def quick_cases() -> list[Case]:
    return [
        Case("debug", "debug", 64, 2, 4, "anytrain", "anytrain", warmup=1, steps=2),
        Case("hf-debug", "debug", 64, 2, 2, "hf", "HF MambaForCausalLM", warmup=1, steps=2),
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Batches and the two stacks


def run_config(case: Case, device: torch.device) -> RunConfig:
    cfg = RunConfig()
    cfg.model = ModelConfig(arch="mamba", flavour=case.flavour, args=dict(case.model_args))
    cfg.data.seq_len = case.seq
    cfg.train.global_batch, cfg.train.micro_batch = case.global_batch, case.micro
    cfg.train.compile, cfg.train.compile_scope = case.compile, case.scope
    cfg.train.cuda_graphs = case.graphs
    cfg.train.dtype = "bf16" if hardware.is_gpu(device) else "fp32"
    cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps = 1e-3, 100, 1000
    return cfg


def trainer_step_fn(case: Case, device: torch.device, batches: RandomBatches) -> tuple:
    """A Trainer without data files or a run dir: the product's build and train_step on random batches."""
    from anytrain.train import trainer as trainer_module

    cfg = run_config(case, device)
    trainer = trainer_module.Trainer(cfg, batches=batches)  # no run directory: nothing is written
    model = trainer.raw_model

    def step(i: int) -> None:
        trainer.train_step(i)

    return step, model, trainer


def direct_step_fn(case: Case, device: torch.device, batches: RandomBatches) -> tuple:
    """The same pieces as the Trainer, called directly: build, parallelize (compile), fused AdamW, autocast, clip."""
    from anytrain.parallel.mesh import ParallelDims

    cfg = run_config(case, device)
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta"):
        model = build_model(cfg.model)
    model.to_empty(device=device)
    model.init_weights()
    dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
    run, _ = parallelize(model, cfg, ParallelDims.from_config(cfg.parallel, 1), device, dtype)
    optimizer = build_optimizer(run, cfg.train, device)
    accum = case.global_batch // case.micro
    use_autocast = dtype != torch.float32
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if use_autocast else contextlib.nullcontext

    def step(i: int) -> None:
        inputs, targets, _ = batches.rank_batch(i)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        for k in range(accum):
            sl = slice(k * case.micro, (k + 1) * case.micro)
            with autocast():
                loss = run(inputs[sl], targets[sl]) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(run.parameters(), cfg.train.grad_clip or float("inf"), foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model, (run, optimizer)


def hf_step_fn(case: Case, device: torch.device, batches: RandomBatches) -> tuple:
    """HF MambaForCausalLM of the same shape (random init, fp32 master weights), autocast bf16, fused AdamW."""
    from transformers import MambaConfig, MambaForCausalLM
    from transformers.models.mamba import modeling_mamba

    a = resolve_args(ModelConfig(arch="mamba", flavour=case.flavour))
    config = MambaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.d_model,
        state_size=a.d_state,
        num_hidden_layers=a.n_layers,
        expand=a.expand,
        conv_kernel=a.d_conv,
        time_step_rank=a.dt_rank,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=a.norm_eps,
        residual_in_fp32=a.residual_in_fp32,
        tie_word_embeddings=a.tie_embeddings,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = MambaForCausalLM(config)
    model = model.float().train()
    fast = getattr(modeling_mamba, "is_fast_path_available", None)
    fast = bool(fast) if fast is not None and not callable(fast) else repr(fast)
    info = {"hf_params": sum(p.numel() for p in model.parameters()), "hf_fast_path_available": fast}
    fused = hardware.is_gpu(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    accum = case.global_batch // case.micro
    dtype = torch.bfloat16 if hardware.is_gpu(device) else torch.float32

    def step(i: int) -> None:
        inputs, _, _ = batches.rank_batch(i)
        inputs = inputs.to(device, non_blocking=True)
        for k in range(accum):
            x = inputs[k * case.micro : (k + 1) * case.micro]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(input_ids=x, labels=x).loss / accum  # HF shifts the labels itself
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, info, (model, optimizer)


# ---------------------------------------------------------------------------------------------------------------------
# Measuring


def measure(step: Callable[[int], None], device: torch.device, warmup: int, steps: int) -> dict:
    """Warm-up steps, then ``steps`` timed steps, each between two device events (host clock on CPU)."""
    t0 = time.perf_counter()
    for i in range(warmup):
        step(i)
    hardware.synchronize(device)
    warmup_s = time.perf_counter() - t0
    hardware.reset_peak_memory(device)
    step_s = []
    if hardware.is_gpu(device):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for i, (start, end) in enumerate(events):
            start.record()
            step(warmup + i)
            end.record()
        hardware.synchronize(device)
        step_s = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for i in range(steps):
            t = time.perf_counter()
            step(warmup + i)
            step_s.append(time.perf_counter() - t)
    return {
        "seconds": sum(step_s),
        "step_s": step_s,
        "warmup_s": warmup_s,
        "peak_mem_gib": hardware.peak_memory_gib(device),
        "peak_reserved_gib": hardware.peak_memory_gib(device, reserved=True),
    }


def flops_per_token(flavour: str, seq: int) -> tuple[float, int]:
    with torch.device("meta"):
        model = build_model(ModelConfig(arch="mamba", flavour=flavour))
    return model.flops_per_token(seq), model.num_params()


def run_case(case: Case, device: torch.device, profile: bool = False) -> dict:
    vocab = resolve_args(ModelConfig(arch="mamba", flavour=case.flavour)).vocab_size
    batches = RandomBatches(vocab, case.global_batch, case.seq)
    fpt, params = flops_per_token(case.flavour, case.seq)
    row = {**asdict(case), "tokens_per_step": case.global_batch * case.seq, "flops_per_token": fpt, "params": params}
    holder = None
    try:
        if case.stack == "hf":
            step, info, holder = hf_step_fn(case, device, batches)
            row.update(info, driver="hf")
            while True:  # its slow path needs ~80 GiB at mamba-130m x micro-batch 8: halve the micro-batch on OOM
                try:
                    row.update(measure(step, device, case.warmup, case.steps))
                    break
                except torch.OutOfMemoryError:
                    if case.micro == 1 or case.global_batch % (case.micro // 2):
                        raise
                # (outside the handler: its traceback, which holds the failed step's activations, is gone)
                step = holder = None
                release(device)
                row.setdefault("micro_out_of_memory", []).append(case.micro)
                case = replace(case, micro=case.micro // 2)  # the same global batch, more micro-steps
                row["micro"] = case.micro
                step, _, holder = hf_step_fn(case, device, batches)
        else:
            try:
                step, _, holder = trainer_step_fn(case, device, batches)
                row["driver"] = "Trainer.train_step"
            except Exception as exc:  # noqa: BLE001 - the trainer's internals moved: same pieces, called directly
                row["trainer_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                release(device)
                step, _, holder = direct_step_fn(case, device, batches)
                row["driver"] = "direct (build_model + parallelize + build_optimizer)"
            row.update(measure(step, device, case.warmup, case.steps))
        if case.graphs:  # the graph's activations sit in its private pool, which the allocated peak leaves out
            row["peak_mem_gib"], row["peak_mem_kind"] = row["peak_reserved_gib"], "reserved"
        row["tokens_per_s"] = case.steps * row["tokens_per_step"] / row["seconds"]
        if profile and hardware.is_gpu(device):
            index = case.warmup + case.steps
            row["kernel_profile"] = profile_call(lambda: step(index), device)
    except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
        row["error"] = row_error(exc)
    finally:
        del holder
    return row


def finish_rows(rows: list[dict], peak: float | None) -> None:
    """MFU from anytrain's flops/token; ratio of each row's tokens/s to the HF row of the same flavour."""
    for r in rows:
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak if peak and "tokens_per_s" in r else None
    for r in rows:
        hf = [
            x["tokens_per_s"]
            for x in rows
            if x["stack"] == "hf" and x["flavour"] == r["flavour"] and "tokens_per_s" in x
        ]
        r["ratio_vs_hf"] = r["tokens_per_s"] / max(hf) if hf and "tokens_per_s" in r else None


def print_table(rows: list[dict]) -> None:
    head = f"{'row':<18}{'what':<44}{'seq':>6}{'mb':>4}{'gb':>4}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'vs HF':>10}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if "tokens_per_s" not in r:
            print(
                f"{r['name']:<18}{r['label'][:43]:<44}{r['seq']:>6}{r['micro']:>4}{r['global_batch']:>4}  "
                f"{r.get('error', 'skipped')[:100]}"
            )
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        ratio = "" if r["ratio_vs_hf"] is None else f"{r['ratio_vs_hf']:,.0f}x"
        print(
            f"{r['name']:<18}{r['label'][:43]:<44}{r['seq']:>6}{r['micro']:>4}{r['global_batch']:>4}"
            f"{r['tokens_per_s']:>12,.0f}{mfu:>8}{r['peak_mem_gib']:>10.1f}{ratio:>10}"
        )


def cpu_scan_rows(repeats: int = 3) -> list[dict]:
    """Forward + backward seconds of tiny-mamba-width LMs on CPU, reference scan loop vs chunked (best of repeats)."""
    from functools import partial

    import anytrain.models.mamba.model as mamba_module
    from anytrain.kernels.reference import selective_scan_ref

    rows = []
    for layers, batch, seq in ((8, 16, 64), (4, 4, 256), (8, 4, 256)):
        torch.manual_seed(0)
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, mamba_module, "selective_scan", mamba_module.selective_scan)
            args = resolve_args(ModelConfig(arch="mamba", flavour="tiny-mamba"))
            args.n_layers = layers
            model = mamba_module.Mamba(args)
            tokens = torch.randint(0, args.vocab_size, (batch, seq))
            best: dict[str, float] = {}
            for _ in range(repeats):
                for impl in ("loop", "chunked"):
                    mamba_module.selective_scan = partial(selective_scan_ref, impl=impl)
                    t0 = time.perf_counter()
                    model(tokens, tokens).backward()
                    best[impl] = min(best.get(impl, float("inf")), time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
        row = {
            "layers": layers,
            "batch": batch,
            "seq": seq,
            "loop_s": best["loop"],
            "chunked_s": best["chunked"],
            "speedup": best["loop"] / best["chunked"],
            "threads": torch.get_num_threads(),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="directory for mamba_train_<device>.json")
    parser.add_argument("--rows", nargs="*", default=None, help="row names to run (default: all)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps of the anytrain rows (0: the row's own)")
    parser.add_argument("--hf-steps", type=int, default=2, help="timed steps of the HF rows (its slow path)")
    parser.add_argument("--hf-warmup", type=int, default=1, help="untimed steps of the HF rows")
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip rows that start past this (0 = none)")
    parser.add_argument("--profile", nargs="*", default=None, help="rows to profile one extra step of (GPU)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: debug shape, 1 + 2 steps")
    parser.add_argument("--cpu-scan", action="store_true", help="CPU: reference scan loop vs chunked, fwd + bwd")
    args = parser.parse_args()
    if args.cpu_scan:
        rows = cpu_scan_rows()
        env = versions(torch.device("cpu"))
        env["cpu_count"], env["load_avg_1m"] = os.cpu_count(), os.getloadavg()[0]
        print(f"\n{'layers':>7}{'batch':>7}{'seq':>6}{'loop s':>10}{'chunked s':>11}{'speedup':>9}")
        for r in rows:
            print(
                f"{r['layers']:>7}{r['batch']:>7}{r['seq']:>6}{r['loop_s']:>10.2f}{r['chunked_s']:>11.2f}"
                f"{r['speedup']:>8.1f}x"
            )
        out_path = Path(args.out) / "mamba_train_cpu-scan.json"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "versions": env, "rows": rows}, indent=1))
        print(f"\nwrote {out_path}")
        return
    device = hardware.resolve_device("cpu" if args.quick else "auto")
    cases = quick_cases() if args.quick else default_cases()
    names = [c.name for c in cases]
    for name in args.rows or []:
        if name not in names:
            parser.error(f"--rows: unknown row {name!r}; choose from {', '.join(names)}")
    cases = [c for c in cases if args.rows is None or c.name in args.rows]
    for c in cases:
        c.steps = args.steps if args.steps and c.stack == "anytrain" else c.steps
        if c.stack == "hf" and not args.quick:
            c.warmup, c.steps = args.hf_warmup, args.hf_steps
    if hardware.is_gpu(device):
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast: same for every stack
    env = versions(device)
    slug = "quick" if args.quick else re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    out_path = Path(args.out) / f"mamba_train_{slug}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    print(json.dumps(env), flush=True)
    started, rows = time.perf_counter(), []
    for case in cases:
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            rows.append({**asdict(case), "error": "skipped: time budget"})
            continue
        release(device)
        t0 = time.perf_counter()
        rows.append(run_case(case, device, profile=case.name in (args.profile or [])))
        rows[-1]["row_wall_s"] = time.perf_counter() - t0
        print(
            json.dumps({k: v for k, v in rows[-1].items() if k not in ("step_s", "kernel_profile")}, default=str),
            flush=True,
        )
        finish_rows(rows, hardware.peak_flops(device))
        kernels = {k: v for k, v in os.environ.items() if k.startswith(("ANYTRAIN", "TORCH"))}
        payload = {
            "date": time.strftime("%Y-%m-%d"),
            "device": env["device"],
            "versions": env,
            "settings": {
                "dtype": "bf16 autocast over fp32 weights (fp32 on CPU)",
                "optimizer": "AdamW fused",
                "env": kernels,
            },
            "rows": rows,
        }
        out_path.write_text(json.dumps(payload, indent=1, default=str))
    finish_rows(rows, hardware.peak_flops(device))
    print_table(rows)
    for r in rows:
        if "kernel_profile" in r:
            print_profile(r["name"], r["seconds"] / r["steps"], r["kernel_profile"])
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
