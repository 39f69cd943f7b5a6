"""The one-shot API: one state in one ``.ink`` file, like ``torch.save`` / ``torch.load``."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Optional, Union

import fsspec
import torch

from .container import ContainerReader
from .errors import CheckpointNotFoundError, FormatError
from .info import SaveInfo
from .policies import Policy, resolve_policy
from .serialize import ProgressCallback, read_state, reference_map, write_state

__all__ = ["save", "load", "open_container", "PathLike"]

PathLike = Union[str, "os.PathLike[str]"]
BaseLike = Union[None, PathLike, Any]


def _is_url(path: str) -> bool:
    return "://" in path


def open_container(path: PathLike) -> ContainerReader:
    """Open and validate a ``.ink`` file (local path or fsspec URL)."""
    source = os.fspath(path)
    try:
        if _is_url(source):
            handle: IO[bytes] = fsspec.open(source, "rb").open()
        else:
            handle = open(source, "rb")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{source}: no such checkpoint file") from None
    except IsADirectoryError:
        raise FormatError(
            f"{source}: is a directory, not an .ink file; open a run with ink.CheckpointManager"
        ) from None
    try:
        return ContainerReader(handle, source)
    except BaseException:
        handle.close()
        raise


def _base_references(base: BaseLike) -> Optional[dict[str, torch.Tensor]]:
    if base is None:
        return None
    if isinstance(base, (str, os.PathLike)):
        base = load(base)
    return reference_map(base)


def save(
    state: Any,
    path: PathLike,
    policy: Union[str, Policy] = "lossless",
    base: BaseLike = None,
    *,
    progress: Optional[ProgressCallback] = None,
) -> SaveInfo:
    """Compress ``state`` into one file at ``path`` (local path or fsspec URL).

    Args:
        state: nested dict/list/tuple of tensors and plain values.
        policy: a policy name or object (default: lossless).
        base: a reference state (or a path to an ``.ink`` file holding one): tensors with the
            same key path, dtype and shape are stored as deltas against it. Loading then
            needs the same base.
        progress: optional callback ``(bytes_done, bytes_total)`` after each tensor.

    A local file is written under a temporary name and renamed into place, so an
    interrupted save never leaves a damaged file at ``path``.

    Raises:
        UnsupportedStateError: the state holds a value that cannot be stored.
    """
    started = time.perf_counter()
    chosen = resolve_policy(policy)
    references = _base_references(base)
    destination = os.fspath(path)
    if _is_url(destination):
        with fsspec.open(destination, "wb") as handle:
            written = write_state(handle, state, chosen, references, progress=progress)
    else:
        target = Path(destination)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                written = write_state(handle, state, chosen, references, progress=progress)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    return SaveInfo(
        step=None,
        kind="delta" if written.used_reference else "full",
        raw_bytes=written.raw_bytes,
        stored_bytes=written.stored_bytes,
        ratio=written.raw_bytes / max(written.stored_bytes, 1),
        seconds=time.perf_counter() - started,
        policy=chosen.name,
    )


def load(
    path: PathLike, base: BaseLike = None, *, progress: Optional[ProgressCallback] = None
) -> Any:
    """Load the state saved at ``path``; ``base`` must be the one it was saved against, if any.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        FormatError / CorruptCheckpointError: not a valid or an intact ``.ink`` file.
        BrokenChainError: the file needs a base that was not given or does not match.
    """
    with open_container(path) as reader:
        return read_state(reader, _base_references(base), progress=progress)
