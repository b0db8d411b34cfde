"""Hugging Face ``BambaForCausalLM`` <-> anytrain's hybrid: which layouts Bamba holds, tensor names, the partial-RoPE
row permutation and the config.json mapping (``anytrain.models.conversion`` dispatches the families).

A Bamba layer is a mixer (Mamba-2, or attention at ``attn_layer_indices``) then a SwiGLU MLP, each with its own
pre-norm and residual: two hybrid blocks. So a hybrid is a Bamba model when its pattern is pairs ``M-`` / ``A-``,
its MLP is SwiGLU and its attention uses RoPE; anything else is refused on export with one line. Bamba computes its
residual stream in the weights' dtype; ``residual_in_fp32`` changes only mixed-precision rounding, so it is not
refused (an fp32 export computes the same either way).

Names, Bamba layer i = hybrid blocks 2i (mixer) and 2i + 1 (MLP)::

    backbone.embeddings.weight                     model.embed_tokens.weight
    backbone.layers.{2i}.norm.weight               model.layers.{i}.input_layernorm.weight
    backbone.layers.{2i}.mixer.<name>              model.layers.{i}.mamba.<name>  (dt_bias, A_log, D, ...; the in_proj /
                                                   conv1d pieces stacked as for Mamba2ForCausalLM)
    backbone.layers.{2i}.attention.w{q,k,v,o}      model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    backbone.layers.{2i+1}.norm.weight             model.layers.{i}.pre_ff_layernorm.weight
    backbone.layers.{2i+1}.feed_forward.w1/w3/w2   model.layers.{i}.feed_forward.gate_proj/up_proj/down_proj.weight
    backbone.norm_f.weight                         model.final_layernorm.weight
    lm_head.weight                                 lm_head.weight (left out when tied)

RoPE: Bamba rotates the first R = partial_rotary_factor·E dims of each head as halves (x[i], x[i + R/2]), anytrain
interleaved pairs (x[2i], x[2i+1]) of the same first R dims; the rows of those R dims of each q/k head are permuted
as for Llama (``llama.hf.interleaved_to_halves``), the other E - R rows move unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from anytrain.errors import ConfigError
from anytrain.models.llama.hf import halves_to_interleaved, interleaved_to_halves, require
from anytrain.models.mamba2 import hf as mamba2_hf
from anytrain.models.mamba2.hf import _json_float

HF_CLASS = "BambaForCausalLM"

_MIXER_NAMES = {"norm.weight": "input_layernorm.weight"}
_MLP_NAMES = {
    "norm.weight": "pre_ff_layernorm.weight",
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
}
_ATTENTION_NAMES = {f"attention.w{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"}
_TOP = {
    "backbone.embeddings.weight": "model.embed_tokens.weight",
    "backbone.norm_f.weight": "model.final_layernorm.weight",
    "lm_head.weight": "lm_head.weight",
}


def check_bamba(args: Any) -> None:
    """One ConfigError when no ``BambaForCausalLM`` computes what the hybrid with ``args`` computes."""
    pattern = args.layers_pattern.replace("*", "A")
    pairs = [pattern[i : i + 2] for i in range(0, len(pattern), 2)]
    why = None
    if any(pair not in ("M-", "A-") for pair in pairs):
        why = f"layers_pattern {args.layers_pattern!r} is not Bamba layers (pairs 'M-' or 'A-': a mixer, then an MLP)"
    elif args.mlp != "swiglu":
        why = f"mlp {args.mlp!r} (Bamba's MLP is SwiGLU)"
    elif "A" in pattern and args.attn_pos_encoding != "rope":
        why = f"attn_pos_encoding {args.attn_pos_encoding!r} (Bamba's attention applies RoPE)"
    if why is not None:
        raise ConfigError(f"export --format hf: BambaForCausalLM cannot hold this hybrid: {why}")


def hf_name(name: str) -> str:
    """The Bamba tensor name of a hybrid parameter name (the pattern being Bamba pairs)."""
    if name in _TOP:
        return _TOP[name]
    index, rest = name.removeprefix("backbone.layers.").split(".", 1)
    layer, mlp = divmod(int(index), 2)
    prefix = f"model.layers.{layer}"
    if mlp:
        return f"{prefix}.{_MLP_NAMES[rest]}"
    if rest in _MIXER_NAMES:
        return f"{prefix}.{_MIXER_NAMES[rest]}"
    if rest in _ATTENTION_NAMES:
        return f"{prefix}.{_ATTENTION_NAMES[rest]}"
    return f"{prefix}.mamba.{mamba2_hf.hf_name(rest).removeprefix('mixer.')}"


def _heads(name: str, args: Any) -> int | None:
    """Heads whose rotated rows to permute for a q/k projection, else None."""
    if name.endswith("attention.wq.weight"):
        return args.attn_heads
    if name.endswith("attention.wk.weight"):
        return args.attn_kv_heads
    return None


def _permute_rotary(weight: torch.Tensor, heads: int, rotary: int, convert) -> torch.Tensor:
    """``convert`` (interleaved <-> halves) applied to the first ``rotary`` rows of each of ``heads`` heads."""
    rows, cols = weight.shape
    per_head = weight.view(heads, rows // heads, cols)
    rotated = convert(per_head[:, :rotary].reshape(heads * rotary, cols), heads).view(heads, rotary, cols)
    return torch.cat([rotated, per_head[:, rotary:]], dim=1).reshape(rows, cols)


def _rotary(name: str, tensor: torch.Tensor, args: Any, convert) -> torch.Tensor:
    heads = _heads(name, args)
    return _permute_rotary(tensor, heads, args.rotary_dim, convert) if heads else tensor


def to_hf_tensors(args: Any, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Bamba name, tensor) for each hybrid parameter in ``state``'s order, each looked up only when it is made (a
    Mamba-2 mixer's in_proj / conv1d pieces stacked, ``mamba2.hf.to_hf_tensors``); the LM head is left out when
    tied."""
    check_bamba(args)
    for key, tensor in mamba2_hf.to_hf_tensors(args, state, rename=lambda name: name):
        yield hf_name(key), _rotary(key, tensor, args, interleaved_to_halves)


