"""Evaluation of trained runs: validation loss / perplexity from a checkpoint, and text samples."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from anytrain import hardware
from anytrain.config import load_config
from anytrain.data.loader import BatchSource, SampleIndex
from anytrain.data.prepare import load_tokenizer
from anytrain.data.shards import INDEX, TokenDataset, read_index
from anytrain.diskio import disk_full_as_error, missing_parents, remove, temp_sibling
from anytrain.errors import ConfigError, DataError, RunDirError
from anytrain.models import build_model, resolve_args
from anytrain.train.checkpoint import COMMIT_MARKER, Checkpointer, CheckpointUnusable, is_committed


def load_run_model(run_dir: str | Path, device: torch.device, checkpoint: str | Path | None = None):
    """(config, model with the newest committed checkpoint's weights, checkpoint path) of a run directory."""
    run_dir = Path(run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise RunDirError(f"{run_dir}: no config.yaml; is this a directory written by `anytrain train`?")
    cfg = load_config(config_file)
    model = build_model(cfg.model).to(device)
    state = {"model": get_model_state_dict(model)}
    path = _load_checkpoint(run_dir, state, checkpoint)
    model.load_state_dict(state["model"])
    model.eval()
    return cfg, model, path


def _load_checkpoint(run_dir: Path, state: dict, checkpoint: str | Path | None) -> Path:
    """Load ``checkpoint``, or the newest committed checkpoint that loads (a damaged newest one is named in a warning
    and the previous one used, as on resume); one-line RunDirError when none can be."""
    checkpointer = Checkpointer(run_dir / "checkpoints", 1, True, log=lambda m: print(m, file=sys.stderr))
    if not checkpoint:
        path = checkpointer.load_newest(state)
        if path is None:
            raise RunDirError(f"{run_dir}/checkpoints: no committed checkpoint to evaluate")
        return path
    path = Path(checkpoint)
    if not is_committed(path):
        raise RunDirError(f"{path}: not a committed checkpoint (no {COMMIT_MARKER} in it); pass a step_N directory "
                          "of the run's checkpoints/")  # fmt: skip
    try:
        checkpointer.load(path, state)
    except CheckpointUnusable as exc:
        raise RunDirError(f"{path}: cannot be loaded ({exc})") from None
    return path


@torch.no_grad()
def validation_loss(model, dataset: TokenDataset, seq_len: int, batches: int, batch_size: int,
                    device: torch.device, dtype: torch.dtype) -> tuple[float, int]:  # fmt: skip
    """Mean next-token loss over the first ``batches`` x ``batch_size`` validation sequences (storage order)."""
    source = BatchSource(SampleIndex(dataset.split("val"), seq_len, "val"), batch_size, seed=0, shuffle=False)
    loss_sum, count = 0.0, 0
    for batch in range(batches):
        inputs, targets, _ = source.rank_batch(batch, 0, 1)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs.to(device))
        loss_sum += F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(), reduction="sum").item()
        count += targets.numel()
    return loss_sum / count, count


def open_eval_data(cfg, run_dir: str | Path, data: str | Path | None) -> TokenDataset:
    """The prepared dataset to evaluate on: ``data`` if given, else the run's recorded ``data.path``; a missing one
    is one line naming the path and the way to point eval elsewhere."""
    if data is not None:
        path, origin = Path(data), "--data"
    else:
        path, origin = Path(cfg.data.path), f"data.path in {Path(run_dir) / 'config.yaml'}"
    if not (path / INDEX).is_file():
        raise DataError(f"{origin}: {path} has no {INDEX} (no prepared dataset there); pass --data PATH with the "
                        "folder `anytrain prepare` wrote")  # fmt: skip
    dataset = TokenDataset(path)
    vocab = resolve_args(cfg.model).vocab_size
    if dataset.vocab_size > vocab:
        raise DataError(f"{origin}: {path} has a vocabulary of {dataset.vocab_size}, larger than the model's "
                        f"{vocab}; pass --data with the dataset the run trained on")  # fmt: skip
    if data is not None:
        check_same_tokenizer(dataset, Path(cfg.data.path), origin, Path(run_dir) / "config.yaml")
    return dataset


def check_same_tokenizer(dataset: TokenDataset, recorded: Path, origin: str, config_file: Path) -> None:
    """``dataset`` must be tokenized as the run's recorded ``data.path`` was: the same vocabulary (added tokens
    included) and EOS id, the test ``data.sources`` passes. Not checkable when the recorded dataset is gone."""
    theirs = recorded / "tokenizer.json"
    if not theirs.is_file() or not dataset.tokenizer_path.is_file():
        return
    try:
        eos = read_index(recorded)["eos_id"]
    except DataError:
        return  # the recorded dataset is damaged: nothing to compare with
    same = eos == dataset.eos_id and (dataset.tokenizer_path.read_bytes() == theirs.read_bytes() or (
        load_tokenizer(dataset.tokenizer_path).get_vocab(with_added_tokens=True)
        == load_tokenizer(theirs).get_vocab(with_added_tokens=True)))  # fmt: skip
    if not same:
        raise DataError(f"{origin}: {dataset.path} was prepared with another tokenizer than the run's data "
                        f"({recorded}, data.path in {config_file}), so its loss would mean nothing; prepare it with "
                        f"--tokenizer {theirs}")  # fmt: skip


