"""Parts of the 1.1B Transformer step on one GPU, measured alone: its GEMM shapes, its RoPE, the idle gaps of a step.

    PYTHONPATH=src python -m bench.transformer_parts [gemms] [rope] [gaps] --out bench/results

- ``gemms``: every projection of a 1.1B layer at the recipe's 32,768 tokens per micro-batch (forward, input
  gradient, weight gradient; CUDA events, 20 calls) under cuBLAS and cuBLASLt (``preferred_blas_library``), a bf16
  8192^3 product for the ceiling, and the weight gradient three ways, alternating 3 times: bf16 product, bf16 product
  copied to fp32 (autocast's path), one GEMM with an fp32 ``out_dtype`` (``transformer.Linear``'s path).
- ``layouts``: the same GEMMs with the weight stored row-major or column-major, and the weight gradient written
  row- or column-major.
- ``rope``: ``apply_rope`` (x·cos + swap(x)·sin) against the pairwise form it replaced, compiled, on the recipe's q
  and k, forward and forward + backward, and a copy of the same bytes (the floor).
- ``gaps``: the recipe's step (as ``bench/transformer.py`` builds it), 3 warm-up steps, 5 timed, 3 profiled back to
  back: device idle gaps over 15 µs in the middle third of the profile (none means the host keeps the GPU fed).

Writes ``transformer_parts_<device>.json``.
"""

# ruff: noqa: B023  (every lambda below is timed at once, inside the loop iteration that defines it)
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from anytrain.models.llama.model import apply_rope, rope_tables
from bench.common import RandomBatches, versions

TOKENS = 32768  # micro-batch 16 x 2048
PROJECTIONS = {"q/o": (2048, 2048), "k/v": (2048, 256), "w1/w3": (2048, 5632), "w2": (5632, 2048)}


