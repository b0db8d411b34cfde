"""Where does the fp32 dA error at seqlen 4096 come from? Compares, against a float64 reference on the same inputs:
the Triton kernel and the float32 reference (autograd through 4096 sequential steps).
Case of tests/gpu: fp32, seqlen 4096, dim 24, ngroups 2, z.

    PYTHONPATH=src python3 bench/scan_da_precision.py [cuda|cpu] [seqlen]   (cpu needs TRITON_INTERPRET=1)
"""

from __future__ import annotations

import sys

import torch

from anytrain.kernels.reference import selective_scan_ref
from anytrain.kernels.selective_scan import selective_scan_triton


def grads(fn, vals, dtype, g):
    leaves = {k: v.to(dtype).clone().requires_grad_() for k, v in vals.items()}
    out = fn(**leaves, delta_softplus=True)
    out.backward(g.to(out.dtype))
    return {k: v.grad for k, v in leaves.items()}


def main() -> int:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    seqlen = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    torch.manual_seed(0)
    batch, dstate, dim, ng = 2, 16, 24, 2
    vals = {
        "u": torch.randn(batch, dim, seqlen, device=dev),
        "delta": 0.5 * torch.rand(batch, dim, seqlen, device=dev),
        "A": -0.5 * torch.rand(dim, dstate, device=dev),
        "B": torch.randn(batch, ng, dstate, seqlen, device=dev),
        "C": torch.randn(batch, ng, dstate, seqlen, device=dev),
        "D": torch.randn(dim, device=dev),
        "z": torch.randn(batch, dim, seqlen, device=dev),
        "delta_bias": 0.5 * torch.rand(dim, device=dev),
    }
    g = torch.randn(batch, dim, seqlen, device=dev)
    ref64 = grads(selective_scan_ref, vals, torch.float64, g)
    runs = {
        "ref_fp32": grads(selective_scan_ref, vals, torch.float32, g),
        "triton_new": grads(selective_scan_triton, vals, torch.float32, g),
    }
    rtol, atol = 1e-3, 5e-3  # the dA tolerance of tests/gpu (rtolw, 5 * atolw)
    for name, gr in runs.items():
        for k in ("A", "B", "C", "delta", "u"):
            err = (gr[k].double() - ref64[k]).abs()
            bad = err > atol + rtol * ref64[k].abs()
            i = int(err.argmax())
            print(
                f"{name:<12} d{k:<6} max abs err {err.max().item():.3e}"
                f" at |ref| {ref64[k].flatten()[i].abs().item():.3e};"
                f" max |ref| {ref64[k].abs().max().item():.3e}; {int(bad.sum())} outside rtol {rtol}/atol {atol}"
            )
    for other in ("triton_new",):
        d = runs["ref_fp32"]["A"].double() - runs[other]["A"].double()
        bad = d.abs() > atol + rtol * runs["ref_fp32"]["A"].double().abs()
        print(
            f"{other} vs ref_fp32 dA: max abs diff {d.abs().max().item():.3e}, {int(bad.sum())} outside (the old test)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
