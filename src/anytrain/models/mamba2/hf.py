"""Hugging Face ``Mamba2ForCausalLM`` <-> anytrain's Mamba-2: tensor names and the config.json mapping.

The state-dict keys are HF's (``model.py``'s docstring lists them), so the tensors move unrenamed and only the LM
head is left out of an export when tied (HF re-ties it). ``anytrain.models.conversion`` calls these two functions for
``anytrain export --format hf`` and ``model.init_from``.

What HF computes from a config.json, and what is refused on import: transformers' ``Mamba2Mixer`` always applies
the gate before its group-wise RMSNorm (it ignores ``norm_before_gate``), clamps Δ to ``time_step_limit`` (only the
unbounded default (0, inf) is accepted here) and has no optional MLP (d_ssm = E, as every released Mamba-2).
"""

from __future__ import annotations

import math
from typing import Any

from anytrain.errors import ConfigError

HF_CLASS = "Mamba2ForCausalLM"


def hf_config(args: Any, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the ``Mamba2ForCausalLM`` equal to anytrain's ``Mamba2Args`` ``args``; ``common`` holds the
    fields every family writes (vocabulary, tokens, dtype, tie_word_embeddings)."""
    return {
        "architectures": [HF_CLASS],
        "model_type": "mamba2",
        **common,
        "hidden_size": args.d_model,
        "num_hidden_layers": args.n_layers,
        "state_size": args.d_state,
        "expand": args.expand,
        "conv_kernel": args.d_conv,
        "head_dim": args.headdim,
        "num_heads": args.nheads,
        "n_groups": args.ngroups,
        "chunk_size": args.chunk_size,
        "layer_norm_epsilon": args.norm_eps,
        "residual_in_fp32": args.residual_in_fp32,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "time_step_rank": math.ceil(args.d_model / 16),  # unused by Mamba2 (Δ comes from in_proj); HF's 'auto'
        "time_step_min": args.dt_min,
        "time_step_max": args.dt_max,
        "time_step_floor": args.dt_init_floor,
        "rescale_prenorm_residual": False,
    }


def args_from_hf_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``model.args`` of a ``mamba2`` config.json (defaults as ``Mamba2Config``'s); one ConfigError naming the key
    for a setting anytrain's Mamba-2 does not compute. A missing required key raises KeyError (the caller names it)."""
    hidden, expand = config["hidden_size"], config.get("expand", 2)
    heads, head_dim = config.get("num_heads", 128), config.get("head_dim", 64)
    for key, expected in (("hidden_act", "silu"), ("use_bias", False), ("use_conv_bias", True)):
        if config.get(key, expected) != expected:
            raise ConfigError(
                f"model.init_from: {where} has {key}={config[key]!r}; anytrain's Mamba-2 needs {expected!r}"
            )
    limit = config.get("time_step_limit", (0.0, math.inf))
    if [_json_float(v) for v in limit] != [0.0, math.inf]:
        raise ConfigError(
            f"model.init_from: {where} has time_step_limit={list(limit)!r}; anytrain's Mamba-2 does "
            "not clamp Δ (needs [0.0, Infinity])"
        )
    if heads * head_dim != expand * hidden:
        raise ConfigError(
            f"model.init_from: {where} has num_heads·head_dim = {heads}·{head_dim} != expand·"
            f"hidden_size = {expand}·{hidden}"
        )
    return {
        "vocab_size": config["vocab_size"],
        "d_model": hidden,
        "n_layers": config["num_hidden_layers"],
        "d_state": config.get("state_size", 128),
        "d_conv": config.get("conv_kernel", 4),
        "expand": expand,
        "headdim": head_dim,
        "ngroups": config.get("n_groups", 8),
        "chunk_size": config.get("chunk_size", 256),
        "norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
        "residual_in_fp32": bool(config.get("residual_in_fp32", True)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def _json_float(value: Any) -> float:
    """A float of a config.json: a number, ``Infinity`` (older transformers) or ``{"__float__": "Infinity"}`` (how
    transformers 5 writes a non-finite float)."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)
