"""Triton SSD (Mamba-2) on a GPU: real layer shapes against the PyTorch twin in fp32 on the same (rounded) inputs, and
the odd shapes against the float64 recurrence.

Errors are measured relative to each tensor's largest magnitude (max |got - ref| / max |ref|): bf16 inputs put bf16
operands into the matmuls (a 2^-8 rounding per operand, accumulated in fp32), so the bound is a few 1e-3 for the
output and per-position gradients and looser for dA and d dt_bias (sums over every position and channel). In fp32
the decays exp(cs_l - cs_s) are differences of fp32 cumulative sums inside a chunk (as in mamba-ssm's kernels), which
costs up to about 1e-4 relative where a head decays fast; the fp32 bound is 1e-3.
Run on a lent GPU: ``PYTHONPATH=src python3 -m pytest -q tests/gpu/test_ssd_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # skip before importing the kernels (CPU runs use the interpreter, see tests/unit)
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

from anytrain.kernels import ops  # noqa: E402
from anytrain.kernels.reference import ssd_scan_ref  # noqa: E402
from anytrain.kernels.ssd import ssd_chunk_scan, ssd_chunk_scan_torch  # noqa: E402
from anytrain.kernels.ssd_triton import ssd_chunk_scan_triton  # noqa: E402

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "init")
NARROW = ("x", "dt", "B", "C", "z")  # the activations (the model's parameters A, D, dt_bias stay fp32)


def mamba2_inputs(b, L, h, p, g, n, dtype, *, z=True, d_per_channel=False, init=False, seed=0):
    """Inputs as a Mamba-2 layer gives them: dt around softplus's knee with dt_bias from the mamba-ssm init (step
    0.001-0.1), A = -exp(A_log) with A_log = log U[1, 16], x, B, C, z standard normal."""
    gen = torch.Generator("cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    step = torch.exp(torch.rand(h, generator=gen, device="cuda") * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    args = {
        "x": randn(b, L, h, p),
        "dt": randn(b, L, h),
        "A": -torch.empty(h, device="cuda").uniform_(1, 16, generator=gen),
        "B": randn(b, L, g, n),
        "C": randn(b, L, g, n),
        "D": randn(h, p) if d_per_channel else randn(h),
        "dt_bias": step + torch.log(-torch.expm1(-step)),
    }
    if z:
        args["z"] = randn(b, L, h, p)
    if init:
        args["init"] = randn(b, h, p, n)
    return {k: v.to(dtype) if k in NARROW else v for k, v in args.items()}


def run(fn, args, chunk, cast=None, **kw):
    """(y, final state, gradients) of ``fn`` for a fixed cotangent; ``cast`` converts the inputs first (the
    reference's dtype)."""
    leaves = {k: (v if cast is None else v.to(cast)).detach().clone().requires_grad_() for k, v in args.items()}
    xs = [leaves[k] for k in ("x", "dt", "A", "B", "C")]
    opt = {k: leaves.get(k) for k in ("D", "z", "dt_bias")}
    extra = (chunk,) if fn is not ssd_scan_ref else ()
    y, state = fn(*xs, *extra, **opt, initial_states=leaves.get("init"), return_final_states=True, **kw)
    gen = torch.Generator("cuda").manual_seed(7)
    gy = torch.randn(y.shape, generator=gen, device="cuda").to(y.dtype)
    gs = torch.randn(state.shape, generator=gen, device="cuda").to(state.dtype)
    names = [k for k in NAMES if k in leaves]
    grads = torch.autograd.grad((y * gy).sum() + (state * gs).sum(), [leaves[k] for k in names])
    return y, state, dict(zip(names, grads, strict=True))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), "non-finite values"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def assert_rel(got, ref, tol: float, sums_tol: float) -> None:
    errs = {"y": rel_err(got[0], ref[0]), "final": rel_err(got[1], ref[1])}
    errs.update({f"d{k}": rel_err(v, ref[2][k]) for k, v in got[2].items()})
    bad = {k: e for k, e in errs.items() if e > (sums_tol if k in ("dA", "ddt_bias", "dD") else tol)}
    assert not bad, f"relative errors above tolerance: {bad} (all: {errs})"


def triton_op(*args, **kw):
    return ssd_chunk_scan_triton(*args, **kw)


