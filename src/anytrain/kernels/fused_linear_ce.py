"""Chunked linear + cross-entropy: the LM head and its loss without full-batch fp32 logits.

``linear_cross_entropy(hidden, weight, targets)`` = ``F.cross_entropy((hidden @ weight.T).float(), targets)`` (mean over
targets != ignore_index). Rows are processed in chunks: per chunk the logits are formed in the compute dtype, a row
kernel takes the fp32 log-sum-exp and overwrites the logits *in place* with the gradient
``(softmax - onehot) / n_valid`` (Liger-Kernel's trick), and the chunk's input and weight gradients are accumulated
right away. Gradients are therefore computed in forward and only scaled by ``grad_output`` in backward: no logits are
kept for backward and none is recomputed. Peak extra memory: one chunk of logits (~256 MiB by default) plus the fp32
weight-gradient accumulator, instead of the (N, V) logits in bf16 + fp32 + fp32 log-softmax + fp32 gradient.

Row op backends: the Triton kernel ``_ce_rows_kernel`` on GPU tensors (CUDA and ROCm), the pure-PyTorch twin
``ce_rows_ref`` on CPU or with the kernel backend "reference" (``anytrain.kernels.set_backend``); tests run the kernel
on CPU under ``TRITON_INTERPRET=1``.
Shapes: N rows (tokens), D model width, V vocabulary.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from anytrain.kernels import ops
from anytrain.kernels.wide_mm import add_mm_, grad_mm

# Triton ships with CUDA/ROCm torch wheels; on CPU it is optional (interpreter tests). It is imported at first kernel
# use, not with the model: tests must be able to set TRITON_INTERPRET=1 before anything imports it.
triton: Any = None
tl: Any = None  # the kernel's globals; bound by _kernel()

IGNORE_INDEX = -100
LOGITS_CHUNK_BYTES = 256 * 2**20  # one chunk of logits in the compute dtype


# ---------------------------------------------------------------------------------------------------------------------
# Row op: loss per row and, in place, the logits gradient


def ce_rows_ref(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    write_grad: bool = True,
) -> torch.Tensor:
    """Reference twin of the row kernel. logits (n, V), targets (n,), scale (1,) -> loss per row (n,) in fp32
    (float64 for float64 logits). With ``write_grad`` overwrites ``logits`` with ``(softmax - onehot) * scale``,
    zero on ignored rows. Math in fp32 (or float64)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc)  # (n, V)
    lse = torch.logsumexp(x, dim=-1)  # (n,)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    picked = x.gather(1, safe[:, None])[:, 0]
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
    if write_grad:
        grad = x.sub_(lse[:, None]).exp_()  # softmax (n, V), in place (x may be logits itself)
        grad.scatter_add_(1, safe[:, None], -torch.ones_like(grad[:, :1]))
        grad.mul_((scale.to(acc) * valid.to(acc))[:, None])
        if grad is not logits:
            logits.copy_(grad)
    return loss


