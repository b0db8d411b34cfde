"""Mamba-2 in the cost model: parameters and FLOPs per token equal the model's own, the SSD's FLOPs equal what
torch.utils.flop_counter counts on the real mixer, the activations equal the bytes autograd saves in a real block
(the PyTorch SSD on CPU; the Triton SSD under the interpreter), the host's op count, and the planner's answers."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # if this module is the first to import triton (Triton SSD test)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from anytrain.config import ModelConfig, RunConfig  # noqa: E402
from anytrain.cost.devices import get_device  # noqa: E402
from anytrain.cost.memory import mamba2_activation_bytes_per_token  # noqa: E402
from anytrain.cost.model import AMP, FSDP_BF16, Layout, Workload, estimate  # noqa: E402
from anytrain.cost.planner import candidate_layouts, plan  # noqa: E402
from anytrain.cost.shapes import Mamba2Shape, shape_from_config  # noqa: E402
from anytrain.models import build_model  # noqa: E402
from anytrain.models.mamba2.model import MAMBA2_FLAVOURS, Mamba2, Mamba2Args, Mamba2Block, Mamba2Mixer  # noqa: E402
from tests.unit.test_cost_model import _saved_bytes  # noqa: E402

# E 32, H 8 heads of 4, N 5, one group, C = 42 conv channels, in_proj 82 rows, chunk 8 (3 chunks at 24 positions)
SMALL = dict(vocab_size=64, d_model=16, n_layers=1, d_state=5, headdim=4, expand=2, chunk_size=8)


@pytest.mark.parametrize("flavour", list(MAMBA2_FLAVOURS))
def test_shape_matches_the_model(flavour):
    cfg = ModelConfig(arch="mamba2", flavour=flavour)
    with torch.device("meta"):
        model = build_model(cfg)
    shape = shape_from_config(RunConfig(model=cfg))
    assert isinstance(shape, Mamba2Shape) and shape.num_params == model.num_params()
    for seq in (1, 100, 2048, 4096):
        assert shape.flops_per_token(seq) == pytest.approx(model.flops_per_token(seq), rel=1e-12)
        assert shape.ssd_flops_per_token(seq) == pytest.approx(model.ssd_flops_per_token(seq), rel=1e-12)


@pytest.mark.parametrize("ngroups, seq", [(1, 24), (2, 32), (1, 40)])
def test_ssd_flops_are_what_the_flop_counter_counts_on_the_mixer(ngroups, seq):
    """Forward + backward of one real mixer: the counted matmul FLOPs = 6·(in_proj + out_proj weights) per token (the
    projections' share of 6·N, as mm) + the SSD's 6·(Q·(G·N + E) + 2·E·N) per token (its einsums, as bmm). The
    depthwise conv's weights are in 6·N; the counter rates its CPU convolution as a dense one, so it is left out.
    (Sequences of several whole chunks: with one chunk the PyTorch SSD skips the zero entering state's and the unused
    end state's gradients; with a partial chunk it computes on the padding.)"""
    args = Mamba2Args(**{**SMALL, "ngroups": ngroups})
    torch.manual_seed(0)
    mixer = Mamba2Mixer(args)
    mixer.reset_parameters()
    h = torch.randn(2, seq, args.d_model, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        mixer(h).sum().backward()
    shape = Mamba2Shape.from_args(args)
    tokens = 2 * seq
    projections = 6 * (sum(w.numel() for w in mixer.in_proj_weights()) + mixer.out_proj.weight.numel())
    counts = {op.__name__: flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert counts["mm"] == projections * tokens  # in_proj and out_proj
    assert counts["bmm"] == shape.ssd_flops_per_token(seq) * tokens  # the SSD's einsums


def _block_saved(mode: str, residual_fp32: bool) -> tuple[int, Mamba2Shape]:
    args = Mamba2Args(**SMALL, residual_in_fp32=residual_fp32)
    torch.manual_seed(0)
    block = Mamba2Block(args)
    block.mixer.reset_parameters()
    if mode == "bf16":
        block = block.to(torch.bfloat16)
    dtype = torch.float32 if residual_fp32 or mode != "bf16" else torch.bfloat16
    h = torch.randn(2, 24, args.d_model, dtype=dtype, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "amp"):
            return block(h)

    return _saved_bytes(step, [*block.parameters(), h]), Mamba2Shape.from_args(args)


def _expected(shape: Mamba2Shape, mode: str, ssd_kernel: str) -> float:
    """The formula for 48 tokens, less the block input (the test's own tensor), plus the per-call tensors."""
    prec = AMP if mode == "amp" else FSDP_BF16
    d, e, h, q = shape.dim, shape.d_inner, shape.nheads, shape.chunk(24)
    per_token = mamba2_activation_bytes_per_token(shape, prec, 24, ssd_kernel) - (4 * d if mode == "amp" else 0)
    # autocast's bf16 copies of in_proj and out_proj (compute_copy in the cost model); the H-vectors A and D
    per_call = 2 * (d * shape.in_proj_dim + e * d) if mode == "amp" else 4 * e + 4 * d  # bf16: fp32 norm weights
    per_call += 2 * 4 * h
    if ssd_kernel == "torch":  # the twin's two (Q, Q) masks, the per-chunk decays, dt_bias, its cast conv weight
        per_call += 2 * q * q + 4 * 2 * h * 3 + (4 * h if mode == "bf16" else 0)
        per_call += 2 * shape.conv_dim * shape.d_conv if mode == "amp" else 4 * shape.conv_dim * shape.d_conv
    else:  # the Triton conv saves the conv_{x,B,C} weights and biases stacked (in the parameters' dtype)
        per_call += (4 if mode == "amp" else 2) * shape.conv_dim * (shape.d_conv + 1)
    return per_token * 48 + per_call


@pytest.mark.parametrize("mode", ["amp", "bf16"])
def test_block_saves_what_the_formula_counts_with_the_pytorch_ssd(mode):
    from anytrain.kernels import ops

    backend = ops.get_backend()
    ops.set_backend("reference")
    try:
        saved, shape = _block_saved(mode, residual_fp32=mode == "amp")
    finally:
        ops.set_backend(backend)
    assert saved == _expected(shape, mode, "torch")


@pytest.mark.parametrize("mode", ["amp", pytest.param("bf16", marks=pytest.mark.slow)])
def test_block_saves_what_the_formula_counts_with_the_triton_ssd(mode):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    import importlib.util

    from anytrain.kernels import ops

    if importlib.util.find_spec("anytrain.kernels.ssd_triton") is None:
        pytest.skip("this tree's SSD has no Triton kernels")
    backend = ops.get_backend()
    ops.set_backend("triton")
    try:
        saved, shape = _block_saved(mode, residual_fp32=mode == "amp")
    finally:
        ops.set_backend(backend)
    assert saved == _expected(shape, mode, "triton")


def test_eager_ops_per_block_grow_with_the_chunks():
    from torch.utils._python_dispatch import TorchDispatchMode

    from anytrain.kernels import ops

    # the view ops test_cost_model.test_eager_ops_per_block leaves out (no kernel, no host work to speak of)
    views = {"view", "_unsafe_view", "t", "transpose", "expand", "unsqueeze", "squeeze", "permute", "slice"}
    views |= {"select", "split", "split_with_sizes", "unbind", "as_strided", "alias", "detach", "reshape"}
    views |= {"unflatten", "flatten", "_reshape_alias", "chunk"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ not in views
            return func(*args, **(kwargs or {}))

    def ops_per_block(seq: int) -> int:
        counts = []
        for layers in (1, 2):
            model = Mamba2(Mamba2Args(vocab_size=64, d_model=32, n_layers=layers, d_state=8, headdim=8, chunk_size=16))
            tokens = torch.randint(0, 64, (2, seq))
            with Count() as count:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(tokens, tokens)
                loss.backward()
            counts.append(count.n)
        return counts[1] - counts[0]

    backend = ops.get_backend()
    ops.set_backend("reference")
    try:
        shape = Mamba2Shape(1, 32, 64, 8, 8, 1, 4, 16, 64)
        assert [ops_per_block(seq) for seq in (32, 64)] == [shape.eager_ops(32), shape.eager_ops(64)]
    finally:
        ops.set_backend(backend)


def test_plan_and_estimate_for_mamba2():
    shape = shape_from_config(RunConfig(model=ModelConfig(arch="mamba2", flavour="1.3b")))
    h200 = get_device("h200")
    assert {lay.tp for lay in candidate_layouts(shape, 8, 8, 64)} == {1}
    wl = Workload(2048, 64)
    est = estimate(shape, Layout(dp=8, strategy="fsdp", micro_batch=8), wl, h200)
    assert est.flops_per_step == shape.flops_per_token(2048) * 64 * 2048
    twin = estimate(shape, Layout(dp=8, strategy="fsdp", micro_batch=8), Workload(2048, 64, ssd_kernel="torch"), h200)
    assert twin.allocated_gib > 2 * est.allocated_gib and twin.step_s > est.step_s  # the (H, Q, Q) tensors
    full = estimate(shape, Layout(dp=8, strategy="fsdp", micro_batch=8, ac="full"), wl, h200)
    assert full.memory["activations"] == pytest.approx(4 * 2048 * 8 * 2048 * 48)  # fp32 block inputs only
    assert plan(shape, h200, 8, wl).recommended.fits


def test_compiled_rows_peak_memory_matches_the_committed_h200_measurements():
    """The peak the cost model predicts for the compiled Mamba-2 and hybrid recipes on one GPU (the Triton SSD)
    against what one H200 measured (bench/results/mamba2_train_nvidia-h200.json): checkpointed, where inductor keeps
    the matmul outputs inside each block (``compiled_checkpoint_kept``, from the committed memory snapshot), and
    without checkpointing (the compiled count, fused norms). Within 5%; the eager count alone would miss the first by
    -35% and the second by +85%."""
    import json
    from pathlib import Path

    from anytrain.config import load_config
    from anytrain.cost.memory import memory_phases
    from anytrain.cost.shapes import GIB, trainer_precision

    results = json.loads((Path(__file__).parents[2] / "bench/results/mamba2_train_nvidia-h200.json").read_text())
    rows = results["rows"] + [results["noac_row"]["row"]]  # the recipe without checkpointing: an earlier call's row
    measured = {(r["row"], r["activation_checkpointing"]): r for r in rows if r["stack"] == "anytrain"}
    checked = 0
    for row, ac in (("mamba2-1.3b", "full"), ("mamba2-1.3b-noac", "none"), ("hybrid-1.2b", "full")):
        r = measured[(row, ac)]
        overrides = ["--train.micro_batch", str(r["micro"]), "--train.global_batch", str(r["global_batch"])]
        overrides += ["--train.activation_checkpointing", ac, "--train.compile", str(r["compile"]).lower()]
        cfg = load_config(r["recipe"], overrides)
        layout = Layout(micro_batch=r["micro"], ac=ac)
        phases = memory_phases(
            shape_from_config(cfg), layout, Workload.from_config(cfg, ssd_kernel="triton"), trainer_precision("ddp")
        )
        predicted = max(sum(p.values()) for p in phases.values()) / GIB
        assert predicted == pytest.approx(r["peak_mem_gib"], rel=0.05), (row, predicted, r["peak_mem_gib"])
        checked += 1
    assert checked == 3


def _committed(name: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[2] / "bench/results" / name).read_text())


def test_ssd_efficiency_is_the_committed_h200_op_rate():
    """``Device.ssd_efficiency``: the SSD's matmul FLOPs (forward + backward) of the mamba2-1.3b layer at batch 4, seq
    4096, over the Triton op's measured forward + backward time (bench/results/ssd_nvidia-h200.json, both calls)."""
    results = _committed("ssd_nvidia-h200.json")
    shape = shape_from_config(RunConfig(model=ModelConfig(arch="mamba2", flavour="1.3b")))
    seq = results["shape"]["seqlen"]
    flops_per_layer = shape.ssd_flops_per_token(seq) / shape.n_layers
    h200 = get_device("h200")
    rates = []
    for rows in (results["rows"], results["repeat"]["rows"]):
        (row,) = [r for r in rows if r["layer"] == "mamba2-1.3b" and r["batch"] == 4 and not r["z"]]
        rates.append(flops_per_layer * 4 * seq / (row["ours_fwdbwd_ms"] * 1e-3 * h200.peak_flops))
    assert h200.ssd_efficiency == pytest.approx(sum(rates) / len(rates), rel=0.03), rates


@pytest.mark.parametrize("row", ["mamba2-1.3b", "hybrid-1.2b"])
def test_compiled_recipes_step_time_is_within_20_percent_of_the_h200_rows(row):
    """The step time predicted for the compiled, checkpointed Mamba-2 and hybrid recipes on one H200 against the
    committed side-by-side rows (bench/results/mamba2_train_nvidia-h200.json). With the Triton SSD's FLOPs at the
    dense GEMMs' efficiency the Mamba-2 row was predicted at 0.80x."""
    from anytrain.config import load_config

    (r,) = [r for r in _committed("mamba2_train_nvidia-h200.json")["rows"] if r["row"] == row]
    overrides = ["--train.micro_batch", str(r["micro"]), "--train.global_batch", str(r["global_batch"])]
    cfg = load_config(r["recipe"], overrides)
    layout = Layout(micro_batch=r["micro"], ac=r["activation_checkpointing"])
    est = estimate(shape_from_config(cfg), layout, Workload.from_config(cfg, ssd_kernel="triton"), get_device("h200"))
    measured = r["tokens_per_step"] / r["tokens_per_s"]
    assert 0.8 <= est.step_s / measured <= 1.2, (est.step_s, measured)
