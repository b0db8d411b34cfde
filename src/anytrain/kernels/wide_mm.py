"""Weight-gradient GEMMs in the parameters' fp32 straight from bf16/fp16 operands (cuBLAS / hipBLASLt, torch >= 2.8).

A weight gradient computed under autocast is a bf16 product that is then copied to the fp32 parameter dtype and, with
gradient accumulation, added to an fp32 buffer: three passes over a weight-sized tensor and a bf16 rounding of every
partial sum. ``mm`` / ``addmm`` with ``out_dtype`` write (or accumulate into) fp32 from the GEMM itself. Used by the
fused Mamba mixer's four weight gradients and by the chunked linear + cross-entropy's head gradient. Elsewhere (CPU,
fp32 operands), or if an overload is missing or fails once (each of the two has its own flag; out-of-memory errors
are raised, not taken for a missing overload), the plain product in the operands' dtype is cast (the autocast
behaviour) for the rest of the process, with one warning.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

_ok = {"mm": True, "addmm": True}  # cleared if this build/device cannot run the overload with out_dtype
_NARROW = (torch.bfloat16, torch.float16)


def _wide(op: str, a: Tensor, dtype: torch.dtype) -> bool:
    return _ok[op] and a.is_cuda and dtype == torch.float32 and a.dtype in _NARROW


def _give_up(op: str, err: Exception) -> None:
    _ok[op] = False
    warnings.warn(f"{op} with an fp32 out_dtype failed ({err}); weight gradients fall back to a bf16 product + cast",
                  stacklevel=3)  # fmt: skip


def grad_mm(a: Tensor, b: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """``a @ b`` in ``dtype`` (the parameter's), into ``out`` when given: one fp32-output GEMM for bf16/fp16 operands
    and an fp32 parameter on a GPU; elsewhere the product in the operands' dtype, cast."""
    if _wide("mm", a, dtype):
        try:
            if out is None:
                return torch.mm(a, b, out_dtype=dtype)
            return torch.mm(a, b, out_dtype=dtype, out=out)
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError) as err:
            _give_up("mm", err)
    if out is None:
        return (a @ b).to(dtype)
    return torch.mm(a, b, out=out) if a.dtype == out.dtype else out.copy_(a @ b)


def add_mm_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b`` in acc's dtype, in place, returns acc: one GEMM whose epilogue adds the fp32 accumulator
    (``addmm`` with ``out_dtype`` and ``out=acc``) for bf16/fp16 operands on a GPU; elsewhere ``addmm_`` when the
    dtypes agree, else the product in the operands' dtype added to acc."""
    if _wide("addmm", a, acc.dtype):
        try:
            return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError) as err:
            _give_up("addmm", err)
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    acc += a @ b
    return acc


# ---------------------------------------------------------------------------------------------------------------------
# A linear layer whose weight gradient comes out of the GEMM in the parameter's dtype


def _register_grad_mm_op():
    """``anytrain::grad_mm`` = ``grad_mm`` as one opaque op for torch.compile (its fallback is a Python try/except,
    which a compiled graph cannot hold); None where torch lacks ``torch.library.custom_op`` (then eager calls)."""
    library = torch.library
    if not all(hasattr(library, n) for n in ("custom_op", "register_fake")):
        return None
    try:
        op = library.custom_op("anytrain::grad_mm", mutates_args=(),
                               schema="(Tensor a, Tensor b, ScalarType dtype) -> Tensor")(grad_mm)  # fmt: skip
    except (TypeError, RuntimeError, ValueError):  # API variants of older torch
        return None

    @op.register_fake
    def _(a, b, dtype):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)

    return op


_grad_mm_op = _register_grad_mm_op() or grad_mm


class _WideLinearFn(torch.autograd.Function):
    """``F.linear(x.to(dtype), weight.to(dtype))`` (no bias) whose weight gradient is one GEMM in weight's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
        xc, wc = x.to(dtype), weight.to(dtype)  # the casts autocast would make (weight: one per call, as autocast)
        ctx.save_for_backward(xc, wc)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return torch.nn.functional.linear(xc, wc)

    @staticmethod
    def backward(ctx, dy: Tensor):
        xc, wc = ctx.saved_tensors
        dy = dy.to(wc.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ wc).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # (out, N) @ (N, in): the weight's layout, in its dtype, from the GEMM
            mm = _grad_mm_op if torch.compiler.is_compiling() else grad_mm  # the op costs host time in eager mode
            dw = mm(dy.reshape(-1, dy.shape[-1]).t(), xc.reshape(-1, xc.shape[-1]), ctx.w_dtype)
        return dx, dw, None


def wide_linear_dtype(x: Tensor, weight: Tensor) -> torch.dtype | None:
    """The compute dtype when ``wide_linear`` applies to ``F.linear(x, weight)``: gradients on, autocast on for x's
    device with a bf16/fp16 dtype and a plain fp32 weight (not a tensor subclass such as a sharded DTensor, whose GEMMs
    go through its own dispatch); else None (use F.linear, which also reuses autocast's cached weight casts)."""
    device_type = x.device.type
    if not torch.is_grad_enabled() or not torch.is_autocast_enabled(device_type) or weight.dtype != torch.float32:
        return None
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in _NARROW else None


def wide_linear(x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``x @ weight.T`` computed in ``dtype`` (autocast's result), with weight's gradient produced by the GEMM in
    weight's dtype (``grad_mm``): no bf16 rounding of the weight gradient and no separate copy to fp32, which autocast's
    cast node does in backward. Forward and input gradient are autocast's (same GEMMs, same dtypes). The weight is cast
    on every call: autocast's cache, which shares one cast between calls inside one autocast region, is not reachable
    from here (the trainer turns the path off for eager pipeline stages, whose schedule runs every micro-batch in one
    region; elsewhere each micro-batch has its own region or compiled graph, which cast per call anyway)."""
    return _WideLinearFn.apply(x, weight, dtype)
