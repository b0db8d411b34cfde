"""Compile every Triton kernel of ``anytrain.kernels`` offline for real GPU targets (no GPU needed) and report each
binary's registers, spills and shared memory.

The launches are captured, not written down by hand: each case below runs the public launchers (the same Python the
GPU paths run: tile choice, clamping, layouts, dtypes) on ``meta``-device tensors at a realistic shape, with
``hardware.vendor()`` answering the target's vendor and every tensor taken for a GPU tensor. ``JITFunction.run`` is
replaced by a recorder, so nothing executes; each recorded launch is then specialized by Triton's own argument binder
for the target's backend (dtypes, 16-divisibility of ints and of the meta tensors' offsets, the launch options) and
compiled with ``triton.compile``: ttir -> ttgir -> llir -> ptx -> cubin (NVIDIA, Triton's bundled ptxas) or -> amdgcn ->
hsaco (AMD). A kernel that would not compile on the GPU (a ``tl.dot`` operand under 16, a block that is not a power of
two, mismatched dtypes, more shared memory than the target has) fails here. Autotuned kernels are captured once per
config of their list.

Targets: ``sm90`` (H100 / H200) and ``gfx942`` (MI300X). Registers and spills come from ptxas' ``-v`` log on NVIDIA
(``spills``: bytes of spill stores) and from the amdgcn metadata on AMD (VGPRs; ``spills``: spilled VGPRs + SGPRs);
``shared`` is the compiled kernel's ``metadata.shared`` in bytes.

    PYTHONPATH=src python3 -m bench.triton_compile [--target sm90 gfx942] [--case mamba2] [--json out.json] [--jobs 2]

Run without ``TRITON_INTERPRET=1`` (under the interpreter ``@triton.jit`` gives interpreted functions). Supported on
the Triton versions whose ``JITFunction`` has ``_pack_args`` and ``triton.runtime.jit.create_function_from_signature``
(3.3 to 3.9); ``unsupported()`` names what is missing elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from anytrain import hardware

TARGETS = {
    "sm90": ("cuda", 90, 32, hardware.CUDA),  # H100 / H200
    "gfx942": ("hip", "gfx942", 64, hardware.ROCM),  # MI300X
}
SHARED_LIMIT = {"sm90": 232448, "gfx942": 65536}
"""Shared memory (LDS) a block may use, bytes: the opt-in maximum per block of the H100 / H200 (227 KiB) and the
MI300X's 64 KiB; Triton raises ``OutOfResources`` at the first launch of a binary that needs more."""
REGISTER_FILE = {"sm90": 65536}
"""32-bit registers of an SM: a block of num_warps x 32 threads at ptxas' count must fit (else the launch fails)."""
META = torch.device("meta")
BF16, FP32 = torch.bfloat16, torch.float32


def unsupported() -> str | None:
    """Why this process cannot compile the kernels offline, or None."""
    if hardware.triton_interpreted():
        return "TRITON_INTERPRET=1: @triton.jit gives interpreted functions (run in a process without it)"
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime import jit
    except ImportError as err:
        return f"triton's compiler API is not importable: {err}"
    missing = [n for n in ("create_function_from_signature",) if not hasattr(jit, n)]
    missing += [f"JITFunction.{n}" for n in ("_pack_args",) if not hasattr(jit.JITFunction, n)]
    if missing:
        return f"triton {triton.__version__}: no {', '.join(missing)} (the argument binder this module reuses)"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Capture: the launches of each case, on meta tensors


@dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)``."""

    case: str
    kernel: Any  # triton.runtime.JITFunction
    args: tuple
    kwargs: dict


def _empty(*shape: int, dtype: torch.dtype = BF16, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, device=META, dtype=dtype, requires_grad=grad)


def _backward(out: torch.Tensor) -> None:
    out.backward(torch.empty_like(out))


def _mamba2_case(batch: int, seqlen: int, d_model: int, param: torch.dtype, documents: bool) -> None:
    """Mamba2Mixer.forward's conv and SSD (models/mamba2/model.py) forward + backward, the released shapes (expand 2,
    headdim 64, d_state 128, one group, conv 4, chunk 256): bf16 activations, A fp32, D / dt_bias / conv weights in
    ``param`` (fp32 under autocast, bf16 under FSDP's bf16 parameters). With ``documents`` the conv runs in PyTorch
    (``causal_conv1d_documents``) and the SSD takes the document counter."""
    from anytrain.kernels.causal_conv1d_triton import causal_conv1d_triton
    from anytrain.kernels.ssd_triton import ssd_chunk_scan_triton

    E, G, N, P = 2 * d_model, 1, 128, 64
    H, conv_dim = E // P, E + 2 * G * N
    zxbcdt = _empty(batch, seqlen, E + conv_dim + H, grad=True)  # in_proj's output (B, T, 2E + 2GN + H)
    _, xBC, dt = zxbcdt.split([E, conv_dim, H], dim=-1)
    if documents:
        xBC = _empty(batch, conv_dim, seqlen, grad=True)  # the PyTorch conv's output, (B, E + 2GN, T) contiguous
    else:
        xBC = causal_conv1d_triton(xBC.transpose(1, 2), _empty(conv_dim, 4, dtype=param), _empty(conv_dim), "silu")
    x, B, C = xBC.transpose(1, 2).split([E, G * N, G * N], dim=-1)
    seq_idx = _empty(batch, seqlen, dtype=torch.int64) if documents else None
    y = ssd_chunk_scan_triton(
        x.unflatten(-1, (H, P)),
        dt,
        -_empty(H, dtype=FP32, grad=True),
        B.unflatten(-1, (G, N)),
        C.unflatten(-1, (G, N)),
        256,
        D=_empty(H, dtype=param, grad=True),
        dt_bias=_empty(H, dtype=param, grad=True),
        dt_softplus=True,
        seq_idx=seq_idx,
    )
    _backward(y)


def _mamba1_weights(d_model: int, d_state: int, param: torch.dtype) -> tuple:
    """MambaMixer's weights (models/mamba/model.py; expand 2, conv 4, dt_rank ceil(d_model / 16)) in ``param``."""
    E, S, R = 2 * d_model, d_state, math.ceil(d_model / 16)
    return (
        _empty(2 * E, d_model, dtype=param),  # in_proj
        _empty(E, 1, 4, dtype=param),  # conv1d weight (E, 1, K)
        _empty(E, dtype=param),  # conv1d bias
        _empty(R + 2 * S, E, dtype=param),  # x_proj
        _empty(E, R, dtype=param),  # dt_proj weight
        _empty(E, dtype=param),  # dt_proj bias
        _empty(E, S, dtype=param),  # A_log
        _empty(E, dtype=param),  # D
        _empty(d_model, E, dtype=param),  # out_proj
    )


def _mamba1_fused_case(batch: int, seqlen: int, d_model: int, param: torch.dtype, deterministic: bool) -> None:
    """The fused Mamba-1 mixer (``mamba_inner._forward`` / ``_backward``, the model's GPU path), bf16 activations."""
    from anytrain.kernels import mamba_inner

    weights = _mamba1_weights(d_model, 16, param)
    h = _empty(batch, seqlen, d_model)
    out, xz, x_dbl, y, states = mamba_inner._forward(h, *weights)
    mamba_inner._backward(torch.empty_like(out), h, *weights, xz, x_dbl, y, states, deterministic)


def _mamba1_unfused_case(batch: int, seqlen: int, d_model: int) -> None:
    """The unfused mixer (``mixer_composition`` on the Triton conv and scan; ``fused_mamba_inner: false``) as autocast
    runs it: bf16 projections, fp32 conv weights and scan parameters."""
    from anytrain.kernels.causal_conv1d_triton import causal_conv1d_triton
    from anytrain.kernels.mamba_inner import mixer_composition
    from anytrain.kernels.selective_scan_triton import selective_scan_triton

    w = list(_mamba1_weights(d_model, 16, FP32))
    for i in (0, 3, 4, 8):  # the projections: autocast's bf16 copies
        w[i] = w[i].to(BF16)
    w = [t.requires_grad_() for t in w]
    h = _empty(batch, seqlen, d_model, grad=True)
    _backward(mixer_composition(h, *w[:8], w[8], causal_conv1d_triton, selective_scan_triton))


def _ce_case(vocab: int, tokens: int) -> None:
    """The fused linear + cross-entropy's row kernel on the chunk of bf16 logits ``linear_cross_entropy`` picks for a
    micro-batch of ``tokens``, training (the gradient written in place) and evaluation."""
    from anytrain.kernels.fused_linear_ce import ce_rows_triton, default_chunk_rows

    n = default_chunk_rows(tokens, vocab, BF16)
    for write_grad in (True, False):
        ce_rows_triton(_empty(n, vocab), _empty(n, dtype=torch.int64), _empty(1, dtype=FP32), write_grad=write_grad)


CASES: dict[str, Callable[[], None]] = {
    "mamba2-1.3b": lambda: _mamba2_case(8, 2048, 2048, FP32, documents=False),
    "mamba2-1.3b docs": lambda: _mamba2_case(8, 2048, 2048, FP32, documents=True),
    "mamba2-1.3b bf16-params": lambda: _mamba2_case(8, 2048, 2048, BF16, documents=False),
    "mamba-1.4b": lambda: _mamba1_fused_case(8, 2048, 2048, FP32, deterministic=False),
    "mamba-1.4b deterministic": lambda: _mamba1_fused_case(8, 2048, 2048, FP32, deterministic=True),
    "mamba-1.4b bf16-params": lambda: _mamba1_fused_case(8, 2048, 2048, BF16, deterministic=False),
    "mamba-1.4b unfused": lambda: _mamba1_unfused_case(8, 2048, 2048),
    "mamba-130m": lambda: _mamba1_fused_case(8, 2048, 768, FP32, deterministic=False),
    "mamba-debug": lambda: _mamba1_fused_case(8, 256, 64, FP32, deterministic=False),  # split conv backward
    "1.1b lm-head": lambda: _ce_case(32000, 16 * 2048),
    "mamba-1.4b lm-head": lambda: _ce_case(50280, 8 * 2048),
}
"""Name -> the launches of one GPU path at one realistic shape (the layer of the named flavour, its recipe's micro
batch and sequence length)."""


@contextlib.contextmanager
def _recording(vendor: str, sink: list[Launch], case: list[str]) -> Iterator[None]:
    """Inside: kernel launches are recorded into ``sink`` (nothing runs), ``hardware.vendor()`` is ``vendor`` and
    every tensor counts as a GPU tensor; the launchers' per-vendor caches are emptied before and after."""
    from triton.runtime import autotuner, jit

    from anytrain.kernels import causal_conv1d_triton, fused_linear_ce, launch

    fused_linear_ce._kernel()  # binds the module's triton globals

    def record(self, *args, grid, warmup, **kwargs):
        sink.append(Launch(case[0], self, args, kwargs))

    def record_configs(self, *args, grid=None, warmup=False, **kwargs):  # every config of an autotuned kernel's list
        for config in self.configs:
            self.fn.run(*args, grid=grid, warmup=False, **{**kwargs, **config.all_kwargs()})

    saved = [
        (jit.JITFunction, "run", record),
        (autotuner.Autotuner, "run", record_configs),
        (launch, "_hooks_set", lambda: True),  # the Launchers' plain kernel[grid] path (the recorder)
        (hardware, "vendor", lambda: vendor),
        (hardware, "is_gpu", lambda device: True),
    ]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in saved]
    caches = (causal_conv1d_triton._PLANS, causal_conv1d_triton._VENDOR, launch._LAUNCHERS)
    try:
        for obj, name, value in saved:
            setattr(obj, name, value)
        for cache in caches:
            cache.clear()
        with torch.device(META):
            yield
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)
        for cache in caches:
            cache.clear()


