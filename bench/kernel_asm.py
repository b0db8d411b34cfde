"""Compile the Triton Mamba kernels offline (no GPU needed) and report registers, spills and instruction counts.

The launchers run on CPU tensors of the benchmark shape with the kernels' ``[grid]`` intercepted; each launch is
compiled for the target with the arguments' real specialisation (dtypes, 16-byte alignment, constexprs) and its
resource use is read back from the binary (``cuobjdump``; on ROCm targets from the AMDGCN metadata).

    PYTHONPATH=src python3 bench/kernel_asm.py [--target cuda:90] [--scan-config 1,8,1,2,8,1,3,32,1,32,0] [--dump DIR]
    PYTHONPATH=src python3 bench/kernel_asm.py --conv-config 2,1024,4,1,1024,4,1024,0 --conv-config ...,1024,3
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from anytrain.kernels.causal_conv1d import ConvConfig
from anytrain.kernels.selective_scan import ScanConfig

scan_mod = importlib.import_module("anytrain.kernels.selective_scan")
conv_mod = importlib.import_module("anytrain.kernels.causal_conv1d")

BATCH, SEQLEN, DIM, DSTATE = 2, 4096, 5376, 16


def compile_launch(fn, args, kwargs, target: GPUTarget):
    """Compile one launch of ``fn`` (a @triton.jit function) for ``target`` as the JIT would specialise it."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


class _Recorder:
    """Stands in for a @triton.jit kernel: ``k[grid](*args, **kw)`` records the launch instead of running it."""

    def __init__(self, fn, sink: list):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append((self.fn, args, kwargs))


def scan_launches(cfg: ScanConfig):
    """The forward and backward launches of the selective scan at the benchmark shape (bf16, z, D, bias, softplus)."""
    sink: list = []
    names = [n for n in dir(scan_mod) if n.startswith(("_ss_", "_bc_")) and "kernel" in n]
    saved = {n: getattr(scan_mod, n) for n in [*names, "_fast_math"]}
    try:
        for n in names:
            setattr(scan_mod, n, _Recorder(saved[n], sink))
        scan_mod._fast_math = lambda on, u, acc: on and acc == torch.float32  # the GPU's choice, not the CPU one
        bf = torch.bfloat16
        u = torch.empty(BATCH, DIM, SEQLEN, dtype=bf)
        A = torch.empty(DIM, DSTATE)
        Bg = torch.empty(BATCH, 1, DSTATE, SEQLEN, dtype=bf)
        D = torch.empty(DIM)
        scan_mod._fwd(u, u.clone(), A, Bg, Bg.clone(), D, u.clone(), D.clone(), True, cfg)
        nsub = triton.cdiv(SEQLEN, cfg.chunk_bwd)
        states = torch.empty(BATCH, DIM, DSTATE, nsub)
        scan_mod._bwd(u.clone(), u, u.clone(), A, Bg, Bg.clone(), D, u.clone(), D.clone(), states, True, cfg, False)
    finally:
        for n, v in saved.items():
            setattr(scan_mod, n, v)
    return sink


def conv_launches(cfg: ConvConfig):
    """The forward and backward launches of the causal conv1d at the benchmark shape (bf16, width 4, bias, SiLU)."""
    sink: list = []
    names = [n for n in dir(conv_mod) if n.startswith("_conv_") and n.endswith("_kernel")]
    saved = {n: getattr(conv_mod, n) for n in [*names, "_silu_mode"]}
    try:
        for n in names:
            setattr(conv_mod, n, _Recorder(saved[n], sink))
        conv_mod._silu_mode = lambda silu, x, acc: 2 if silu else 0  # the GPU's (fast fp32) SiLU, not the CPU one
        x = torch.empty(BATCH, DIM, SEQLEN, dtype=torch.bfloat16)
        w, bias = torch.empty(DIM, 4), torch.empty(DIM)
        conv_mod._fwd(x, w, bias, True, cfg)
        conv_mod._bwd(x, w, bias, x.clone(), True, cfg)
    finally:
        for n, v in saved.items():
            setattr(conv_mod, n, v)
    return sink


