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
