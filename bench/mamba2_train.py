"""Mamba-2 training throughput on one GPU: anytrain's mamba2-1.3b recipe vs mamba-ssm's ``MambaLMHeadModel`` with the
same Mamba-2 config, beside anytrain's Mamba-1 1.4b, 1.1B Transformer and 1.2B hybrid recipes at about equal
parameters.

Every row runs in a fresh subprocess of this script with its own empty inductor cache (``bench.common.
run_row_in_child``; ``--in-process`` runs them here instead), on identical random-token batches (a bank of 4 global
batches drawn once from a seeded generator and cycled), seq 2048 and global batch 32 for every row (the 1.4b and 1.1B
recipes' own; the Mamba-2 and hybrid recipes' 256 cut to 32 so that a step is 4 micro-batches of 8 and a row fits a
short GPU lease), each recipe at its own micro-batch. A step is one optimizer step (all micro-batches); ``--warmup``
untimed steps (compilation and Triton autotuning happen there), then ``--steps`` timed steps, each between two CUDA
events (``bench.mamba_train.measure``). Peak memory is the caching allocator's max allocated bytes over the timed
steps.

The anytrain rows are their recipe (``configs/<recipe>``: compile, compile scope, activation checkpointing, dtype,
model args as configured) with only ``train.global_batch`` changed, run by the product's ``Trainer.train_step`` on a
Trainer whose data source yields the random batches. ``mamba2-1.3b-noac`` is the Mamba-2 recipe without activation
checkpointing (mamba-ssm has none).

The ``mamba-ssm-1.3b`` row builds ``MambaLMHeadModel`` from a ``MambaConfig`` of the recipe's model (``ssm_cfg``
layer Mamba2, d_state 128, headdim 64, expand 2, conv 4, chunk 256, ngroups 1; the same padded vocabulary, tied
embeddings, ``rms_norm``, ``fused_add_norm`` and ``residual_in_fp32`` as mamba-ssm's released Mamba-2 configs), fp32
weights, bf16 autocast, ``F.cross_entropy`` over its full logits, fused AdamW (β 0.9/0.95, weight decay 0.1), clipping
1.0, eager, same micro-batch, global batch and seq. It is loaded through ``bench/mamba_ssm_loader.py`` (mamba-ssm
installed without its CUDA build). Without causal-conv1d its Mamba2 cannot take the fused split-conv path
(``mamba_split_conv1d_scan_combined`` calls causal-conv1d's CUDA functions), so the row sets
``use_mem_eff_path=False``: in_proj, ``nn.Conv1d`` (padding K-1, sliced) + SiLU, the Triton
``mamba_chunk_scan_combined``, the Triton gated RMSNorm, out_proj; with causal-conv1d installed it keeps mamba-ssm's
default fused path. The row says which in ``peer_path``.

MFU = the row model's ``flops_per_token`` × tokens/s / the device's dense bf16 peak; the mamba-ssm row uses anytrain's
``Mamba2.flops_per_token`` of the same config (the same formula as the mamba2 rows). ``vs_mamba_ssm``: tokens/s over
the mamba-ssm row's; ``mem_vs_mamba_ssm``: peak memory over its peak.

    PYTHONPATH=src python3 -m bench.mamba2_train --out bench/results                    # all rows (GPU)
    PYTHONPATH=src python3 -m bench.mamba2_train --rows mamba2-1.3b mamba-ssm-1.3b       # the side by side
    PYTHONPATH=src python3 -m bench.mamba2_train --smoke --in-process                    # CPU: debug flavours, ours
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from anytrain import hardware
from anytrain.config import RunConfig, load_config
from anytrain.models import build_model, resolve_args
from anytrain.train.profiling import profile_call
from bench.common import (
    ROOT,
    RandomBatches,
    bench_device,
    print_profile,
    print_row,
    release,
    results_path,
    row_error,
    run_row_in_child,
    versions,
)
from bench.mamba_ssm_loader import load_lm_head_model, mamba_ssm_version
from bench.mamba_train import measure

GLOBAL_BATCH = 32  # every row: seq 2048 x 32 sequences = 65,536 tokens per optimizer step
SMOKE = ("--model.flavour", "debug", "--data.seq_len", "32", "--train.global_batch", "2", "--train.micro_batch", "2")
SMOKE += ("--train.compile", "false", "--train.dtype", "fp32")  # CPU: no compile, fp32; the recipe's checkpointing


@dataclass
class Row:
    name: str  # the --rows key
    stack: str  # "anytrain" (its Trainer on the recipe) | "mamba-ssm" (MambaLMHeadModel of the recipe's model)
    recipe: str  # configs/<recipe>
    label: str
    overrides: tuple[str, ...] = ()  # config overrides beyond the global batch, e.g. ("--train.X", "value")
    estimate_s: float = 80.0  # rough wall time of the row on an H200 (start-up, build, compile, 1 + 5 steps)


ROWS = [
    # in priority order: a time budget drops the tail
    Row("mamba2-1.3b", "anytrain", "mamba2-1.3b.yaml", "anytrain Mamba-2 recipe", estimate_s=80),
    Row(
        "mamba-ssm-1.3b", "mamba-ssm", "mamba2-1.3b.yaml", "mamba-ssm MambaLMHeadModel (Mamba2), eager", estimate_s=240
    ),
    Row("hybrid-1.2b", "anytrain", "hybrid-1.2b.yaml", "anytrain hybrid recipe (Bamba layout)", estimate_s=80),
    Row("mamba-1.4b", "anytrain", "mamba-1.4b.yaml", "anytrain Mamba-1 recipe", estimate_s=75),
    Row("1.1b", "anytrain", "1.1b.yaml", "anytrain Transformer recipe", estimate_s=55),
    Row(
        "mamba2-1.3b-noac",
        "anytrain",
        "mamba2-1.3b.yaml",
        "Mamba-2 recipe, no activation checkpointing",
        ("--train.activation_checkpointing", "none"),
        estimate_s=75,
    ),
]
BY_NAME = {r.name: r for r in ROWS}


def row_config(row: Row, smoke: bool) -> RunConfig:
    """The row's recipe with the bench's global batch (and, for a smoke run, the debug flavour on the CPU)."""
    overrides = ["--train.global_batch", str(GLOBAL_BATCH), *row.overrides, *(SMOKE if smoke else ())]
    return load_config(ROOT / "configs" / row.recipe, overrides)


def settings(cfg: RunConfig) -> dict:
    t = cfg.train
    return {
        "arch": cfg.model.arch,
        "flavour": cfg.model.flavour,
        "model_args": dict(cfg.model.args),
        "seq": cfg.data.seq_len,
        "micro": t.micro_batch,
        "global_batch": t.global_batch,
        "dtype": t.dtype,
        "compile": t.compile,
        "compile_scope": t.compile_scope,
        "activation_checkpointing": t.activation_checkpointing,
        "cuda_graphs": t.cuda_graphs,
    }


def anytrain_step_fn(cfg: RunConfig, batches: RandomBatches) -> tuple:
    """A Trainer without data files or a run dir: the product's build and train_step on random batches."""
    from anytrain.train.trainer import Trainer

    trainer = Trainer(cfg, batches=batches)  # no run directory: nothing is written
    model = trainer.raw_model
    info = {
        "driver": "Trainer.train_step",
        "params": model.num_params(),
        "flops_per_token": model.flops_per_token(cfg.data.seq_len),
    }
    return trainer.train_step, info, trainer


