"""A DCP checkpoint's model tensors, read one at a time on the CPU without a process group (``anytrain export``).

``CheckpointTensors`` is a read-only mapping {parameter name: tensor} over one checkpoint directory: each lookup is
one ``dcp.load`` of a one-key state dict into a fresh CPU tensor. DCP's ``FileSystemReader`` reads only the byte
ranges of that tensor's chunks, from every rank's ``.distcp`` file that holds one (an FSDP- or TP-sharded tensor is
put together here), so the memory held is the tensors the caller keeps, not the checkpoint.

``usable_checkpoint`` picks the checkpoint to read as ``anytrain eval`` does (the given one, or the newest committed
one that is intact and fits the model, a skipped newer one named in a warning), from the files' sizes / checksums and
the metadata alone: no tensor is read to decide.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from anytrain.checkpoint import safe_load
from anytrain.checkpoint.dcp import COMMIT_MARKER, Checkpointer, is_committed, verify
from anytrain.errors import RunDirError, one_line

MODEL_KEY = "train.model."
"""Prefix of the model's entries in a training checkpoint (``Checkpointer.save`` of ``{"train": TrainState}``)."""


class _Reader(safe_load.SafeReader):
    """A SafeReader that reads the checkpoint's ``.metadata`` once (every ``dcp.load`` asks for it)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{state dict name: (shape, dtype)} of ``model`` (a model on the meta device is enough)."""
    return {name: (tensor.shape, tensor.dtype) for name, tensor in model.state_dict().items()}


def misfit(metadata: Metadata, expected: dict[str, tuple[torch.Size, torch.dtype]]) -> str | None:
    """Why a checkpoint with ``metadata`` cannot fill a model with tensors ``expected``, or None."""
    saved = metadata.state_dict_metadata
    for name, (shape, _) in expected.items():
        entry = saved.get(MODEL_KEY + name)
        if not isinstance(entry, TensorStorageMetadata):
            return f"it holds no tensor {name} (a checkpoint of another model?)"
        if tuple(entry.size) != tuple(shape):
            return f"{name} has shape {tuple(entry.size)}, the run's model expects {tuple(shape)}"
    return None


class CheckpointTensors(Mapping):
    """{name: tensor} of the model tensors ``expected`` in checkpoint ``path``; each lookup reads that tensor from the
    files (in the model's dtype, then cast to ``dtype`` when one is given) and keeps nothing."""

    def __init__(
        self, path: str | Path, expected: dict[str, tuple[torch.Size, torch.dtype]], dtype: torch.dtype | None = None
    ) -> None:
        self.path, self.expected, self.dtype = Path(path), expected, dtype
        self._reader = _Reader(self.path)

    def __iter__(self) -> Iterator[str]:
        return iter(self.expected)

    def __len__(self) -> int:
        return len(self.expected)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, model_dtype = self.expected[name]
        tensor = torch.empty(shape, dtype=model_dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            try:
                safe_load.load({MODEL_KEY + name: tensor}, self.path, reader=self._reader, no_dist=True)
            except safe_load.UnsafeCheckpointError:
                raise
            except (Exception, CheckpointException) as exc:
                raise RunDirError(f"{self.path}: cannot be loaded ({one_line(exc)})") from exc
        return tensor if self.dtype is None else tensor.to(self.dtype)


def usable_checkpoint(
    run_dir: Path, checkpoint: Path | None, expected: dict[str, tuple[torch.Size, torch.dtype]], log: Any = None
) -> Path:
    """``checkpoint`` when it is committed, intact and fits ``expected``; without one, the newest committed checkpoint
    of ``run_dir`` that is (each newer one skipped gets a warning line on stderr). One-line RunDirError otherwise."""
    log = log or (lambda line: print(line, file=sys.stderr))
    if checkpoint is not None:
        if not is_committed(checkpoint):
            raise RunDirError(
                f"{checkpoint}: not a committed checkpoint (no {COMMIT_MARKER} in it); pass a step_N "
                "directory of the run's checkpoints/"
            )
        reason = _unusable(checkpoint, expected)
        if reason:
            raise RunDirError(f"{checkpoint}: cannot be loaded ({reason})")
        return checkpoint
    checkpointer = Checkpointer(run_dir / "checkpoints", 1, True, log=log)
    checkpointer.latest()  # names torn (uncommitted) newer ones
    failed: list[tuple[Path, str]] = []
    for path in reversed(checkpointer.committed()):
        reason = _unusable(path, expected)
        if reason is None:
            for bad, why in failed:
                log(f"warning: cannot load {bad} ({why}); using the previous committed checkpoint {path}")
            return path
        failed.append((path, reason))
    if failed:
        listed = "; ".join(f"{p.name}: {why}" for p, why in failed)
        raise RunDirError(f"{run_dir / 'checkpoints'}: no committed checkpoint can be loaded ({listed})")
    raise RunDirError(f"{run_dir}/checkpoints: no committed checkpoint to export")


def _unusable(path: Path, expected: dict[str, tuple[torch.Size, torch.dtype]]) -> str | None:
    reason = verify(path)
    if reason:
        return reason
    try:
        metadata = _Reader(path).read_metadata()
    except safe_load.UnsafeCheckpointError:
        raise  # a planted object is refused, not skipped for an older checkpoint
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata makes the checkpoint unusable, in one line
        return f"its .metadata cannot be read ({type(exc).__name__})"
    return misfit(metadata, expected)
