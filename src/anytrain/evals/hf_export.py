"""Export of a run's checkpoint as a Hugging Face model folder: ``anytrain export RUN --format hf``.

Writes a directory that ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load: safetensors weights (sharded
with ``model.safetensors.index.json`` above ``max_shard_bytes``, each shard written as it fills from tensors read one at
a time from the DCP checkpoint), ``config.json``, ``generation_config.json`` and the run's tokenizer as a
``PreTrainedTokenizerFast``. The names, layouts and config translation are ``evals/hf.py``'s; a ``model.arch: hf`` run
is written by ``save_pretrained`` of its own class.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from anytrain.diskio import disk_full_as_error, missing_parents, move_into_place, remove, temp_sibling
from anytrain.errors import RunDirError
from anytrain.evals.hf import INDEX_FILE, SINGLE_FILE, hf_config, hf_family, to_hf_tensors

MARKER = "anytrain_export.json"
"""Written into every export directory: ``--overwrite`` replaces only a directory holding it (or an empty one)."""
DEFAULT_SHARD_BYTES = 5 * 1024**3
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # export --dtype

# --------------------------------------------------------------------------------------------------------------------
# export


def _tokenizer_files(tokenizer_file: Path, max_len: int) -> tuple[dict[str, str], int, int | None]:
    """({file name: text}, eos id, pad id) of the run's tokenizer as a ``PreTrainedTokenizerFast``: BOS = EOS =
    the end-of-text token that separates documents in the prepared data (the GPT-2 convention); no BOS is added."""
    from anytrain.data.prepare import _eos_id, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_file)
    eos_id = _eos_id(tokenizer, str(tokenizer_file))
    eos = tokenizer.id_to_token(eos_id)
    pad = "<|pad|>" if tokenizer.token_to_id("<|pad|>") is not None else None
    special = {"bos_token": eos, "eos_token": eos, "unk_token": None, **({"pad_token": pad} if pad else {})}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": max_len}  # fmt: skip
    files = {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config, indent=2),
             "special_tokens_map.json": json.dumps({k: v for k, v in special.items() if v}, indent=2)}  # fmt: skip
    return files, eos_id, tokenizer.token_to_id(pad) if pad else None


class ShardWriter:
    """safetensors shards written as they fill: ``add`` keeps a tensor in the current shard and writes the shard out
    first when the tensor would take it past ``max_bytes`` (a tensor larger than that gets a shard of its own);
    ``close`` writes the last one and names the files: one ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. At most one shard is held."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.pending_bytes = 0
        self.parts: list[list[str]] = []  # the tensor names of each written shard, in order
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending.append((name, tensor))
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tensors = {name: tensor.contiguous() for name, tensor in self.pending}
        save_file(tensors, str(self.directory / f"part-{len(self.parts)}.safetensors"), metadata={"format": "pt"})
        self.parts.append(list(tensors))
        self.pending, self.pending_bytes = [], 0

    def close(self) -> list[str]:
        """Write the last shard, give every shard its final name (and the index json when several); the names."""
        self._flush()
        count = len(self.parts)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, name in enumerate(names):
            (self.directory / f"part-{i}.safetensors").rename(self.directory / name)
        if count > 1:
            weight_map = {key: name for name, keys in zip(names, self.parts, strict=True) for key in keys}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return names


