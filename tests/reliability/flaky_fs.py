"""An in-memory fsspec filesystem whose operations fail on demand (``flaky://``).

Every operation the store can issue counts as one: listing, reading, opening, each
``write`` call on an open file, putting a whole object, removing, creating folders.
:meth:`FlakyFileSystem.arm` makes the ``fail_at``-th operation from then on raise
``OSError(EIO)`` (and, for an *outage*, every operation after it too), so a test can
sweep a failure across every operation of a save.
"""

from __future__ import annotations

import errno
from typing import Any, Optional

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

__all__ = ["FlakyFileSystem", "flaky_filesystem"]


class _FlakyFile(MemoryFile):
    def write(self, data: Any) -> int:
        assert isinstance(self.fs, FlakyFileSystem)
        self.fs.tick("write", self.path)
        return super().write(data)


class FlakyFileSystem(MemoryFileSystem):
    protocol = "flaky"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, global_store=False, **kwargs)
        self.operations = 0
        self.fail_at: Optional[int] = None
        self.outage = False
        self.failures: list[str] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return super()._strip_protocol(str(path).removeprefix("flaky://"))

    def names(self, folder: str) -> list[str]:
        """The names of the files directly in ``folder`` (e.g. ``"/runs/exp"``)."""
        prefix = folder.rstrip("/") + "/"
        return sorted(path[len(prefix):] for path in self.store if path.startswith(prefix) and "/" not in path[len(prefix):])

    # -- fault control
    def arm(self, fail_at: int, outage: bool = False) -> None:
        self.operations, self.fail_at, self.outage, self.failures = 0, fail_at, outage, []

    def disarm(self) -> int:
        """Stop failing; returns the number of operations since :meth:`arm`."""
        count, self.fail_at = self.operations, None
        return count

    def tick(self, operation: str, path: str) -> None:
        if self.fail_at is None:
            return
        self.operations += 1
        if self.operations == self.fail_at or (self.outage and self.operations > self.fail_at):
            self.failures.append(f"{operation} {path}")
            raise OSError(errno.EIO, f"injected I/O error on {operation} #{self.operations}", path)

    def reset(self) -> None:
        self.store.clear()
        self.pseudo_dirs[:] = [""]
        self.disarm()

    # -- the operations
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.tick("ls", path)
        return super().ls(path, detail=detail, **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        self.tick("read", path)
        return super().cat_file(path, start=start, end=end, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self.tick(f"open {mode}", path)
        if mode == "wb":
            file = _FlakyFile(self, self._strip_protocol(path), kwargs.get("data"))
            file.commit()  # visible at once, like the memory filesystem (an object store is stricter)
            return file
        return super()._open(path, mode=mode, **kwargs)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.tick("put", path)
        super().pipe_file(path, value, mode=mode, **kwargs)

    def rm_file(self, path: str) -> None:
        self.tick("rm", path)
        super().rm_file(path)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.tick("copy", path1)
        super().cp_file(path1, path2, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.tick("mkdir", path)
        super().makedirs(path, exist_ok=exist_ok)

    def isfile(self, path: str) -> bool:
        self.tick("stat", path)
        return super().isfile(path)


def flaky_filesystem() -> FlakyFileSystem:
    """The (cached, shared) instance behind ``flaky://`` URLs, emptied and disarmed."""
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    fs = fsspec.filesystem("flaky")
    assert isinstance(fs, FlakyFileSystem)
    fs.reset()
    return fs