def evaluate_run(run_dir: str | Path, prompt: str = "ROMEO.\n", max_new_tokens: int = 60, batches: int = 0,
                 seed: int = 0, data: str | Path | None = None) -> dict:  # fmt: skip
    """Validation loss of the newest checkpoint on the run's data (or ``data``) and a sample continuing ``prompt``."""
    if batches < 0:
        raise ConfigError(f"--batches: must be >= 0 (0 = the run's train.eval_batches), got {batches}")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens: must be >= 0, got {max_new_tokens}")
    device = hardware.resolve_device("auto")
    cfg, model, path = load_run_model(run_dir, device)
    dataset = open_eval_data(cfg, run_dir, data)
    if cfg.data.document_mask:  # attention inside each document, as the run trained and validated
        model.document_eos_id = dataset.eos_id
    dtype = torch.bfloat16 if hardware.supports_bf16(device) else torch.float32
    loss, tokens = validation_loss(model, dataset, cfg.data.seq_len, batches or cfg.train.eval_batches or 1,
                                   cfg.train.global_batch, device, dtype)  # fmt: skip
    per_source = {}
    if data is None and len(cfg.data.sources) > 1:  # a mixture: each source's loss, and their weighted mean
        for source in cfg.data.sources:
            per_source[source["name"]], _ = validation_loss(model, open_eval_data(cfg, run_dir, source["path"]),
                                                            cfg.data.seq_len, batches or cfg.train.eval_batches or 1,
                                                            cfg.train.global_batch, device, dtype)  # fmt: skip
        weights = [source["weight"] for source in cfg.data.sources]
        loss = sum(w * v for w, v in zip(weights, per_source.values(), strict=True)) / sum(weights)
    tokenizer = load_tokenizer(dataset.tokenizer_path)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [dataset.eos_id]
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, generator=generator)
    return {
        "checkpoint": str(path),
        "step": int(path.name.split("_")[-1]),
        "val_loss": loss,
        "val_ppl": math.exp(min(loss, 50.0)),
        "val_loss_per_source": per_source,
        "val_tokens": tokens,
        "sample": tokenizer.decode(out[0].tolist()),
    }


def _export_paths(out: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """(weights file, JSON sidecar) for ``--out``; refuses another suffix and, without ``overwrite``, existing files."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise RunDirError(f"--out: {out} must end in .safetensors (the model config goes next to it as "
                          f"{out.with_suffix('.json').name})")  # fmt: skip
    sidecar = out.with_suffix(".json")
    for path in (out, sidecar):
        if path.is_dir():
            raise RunDirError(f"{path}: is a directory; pick another --out")
        if path.exists() and not overwrite:
            raise RunDirError(f"{path}: exists; pass --overwrite to replace it")
    return out, sidecar


def _checkpoint_path(run_dir: str | Path, checkpoint: str | Path | None) -> Path | None:
    if checkpoint is None:
        return None
    for path in (Path(checkpoint), Path(run_dir) / checkpoint, Path(run_dir) / "checkpoints" / checkpoint):
        if path.is_dir():
            return path
    raise RunDirError(f"--checkpoint: {checkpoint} is not a checkpoint directory; pass one of "
                      f"{Path(run_dir) / 'checkpoints'}/step_* (or leave it out for the newest)")  # fmt: skip


def export_run(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None, dtype: str = "fp32",
               overwrite: bool = False) -> Path:  # fmt: skip
    """Write the weights of a run's checkpoint as one safetensors file (shared tensors stored once) and the model
    config next to it as ``<name>.json``. Both are written to hidden temporary files and renamed into place, so a
    failure leaves any previous export as it was."""
    from safetensors.torch import save_model

    from anytrain.models import args_dict

    if dtype not in ("fp32", "bf16"):
        raise RunDirError(f"--dtype: expected fp32 or bf16, got {dtype!r}")
    out, sidecar = _export_paths(out, overwrite)
    cfg, model, path = load_run_model(run_dir, torch.device("cpu"), _checkpoint_path(run_dir, checkpoint))
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    meta = {"arch": cfg.model.arch, "checkpoint": str(path), "format": "anytrain"}
    info = {**meta, "args": args_dict(resolve_args(cfg.model)), "dtype": dtype}
    created = missing_parents(out)
    temps = [temp_sibling(out), temp_sibling(sidecar)]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with disk_full_as_error(out):
            save_model(model, str(temps[0]), metadata=meta)
        with disk_full_as_error(sidecar):
            temps[1].write_text(json.dumps(info, indent=1))
        temps[0].replace(out)
        temps[1].replace(sidecar)
    except BaseException:
        for temp in temps + ([created] if created is not None else []):
            remove(temp)
        raise
    return out
