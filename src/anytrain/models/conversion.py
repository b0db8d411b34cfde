"""Hugging Face conversion of anytrain's model families, one interface over the per-family adapters
(``models/llama/hf.py`` for Llama and MPT, ``models/mamba/hf.py``, ``models/mamba2/hf.py``, ``models/hybrid/hf.py``):
the HF class a model
maps to, tensor names, config.json in both directions, and ``model.init_from``'s config.json -> ``model.args``.

The config JSON is written without ``transformers`` (needed only to load the result), with the keys of both
transformers 4.x and 5.x (``rope_theta`` and ``rope_parameters``). The HF class follows the model args
(:func:`hf_family`): a Transformer -> ``LlamaForCausalLM`` or ``MptForCausalLM``; Mamba -> ``MambaForCausalLM``,
Mamba-2 -> ``Mamba2ForCausalLM`` (their state-dict names are HF's, Mamba-2's in_proj / conv1d held in pieces), a
hybrid of Bamba layers -> ``BambaForCausalLM``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from anytrain.errors import ConfigError
from anytrain.models.hf.adapter import INDEX_FILE as INDEX_FILE  # the file names of a Hugging Face folder
from anytrain.models.hf.adapter import SINGLE_FILE as SINGLE_FILE
from anytrain.models.hybrid import hf as hybrid_hf
from anytrain.models.llama import hf as llama_hf
from anytrain.models.mamba import hf as mamba_hf
from anytrain.models.mamba2 import hf as mamba2_hf

MAMBA_FAMILIES = ("mamba", "mamba2")  # anytrain's names are HF's (backbone.*, lm_head.weight)
BACKBONE_ARCHS = ("mamba", "mamba2", "hybrid")  # embedding backbone.embeddings.weight, head lm_head.weight


def hf_family(arch: str, args: Any) -> str:
    """'llama', 'mpt', 'mamba', 'mamba2' or 'bamba': the transformers class that computes what ``arch`` with ``args``
    computes; one ConfigError for a Transformer or hybrid no HF class here represents."""
    if arch == "hybrid":
        hybrid_hf.check_bamba(args)
        return "bamba"
    return llama_hf.hf_family(args) if arch == "transformer" else arch


def hf_name(family: str, name: str) -> str:
    """The HF tensor name of an anytrain parameter name (q, k and v share MPT's ``Wqkv``)."""
    if family == "bamba":
        return hybrid_hf.hf_name(name)
    if family == "mamba2":
        return mamba2_hf.hf_name(name)
    return name if family in MAMBA_FAMILIES else llama_hf.hf_name(family, name)


def hf_shapes(family: str, shapes: dict[str, torch.Size]) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: its shape} for anytrain parameters of ``shapes``."""
    if family == "mamba2":
        return mamba2_hf.hf_shapes(shapes)
    if family in MAMBA_FAMILIES:
        return {name: tuple(shape) for name, shape in shapes.items()}
    if family == "bamba":
        return mamba2_hf.hf_shapes(shapes, hybrid_hf.hf_name)
    return llama_hf.hf_shapes(family, shapes)


def to_hf_tensors(family: str, args: Any, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for each anytrain parameter, in ``state``'s order; the LM head is left out when tied (HF
    re-ties it). Each entry of ``state`` is looked up only when its HF tensor is made (and a tied head never), so a
    mapping that reads on lookup (``CheckpointTensors``) is read one tensor (MPT: one q, k, v triple) at a time."""
    if family == "bamba":
        yield from hybrid_hf.to_hf_tensors(args, state)
        return
    if family == "mamba2":
        yield from mamba2_hf.to_hf_tensors(args, state)
        return
    if family not in MAMBA_FAMILIES:
        yield from llama_hf.to_hf_tensors(family, args, state)
        return
    for name in state:
        if not (name == "lm_head.weight" and args.tie_embeddings):
            yield name, state[name]


