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


PLAN = ParallelizePlan(compile_model=compile_model)
