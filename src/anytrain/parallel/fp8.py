"""FP8 training through torchao's float8 (``train.fp8``): the blocks' ``nn.Linear`` layers become torchao
``Float8Linear`` modules, which cast their input, weight and output gradient to FP8 with dynamic scales and run the
three GEMMs of each layer as scaled FP8 matmuls (``torch._scaled_mm``). No FP8 GEMM is written here.

* **Which layers.** The family's ``ParallelizePlan.fp8_linears`` names the candidates (never the LM head); of those,
  layers whose in or out features are not multiples of 16 (what ``_scaled_mm`` requires) stay high precision, and with
  ``train.fp8_filter: auto`` so do the GEMMs too small to gain from FP8: torchao's ``_auto_filter_for_recipe``
  thresholds (torchtitan's ``auto_filter_small_kn``), in ``small_gemm``. docs/fp8.md says where they come from.
* **Recipes** are torchao's (``Float8LinearConfig.from_recipe_name``); the float8 dtypes are the device's
  (``hardware.fp8_dtypes``: e4m3fn/e5m2, or e4m3fnuz/e5m2fnuz on gfx942). ``train.fp8_emulate`` runs torchao's
  emulation (the casts as on hardware, the matmuls in high precision), on any device.
* **Order.** ``anytrain.parallel.parallelize`` converts first, before TP -> activation checkpointing -> compile -> FSDP
  / DDP, so every later step sees Float8Linear modules. The parameters stay the layers' own high-precision
  ``weight`` / ``bias`` under the same names: checkpoints, the optimizer and export are unchanged, and a run resumes
  with another ``train.fp8``.
* **FSDP with tensorwise scaling** all-gathers the weights in FP8 (``enable_fsdp_float8_all_gather``: half the bytes
  of bf16) and ``attach_fp8`` makes their scales in one all-reduce after each optimizer step
  (``precompute_float8_dynamic_scale_for_fsdp``) instead of one per weight during the all-gathers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

from anytrain import hardware
from anytrain.config import TrainConfig
from anytrain.errors import ConfigError
from anytrain.models import spec_of

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (``Float8LinearRecipeName``); ``train.fp8`` takes these or none."""
INSTALL_HINT = "pip install 'anytrain[fp8]'"
ALIGNMENT = 16
"""``torch._scaled_mm`` needs both GEMM dimensions of the weight to be multiples of 16."""

_notes: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""Each candidate layer -> its recipe when converted, or why it stays high precision ('misaligned' / 'small'), for
``attach_fp8``'s log line (the modules themselves carry nothing of it)."""


