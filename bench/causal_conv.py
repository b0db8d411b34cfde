"""Causal depthwise conv1d through the public op: anytrain vs Dao-AILab causal-conv1d vs torch's depthwise conv1d.

Default shape (mamba-2.8b-like): batch 2, dim 5376, seqlen 4096, width 4, SiLU, bf16 x / weight / bias. Per
implementation, in ms (``triton.testing.do_bench`` medians over 3 rotating input sets; do_bench clears the L2 before
every call):

- ``fwd``: the op (``anytrain.kernels.causal_conv1d_triton``) under ``torch.no_grad``;
- ``bwd``: ``torch.autograd.grad`` of the retained graph of one forward (the backward alone);
- ``fwd+bwd``: a forward with autograd and ``torch.autograd.grad`` of it;
- ``kern warm`` / ``kern flushed``: the GPU time of the kernels one call launches (torch.profiler, summed kernel
  durations per call), without / after an L2 clear like do_bench's (its 256 MB memset subtracted), and ``kernels``:
  kernel launches per call;
- ``graph``: the no-grad forward replayed from a CUDA graph under do_bench: the GPU time of the do_bench row without
  any host work;
- ``host us``: the host (CPU) time of one call while the GPU is kept busy, i.e. the Python / launch overhead; do_bench
  shows it only where it exceeds the GPU time of the clear plus the call.

Dao-AILab's ``causal_conv1d.causal_conv1d_fn`` is timed when importable ("peer not installed" otherwise). Prints a
table; writes causal_conv_<device>.json (device, versions, shape, rows) under --out (default bench/results).

    PYTHONPATH=src python3 -m bench.causal_conv [--batch 2 --dim 5376 --seqlen 4096 --width 4] [--param-dtype fp32]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from anytrain.kernels import causal_conv1d_ref
from anytrain.kernels.ops import causal_conv1d as anytrain_conv  # the public op (dispatches to the Triton kernels)

NSETS = 3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def median_ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rotating(fns):
    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    return call


def kernel_time(fns, flush: bool, calls: int = 30) -> tuple[float, float]:
    """(ms, kernels) per call: the summed durations and the number of the GPU kernels the calls launch (profiler).
    ``flush``: each call after do_bench's L2 clear, whose own kernels (timed alone the same way) are subtracted."""
    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")

    def measure(fn_list, with_flush):
        for f in fn_list:
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                if with_flush:
                    cache.zero_()
                if fn_list:
                    fn_list[i % len(fn_list)]()
            torch.cuda.synchronize()
        ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sum(e.device_time for e in ks) / 1e3 / calls, len(ks) / calls

    ms, n = measure(fns, flush)
    if flush:
        ms0, n0 = measure([], True)
        ms, n = ms - ms0, n - n0
    return ms, n