def write_weights(directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> list[str]:
    """safetensors file(s) in ``directory`` (``ShardWriter``), taking ``tensors`` one at a time; the file names."""
    writer = ShardWriter(directory, max_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    return writer.close()


@contextlib.contextmanager
def _assembled(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` for the export to be written into (a full disk is one line), renamed to ``out``
    when the block succeeds; on any failure it is removed, with the parent folders this export created."""
    created, temp = missing_parents(out), temp_sibling(out)
    try:
        temp.mkdir(parents=True)
        with disk_full_as_error(out):
            yield temp
        move_into_place(temp, out)
    except BaseException:
        for leftover in [temp] + ([created] if created is not None else []):
            remove(leftover)
        raise


def _resolve_source(source: str | Path) -> tuple[Path, Path | None]:
    """(run dir, checkpoint dir or None for the newest) of ``RUN_OR_CHECKPOINT``."""
    from anytrain.train.checkpoint import COMMIT_MARKER

    path = Path(source)
    if (path / COMMIT_MARKER).is_file() or path.parent.name == "checkpoints":
        return path.parent.parent, path
    if not path.is_dir():
        raise RunDirError(f"{path}: not a run directory or a checkpoint directory")
    return path, None


def _check_out(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise RunDirError(f"--out: {out} exists and is not a directory; pick another --out")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise RunDirError(f"--out: {out} exists and is not empty; pass --overwrite to replace an earlier export")
    if not (out / MARKER).is_file():
        raise RunDirError(f"--out: {out} holds files that `anytrain export` did not write (no {MARKER}); "
                          "refusing to replace it")  # fmt: skip


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '1.5GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    value = text.strip().upper()
    for suffix, scale in (("GIB", 1024**3), ("MIB", 1024**2), ("KIB", 1024), ("GB", 10**9), ("MB", 10**6),
                          ("KB", 10**3), ("B", 1)):  # fmt: skip
        if value.endswith(suffix):
            value, unit = value[: -len(suffix)], scale
            break
    else:
        unit = 1
    try:
        size = int(float(value) * unit)
    except ValueError:
        raise RunDirError(f"--max-shard-size: expected a size such as 5GB or 500MB, got {text!r}") from None
    if size <= 0:
        raise RunDirError(f"--max-shard-size: must be > 0, got {text!r}")
    return size


def export_hf(source: str | Path, out: str | Path, dtype: str = "fp32", overwrite: bool = False,
              tokenizer: str | Path | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:  # fmt: skip
    """Write the run's (or checkpoint's) model as an HF folder at ``out`` (see the module docstring). The checkpoint
    is read on the CPU one tensor at a time (``CheckpointTensors``; whatever the layout that saved it) and each
    safetensors shard is written once it is full, so memory holds about one shard and one tensor, not the model.
    The folder is assembled next to ``out`` and renamed into place, so a failure leaves any earlier export as it
    was."""
    from anytrain.config import load_config
    from anytrain.data.shards import TokenDataset
    from anytrain.evals.checkpoint_tensors import CheckpointTensors, expected_tensors, usable_checkpoint
    from anytrain.models import args_dict, build_model, resolve_args

    if dtype not in ("fp32", "bf16"):
        raise RunDirError(f"--dtype: expected fp32 or bf16, got {dtype!r}")
    out = Path(out)
    _check_out(out, overwrite)
    run_dir, checkpoint = _resolve_source(source)
    if run_arch(run_dir) == "hf":  # a transformers model trained as it is: saved as transformers saves it
        return export_hf_arch(run_dir, checkpoint, out, dtype, tokenizer, max_shard_bytes)
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"{run_dir}: no config.yaml; is this a directory written by `anytrain train`?")
    cfg = load_config(run_dir / "config.yaml")
    with torch.device("meta"):
        expected = expected_tensors(build_model(cfg.model))  # names, shapes and dtypes; nothing allocated
    path = usable_checkpoint(run_dir, checkpoint, expected)
    args, arch = resolve_args(cfg.model), cfg.model.arch
    family = hf_family(arch, args)  # before any file is written: a model no HF class represents is refused
    tokenizer_file = Path(tokenizer) if tokenizer else TokenDataset(cfg.data.path).tokenizer_path if (
        Path(cfg.data.path) / "index.json").is_file() else None  # fmt: skip
    if tokenizer_file is None or not tokenizer_file.is_file():
        raise RunDirError(f"{tokenizer_file or Path(cfg.data.path) / 'tokenizer.json'}: the run's tokenizer is not "
                          "there; pass --tokenizer FILE (the tokenizer.json the data was prepared with)")  # fmt: skip
    files, eos_id, pad_id = _tokenizer_files(tokenizer_file, args.max_seq_len)
    torch_dtype = TORCH_DTYPES[dtype]
    tensors = to_hf_tensors(family, args, CheckpointTensors(path, expected, torch_dtype))  # read while written
    config = hf_config(family, args, eos_id, pad_id, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    marker = {"source": str(path), "arch": arch, "args": args_dict(args), "dtype": dtype, "format": "hf"}
    with _assembled(out) as temp:
        shards = write_weights(temp, tensors, max_shard_bytes)
        for name, text in {**files, "config.json": json.dumps(config, indent=2),
                           "generation_config.json": json.dumps(generation, indent=2),
                           MARKER: json.dumps({**marker, "weights": shards}, indent=1)}.items():  # fmt: skip
            (temp / name).write_text(text)
    return out


# --------------------------------------------------------------------------------------------------------------------
# export of a model.arch hf run: the trained transformers model as save_pretrained writes it

HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Tokenizer files of ``model.hf_path`` that an export of an hf-arch run carries over (those that exist)."""


def run_arch(run_dir: Path) -> str | None:
    """``model.arch`` recorded in a run's config.yaml (None when it cannot be read: load_run_model reports that)."""
    import yaml

    try:
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    return (recorded.get("model") or {}).get("arch") if isinstance(recorded, dict) else None


def export_hf_arch(run_dir: Path, checkpoint: Path | None, out: Path, dtype: str, tokenizer: str | Path | None,
                   max_shard_bytes: int) -> Path:  # fmt: skip
    """``anytrain export --format hf`` of a ``model.arch: hf`` run: the checkpoint's weights in the class and
    config.json of ``model.hf_path`` (``save_pretrained``: safetensors, sharded above ``max_shard_bytes``), dtype as
    asked; the folder's generation_config.json and tokenizer files (``HF_TOKENIZER_FILES``) copied, or with
    ``tokenizer`` (a tokenizer.json), or when the folder has none, the run's tokenizer as the other families export
    it. Assembled next to ``out`` and renamed into place."""
    import shutil

    from anytrain.data.shards import TokenDataset
    from anytrain.evals import load_run_model

    cfg, model, path = load_run_model(run_dir, torch.device("cpu"), checkpoint)
    source = Path(cfg.model.hf_path)
    copies = [source / name for name in (*HF_TOKENIZER_FILES, "generation_config.json") if (source / name).is_file()]
    files: dict[str, str] = {}
    if tokenizer or not any(f.name in HF_TOKENIZER_FILES for f in copies):
        tokenizer_file = Path(tokenizer) if tokenizer else TokenDataset(cfg.data.path).tokenizer_path
        if not tokenizer_file.is_file():
            raise RunDirError(f"{tokenizer_file}: no tokenizer to ship; pass --tokenizer FILE")
        files, _, _ = _tokenizer_files(tokenizer_file, model.args.max_seq_len)
        copies = [f for f in copies if f.name not in HF_TOKENIZER_FILES]
    hf = model.hf.to(TORCH_DTYPES[dtype])
    marker = {"source": str(path), "arch": "hf", "hf_path": str(source), "class": type(hf).__name__, "dtype": dtype,
              "format": "hf"}  # fmt: skip
    with _assembled(out) as temp:
        hf.save_pretrained(temp, max_shard_size=max_shard_bytes)
        for file in copies:
            shutil.copyfile(file, temp / file.name)
        for name, text in files.items():
            (temp / name).write_text(text)
        weights = sorted(p.name for p in temp.glob("*.safetensors"))
        (temp / MARKER).write_text(json.dumps({**marker, "weights": weights}, indent=1))
    return out
