"""Benchmark the Triton SSD (Mamba-2) op against mamba-ssm's ``mamba_chunk_scan_combined`` (its Triton kernels).

Shapes: mamba2-1.3b and mamba2-2.7b layers (d_model 2048 / 2560, expand 2 -> 64 / 80 heads of headdim 64, d_state 128,
one group, chunk 256), seq 4096, batch 2 and 4, bf16 activations with fp32 A, D (per head) and dt_bias, dt_softplus:
as mamba-ssm's ``Mamba2`` calls the op, once without z (its default, the gate applied by the gated RMSNorm after the
op) and once with z (``rmsnorm=False``). Times are ``triton.testing.do_bench`` medians in ms: the forward without
autograd, and forward + backward (every input's gradient through ``torch.autograd.grad``); the ratio column is
mamba-ssm's time over ours (above 1: ours is faster). Writes bench/results/ssd_<device-slug>.json (or under --out).

    PYTHONPATH=src python3 -m bench.ssd [--out DIR] [--sweep] [--layers mamba2-1.3b] [--batches 2]

``--sweep`` also times tile variants (``SSDConfig`` fields) of our op at the 1.3b shape, the largest batch given;
``--sweep-scan`` first times the forward under variants of the forward output kernel's tiles and launch options.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from anytrain.kernels import ssd_triton
from anytrain.kernels.ssd import ssd_chunk_scan
from anytrain.kernels.ssd_triton import CONFIG, ssd_chunk_scan_triton
from bench.common import results_path, row_error, versions
from bench.mamba_ssm_loader import load_chunk_scan_combined, mamba_ssm_version

SEQLEN, HEADDIM, DSTATE, CHUNK = 4096, 64, 128, 256
LAYERS = {"mamba2-1.3b": 64, "mamba2-2.7b": 80}  # d_model 2048 / 2560, expand 2, headdim 64 -> heads
BATCHES = (2, 4)
SWEEP = [
    {"block_l": 128},
    {"block_s": 32},
    {"num_warps": 8},
    {"num_stages": 3},
    {"block_l": 128, "num_warps": 8},
    {"block_t": 32},
    {"heads_per_program": 4},
    {"heads_per_program": 16},
    {"block_n": 64},
    {"block_state": 1024},
    {"block_k": 32},
    {"block_k": 128},
    {"block_p": 32},
    {"block_l": 128, "block_s": 32},
    {"num_warps": 8, "num_stages": 3},
]


def layer_inputs(batch: int, nheads: int, gated: bool) -> dict:
    """A Mamba-2 layer's SSD arguments: bf16 x, dt, B, C (and z), fp32 A = -exp(log U[1, 16]), D (per head) and
    dt_bias from mamba-ssm's init (steps 0.001-0.1)."""
    dev, bf = "cuda", torch.bfloat16
    step = torch.exp(torch.rand(nheads, device=dev) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    args = {
        "x": torch.randn(batch, SEQLEN, nheads, HEADDIM, device=dev, dtype=bf),
        "dt": torch.randn(batch, SEQLEN, nheads, device=dev, dtype=bf),
        "A": -torch.empty(nheads, device=dev).uniform_(1, 16),
        "B": torch.randn(batch, SEQLEN, 1, DSTATE, device=dev, dtype=bf),
        "C": torch.randn(batch, SEQLEN, 1, DSTATE, device=dev, dtype=bf),
        "D": torch.randn(nheads, device=dev),
        "dt_bias": step + torch.log(-torch.expm1(-step)),
    }
    if gated:
        args["z"] = torch.randn(batch, SEQLEN, nheads, HEADDIM, device=dev, dtype=bf)
    return args


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def time_op(fn, args: dict) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of an op with ``mamba_chunk_scan_combined``'s signature."""
    xs = [args[k] for k in ("x", "dt", "A", "B", "C")]
    opt = {k: args.get(k) for k in ("D", "z", "dt_bias")}

    def forward():
        return fn(*xs, CHUNK, **opt, dt_softplus=True)

    with torch.no_grad():
        fwd = median_ms(forward)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in args.items()}
    lx = [leaves[k] for k in ("x", "dt", "A", "B", "C")]
    lopt = {k: leaves.get(k) for k in ("D", "z", "dt_bias")}
    grad = torch.randn(args["x"].shape, device="cuda", dtype=args["x"].dtype)
    inputs = list(leaves.values())

    def forward_backward():
        out = fn(*lx, CHUNK, **lopt, dt_softplus=True)
        return torch.autograd.grad(out, inputs, grad)

    return fwd, median_ms(forward_backward)


