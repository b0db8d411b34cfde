"""Evaluation of trained runs: validation loss / perplexity from a checkpoint (read by
``anytrain.checkpoint.run_model``), and text samples."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from anytrain import hardware
from anytrain.checkpoint.run_model import load_run_model
from anytrain.data.loader import BatchSource, SampleIndex
from anytrain.data.prepare import load_tokenizer
from anytrain.data.shards import INDEX, TokenDataset, read_index
from anytrain.errors import ConfigError, DataError
from anytrain.models import resolve_args


@torch.no_grad()
def validation_loss(
    model, dataset: TokenDataset, seq_len: int, batches: int, batch_size: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, int]:
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
        raise DataError(
            f"{origin}: {path} has no {INDEX} (no prepared dataset there); pass --data PATH with the "
            "folder `anytrain prepare` wrote"
        )
    dataset = TokenDataset(path)
    vocab = resolve_args(cfg.model).vocab_size
    if dataset.vocab_size > vocab:
        raise DataError(
            f"{origin}: {path} has a vocabulary of {dataset.vocab_size}, larger than the model's "
            f"{vocab}; pass --data with the dataset the run trained on"
        )
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
    same = eos == dataset.eos_id and (
        dataset.tokenizer_path.read_bytes() == theirs.read_bytes()
        or (
            load_tokenizer(dataset.tokenizer_path).get_vocab(with_added_tokens=True)
            == load_tokenizer(theirs).get_vocab(with_added_tokens=True)
        )
    )
    if not same:
        raise DataError(
            f"{origin}: {dataset.path} was prepared with another tokenizer than the run's data "
            f"({recorded}, data.path in {config_file}), so its loss would mean nothing; prepare it with "
            f"--tokenizer {theirs}"
        )


def evaluate_run(
    run_dir: str | Path,
    prompt: str = "ROMEO.\n",
    max_new_tokens: int = 60,
    batches: int = 0,
    seed: int = 0,
    data: str | Path | None = None,
) -> dict:
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
    loss, tokens = validation_loss(
        model, dataset, cfg.data.seq_len, batches or cfg.train.eval_batches or 1, cfg.train.global_batch, device, dtype
    )
    per_source = {}
    if data is None and len(cfg.data.sources) > 1:  # a mixture: each source's loss, and their weighted mean
        for source in cfg.data.sources:
            per_source[source["name"]], _ = validation_loss(
                model,
                open_eval_data(cfg, run_dir, source["path"]),
                cfg.data.seq_len,
                batches or cfg.train.eval_batches or 1,
                cfg.train.global_batch,
                device,
                dtype,
            )
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
