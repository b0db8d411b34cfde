"""Fused Mamba-1 mixer ("inner" op, mamba-ssm's ``mamba_inner_fn``): in_proj -> causal conv + SiLU -> x_proj ->
dt_proj -> selective scan (D skip, SiLU(z) gate) -> out_proj as ONE autograd node that owns every layout.

Layout: every (batch, channels, time) activation is stored channel-major with the batch folded into time, i.e. as a
(C, B·T) matrix, and handed to the kernels as the (B, C, T) view with strides (T, B·T, 1) (unit stride in time, which
is all the conv/scan kernels need; their batch and channel strides are kernel arguments). The kernels run through
the launchers ``causal_conv1d_triton._fwd`` / ``_bwd`` and ``selective_scan_triton._fwd`` / ``_bwd`` (the forwards
write into this op's buffers via ``out=``). Every projection, forward and backward, is then one plain 2-D GEMM whose
operands are row-major or transposed (cuBLAS reads both, no copy):

    xz    (2E, N) = W_in (2E, D) @ h^T           (N = B·T; h (N, D) row-major, read transposed)
    x_dbl (R+2S, N) = W_x @ conv_out (E, N)      (dt, B, C are row blocks: B, C reach the scan unit-stride in time)
    delta (E, N) = W_dt @ x_dbl[:R]
    out   (N, D) = y^T @ W_out^T                 (y (E, N) scan output, read transposed; out is (B, T, D) contiguous)

Saved for backward: h, the weights (as passed: recast in backward, or reused from ``cached_weight_casts``), xz,
x_dbl, y and the scan's states. The conv output and delta are recomputed in backward (mamba-ssm's checkpoint_lvl=1).
No (B, E, T) transposed copy and no ``cat``: dx and dz stay two buffers and d(in_proj) / dh are split GEMMs; dt/dB/dC
land in one preallocated dx_dbl.

GEMMs run in h's dtype (the autocast dtype under ``torch.autocast``: h is cast, the weights are cast inside); A_log, D
and dt_proj.bias in fp32 (fp64 for fp64 tests), the conv weights as given (the kernel accumulates in fp32). The four
weight-gradient GEMMs write the parameters' fp32 directly on GPUs (``wide_mm.grad_mm``: no bf16 rounding, no copy
kernel).

Two entry points share ``_forward`` / ``_backward``: eagerly a plain ``torch.autograd.Function`` (least host
overhead), under ``torch.compile`` the custom ops ``anytrain::mamba_inner_fwd`` / ``_bwd`` (``torch.library``,
opaque to the compiler, with fake kernels), so that a compiled block can fuse the norm and residual around it.
``set_mamba_inner(False)`` (``KernelsConfig.fused_mamba_inner``) makes ``use_mamba_inner`` false (the model then runs
the unfused composition).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from anytrain.kernels import ops
from anytrain.kernels.reference import causal_conv1d_ref, selective_scan_ref
from anytrain.kernels.wide_mm import grad_mm

_enabled = True


MAX_ELEMENTS = 2**31 - 1
"""The kernels index the (C, B·T) activations with 32-bit channel offsets: C·B·T must stay below 2^31."""


def use_mamba_inner(x: Tensor, d_inner: int | None = None) -> bool:
    """Whether the model should call the fused op: the Triton path is active for ``x`` (B, T, D), it is not disabled,
    and (given ``d_inner``) the (2·d_inner, B·T) activations fit 32-bit offsets; otherwise the unfused composition."""
    if d_inner is not None and 2 * d_inner * x.shape[0] * x.shape[1] > MAX_ELEMENTS:
        return False
    return _enabled and ops._use_triton(x)


def set_mamba_inner(flag: bool) -> None:
    """Enable / disable the fused op in the model (default on; ``KernelsConfig.fused_mamba_inner``)."""
    global _enabled
    _enabled = bool(flag)


def at_least_fp32(t: Tensor) -> Tensor:
    """fp32, or fp64 for fp64 tensors (the scan parameters A_log, D, delta bias)."""
    return t if t.dtype == torch.float64 else t.float()


_casts: dict | None = None  # inside cached_weight_casts(): id(weight) -> (weight, its version, dtype, the cast)
_cache_casts = True


def set_cast_cache(flag: bool) -> None:
    """Enable / disable ``cached_weight_casts`` (default on; ``KernelsConfig.cast_cache``)."""
    global _cache_casts
    _cache_casts = bool(flag)


@contextlib.contextmanager
def cached_weight_casts():
    """Inside: the fused op casts each weight to the compute dtype once and reuses the copy in every later forward and
    backward (the trainer wraps one optimizer step's micro-batches, between which the weights do not change): 4 casts
    per layer per optimizer step instead of 8 per micro-batch, for a bf16 copy of the four projections held through the
    micro-batches (2.5 GB at mamba-1.4b). A copy is reused only for the same tensor at the same version counter; never
    while a CUDA graph is being captured (a replay must cast the weights of its own step). The block must not span an
    optimizer step: fused / foreach optimizers and ``.data`` writes change weights without bumping their version
    counter. Nested calls share the outer cache; ``set_cast_cache(False)`` turns it off."""
    global _casts
    outer = _casts
    _casts = outer if outer is not None or not _cache_casts else {}
    try:
        yield
    finally:
        _casts = outer


def _cast(w: Tensor, dtype: torch.dtype) -> Tensor:
    """``w.to(dtype)``, from the cache inside ``cached_weight_casts``."""
    cache = _casts
    if w.dtype == dtype or cache is None or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return w.to(dtype)
    hit = cache.get(id(w))
    if hit is not None and hit[0] is w and hit[1] == w._version and hit[2] == dtype:
        return hit[3]
    cast = w.to(dtype)
    cache[id(w)] = (w, w._version, dtype, cast)
    return cast


def _cdiv(a, b):
    return -(-a // b)


def _bct(x2: Tensor, batch: int) -> Tensor:
    """(C, B·T) matrix -> (B, C, T) view with strides (T, B·T, 1)."""
    return x2.view(x2.shape[0], batch, -1).transpose(0, 1)


def _flat(x: Tensor) -> Tensor:
    """Inverse of ``_bct``: (B, C, T) with strides (T, B·T, 1) -> (C, B·T) view (a copy for any other layout)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _modules():
    return ops._triton_modules()[:2]  # (selective_scan_triton, causal_conv1d); imports triton on first use


def _scan_inputs(xz: Tensor, x_dbl: Tensor, conv_out: Tensor, delta: Tensor, A_log: Tensor, batch: int, R: int):
    """(B, E, T) views u, delta, z; B, C as (B, 1, S, T) views of x_dbl's row blocks; A = -exp(A_log) (E, S)."""
    E, S = conv_out.shape[0], A_log.shape[1]
    Bg = _bct(x_dbl[R : R + S], batch).unsqueeze(1)
    Cg = _bct(x_dbl[R + S :], batch).unsqueeze(1)
    A = -torch.exp(at_least_fp32(A_log))
    return _bct(conv_out, batch), _bct(delta, batch), _bct(xz[E:], batch), Bg, Cg, A


def _forward(h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out):
    """h (B, T, D) -> out (B, T, D), and the residuals xz (2E, N), x_dbl (R+2S, N), y (E, N), states."""
    scan_mod, conv_mod = _modules()
    batch, T, d_model = h.shape
    E, R = w_in.shape[0] // 2, w_dt.shape[1]
    xz = _cast(w_in, h.dtype) @ h.reshape(batch * T, d_model).t()  # (2E, N)
    conv_out = xz.new_empty(E, batch * T)  # (E, N)
    conv_mod._fwd(
        _bct(xz[:E], batch), conv_w.reshape(E, -1), conv_b, True, conv_mod.default_config(), out=_bct(conv_out, batch)
    )
    x_dbl = _cast(w_x, h.dtype) @ conv_out  # (R + 2S, N)
    delta = _cast(w_dt, h.dtype) @ x_dbl[:R]  # (E, N); dt_proj's bias and the softplus are applied in the scan
    u, dlt, z, Bg, Cg, A = _scan_inputs(xz, x_dbl, conv_out, delta, A_log, batch, R)
    y = torch.empty_like(conv_out)  # (E, N)
    scan_args = (u, dlt, A, Bg, Cg, at_least_fp32(D), z, at_least_fp32(dt_bias), True, scan_mod.default_config())
    _, states = scan_mod._fwd(*scan_args, out=_bct(y, batch))  # y written in place, (E, N) layout
    out = y.t() @ _cast(w_out, h.dtype).t()  # (N, D)
    return out.view(batch, T, -1), xz, x_dbl, y, states


def _backward(dout, h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out, xz, x_dbl, y, states, deterministic):
    """Gradients of h and of the 9 weights, each in its input's dtype."""
    scan_mod, conv_mod = _modules()
    batch, T, d_model = h.shape
    E, R, dtype = w_in.shape[0] // 2, w_dt.shape[1], h.dtype
    w_in_c, w_x_c, w_dt_c, w_out_c = (_cast(w, dtype) for w in (w_in, w_x, w_dt, w_out))
    h2, dout2 = h.reshape(-1, d_model), dout.to(dtype).reshape(-1, d_model)  # (N, D)
    conv_w2, x = conv_w.reshape(E, -1), _bct(xz[:E], batch)
    conv_out = torch.empty_like(y)  # recomputed (E, N)
    conv_mod._fwd(x, conv_w2, conv_b, True, conv_mod.default_config(), out=_bct(conv_out, batch))
    delta = w_dt_c @ x_dbl[:R]  # recomputed (E, N)
    u, dlt, z, Bg, Cg, A = _scan_inputs(xz, x_dbl, conv_out, delta, A_log, batch, R)
    dy = w_out_c.t() @ dout2.t()  # (E, N)
    dw_out = grad_mm(dout2.t(), y.t(), w_out.dtype)  # (D, E)
    du, ddelta, dz, dB, dC, dA, dD, dbias = scan_mod._bwd(
        _bct(dy, batch),
        u,
        dlt,
        A,
        Bg,
        Cg,
        at_least_fp32(D),
        z,
        at_least_fp32(dt_bias),
        states,
        True,
        scan_mod.default_config(),
        deterministic,
    )  # du, ddelta, dz: (B, E, T) in the layout of u, delta, z (empty_like); dB, dC (B, 1, S, T) fp32
    du2, ddelta2, dz2 = _flat(du), _flat(ddelta), _flat(dz)  # (E, N) views
    dx_dbl = torch.empty_like(x_dbl)  # (R + 2S, N): dt, B, C gradients in place, no cat
    torch.mm(w_dt_c.t(), ddelta2, out=dx_dbl[:R])
    S = A_log.shape[1]
    _bct(dx_dbl[R : R + S], batch).copy_(dB.squeeze(1))
    _bct(dx_dbl[R + S :], batch).copy_(dC.squeeze(1))
    dw_dt = grad_mm(ddelta2, x_dbl[:R].t(), w_dt.dtype)  # (E, R)
    dw_x = grad_mm(dx_dbl, conv_out.t(), w_x.dtype)  # (R + 2S, E)
    du2.addmm_(w_x_c.t(), dx_dbl)  # + the x_proj path: d conv_out (E, N)
    # dx in x's (T, B·T, 1) layout (empty_like); dconv_w, dconv_b in conv_w's and conv_b's dtypes
    dx, dconv_w, dconv_b = conv_mod._bwd(x, conv_w2, conv_b, _bct(du2, batch), True, conv_mod.default_config())
    dx2 = _flat(dx)  # (E, N)
    dw_in = torch.empty_like(w_in)  # (2E, D) in w_in's dtype: the x and z halves as two GEMMs (no dxz cat)
    grad_mm(dx2, h2, w_in.dtype, out=dw_in[:E])
    grad_mm(dz2, h2, w_in.dtype, out=dw_in[E:])
    dh = (dx2.t() @ w_in_c[:E]).addmm_(dz2.t(), w_in_c[E:])  # (N, D)
    return (
        dh.view(h.shape),
        dw_in.to(w_in.dtype),
        dconv_w.view(conv_w.shape),
        dconv_b,
        dw_x.to(w_x.dtype),
        dw_dt.to(w_dt.dtype),
        dbias.to(dt_bias.dtype),
        (dA * A).to(A_log.dtype),
        dD.to(D.dtype),
        dw_out.to(w_out.dtype),
    )


def _forward_op(h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out, deterministic):
    del deterministic  # used by the backward (saved by setup_context)
    return _forward(h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out)


class _MambaInnerFn(torch.autograd.Function):
    """The eager path: one autograd node (``_forward`` / ``_backward``)."""

    @staticmethod
    def forward(ctx, h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out, deterministic):
        out, xz, x_dbl, y, states = _forward(h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out)
        ctx.save_for_backward(h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out, xz, x_dbl, y, states)
        ctx.deterministic = deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*_backward(dout, *ctx.saved_tensors, ctx.deterministic), None)


