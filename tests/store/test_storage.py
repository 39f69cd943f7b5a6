"""Run storage: atomic writes, listing, locations."""

from __future__ import annotations

import pytest

from inshrinkerator.errors import CheckpointNotFoundError
from inshrinkerator.store.storage import (
    FsspecRunStorage,
    LocalRunStorage,
    is_temporary,
    open_storage,
)


def test_locations_pick_the_right_storage(tmp_path) -> None:
    assert isinstance(open_storage(tmp_path / "run"), LocalRunStorage)
    assert isinstance(open_storage(f"file://{tmp_path}/run"), LocalRunStorage)
    assert isinstance(open_storage("memory://bucket/run"), FsspecRunStorage)
    with pytest.raises(CheckpointNotFoundError):
        open_storage("nosuchprotocol://x/y")


def _fails_midway(handle):
    handle.write(b"half of the new content")
    raise OSError("disk full")


def test_failed_writes_leave_nothing_and_replacement_is_whole(run_url: str) -> None:
    storage = open_storage(run_url)
    assert storage.list_names() == []
    storage.prepare()
    storage.write_bytes("a.json", b"first")
    with pytest.raises(OSError, match="disk full"):
        storage.write_file("b.json", _fails_midway)
    storage.write_bytes("a.json", b"second")
    assert storage.read_bytes("a.json", 100) == b"second"
    assert storage.list_names() == ["a.json"]
    storage.remove("a.json")
    storage.remove("a.json")  # removing a missing file is fine
    assert storage.list_names() == []


def test_local_failed_rewrite_keeps_the_old_file(tmp_path) -> None:
    storage = open_storage(tmp_path / "run")
    storage.prepare()
    storage.write_bytes("a.json", b"first")
    with pytest.raises(OSError):
        storage.write_file("a.json", _fails_midway)
    assert storage.read_bytes("a.json", 100) == b"first"
    assert not any(is_temporary(n) for n in storage.list_names())


def test_read_limit_is_enforced(run_url: str) -> None:
    storage = open_storage(run_url)
    storage.prepare()
    storage.write_bytes("big", b"x" * 100)
    with pytest.raises(ValueError, match="larger than 10"):
        storage.read_bytes("big", 10)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("absent", 10)