def select_cases(names: list[str] | None) -> list[str]:
    """The cases named (exactly, else every case containing the name); all for None or []."""
    if not names:
        return list(CASES)
    picked = [c for n in names for c in ([n] if n in CASES else [c for c in CASES if n in c])]
    unknown = [n for n in names if n not in CASES and not any(n in c for c in CASES)]
    if unknown:
        raise SystemExit(f"triton_compile: no case matches {unknown}; cases: {list(CASES)}")
    return list(dict.fromkeys(picked))


def capture(vendor: str, cases: list[str] | None = None) -> list[Launch]:
    """Every kernel launch of ``cases`` (default: all of ``CASES``) with ``vendor``'s launch parameters."""
    launches: list[Launch] = []
    current = [""]
    with _recording(vendor, launches, current):
        for name in cases or list(CASES):
            current[0] = name
            CASES[name]()
    return launches


def package_kernels() -> set[str]:
    """Names of the package's Triton kernels (``JITFunction``s named ``*_kernel`` in ``anytrain.kernels``)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import anytrain.kernels as pkg
    from anytrain.kernels import fused_linear_ce

    names = {fused_linear_ce._kernel().__name__}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        names |= {
            v.__name__ for v in vars(module).values() if isinstance(v, JITFunction) and v.__name__.endswith("_kernel")
        }
    return names


# ---------------------------------------------------------------------------------------------------------------------
# Specialize and compile


@dataclass
class Compiled:
    """One kernel specialization compiled for one target."""

    kernel: str
    target: str
    config: str
    cases: list[str]
    ok: bool = False
    error: str = ""
    regs: int | None = None
    spills: int | None = None
    shared: int | None = None
    seconds: float = 0.0
    signature: dict = field(default_factory=dict)


def _run_kwargs(kernel: Any, kwargs: dict) -> dict:
    """The launch's keyword arguments with the options ``JITFunction.run`` adds before binding."""
    from triton import knobs

    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            kw[name] = getattr(knobs.compilation, name)
    return kw


