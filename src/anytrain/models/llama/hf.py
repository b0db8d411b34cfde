"""Hugging Face ``LlamaForCausalLM`` and ``MptForCausalLM`` <-> anytrain's Transformer: tensor names, the RoPE row
permutation and the config.json mapping (``anytrain.models.conversion`` dispatches the families).

A Transformer with RoPE, RMSNorm and SwiGLU is ``LlamaForCausalLM``; with ALiBi, LayerNorm without bias, GELU
(F = 4·D) and multi-head attention ``MptForCausalLM``. Other option combinations (biases, QK-norm, learned positions,
...) have no HF class here and are refused with one line.

Names and layouts, Llama::

    tok_embeddings.weight                   model.embed_tokens.weight
    layers.{i}.attention.w{q,k,v,o}.weight  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.feed_forward.w1/w3/w2.weight model.layers.{i}.mlp.gate_proj/up_proj/down_proj.weight
    layers.{i}.attention_norm.weight        model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight              model.layers.{i}.post_attention_layernorm.weight
    norm.weight / output.weight             model.norm.weight / lm_head.weight (left out when tied)

MPT (q, k and v rows stacked into one ``Wqkv``; ALiBi slopes computed by both sides with MPT's formula)::

    tok_embeddings.weight                   transformer.wte.weight
    layers.{i}.attention.w{q,k,v}.weight    transformer.blocks.{i}.attn.Wqkv.weight (rows [q; k; v])
    layers.{i}.attention.wo.weight          transformer.blocks.{i}.attn.out_proj.weight
    layers.{i}.feed_forward.w1/w2.weight    transformer.blocks.{i}.ffn.up_proj/down_proj.weight
    layers.{i}.attention_norm/ffn_norm      transformer.blocks.{i}.norm_1/norm_2.weight
    norm.weight / output.weight             transformer.norm_f.weight / lm_head.weight (left out when tied)

RoPE: anytrain rotates interleaved pairs (x[2i], x[2i+1]) of each head, HF Llama the halves (x[i], x[i + E/2]), both
by angle t·theta^(-2i/E). Permuting the rows of each head of wq and wk (anytrain row 2i + p is HF row p·E/2 + i)
makes the two the same function: q·k is unchanged by a permutation applied to both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from anytrain.errors import ConfigError

# --------------------------------------------------------------------------------------------------------------------
# RoPE layout


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (H·E, D) from anytrain's pair order to HF's half order, head by head."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``interleaved_to_halves``."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# --------------------------------------------------------------------------------------------------------------------
# names


_LLAMA_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LLAMA_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


_MPT_LAYER = {
    "attention.wo.weight": "attn.out_proj.weight",
    "feed_forward.w1.weight": "ffn.up_proj.weight",
    "feed_forward.w2.weight": "ffn.down_proj.weight",
    "attention_norm.weight": "norm_1.weight",
    "ffn_norm.weight": "norm_2.weight",
}
MPT_QKV = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight")  # stacked rows of attn.Wqkv
_MPT_TOP = {
    "tok_embeddings.weight": "transformer.wte.weight",
    "norm.weight": "transformer.norm_f.weight",
    "output.weight": "lm_head.weight",
}


def _transformer_options(args: Any) -> dict[str, Any]:
    return {
        "pos_encoding": args.pos_encoding,
        "norm": args.norm,
        "norm_bias": args.norm_bias,
        "mlp": args.mlp,
        "bias": args.bias,
        "qk_norm": args.qk_norm,
    }


LLAMA_OPTIONS = {
    "pos_encoding": "rope",
    "norm": "rmsnorm",
    "norm_bias": False,
    "mlp": "swiglu",
    "bias": False,
    "qk_norm": False,
}
MPT_OPTIONS = {
    "pos_encoding": "alibi",
    "norm": "layernorm",
    "norm_bias": False,
    "mlp": "gelu",
    "bias": False,
    "qk_norm": False,
}


def hf_family(args: Any) -> str:
    """'llama' or 'mpt': the transformers class that computes what a Transformer with ``args`` computes; one
    ConfigError for a Transformer no HF class here represents."""
    options = _transformer_options(args)
    if options == LLAMA_OPTIONS:
        return "llama"
    if options == MPT_OPTIONS and args.ffn_dim == 4 * args.dim and args.n_kv_heads == args.n_heads:
        return "mpt"
    options.update(ffn_dim=args.ffn_dim, dim=args.dim, n_kv_heads=args.n_kv_heads, n_heads=args.n_heads)
    given = ", ".join(f"{k}={v}" for k, v in options.items())
    raise ConfigError(
        f"export --format hf: no transformers class computes this Transformer ({given}); "
        "LlamaForCausalLM needs rope/rmsnorm/swiglu, MptForCausalLM alibi/layernorm/gelu with "
        "ffn_dim = 4·dim and n_kv_heads = n_heads; both no bias, norm_bias or qk_norm"
    )


def hf_name(family: str, name: str) -> str:
    """The HF tensor name of an anytrain parameter name (q, k and v share MPT's ``Wqkv``)."""
    top, layer, prefix = (
        (_MPT_TOP, _MPT_LAYER, "transformer.blocks") if family == "mpt" else (_LLAMA_TOP, _LLAMA_LAYER, "model.layers")
    )
    if name in top:
        return top[name]
    _, index, rest = name.split(".", 2)  # layers.{i}.<rest>
    if family == "mpt" and rest in MPT_QKV:
        return f"{prefix}.{index}.attn.Wqkv.weight"
    return f"{prefix}.{index}.{layer[rest]}"


def head_count(family: str, name: str, args: Any) -> int | None:
    """Heads to permute for a q/k projection (Llama's RoPE layout), else None."""
    if family != "llama":
        return None
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def to_hf_tensors(family: str, args: Any, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for each anytrain parameter, in ``state``'s order; the LM head is left out when tied (HF
    re-ties it). Each entry of ``state`` is looked up only when its HF tensor is made (and a tied head never), so a
    mapping that reads on lookup (``CheckpointTensors``) is read one tensor (MPT: one q, k, v triple) at a time."""
    for name in state:
        if name == "output.weight" and args.tie_embeddings:
            continue
        if family == "mpt" and name.endswith(MPT_QKV):
            if not name.endswith(MPT_QKV[0]):
                continue  # k and v go out with q
            layer = name[: -len(MPT_QKV[0])]
            yield hf_name(family, name), torch.cat([state[layer + part] for part in MPT_QKV])
            continue
        heads = head_count(family, name, args)
        tensor = state[name]
        yield hf_name(family, name), interleaved_to_halves(tensor, heads) if heads else tensor


def from_hf_tensor(family: str, key: str, tensor: torch.Tensor, names: list[str], args: Any) -> dict[str, torch.Tensor]:
    """The anytrain tensors ``names`` that the HF tensor ``key`` fills: MPT's Wqkv split into q, k, v (rows [q; k; v],
    each D: multi-head), Llama's q/k rows permuted back to pair order."""
    if family == "mpt" and key.endswith("attn.Wqkv.weight"):
        parts = dict(zip(MPT_QKV, tensor.chunk(3), strict=True))
        return {n: parts[n[n.index("attention.") :]] for n in names}
    out = {}
    for name in names:
        heads = head_count(family, name, args)
        out[name] = halves_to_interleaved(tensor, heads) if heads else tensor
    return out


