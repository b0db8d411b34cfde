"""Export of a run's checkpoint: ``anytrain export RUN --format hf`` (a Hugging Face model folder, :func:`export_hf`)
or ``--format safetensors`` (one safetensors file and the model config next to it, :func:`export_run`).

The HF folder is one that ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load: safetensors weights (sharded
with ``model.safetensors.index.json`` above ``max_shard_bytes``, each shard written as it fills from tensors read one at
a time from the DCP checkpoint), ``config.json``, ``generation_config.json`` and the run's tokenizer as a
``PreTrainedTokenizerFast``. The names, layouts and config translation are the families' state-dict adapters'
(``anytrain.models.conversion``); a ``model.arch: hf`` run is written by ``save_pretrained`` of its own class.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from anytrain.diskio import disk_full_as_error, missing_parents, move_into_place, remove, temp_sibling
from anytrain.errors import RunDirError
from anytrain.models.conversion import INDEX_FILE, SINGLE_FILE, hf_config, hf_family, to_hf_tensors

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
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    files = {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps({k: v for k, v in special.items() if v}, indent=2),
    }
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
    from anytrain.checkpoint.dcp import COMMIT_MARKER

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
        raise RunDirError(
            f"--out: {out} holds files that `anytrain export` did not write (no {MARKER}); refusing to replace it"
        )


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '1.5GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    value = text.strip().upper()
    for suffix, scale in (
        ("GIB", 1024**3),
        ("MIB", 1024**2),
        ("KIB", 1024),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
    ):
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


def export_hf(
    source: str | Path,
    out: str | Path,
    dtype: str = "fp32",
    overwrite: bool = False,
    tokenizer: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write the run's (or checkpoint's) model as an HF folder at ``out`` (see the module docstring). The checkpoint
    is read on the CPU one tensor at a time (``CheckpointTensors``; whatever the layout that saved it) and each
    safetensors shard is written once it is full, so memory holds about one shard and one tensor, not the model.
    The folder is assembled next to ``out`` and renamed into place, so a failure leaves any earlier export as it
    was."""
    from anytrain.checkpoint.tensors import CheckpointTensors, expected_tensors, usable_checkpoint
    from anytrain.config import load_config
    from anytrain.data.resolve import resolve_run_config
    from anytrain.data.shards import TokenDataset
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
    cfg = resolve_run_config(load_config(run_dir / "config.yaml"))
    with torch.device("meta"):
        expected = expected_tensors(build_model(cfg.model))  # names, shapes and dtypes; nothing allocated
    path = usable_checkpoint(run_dir, checkpoint, expected)
    args, arch = resolve_args(cfg.model), cfg.model.arch
    family = hf_family(arch, args)  # before any file is written: a model no HF class represents is refused
    tokenizer_file = (
        Path(tokenizer)
        if tokenizer
        else TokenDataset(cfg.data.path).tokenizer_path
        if (Path(cfg.data.path) / "index.json").is_file()
        else None
    )
    if tokenizer_file is None or not tokenizer_file.is_file():
        raise RunDirError(
            f"{tokenizer_file or Path(cfg.data.path) / 'tokenizer.json'}: the run's tokenizer is not "
            "there; pass --tokenizer FILE (the tokenizer.json the data was prepared with)"
        )
    files, eos_id, pad_id = _tokenizer_files(tokenizer_file, args.max_seq_len)
    torch_dtype = TORCH_DTYPES[dtype]
    tensors = to_hf_tensors(family, args, CheckpointTensors(path, expected, torch_dtype))  # read while written
    config = hf_config(family, args, eos_id, pad_id, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    marker = {"source": str(path), "arch": arch, "args": args_dict(args), "dtype": dtype, "format": "hf"}
    with _assembled(out) as temp:
        shards = write_weights(temp, tensors, max_shard_bytes)
        for name, text in {
            **files,
            "config.json": json.dumps(config, indent=2),
            "generation_config.json": json.dumps(generation, indent=2),
            MARKER: json.dumps({**marker, "weights": shards}, indent=1),
        }.items():
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


def export_hf_arch(
    run_dir: Path, checkpoint: Path | None, out: Path, dtype: str, tokenizer: str | Path | None, max_shard_bytes: int
) -> Path:
    """``anytrain export --format hf`` of a ``model.arch: hf`` run: the checkpoint's weights in the class and
    config.json of ``model.hf_path`` (``save_pretrained``: safetensors, sharded above ``max_shard_bytes``), dtype as
    asked; the folder's generation_config.json and tokenizer files (``HF_TOKENIZER_FILES``) copied, or with
    ``tokenizer`` (a tokenizer.json), or when the folder has none, the run's tokenizer as the other families export
    it. Assembled next to ``out`` and renamed into place."""
    import shutil

    from anytrain.checkpoint.run_model import load_run_model
    from anytrain.data.shards import TokenDataset

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
    marker = {
        "source": str(path),
        "arch": "hf",
        "hf_path": str(source),
        "class": type(hf).__name__,
        "dtype": dtype,
        "format": "hf",
    }
    with _assembled(out) as temp:
        hf.save_pretrained(temp, max_shard_size=max_shard_bytes)
        for file in copies:
            shutil.copyfile(file, temp / file.name)
        for name, text in files.items():
            (temp / name).write_text(text)
        weights = sorted(p.name for p in temp.glob("*.safetensors"))
        (temp / MARKER).write_text(json.dumps({**marker, "weights": weights}, indent=1))
    return out


def _export_paths(out: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """(weights file, JSON sidecar) for ``--out``; refuses another suffix and, without ``overwrite``, existing files."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise RunDirError(
            f"--out: {out} must end in .safetensors (the model config goes next to it as "
            f"{out.with_suffix('.json').name})"
        )
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
    raise RunDirError(
        f"--checkpoint: {checkpoint} is not a checkpoint directory; pass one of "
        f"{Path(run_dir) / 'checkpoints'}/step_* (or leave it out for the newest)"
    )


def export_run(
    run_dir: str | Path,
    out: str | Path,
    checkpoint: str | Path | None = None,
    dtype: str = "fp32",
    overwrite: bool = False,
) -> Path:
    """Write the weights of a run's checkpoint as one safetensors file (shared tensors stored once) and the model
    config next to it as ``<name>.json``. Both are written to hidden temporary files and renamed into place, so a
    failure leaves any previous export as it was."""
    from safetensors.torch import save_model

    from anytrain.checkpoint.run_model import load_run_model
    from anytrain.models import args_dict, resolve_args

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


FORMATS = ("hf", "safetensors")
"""``anytrain export --format``: hf = a transformers folder (:func:`export_hf`), safetensors = one file with
anytrain's own names and the model config beside it (:func:`export_run`)."""


def export(
    source: str | Path,
    out: str | Path,
    format: str = "hf",
    checkpoint: str | Path | None = None,
    dtype: str = "fp32",
    overwrite: bool = False,
    tokenizer: str | Path | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """``anytrain export SOURCE --format hf|safetensors``: ``source`` is a run directory or one of its
    checkpoints/step_* directories, ``checkpoint`` (with a run directory) picks a checkpoint of it; ``tokenizer`` and
    ``max_shard_size`` (default 5GB) belong to the hf folder. Returns the folder or file written."""
    if format not in FORMATS:
        raise RunDirError(f"--format: expected hf or safetensors, got {format!r}")
    run_dir, step_dir = _resolve_source(source)
    if checkpoint is not None:
        if step_dir is not None:
            raise RunDirError(
                f"--checkpoint: {source} is a checkpoint already; pass its run directory with --checkpoint"
            )
        step_dir = _checkpoint_path(run_dir, checkpoint)
    if format == "safetensors":
        for name, value in (("--tokenizer", tokenizer), ("--max-shard-size", max_shard_size)):
            if value is not None:
                raise RunDirError(f"{name}: only with --format hf (a safetensors export is one file with no tokenizer)")
        return export_run(run_dir, out, checkpoint=step_dir, dtype=dtype, overwrite=overwrite)
    shard_bytes = parse_size(max_shard_size) if max_shard_size is not None else DEFAULT_SHARD_BYTES
    return export_hf(step_dir or run_dir, out, dtype, overwrite, tokenizer, shard_bytes)