def peer_config(args, config_cls):
    """mamba-ssm's MambaConfig of anytrain's Mamba2Args (its released Mamba-2 configs' norm and residual settings)."""
    mamba2 = sys.modules["mamba_ssm.modules.mamba2"]
    ssd = sys.modules["mamba_ssm.ops.triton.ssd_combined"]
    # the fused split-conv path needs causal-conv1d's CUDA functions; without them the unfused path, nn.Conv1d
    fused = ssd.causal_conv1d_fwd_function is not None
    ssm_cfg = {
        "layer": "Mamba2",
        "d_state": args.d_state,
        "d_conv": args.d_conv,
        "expand": args.expand,
        "headdim": args.headdim,
        "ngroups": args.ngroups,
        "chunk_size": args.chunk_size,
        "use_mem_eff_path": fused,
    }
    config = config_cls(
        d_model=args.d_model,
        d_intermediate=0,
        n_layer=args.n_layers,
        vocab_size=args.vocab_size,
        ssm_cfg=ssm_cfg,
        rms_norm=True,
        residual_in_fp32=args.residual_in_fp32,
        fused_add_norm=True,
        pad_vocab_size_multiple=16,  # anytrain's vocabulary is already padded to 16: kept as is
        tie_embeddings=args.tie_embeddings,
    )
    if fused:
        path = "use_mem_eff_path=True: mamba_split_conv1d_scan_combined (causal-conv1d + Triton SSD + fused out_proj)"
    else:
        conv = "causal_conv1d_fn" if mamba2.causal_conv1d_fn is not None else "nn.Conv1d (padding K-1, sliced) + SiLU"
        path = f"use_mem_eff_path=False: in_proj, {conv}, mamba_chunk_scan_combined (Triton), RMSNormGated (Triton)"
    info = {
        "peer_path": path,
        "peer_ssm_cfg": ssm_cfg,
        "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
        "peer_loss": "F.cross_entropy over the full logits (fp32 under autocast)",
    }
    return config, info


