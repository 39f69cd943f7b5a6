"""The one-shot API: one state in one ``.ink`` file, like ``torch.save`` / ``torch.load``."""

from __future__ import annotations

import errno
import os
import posixpath
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Optional, TypeVar, Union

import fsspec
import torch

from .container import ContainerReader
from .errors import CheckpointNotFoundError, FormatError
from .info import SaveInfo
from .policies import Policy, resolve_policy
from .serialize import ProgressCallback, read_state, reference_map, write_state
from .store.remote_errors import TranslatingHandle, abort_upload, translated

__all__ = ["save", "load", "open_container", "PathLike"]

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]
BaseLike = Union[None, PathLike, Any]


def _is_url(path: str) -> bool:
    return "://" in path


def open_container(path: PathLike) -> ContainerReader:
    """Open and validate a ``.ink`` file (local path or fsspec URL)."""
    source = os.fspath(path)
    try:
        if _is_url(source):
            with translated(source):
                handle: IO[bytes] = TranslatingHandle(fsspec.open(source, "rb").open(), source)  # type: ignore[assignment]
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


def _write_local(target: Path, produce: Callable[[IO[bytes]], T]) -> T:
    if target.is_dir():  # checked first: encoding a large state only to fail at the rename
        raise _is_a_directory(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            result = produce(handle)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.replace(temporary, target)
        except IsADirectoryError:  # a directory appeared there meanwhile
            raise _is_a_directory(target) from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return result


def _is_a_directory(target: Path) -> IsADirectoryError:
    return IsADirectoryError(
        errno.EISDIR, f"{target} is a directory: ink.save writes one file, so give a file path "
        "(ink.CheckpointManager writes a run into a directory); nothing was written"
    )


def _write_whole(destination: str, produce: Callable[[IO[bytes]], T]) -> T:
    """Write ``destination`` (local path or fsspec URL) under a temporary name beside it, then
    move it into place: until the write is complete, ``destination`` keeps what it held.

    (``fsspec.open(url, "wb")`` would not: some filesystems truncate or replace the file when
    it is opened, and closing it after an error commits the partial bytes.)
    """
    if not _is_url(destination):
        return _write_local(Path(destination), produce)
    fs, path = fsspec.core.url_to_fs(destination)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return _write_local(Path(path), produce)
    parent, name = posixpath.split(path)
    temporary = posixpath.join(parent, f".{name}.{secrets.token_hex(4)}.tmp")
    with translated(destination):
        handle = fs.open(temporary, "wb")
    try:
        with translated(destination):
            result = produce(TranslatingHandle(handle, destination))  # type: ignore[arg-type]
            handle.close()  # completes the upload
            fs.cp_file(temporary, path)  # one atomic replace (a server-side copy on object stores)
    except BaseException:
        abort_upload(handle)
        _remove_quietly(fs, temporary)
        raise
    _remove_quietly(fs, temporary)  # the file is in place: a temporary left behind is only clutter
    return result


def _remove_quietly(fs: Any, path: str) -> None:
    try:
        fs.rm_file(path)
    except Exception:  # noqa: BLE001 - nothing there, or the store is unreachable: not an error
        pass


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
        policy: a policy name, spec (``"cnr:bits=4"``) or object (default: lossless).
        base: a reference state (or a path to an ``.ink`` file holding one): tensors with the
            same key path, dtype and shape are stored as deltas against it. Loading then
            needs the same base.
        progress: optional callback ``(bytes_done, bytes_total)`` after each tensor.

    The file is written under a temporary name beside ``path`` and moved into place (local
    files: renamed after an fsync), so a failed or interrupted save never leaves a damaged
    file at ``path`` nor changes what was there.

    Raises:
        UnsupportedStateError: the state holds a value that cannot be stored.
        IsADirectoryError: ``path`` is a directory.
        OSError: the write failed (``ConnectionError`` when the storage behind a URL cannot
            be reached).
    """
    started = time.perf_counter()
    chosen = resolve_policy(policy)
    references = _base_references(base)
    destination = os.fspath(path)
    try:
        written = _write_whole(
            destination, lambda handle: write_state(handle, state, chosen, references, progress=progress)
        )
    except Exception as exc:
        exc.add_note(f"saving {destination} failed: what it held before (if anything) is unchanged")
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

    A checkpoint written by the Lightning or Hugging Face integration (a delta against a
    keyframe in ``.ink-keyframes`` beside it) finds its keyframe by itself when no ``base``
    is given.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        FormatError / CorruptCheckpointError: not a valid or an intact ``.ink`` file.
        BrokenChainError: the file needs a base that was not given or does not match.
        OSError: reading failed (``ConnectionError`` when the storage behind a URL cannot be
            reached).
    """
    with open_container(path) as reader:
        if base is None:  # a file that names a keyframe finds it; any other reads as it is
            from .integrations._keyframes import read_with_keyframe

            return read_with_keyframe(reader, path, progress=progress)
        return read_state(reader, _base_references(base), progress=progress)
