"""The S3 server stops in the middle of a save: nothing committed is lost, the error is clear.

A moto S3 server on 127.0.0.1 is stopped at three moments of a save that continues a run
with retention — in the middle of a multipart upload of the data file, just before the
manifest (the commit), and just after it (in retention) — then started again on the same
port (its buckets survive in this process). Every committed step must then restore, the
run verify, and the run go on. s3fs and botocore retries are turned down so that each
outage fails in milliseconds instead of the ~8 s of default retries.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed")
botocore_exceptions = pytest.importorskip("botocore.exceptions")

import inshrinkerator as ink  # noqa: E402
from inshrinkerator.errors import AsyncSaveError  # noqa: E402
from inshrinkerator.store import CheckpointManager, describe_run, verify_run  # noqa: E402
from inshrinkerator.store import manager as manager_module  # noqa: E402
from inshrinkerator.store.manifest import RUN_MARKER, manifest_name  # noqa: E402
from inshrinkerator.store.storage import open_storage  # noqa: E402

from ..helpers import assert_same, point_aws_at_loopback  # noqa: E402
from .run_damage import step_state  # noqa: E402

BUCKET = "ink-outage"
OPTIONS = {"policy": "lossless", "full_every": 3, "keep_last": 2}
#: What a client sees while the server is down: s3fs turns most failures into OSError, and
#: the store turns botocore's EndpointConnectionError (a refused connection) into one too.
OUTAGE_ERRORS = (OSError,)
_runs = itertools.count()


class S3Server:
    """A moto S3 server reached through a loopback TCP relay that can be stopped and started.

    Stopping the relay closes its port and drops every open connection at once, as a dead
    server or network would (stopping moto's own threaded server would let connections
    that are kept alive go on being served). The moto server behind it keeps its buckets. Only loopback addresses are used.
    """

    def __init__(self) -> None:
        self._moto_port = _free_port()
        self._moto = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self._moto_port, verbose=False)
        self._moto.start()
        self.port = _free_port()
        self._listener: Optional[socket.socket] = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._listener is not None

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        for sock in [listener, *self._drain()]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.stop()
        self._moto.stop()

    def _drain(self) -> list[socket.socket]:
        with self._lock:
            sockets, self._open = self._open, []
        return sockets

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            upstream = socket.create_connection(("127.0.0.1", self._moto_port))
            with self._lock:
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    for sock in (source, sink):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = S3Server()
    server.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            point_aws_at_loopback(patch, server.port)
            patch.setenv("AWS_MAX_ATTEMPTS", "1")
            patch.setenv("AWS_RETRY_MODE", "standard")
            patch.setattr(s3fs.S3FileSystem, "retries", 1)
            patch.setattr(s3fs.core.S3File, "retries", 1)
            # 5 MiB parts (the S3 minimum): a 6 MiB data file is a multipart upload
            patch.setattr(s3fs.S3FileSystem, "default_block_size", 5 << 20)
            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
            yield server
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.close()


def big_state(step: int) -> dict[str, Any]:
    """7 MiB of random bytes (incompressible): the data file goes up in two parts."""
    generator = torch.Generator().manual_seed(step)
    return {"blob": torch.randint(0, 256, (7 << 20,), dtype=torch.uint8, generator=generator), "step": step}


def assert_unreachable(error: BaseException, url: str) -> None:
    """The error of a storage operation while the server is gone: a ConnectionError naming
    the file or folder and what to check, chained to botocore's error."""
    assert type(error) is ConnectionError, repr(error)
    message = str(error)
    assert message.startswith(url) and "cannot reach the storage" in message, message
    assert "check the endpoint URL" in message and "server is up" in message, message
    assert isinstance(error.__cause__, botocore_exceptions.BotoCoreError), repr(error.__cause__)


def _state(step: int) -> dict[str, Any]:
    return big_state(step) if step == 3 else step_state(step)