def mamba_ssm_step_fn(cfg: RunConfig, batches: RandomBatches, device: torch.device) -> tuple:
    """mamba-ssm's MambaLMHeadModel of the recipe's Mamba-2 model: fp32 weights, bf16 autocast, fused AdamW, clip."""
    model_cls, why = load_lm_head_model()
    if model_cls is None:
        raise RuntimeError(why)
    from mamba_ssm.models.config_mamba import MambaConfig

    args = resolve_args(cfg.model)
    config, info = peer_config(args, MambaConfig)
    torch.manual_seed(0)
    model = model_cls(config, device=device).train()
    info["peer_params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with torch.device("meta"):
        ours = build_model(cfg.model)  # the FLOPs formula of the mamba2 rows, and their parameter count
    info.update(params=ours.num_params(), flops_per_token=ours.flops_per_token(cfg.data.seq_len), driver="mamba-ssm")
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    micro = t.micro_batch
    accum = t.global_batch // micro

    def step(i: int) -> None:
        inputs, targets, _ = batches.rank_batch(i)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        for k in range(accum):
            sl = slice(k * micro, (k + 1) * micro)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(inputs[sl]).logits  # (b, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1), targets[sl].flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"), foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, info, (model, optimizer)


def run_row(name: str, args: argparse.Namespace) -> dict:
    """One row in this process; errors are recorded in the row."""
    row_def = BY_NAME[name]
    device = bench_device(args.smoke)
    release(device)
    out = {"row": name, "stack": row_def.stack, "recipe": f"configs/{row_def.recipe}", "label": row_def.label}
    holder = None
    try:
        cfg = row_config(row_def, args.smoke)
        out.update(settings(cfg))
        out["tokens_per_step"] = cfg.train.global_batch * cfg.data.seq_len
        vocab = resolve_args(cfg.model).vocab_size
        batches = RandomBatches(vocab, cfg.train.global_batch, cfg.data.seq_len)
        if row_def.stack == "mamba-ssm":
            if not hardware.is_gpu(device):
                raise RuntimeError("mamba-ssm's kernels are Triton GPU kernels: this row needs a GPU")
            step, info, holder = mamba_ssm_step_fn(cfg, batches, device)
        else:
            step, info, holder = anytrain_step_fn(cfg, batches)
        out.update(info)
        out.update(measure(step, device, args.warmup, args.steps))
        out["tokens_per_s"] = args.steps * out["tokens_per_step"] / out["seconds"]
        peak = hardware.peak_flops(device)
        out["mfu"] = out["flops_per_token"] * out["tokens_per_s"] / peak if peak else None
        if name in (args.profile or []):  # one more step under torch.profiler: kernels on a GPU, operators on CPU
            out["kernel_profile"] = profile_call(lambda: step(args.warmup + args.steps), device)
    except Exception as exc:  # noqa: BLE001 - one failing row must not lose the others
        out["error"] = row_error(exc)
    finally:
        del holder
    return out


def run_child(name: str, args: argparse.Namespace) -> dict:
    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup), *(["--smoke"] * args.smoke)]
    if name in (args.profile or []):
        argv += ["--profile", name]
    row = run_row_in_child("bench.mamba2_train", argv, name)
    return {"stack": BY_NAME[name].stack, "label": BY_NAME[name].label, **row}


