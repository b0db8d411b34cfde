"""Hugging Face ``Mamba2ForCausalLM`` <-> anytrain's Mamba-2: tensor names and the config.json mapping.

The state-dict keys are HF's (``model.py``'s docstring lists them) but for HF's ``in_proj`` and ``conv1d``, which
anytrain holds one parameter per piece (``in_proj_{z,x,B,C,dt}``, ``conv_{x,B,C}``): an export stacks the pieces in
HF's row order, an import splits them; every other tensor moves unrenamed, and the LM head is left out of an export
when tied (HF re-ties it). ``anytrain.models.conversion`` calls these two functions for
``anytrain export --format hf`` and ``model.init_from``.

What HF computes from a config.json, and what is refused on import: transformers' ``Mamba2Mixer`` always applies
the gate before its group-wise RMSNorm (it ignores ``norm_before_gate``), clamps Δ to ``time_step_limit`` (only the
unbounded default (0, inf) is accepted here) and has no optional MLP (d_ssm = E, as every released Mamba-2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from anytrain.errors import ConfigError
from anytrain.models.mamba2.model import CONV_SEGMENTS, IN_PROJ_SEGMENTS, conv_channels, in_proj_rows

HF_CLASS = "Mamba2ForCausalLM"

STACKED = {
    "in_proj.weight": tuple(f"in_proj_{name}.weight" for name in IN_PROJ_SEGMENTS),
    "conv1d.weight": tuple(f"conv_{name}.weight" for name in CONV_SEGMENTS),
    "conv1d.bias": tuple(f"conv_{name}.bias" for name in CONV_SEGMENTS),
}
"""HF mixer tensor -> anytrain's pieces of it, in HF's row order."""
_PIECES = {piece: stacked for stacked, pieces in STACKED.items() for piece in pieces}


def _split_piece(name: str) -> tuple[str, str, str] | None:
    """(prefix up to the mixer, HF tensor in the mixer, the piece) of a piece's name, else None."""
    prefix, sep, rest = name.rpartition("mixer.")  # a mixer's own names have no prefix
    if rest not in _PIECES:
        return None
    return prefix + sep, _PIECES[rest], rest


def hf_name(name: str) -> str:
    """The HF tensor name of an anytrain Mamba-2 parameter name (a piece -> the mixer's stacked in_proj / conv1d)."""
    piece = _split_piece(name)
    return name if piece is None else piece[0] + piece[1]


def to_hf_tensors(
    args: Any, state: Mapping[str, torch.Tensor], rename: Callable[[str], str] = hf_name
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for each parameter in ``state``'s order, a mixer's pieces stacked into one tensor (yielded
    at its first piece; each piece looked up only then); ``rename``: anytrain name -> HF name (the hybrid's Bamba
    names). The tied LM head is left out."""
    for name in state:
        if name == "lm_head.weight" and args.tie_embeddings:
            continue
        piece = _split_piece(name)
        if piece is None:
            yield rename(name), state[name]
        elif piece[2] == STACKED[piece[1]][0]:
            yield rename(name), torch.cat([state[piece[0] + part] for part in STACKED[piece[1]]])


def from_hf_tensor(tensor: torch.Tensor, names: list[str], mamba_args: Any) -> dict[str, torch.Tensor]:
    """The anytrain tensors ``names`` that one HF tensor fills: a stacked in_proj / conv1d cut into its pieces (rows E,
    E, G·N, G·N, H / channels E, G·N, G·N of ``mamba_args``), anything else as it is."""
    out = {}
    for name in names:
        piece = _split_piece(name)
        if piece is None:
            out[name] = tensor
            continue
        sizes = in_proj_rows(mamba_args) if piece[1] == "in_proj.weight" else conv_channels(mamba_args)
        out[name] = tensor.split(sizes)[STACKED[piece[1]].index(piece[2])]
    return out


def hf_shapes(shapes: dict[str, torch.Size], rename: Callable[[str], str] = hf_name) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: its shape} for anytrain parameters of ``shapes`` (a mixer's pieces stacked by rows)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        key = rename(name)
        if key in out and _split_piece(name) is not None:
            out[key] = (out[key][0] + shape[0], *shape[1:])
        else:
            out[key] = tuple(shape)
    return out


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
