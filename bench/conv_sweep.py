"""Sweep the Triton causal conv1d tiles at the kernel bench shape (batch 2, dim 5376, seqlen 4096, width 4, SiLU, bf16).

Times as bench/mamba_kernels.py does (``do_bench`` medians over 3 rotating input sets; the backward through
``torch.autograd.grad``, so Python/launch overhead counts), plus the forward replayed from a CUDA graph (GPU time
alone) and the profiler's summed kernel time of the backward. Every config is first checked against the float64
reference. Prints a table; writes mamba_train_<device>_conv_sweep.json under $OUT (default bench/results) and, when
$OUT is set, best_conv.txt there (ANYTRAIN_CONV_CONFIG of the best by do_bench).

    PYTHONPATH=src python3 bench/conv_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from anytrain.kernels.causal_conv1d import ConvConfig
from anytrain.kernels.reference import causal_conv1d_ref

sys.path.insert(0, str(Path(__file__).parent))
from mamba_kernels import median_ms, rotating  # noqa: E402  (the same timing as the kernel bench)

conv_mod = importlib.import_module("anytrain.kernels.causal_conv1d")
BATCH, DIM, SEQLEN, WIDTH = 2, 5376, 4096, 4


def graph_ms(fn, iters: int = 20) -> float:
    """Median time of fn replayed from a CUDA graph (no CPU overhead), or nan if it cannot be captured. Forward
    only: a failed capture (autograd.grad in a graph did fail) leaves the CUDA RNG unusable for later configs."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        return float(do_bench(g.replay, warmup=10, rep=100, return_mode="median")) / iters
    except Exception as exc:  # noqa: BLE001
        print(f"  graph capture failed: {type(exc).__name__}: {str(exc)[:120]}")
        return float("nan")


def check(fn_apply, cfg) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(BATCH, DIM, SEQLEN, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(DIM, WIDTH, device="cuda", generator=g) * 0.5
    b = torch.randn(DIM, device="cuda", generator=g) * 0.1
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out = fn_apply(*leaves, cfg)
    gout = torch.randn(out.shape, device="cuda", generator=g).to(torch.bfloat16)
    grads = torch.autograd.grad(out, leaves, gout)
    ref_leaves = [t.double().requires_grad_() for t in (x, w, b)]
    ref = causal_conv1d_ref(*ref_leaves, activation="silu")
    ref_grads = torch.autograd.grad(ref, ref_leaves, gout.double())
    rel = lambda a, r: float((a.detach().double() - r.detach()).norm() / r.detach().norm())  # noqa: E731
    names = ("dx", "dw", "db")
    return {"out": rel(out, ref), **{n: rel(a, r) for n, a, r in zip(names, grads, ref_grads, strict=True)}}


def kernel_ms(fn, calls: int = 10) -> float:
    """Summed device-kernel time of one call (torch.profiler): the GPU work without launch gaps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
    return us / 1e3 / calls


def bench(fn_apply, cfg, sets) -> tuple[float, float, float, float]:
    with torch.no_grad():
        fwds = [lambda x=x, w=w, b=b: fn_apply(x, w, b, cfg) for x, w, b in sets]
    bwds = []
    for x, w, b in sets:
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        out = fn_apply(*leaves, cfg)
        g = torch.randn_like(out)
        bwds.append(lambda out=out, g=g, leaves=leaves: torch.autograd.grad(out, leaves, g, retain_graph=True))
    with torch.no_grad():
        f = median_ms(rotating(fwds))
        fg = graph_ms(fwds[0])
    return f, median_ms(rotating(bwds)), fg, kernel_ms(bwds[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    new_apply = lambda x, w, b, cfg: conv_mod.causal_conv1d_triton(x, w, b, "silu", config=cfg)  # noqa: E731
    variants = []
    sys.path.insert(0, str(Path(__file__).parent))
    try:  # optional: a copy of an earlier kernel module as bench/_conv_v2_old.py, timed first for comparison
        old = importlib.import_module("_conv_v2_old")
        old_apply = lambda x, w, b, cfg: old.causal_conv1d_triton(x, w, b, "silu", config=cfg)  # noqa: E731
        variants.append(("v2 (before)", old_apply, old.ConvConfig()))
    except ImportError:
        pass
    sets = [(torch.randn(BATCH, DIM, SEQLEN, device="cuda", dtype=torch.bfloat16),
             torch.randn(DIM, WIDTH, device="cuda") * 0.5, torch.randn(DIM, device="cuda") * 0.1)
            for _ in range(3)]  # fmt: skip
    fwd = [(4, 256, 4), (2, 512, 4), (4, 512, 4), (2, 1024, 4), (4, 256, 2), (8, 256, 4)]
    bwd = [(4, 256, 4, 1024), (2, 512, 4, 1024), (2, 1024, 4, 1024), (4, 512, 4, 1024), (8, 256, 4, 1024),
           (4, 256, 4, 4096), (2, 512, 4, 4096), (1, 1024, 4, 1024)]  # fmt: skip
    if args.quick:
        fwd, bwd = fwd[:2], bwd[:2]
    for i in range(max(len(fwd), len(bwd))):
        f, b = fwd[min(i, len(fwd) - 1)], bwd[min(i, len(bwd) - 1)]
        variants.append((f"v3 {f} / {b}", new_apply, ConvConfig(*f, *b)))
    rows = []
    for name, fn, cfg in variants:
        try:
            err = check(fn, cfg)
            f, b, fg, bg = bench(fn, cfg, sets)
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        rows.append({"name": name, "config": vars(cfg), "fwd_ms": f, "bwd_ms": b, "fwd_graph_ms": fg,
                     "bwd_kernel_ms": bg, "rel_err": err})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'variant':<46}{'fwd ms':>9}{'bwd ms':>9}{'fwd graph':>11}{'bwd kern':>11}{'max rel err':>13}")
    for r in rows:
        print(f"{r['name']:<46}{r['fwd_ms']:>9.4f}{r['bwd_ms']:>9.4f}{r['fwd_graph_ms']:>11.4f}"
              f"{r['bwd_kernel_ms']:>11.4f}{max(r['rel_err'].values()):>13.2e}")  # fmt: skip
    new = [r for r in rows if r["name"].startswith("v3") and max(r["rel_err"].values()) < 1e-2]
    if new:  # the fastest forward and backward tiles, as ANYTRAIN_CONV_CONFIG for a following run
        bf, bb = min(new, key=lambda r: r["fwd_ms"])["config"], min(new, key=lambda r: r["bwd_ms"])["config"]
        keys_f, keys_b = ("block_d", "block_t", "num_warps"), ("block_d_bwd", "block_t_bwd", "num_warps_bwd",
                                                              "min_programs_bwd")  # fmt: skip
        best = ",".join(str(bf[k]) for k in keys_f) + "," + ",".join(str(bb[k]) for k in keys_b)
        print(f"best: ANYTRAIN_CONV_CONFIG={best}")
        if os.environ.get("OUT"):  # for a following command of the same device run
            Path(os.environ["OUT"], "best_conv.txt").write_text(best)
    out = Path(os.environ.get("OUT", "bench/results"))
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": importlib.import_module("triton").__version__, "rows": rows}  # fmt: skip
    (out / f"mamba_train_{slug}_conv_sweep.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