_WEIGHTS = "Tensor w_in, Tensor conv_w, Tensor conv_b, Tensor w_x, Tensor w_dt, Tensor dt_bias, Tensor A_log, Tensor D"
_FWD_SCHEMA = f"(Tensor h, {_WEIGHTS}, Tensor w_out, bool deterministic) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
_BWD_SCHEMA = (
    f"(Tensor dout, Tensor h, {_WEIGHTS}, Tensor w_out, Tensor xz, Tensor x_dbl, Tensor y, Tensor states, "
    "bool deterministic) -> (" + ", ".join(["Tensor"] * 10) + ")"
)


def _register_custom_ops() -> bool:
    """``anytrain::mamba_inner_fwd`` / ``_bwd`` for torch.compile (torch >= 2.4); False where the API is missing."""
    pair = ops.define_op_pair("mamba_inner", _forward_op, _FWD_SCHEMA, _backward, _BWD_SCHEMA)
    if pair is None:
        return False
    fwd_op, bwd_op = pair

    @fwd_op.register_fake
    def _(h, w_in, conv_w, conv_b, w_x, w_dt, dt_bias, A_log, D, w_out, deterministic):
        (batch, T, _), E, S, N = h.shape, w_in.shape[0] // 2, A_log.shape[1], h.shape[0] * h.shape[1]
        nsub = _cdiv(T, _modules()[0].SAVE_EVERY)
        acc = torch.float64 if torch.float64 in (h.dtype, A_log.dtype) else torch.float32
        return (
            h.new_empty(batch, T, w_out.shape[0]),
            h.new_empty(2 * E, N),
            h.new_empty(w_x.shape[0], N),
            h.new_empty(E, N),
            h.new_empty(batch, E, S, nsub, dtype=acc),
        )

    @bwd_op.register_fake
    def _(dout, h, *rest):
        return tuple(torch.empty_like(t) for t in (h, *rest[:9]))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:10], *output[1:])
        ctx.deterministic = inputs[10]
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    def backward(ctx, dout, *unused):
        return (*torch.ops.anytrain.mamba_inner_bwd(dout, *ctx.saved_tensors, ctx.deterministic), None)

    torch.library.register_autograd("anytrain::mamba_inner_fwd", backward, setup_context=setup_context)
    return True


