"""Benchmark the Triton Mamba kernels on one GPU against their memory floor and eager baselines.

Shape (mamba-2.8b-like): batch 2, seqlen 4096, dim 5376, dstate 16; bf16 u/delta/z/B/C, fp32 A/D/delta_bias, with z, D,
delta_bias and delta_softplus. Times are ``triton.testing.do_bench`` medians over rotating input sets (each set is
several times the L2), in ms. The scan rows time the launchers (``_fwd`` / ``_bwd``); the ``scan_op`` rows time the
public op (forward without grad, backward through autograd) next to mamba-ssm's CUDA ``selective_scan_fn`` where
mamba-ssm is importable. Writes bench/results/mamba_kernels_<device-slug>.json (or under --out).

    PYTHONPATH=src python3 -m bench.mamba_kernels [--out DIR] [--sweep [--conv-configs F,F,... ...]]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from anytrain.kernels import selective_scan_triton as scan_mod
from anytrain.kernels.causal_conv1d_triton import ConvConfig
from anytrain.kernels.reference import selective_scan_ref
from anytrain.kernels.selective_scan_triton import ScanConfig

conv_mod = importlib.import_module("anytrain.kernels.causal_conv1d_triton")

BATCH, SEQLEN, DIM, DSTATE, WIDTH = 2, 4096, 5376, 16, 4
NSETS = 3
TARGETS_MS = {"scan_fwd": 0.5, "scan_bwd": 1.5, "conv_fwd": 0.06, "conv_bwd": 0.08}


def median_ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def gpu_ms(fns, calls: int = 60) -> float:
    """Device time of every kernel the calls launch (CUDA profiler), per call: the GPU time without the host's launch
    overhead, which do_bench adds whenever launching a call takes longer than running it (the conv's ~0.08 ms)."""
    from torch.profiler import ProfilerActivity, profile

    for f in fns:
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e3 / calls


def rotating(fns):
    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    return call


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda").random_(0, 255)  # 512 MiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def scan_inputs(dim: int = DIM, seqlen: int = SEQLEN):
    dev, bf = "cuda", torch.bfloat16
    u = torch.randn(BATCH, dim, seqlen, device=dev, dtype=bf)
    delta = (0.5 * torch.randn(BATCH, dim, seqlen, device=dev)).to(bf)
    z = torch.randn(BATCH, dim, seqlen, device=dev, dtype=bf)
    B = torch.randn(BATCH, DSTATE, seqlen, device=dev, dtype=bf)
    C = torch.randn(BATCH, DSTATE, seqlen, device=dev, dtype=bf)
    A = -torch.exp(torch.rand(dim, DSTATE, device=dev) * 2)
    D = torch.randn(dim, device=dev)
    bias = torch.rand(dim, device=dev) - 4.0
    return dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=bias)


def bench_scan(cfg: ScanConfig, sets, deterministic: bool = False) -> tuple[float, float]:
    """(fwd ms, bwd ms) of the launchers ``_fwd`` / ``_bwd`` (no autograd engine)."""
    fwds, bwds = [], []
    for s in sets:
        Bg, Cg = scan_mod._as_groups(s["B"]), scan_mod._as_groups(s["C"])
        args = (s["u"], s["delta"], s["A"], Bg, Cg, s["D"], s["z"], s["delta_bias"], True)
        _, states = scan_mod._fwd(*args, cfg)
        dout = torch.randn_like(s["u"])
        fwds.append(lambda args=args: scan_mod._fwd(*args, cfg))
        bwds.append(
            lambda a=args, st=states, g=dout: scan_mod._bwd(g, *a[:8], st, True, cfg, deterministic)  # noqa: B023
        )
    return median_ms(rotating(fwds)), median_ms(rotating(bwds))


