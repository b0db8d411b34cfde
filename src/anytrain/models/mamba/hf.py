"""Hugging Face ``MambaForCausalLM`` <-> anytrain's Mamba: the config.json mapping.

The state-dict keys are HF's (``backbone.*``, ``lm_head.weight``), so the tensors move unrenamed and only the LM head
is left out of an export when tied (HF re-ties it). ``anytrain.models.conversion`` calls these two functions for
``anytrain export --format hf`` and ``model.init_from``.
"""

from __future__ import annotations

import math
from typing import Any

from anytrain.models.llama.hf import require

HF_CLASS = "MambaForCausalLM"


def hf_config(args: Any, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the ``MambaForCausalLM`` equal to anytrain's ``MambaArgs`` ``args``; ``common`` holds the fields
    every family writes (vocabulary, tokens, dtype, tie_word_embeddings)."""
    return {
        "architectures": [HF_CLASS],
        "model_type": "mamba",
        **common,
        "hidden_size": args.d_model,
        "state_size": args.d_state,
        "num_hidden_layers": args.n_layers,
        "layer_norm_epsilon": args.norm_eps,
        "expand": args.expand,
        "intermediate_size": args.d_inner,
        "conv_kernel": args.d_conv,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": args.residual_in_fp32,
        "time_step_rank": args.dt_rank,
        "time_step_scale": 1.0,
        "time_step_min": args.dt_min,
        "time_step_max": args.dt_max,
        "time_step_init_scheme": "random",
        "time_step_floor": args.dt_init_floor,
        "rescale_prenorm_residual": False,
        "use_mambapy": False,
    }


def args_from_hf_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``model.args`` of a ``mamba`` config.json; one ConfigError naming the key for a setting anytrain's Mamba does
    not compute. A missing required key raises KeyError (the caller names it)."""
    hidden, expand = config["hidden_size"], config.get("expand", 2)
    for key, expected in (
        ("hidden_act", "silu"),
        ("use_bias", False),
        ("use_conv_bias", True),
        ("intermediate_size", expand * hidden),
    ):
        require(config, key, expected, where)
    rank = config.get("time_step_rank", "auto")
    return {
        "vocab_size": config["vocab_size"],
        "d_model": hidden,
        "n_layers": config["num_hidden_layers"],
        "d_state": config.get("state_size", 16),
        "d_conv": config.get("conv_kernel", 4),
        "expand": expand,
        "dt_rank": math.ceil(hidden / 16) if rank == "auto" else rank,
        "norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
        "residual_in_fp32": bool(config.get("residual_in_fp32", True)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
    }