HAS_CUSTOM_OP = _register_custom_ops()


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The autocast dtype for x's device when autocast is on and would cast x (fp32/fp16/bf16), else None."""
    if x.dtype == torch.float64 or not torch.is_autocast_enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


def mamba_inner_triton(
    h: Tensor,
    in_proj_weight: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor,
    x_proj_weight: Tensor,
    dt_proj_weight: Tensor,
    dt_proj_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
    out_proj_weight: Tensor,
    deterministic: bool | None = None,
) -> Tensor:
    """The fused op on the Triton kernels (see ``mamba_inner`` for the arguments). ``deterministic``: default
    ``anytrain.ops.is_deterministic()``."""
    dtype = _autocast_dtype(h)
    h = h if dtype is None else h.to(dtype)
    det = ops.is_deterministic() if deterministic is None else bool(deterministic)
    args = (h, in_proj_weight, conv1d_weight, conv1d_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D)
    if HAS_CUSTOM_OP and torch.compiler.is_compiling():
        return torch.ops.anytrain.mamba_inner_fwd(*args, out_proj_weight, det)[0]
    return _MambaInnerFn.apply(*args, out_proj_weight, det)


def mixer_composition(
    h,
    in_proj_weight,
    conv1d_weight,
    conv1d_bias,
    x_proj_weight,
    dt_proj_weight,
    dt_proj_bias,
    A_log,
    D,
    out_proj_weight,
    conv_fn,
    scan_fn,
    projections=None,
) -> Tensor:
    """The unfused mixer (``MambaMixer``'s computation) on the given ops, autograd through it: ``conv_fn`` /
    ``scan_fn`` with the ``causal_conv1d`` / ``selective_scan`` signatures (the public dispatching ops, or the
    reference twins). in_proj and dt_proj are computed channel-major as mamba-ssm does, so x, z and delta reach the
    kernels with unit stride along time. ``projections``: (in_proj, out_proj) modules to call instead of the two
    weights' matmuls (Linear layers that compute otherwise, e.g. FP8 training's); in_proj's output is then
    token-major, and the kernels copy x and z to unit stride along time."""
    batch, T, _ = h.shape
    E, R, S = in_proj_weight.shape[0] // 2, dt_proj_weight.shape[1], A_log.shape[1]
    if projections is None:
        xz = (in_proj_weight @ h.reshape(batch * T, -1).t()).view(-1, batch, T).transpose(0, 1)  # (B, 2E, T)
    else:
        xz = projections[0](h).transpose(1, 2)  # (B, T, 2E) -> (B, 2E, T)
    x, z = xz.chunk(2, dim=1)  # (B, E, T) each
    x = conv_fn(x, conv1d_weight.reshape(E, -1), conv1d_bias, activation="silu")  # (B, E, T)
    dt, b, c = F.linear(x.transpose(1, 2), x_proj_weight).split([R, S, S], dim=-1)  # (B, T, R), (B, T, S) x 2
    dt = (dt_proj_weight @ dt.reshape(batch * T, R).t()).view(-1, batch, T).transpose(0, 1)  # (B, E, T)
    A = -torch.exp(at_least_fp32(A_log))  # (E, S), fp32 as the kernels require (fp64 in fp64 tests)
    # out = (scan(u) + D·u) · SiLU(z); dt_proj's bias and the softplus are applied inside the scan
    y = scan_fn(
        x,
        dt,
        A,
        b.transpose(1, 2),
        c.transpose(1, 2),
        D=at_least_fp32(D),
        z=z,
        delta_bias=at_least_fp32(dt_proj_bias),
        delta_softplus=True,
    )  # (B, E, T)
    if projections is not None:
        return projections[1](y.transpose(1, 2).contiguous())  # (B, T, D); row-wise FP8 casts need it contiguous
    return F.linear(y.transpose(1, 2), out_proj_weight)  # (B, T, D)