def resources(kernel, target: GPUTarget, dump: Path | None) -> dict:
    asm = kernel.asm
    name = kernel.metadata.name
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        for k, v in asm.items():
            (dump / f"{name}.{k}").write_text(v) if isinstance(v, str) else (dump / f"{name}.{k}").write_bytes(v)
    ttgir = asm.get("ttgir", "")
    out = {
        "kernel": name,
        "convert_layout": ttgir.count("ttg.convert_layout"),
        "local_alloc (shared memory)": ttgir.count("ttg.local_alloc"),
        "shared_bytes": kernel.metadata.shared,
    }
    if target.backend == "cuda":
        ptx = asm["ptx"]
        out["shfl"] = len(re.findall(r"\bshfl\.sync", ptx))
        out["red/atom"] = len(re.findall(r"\b(?:red|atom)\.global", ptx))
        out["bar.sync"] = len(re.findall(r"\bbar\.sync|barrier\.sync", ptx))
        out["cp.async"] = len(re.findall(r"\bcp\.async\.c", ptx))  # pipelined (asynchronous) global loads
        vector = (r"ld\.global[.\w]*\.v4", r"ld\.global[.\w]*\.v2", r"ld\.global(?![.\w]*\.v[24])")
        out["ld.global.v4/v2/1"] = "/".join(str(len(re.findall(p, ptx))) for p in vector)
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        cubin = Path("/tmp") / f"{name}.cubin"
        cubin.write_bytes(asm["cubin"])
        res = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
        for key, pat in (("registers", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"), ("local", r"LOCAL:(\d+)")):
            m = re.search(pat, res)
            out[key] = int(m.group(1)) if m else None
    else:
        amdgcn = asm.get("amdgcn", "")
        for key, pat in (("vgprs", r"\.vgpr_count:\s+(\d+)"), ("sgprs", r"\.sgpr_count:\s+(\d+)"),
                         ("spills", r"\.vgpr_spill_count:\s+(\d+)")):  # fmt: skip
            m = re.search(pat, amdgcn)
            out[key] = int(m.group(1)) if m else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="cuda:90", help="cuda:<sm> (e.g. cuda:90) or hip:<arch> (e.g. hip:gfx942)")
    ap.add_argument("--scan-config", action="append", default=[], help="ScanConfig fields, comma-separated")
    ap.add_argument("--conv-config", action="append", default=[], help="ConvConfig fields, comma-separated")
    ap.add_argument("--dump", default=None, help="write each kernel's ttir/ttgir/ptx/... here")
    args = ap.parse_args()
    backend, arch = args.target.split(":")
    target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)
    cfgs = [ScanConfig(*(int(v) for v in c.split(","))) for c in args.scan_config]
    cfgs += [ConvConfig(*(int(v) for v in c.split(","))) for c in args.conv_config]
    for cfg in cfgs or [ScanConfig()]:
        print(f"{cfg}")
        for fn, a, kw in scan_launches(cfg) if isinstance(cfg, ScanConfig) else conv_launches(cfg):
            # the launcher caps the backward kernels and the v3 forward (fwd_impl 1) only
            cap = getattr(cfg, "maxnreg_bwd", 0) if "bwd" in fn.__name__ else 0
            if fn.__name__ == "_ss_fwd_kernel_v3":
                cap = getattr(cfg, "maxnreg", 0)
            if cap and backend == "cuda":
                kw = {**kw, "maxnreg": cap}  # the launcher sets it on CUDA devices only
            k = compile_launch(fn, a, kw, target)
            r = resources(k, target, Path(args.dump) if args.dump else None)
            print("  " + "  ".join(f"{k_}={v}" for k_, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