def graph_ms(fn) -> float:
    """do_bench median of ``fn`` (one call) replayed from a CUDA graph, or nan if it cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return median_ms(g.replay)
    except Exception as exc:  # noqa: BLE001
        print(f"  graph capture failed: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
        return float("nan")


def host_us(fn, calls: int = 40) -> float:
    """Host time of one call (us) while the GPU is busy: every launch only queues, so nothing waits for the GPU."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU work ahead of the calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def torch_conv(x, w, b, activation):
    out = F.conv1d(x, w.unsqueeze(1), b, padding=w.shape[1] - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(out) if activation == "silu" else out


def implementations(activation: str | None) -> tuple[dict, dict]:
    """name -> op(x, w, b) and name -> version, skipping the peer when it is not importable."""
    impls = {"anytrain": lambda x, w, b: anytrain_conv(x, w, b, activation)}
    versions = {}
    try:
        import causal_conv1d as peer

        impls["causal-conv1d (Dao-AILab)"] = lambda x, w, b: peer.causal_conv1d_fn(x, w, b, activation=activation)
        versions["causal_conv1d"] = getattr(peer, "__version__", "unknown")
    except ImportError:
        print("peer not installed: causal_conv1d (Dao-AILab) is not importable, its rows are skipped")
        versions["causal_conv1d"] = None
    impls["torch conv1d (depthwise)"] = lambda x, w, b: torch_conv(x, w, b, activation)
    return impls, versions


def rel_errors(op, x, w, b, activation) -> dict:
    """Relative error (norm) of out, dx, dweight, dbias against the fp32 reference on the same inputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    out = op(*leaves)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(7)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    ref = causal_conv1d_ref(*ref_leaves, activation=activation)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.float())
    pairs = zip(("out", "dx", "dweight", "dbias"), (out, *grads), (ref, *ref_grads), strict=True)
    return {
        n: float((a.detach().float() - r.detach()).norm() / r.detach().norm().clamp_min(1e-30)) for n, a, r in pairs
    }


def bench_impl(op, sets, activation) -> dict:
    with torch.no_grad():
        fwds = [lambda x=x, w=w, b=b: op(x, w, b) for x, w, b in sets]
    bwds, fwd_bwds = [], []
    for x, w, b in sets:
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        out = op(*leaves)
        g = torch.randn_like(out)
        bwds.append(lambda out=out, g=g, leaves=leaves: torch.autograd.grad(out, leaves, g, retain_graph=True))
        fwd_bwds.append(lambda g=g, leaves=leaves: torch.autograd.grad(op(*leaves), leaves, g))
    row = {"rel_err": rel_errors(op, *sets[0], activation)}
    with torch.no_grad():
        row["fwd_ms"] = median_ms(rotating(fwds))
        row["fwd_kernel_warm_ms"], _ = kernel_time(fwds, flush=False)
        row["fwd_kernel_flushed_ms"], row["fwd_kernels"] = kernel_time(fwds, flush=True)
        row["fwd_graph_ms"] = graph_ms(fwds[0])
        row["fwd_host_us"] = host_us(rotating(fwds))
    row["bwd_ms"] = median_ms(rotating(bwds))
    row["bwd_kernel_warm_ms"], _ = kernel_time(bwds, flush=False)
    row["bwd_kernel_flushed_ms"], row["bwd_kernels"] = kernel_time(bwds, flush=True)
    row["bwd_host_us"] = host_us(rotating(bwds))
    row["fwd_bwd_ms"] = median_ms(rotating(fwd_bwds))
    row["fwd_bwd_host_us"] = host_us(rotating(fwd_bwds))
    return row


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dim", type=int, default=5376)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--width", type=int, default=4, choices=(2, 3, 4))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="x (and dout)")
    ap.add_argument("--param-dtype", default="bf16", choices=sorted(DTYPES), help="weight and bias")
    ap.add_argument("--activation", default="silu", choices=("silu", "none"))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU visible: nothing to benchmark", file=sys.stderr)
        return 1
    activation = None if args.activation == "none" else "silu"
    dtype, pdtype = DTYPES[args.dtype], DTYPES[args.param_dtype]
    torch.manual_seed(0)
    sets = [
        (
            torch.randn(args.batch, args.dim, args.seqlen, device="cuda").to(dtype),
            (0.5 * torch.randn(args.dim, args.width, device="cuda")).to(pdtype),
            torch.randn(args.dim, device="cuda").to(pdtype),
        )
        for _ in range(NSETS)
    ]
    impls, versions = implementations(activation)
    rows = {}
    for name, op in impls.items():
        try:
            rows[name] = bench_impl(op, sets, activation)
        except Exception as exc:  # noqa: BLE001  (one failing implementation must not lose the others)
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    device = torch.cuda.get_device_name()
    shape = f"({args.batch}, {args.dim}, {args.seqlen}) width {args.width} {args.activation} {args.dtype}"
    print(f"\n{device}, {shape}, params {args.param_dtype}; ms unless noted")
    cols = [
        ("fwd", "fwd_ms"),
        ("kern warm", "fwd_kernel_warm_ms"),
        ("kern flushed", "fwd_kernel_flushed_ms"),
        ("graph", "fwd_graph_ms"),
        ("kernels", "fwd_kernels"),
        ("host us", "fwd_host_us"),
        ("bwd", "bwd_ms"),
        ("kern warm", "bwd_kernel_warm_ms"),
        ("kern flushed", "bwd_kernel_flushed_ms"),
        ("kernels", "bwd_kernels"),
        ("host us", "bwd_host_us"),
        ("fwd+bwd", "fwd_bwd_ms"),
        ("host us", "fwd_bwd_host_us"),
    ]
    print(f"{'':<27}" + "".join(f"{c:>13}" for c, _ in cols))
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<27}{r['error']}")
            continue
        print(f"{name:<27}" + "".join(f"{r[k]:>13.4f}" if "ms" in k else f"{r[k]:>13.1f}" for _, k in cols))
    try:
        config = vars(importlib.import_module("anytrain.kernels.causal_conv1d_triton").default_config())
    except Exception:  # noqa: BLE001  (metadata only)
        config = None
    record = {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        **versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"batch": args.batch, "dim": args.dim, "seqlen": args.seqlen, "width": args.width},
        "dtype": args.dtype,
        "param_dtype": args.param_dtype,
        "activation": args.activation,
        "anytrain_conv_config": config,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"causal_conv_{slug(device)}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
