"""Loading a DCP checkpoint without running code from it.

DCP writes ``.metadata`` with ``pickle.dump`` and its ``FileSystemReader`` reads it back with ``pickle.load``; its
``DefaultLoadPlanner`` reads each non-tensor value of the ``.distcp`` files (LR-schedule state, progress counters,
param-group settings) with ``torch.load(weights_only=False)``. A pickle runs whatever callable it names, so either
would let a crafted checkpoint run code on the machine that loads it. Here:

- ``SafeReader`` (a ``FileSystemReader``) reads ``.metadata`` through ``MetadataUnpickler``, which resolves only the
  globals a DCP checkpoint's metadata holds (``ALLOWED``: DCP's metadata dataclasses and ``_StorageInfo``,
  ``torch.Size``, torch dtypes / layouts / memory formats, ``pathlib`` paths, plain containers) and refuses any other
  before anything is called, then refuses a storage entry whose file lies outside the checkpoint folder (an absolute
  ``relative_path``, or one through ``..``);
- ``SafeLoadPlanner`` (a ``DefaultLoadPlanner``) reads the non-tensor values with ``torch.load(weights_only=True)``
  (DCP's reader already reads tensors that way);
- ``load`` is ``dcp.load`` through both, and re-raises the refusal itself (DCP wraps a rank's exception in a
  ``CheckpointException``).

A refusal is ``UnsafeCheckpointError``: one line naming the file and the global (or the outside path). ``ALLOWED``
is the set that real checkpoints of every layout (Transformer, Mamba, FSDP-sharded, ZeRO-1, PowerSGD state, with
optimizer state) reference, plus the names other torch / Python versions give the same objects
(tests/unit/test_safe_load.py).
"""

from __future__ import annotations

import importlib
import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from anytrain.errors import RunDirError

METADATA_FILE = ".metadata"

# the dataclasses and enum of a checkpoint's Metadata (state-dict entries, chunks, tensor properties)
_METADATA_CLASSES = "Metadata MetadataIndex StorageMeta TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata"
_METADATA_CLASSES += " TensorProperties _MEM_FORMAT_ENCODING"
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES.split()),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each item lies: file, offset, length
        ("torch", "Size"),  # tensor and chunk shapes / offsets
        ("torch.serialization", "_get_layout"),  # a layout by name (torch.strided): a table lookup
        # StorageMeta.checkpoint_id; Python 3.13 moved the classes to pathlib._local (resolved from pathlib here)
        *(("pathlib", name) for name in _PATHS),
        *(("pathlib._local", name) for name in _PATHS),
        # containers pickled by reference to their class (OrderedDict; sets under protocols before 4)
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)
"""(module, name) of every global a DCP checkpoint's ``.metadata`` may name, besides torch's dtypes, layouts and
memory formats (``torch.float32``, ``torch.strided``: values, nothing callable)."""

_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(RunDirError):
    """A checkpoint file whose pickle names an object no checkpoint holds (loading it could run code)."""


def _refusal(file: str | os.PathLike, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{file}: refusing to load: it names {what}, which no checkpoint holds (unpickling it could run code); the "
        "checkpoint was altered or was not written by anytrain: delete it, or restore it from a copy you trust"
    )


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``ALLOWED`` globals and torch's dtypes / layouts / memory formats."""

    def __init__(self, file: IO[bytes], name: str | os.PathLike) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            if module.startswith("pathlib"):
                return getattr(pathlib, name)
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise _refusal(self.name, f"{module}.{name}")


def load_metadata(file: IO[bytes], name: str | os.PathLike) -> Metadata:
    """The DCP ``Metadata`` pickled in ``file`` (called ``name`` in errors), read with ``MetadataUnpickler``."""
    metadata = MetadataUnpickler(file, name).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{name} holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


def check_storage_paths(metadata: Metadata, file: Path) -> None:
    """Refuse a storage entry whose ``relative_path`` is absolute or leads out of the folder of ``file`` (the
    ``.metadata``): DCP reads each item from ``folder / relative_path``, so such a path would read any file of the
    machine into the loaded state."""
    folder, inside = Path(file).parent.resolve(), set()  # the names checked (a few files for many entries)
    for index, info in (metadata.storage_data if isinstance(metadata.storage_data, dict) else {}).items():
        relative = getattr(info, "relative_path", None)
        if isinstance(relative, str) and relative and not os.path.isabs(relative):
            if relative in inside or (folder / relative).resolve().is_relative_to(folder):
                inside.add(relative)
                continue
        raise UnsafeCheckpointError(
            f"{file}: refusing to load: the storage entry of {getattr(index, 'fqn', index)} names the file "
            f"{relative!r}, outside the checkpoint folder; the checkpoint was altered or was not written by anytrain: "
            "delete it, or restore it from a copy you trust"
        )


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` unpickles ``.metadata`` with ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, path)
        check_storage_paths(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``; ``path`` (the
    checkpoint directory) names the file in a refusal."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = Path(path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL (\S+)", str(exc))
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            file = self.path / info.relative_path if info is not None else self.path
            what = found.group(1) if found else "an object torch.load(weights_only=True) refuses"
            raise _refusal(file, f"{what} (in {read_item.dest_index.fqn})") from None
        # as DefaultLoadPlanner.load_bytes puts the value in place
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def unsafe_cause(exc: BaseException) -> UnsafeCheckpointError | None:
    """The UnsafeCheckpointError behind ``exc`` (itself, or the one a rank raised inside ``dcp.load``), or None."""
    if isinstance(exc, UnsafeCheckpointError):
        return exc
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, UnsafeCheckpointError):
            return inner
    return None


def load(state_dict: dict, path: str | os.PathLike, reader: SafeReader | None = None, **kwargs: Any) -> None:
    """``dcp.load`` of checkpoint directory ``path`` into ``state_dict`` through ``SafeReader`` (or ``reader``) and
    ``SafeLoadPlanner``; a refusal on any rank is raised as the UnsafeCheckpointError itself."""
    reader = reader or SafeReader(str(path))
    try:
        reader.read_metadata()  # first: dcp.load folds a failed metadata read into an AssertionError's text
    except UnsafeCheckpointError:
        raise
    except Exception:  # noqa: BLE001, S110 - dcp.load reads it again and reports the failure its way
        pass
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(path), **kwargs)
    except (Exception, CheckpointException) as exc:
        unsafe = unsafe_cause(exc)
        if unsafe is not None:
            raise unsafe from None
        raise
