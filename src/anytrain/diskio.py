"""Writing outputs safely: a full disk becomes one error line, and files appear only once complete.

``disk_full_as_error`` turns the ways a full filesystem surfaces (``OSError`` ENOSPC/EDQUOT, torch's
``PytorchStreamWriter`` / ``inline_container.cc`` RuntimeError, safetensors' "os error 28") into
:class:`DiskFullError` naming what was being written. ``temp_sibling`` names a hidden file or folder next to the
target, to be renamed onto it when complete (a rename within one folder is atomic): ``write_text_atomic`` for a
file, ``move_into_place`` for a finished output folder.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from anytrain.errors import AnytrainError

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXTS = ("no space left", "os error 28", "inline_container", "file write failed", "disk quota exceeded")


class DiskFullError(AnytrainError):
    """The filesystem ran out of space (or quota) while an output was being written."""


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return True
    # torch.distributed.checkpoint collects each rank's exception in CheckpointException.failures
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        wrapped = (f[0] if isinstance(f, tuple) else f for f in failures.values())
        if any(isinstance(e, BaseException) and _is_disk_full(e) for e in wrapped):
            return True
    text = str(exc).lower()  # torch and safetensors wrap the OSError in their own exception types
    return any(t in text for t in _FULL_TEXTS)


@contextmanager
def disk_full_as_error(what: str | Path) -> Iterator[None]:
    """Re-raise a disk-full failure inside the block as ``DiskFullError("disk full while writing <what>...")``."""
    try:
        yield
    except AnytrainError:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException; anything else is re-raised as is
        if _is_disk_full(exc) or _is_disk_full(exc.__cause__ or exc):
            raise DiskFullError(
                f"disk full while writing {what}; free space on that filesystem or write "
                "elsewhere (nothing was replaced)"
            ) from None
        raise


def temp_sibling(path: Path, tag: str = "tmp") -> Path:
    """A hidden name next to ``path`` for its in-progress version: ``.<name>.<tag>-<pid>``."""
    return path.parent / f".{path.name}.{tag}-{os.getpid()}"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that readers see either the old file or the whole new one (a hidden sibling, renamed)."""
    tmp = temp_sibling(path)
    tmp.write_text(text)
    tmp.replace(path)


def move_into_place(temp: Path, out: Path) -> None:
    """Rename the finished folder ``temp`` onto ``out``. An existing ``out`` (an earlier output, or an empty folder)
    is moved aside first and deleted only once the new one is in place; if the rename fails, it is put back."""
    old = temp_sibling(out, "old")
    if out.exists():
        out.replace(old)
    try:
        temp.replace(out)
    except BaseException:
        if old.exists():
            old.replace(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove(path: Path) -> None:
    """Delete a file or folder this process created, ignoring one that is already gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def missing_parents(path: Path) -> Path | None:
    """The outermost ancestor of ``path`` that does not exist yet (to remove it again on failure), or None."""
    top = None
    for parent in path.absolute().parents:
        if parent.exists():
            break
        top = parent
    return top