def max_rel_diff(fn, ref_fn, args: dict) -> float:
    """Largest relative difference (max |a - b| / max |b|) of the output and every gradient of two ops."""
    res = []
    for f in (fn, ref_fn):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in args.items()}
        xs = [leaves[k] for k in ("x", "dt", "A", "B", "C")]
        out = f(*xs, CHUNK, **{k: leaves.get(k) for k in ("D", "z", "dt_bias")}, dt_softplus=True)
        g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(out.dtype)
        res.append([out.detach(), *torch.autograd.grad(out, list(leaves.values()), g)])
    return max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        for a, b in zip(*res, strict=True)
    )


def bench_rows(mamba, layers=tuple(LAYERS), batches=BATCHES) -> list[dict]:
    rows = []
    for layer in layers:
        nheads = LAYERS[layer]
        for batch in batches:
            for gated in (False, True):
                row = {"layer": layer, "nheads": nheads, "batch": batch, "z": gated}
                torch.manual_seed(0)
                args = layer_inputs(batch, nheads, gated)
                try:
                    row["ours_fwd_ms"], row["ours_fwdbwd_ms"] = time_op(ssd_chunk_scan, args)
                except Exception as exc:
                    row["error"] = row_error(exc)
                if mamba is not None:
                    try:
                        row["mamba_ssm_fwd_ms"], row["mamba_ssm_fwdbwd_ms"] = time_op(mamba, args)
                        row["max_rel_diff"] = max_rel_diff(ssd_chunk_scan, mamba, args)
                    except Exception as exc:
                        row["mamba_ssm_error"] = row_error(exc)
                for kind in ("fwd", "fwdbwd"):
                    ours, theirs = row.get(f"ours_{kind}_ms"), row.get(f"mamba_ssm_{kind}_ms")
                    if ours and theirs:
                        row[f"speedup_{kind}"] = theirs / ours
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)  # a row survives a cut-off call
                del args
                torch.cuda.empty_cache()
    return rows


def sweep_rows(batch: int) -> list[dict]:
    """Our op at the 1.3b shape without z, at ``batch``, under the default tiles and each variant of ``SWEEP``."""
    args = layer_inputs(batch, LAYERS["mamba2-1.3b"], False)
    rows = []
    for change in [{}, *SWEEP]:
        cfg = replace(CONFIG, **change)

        def op(*a, cfg=cfg, **kw):
            return ssd_chunk_scan_triton(*a, **kw, config=cfg)

        row = {"change": change or "default", "config": asdict(cfg)}
        try:
            row["fwd_ms"], row["fwdbwd_ms"] = time_op(op, args)
        except Exception as exc:
            row["error"] = row_error(exc)
        rows.append(row)
        print(f"sweep {change or 'default'}: fwd {fmt(row.get('fwd_ms'))} ms, fwd+bwd {fmt(row.get('fwdbwd_ms'))} ms")
    return rows


SCAN_SWEEP = [
    {"block_l": bl, "block_s": bs, "scan_warps": w, "scan_stages": st}
    for bl in (32, 64)
    for bs in (32, 64)
    for w in (2, 4)
    for st in (2, 3, 4, 5)
]
"""``--sweep-scan``: tiles and launch options of the forward output kernel alone (the forward's largest kernel)."""


def scan_sweep_rows(batch: int) -> list[dict]:
    """Our forward at the 1.3b shape without z, at ``batch``, under each ``SCAN_SWEEP`` variant (only the chunk-scan
    kernel's launch changes), fastest first."""
    args = layer_inputs(batch, LAYERS["mamba2-1.3b"], False)
    xs = [args[k] for k in ("x", "dt", "A", "B", "C")]
    opt = {k: args.get(k) for k in ("D", "dt_bias")}
    rows = []
    for change in SCAN_SWEEP:
        cfg = replace(CONFIG, **change)
        row = {"change": change}
        try:
            with torch.no_grad():
                row["fwd_ms"] = median_ms(
                    lambda cfg=cfg: ssd_chunk_scan_triton(*xs, CHUNK, **opt, dt_softplus=True, config=cfg)
                )
        except Exception as exc:
            row["error"] = row_error(exc)
        rows.append(row)
        print(f"scan sweep {change}: fwd {fmt(row.get('fwd_ms'))} ms", flush=True)
    return sorted(rows, key=lambda r: r.get("fwd_ms", float("inf")))


