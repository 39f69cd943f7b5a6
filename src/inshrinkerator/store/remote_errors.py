"""Storage client failures as OSErrors that name the file and say what to check.

fsspec backends raise their client library's own exceptions for some failures: s3fs turns
most S3 errors into ``OSError`` but lets botocore's ``EndpointConnectionError`` (the
endpoint cannot be reached) and its other ``BotoCoreError`` subclasses through;
aiohttp-based backends raise ``aiohttp.ClientError`` subclasses. Most of them are not
OSErrors, so ordinary ``except OSError`` clauses (and the run's own cleanup) miss them. Every storage operation on
an fsspec URL runs under :func:`translated`, which raises instead:

- ``ConnectionError`` (an ``OSError``) when the endpoint cannot be reached or the
  connection broke (connect/read timeouts, closed connections, proxy and TLS failures;
  also botocore's timeouts, which already are OSErrors but name neither the file nor
  what to check);
- ``PermissionError`` when no usable credentials were found;
- ``OSError`` for any other failure of the client library.

Each names the file or folder and says what to check, and is chained (``__cause__``) to the
client's exception. The library's own errors (``FormatError``, ``CorruptCheckpointError``
and the rest) and every other ``OSError`` (a full disk, ``FileNotFoundError``, what s3fs
already translated) pass through untouched. Client libraries are looked up only
once they are imported: none of this imports botocore or aiohttp.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, Optional

__all__ = ["translated", "as_storage_error", "TranslatingHandle", "abort_upload"]

_CHECK_ENDPOINT = (
    "check the endpoint URL (e.g. AWS_ENDPOINT_URL or the storage options' endpoint_url), the "
    "network, and that the storage server is up"
)


def _classes(module: str, names: tuple[str, ...]) -> tuple[type, ...]:
    loaded = sys.modules.get(module)
    found = (getattr(loaded, name, None) for name in names) if loaded is not None else ()
    return tuple(cls for cls in found if isinstance(cls, type))


def as_storage_error(exc: BaseException, where: str) -> Optional[OSError]:
    """The ``OSError`` to raise for a storage client's ``exc`` at ``where``, or ``None`` when
    ``exc`` is not a client-library failure (it is then raised as it is)."""
    if not isinstance(exc, Exception):
        return None
    detail = f"{type(exc).__name__}: {str(exc)[:300]}"
    connection = _classes("botocore.exceptions", ("ConnectionError", "HTTPClientError")) + _classes(
        "aiohttp", ("ClientConnectionError", "ServerTimeoutError")
    )
    if connection and isinstance(exc, connection):
        # (botocore's timeouts already are OSErrors, but name neither the file nor the fix)
        return ConnectionError(f"{where}: cannot reach the storage ({detail}); {_CHECK_ENDPOINT}")
    if isinstance(exc, OSError):
        return None  # ENOSPC, EIO, FileNotFoundError, s3fs's own translations: as they are
    credentials = _classes("botocore.exceptions", ("NoCredentialsError", "PartialCredentialsError"))
    if credentials and isinstance(exc, credentials):
        return PermissionError(
            f"{where}: no usable storage credentials ({detail}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, the profile, or the storage options' key and secret"
        )
    client = _classes("botocore.exceptions", ("BotoCoreError",)) + _classes("aiohttp", ("ClientError",))
    if client and isinstance(exc, client):
        return OSError(f"{where}: the storage request failed ({detail}); check the storage settings")
    return None


@contextmanager
def translated(where: str) -> Iterator[None]:
    """Run a storage operation; a client-library failure leaves it as an ``OSError`` (see the
    module doc) naming ``where``."""
    try:
        yield
    except Exception as exc:
        storage_error = as_storage_error(exc, where)
        if storage_error is None:
            raise
        raise storage_error from exc


class TranslatingHandle:
    """A file object of an fsspec backend whose I/O calls go through :func:`translated`.

    ``raw`` is the backend's own handle (for what the proxy does not wrap: ``discard``,
    ``closed``). Other attributes are the backend handle's.
    """

    def __init__(self, raw: IO[bytes], where: str) -> None:
        self.raw = raw
        self.where = where

    def read(self, size: int = -1) -> bytes:
        with translated(self.where):
            return self.raw.read(size)

    def readinto(self, buffer: Any) -> int:
        with translated(self.where):
            return self.raw.readinto(buffer)  # type: ignore[attr-defined]

    def write(self, data: Any) -> int:
        with translated(self.where):
            return self.raw.write(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        with translated(self.where):
            return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        with translated(self.where):
            self.raw.flush()

    def close(self) -> None:
        with translated(self.where):
            self.raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def __enter__(self) -> "TranslatingHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def abort_upload(handle: Any) -> None:
    """Abandon an fsspec write handle whose content is incomplete, so nothing is uploaded.

    Closing would complete the upload with partial content: discard it instead, and mark it
    closed so that no later close (the finalizer's included) uploads it. A store that cannot
    be reached while aborting is ignored: the write's own error is the one that counts.
    """
    discard = getattr(handle, "discard", None)
    if callable(discard):
        try:
            discard()
        except Exception:  # noqa: BLE001 - the write's error counts, not the abort's
            pass
    try:
        handle.closed = True
    except AttributeError:
        pass
