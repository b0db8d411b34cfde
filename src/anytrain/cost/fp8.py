"""FP8 training (``train.fp8``, torchao's float8) in the cost model: which GEMMs convert, their FP8 rate, the cast
overheads, the operand and all-gather bytes. ``model.estimate`` and ``memory.memory_phases`` call these when
``Workload.fp8`` is a recipe; docs/cost-model.md ("FP8") has the closed forms and their sources.

* **Which GEMMs.** The family's candidates (``shape.fp8_candidates()``: the blocks' linears that its
  ``ParallelizePlan.fp8_linears`` names; never the LM head) filtered by ``parallel.fp8.gemm_keep_reason``, the same
  predicate the trainer applies (alignment to 16; with ``fp8_filter`` auto torchao's small-GEMM thresholds).
* **Rate.** A converted linear's 6·K·N FLOPs per token run at the device's dense FP8 peak × ``fp8_efficiency``
  (rowwise_with_gw_hp: the weight-gradient third stays at the bf16 rate); everything else at the bf16 rate.
* **Casts** (memory-bound, per converted linear, forward + backward), after torchao's float8 roofline
  (``torchao/testing/training/roofline_utils.py``, ``get_tensor_memory_traffic_ovhd_s``, without fusion into the
  previous op), bytes per element of a source of ``a`` bytes:

  ============================  ==========================  =======================
  recipe                        input, output gradient      weight
  ============================  ==========================  =======================
  tensorwise                    2a + 2 (amax; cast writing  3a + 2 (amax; a cast in
                                both layouts)               forward and backward)
  rowwise                       3a + 2 (cast + transposed   4a + 2 (cast, transpose,
                                copy; cast of the copy)     cast)
  rowwise_with_gw_hp            a + 1 (forward cast only)   2a + 2
  ============================  ==========================  =======================

  The weight's source is its fp32 master under autocast (a = 4; autocast's own weight cast is then not made) and the
  bf16 parameter under FSDP (a = 2); with FSDP's FP8 all-gather (tensorwise) the weights arrive cast, and each
  gather casts the fp32 shard instead ((4 + 1)/z per element) after one amax pass per step (4/z), the backward
  making a transposed copy (2 per element).
* **Operands.** An FP8 GEMM reads its operands in 1 byte and writes its output in a: (a + 2)·(K + N) per token for
  the three GEMMs (rowwise_with_gw_hp: (2a + 1)·(K + N), its weight gradient reading bf16), (2 + a)·K·N weight
  bytes per micro-batch, against 3·a·(K + N) and 3·a·K·N in high precision.
* **Memory.** Eager, torchao saves the linear's high-precision input and its weight parameter, as ``nn.Linear``
  does. In a compiled Transformer block under tensorwise or rowwise the partitioner keeps the input's FP8 cast (1
  byte) in place
  of the a-byte input wherever every consumer of that input is converted (``saved_input_savings_per_token``: the
  attention norm's output for q, k, v; the attention output for o; the MLP norm's output for w1 and w3; the SwiGLU
  product for w2), a term read from the measured FP8 peaks (docs/cost-model.md, "FP8"), not from a saved-tensor count.
  At Llama-3.2-3B the rowwise rows peak exactly where the tensorwise rows do (q alone converts, so the shared
  input of q, k, v stays in a bytes either way); rowwise_with_gw_hp's weight gradient reads the high-precision
  input, so nothing is saved there (no measured row). Under autocast the
  converted weights have no bf16 copy (the cast goes straight from fp32 to FP8 inside the layer); FSDP's FP8
  all-gather holds 1 byte per converted parameter gathered.
"""

from __future__ import annotations

from typing import Any

from anytrain.errors import ConfigError
from anytrain.parallel.fp8 import RECIPES, fp8_all_gather, gemm_keep_reason

__all__ = [
    "RECIPES",
    "cast_bytes_per_token",
    "cast_weight_bytes",
    "check_fp8",
    "converted_linears",
    "converted_params_per_layer",
    "fp8_all_gather",
    "gather_bytes_per_param",
    "gemm_split_per_token",
    "operand_bytes_per_token",
    "operand_weight_bytes",
    "saved_input_savings_per_token",
]

ACT_CAST = {"tensorwise": (2, 2), "rowwise": (3, 2), "rowwise_with_gw_hp": (1, 1)}
"""Cast bytes per element of an input or output gradient: (multiple of the source bytes a, FP8 bytes written)."""
WEIGHT_CAST = {"tensorwise": (3, 2), "rowwise": (4, 2), "rowwise_with_gw_hp": (2, 2)}
"""Cast bytes per element of a weight: (multiple of the source bytes, FP8 bytes written)."""


def converted_linears(shape: Any, recipe: str, fp8_filter: str) -> list[tuple[int, int]]:
    """(in, out) widths of the block linears that ``recipe`` runs in FP8 (per block; none with ``recipe`` 'none'):
    the family's candidates the trainer's filter keeps (``parallel.fp8.gemm_keep_reason``)."""
    if recipe == "none":
        return []
    candidates = shape.fp8_candidates()
    if candidates is None:
        return []
    return [(k, n) for k, n in candidates if gemm_keep_reason(n, k, recipe, fp8_filter) is None]