def _short(value: Any) -> str:
    name = getattr(value, "name", None)
    if name is not None and type(value).__name__ == "dtype":
        return {"bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "float16": "fp16"}.get(name, name)
    return str(value)


def _divisible(attrs: dict, index: int) -> bool:
    return any(a[0] == "tt.divisibility" for a in attrs.get((index,), []))


def _config_text(kernel: Any, given: dict, signature: dict, constexprs: dict, attrs: dict, opts: dict) -> str:
    """The launch's constexprs, then the int arguments Triton specialized to a constant (``name=1*``), the launch
    options, the pointer dtypes (``ptrs=``) and the int arguments not divisible by 16 (``not%16=``)."""
    names = kernel.arg_names
    parts = [f"{names[k[0]]}={_short(v)}" for k, v in constexprs.items() if names[k[0]] in given]
    parts += [
        f"{names[k[0]]}={_short(v)}*" for k, v in constexprs.items() if names[k[0]] not in given and v is not None
    ]
    parts += [f"warps={opts['num_warps']}", f"stages={opts['num_stages']}"]
    parts.append("ptrs=" + ",".join(t[1:] for t in signature.values() if t.startswith("*")))
    odd = [n for n, t in signature.items() if t in ("i32", "i64") and not _divisible(attrs, names.index(n))]
    if odd:
        parts.append("not%16=" + ",".join(odd))
    if opts.get("maxnreg"):
        parts.append(f"maxnreg={opts['maxnreg']}")
    return " ".join(parts)


def specialize(launch: Launch, target: Any) -> tuple[Any, dict, str, tuple]:
    """(ASTSource, compile options, config text, dedup key) of ``launch`` for ``target``, as ``JITFunction.run`` would
    build them on that GPU."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, backend = launch.kernel, make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kw = _run_kwargs(kernel, launch.kwargs)
    bound, spec, options = binder(*launch.args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, options)
    opts = options.__dict__
    config = _config_text(kernel, launch.kwargs, signature, constexprs, attrs, opts)
    key = (kernel.__name__, repr(sorted(signature.items())), repr(constexprs), repr(attrs), repr(sorted(opts.items())))
    return ASTSource(kernel, signature, constexprs, attrs), opts, config, key


def _resources(asm: dict, ptxas_log: str) -> tuple[int | None, int | None]:
    """(registers, spills) from ptxas' log (NVIDIA: spill-store bytes) or the amdgcn metadata (VGPRs, spilled
    registers)."""
    if "amdgcn" in asm:
        text = asm["amdgcn"]
        regs = re.search(r"\.vgpr_count:\s+(\d+)", text)
        spills = [int(m) for m in re.findall(r"\.[sv]gpr_spill_count:\s+(\d+)", text)]
        return (int(regs.group(1)) if regs else None), (sum(spills) if spills else None)
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    spills = re.search(r"(\d+) bytes spill stores", ptxas_log)
    return (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else None)


class OutOfResources(RuntimeError):
    """A compiled binary needs more shared memory or registers than the target has."""


def check_resources(target: str, regs: int | None, shared: int, num_warps: int) -> None:
    """Raise ``OutOfResources`` where a launch of the binary would fail on ``target`` (the limits above)."""
    if shared > SHARED_LIMIT[target]:
        raise OutOfResources(f"shared memory: {shared} bytes > {SHARED_LIMIT[target]} on {target}")
    threads = num_warps * TARGETS[target][2]
    if regs is not None and target in REGISTER_FILE and regs * threads > REGISTER_FILE[target]:
        raise OutOfResources(f"registers: {regs} x {threads} threads > {REGISTER_FILE[target]} on {target}")


def compile_one(src: Any, options: dict, target: Any) -> tuple[int | None, int | None, int]:
    """Compile ``src`` for ``target`` (ptxas always runs: its log gives the registers) -> (regs, spills, shared)."""
    import triton
    from triton import knobs

    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
    try:
        with contextlib.redirect_stdout(log):
            binary = triton.compile(src, target=target, options=options)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    regs, spills = _resources(binary.asm, log.getvalue())
    return regs, spills, int(binary.metadata.shared)


def available_targets() -> dict[str, str | None]:
    """Target name -> None where this Triton has its backend, else why not."""
    from triton.compiler import make_backend

    reasons: dict[str, str | None] = {}
    for name in TARGETS:
        try:
            make_backend(_gpu_target(name))
            reasons[name] = None
        except Exception as err:  # noqa: BLE001 - a missing or broken backend is a skip reason
            reasons[name] = f"{type(err).__name__}: {err}"
    return reasons


def _gpu_target(name: str) -> Any:
    from triton.backends.compiler import GPUTarget

    backend, arch, warp, _ = TARGETS[name]
    return GPUTarget(backend, arch, warp)


def plan(target: str, cases: list[str] | None = None) -> list[tuple[Compiled, Any, dict]]:
    """The distinct specializations of the captured launches for ``target``: (result to fill, source, options)."""
    gpu = _gpu_target(target)
    seen: dict[tuple, tuple[Compiled, Any, dict]] = {}
    for launch in capture(TARGETS[target][3], cases):
        src, options, config, key = specialize(launch, gpu)
        if key in seen:
            if launch.case not in seen[key][0].cases:
                seen[key][0].cases.append(launch.case)
            continue
        seen[key] = (
            Compiled(launch.kernel.__name__, target, config, [launch.case], signature=src.signature),
            src,
            options,
        )
    return list(seen.values())


_PLANNED: list[tuple[Compiled, Any, dict]] = []  # compile_all's plan, read by index in the (forked) workers


def _compile_planned(index: int) -> Compiled:
    result, src, options = _PLANNED[index]
    start = time.perf_counter()
    try:
        result.regs, result.spills, result.shared = compile_one(src, options, _gpu_target(result.target))
        check_resources(result.target, result.regs, result.shared, options["num_warps"])
        result.ok = True
    except Exception as err:  # noqa: BLE001 - every compile error is a row of the report
        result.error = f"{type(err).__name__}: {err}".strip()[-4000:]
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def compile_all(targets: list[str], cases: list[str] | None = None, jobs: int = 1) -> list[Compiled]:
    """Capture, specialize and compile every kernel launch of ``cases`` for each target."""
    _PLANNED[:] = [item for target in targets for item in plan(target, cases)]
    try:
        if jobs <= 1:
            return [_compile_planned(i) for i in range(len(_PLANNED))]
        # forked workers read the plan from this module (a kernel does not pickle); each returns its filled row
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_compile_planned, range(len(_PLANNED))))
    finally:
        _PLANNED.clear()


# ---------------------------------------------------------------------------------------------------------------------
# Report


def table(results: list[Compiled]) -> str:
    """A fixed-width table: kernel, target, regs, spills, shared bytes, compile seconds, then the config and (on the
    next line) the cases that launch it."""
    rows = [("kernel", "target", "regs", "spills", "shared", "s")]
    tails = ["config / cases"]
    for r in results:
        cells = ["FAIL" if not r.ok else "-" if v is None else str(v) for v in (r.regs, r.spills, r.shared)]
        rows += [(r.kernel, r.target, *cells, f"{r.seconds:.1f}"), ("",) * 6]
        tails += [r.config, "  " + ", ".join(r.cases)]
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = []
    for row, tail in zip(rows, tails, strict=True):
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells) + "  " + tail)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument("--case", nargs="*", default=None, help="case names, or substrings of them (default: all)")
    parser.add_argument("--json", default=None, help="write the rows (and the Triton version) to this JSON file")
    parser.add_argument("--jobs", type=int, default=1, help="compile processes")
    parser.add_argument("--list", action="store_true", help="print the specializations without compiling")
    args = parser.parse_args(argv)
    reason = unsupported()
    if reason:
        print(f"triton_compile: skipped: {reason}", file=sys.stderr)
        return 2
    targets = []
    for target, why in available_targets().items():
        if target in args.target and why:
            print(f"triton_compile: {target} skipped: {why}", file=sys.stderr)
        elif target in args.target:
            targets.append(target)
    cases = select_cases(args.case)
    if args.list:
        for target in targets:
            for result, _, _ in plan(target, cases):
                print(f"{result.kernel}  {target}  {result.config}  [{', '.join(result.cases)}]")
        return 0
    results = compile_all(targets, cases, args.jobs)
    print(table(results))
    for r in results:
        if not r.ok:
            print(f"\nFAILED {r.kernel} {r.target} {r.config}\n{r.error}", file=sys.stderr)
    if args.json:
        import triton

        doc = {"triton": triton.__version__, "torch": torch.__version__, "rows": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
