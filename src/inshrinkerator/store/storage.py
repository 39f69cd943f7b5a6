"""Where a run's files live, and how one file becomes visible all at once.

Two atomicity strategies, one per kind of storage:

- :class:`LocalRunStorage` (a local directory): write to a temporary name, flush and
  fsync, rename into place, fsync the directory. A reader sees the whole file or none.
- :class:`FsspecRunStorage` (``memory://``, ``s3://`` and other fsspec URLs): object stores
  cannot rename. Small files (manifests) go up in one put, which is atomic. Data files
  are streamed under their final name, which is new for every write and named by no
  manifest until the write is complete: the step manifest, written last, is the commit
  marker (see :mod:`.commit`). A failed stream is aborted and removed.

Storage knows nothing of steps; it reads, writes, lists and removes named files in one
flat folder.
"""

from __future__ import annotations

import errno
import os
import posixpath
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar, Union

import fsspec

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, FormatError
from .remote_errors import TranslatingHandle, abort_upload, translated

__all__ = [
    "RunStorage",
    "LocalRunStorage",
    "FsspecRunStorage",
    "open_storage",
    "TEMPORARY_PREFIX",
    "is_temporary",
    "RunLocation",
]

T = TypeVar("T")
RunLocation = Union[str, "os.PathLike[str]"]

#: Names of unfinished local writes start with this; nothing else in a run does.
TEMPORARY_PREFIX = ".tmp-"


def is_temporary(name: str) -> bool:
    """True for the name of a write that never finished (safe to remove when no save runs)."""
    return name.startswith(TEMPORARY_PREFIX)


def _directory_in_the_way(where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} is a directory where a run file belongs; the run was damaged (move the "
        "directory away; `inshrink verify` lists the steps this breaks)"
    )


def _cannot_write_over_directory(where: str) -> IsADirectoryError:
    return IsADirectoryError(
        errno.EISDIR, f"{where} is a directory where a run file belongs; nothing was written "
        "there (move the directory away and save again)"
    )


class RunStorage(ABC):
    """A flat folder of named files. ``location`` is the path or URL, for messages."""

    location: str

    @abstractmethod
    def list_names(self) -> list[str]:
        """Names of the files in the folder (``[]`` when it does not exist)."""

    @abstractmethod
    def read_bytes(self, name: str, limit: int) -> bytes:
        """The whole file; :class:`FileNotFoundError` if absent, :class:`FormatError` if over
        ``limit``, :class:`CorruptCheckpointError` if a directory is in its place."""

    @abstractmethod
    def open_read(self, name: str) -> IO[bytes]:
        """A seekable binary handle; :class:`FileNotFoundError` if absent,
        :class:`CorruptCheckpointError` if a directory is in its place."""

    @abstractmethod
    def write_file(self, name: str, produce: Callable[[IO[bytes]], T]) -> T:
        """Write the new file ``name`` with ``produce(handle)``; return what it returned.

        On any error nothing is left under ``name``. Use a name that no reader looks
        for yet: on object stores the bytes may be visible under it while it is written.
        A directory in the way is an :class:`IsADirectoryError` naming it (left as it is).
        """

    @abstractmethod
    def write_bytes(self, name: str, data: bytes) -> None:
        """Create or replace ``name`` with ``data`` atomically: readers see old or new, whole."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete ``name``; a missing file is not an error, a directory is never removed
        (:class:`IsADirectoryError` where the backend has directories)."""

    @abstractmethod
    def prepare(self) -> None:
        """Create the folder if needed (before the first write)."""

    def describe(self, name: str) -> str:
        return f"{self.location.rstrip('/')}/{name}"


