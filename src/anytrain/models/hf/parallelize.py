"""How an HF causal LM is parallelized: data parallelism only (DDP / FSDP2 per decoder layer, from
``anytrain.parallel`` through ``blocks()``), per-block or whole-body compile. Tensor and pipeline parallelism would
need a plan per architecture and are refused at config load (``models/hf/__init__.check_run_config``)."""

from __future__ import annotations

import torch

from anytrain.models.hf.adapter import HFCausalLM
from anytrain.models.protocol import ParallelizePlan


def compile_model(model: HFCausalLM) -> None:
    """Compile the body (``hf.base_model``: embeddings, layers, final norm) as one graph; the head and the loss stay
    outside."""
    body = model.hf.base_model
    body.forward = torch.compile(body.forward, fullgraph=False)


PLAN = ParallelizePlan(compile_model=compile_model, whole_model_when_auto=False)
"""``train.compile_scope: auto`` compiles per block here even in a one-process run. Under torch.compile with
torch < 2.14 transformers builds the causal mask as a (B, 1, T, T) tensor (it skips the mask, for SDPA's
``is_causal``, only in eager code), and a masked SDPA call takes neither the causal kernels nor native GQA: that is
still so for models with windowed or chunked attention. Compiled per block, the body's mask code runs eagerly. Plain
causal models get no mask in either scope (``adapter.CAUSAL_SDPA``); per block is the scope measured (1.26x HF +
compile at 1.1B on an H100, docs/hf-models.md), the whole body under that attention has not been measured yet."""
