"""remote_errors: storage client failures become OSErrors naming the file; ours pass through."""

from __future__ import annotations

import io

import pytest

from inshrinkerator.errors import CorruptCheckpointError, FormatError
from inshrinkerator.store.remote_errors import TranslatingHandle, as_storage_error, translated

botocore_exceptions = pytest.importorskip("botocore.exceptions")
WHERE = "s3://bucket/run/step-0000000001.json"


@pytest.mark.parametrize(
    "error, expected",
    [
        (botocore_exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9/b"), ConnectionError),
        (botocore_exceptions.ConnectTimeoutError(endpoint_url="http://127.0.0.1:9/b"), ConnectionError),
        (botocore_exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:9/b"), ConnectionError),
        (botocore_exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:9/b"), ConnectionError),
        (botocore_exceptions.NoCredentialsError(), PermissionError),
        (botocore_exceptions.NoRegionError(), OSError),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else value.__name__,
)
def test_client_failures_become_os_errors_naming_the_file(error: Exception, expected: type) -> None:
    with pytest.raises(OSError) as caught:
        with translated(WHERE):
            raise error
    assert type(caught.value) is expected
    assert caught.value.__cause__ is error
    message = str(caught.value)
    assert message.startswith(WHERE) and type(error).__name__ in message and "check" in message


def test_aiohttp_failures_too() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    assert type(as_storage_error(aiohttp.ServerDisconnectedError(), WHERE)) is ConnectionError
    assert type(as_storage_error(aiohttp.ClientPayloadError("cut"), WHERE)) is OSError


@pytest.mark.parametrize(
    "error",
    [
        CorruptCheckpointError("damaged"),
        FormatError("not a file"),
        FileNotFoundError("absent"),
        OSError(28, "No space left on device"),
        ValueError("other"),
        KeyboardInterrupt(),
    ],
    ids=lambda value: type(value).__name__,
)
def test_our_errors_and_os_errors_pass_through_untouched(error: BaseException) -> None:
    assert as_storage_error(error, WHERE) is None
    with pytest.raises(type(error)) as caught:
        with translated(WHERE):
            raise error
    assert caught.value is error


def test_the_handle_proxy_translates_io_and_passes_everything_else_on() -> None:
    class Flaky(io.BytesIO):
        size = 11

        def read(self, size: int = -1) -> bytes:
            raise botocore_exceptions.EndpointConnectionError(endpoint_url="http://x/b")

    handle = TranslatingHandle(Flaky(b"hello world"), WHERE)
    assert handle.seek(6) == 6 and handle.tell() == 6 and handle.size == 11
    with pytest.raises(ConnectionError, match="cannot reach the storage"):
        handle.read(5)
    with TranslatingHandle(io.BytesIO(), WHERE) as out:
        assert out.write(b"abc") == 3 and out.raw.getvalue() == b"abc"
    assert out.raw.closed