def finish_rows(rows: list[dict]) -> None:
    """Each row's tokens/s and peak memory against the mamba-ssm row's."""
    peer = next((r for r in rows if r.get("stack") == "mamba-ssm" and "tokens_per_s" in r), None)
    for r in rows:
        ok = peer is not None and "tokens_per_s" in r
        r["vs_mamba_ssm"] = r["tokens_per_s"] / peer["tokens_per_s"] if ok else None
        r["mem_vs_mamba_ssm"] = r["peak_mem_gib"] / peer["peak_mem_gib"] if ok and peer["peak_mem_gib"] else None


def print_table(rows: list[dict]) -> None:
    head = f"{'row':<18}{'what':<44}{'params':>8}{'mb':>4}{'gb':>4}{'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}"
    head += f"{'vs mamba-ssm':>14}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['row']:<18}{r.get('label', '')[:43]:<44}  {r.get('error') or r.get('skipped', '')}"[:220])
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        ratio = "" if r["vs_mamba_ssm"] is None else f"{r['vs_mamba_ssm']:.2f}x / {r['mem_vs_mamba_ssm']:.2f}x"
        print(
            f"{r['row']:<18}{r['label'][:43]:<44}{r['params'] / 1e9:>7.2f}B{r['micro']:>4}{r['global_batch']:>4}"
            f"{r['tokens_per_s']:>11,.0f}{mfu:>7}{r['peak_mem_gib']:>10.1f}{ratio:>14}"
        )
    peer = next((r for r in rows if r.get("stack") == "mamba-ssm" and "peer_path" in r), None)
    if peer is not None:
        print(f"mamba-ssm path: {peer['peer_path']}  (vs mamba-ssm: tokens/s ratio / peak-memory ratio)")


def write_rows(path, env: dict, args: argparse.Namespace, rows: list[dict]) -> None:
    settings = {
        "steps": args.steps,
        "warmup": args.warmup,
        "global_batch": GLOBAL_BATCH,
        "dtype": "bf16 autocast over fp32 weights (fp32 on CPU)",
        "optimizer": "AdamW fused",
        "env": {k: v for k, v in os.environ.items() if k.startswith(("ANYTRAIN", "TORCH"))},
    }
    payload = {"date": time.strftime("%Y-%m-%d"), "device": env["device"], "versions": env, "settings": settings}
    path.write_text(json.dumps({**payload, "rows": rows}, indent=1, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="directory for mamba2_train_<device>.json")
    parser.add_argument("--rows", nargs="*", default=None, choices=list(BY_NAME), help="rows to run (default: all)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile, autotuning)")
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip rows that would end past this (0 = none)")
    parser.add_argument("--smoke", action="store_true", help="CPU check: debug flavours, anytrain rows, 1 + 1 steps")
    parser.add_argument("--profile", nargs="*", default=None, help="rows to profile one extra step of")
    parser.add_argument("--in-process", action="store_true", help="run every row in this process (no subprocess)")
    parser.add_argument("--one-row", default=None, help=argparse.SUPPRESS)  # a child: run this row, print it
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = 1, 1
    if args.one_row:
        print_row(run_row(args.one_row, args))
        return 0
    names = args.rows or [r.name for r in ROWS if not (args.smoke and r.stack == "mamba-ssm")]
    device = bench_device(args.smoke)
    env = versions(device)
    env["mamba_ssm"] = mamba_ssm_version()
    out_path = results_path(args.out, "mamba2_train", env, args.smoke)
    print(json.dumps(env), flush=True)
    started, rows = time.perf_counter(), []
    for name in names:
        elapsed = time.perf_counter() - started
        if args.budget_s and elapsed + BY_NAME[name].estimate_s > args.budget_s:
            rows.append({"row": name, "label": BY_NAME[name].label, "skipped": f"time budget ({elapsed:.0f} s used)"})
        else:
            t0 = time.perf_counter()
            rows.append(run_row(name, args) if args.in_process else run_child(name, args))
            rows[-1]["row_wall_s"] = time.perf_counter() - t0
        shown = {k: v for k, v in rows[-1].items() if k not in ("step_s", "kernel_profile")}
        print(json.dumps(shown, default=str), flush=True)
        finish_rows(rows)
        write_rows(out_path, env, args, rows)  # after every row: a cut-off call keeps the rows that ended
    print_table(rows)
    for r in rows:
        if "kernel_profile" in r:
            print_profile(r["row"], r["seconds"] / args.steps, r["kernel_profile"])
    print(f"\nwrote {out_path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
