"""How an HF causal LM is parallelized: data parallelism only (DDP / FSDP2 per decoder layer, from
``anytrain.parallel`` through ``blocks()``), per-block or whole-body compile, FP8 in the decoder layers' Linear
layers. Tensor and pipeline parallelism would need a plan per architecture and are refused at config load
(``models/hf/__init__.check_run_config``)."""

from __future__ import annotations

import torch

from anytrain.models.hf.adapter import HFCausalLM
from anytrain.models.protocol import ParallelizePlan


def compile_model(model: HFCausalLM) -> None:
    """Compile the body (``hf.base_model``: embeddings, layers, final norm) as one graph; the head and the loss stay
    outside."""
    body = model.hf.base_model
    body.forward = torch.compile(body.forward, fullgraph=False)


def whole_body_when_auto(model: HFCausalLM) -> bool:
    """``train.compile_scope: auto`` in a one-process run: the whole body as one graph for a model without mask code
    (``HFCausalLM.mask_free``), else per block. Under torch.compile with torch < 2.14 transformers builds the causal
    mask as a (B, 1, T, T) tensor (it skips the mask, for SDPA's ``is_causal``, only in eager code), and a masked SDPA
    call takes neither the causal kernels nor native GQA: compiled per block, the body's mask code runs eagerly. The
    mask-free whole body measured faster than per-block compile for a tiny Llama (host-bound) and the same at 1.1B
    (docs/hf-models.md)."""
    return model.mask_free


def fp8_linears(model: HFCausalLM) -> list[str]:
    """FP8 candidates: every ``nn.Linear`` inside the decoder layers (the attention and MLP projections, whatever the
    architecture names them); the LM head and embeddings are outside the layers, and layers of other classes (GPT-2's
    ``Conv1D``) are not converted."""
    inside = {id(module) for block in model.blocks() for module in block.modules()}
    return [
        name for name, module in model.named_modules() if id(module) in inside and isinstance(module, torch.nn.Linear)
    ]


PLAN = ParallelizePlan(compile_model=compile_model, whole_model_when_auto=whole_body_when_auto, fp8_linears=fp8_linears)