def hf_shapes(family: str, shapes: dict[str, torch.Size]) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: its shape} for anytrain parameters of ``shapes`` (MPT's Wqkv: the q, k, v rows stacked)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        key = hf_name(family, name)
        if key in out and name.endswith(MPT_QKV):
            out[key] = (out[key][0] + shape[0], *shape[1:])
        else:
            out[key] = tuple(shape)
    return out


# --------------------------------------------------------------------------------------------------------------------
# config.json


def hf_config(family: str, args: Any, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the ``LlamaForCausalLM`` or ``MptForCausalLM`` (``family``) equal to anytrain's Transformer with
    ``args``; ``common`` holds the fields every family writes (vocabulary, tokens, dtype, tie_word_embeddings)."""
    if family == "mpt":
        attn = {
            "attn_type": "multihead_attention",
            "attn_pdrop": 0,
            "attn_impl": "torch",
            "clip_qkv": None,
            "softmax_scale": None,
            "prefix_lm": False,
            "qk_ln": False,
            "attn_uses_sequence_id": False,
            "alibi": True,
            "alibi_bias_max": 8,
        }
        return {
            "architectures": ["MptForCausalLM"],
            "model_type": "mpt",
            **common,
            "d_model": args.dim,
            "n_heads": args.n_heads,
            "n_layers": args.n_layers,
            "expansion_ratio": 4,
            "max_seq_len": args.max_seq_len,
            "layer_norm_epsilon": args.norm_eps,
            "learned_pos_emb": False,
            "no_bias": True,
            "logit_scale": None,
            "norm_type": "low_precision_layernorm",
            "emb_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "embedding_fraction": 1.0,
            "attn_config": attn,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def require(config: dict, key: str, expected: Any, where: str) -> None:
    """``config[key]`` (``expected`` when absent) must be ``expected``: else one ConfigError naming the key."""
    value = config.get(key, expected)
    if value != expected:
        raise ConfigError(f"model.init_from: {where} has {key}={value!r}; anytrain's model needs {expected!r}")


def _rope_theta(config: dict, where: str) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"model.init_from: {where} uses RoPE scaling {kind!r}; only the default RoPE is supported")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def llama_args(config: dict, where: str) -> dict[str, Any]:
    """model.args of a ``llama`` config.json; one ConfigError naming the field for a setting anytrain's Transformer
    does not compute. A missing required key raises KeyError (the caller names it)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    for key, expected in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("pretraining_tp", 1),
        ("head_dim", hidden // heads),
    ):
        require(config, key, expected, where)
    return {
        **LLAMA_OPTIONS,
        "vocab_size": config["vocab_size"],
        "dim": hidden,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "ffn_dim": config["intermediate_size"],
        "rope_theta": _rope_theta(config, where),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "max_seq_len": config.get("max_position_embeddings", 2048),
    }


def mpt_args(config: dict, where: str) -> dict[str, Any]:
    """model.args of an MPT config.json: the settings ``MptForCausalLM`` computes with (it ignores learned_pos_emb
    and no_bias; a checkpoint holding tensors it has no place for fails when the weights are read)."""
    hidden, heads = config["d_model"], config["n_heads"]
    for key, expected in (("expansion_ratio", 4), ("logit_scale", None)):
        require(config, key, expected, where)
    attn = config.get("attn_config") or {}
    scale = attn.get("softmax_scale")
    if scale is not None and not math.isclose(scale, (hidden // heads) ** -0.5):
        raise ConfigError(
            f"model.init_from: {where} has attn_config.softmax_scale={scale!r}; anytrain's model "
            f"needs 1/sqrt(head_dim) = {(hidden // heads) ** -0.5!r} (or null)"
        )
    for key, expected in (
        ("alibi", True),
        ("alibi_bias_max", 8),
        ("qk_ln", False),
        ("clip_qkv", None),
        ("prefix_lm", False),
        ("attn_uses_sequence_id", False),
    ):
        require(attn, key, expected, f"{where} attn_config")
    return {
        **MPT_OPTIONS,
        "vocab_size": config["vocab_size"],
        "dim": hidden,
        "n_layers": config["n_layers"],
        "n_heads": heads,
        "n_kv_heads": heads,
        "ffn_dim": 4 * hidden,
        "norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
        "max_seq_len": config.get("max_seq_len", 2048),
    }