def _stop_while_writing(server: S3Server) -> Callable[..., Any]:
    """``write_state`` that stops the server once the first 5 MiB part has gone up."""
    original = manager_module.write_state

    class _StopAfter:
        def __init__(self, out: Any) -> None:
            self.out, self.written = out, 0

        def write(self, data: Any) -> int:
            count = self.out.write(data)  # s3fs uploads a part as soon as 5 MiB are buffered
            self.written += memoryview(data).nbytes
            if self.written > 5 << 20 and server.running:
                server.stop()
            return count

    return lambda out, *args, **kwargs: original(_StopAfter(out), *args, **kwargs)


def _stop_then(server: S3Server, original: Callable[..., Any]) -> Callable[..., Any]:
    def stopped_first(*args: Any, **kwargs: Any) -> Any:
        server.stop()
        return original(*args, **kwargs)

    return stopped_first


MOMENTS = {
    "during-upload": lambda server: ("write_state", _stop_while_writing(server)),
    "before-commit": lambda server: ("publish_manifest", _stop_then(server, manager_module.publish_manifest)),
    "after-commit": lambda server: ("apply_retention", _stop_then(server, manager_module.apply_retention)),
}


@pytest.mark.parametrize(
    "moment, async_save",
    [*((moment, False) for moment in sorted(MOMENTS)), ("during-upload", True)],
    ids=[*(f"{moment}-sync" for moment in sorted(MOMENTS)), "during-upload-async"],
)
def test_the_server_stopping_mid_save_loses_nothing(
    s3: S3Server, moment: str, async_save: bool, monkeypatch: pytest.MonkeyPatch, tally: Any
) -> None:
    url = f"s3://{BUCKET}/run-{next(_runs)}"
    with CheckpointManager(url, **OPTIONS) as writer:
        for step in range(3):
            writer.save(step, _state(step))
    manager = CheckpointManager(url, async_save=async_save, **OPTIONS)
    name, replacement = MOMENTS[moment](s3)
    monkeypatch.setattr(manager_module, name, replacement)
    with pytest.raises((AsyncSaveError, *OUTAGE_ERRORS)) as caught:
        manager.save(3, _state(3))
        manager.wait()
    monkeypatch.undo()
    assert not s3.running
    tally["S3 outages"] += 1
    error = caught.value.__cause__ if isinstance(caught.value, AsyncSaveError) else caught.value
    assert_unreachable(error, url)
    notes = " ".join(getattr(error, "__notes__", []))
    with pytest.raises(ConnectionError) as caught:  # readers get an error too while the server is down
        CheckpointManager(url).load(2)
    assert_unreachable(caught.value, url)
    with pytest.raises(ConnectionError):  # nothing could be checked: not reported as damage
        verify_run(url)

    s3.start()
    s3fs.S3FileSystem.clear_instance_cache()
    steps = CheckpointManager(url).steps()
    committed = moment == "after-commit"
    assert ("was committed" in notes) == committed and ("failed before its commit" in notes) != committed, notes
    assert steps == ([1, 2, 3] if committed else [1, 2])
    reader = CheckpointManager(url)
    for step in steps:
        assert_same(reader.load(step), _state(step))
    assert verify_run(url) == []

    following = 4 if committed else 3
    manager.save(following, _state(following))  # the training loop goes on
    manager.close()
    with CheckpointManager(url, **OPTIONS) as cleaner:
        cleaner.save(following + 1, _state(following + 1))
    entries = describe_run(url)
    kept = {RUN_MARKER} | {manifest_name(e.step) for e in entries} | {e.data_file for e in entries}
    listed = {path.rsplit("/", 1)[1] for path in s3fs.S3FileSystem().ls(url.removeprefix("s3://"), refresh=True)}
    assert listed == kept, "a new writer removed what the outage left behind"
    assert [e.step for e in entries] == [following, following + 1]
    assert verify_run(url) == []


