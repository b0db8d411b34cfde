"""Probe the Triton scan / conv kernels at the benchmark shape: one launch of each for a profiler, and timings
against the channel count (how the time depends on the number of program waves).

    PYTHONPATH=src python3 bench/scan_probe.py once          # 2 warm-up calls, then one call of each kernel
    ncu --clock-control none --kernel-name regex:'_ss_|_conv_' --launch-skip 9 --launch-count 4 \
        python3 bench/scan_probe.py once                      # what bench/device/scan_ncu.sh runs
    PYTHONPATH=src python3 bench/scan_probe.py waves [--dims 4752,5376,6336]
    PYTHONPATH=src python3 bench/scan_probe.py mixer --configs FIELDS FIELDS ...   # backward at the 1.4b step's layout
    PYTHONPATH=src python3 bench/scan_probe.py kernels      # each kernel of the default launchers, GPU time per call

``mixer`` times the backward (``--fwd``: the forward) of each given ScanConfig (comma-separated fields) on the fused
mixer's layout at a training shape (default: mamba-1.4b at micro-batch 16, seqlen 2048): u, delta, z as (batch, dim,
seqlen) views of (dim, batch * seqlen) matrices and B, C as row blocks of x_dbl, as ``kernels/mamba_inner.py`` passes
them. The configs are timed in turn, several rounds, so a drift of the machine shows up as a spread, not as a
difference.

``waves`` prints, per dim, the forward and backward launch times (``do_bench`` medians) and the number of program
waves each kernel needs at the occupancy its registers allow (given by ``--regs``), so a time that steps
with whole waves shows up as a constant time per wave.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mamba_kernels import BATCH, DSTATE, SEQLEN, WIDTH, median_ms, scan_inputs  # noqa: E402

scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
conv_mod = importlib.import_module("anytrain.kernels.causal_conv1d")


def _scan_calls(s, cfg):
    Bg, Cg = scan_mod._as_groups(s["B"]), scan_mod._as_groups(s["C"])
    args = (s["u"], s["delta"], s["A"], Bg, Cg, s["D"], s["z"], s["delta_bias"], True)
    _, states = scan_mod._fwd(*args, cfg)
    dout = torch.randn_like(s["u"])
    return (lambda: scan_mod._fwd(*args, cfg)), (lambda: scan_mod._bwd(dout, *args[:8], states, True, cfg, False))


def _conv_calls(dim: int):
    x = torch.randn(BATCH, dim, SEQLEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(dim, WIDTH, device="cuda")
    bias = torch.randn(dim, device="cuda")
    dout = torch.randn_like(x)
    cfg = conv_mod.default_config()
    fwd = lambda: conv_mod._fwd(x, w, bias, True, cfg)  # noqa: E731
    bwd = lambda: conv_mod._bwd(x, w, bias, dout, True, cfg)  # noqa: E731
    return fwd, bwd


def once(dim: int) -> None:
    cfg = scan_mod.default_config()
    sf, sb = _scan_calls(scan_inputs(dim), cfg)
    cf, cb = _conv_calls(dim)
    for _ in range(2):  # compile + warm (with the forward above: launches 0-8 of the filtered kernels)
        sf(), sb(), cf(), cb()
    torch.cuda.synchronize()
    sf(), sb(), cf(), cb()  # the profiled launches
    torch.cuda.synchronize()
    print(f"once: dim {dim}, scan config {cfg}")


def kernels(dim: int, calls: int, out: Path | None) -> None:
    """Each kernel the default scan launchers run (forward, backward), its GPU time per call (CUDA profiler), the sum,
    and the launcher's do_bench median: what the small kernels around the scan kernel cost."""
    from torch.profiler import ProfilerActivity, profile

    cfg = scan_mod.default_config()
    rec: dict = {"device": torch.cuda.get_device_name(0), "dim": dim, "config": vars(cfg)}
    for name, fn in zip(("fwd", "bwd"), _scan_calls(scan_inputs(dim), cfg), strict=True):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        per: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] = per.get(e.name, 0.0) + e.device_time / 1e3 / calls
        med = median_ms(fn)
        print(f"scan {name}: do_bench median {med:.4f} ms, kernels' sum {sum(per.values()):.4f} ms")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {v * 1e3:9.2f} us  {k[:110]}")
        rec[name] = {"do_bench_ms": med, "kernels_ms": per}
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scan_kernels.json").write_text(json.dumps(rec, indent=1))


def _slots_per_sm(kernel_regs: int, warps: int) -> int:
    props = torch.cuda.get_device_properties(0)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    warp_regs = math.ceil(kernel_regs * 32 / 256) * 256  # allocation unit: 256 registers per warp
    # the register file is split over the SM's 4 schedulers and a warp's registers come from its scheduler's quarter:
    # 152 registers give 3 warps per scheduler, 12 per SM (Nsight Compute's "Block Limit Registers"), not 65536 // 4864
    by_regs = 4 * ((regs_per_sm // 4) // warp_regs) // warps
    by_warps = (props.max_threads_per_multi_processor // 32) // warps
    return max(1, min(by_regs, by_warps, 32))


def waves(dims: list[int], regs: dict, out: Path | None) -> None:
    cfg = scan_mod.default_config()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for dim in dims:
        sf, sb = _scan_calls(scan_inputs(dim), cfg)
        fwd_ms, bwd_ms = median_ms(sf), median_ms(sb)
        row = {"dim": dim, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "regs": regs}
        for key, per_prog, warps in (("fwd", cfg.block_d, cfg.num_warps), ("bwd", cfg.block_d_bwd, cfg.num_warps_bwd)):
            programs = BATCH * math.ceil(dim / per_prog)
            slots = _slots_per_sm(regs[key], warps) * sms
            row[f"{key}_waves"] = programs / slots
            row[f"{key}_ms_per_wave"] = row[f"{key}_ms"] / math.ceil(programs / slots)
        rows.append(row)
        print(json.dumps(row))
    print(f"{'dim':>6} {'fwd ms':>8} {'waves':>6} {'bwd ms':>8} {'waves':>6}")
    for r in rows:
        print(f"{r['dim']:>6} {r['fwd_ms']:>8.3f} {r.get('fwd_waves', float('nan')):>6.2f} "
              f"{r['bwd_ms']:>8.3f} {r.get('bwd_waves', float('nan')):>6.2f}")  # fmt: skip
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scan_waves.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}))