def small_gemm(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether a Linear layer with weight (N, K) = (out_features, in_features) is too small to gain from FP8 under
    ``recipe``: torchao's ``_auto_filter_for_recipe`` thresholds (torchao/float8/float8_linear_utils.py), which
    torchtitan applies as ``auto_filter_small_kn``. tensorwise: K <= 4096 and N <= 1024; rowwise: N <= 2048, or
    K <= 1024, or N <= 4096 and K <= 2048. torchao has no thresholds for rowwise_with_gw_hp; its forward and input
    gradient are rowwise's and its weight gradient stays high precision, so rowwise's thresholds apply."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def keep_reason(linear: nn.Linear, recipe: str, fp8_filter: str) -> str | None:
    """Why this candidate layer stays high precision ('misaligned' / 'small'), or None to convert it."""
    return gemm_keep_reason(linear.out_features, linear.in_features, recipe, fp8_filter)


def gemm_keep_reason(out_features: int, in_features: int, recipe: str, fp8_filter: str) -> str | None:
    """``keep_reason`` for a weight of shape (out_features, in_features) (the cost model asks with widths)."""
    n, k = out_features, in_features
    if n % ALIGNMENT or k % ALIGNMENT:
        return "misaligned"
    if fp8_filter == "auto" and small_gemm(recipe, n, k):
        return "small"
    return None


@contextlib.contextmanager
def _quiet_import():
    """Import torchao without its start-up warnings about optional kernel libraries anytrain does not use."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def torchao_float8():
    """``torchao.float8``, or a ConfigError saying how to install it."""
    try:
        with _quiet_import():
            import torchao.float8 as float8
    except ImportError:
        raise ConfigError(f"train.fp8: needs the torchao package: {INSTALL_HINT} (or set --train.fp8 none)") from None
    return float8


def linear_config(recipe: str, emulate: bool, device: torch.device, fsdp_all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` for ``recipe`` with this device's float8 dtypes, ``emulate``, and (tensorwise
    under FSDP) the FP8 all-gather of the weights."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    e4m3, e5m2 = hardware.fp8_dtypes(device)
    ours = {
        torch.float8_e4m3fn: e4m3,
        torch.float8_e4m3fnuz: e4m3,
        torch.float8_e5m2: e5m2,
        torch.float8_e5m2fnuz: e5m2,
    }
    casts = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name.startswith("cast_config")}
    casts = {name: dataclasses.replace(cast, target_dtype=ours[cast.target_dtype]) for name, cast in casts.items()}
    return dataclasses.replace(config, **casts, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)


def fp8_layers(model: nn.Module, candidates: list[str], recipe: str, fp8_filter: str) -> tuple[list[str], dict]:
    """(the candidates to convert, {kept candidate: 'misaligned' | 'small'})."""
    convert, kept = [], {}
    for name in candidates:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"fp8_linears names {name}, a {type(linear).__name__}, not an nn.Linear")
        reason = keep_reason(linear, recipe, fp8_filter)
        if reason is None:
            convert.append(name)
        else:
            kept[name] = reason
    return convert, kept


def convert_to_fp8(
    model: nn.Module,
    recipe: str,
    emulate: bool,
    module_filter: Callable[[nn.Module, str], bool],
    device: torch.device,
    fsdp_all_gather: bool = False,
) -> nn.Module:
    """Swap the ``nn.Linear`` layers of ``model`` for which ``module_filter(module, name)`` holds for torchao
    ``Float8Linear`` (same parameters, same names), in place."""
    float8 = torchao_float8()
    config = linear_config(recipe, emulate, device, fsdp_all_gather)
    float8.convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    if fsdp_all_gather:
        from torchao.float8.float8_linear import Float8Linear

        for module in model.modules():
            if isinstance(module, Float8Linear):
                module.register_state_dict_post_hook(_plain_weight)
    return model


def _plain_weight(_module: nn.Module, state_dict: dict, prefix: str, _metadata) -> None:
    """State-dict post-hook of an FP8 layer whose weight FSDP all-gathers in FP8: the weight's entry as the plain
    high-precision tensor it wraps (torchao's ``WeightWithDynamicFloat8CastTensor``, same storage), so checkpoints hold
    ordinary tensors (loadable without torchao, by bf16 runs and export) and loading still writes into the weight."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(local, WeightWithDynamicFloat8CastTensor):
        return
    if isinstance(value, DTensor):
        state_dict[key] = DTensor.from_local(
            local._tensor,
            value.device_mesh,
            value.placements,
            shape=value.shape,
            stride=value.stride(),
            run_check=False,
        )
    else:
        state_dict[key] = local._tensor


def apply_fp8(
    model: nn.Module,
    candidates: list[str],
    recipe: str,
    emulate: bool,
    fp8_filter: str,
    device: torch.device,
    fsdp_all_gather: bool = False,
) -> list[str]:
    """Convert the candidates that pass the filter (``fp8_layers``); returns their names. A ConfigError when none
    does (the run would train in high precision while saying FP8)."""
    convert, kept = fp8_layers(model, candidates, recipe, fp8_filter)
    if not candidates:
        raise ConfigError(
            "train.fp8: the model's blocks have no nn.Linear layer to convert (GPT-2's Conv1D, say); set "
            "--train.fp8 none"
        )
    if not convert:
        reasons = list(kept.values())
        counts = ", ".join(f"{reasons.count(why)} {why}" for why in ("misaligned", "small") if why in reasons)
        hint = "--train.fp8_filter aligned, or " if "small" in kept.values() else ""
        raise ConfigError(
            f"train.fp8: none of the model's {len(candidates)} candidate Linear layers can take FP8 "
            f"({counts}; docs/fp8.md); set {hint}--train.fp8 none"
        )
    wanted = set(convert)
    convert_to_fp8(model, recipe, emulate, lambda _module, name: name in wanted, device, fsdp_all_gather)
    for name in candidates:
        _notes[model.get_submodule(name)] = kept.get(name, recipe)
    return convert


def convert_model(model: nn.Module, train: TrainConfig, strategy: str, device: torch.device) -> list[str]:
    """``train.fp8`` on a model or pipeline stage (the first step of ``parallelize``, with the resolved data-parallel
    ``strategy``): torchao and the device checked (``check_device``), then the family's candidates
    (``ParallelizePlan.fp8_linears``) converted as ``apply_fp8`` does. Returns their names."""
    spec = spec_of(model)
    if spec.parallelize_plan.fp8_linears is None:
        raise ConfigError(f"train.fp8: FP8 training is not implemented for {spec.name}; set --train.fp8 none")
    torchao_float8()  # installed?
    check_device(train.fp8, train.fp8_emulate, device)
    candidates = spec.parallelize_plan.fp8_linears(model)
    gather = fp8_all_gather(train.fp8, strategy)
    return apply_fp8(model, candidates, train.fp8, train.fp8_emulate, train.fp8_filter, device, gather)


def check_device(recipe: str, emulate: bool, device: torch.device) -> None:
    """A device without the recipe's FP8 matmuls (``hardware.fp8_support``) is one ConfigError, unless ``emulate``.
    The combinations refused without a device are refused at config load (``config.checks.check_fp8``)."""
    if emulate:
        return
    reason = hardware.fp8_support(device, rowwise=recipe != "tensorwise")
    if reason:
        raise ConfigError(
            f"train.fp8: {reason}; set --train.fp8 none, or --train.fp8_emulate true (torchao's emulation: slow, "
            "for tests)"
        )


def fp8_all_gather(recipe: str, strategy: str) -> bool:
    """Whether FSDP all-gathers the FP8 weights in FP8: tensorwise scaling under FSDP (torchao has no FP8 all-gather for
    row-wise scales)."""
    return recipe == "tensorwise" and strategy == "fsdp"


def precompute_fp8_scales(model: nn.Module) -> None:
    """The FP8 scales of every FSDP-sharded FP8 weight of ``model`` from the current weights, in one all-reduce
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``); the next all-gathers use them. No-op without such
    weights."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def attach_fp8(optimizer: torch.optim.Optimizer, model: nn.Module, log: Callable[[str], None] | None = None) -> None:
    """After the optimizer is built, for a model with FP8 layers (nothing otherwise): one ``log`` line saying which
    layers compute in FP8, and, when FSDP all-gathers FP8 weights, ``precompute_fp8_scales`` after every optimizer
    step (a post-step hook of ``optimizer``)."""
    notes = [(m, note) for m in model.modules() if (note := _notes.get(m)) is not None]
    converted = [m for m, note in notes if note in RECIPES]
    if not converted:
        return
    gathers = any(m.config.enable_fsdp_float8_all_gather for m in converted)
    if gathers:
        optimizer.register_step_post_hook(lambda *_: precompute_fp8_scales(model))
    if log is None:
        return
    kept = [note for _, note in notes if note not in RECIPES]
    labels = {"misaligned": "with in/out features not multiples of 16", "small": "too small for train.fp8_filter auto"}
    parts = [f"{kept.count(why)} {label}" for why, label in labels.items() if why in kept]
    high = f" (high precision: {', '.join(parts)})" if parts else ""
    gather = "; FSDP all-gathers their weights in FP8" if gathers else ""
    log(
        f"train.fp8: {_notes[converted[0]]} FP8 matmuls in {len(converted)} of {len(notes)} candidate Linear layers"
        f"{high}{gather}; the LM head stays high precision"
    )
