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

import contextlib
import warnings

import torch
from torch import Tensor

_ok = {"mm": True, "addmm": True}  # cleared if this build/device cannot run the overload with out_dtype
_NARROW = (torch.bfloat16, torch.float16)


def _wide(op: str, a: Tensor, dtype: torch.dtype) -> bool:
    return _ok[op] and a.is_cuda and dtype == torch.float32 and a.dtype in _NARROW


def _give_up(op: str, err: Exception) -> None:
    _ok[op] = False
    warnings.warn(
        f"{op} with an fp32 out_dtype failed ({err}); weight gradients fall back to a bf16 product + cast", stacklevel=3
    )


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
# A linear layer whose weight gradient comes out of the GEMM in the parameter's dtype (and, across the micro-batches
# of an optimizer step in a one-process run, is summed by the GEMM as well)

_accumulate = False  # process-wide (the trainer's one training thread), not thread-local
_accumulate_on = True  # set_gemm_accumulate / KernelsConfig.gemm_accumulate
accumulated = 0  # weight gradients summed into .grad by their GEMM since import (read by the tests)


@contextlib.contextmanager
def accumulate_in_gemm(enabled: bool = True):
    """Inside (when ``enabled``): a ``wide_linear`` weight gradient whose parameter already holds a gradient (the
    second and later micro-batches of an optimizer step) is added to that gradient by the GEMM itself (``add_mm_``:
    ``addmm`` into ``.grad``), instead of a new fp32 product that ``AccumulateGrad`` then adds: one pass over the
    weight-sized gradient instead of three. The sum is handed back through autograd (``.grad`` is cleared and the
    summed tensor returned, so ``AccumulateGrad``, which runs next, takes it as the gradient). Taken only when that
    hand-back is sure to happen and to be plain: the backward will run the parameter's ``AccumulateGrad`` (not for
    ``torch.autograd.grad`` or ``backward(inputs=...)`` that skip it; a compiled backward cannot tell, see
    ``_accumulates_here``), grad mode is off (no ``create_graph``) and the
    parameter has no tensor hooks (which would see, and could rescale, the running sum); post-accumulate hooks see
    ``.grad`` as always. Eager activation checkpointing recomputes the forward with detached parameters, which have no
    ``.grad``: those layers keep the plain path (same result). A backward that fails part-way leaves the parameters
    it reached with ``.grad`` None (the step is lost either way). The Transformer's ``ParallelizePlan.step_context``
    enters it around the micro-batches of a one-process optimizer step (no DDP reducer hooks), whose only backward
    passes are the trainer's ``loss.backward()``.
    ``set_gemm_accumulate(False)`` turns it off; a nested ``accumulate_in_gemm(False)`` does not turn off an enclosing
    one."""
    global _accumulate
    outer = _accumulate
    _accumulate = outer or (enabled and _accumulate_on)
    try:
        yield
    finally:
        _accumulate = outer


def set_gemm_accumulate(flag: bool) -> None:
    """Enable / disable ``accumulate_in_gemm`` (default on; ``KernelsConfig.gemm_accumulate``)."""
    global _accumulate_on
    _accumulate_on = bool(flag)


def weight_grad(a: Tensor, b: Tensor, weight: Tensor) -> Tensor:
    """``a @ b`` in ``weight``'s dtype (``grad_mm``): the gradient of ``weight``; inside ``accumulate_in_gemm``,
    summed with ``weight.grad`` by the GEMM when that is a plain contiguous tensor of the weight's dtype and shape."""
    global accumulated
    acc = weight.grad if _accumulate and not torch.is_grad_enabled() and not weight._backward_hooks else None
    if (
        acc is not None
        and type(acc) is torch.Tensor
        and acc.dtype == weight.dtype
        and not acc.requires_grad
        and acc.shape == (a.shape[0], b.shape[1])
        and acc.is_contiguous()
        and _accumulates_here(weight)
    ):
        add_mm_(acc, a, b)
        weight.grad = None  # AccumulateGrad (next for this parameter) takes the sum back as .grad
        accumulated += 1
        return acc
    return grad_mm(a, b, weight.dtype)


def _accumulates_here(weight: Tensor) -> bool:
    """Whether the running backward will execute ``weight``'s ``AccumulateGrad`` (False for ``autograd.grad`` and
    ``backward(inputs=...)`` without it). Inside the compiled op, where autograd's dispatch is off, the leaf's node
    cannot be found (it is reached through a view): True there, which is why ``accumulate_in_gemm`` is open only
    around micro-batches whose backward passes are the trainer's own ``loss.backward()``."""
    try:
        with torch.enable_grad():  # a leaf's edge is found through a view, which needs grad mode (off in backward)
            node = torch.autograd.graph.get_gradient_edge(weight).node
    except AttributeError:  # the view recorded no grad_fn: autograd's dispatch keys are off (the compiled op)
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):  # no such API, or not inside a backward
        return False


def _register_weight_grad_op():
    """``anytrain::weight_grad`` = ``weight_grad`` as one opaque op for torch.compile: it reads and clears the
    parameter's ``.grad`` at run time, which a traced graph cannot; None where torch lacks ``custom_op``."""
    library = torch.library
    if not all(hasattr(library, n) for n in ("custom_op", "register_fake")):
        return None
    # it reads and clears .grad at run time: a CUDA graph replay (inductor's cudagraphs) must not skip its body
    tags = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
    try:
        op = library.custom_op(
            "anytrain::weight_grad", mutates_args=(), tags=tags, schema="(Tensor a, Tensor b, Tensor weight) -> Tensor"
        )(weight_grad)
    except (TypeError, RuntimeError, ValueError):
        return None

    @op.register_fake
    def _(a, b, weight):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=weight.dtype)

    return op


_weight_grad_op = _register_weight_grad_op()


class _WideLinearFn(torch.autograd.Function):
    """``F.linear(x.to(dtype), weight.to(dtype))`` (no bias) whose weight gradient is one GEMM in weight's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
        xc, wc = x.to(dtype), weight.to(dtype)  # the casts autocast would make (weight: one per call, as autocast)
        ctx.save_for_backward(xc, wc, weight)  # the parameter itself: weight_grad may sum into its .grad
        ctx.x_dtype = x.dtype
        return torch.nn.functional.linear(xc, wc)

    @staticmethod
    def backward(ctx, dy: Tensor):
        xc, wc, weight = ctx.saved_tensors
        dy = dy.to(wc.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ wc).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # (out, N) @ (N, in): the weight's layout, in its dtype, from the GEMM
            compiling = torch.compiler.is_compiling() and _weight_grad_op is not None
            fn = _weight_grad_op if compiling else weight_grad  # the op costs host time in eager mode
            dw = fn(dy.reshape(-1, dy.shape[-1]).t(), xc.reshape(-1, xc.shape[-1]), weight)
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