def forward_profiles(mamba, batch: int) -> dict:
    """Kernel tables of one forward (no z, the 1.3b shape) of ours and of mamba-ssm's op: which kernel differs."""
    from anytrain.train.profiling import profile_call

    args = layer_inputs(batch, LAYERS["mamba2-1.3b"], False)
    xs = [args[k] for k in ("x", "dt", "A", "B", "C")]
    opt = {k: args.get(k) for k in ("D", "dt_bias")}
    out = {}
    for name, fn in (("ours", ssd_chunk_scan), ("mamba_ssm", mamba)):
        if fn is None:
            continue
        with torch.no_grad():
            for _ in range(3):  # compiled and autotuned before the profile
                fn(*xs, CHUNK, **opt, dt_softplus=True)
            out[name] = profile_call(lambda fn=fn: fn(*xs, CHUNK, **opt, dt_softplus=True), torch.device("cuda"))
        for k in out[name]["top"][:8]:
            print(f"  {name:<10}{k['ms']:>8.3f} ms x{k['calls']:<3} {k['kernel'][:90]}")
    if mamba is not None:  # the launch settings mamba-ssm's autotuner chose for its chunk-scan kernel at this shape
        try:
            from mamba_ssm.ops.triton.ssd_chunk_scan import _chunk_scan_fwd_kernel

            out["mamba_ssm_scan_config"] = str(_chunk_scan_fwd_kernel.best_config)
            print(f"  mamba_ssm chunk-scan config: {out['mamba_ssm_scan_config']}")
        except (ImportError, AttributeError) as exc:
            out["mamba_ssm_scan_config"] = f"unknown: {exc}"
    return out


def fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else "-"


def print_table(rows: list[dict], mamba_note: str | None) -> None:
    head = f"{'layer':<13}{'batch':>6}{'z':>4}{'ours fwd':>10}{'mamba fwd':>11}{'x':>7}"
    head += f"{'ours f+b':>10}{'mamba f+b':>11}{'x':>7}"
    print("\n" + head + "   (ms; x = mamba-ssm time / ours)")
    for r in rows:
        print(
            f"{r['layer']:<13}{r['batch']:>6}{'y' if r['z'] else 'n':>4}{fmt(r.get('ours_fwd_ms')):>10}"
            f"{fmt(r.get('mamba_ssm_fwd_ms')):>11}{fmt(r.get('speedup_fwd')):>7}{fmt(r.get('ours_fwdbwd_ms')):>10}"
            f"{fmt(r.get('mamba_ssm_fwdbwd_ms')):>11}{fmt(r.get('speedup_fwdbwd')):>7}"
        )
        for key in ("error", "mamba_ssm_error"):
            if key in r:
                print(f"  {key}: {r[key]}")
    if mamba_note:
        print(f"mamba-ssm rows: {mamba_note}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--sweep", action="store_true", help="also time tile variants of our op")
    ap.add_argument("--sweep-scan", action="store_true", help="time the forward output kernel's variants first")
    ap.add_argument(
        "--scan-best",
        action="store_true",
        help="--sweep-scan, then the table under the fastest variant where it beats the default by 2%%",
    )
    ap.add_argument("--profile", action="store_true", help="kernel tables of one forward of each op (on with --sweep)")
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS), help="layer shapes to time")
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="batch sizes to time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU visible: nothing to benchmark", file=sys.stderr)
        return 1
    mamba, note = load_chunk_scan_combined()
    scan = scan_sweep_rows(max(args.batches)) if args.sweep_scan or args.scan_best else []
    effective = {"block_l": CONFIG.block_l, "block_s": CONFIG.block_s}
    effective["scan_warps"] = CONFIG.scan_warps or CONFIG.num_warps
    effective["scan_stages"] = CONFIG.scan_stages or CONFIG.num_stages
    default = next((r for r in scan if r["change"] == effective), None)
    if args.scan_best and scan and default and "fwd_ms" in scan[0] and scan[0]["fwd_ms"] < 0.98 * default["fwd_ms"]:
        ssd_triton.CONFIG = replace(CONFIG, **scan[0]["change"])  # the op reads it at each call
        print(
            f"the table runs with {scan[0]['change']}: fwd {scan[0]['fwd_ms']:.3f} ms, default {default['fwd_ms']:.3f}"
        )
    rows = bench_rows(mamba, args.layers, args.batches)
    print_table(rows, note)
    env = versions(torch.device("cuda"))
    env["mamba_ssm"] = mamba_ssm_version() if mamba is not None else None
    record = {
        "device": env,
        "shape": {"seqlen": SEQLEN, "headdim": HEADDIM, "dstate": DSTATE, "ngroups": 1, "chunk": CHUNK},
        "dtype": "bfloat16",
        "config": asdict(ssd_triton.CONFIG),
        "mamba_ssm_note": note,
        "rows": rows,
        "sweep": sweep_rows(max(args.batches)) if args.sweep else [],
        "forward_profile": forward_profiles(mamba, max(args.batches)) if args.sweep or args.profile else {},
        "scan_sweep": scan,
    }
    path = results_path(args.out, "ssd", env)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"\nwrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
