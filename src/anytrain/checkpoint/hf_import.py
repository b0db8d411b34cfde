"""``model.init_from``: the weights of a Hugging Face model folder (safetensors) copied into a built anytrain model,
through the family's state-dict adapter (``anytrain.models.conversion``); ``model.args`` came from the folder's
config.json when the run config was resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from anytrain.errors import ConfigError
from anytrain.models import build_model, resolve_args
from anytrain.models.conversion import BACKBONE_ARCHS, from_hf_tensor, hf_family, hf_name, hf_shapes
from anytrain.models.hf.adapter import open_safetensors, safetensors_files


def read_hf_weights(
    directory: str | Path, arch: str, args: Any, shapes: dict[str, torch.Size], names: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The HF model in ``directory`` as anytrain tensors on the CPU, keyed by anytrain's ``names`` (default: all of
    ``shapes``; rows of q/k permuted back to pair order; MPT's Wqkv split into q, k, v; a tied LM head read from the
    embedding). ``shapes`` ({name: shape} of the whole model) is checked first against the files' headers alone: a
    tensor the model has no place for, one it lacks or one of another shape is one ConfigError, the same on every rank
    whatever it reads. Then only the tensors behind ``names`` are read, one at a time, from the files holding them."""
    directory, family = Path(directory), hf_family(arch, args)
    head = "lm_head.weight" if arch in BACKBONE_ARCHS else "output.weight"
    embedding = "backbone.embeddings.weight" if arch in BACKBONE_ARCHS else "tok_embeddings.weight"
    expected = hf_shapes(family, shapes)
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
                    raise ConfigError(
                        f"model.init_from: {key} in {file.name} has shape {shape}, the model expects {expected[key]}"
                    )
                where[key] = file
    tied_head = hf_name(family, head) if args.tie_embeddings and head in shapes else None
    missing = [key for key in expected if key not in where and key != tied_head]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"model.init_from: {directory} lacks {missing[0]}" + more)
    names = list(shapes) if names is None else names
    wanted: dict[str, list[str]] = {}  # HF tensor name -> the anytrain names it fills
    for name in names:
        wanted.setdefault(hf_name(family, embedding if name == head and tied_head else name), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file in sorted({where[key] for key in wanted}):
        with open_safetensors(file, "model.init_from") as handle:
            for key in (k for k in wanted if where[k] == file):
                out.update(from_hf_tensor(family, key, handle.get_tensor(key), wanted[key], args))
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
    with torch.device("meta"):
        whole = build_model(model_cfg)
    shapes = {name: p.shape for name, p in whole.named_parameters(remove_duplicate=False)}
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = read_hf_weights(model_cfg.init_from, model_cfg.arch, resolve_args(model_cfg), shapes, list(params))
    for name, param in params.items():
        param.copy_(tensors[name])
    log(f"model.init_from: weights of {model_cfg.init_from} ({len(params)} tensors)")
