"""Hugging Face names, layouts and configs of anytrain's model families, and ``model.init_from`` (import).

``evals/hf_export.py`` writes the export folder (``anytrain export --format hf``) from these mappings. The config
JSON is written without ``transformers`` (needed only to load the result), with the keys of both transformers 4.x and
5.x (``rope_theta`` and ``rope_parameters``).

The HF class follows the model args (``hf_family``): a Transformer with RoPE, RMSNorm and SwiGLU ->
``LlamaForCausalLM``; with ALiBi, LayerNorm without bias, GELU (F = 4·D), multi-head attention ->
``MptForCausalLM``; Mamba -> ``MambaForCausalLM``, Mamba-2 -> ``Mamba2ForCausalLM`` (equal names; Mamba-2's config
mapping is ``models/mamba2/hf.py``'s). Other option combinations (biases, QK-norm, learned
positions, ...) have no HF class here and are refused with one line.

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

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from anytrain.errors import ConfigError
from anytrain.models.hf.adapter import INDEX_FILE as INDEX_FILE  # the file names of a Hugging Face folder
from anytrain.models.hf.adapter import SINGLE_FILE as SINGLE_FILE
from anytrain.models.hf.adapter import open_safetensors, safetensors_files
from anytrain.models.mamba2 import hf as mamba2_hf

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
_LLAMA_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}  # fmt: skip


_MPT_LAYER = {
    "attention.wo.weight": "attn.out_proj.weight",
    "feed_forward.w1.weight": "ffn.up_proj.weight",
    "feed_forward.w2.weight": "ffn.down_proj.weight",
    "attention_norm.weight": "norm_1.weight",
    "ffn_norm.weight": "norm_2.weight",
}
_MPT_QKV = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight")  # stacked rows of attn.Wqkv
_MPT_TOP = {"tok_embeddings.weight": "transformer.wte.weight", "norm.weight": "transformer.norm_f.weight",
            "output.weight": "lm_head.weight"}  # fmt: skip


def _transformer_options(args: Any) -> dict[str, Any]:
    return {"pos_encoding": args.pos_encoding, "norm": args.norm, "norm_bias": args.norm_bias, "mlp": args.mlp,
            "bias": args.bias, "qk_norm": args.qk_norm}  # fmt: skip


LLAMA_OPTIONS = {"pos_encoding": "rope", "norm": "rmsnorm", "norm_bias": False, "mlp": "swiglu", "bias": False,
                 "qk_norm": False}  # fmt: skip
MPT_OPTIONS = {"pos_encoding": "alibi", "norm": "layernorm", "norm_bias": False, "mlp": "gelu", "bias": False,
               "qk_norm": False}  # fmt: skip


_MAMBA_FAMILIES = ("mamba", "mamba2")  # anytrain's names are HF's (backbone.*, lm_head.weight)


def hf_family(arch: str, args: Any) -> str:
    """'llama', 'mpt', 'mamba' or 'mamba2': the transformers class that computes what ``arch`` with ``args``
    computes; one ConfigError for a Transformer no HF class here represents."""
    if arch != "transformer":
        return arch
    options = _transformer_options(args)
    if options == LLAMA_OPTIONS:
        return "llama"
    if options == MPT_OPTIONS and args.ffn_dim == 4 * args.dim and args.n_kv_heads == args.n_heads:
        return "mpt"
    options.update(ffn_dim=args.ffn_dim, dim=args.dim, n_kv_heads=args.n_kv_heads, n_heads=args.n_heads)
    given = ", ".join(f"{k}={v}" for k, v in options.items())
    raise ConfigError(f"export --format hf: no transformers class computes this Transformer ({given}); "
                      "LlamaForCausalLM needs rope/rmsnorm/swiglu, MptForCausalLM alibi/layernorm/gelu with "
                      "ffn_dim = 4·dim and n_kv_heads = n_heads; both no bias, norm_bias or qk_norm")  # fmt: skip


def hf_name(family: str, name: str) -> str:
    """The HF tensor name of an anytrain parameter name (q, k and v share MPT's ``Wqkv``)."""
    if family in _MAMBA_FAMILIES:
        return name
    top, layer, prefix = (_MPT_TOP, _MPT_LAYER, "transformer.blocks") if family == "mpt" else (
        _LLAMA_TOP, _LLAMA_LAYER, "model.layers")  # fmt: skip
    if name in top:
        return top[name]
    _, index, rest = name.split(".", 2)  # layers.{i}.<rest>
    if family == "mpt" and rest in _MPT_QKV:
        return f"{prefix}.{index}.attn.Wqkv.weight"
    return f"{prefix}.{index}.{layer[rest]}"


def _head_count(family: str, name: str, args: Any) -> int | None:
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
    head = "lm_head.weight" if family in _MAMBA_FAMILIES else "output.weight"
    for name in state:
        if name == head and args.tie_embeddings:
            continue
        if family == "mpt" and name.endswith(_MPT_QKV):
            if not name.endswith(_MPT_QKV[0]):
                continue  # k and v go out with q
            layer = name[: -len(_MPT_QKV[0])]
            yield hf_name(family, name), torch.cat([state[layer + part] for part in _MPT_QKV])
            continue
        heads = _head_count(family, name, args)
        tensor = state[name]
        yield hf_name(family, name), interleaved_to_halves(tensor, heads) if heads else tensor


# --------------------------------------------------------------------------------------------------------------------
# config.json


def hf_config(family: str, args: Any, eos_id: int, pad_id: int | None, dtype: str) -> dict[str, Any]:
    """config.json of the HF model (``hf_family``) equal to anytrain's model with ``args``."""
    common = {"vocab_size": args.vocab_size, "tie_word_embeddings": args.tie_embeddings, "bos_token_id": eos_id,
              "eos_token_id": eos_id, "pad_token_id": pad_id, "initializer_range": args.init_std, "use_cache": True,
              "torch_dtype": dtype, "dtype": dtype}  # fmt: skip
    if family == "mpt":
        attn = {"attn_type": "multihead_attention", "attn_pdrop": 0, "attn_impl": "torch", "clip_qkv": None,
                "softmax_scale": None, "prefix_lm": False, "qk_ln": False, "attn_uses_sequence_id": False,
                "alibi": True, "alibi_bias_max": 8}  # fmt: skip
        return {"architectures": ["MptForCausalLM"], "model_type": "mpt", **common, "d_model": args.dim,
                "n_heads": args.n_heads, "n_layers": args.n_layers, "expansion_ratio": 4,
                "max_seq_len": args.max_seq_len, "layer_norm_epsilon": args.norm_eps, "learned_pos_emb": False,
                "no_bias": True, "logit_scale": None, "norm_type": "low_precision_layernorm", "emb_pdrop": 0.0,
                "resid_pdrop": 0.0, "embedding_fraction": 1.0, "attn_config": attn}  # fmt: skip
    if family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, "hidden_size": args.dim,
                "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
                "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
                "head_dim": args.head_dim, "hidden_act": "silu", "max_position_embeddings": args.max_seq_len,
                "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta}, "rope_scaling": None,
                "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1}  # fmt: skip
    if family == "mamba2":
        return mamba2_hf.hf_config(args, common)
    return {"architectures": ["MambaForCausalLM"], "model_type": "mamba", **common, "hidden_size": args.d_model,
            "state_size": args.d_state, "num_hidden_layers": args.n_layers, "layer_norm_epsilon": args.norm_eps,
            "expand": args.expand, "intermediate_size": args.d_inner, "conv_kernel": args.d_conv, "use_bias": False,
            "use_conv_bias": True, "hidden_act": "silu", "residual_in_fp32": args.residual_in_fp32,
            "time_step_rank": args.dt_rank, "time_step_scale": 1.0, "time_step_min": args.dt_min,
            "time_step_max": args.dt_max, "time_step_init_scheme": "random", "time_step_floor": args.dt_init_floor,
            "rescale_prenorm_residual": False, "use_mambapy": False}  # fmt: skip


def _require(config: dict, key: str, expected: Any, where: str) -> None:
    value = config.get(key, expected)
    if value != expected:
        raise ConfigError(f"model.init_from: {where} has {key}={value!r}; anytrain's model needs {expected!r}")


def _rope_theta(config: dict, where: str) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"model.init_from: {where} uses RoPE scaling {kind!r}; only the default RoPE is supported")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def args_from_hf_config(config: dict, where: str) -> tuple[str, dict[str, Any]]:
    """(anytrain arch, model.args fields) of an HF config.json; one ConfigError naming the field for an architecture
    anytrain's models cannot represent."""
    kind = config.get("model_type")
    if kind == "llama":
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                              ("pretraining_tp", 1), ("head_dim", hidden // heads)):  # fmt: skip
            _require(config, key, expected, where)
        return "transformer", {
            **LLAMA_OPTIONS, "vocab_size": config["vocab_size"], "dim": hidden, "n_layers": config["num_hidden_layers"],
            "n_heads": heads, "n_kv_heads": config.get("num_key_value_heads") or heads,
            "ffn_dim": config["intermediate_size"], "rope_theta": _rope_theta(config, where),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "max_seq_len": config.get("max_position_embeddings", 2048),
        }  # fmt: skip
    if kind == "mamba":
        hidden, expand = config["hidden_size"], config.get("expand", 2)
        for key, expected in (("hidden_act", "silu"), ("use_bias", False), ("use_conv_bias", True),
                              ("intermediate_size", expand * hidden)):  # fmt: skip
            _require(config, key, expected, where)
        rank = config.get("time_step_rank", "auto")
        return "mamba", {
            "vocab_size": config["vocab_size"], "d_model": hidden, "n_layers": config["num_hidden_layers"],
            "d_state": config.get("state_size", 16), "d_conv": config.get("conv_kernel", 4), "expand": expand,
            "dt_rank": math.ceil(hidden / 16) if rank == "auto" else rank,
            "norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
            "residual_in_fp32": bool(config.get("residual_in_fp32", True)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
        }  # fmt: skip
    if kind == "mpt":
        return "transformer", _mpt_args(config, where)
    if kind == "mamba2":
        return "mamba2", mamba2_hf.args_from_hf_config(config, where)
    raise ConfigError(
        f"model.init_from: {where} has model_type {kind!r}; anytrain imports 'llama', 'mpt', 'mamba' and 'mamba2'"
    )


def _mpt_args(config: dict, where: str) -> dict[str, Any]:
    """model.args of an MPT config.json: the settings ``MptForCausalLM`` computes with (it ignores learned_pos_emb
    and no_bias; a checkpoint holding tensors it has no place for fails when the weights are read)."""
    hidden, heads = config["d_model"], config["n_heads"]
    for key, expected in (("expansion_ratio", 4), ("logit_scale", None)):
        _require(config, key, expected, where)
    attn = config.get("attn_config") or {}
    scale = attn.get("softmax_scale")
    if scale is not None and not math.isclose(scale, (hidden // heads) ** -0.5):
        raise ConfigError(f"model.init_from: {where} has attn_config.softmax_scale={scale!r}; anytrain's model "
                          f"needs 1/sqrt(head_dim) = {(hidden // heads) ** -0.5!r} (or null)")  # fmt: skip
    for key, expected in (("alibi", True), ("alibi_bias_max", 8), ("qk_ln", False), ("clip_qkv", None),
                          ("prefix_lm", False), ("attn_uses_sequence_id", False)):  # fmt: skip
        _require(attn, key, expected, f"{where} attn_config")
    return {
        **MPT_OPTIONS, "vocab_size": config["vocab_size"], "dim": hidden, "n_layers": config["n_layers"],
        "n_heads": heads, "n_kv_heads": heads, "ffn_dim": 4 * hidden,
        "norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
        "max_seq_len": config.get("max_seq_len", 2048),
    }  # fmt: skip


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
        raise ConfigError(f"model.init_from: {config_file} holds a JSON {type(config).__name__}, not the object "
                          "save_pretrained writes; restore it from the model's source")  # fmt: skip
    return config


def apply_init_from(cfg: Any) -> None:
    """At config load: make ``model.init_from`` absolute and fill ``model.args`` from its config.json (so the saved
    config.yaml records the shape); an explicit ``model.args`` field or ``model.arch`` that disagrees is one
    ConfigError naming it. A resolved run config whose folder is gone keeps its recorded args."""
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
        raise ConfigError(f"model.arch: {model.arch!r}, but model.init_from {directory} holds a {arch!r} model; "
                          f"set --model.arch {arch}")  # fmt: skip
    for key, value in fields.items():
        given = model.args.get(key)
        if given is not None and given != value and key not in _FREE_FIELDS:
            raise ConfigError(f"model.args.{key}: {given!r} differs from {value!r} in {where} (model.init_from); "
                              "drop the override")  # fmt: skip
    model.args = {**fields, **model.args}


# --------------------------------------------------------------------------------------------------------------------
# import


def _hf_shapes(family: str, shapes: dict[str, torch.Size]) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: its shape} for anytrain parameters of ``shapes`` (MPT's Wqkv: the q, k, v rows stacked)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        key = hf_name(family, name)
        if key in out and name.endswith(_MPT_QKV):
            out[key] = (out[key][0] + shape[0], *shape[1:])
        else:
            out[key] = tuple(shape)
    return out


def read_hf_weights(directory: str | Path, arch: str, args: Any, shapes: dict[str, torch.Size],
                    names: list[str] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The HF model in ``directory`` as anytrain tensors on the CPU, keyed by anytrain's ``names`` (default: all of
    ``shapes``; rows of q/k permuted back to pair order; MPT's Wqkv split into q, k, v; a tied LM head read from the
    embedding). ``shapes`` ({name: shape} of the whole model) is checked first against the files' headers alone: a
    tensor the model has no place for, one it lacks or one of another shape is one ConfigError, the same on every rank
    whatever it reads. Then only the tensors behind ``names`` are read, one at a time, from the files holding them."""
    directory, family = Path(directory), hf_family(arch, args)
    head = "lm_head.weight" if arch in _MAMBA_FAMILIES else "output.weight"
    embedding = "backbone.embeddings.weight" if arch in _MAMBA_FAMILIES else "tok_embeddings.weight"
    expected = _hf_shapes(family, shapes)
    where: dict[str, Path] = {}  # HF tensor name -> the file holding it
    for file in safetensors_files(directory, "model.init_from", "save the model with save_pretrained (safetensors)"):
        with open_safetensors(file, "model.init_from") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key not in expected:
                    if key == "lm_head.weight" and args.tie_embeddings:
                        continue  # a tied head stored anyway
                    raise ConfigError(f"model.init_from: {file.name} holds {key}, which {arch} has no place for")
                shape = tuple(handle.get_slice(key).get_shape())
                if shape != expected[key]:
                    raise ConfigError(f"model.init_from: {key} in {file.name} has shape {shape}, the model expects "
                                      f"{expected[key]}")  # fmt: skip
                where[key] = file
    tied_head = hf_name(family, head) if args.tie_embeddings and head in shapes else None
    missing = [key for key in expected if key not in where and key != tied_head]
    if missing:
        raise ConfigError(f"model.init_from: {directory} lacks {missing[0]}" + (f" (and {len(missing) - 1} more)"
                          if len(missing) > 1 else ""))  # fmt: skip
    names = list(shapes) if names is None else names
    wanted: dict[str, list[str]] = {}  # HF tensor name -> the anytrain names it fills
    for name in names:
        wanted.setdefault(hf_name(family, embedding if name == head and tied_head else name), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file in sorted({where[key] for key in wanted}):
        with open_safetensors(file, "model.init_from") as handle:
            for key in (k for k in wanted if where[k] == file):
                tensor = handle.get_tensor(key)
                if family == "mpt" and key.endswith("attn.Wqkv.weight"):  # rows [q; k; v], each D (multi-head)
                    parts = dict(zip(_MPT_QKV, tensor.chunk(3), strict=True))
                    out.update({n: parts[n[n.index("attention.") :]] for n in wanted[key]})
                    continue
                for name in wanted[key]:
                    heads = _head_count(family, name, args)
                    out[name] = halves_to_interleaved(tensor, heads) if heads else tensor
    return out


@torch.no_grad()
def init_from_hf(model: nn.Module, model_cfg: Any, log: Any = print) -> None:
    """Trainer hook, after weight init and before parallelisation: copy the weights of ``model.init_from`` (an HF
    folder) into ``model``, on its device. ``model`` is the whole model (DDP/FSDP/TP then replicate or shard it as
    usual) or one pipeline stage's part (parameter names of the whole model): the folder is checked against the whole
    model (``read_hf_weights``), and only ``model``'s own tensors are read (on the CPU, one at a time). ``log`` gets
    one line. Nothing happens when ``init_from`` is empty."""
    if not getattr(model_cfg, "init_from", ""):
        return
    from anytrain.models import build_model, resolve_args

    with torch.device("meta"):
        whole = build_model(model_cfg)
    shapes = {name: p.shape for name, p in whole.named_parameters(remove_duplicate=False)}
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = read_hf_weights(model_cfg.init_from, model_cfg.arch, resolve_args(model_cfg), shapes, list(params))
    for name, param in params.items():
        param.copy_(tensors[name])
    log(f"model.init_from: weights of {model_cfg.init_from} ({len(params)} tensors)")