def check_fp8(shape: Any, device: Any, recipe: str, fp8_filter: str) -> None:
    """A ConfigError naming ``train.fp8`` where the trainer would refuse the run: an unknown recipe, a device without
    FP8 matmuls (``Device.peak_fp8_tflops`` 0), a family without FP8 candidates, or no candidate left by the filter."""
    if recipe == "none":
        return
    if recipe not in RECIPES:
        raise ConfigError(f"train.fp8: unknown recipe {recipe!r}; choose none or one of {', '.join(RECIPES)}")
    if not device.peak_fp8_tflops:
        raise ConfigError(f"train.fp8: {device.name} has no FP8 matmuls (no dense FP8 rate); use bf16 (fp8 none)")
    kind = getattr(shape, "kind", "transformer")
    if shape.fp8_candidates() is None:
        raise ConfigError(f"train.fp8: FP8 training is not implemented for {kind}; set --train.fp8 none")
    if not converted_linears(shape, recipe, fp8_filter):
        hint = "--train.fp8_filter aligned, or " if fp8_filter == "auto" else ""
        raise ConfigError(
            f"train.fp8: none of the model's candidate Linear layers can take FP8 under {recipe} "
            f"(train.fp8_filter {fp8_filter}; docs/fp8.md); set {hint}--train.fp8 none"
        )


def converted_params_per_layer(shape: Any, recipe: str, fp8_filter: str) -> int:
    """Weight elements per block in converted linears (Σ K·N)."""
    return sum(k * n for k, n in converted_linears(shape, recipe, fp8_filter))


def gemm_split_per_token(shape: Any, recipe: str, fp8_filter: str) -> float:
    """Model FLOPs per token that run in FP8: L × Σ 6·K·N over the converted linears (4·K·N for
    rowwise_with_gw_hp, whose weight-gradient GEMM stays high precision)."""
    share = 4.0 if recipe == "rowwise_with_gw_hp" else 6.0
    return shape.n_layers * share * converted_params_per_layer(shape, recipe, fp8_filter)


def cast_bytes_per_token(shape: Any, recipe: str, fp8_filter: str, act: int) -> float:
    """Cast traffic of the converted linears' inputs (K per token) and output gradients (N), forward + backward,
    per token, L blocks (the table in the module docstring)."""
    if recipe == "none":
        return 0.0
    times, written = ACT_CAST[recipe]
    widths = sum(k + n for k, n in converted_linears(shape, recipe, fp8_filter))
    return shape.n_layers * (times * act + written) * widths


def cast_weight_bytes(shape: Any, recipe: str, fp8_filter: str, source: int, gathered_fp8: bool) -> float:
    """Cast traffic of the converted weights per micro-batch, L blocks: (times·source + written)·K·N; with FSDP's
    FP8 all-gather only the backward's transposed copy of each gathered FP8 weight (2·K·N: the gathers' casts are in
    ``parameter_traffic_bytes``)."""
    if recipe == "none":
        return 0.0
    params = shape.n_layers * converted_params_per_layer(shape, recipe, fp8_filter)
    if gathered_fp8:
        return 2.0 * params
    times, written = WEIGHT_CAST[recipe]
    return (times * source + written) * params


def operand_bytes_per_token(shape: Any, recipe: str, fp8_filter: str, act: int) -> float:
    """Change of the GEMMs' activation-operand traffic per token from FP8 operands (negative: fewer bytes): per
    converted linear (a + 2)·(K + N) (rowwise_with_gw_hp (2a + 1)·(K + N)) instead of 3·a·(K + N), L blocks."""
    if recipe == "none":
        return 0.0
    widths = sum(k + n for k, n in converted_linears(shape, recipe, fp8_filter))
    fp8 = (2 * act + 1) if recipe == "rowwise_with_gw_hp" else (act + 2)
    return shape.n_layers * (fp8 - 3 * act) * widths


def operand_weight_bytes(shape: Any, recipe: str, fp8_filter: str, act: int) -> float:
    """Change of the GEMMs' weight-operand traffic per micro-batch: (2 + a)·K·N per converted weight (read in FP8
    by the forward and the input-gradient GEMM, its gradient written in a) instead of 3·a·K·N, L blocks."""
    if recipe == "none":
        return 0.0
    return shape.n_layers * (2 + act - 3 * act) * converted_params_per_layer(shape, recipe, fp8_filter)


def saved_input_savings_per_token(shape: Any, recipe: str, fp8_filter: str, act: int, compiled: bool) -> float:
    """Activation bytes per token and block that a compiled Transformer block under tensorwise or rowwise does not
    keep: (a − 1) per element of each saved matmul input whose consumers are all converted (the module docstring's
    "Memory"); 0 for rowwise_with_gw_hp, eager blocks and the other families (their blocks save other tensors)."""
    if (
        recipe not in ("tensorwise", "rowwise")
        or not compiled
        or getattr(shape, "kind", "transformer") != "transformer"
    ):
        return 0.0
    candidates = shape.fp8_candidates()
    keep = [gemm_keep_reason(n, k, recipe, fp8_filter) is None for k, n in candidates]
    # the linears in candidate order: q, k, v, o, then w1, w3, w2 (SwiGLU) or w1, w2 (GELU); groups share an input
    groups = [(0, 1, 2), (3,), (4, 5), (6,)] if len(candidates) == 7 else [(0, 1, 2), (3,), (4,), (5,)]
    width = sum(candidates[g[0]][0] for g in groups if all(keep[i] for i in g))
    return (act - 1) * width


def gather_bytes_per_param(gather: float, recipe: str, strategy: str) -> float:
    """Bytes per converted parameter that FSDP all-gathers: 1 (FP8) for tensorwise under FSDP/HSDP, else ``gather``."""
    fsdp = "fsdp" if strategy in ("fsdp", "hsdp") else strategy
    return 1.0 if recipe != "none" and fp8_all_gather(recipe, fsdp) else gather