class LocalRunStorage(RunStorage):
    """A local directory; atomic writes by temporary name, fsync and rename."""

    def __init__(self, root: Path, location: str) -> None:
        self.root = root
        self.location = location

    def list_names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise FormatError(f"{self.location} is a file, not a run directory") from None

    def read_bytes(self, name: str, limit: int) -> bytes:
        try:
            with open(self.root / name, "rb") as handle:
                data = handle.read(limit + 1)
        except IsADirectoryError:
            raise _directory_in_the_way(self.describe(name)) from None
        if len(data) > limit:
            raise FormatError(f"{self.describe(name)}: larger than {limit} bytes, not a run file")
        return data

    def open_read(self, name: str) -> IO[bytes]:
        try:
            return open(self.root / name, "rb")
        except IsADirectoryError:
            raise _directory_in_the_way(self.describe(name)) from None

    def write_file(self, name: str, produce: Callable[[IO[bytes]], T]) -> T:
        fd, temporary = tempfile.mkstemp(prefix=f"{TEMPORARY_PREFIX}{name}.", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as handle:
                result = produce(handle)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.replace(temporary, self.root / name)
            except IsADirectoryError:
                raise _cannot_write_over_directory(self.describe(name)) from None
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._sync_directory()
        return result

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write_file(name, lambda handle: handle.write(data))

    def _sync_directory(self) -> None:
        # The rename is durable only once the directory entry is on disk.
        try:
            fd = os.open(self.root, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse fsync on directories; the rename is still atomic
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        try:
            (self.root / name).unlink(missing_ok=True)
        except IsADirectoryError:
            raise IsADirectoryError(
                errno.EISDIR, f"{self.describe(name)} is a directory, not a run file: left as it is"
            ) from None

    def prepare(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise FormatError(f"{self.location} is a file, not a run directory")
        self.root.mkdir(parents=True, exist_ok=True)


class FsspecRunStorage(RunStorage):
    """An fsspec folder (``memory://``, ``s3://``, ...); a file appears when its write completes.

    Every operation raises an ``OSError`` for a storage failure: a client library's own
    exceptions (botocore's ``EndpointConnectionError`` when the endpoint cannot be reached,
    ...) become a ``ConnectionError`` / ``OSError`` naming the file (see :mod:`.remote_errors`).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, location: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.location = location

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def list_names(self) -> list[str]:
        with translated(self.location):
            # Another process may have written since fsspec cached this listing.
            self.fs.invalidate_cache(self.root)
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
            except NotADirectoryError:
                raise FormatError(f"{self.location} is a file, not a run folder") from None
        paths = [str(entry).rstrip("/") for entry in entries]
        return [posixpath.basename(path) for path in paths if path != self.root]

    def read_bytes(self, name: str, limit: int) -> bytes:
        try:
            with translated(self.describe(name)):
                data = self.fs.cat_file(self._path(name), start=0, end=limit + 1)
        except IsADirectoryError:
            raise _directory_in_the_way(self.describe(name)) from None
        if len(data) > limit:
            raise FormatError(f"{self.describe(name)}: larger than {limit} bytes, not a run file")
        return data

    def open_read(self, name: str) -> IO[bytes]:
        where = self.describe(name)
        try:
            with translated(where):
                return TranslatingHandle(self.fs.open(self._path(name), "rb"), where)  # type: ignore[return-value]
        except IsADirectoryError:
            raise _directory_in_the_way(where) from None

    def write_file(self, name: str, produce: Callable[[IO[bytes]], T]) -> T:
        where = self.describe(name)
        with translated(where):
            handle = self.fs.open(self._path(name), "wb")
        try:
            with translated(where):
                result = produce(TranslatingHandle(handle, where))  # type: ignore[arg-type]
                handle.close()  # completes the upload; if that fails, it is aborted below too
        except BaseException:
            abort_upload(handle)
            try:
                self.remove(name)
            except Exception:  # noqa: BLE001 - an unreferenced leftover; the next writer removes it
                pass
            raise
        return result

    def write_bytes(self, name: str, data: bytes) -> None:
        with translated(self.describe(name)):
            self.fs.pipe_file(self._path(name), data)

    def remove(self, name: str) -> None:
        with translated(self.describe(name)):
            try:
                self.fs.rm_file(self._path(name))
            except FileNotFoundError:
                pass

    def prepare(self) -> None:
        with translated(self.location):
            # Object stores have no folders (s3fs only checks the bucket); others get one here.
            if self.fs.isfile(self.root):
                raise FormatError(f"{self.location} is a file, not a run folder")
            self.fs.makedirs(self.root, exist_ok=True)


def open_storage(location: RunLocation) -> RunStorage:
    """The storage for a local path or an fsspec URL.

    Raises:
        CheckpointNotFoundError: the URL names a protocol fsspec does not know.
    """
    text = os.fspath(location)
    if not isinstance(text, str) or not text:
        raise ValueError(f"a run location must be a non-empty path or URL, got {location!r}")
    if "://" not in text:
        return LocalRunStorage(Path(text), text)
    try:
        fs, root = fsspec.core.url_to_fs(text)
    except (ValueError, ImportError) as exc:
        raise CheckpointNotFoundError(f"{text}: cannot open this URL ({exc})") from None
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return LocalRunStorage(Path(root), text)
    return FsspecRunStorage(fs, root, text)