def test_a_single_file_on_s3_survives_an_outage_mid_upload(s3: S3Server, tally: Any) -> None:
    url = f"s3://{BUCKET}/files/model-{next(_runs)}.ink"
    ink.save(step_state(0), url)
    from inshrinkerator import single_file

    real_write_state = single_file.write_state

    def stops_midway(out: Any, *args: Any, **kwargs: Any) -> Any:
        out.write(b"\0" * (6 << 20))  # past the first part: a multipart upload is under way
        s3.stop()
        return real_write_state(out, *args, **kwargs)

    single_file.write_state = stops_midway
    try:
        with pytest.raises(ConnectionError) as caught:
            ink.save(big_state(1), url)
    finally:
        single_file.write_state = real_write_state
    tally["S3 outages"] += 1
    assert_unreachable(caught.value, url)
    assert any("unchanged" in note for note in getattr(caught.value, "__notes__", []))
    with pytest.raises(ConnectionError) as caught:
        ink.load(url)
    assert_unreachable(caught.value, url)
    s3.start()
    s3fs.S3FileSystem.clear_instance_cache()
    assert_same(ink.load(url), step_state(0))


def test_every_storage_operation_with_the_server_gone_is_a_connection_error(s3: S3Server) -> None:
    """Saves, loads, listings and verification of runs and files, the server down from the
    start: each raises ConnectionError naming what it was reaching for, in well under a second
    (retries turned down), and nothing is lost once the server is back."""
    url = f"s3://{BUCKET}/run-{next(_runs)}"
    file_url = f"s3://{BUCKET}/files/gone-{next(_runs)}.ink"
    with CheckpointManager(url, **OPTIONS) as writer:
        writer.save(0, step_state(0))
    ink.save(step_state(0), file_url)
    storage = open_storage(url)
    s3.stop()
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        attempts: dict[str, Callable[[], Any]] = {
            "list": storage.list_names,
            "read": lambda: storage.read_bytes(RUN_MARKER, 1 << 20),
            "open": lambda: storage.open_read(RUN_MARKER),
            "write_bytes": lambda: storage.write_bytes("x.json", b"{}"),
            "write_file": lambda: storage.write_file("x.ink", lambda out: out.write(b"x")),
            "remove": lambda: storage.remove(RUN_MARKER),
            "prepare": storage.prepare,
            "manager load": lambda: CheckpointManager(url).load(0),
            "manager steps": lambda: CheckpointManager(url).steps(),
            "manager save": lambda: CheckpointManager(url, **OPTIONS).save(1, step_state(1)),
            "describe_run": lambda: describe_run(url),
            "verify_run": lambda: verify_run(url),
            "ink.save": lambda: ink.save(step_state(1), file_url),
            "ink.load": lambda: ink.load(file_url),
        }
        for what, attempt in attempts.items():
            with pytest.raises(ConnectionError) as caught:
                attempt()
            target = file_url if what.startswith("ink.") else url
            assert_unreachable(caught.value, target)
            notes = " ".join(getattr(caught.value, "__notes__", []))
            if what == "manager save":
                assert "failed before its commit" in notes, notes
            if what == "ink.save":
                assert "is unchanged" in notes, notes
    finally:
        s3.start()
        s3fs.S3FileSystem.clear_instance_cache()
    assert CheckpointManager(url).steps() == [0]
    assert_same(CheckpointManager(url).load(0), step_state(0))
    assert_same(ink.load(file_url), step_state(0))
    assert verify_run(url) == []


def test_format_errors_on_s3_are_not_disguised(s3: S3Server) -> None:
    """With the server up, a damaged or foreign file is still a FormatError / corruption."""
    url = f"s3://{BUCKET}/files/bad-{next(_runs)}.ink"
    fs = s3fs.S3FileSystem()
    fs.pipe_file(url.removeprefix("s3://"), b"\x80\x04" + b"a pickle, not an ink file" * 4)
    with pytest.raises(ink.FormatError, match="bad magic.*pickle"):
        ink.load(url)
    run = f"s3://{BUCKET}/run-{next(_runs)}"
    with CheckpointManager(run, **OPTIONS) as writer:
        writer.save(0, step_state(0))
    fs.pipe_file(f"{run.removeprefix('s3://')}/{manifest_name(0)}", b'{"version": 1}')
    with pytest.raises(ink.CorruptCheckpointError):
        CheckpointManager(run).load(0)
    assert verify_run(run) and all("CorruptCheckpointError" in line for line in verify_run(run))
