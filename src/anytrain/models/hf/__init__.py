"""Any local ``transformers`` causal LM (``model.arch: hf``): the adapter (``adapter``) and its parallelize plan
(``parallelize``); ``SPEC`` is its registry entry ("hf")."""

from __future__ import annotations

from typing import Any

from anytrain.errors import ConfigError
from anytrain.models.hf.adapter import (
    HFArgs,
    HFCausalLM,
    check_folder,
    find_blocks,
    plain_causal,
    read_config,
    resolve_args,
)
from anytrain.models.hf.parallelize import PLAN
from anytrain.models.protocol import ModelSpec

SPEC = ModelSpec("hf", HFArgs, HFCausalLM, {}, PLAN, resolve_args=resolve_args)


def check_run_config(cfg: Any) -> None:
    """When the run config is resolved (``models/run_config.py``): ``model.hf_path`` made absolute and checked (a
    folder with config.json), used only with ``model.arch: hf``; the layouts and options the hf family does not take
    refused, one line naming the field."""
    model = cfg.model
    if model.arch != "hf":
        raise ConfigError(
            f"model.hf_path: only read with model.arch hf (model.arch is {model.arch!r}); set "
            "--model.arch hf, or use model.init_from to start a transformer/mamba run from HF weights"
        )
    model.hf_path = str(check_folder(model.hf_path))
    if model.init_from:
        raise ConfigError("model.init_from: not used with model.arch hf (the weights come from model.hf_path); drop it")
    if cfg.train.cuda_graphs and not (
        model.args.get("attn_implementation", "sdpa") == "sdpa" and plain_causal(read_config(model.hf_path))
    ):
        raise ConfigError(
            "train.cuda_graphs: with model.arch hf only for models whose every layer attends causally "
            "over the whole sequence, under attn_implementation sdpa (transformers' attention-mask "
            "code reads GPU tensors on the host, which breaks capture); set --train.cuda_graphs "
            "false"
        )
    for name in ("tp", "pp"):
        if getattr(cfg.parallel, name) > 1:
            raise ConfigError(
                f"parallel.{name}: model.arch hf trains with data parallelism only (DDP / FSDP); set "
                f"--parallel.{name} 1"
            )


__all__ = [
    "PLAN",
    "SPEC",
    "HFArgs",
    "HFCausalLM",
    "check_folder",
    "check_run_config",
    "find_blocks",
    "read_config",
    "resolve_args",
]
