"""SDPA kernels side by side at the 1.1B recipe's attention shape: forward + backward time of each backend.

Shape: micro-batch 16, 32 query heads, 4 KV heads, seq 2048, head dim 64, bf16, causal (configs/1.1b.yaml). Each
backend is forced with ``torch.nn.attention.sdpa_kernel`` and timed with ``triton.testing.do_bench`` (median ms of one
forward + backward), with GQA given natively (``enable_gqa=True``) and with K/V expanded to 32 heads
(``repeat_interleave``, included in the time). A backend that refuses the call is listed with its reason. TFLOP/s
count the causal work: (2 forward + 5 backward matmuls) x B H S^2 D, halved for causality.

    PYTHONPATH=src python3 -m bench.sdpa_backends [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import versions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU visible: nothing to benchmark", file=sys.stderr)
        return 1
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    B, H, KV, S, D = 16, 32, 4, 2048, 64
    q, k, v = (torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (H, KV, KV))
    go = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    flops = 7 * 2 * B * H * S * S * D / 2
    rows = []

    def step(gqa: bool) -> None:
        if gqa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            kk, vv = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        torch.autograd.grad(o, (q, k, v), go)  # no .grad accumulation in the timed step

    for gqa in (True, False):
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            row = {"backend": backend.name, "enable_gqa": gqa, "ms": None, "tflops": None, "refused": None}
            with sdpa_kernel([backend]), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    step(gqa)
                    row["ms"] = float(do_bench(lambda g=gqa: step(g), warmup=10, rep=100, return_mode="median"))
                    row["tflops"] = flops / row["ms"] / 1e9
                except RuntimeError as e:
                    row["refused"] = " ".join([str(e)[:200], *(str(w.message)[:300] for w in caught)])
            rows.append(row)
    name = torch.cuda.get_device_name()
    print(f"\n{name}, torch {torch.__version__}: B {B}, heads {H} (KV {KV}), seq {S}, head dim {D}, bf16, causal")
    print(f"{'backend':<22}{'K/V':<10}{'fwd+bwd ms':>12}{'TFLOP/s':>9}")
    for r in rows:
        kv = "GQA" if r["enable_gqa"] else "expanded"
        ms = f"{r['ms']:.3f}" if r["ms"] else "refused"
        tf = f"{r['tflops']:.0f}" if r["tflops"] else ""
        print(f"{r['backend']:<22}{kv:<10}{ms:>12}{tf:>9}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sdpa_backends_{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.json"
    record = {
        "device": name,
        "versions": {**versions(torch.device("cuda")), "cudnn": torch.backends.cudnn.version()},
        "shape": {"batch": B, "heads": H, "kv_heads": KV, "seq": S, "head_dim": D},
        "rows": rows,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