def timeit(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gemms() -> dict:
    rows = []
    shapes = {**PROJECTIONS, "head chunk": (2048, 32000)}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (i, o) in shapes.items():
            t = 4096 if name == "head chunk" else TOKENS  # the chunked loss's ~256 MiB of bf16 logits
            x, w = torch.randn(t, i, device="cuda").bfloat16(), torch.randn(o, i, device="cuda").bfloat16()
            dy = torch.randn(t, o, device="cuda").bfloat16()
            for kind, fn in (
                ("forward", lambda: torch.nn.functional.linear(x, w)),
                ("input grad", lambda: dy @ w),
                ("weight grad", lambda: dy.t() @ x),
            ):
                ms = timeit(fn)
                rows.append(dict(lib=lib, gemm=name, kind=kind, ms=ms, tflops=2 * t * i * o / ms / 1e9))
        a = torch.randn(8192, 8192, device="cuda").bfloat16()
        ms = timeit(lambda: a @ a)
        rows.append(dict(lib=lib, gemm="8192^3", kind="-", ms=ms, tflops=2 * 8192**3 / ms / 1e9))
    torch.backends.cuda.preferred_blas_library("cublas")
    wgrad = []
    for name, (i, o) in PROJECTIONS.items():
        x, dy = torch.randn(TOKENS, i, device="cuda").bfloat16(), torch.randn(TOKENS, o, device="cuda").bfloat16()
        r = {"gemm": name, "bf16": [], "bf16 + copy to fp32": [], "fp32 out_dtype": []}
        for _ in range(3):  # alternating, against clock drift
            r["bf16"].append(timeit(lambda: dy.t() @ x))
            r["bf16 + copy to fp32"].append(timeit(lambda: (dy.t() @ x).float()))
            r["fp32 out_dtype"].append(timeit(lambda: torch.mm(dy.t(), x, out_dtype=torch.float32)))
        wgrad.append(r)
    for r in rows:
        print(f"{r['lib']:9} {r['gemm']:10} {r['kind']:12} {r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s")
    for r in wgrad:
        print(f"weight grad {r['gemm']:6}: " + ", ".join(f"{k} {min(r[k]):.3f} ms" for k in r if k != "gemm"))
    return {"gemms": rows, "weight_grad_paths": wgrad}


def layouts() -> dict:
    """Each projection's three GEMMs with the weight stored row-major (as ``nn.Linear`` makes it, (out, in)
    contiguous) and column-major (same shape, (in, out) memory: ``torch.empty(in, out).t()``), and the weight
    gradient written either way (fp32 ``out_dtype``, as ``transformer.Linear`` computes it); medians of 3 alternating
    rounds. Also K and V as one (2048 -> 512) projection."""
    rows = []
    shapes = {**PROJECTIONS, "k+v fused": (2048, 512)}
    f32 = torch.float32
    for name, (i, o) in shapes.items():
        x, dy = torch.randn(TOKENS, i, device="cuda").bfloat16(), torch.randn(TOKENS, o, device="cuda").bfloat16()
        w_row = torch.randn(o, i, device="cuda").bfloat16()
        w_col = w_row.t().contiguous().t()  # same values, column-major
        variants = {
            ("forward", "row"): lambda: torch.nn.functional.linear(x, w_row),
            ("forward", "col"): lambda: torch.nn.functional.linear(x, w_col),
            ("input grad", "row"): lambda: dy @ w_row,
            ("input grad", "col"): lambda: dy @ w_col,
            ("weight grad", "row"): lambda: torch.mm(dy.t(), x, out_dtype=f32),  # (out, in) contiguous
            ("weight grad", "col"): lambda: torch.mm(x.t(), dy, out_dtype=f32),  # (in, out) contiguous
        }
        times: dict = {k: [] for k in variants}
        for _ in range(3):  # alternating, against clock drift
            for k, fn in variants.items():
                times[k].append(timeit(fn))
        for (kind, layout), ts in times.items():
            ms = sorted(ts)[1]
            rows.append(dict(gemm=name, kind=kind, weight=layout, ms=ms, tflops=2 * TOKENS * i * o / ms / 1e9))
            print(f"{name:10} {kind:12} {layout}  {ms:7.3f} ms {rows[-1]['tflops']:6.0f} TFLOP/s")
    return {"layouts": rows}


def _pairwise_rope(x, cos, sin):
    """The form apply_rope had before (tables (T, E/2)): stack of the rotated even and odd halves."""
    x32 = x.float().unflatten(-1, (-1, 2))
    even, odd = x32[..., 0], x32[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


def rope() -> dict:
    B, T, H, K, E = 16, 2048, 32, 4, 64
    cos, sin = rope_tables(E, T, 10000.0, "cuda")
    half_cos, half_sin = cos[:, 0::2].contiguous(), sin[:, 1::2].contiguous()
    q = torch.randn(B, T, H, E, device="cuda").bfloat16().requires_grad_()
    k = torch.randn(B, T, K, E, device="cuda").bfloat16().requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    rows = [
        dict(
            variant="max |swap form - pairwise form|",
            value=(apply_rope(q, cos, sin).float() - _pairwise_rope(q, half_cos, half_sin).float()).abs().max().item(),
        )
    ]
    for name, f, c, s in (
        ("x cos + swap(x) sin (apply_rope)", apply_rope, cos, sin),
        ("pairwise stack (before)", _pairwise_rope, half_cos, half_sin),
    ):
        both = torch.compile(lambda a, b, f=f, c=c, s=s: (f(a, c, s), f(b, c, s)))

        def fwd_bwd(both=both):
            q.grad = k.grad = None
            torch.autograd.backward(both(q, k), (gq, gk))

        rows.append(
            dict(
                variant=name, fwd_ms=timeit(lambda both=both: both(q.detach(), k.detach())), fwd_bwd_ms=timeit(fwd_bwd)
            )
        )
    rows.append(
        dict(variant="copy of q and k (floor)", fwd_ms=timeit(lambda: (q.detach().clone(), k.detach().clone())))
    )
    for r in rows:
        print(r)
    return {"rope": rows}


def gaps() -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from bench import transformer as tb

    case = next(c for c in tb.default_cases() if c.label.startswith("anytrain recipe"))
    device = torch.device("cuda")
    with tb.attention_order(case):
        step, _, holder = tb.anytrain_step_fn(case, device, RandomBatches(32000, case.global_batch, case.seq), True)
        for i in range(3):
            step(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(3, 8):
            step(i)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(8, 11):
                step(i)
            torch.cuda.synchronize()
    del holder
    events = sorted(
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )
    events.sort(key=lambda r: r[1])
    first, last = events[0][1], max(e for _, _, e in events)
    lo, hi = first + (last - first) / 3, first + 2 * (last - first) / 3  # the middle step, roughly
    found, end, prev = [], events[0][2], events[0][0]
    for name, s, e in events[1:]:
        if s - end > 15 and lo < s < hi:
            found.append(dict(us=s - end, after=prev[:80], before=name[:80]))
        if e > end:
            end, prev = e, name
    found.sort(key=lambda g: -g["us"])
    kernel_ms = sum(e - s for _, s, e in events if lo < s < hi) / 1e3
    out = dict(
        wall_ms_per_step=wall_ms,
        window_ms=(hi - lo) / 1e3,
        kernel_ms_in_window=kernel_ms,
        gaps_over_15us_ms=sum(g["us"] for g in found) / 1e3,
        top_gaps=found[:40],
    )
    print({k: v for k, v in out.items() if k != "top_gaps"}, *found[:10], sep="\n")
    return {"gaps": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", help="gemms, layouts, rope, gaps (default: all four)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="", help="suffix of the results file name (keeps earlier files)")
    args = parser.parse_args()
    parts = {"gemms": gemms, "layouts": layouts, "rope": rope, "gaps": gaps}
    unknown = set(args.parts) - set(parts)
    if unknown:
        raise SystemExit(f"transformer_parts: unknown part(s) {sorted(unknown)}; choose from {sorted(parts)}")
    if not torch.cuda.is_available():
        raise SystemExit("transformer_parts: needs a CUDA/ROCm GPU")
    env = versions(torch.device("cuda"))
    results = {"date": time.strftime("%Y-%m-%d"), "device": env["device"], "versions": env}
    for part in args.parts or list(parts):
        results.update(parts[part]())
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    path = Path(args.out) / f"transformer_parts_{slug}{'_' + args.tag if args.tag else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
