"""``torch.compile`` of a model (``train.compile``, ``train.compile_scope``): each block on its own, or the whole
body as one graph where the family's ``ParallelizePlan`` implements it."""

from __future__ import annotations

from torch import nn

from anytrain.errors import ConfigError
from anytrain.models import spec_of


def resolve_compile_scope(scope: str, strategy: str, whole_model_when_auto: bool = True) -> str:
    """train.compile_scope for a run with this strategy: auto = the whole model in a one-process run (unless the
    family's ``ParallelizePlan.whole_model_when_auto`` says blocks), else blocks."""
    if scope == "auto":
        return "model" if strategy == "single" and whole_model_when_auto else "blocks"
    if scope == "model" and strategy != "single":
        raise ConfigError(
            "train.compile_scope: 'model' needs a one-process run; use --train.compile_scope blocks (or auto)"
        )
    return scope


def apply_compile(model: nn.Module, scope: str = "blocks") -> None:
    """Compile each block separately (same-shaped blocks share one compiled graph and compile fast), or with scope
    "model" the model's whole body (embedding, blocks, final norm) as one graph, as its family's plan says; the loss
    stays outside (the chunked linear + cross-entropy runs its own kernels)."""
    if scope == "model":
        spec = spec_of(model)
        if spec.parallelize_plan.compile_model is None:
            raise ConfigError(f"train.compile_scope: 'model' is not implemented for {spec.name}; use blocks")
        spec.parallelize_plan.compile_model(model)
        return
    for block in model.blocks():
        block.compile(fullgraph=False)


def compile_model(model: nn.Module, scope: str, strategy: str) -> None:
    """``train.compile`` with ``train.compile_scope`` resolved for this strategy and the model's family."""
    whole = spec_of(model).parallelize_plan.whole_model_when_auto
    whole = whole(model) if callable(whole) else whole
    apply_compile(model, resolve_compile_scope(scope, strategy, whole))