def from_hf_tensor(family: str, key: str, tensor: torch.Tensor, names: list[str], args: Any) -> dict[str, torch.Tensor]:
    """The anytrain tensors ``names`` that the HF tensor ``key`` fills."""
    if family == "mamba2":
        return mamba2_hf.from_hf_tensor(tensor, names, args)
    if family in MAMBA_FAMILIES:
        return dict.fromkeys(names, tensor)
    if family == "bamba":
        return hybrid_hf.from_hf_tensor(tensor, names, args)
    return llama_hf.from_hf_tensor(family, key, tensor, names, args)


def hf_config(family: str, args: Any, eos_id: int, pad_id: int | None, dtype: str) -> dict[str, Any]:
    """config.json of the HF model (``hf_family``) equal to anytrain's model with ``args``."""
    common = {
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "initializer_range": args.init_std,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if family == "mamba2":
        return mamba2_hf.hf_config(args, common)
    if family == "bamba":
        return hybrid_hf.hf_config(args, common)
    if family == "mamba":
        return mamba_hf.hf_config(args, common)
    return llama_hf.hf_config(family, args, common)


def args_from_hf_config(config: dict, where: str) -> tuple[str, dict[str, Any]]:
    """(anytrain arch, model.args fields) of an HF config.json; one ConfigError naming the field for an architecture
    anytrain's models cannot represent."""
    kind = config.get("model_type")
    if kind == "llama":
        return "transformer", llama_hf.llama_args(config, where)
    if kind == "mpt":
        return "transformer", llama_hf.mpt_args(config, where)
    if kind == "mamba":
        return "mamba", mamba_hf.args_from_hf_config(config, where)
    if kind == "mamba2":
        return "mamba2", mamba2_hf.args_from_hf_config(config, where)
    if kind == "bamba":
        return "hybrid", hybrid_hf.args_from_hf_config(config, where)
    raise ConfigError(
        f"model.init_from: {where} has model_type {kind!r}; anytrain imports 'llama', 'mpt', 'mamba', 'mamba2' and "
        "'bamba'"
    )


# fields an explicit model.args value may change without changing the weights' meaning or shapes
_FREE_FIELDS = ("max_seq_len",)


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.init_from: {directory} has no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.init_from: {config_file} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"model.init_from: {config_file} holds a JSON {type(config).__name__}, not the object "
            "save_pretrained writes; restore it from the model's source"
        )
    return config


def apply_init_from(cfg: Any) -> None:
    """Where the model is resolved (``anytrain.models.run_config``): make ``model.init_from`` absolute and fill
    ``model.args`` from its config.json (so the saved config.yaml records the shape); an explicit ``model.args`` field
    or ``model.arch`` that disagrees is one ConfigError naming it. A resolved run config whose folder is gone keeps
    its recorded args."""
    model = cfg.model
    directory = Path(model.init_from).expanduser().absolute()
    model.init_from = str(directory)
    if not (directory / "config.json").is_file() and model.args.get("vocab_size"):
        return  # a run's resolved config.yaml (eval, resume): the shape is recorded in model.args
    where = f"{directory}/config.json"
    try:
        arch, fields = args_from_hf_config(read_hf_config(directory), where)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # a field missing or of the wrong type
        what = f"lacks {exc}" if isinstance(exc, KeyError) else f"has a field of the wrong type ({exc})"
        raise ConfigError(f"model.init_from: {where} {what}; restore it from the model's source") from None
    if model.arch != arch:
        raise ConfigError(
            f"model.arch: {model.arch!r}, but model.init_from {directory} holds a {arch!r} model; "
            f"set --model.arch {arch}"
        )
    for key, value in fields.items():
        given = model.args.get(key)
        if given is not None and given != value and key not in _FREE_FIELDS:
            raise ConfigError(
                f"model.args.{key}: {given!r} differs from {value!r} in {where} (model.init_from); drop the override"
            )
    model.args = {**fields, **model.args}