def _ce_rows_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    loss_ptr,
    scale_ptr,
    V,
    ignore_index,
    BLOCK_V: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    """One program per row: online max / sum-exp over V (first sweep), loss = lse - x[target]; then (second sweep)
    the row is overwritten with (exp(x - lse) - onehot) * scale. Loads in the logits dtype, math in fp32."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = target != ignore_index
    safe = tl.where(valid, target, 0)
    x_target = tl.load(base + safe).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_target, 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            g = tl.where(offs == safe, p - 1.0, p) * scale
            tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=offs < V)


_JITTED: dict[str, object] = {}


def triton_importable() -> bool:
    return triton is not None or importlib.util.find_spec("triton") is not None


def _kernel():
    """Import Triton and JIT-wrap the kernel at first use."""
    global triton, tl
    if "ce_rows" not in _JITTED:
        import triton as _triton
        import triton.language as _tl

        triton, tl = _triton, _tl
        _JITTED["ce_rows"] = triton.jit(_ce_rows_kernel)
    return _JITTED["ce_rows"]


def ce_rows_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    write_grad: bool = True,
    block_v: int | None = None,
) -> torch.Tensor:
    """Triton row kernel (same contract as ``ce_rows_ref``). logits must have a contiguous last dim."""
    kernel = _kernel()
    n, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    loss_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss = torch.empty(n, device=logits.device, dtype=loss_dtype)
    if n == 0:
        return loss
    block = block_v or min(triton.next_power_of_2(vocab), 4096)
    kernel[(n,)](
        logits,
        logits.stride(0),
        targets.contiguous(),
        loss,
        scale.to(torch.float32).contiguous(),
        vocab,
        ignore_index,
        BLOCK_V=block,
        WRITE_GRAD=write_grad,
        num_warps=8 if block >= 2048 else 4,
    )
    return loss


def _use_triton(t: torch.Tensor) -> bool:
    if ops.get_backend() == "reference" or not triton_importable():
        return False
    return t.is_cuda  # CUDA and ROCm tensors; the interpreter is for tests, which call ce_rows_triton directly


def ce_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    write_grad: bool = True,
) -> torch.Tensor:
    """Dispatch: Triton on GPU tensors, the reference twin otherwise."""
    if _use_triton(logits) and logits.dtype != torch.float64:
        return ce_rows_triton(logits, targets, scale, ignore_index, write_grad)
    return ce_rows_ref(logits, targets, scale, ignore_index, write_grad)


# ---------------------------------------------------------------------------------------------------------------------
# Chunked linear + cross-entropy


def default_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Equal row chunks whose logits stay under LOGITS_CHUNK_BYTES (at least one row)."""
    total = n_rows * vocab * torch.empty((), dtype=dtype).element_size()
    n_chunks = max(1, math.ceil(total / LOGITS_CHUNK_BYTES))
    return max(1, math.ceil(n_rows / n_chunks))


def _loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_rows: int,
    grad_hidden: bool,
    grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """hidden (N, D), weight (V, D), targets (N,) -> (mean loss fp32 scalar, dHidden (N, D), dWeight (V, D)).

    dWeight is accumulated in fp32 when the compute dtype is narrower. No host synchronisation."""
    n_rows = hidden.shape[0]
    valid = targets != ignore_index
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    n_valid = valid.sum().to(acc_dtype)
    scale = n_valid.reciprocal().reshape(1)  # d(mean)/d(row loss); inf when nothing is valid (loss is then nan)
    write_grad = grad_hidden or grad_weight
    loss_sum = torch.zeros((), device=hidden.device, dtype=acc_dtype)
    d_hidden = torch.empty_like(hidden) if grad_hidden else None
    d_weight = None
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h = hidden[start:end]  # (n, D)
        logits = h @ weight.t()  # (n, V) in the compute dtype
        loss_sum += ce_rows(logits, targets[start:end], scale, ignore_index, write_grad).sum()
        grad = logits  # now (softmax - onehot) / n_valid, (n, V)
        if d_hidden is not None:
            torch.mm(grad, weight, out=d_hidden[start:end])  # (n, D)
        if grad_weight:  # (V, D) in fp32, summed over chunks by the GEMM itself on GPUs (wide_mm)
            d_weight = grad_mm(grad.t(), h, acc_dtype) if d_weight is None else add_mm_(d_weight, grad.t(), h)
    if grad_weight and d_weight is None:  # no rows
        d_weight = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype)
    return loss_sum / n_valid, d_hidden, d_weight


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk_rows: int
    ) -> torch.Tensor:
        loss, d_hidden, d_weight = _loss_and_grads(
            hidden, weight, targets, ignore_index, chunk_rows, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        d_hidden, d_weight = ctx.saved_tensors
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = d_hidden * grad_out.to(d_hidden.dtype)
        if ctx.needs_input_grad[1]:
            gw = (d_weight * grad_out.to(d_weight.dtype)).to(ctx.weight_dtype)
        return gh, gw, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` over rows whose target != ignore_index.

    hidden (..., D), weight (V, D), targets (...) int64, all in one dtype (the caller casts for autocast). Returns
    an fp32 scalar (float64 for float64 inputs). Differentiable in hidden and weight."""
    hidden2d = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    targets1d = targets.reshape(-1)  # (N,)
    rows = chunk_rows or default_chunk_rows(hidden2d.shape[0], weight.shape[0], hidden2d.dtype)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not needs_grad:
        return _loss_and_grads(hidden2d, weight, targets1d, ignore_index, rows, False, False)[0]
    return _LinearCrossEntropy.apply(hidden2d, weight, targets1d, ignore_index, rows)