def mixer(
    configs: list[str], batch: int, dim: int, seqlen: int, rounds: int, out: Path | None, gemm: int, fwd: bool = False
) -> None:
    from anytrain.kernels.mamba_inner import _bct, _scan_inputs
    from anytrain.kernels.selective_scan import ScanConfig

    n, rank, dev = batch * seqlen, math.ceil(dim / 32), "cuda"
    configs = list(dict.fromkeys(configs))  # one entry per distinct config
    torch.manual_seed(0)
    xz = torch.randn(2 * dim, n, device=dev, dtype=torch.bfloat16)
    conv_out = torch.randn(dim, n, device=dev, dtype=torch.bfloat16)
    x_dbl = torch.randn(rank + 2 * DSTATE, n, device=dev, dtype=torch.bfloat16)
    delta = (0.5 * torch.randn(dim, n, device=dev)).to(torch.bfloat16)
    A_log = torch.log(torch.arange(1, DSTATE + 1, device=dev, dtype=torch.float32)).repeat(dim, 1)
    u, dlt, z, Bg, Cg, A = _scan_inputs(xz, x_dbl, conv_out, delta, A_log, batch, rank)  # the mixer's own views
    D, bias = torch.ones(dim, device=dev), torch.rand(dim, device=dev) - 4.0
    dout = _bct(torch.randn(dim, n, device=dev, dtype=torch.bfloat16), batch)
    args, calls = (u, dlt, A, Bg, Cg, D, z, bias), []
    for c in configs:
        cfg = ScanConfig(*(int(v) for v in c.split(",")))
        _, states = scan_mod._fwd(*args, True, cfg)
        if fwd:
            calls.append((c, lambda cfg=cfg: scan_mod._fwd(*args, True, cfg)))
        else:
            calls.append((c, lambda cfg=cfg, st=states: scan_mod._bwd(dout, *args, st, True, cfg, False)))
    if gemm:  # each launch after a (gemm, gemm) bf16 matmul, as in the training step; its own time subtracted
        a = torch.randn(gemm, gemm, device=dev, dtype=torch.bfloat16)
        mm = lambda: a @ a  # noqa: E731
        calls = [(c, lambda fn=fn: (mm(), fn())) for c, fn in calls]
    times: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        base = median_ms(mm) if gemm else 0.0
        for c, fn in calls:
            times[c].append(median_ms(fn) - base)
    which = "forward" if fwd else "backward"
    print(f"mixer layout: batch {batch}, dim {dim}, seqlen {seqlen}, gemm {gemm}; {which} ms per round")
    for c in configs:
        print(f"  {' '.join(f'{t:.3f}' for t in times[c])}  {c}")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        rec = {"device": torch.cuda.get_device_name(0), "batch": batch, "dim": dim, "seqlen": seqlen, "gemm": gemm,
               "ms": times}  # fmt: skip
        (out / f"scan_mixer_{'fwd' if fwd else 'bwd'}.json").write_text(json.dumps(rec, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("once", "waves", "mixer", "kernels"))
    ap.add_argument("--configs", nargs="+", default=[], metavar="FIELDS", help="mixer: ScanConfigs to time")
    ap.add_argument("--shape", default="16,4096,2048", help="mixer: batch,dim,seqlen")
    ap.add_argument("--rounds", type=int, default=3, help="mixer: timing rounds over the configs")
    ap.add_argument("--gemm", type=int, default=0, help="mixer: a (n, n) bf16 matmul before each launch (0: none)")
    ap.add_argument("--fwd", action="store_true", help="mixer: time the forward instead of the backward")
    ap.add_argument("--dim", type=int, default=5376)
    ap.add_argument("--dims", default="4752,5376,6336")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--regs",
        default="72,168",
        help="registers per thread of the forward, backward kernel (from an offline compile, bench/kernel_asm.py)",
    )
    a = ap.parse_args()
    assert DSTATE == 16
    if a.mode == "once":
        once(a.dim)
    elif a.mode == "kernels":
        kernels(a.dim, 20, Path(a.out) if a.out else None)
    elif a.mode == "mixer":
        batch, dim, seqlen = (int(v) for v in a.shape.split(","))
        mixer(a.configs or [",".join(str(v) for v in vars(scan_mod.default_config()).values())], batch, dim, seqlen,
              a.rounds, Path(a.out) if a.out else None, a.gemm, a.fwd)  # fmt: skip
    else:
        rf, rb = (int(v) for v in a.regs.split(","))
        regs = {"fwd": rf, "bwd": rb}  # the default forward / backward kernel's registers
        waves([int(d) for d in a.dims.split(",")], regs, Path(a.out) if a.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
