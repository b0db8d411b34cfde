"""What the trainer and ``anytrain.parallel`` may rely on about a model family, and nothing more.

A family provides two things:

* a single-device ``nn.Module`` satisfying ``LanguageModel`` (``models/<family>/model.py``; no ``torch.distributed``);
* a ``ModelSpec`` in the registry (``anytrain.models.REGISTRY``) naming its args dataclass, flavours, builder and its
  ``ParallelizePlan`` (``models/<family>/parallelize.py``): the family-specific steps of the parallelize order
  TP -> activation checkpointing -> compile -> FSDP. Checkpointing and FSDP need only ``blocks()``: each block is an
  FSDP unit (or a checkpointed region) and everything else (embeddings, final norm, head) belongs to the root unit.

``anytrain.parallel`` reaches a family only through these two: it inspects no attribute names of a model.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class LanguageModel(Protocol):
    """A causal LM: token ids (B, T) -> logits (B, T, V), or with targets the mean next-token loss (a scalar)."""

    args: Any
    """The family's validated args dataclass (what ``ModelSpec.args_cls`` builds from a flavour and overrides)."""

    @property
    def hidden_size(self) -> int:
        """Width D of the residual stream (the hidden states a pipeline stage hands to the next: (B, T, D))."""
        ...

    @property
    def tie_embeddings(self) -> bool:
        """Whether the LM head shares the token embedding's tensor (one module then holds both ends)."""
        ...

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor: ...

    def blocks(self) -> list[nn.Module]:
        """The repeated units, in order, that parallelism wraps (FSDP units, checkpointed regions, compiled graphs)."""
        ...

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter in place (after ``to_empty`` from the meta device); ``seed`` makes the
        weights a function of it alone. ``ParallelizePlan.stage_init`` says whether a pipeline stage can be
        initialised on its own."""
        ...

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters (shared tensors once); ``exclude_embedding`` drops the input table and keeps the LM head."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Model training FLOPs per token for MFU (6·N plus the family's attention/scan terms, in its docstring)."""
        ...

    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.8,
        top_k: int = 50,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor: ...


TensorParallelPlan = Callable[..., None]
"""(model or pipeline stage, 1D tensor-parallel DeviceMesh[, sequence_loss=True where ``ParallelizePlan.
sequence_loss``]) -> None: shards the module in place with DTensor."""

PipelineSplit = Callable[[nn.Module, range, bool, bool], nn.Module]
"""(model, layer indices to keep, holds the first stage, holds the last stage) -> the stage module: the model with
only those blocks (the embedding only on the first stage, final norm and head only on the last), parameter names
unchanged. The stage's forward takes what the previous stage returns (token ids on the first stage, hidden states
(B, T, D) later) and, on the last stage, optional targets (then it returns the mean token loss)."""

StepContext = Callable[[nn.Module, str, bool], AbstractContextManager]
"""(model as trained, parallel strategy, whether the micro-steps replay a captured CUDA graph) -> the context the
trainer runs one optimizer step's micro-batches in (their forward and backward passes; not pipeline steps). The
strategy is ``anytrain.parallel.data_parallel.resolve_strategy``'s: 'single' (one process), 'ddp', 'zero1', 'fsdp'
or 'none'. The context is closed before the optimizer step, which changes the weights."""


@dataclass(frozen=True)
class ParallelizePlan:
    """The family-specific parts of parallelizing a model; a None field means the family does not support it."""

    tensor_parallel: TensorParallelPlan | None = None
    """Tensor (+ sequence) parallelism of the model or of one of its pipeline stages."""
    sequence_loss: bool = False
    """True when ``tensor_parallel`` takes ``sequence_loss=True`` (``parallel.tp_sequence_loss``): the LM head and
    the loss on each TP rank's sequence shard."""
    check_tensor_parallel: Callable[[Any, int], None] | None = None
    """(the family's args, parallel.tp > 1) -> None: one ConfigError naming the field for a degree the model cannot be
    split over, before any process group exists. None: the Transformer's head checks (n_heads, n_kv_heads)."""
    pipeline_split: PipelineSplit | None = None
    """Cut the model into a pipeline stage."""
    compile_model: Callable[[nn.Module], None] | None = None
    """``train.compile_scope: model``: compile the model's body (embedding, blocks, final norm) as one graph in
    place, leaving the loss outside. None: only per-block compilation."""
    whole_model_when_auto: bool | Callable[[nn.Module], bool] = True
    """What ``train.compile_scope: auto`` picks in a one-process run: the whole body (True) or per block (False, for
    a family whose body builds something under the compiler that it would skip in eager code); a callable decides
    per built model."""
    stage_init: bool = False
    """True when ``init_weights(seed)`` of a pipeline stage gives the same weights as that stage of the whole model
    (per-parameter random streams): stages are then built on the meta device and only their own parameters are
    allocated. False: the whole model is initialised and then cut."""
    stage_types: tuple[type, ...] = ()
    """Module classes ``pipeline_split`` returns besides the model class (to find the spec of a stage)."""
    fp8_linears: Callable[[nn.Module], list[str]] | None = None
    """``train.fp8``: the qualified names, in the module given (the model or a pipeline stage), of the ``nn.Linear``
    layers that may compute in FP8 (never the LM head, whose weight the fused linear + cross-entropy reads directly);
    ``anytrain.parallel.fp8`` keeps the misaligned and small ones of them in high precision. None: no FP8 plan."""
    step_context: StepContext | None = None
    """The family's kernel state for one optimizer step (e.g. weight casts shared by its micro-batches, weight
    gradients summed by their GEMMs), so that the trainer knows nothing of the family's kernels. None: nothing."""


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: architecture name -> how to build, configure and parallelize the family."""

    name: str
    args_cls: type
    build: Callable[[Any], nn.Module]
    flavours: dict[str, dict[str, Any]] = field(default_factory=dict)
    parallelize_plan: ParallelizePlan = field(default_factory=ParallelizePlan)
    resolve_args: Callable[[Any], Any] | None = None
    """``ModelConfig`` -> the validated args, for a family whose shape is not a flavour plus ``model.args`` (``hf``:
    read from ``model.hf_path``); None = flavour defaults merged with ``model.args``."""

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is this family's model or one of its pipeline stages."""
        types = ((self.build,) if isinstance(self.build, type) else ()) + self.parallelize_plan.stage_types
        return isinstance(module, types)