@pytest.mark.parametrize(("nheads", "batch"), [(32, 2), (64, 2), (80, 2), (64, 4)])
def test_layer_shapes_bf16_match_the_fp32_twin(nheads, batch):
    """mamba2-1.3b / 2.7b layers (headdim 64, d_state 128, one group, chunk 256, seq 4096) in bf16."""
    args = mamba2_inputs(batch, 4096, nheads, 64, 1, 128, torch.bfloat16, seed=nheads)
    ours = run(triton_op, args, 256, dt_softplus=True)
    assert ours[0].dtype == torch.bfloat16 and all(ours[2][k].dtype == args[k].dtype for k in ours[2])
    ref = run(ssd_chunk_scan_torch, args, 256, cast=torch.float32, dt_softplus=True)
    assert_rel(ours, ref, 2e-2, 5e-2)


def test_layer_shape_fp32_groups_documents_and_initial_state():
    """fp32 (full-precision matmuls), 8 groups, z, D per channel, an initial state and document boundaries."""
    b, L, h = 2, 2048, 32
    args = mamba2_inputs(b, L, h, 64, 8, 64, torch.float32, d_per_channel=True, init=True, seed=1)
    seq_idx = torch.zeros(b, L, dtype=torch.long, device="cuda")
    for start in (300, 512, 1500):
        seq_idx[0, start:] += 1
    ours = run(triton_op, args, 256, dt_softplus=True, seq_idx=seq_idx)
    ref = run(ssd_chunk_scan_torch, args, 256, dt_softplus=True, seq_idx=seq_idx)
    assert_rel(ours, ref, 1e-3, 5e-3)


@pytest.mark.parametrize(
    ("L", "chunk", "h", "g", "p", "n"),
    [
        (1, 256, 3, 1, 64, 128),  # one position
        (2, 256, 5, 1, 64, 128),
        (3, 64, 7, 7, 32, 16),  # as many groups as heads
        (1000, 256, 6, 2, 64, 128),  # not a multiple of the chunk
        (300, 128, 9, 3, 48, 96),  # headdim and dstate not powers of two
    ],
)
def test_odd_shapes_match_the_float64_recurrence(L, chunk, h, g, p, n):
    args = mamba2_inputs(2, L, h, p, g, n, torch.float32, init=True, seed=L)
    seq_idx = torch.zeros(2, L, dtype=torch.long, device="cuda")
    seq_idx[1, L // 2 :] = 1
    ours = run(triton_op, args, chunk, dt_softplus=True, seq_idx=seq_idx)
    ref = run(ssd_scan_ref, args, chunk, cast=torch.float64, dt_softplus=True, seq_idx=seq_idx)
    assert_rel(ours, ref, 1e-3, 5e-3)


def test_public_op_takes_the_triton_path_on_gpu_and_repeats_bitwise():
    args = mamba2_inputs(2, 1024, 16, 64, 1, 128, torch.bfloat16, seed=3)
    assert ops._use_triton(args["x"])
    first, second = (run(ssd_chunk_scan, args, 256, dt_softplus=True) for _ in range(2))
    assert torch.equal(first[0], second[0])
    for k, grad in first[2].items():
        assert torch.equal(grad, second[2][k]), k


def test_compiled_checkpointed_mamba2_block_is_one_graph_with_the_eager_values():
    """A Mamba-2 block at the 1.3b width under torch.compile (inductor) and bf16 autocast, checkpointed as
    train.activation_checkpointing does it: one graph (the Triton conv and SSD are custom ops inside it; a graph break
    in a checkpointed region would run the whole block eagerly), and the eager block's output and input gradient."""
    from torch.utils.checkpoint import checkpoint

    from anytrain.models.mamba2.model import Mamba2Args, Mamba2Block

    torch.manual_seed(0)
    block = Mamba2Block(Mamba2Args(d_model=2048, n_layers=1)).cuda()
    block.mixer.reset_parameters()

    def f(h):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return checkpoint(block, h, use_reentrant=False)

    h = torch.randn(2, 1024, 2048, device="cuda", requires_grad=True)
    eager = f(h)
    (grad,) = torch.autograd.grad(eager.float().pow(2).mean(), h)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(h)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(f)(h)
    (compiled_grad,) = torch.autograd.grad(compiled.float().pow(2).mean(), h)
    torch._dynamo.reset()
    assert (compiled.float() - eager.float()).abs().max() <= 2e-2 * eager.float().abs().max()
    assert (compiled_grad - grad).abs().max() <= 2e-2 * grad.abs().max()