def from_hf_tensor(tensor: torch.Tensor, names: list[str], args: Any) -> dict[str, torch.Tensor]:
    """The hybrid tensors ``names`` that one Bamba tensor fills (q/k rotated rows back to pair order; a Mamba-2
    in_proj / conv1d cut into its pieces)."""
    pieces = mamba2_hf.from_hf_tensor(tensor, names, args.mamba_args())
    return {name: _rotary(name, piece, args, halves_to_interleaved) for name, piece in pieces.items()}


def hf_config(args: Any, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the ``BambaForCausalLM`` equal to the hybrid with ``args`` (``check_bamba`` first); ``common``
    holds the fields every family writes."""
    check_bamba(args)
    kinds = args.layers_pattern.replace("*", "A")[::2]  # each Bamba layer's mixer
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": args.rope_fraction}
    return {
        "architectures": [HF_CLASS],
        "model_type": "bamba",
        **common,
        "hidden_size": args.d_model,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": len(kinds),
        "attn_layer_indices": [i for i, kind in enumerate(kinds) if kind == "A"],
        "num_attention_heads": args.attn_heads,
        "num_key_value_heads": args.attn_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "mamba_n_heads": args.mamba_expand * args.d_model // args.mamba_headdim,
        "mamba_d_head": args.mamba_headdim,
        "mamba_n_groups": args.mamba_ngroups,
        "mamba_d_state": args.mamba_d_state,
        "mamba_d_conv": args.mamba_d_conv,
        "mamba_expand": args.mamba_expand,
        "mamba_chunk_size": args.mamba_chunk_size,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "z_loss_coefficient": 0.0,
        "num_logits_to_keep": 1,
    }


def args_from_hf_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``model.args`` of a ``bamba`` config.json (defaults as ``BambaConfig``'s); one ConfigError naming the key for
    a setting the hybrid does not compute. A missing required key raises KeyError (the caller names it)."""
    hidden, heads = config["hidden_size"], config.get("num_attention_heads", 32)
    expand, mamba_heads = config.get("mamba_expand", 2), config.get("mamba_n_heads", 128)
    head = config.get("mamba_d_head", "auto")
    head = expand * hidden // mamba_heads if head == "auto" else head
    for key, expected in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("mamba_conv_bias", True),
        ("mamba_proj_bias", False),
        ("head_dim", hidden // heads),
    ):
        require(config, key, expected, where)
    limit = config.get("time_step_limit", (0.0, math.inf))
    if limit is None or [_json_float(v) for v in limit] != [0.0, math.inf]:
        raise ConfigError(
            f"model.init_from: {where} has time_step_limit={limit!r}; anytrain's Mamba-2 does not clamp Δ "
            "(needs [0.0, Infinity])"
        )
    if head * mamba_heads != expand * hidden:
        raise ConfigError(
            f"model.init_from: {where} has mamba_n_heads·mamba_d_head = {mamba_heads}·{head} != mamba_expand·"
            f"hidden_size = {expand}·{hidden}"
        )
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"model.init_from: {where} uses RoPE scaling {rope['rope_type']!r}; only the default")
    attention = set(config.get("attn_layer_indices") or ())
    layers = config["num_hidden_layers"]
    return {
        "vocab_size": config["vocab_size"],
        "d_model": hidden,
        "layers_pattern": "".join(("A" if i in attention else "M") + "-" for i in range(layers)),
        "mamba_d_state": config.get("mamba_d_state", 256),
        "mamba_d_conv": config.get("mamba_d_conv", 4),
        "mamba_expand": expand,
        "mamba_headdim": head,
        "mamba_ngroups": config.get("mamba_n_groups", 1),
        "mamba_chunk_size": config.get("mamba_chunk_size", 256),
        "attn_heads": heads,
        "attn_kv_heads": config.get("num_key_value_heads") or heads,
        "attn_pos_encoding": "rope",
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "rope_fraction": float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))),
        "ffn_dim": config.get("intermediate_size", 14336),
        "mlp": "swiglu",
        "norm_eps": float(config.get("rms_norm_eps", 1e-5)),
        "residual_in_fp32": False,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_seq_len": config.get("max_position_embeddings", 262144),
    }