def mamba_inner_ref(
    h,
    in_proj_weight,
    conv1d_weight,
    conv1d_bias,
    x_proj_weight,
    dt_proj_weight,
    dt_proj_bias,
    A_log,
    D,
    out_proj_weight,
) -> Tensor:
    """The unfused composition on the PyTorch reference ops (``MambaMixer``'s computation), autograd through it."""
    weights = (in_proj_weight, conv1d_weight, conv1d_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D)
    return mixer_composition(h, *weights, out_proj_weight, causal_conv1d_ref, selective_scan_ref)


def mamba_inner(
    h: Tensor,
    in_proj_weight: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor,
    x_proj_weight: Tensor,
    dt_proj_weight: Tensor,
    dt_proj_bias: Tensor,
    A_log: Tensor,
    D: Tensor,
    out_proj_weight: Tensor,
) -> Tensor:
    """Mamba-1 mixer, h (B, T, D) -> (B, T, D). Weights as ``MambaMixer`` holds them: in_proj (2E, D), conv1d (E, 1, K)
    or (E, K) with bias (E,), x_proj (R + 2S, E), dt_proj (E, R) with bias (E,), A_log (E, S) (A = -exp(A_log)), D (E,),
    out_proj (D, E); no in/out_proj biases; delta_softplus always on. Triton (fused, one autograd node) per the
    ``anytrain.kernels`` backend rules, else ``mamba_inner_ref``."""
    args = (h, in_proj_weight, conv1d_weight, conv1d_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D)
    if ops._use_triton(h):
        return mamba_inner_triton(*args, out_proj_weight)
    return mamba_inner_ref(*args, out_proj_weight)