def mamba_ssm_scan():
    """mamba-ssm's CUDA ``selective_scan_fn``, or None where it is not importable."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception:  # not installed, or built for another torch / CUDA
        return None
    return selective_scan_fn


def bench_scan_op(fn, sets) -> tuple[float, float]:
    """(fwd ms, bwd ms) of a ``selective_scan_fn``-signature op: the forward without grad, the backward through
    ``torch.autograd.grad`` of every input (what a model's step pays per call)."""
    fwds, bwds = [], []
    for s in sets:
        fwds.append(lambda s=s: fn(**s, delta_softplus=True))
        leaves = {k: v.detach().clone().requires_grad_() for k, v in s.items()}
        out = fn(**leaves, delta_softplus=True)
        g = torch.randn_like(out)
        inputs = list(leaves.values())
        bwds.append(lambda out=out, g=g, inputs=inputs: torch.autograd.grad(out, inputs, g, retain_graph=True))
    with torch.no_grad():
        f = median_ms(rotating(fwds))
    return f, median_ms(rotating(bwds))


def scan_op_max_rel_err(fn, ref_fn, s) -> float:
    """Largest relative error (max |x - ref| / max |ref|) of out and all gradients of ``fn`` against ``ref_fn``."""
    res = []
    for f in (fn, ref_fn):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in s.items()}
        out = f(**leaves, delta_softplus=True)
        g = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1))
        out.backward(g.to(out.dtype))
        res.append([out.detach()] + [leaves[k].grad for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")])
    return max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        for a, b in zip(*res, strict=True)
    )


def bench_conv_launch(cfg: ConvConfig, xs, gpu: bool = False) -> tuple[float, float]:
    """(fwd ms, bwd ms) of the kernel launchers alone (``_fwd`` / ``_bwd``, as the scan is timed): no autograd
    engine, so the GPU time whenever the launch is shorter than the kernel; ``gpu``: the kernels' device time
    (``gpu_ms``) instead."""
    fwds, bwds = [], []
    for x, w, b in xs:
        g = torch.randn_like(x)
        fwds.append(lambda x=x, w=w, b=b: conv_mod._fwd(x, w, b, True, cfg))
        bwds.append(lambda x=x, w=w, b=b, g=g: conv_mod._bwd(x, w, b, g, True, cfg))
    if gpu:
        return gpu_ms(fwds), gpu_ms(bwds)
    return median_ms(rotating(fwds)), median_ms(rotating(bwds))


def bench_conv(cfg: ConvConfig, xs) -> tuple[float, float]:
    """(fwd ms, bwd ms) through the public op and ``torch.autograd.grad`` (what a model's step pays per call)."""
    fwds, bwds = [], []
    with torch.no_grad():
        for x, w, b in xs:
            fwds.append(lambda x=x, w=w, b=b: conv_mod.causal_conv1d_triton(x, w, b, "silu", config=cfg))
    for x, w, b in xs:
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        out = conv_mod.causal_conv1d_triton(*leaves, "silu", config=cfg)
        g = torch.randn_like(out)
        bwds.append(lambda out=out, g=g, leaves=leaves: torch.autograd.grad(out, leaves, g, retain_graph=True))
    with torch.no_grad():
        f = median_ms(rotating(fwds))
    return f, median_ms(rotating(bwds))


def bench_torch_conv(xs) -> tuple[float, float]:
    def f(x, w, b):
        return F.silu(F.conv1d(x, w.unsqueeze(1), b, padding=WIDTH - 1, groups=x.shape[1])[..., : x.shape[-1]])

    fwds, bwds = [], []
    for x, w, b in xs:
        fwds.append(lambda x=x, w=w, b=b: f(x, w, b))
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        out = f(*leaves)
        g = torch.randn_like(out)
        bwds.append(lambda out=out, g=g, leaves=leaves: torch.autograd.grad(out, leaves, g, retain_graph=True))
    with torch.no_grad():
        fwd = median_ms(rotating(fwds))
    return fwd, median_ms(rotating(bwds))


def bench_eager_scan(seqlen: int) -> tuple[float, float]:
    """Eager sequential reference at reduced seqlen (launch-bound per step, so time scales ~linearly with seqlen)."""
    s = scan_inputs(seqlen=seqlen)
    leaves = {k: v.detach().clone().requires_grad_(k in ("u", "delta", "z", "B", "C")) for k, v in s.items()}
    out = selective_scan_ref(**leaves, delta_softplus=True)
    g = torch.randn_like(out)
    with torch.no_grad():
        fwd = median_ms(lambda: selective_scan_ref(**leaves, delta_softplus=True))
    grads = [v for v in leaves.values() if v.requires_grad]
    bwd = median_ms(lambda: torch.autograd.grad(out, grads, g, retain_graph=True))
    return fwd, bwd


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--sweep", action="store_true", help="also time alternative conv tile configs")
    ap.add_argument(
        "--conv-configs",
        nargs="+",
        default=None,
        metavar="FIELDS",
        help="with --sweep: time the default and these ConvConfigs (comma-separated fields) instead of the list",
    )
    args = ap.parse_args()
    conv_given = None
    if args.conv_configs:
        try:
            conv_given = [ConvConfig(*(int(v) for v in c.split(","))) for c in args.conv_configs]
        except (TypeError, ValueError) as e:
            ap.error(f"--conv-configs: {e} (comma-separated ConvConfig fields, e.g. 2,1024,4,1,1024,4,1024,0,8)")
    if not torch.cuda.is_available():
        print("no GPU visible: nothing to benchmark", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    elems = BATCH * DIM * SEQLEN
    bytes_ = {
        "scan_fwd": 2 * elems * 4 + 2 * 2 * BATCH * DSTATE * SEQLEN,  # read u, delta, z; write out; read B, C
        "scan_bwd": 2 * elems * 7 + 4 * 2 * BATCH * DSTATE * SEQLEN,  # read u, delta, z, dout; write du, ddelta, dz
        "conv_fwd": 2 * elems * 2,  # read x, write out
        "conv_bwd": 2 * elems * 3,  # read x, dout; write dx
    }
    floors = {k: v / bw * 1e3 for k, v in bytes_.items()}
    sets = [scan_inputs() for _ in range(NSETS)]
    xs = [
        (
            torch.randn(BATCH, DIM, SEQLEN, device="cuda", dtype=torch.bfloat16),
            torch.randn(DIM, WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5,
            torch.randn(DIM, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(NSETS)
    ]
    results: dict[str, dict] = {}
    sweep: list[dict] = []
    scan_cfg, conv_cfg = scan_mod.default_config(), conv_mod.default_config()
    if args.sweep:
        conv_variants = [
            ConvConfig(),  # runs of 4 in the backward
            ConvConfig(4, 256, 4, 4, 256, 4),
            ConvConfig(8, 256, 4, 8, 256, 4),
            ConvConfig(4, 512, 4, 4, 512, 4),
            ConvConfig(8, 512, 8, 8, 512, 8),
            ConvConfig(16, 256, 8, 16, 256, 8),
            ConvConfig(2, 1024, 4, 2, 1024, 4),
            ConvConfig(16, 128, 4, 16, 128, 4),
            ConvConfig(4, 1024, 8, 4, 1024, 8),
            # the default tiles with the backward's (batch, time block) loop software-pipelined: cp.async loads of
            # the next 1-2 iterations (offline Triton 3.6 sm_90: 30 / 45 cp.async, 10 / 20 KB shared, 63 / 64 regs)
            ConvConfig(2, 1024, 4, 1, 1024, 4, 1024, 2),
            ConvConfig(2, 1024, 4, 1, 1024, 4, 1024, 3),
            ConvConfig(2, 1024, 4, 2, 512, 4, 1024, 3),
            ConvConfig(2, 1024, 4, 1, 512, 4, 1024, 4),
            ConvConfig(2, 1024, 4, 1, 1024, 8, 1024, 3),
            ConvConfig(2, 1024, 4, 1, 2048, 8, 1024, 2),
            ConvConfig(2, 1024, 4, 1, 512, 2, 1024, 3),
            ConvConfig(2, 1024, 4, 1, 1024, 4, 2048, 3),
            ConvConfig(2, 1024, 4, 1, 1024, 4, 512, 3),
            # runs of 8 timesteps per thread in the backward (slots_bwd 8; offline Triton 3.6 sm_90: 417 instead of
            # 512 instructions per 8 outputs at the default tiles, 48 registers)
            ConvConfig(2, 1024, 4, 1, 1024, 4, 1024, 0, 8),
            ConvConfig(2, 1024, 4, 1, 2048, 4, 1024, 0, 8),
            ConvConfig(2, 1024, 4, 2, 1024, 4, 1024, 0, 8),
            ConvConfig(2, 1024, 4, 1, 1024, 2, 1024, 0, 8),
            ConvConfig(2, 1024, 4, 1, 512, 2, 1024, 0, 8),
            ConvConfig(2, 1024, 4, 1, 2048, 8, 1024, 0, 8),
            ConvConfig(2, 1024, 4, 1, 1024, 4, 2048, 0, 8),
            ConvConfig(2, 1024, 4, 2, 512, 2, 1024, 0, 8),
        ]
        if conv_given is not None:
            conv_variants = [conv_mod.default_config(), *conv_given]
        for cfg in conv_variants:
            try:
                f, b = bench_conv(cfg, xs)
                fl, bl = bench_conv_launch(cfg, xs)
                fg, bg = bench_conv_launch(cfg, xs, gpu=True)
            except Exception as e:
                print(f"conv {cfg}: failed {type(e).__name__}: {str(e)[:200]}")
                continue
            sweep.append(
                {
                    "op": "conv",
                    "config": vars(cfg),
                    "fwd_ms": f,
                    "bwd_ms": b,
                    "ms": f + b,
                    "fwd_launch_ms": fl,
                    "bwd_launch_ms": bl,
                    "fwd_gpu_ms": fg,
                    "bwd_gpu_ms": bg,
                }
            )
            print(
                f"conv {cfg}: fwd {f:.4f} ms bwd {b:.4f} ms; launchers alone fwd {fl:.4f} bwd {bl:.4f}; "
                f"GPU time fwd {fg:.4f} bwd {bg:.4f}",
                flush=True,
            )
    if sweep:  # use the fastest swept conv config
        convs = [r for r in sweep if r["op"] == "conv"]
        if convs:
            # by the kernels' GPU time (the launchers' host overhead is the same for every config)
            conv_cfg = ConvConfig(**min(convs, key=lambda r: r["fwd_gpu_ms"] + r["bwd_gpu_ms"])["config"])
        # timed below and recorded as "conv_config"; a new default goes into kernels/causal_conv1d_triton.py
        print(f"chosen: {conv_cfg}")
    f, b = bench_scan(scan_cfg, sets)
    _, bd = bench_scan(scan_cfg, sets, deterministic=True)
    ours_op = scan_mod.selective_scan_triton
    of, ob = bench_scan_op(ours_op, sets)
    results["scan_op_fwd"] = {"ms": of}
    results["scan_op_bwd"] = {"ms": ob}
    ssm = mamba_ssm_scan()
    if ssm is not None:
        mf, mb = bench_scan_op(ssm, sets)
        err = scan_op_max_rel_err(ours_op, ssm, sets[0])
        results["scan_op_fwd"].update(baseline="mamba-ssm selective_scan_fn", baseline_ms=mf)
        results["scan_op_bwd"].update(baseline="mamba-ssm selective_scan_fn", baseline_ms=mb, max_rel_err=err)
    cf, cb = bench_conv(conv_cfg, xs)
    cfl, cbl = bench_conv_launch(conv_cfg, xs)
    cfgm, cbgm = bench_conv_launch(conv_cfg, xs, gpu=True)
    tf, tb = bench_torch_conv(xs)
    red = 256
    ef, eb = bench_eager_scan(red)
    scale = SEQLEN / red
    results["scan_fwd"] = {"ms": f, "baseline": "eager reference (scaled)", "baseline_ms": ef * scale}
    results["scan_bwd"] = {"ms": b, "baseline": "eager reference (scaled)", "baseline_ms": eb * scale}
    results["scan_bwd_deterministic"] = {"ms": bd}
    results["conv_fwd"] = {"ms": cf, "baseline": "torch conv1d+silu", "baseline_ms": tf}
    results["conv_bwd"] = {"ms": cb, "baseline": "torch conv1d+silu", "baseline_ms": tb}
    for k, ms, gms in (("conv_fwd", cfl, cfgm), ("conv_bwd", cbl, cbgm)):  # the launcher alone, timed like the scan
        results[k]["launch_ms"] = ms
        results[k]["gpu_ms"] = gms  # the kernels' device time per call (profiler)
    for k in ("scan_fwd", "scan_bwd", "conv_fwd", "conv_bwd"):
        r = results[k]
        r.update(
            floor_ms=floors[k], bytes=bytes_[k], gb_per_s=bytes_[k] / (r["ms"] * 1e-3) / 1e9, target_ms=TARGETS_MS[k]
        )
    print(f"\n{name}: copy bandwidth {bw / 1e12:.2f} TB/s (read+write); eager scan timed at seqlen {red}, x{scale:.0f}")
    print(f"{'op':<10}{'ours ms':>10}{'target':>9}{'floor ms':>10}{'GB/s':>8}{'baseline ms':>13}  baseline")
    for k in ("scan_fwd", "scan_bwd", "conv_fwd", "conv_bwd"):
        r = results[k]
        print(
            f"{k:<10}{r['ms']:>10.4f}{r['target_ms']:>9.3f}{r['floor_ms']:>10.4f}{r['gb_per_s']:>8.0f}"
            f"{r['baseline_ms']:>13.3f}  {r['baseline']}"
        )
    print(f"scan_bwd deterministic: {bd:.4f} ms")
    for k in ("scan_op_fwd", "scan_op_bwd"):
        r = results[k]
        base = f"{r['baseline_ms']:.4f} ms {r['baseline']}" if "baseline" in r else "mamba-ssm not importable"
        print(f"{k} (public op, autograd): {r['ms']:.4f} ms; {base}")
    if "max_rel_err" in results["scan_op_bwd"]:
        print(f"largest relative difference to mamba-ssm (out, gradients): {results['scan_op_bwd']['max_rel_err']:.1e}")
    print(f"conv launchers alone (no autograd, as the scan rows): fwd {cfl:.4f} ms, bwd {cbl:.4f} ms")
    print(f"conv kernels' GPU time (profiler, per call): fwd {cfgm:.4f} ms, bwd {cbgm:.4f} ms")
    record = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"batch": BATCH, "seqlen": SEQLEN, "dim": DIM, "dstate": DSTATE, "width": WIDTH},
        "copy_bandwidth_tb_per_s": bw / 1e12,
        "eager_reference_seqlen": red,
        "scan_config": vars(scan_cfg),
        "conv_config": vars(conv_cfg),
        "results": results,
        "sweep": sweep,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"mamba_kernels_{slug(name)}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
