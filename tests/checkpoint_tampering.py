"""A DCP checkpoint altered as an attacker would: its ``.metadata`` rewritten, a pickle planted in a ``.distcp`` file.
Used by tests/unit/test_safe_load.py and tests/integration/test_checkpoint_safety.py."""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def edit_metadata(checkpoint: Path, edit: Callable[[Any], None]) -> Path:
    """``checkpoint/.metadata`` unpickled, changed in place by ``edit`` and written back; its path."""
    file = Path(checkpoint) / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    edit(metadata)
    file.write_bytes(pickle.dumps(metadata))
    return file


def plant_value(checkpoint: Path, key: str, payload: Any) -> Path:
    """``payload``, torch.save'd, appended to the ``.distcp`` file that holds the value ``key`` (its fqn), and ``key``
    pointed at it in ``.metadata``; the ``.distcp`` file's path."""
    checkpoint, shard = Path(checkpoint), None

    def point_at_payload(metadata: Any) -> None:
        nonlocal shard
        index = next(i for i in metadata.storage_data if i.fqn == key)
        info = metadata.storage_data[index]
        shard = checkpoint / info.relative_path
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(buffer.getvalue())
        metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))

    edit_metadata(checkpoint, point_at_payload)
    return shard


def point_outside(checkpoint: Path, relative_path: str) -> Path:
    """Every storage entry of ``.metadata`` pointed at ``relative_path`` (a file outside the folder); its path."""

    def repoint(metadata: Any) -> None:
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=relative_path)

    return edit_metadata(checkpoint, repoint)
