"""The commit protocol: the manifest commits a step; leftovers of a crash are cleaned by the writer."""

from __future__ import annotations

from inshrinkerator.store import CheckpointManager, verify_run
from inshrinkerator.store.commit import list_steps, remove_stale
from inshrinkerator.store.manifest import data_name, manifest_name
from inshrinkerator.store.storage import open_storage

from ..helpers import assert_same
from .support import state_for


def _crash_leftovers(storage) -> list[str]:
    """What a killed writer leaves: a temporary and an uncommitted data file of step 3."""
    leftovers = [".tmp-step-0000000003-deadbeef.ink.x7", data_name(3, "deadbeef")]
    for name in leftovers:
        storage.write_bytes(name, b"partial bytes")
    return leftovers


def test_uncommitted_files_are_not_steps_and_the_next_writer_removes_them(run_url: str) -> None:
    with CheckpointManager(run_url, policy="lossless") as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    storage = open_storage(run_url)
    leftovers = _crash_leftovers(storage)
    reader = CheckpointManager(run_url)
    assert reader.steps() == [1, 2]
    assert_same(reader.load(), state_for(2))
    assert set(leftovers) <= set(storage.list_names()), "a reader must not clean up a writer's files"
    assert verify_run(run_url) == []
    with CheckpointManager(run_url, policy="lossless") as writer:
        writer.save(3, state_for(3))
    names = storage.list_names()
    assert not set(leftovers) & set(names)
    assert list_steps(storage) == [1, 2, 3]
    assert_same(CheckpointManager(run_url).load(3), state_for(3))


def test_cleanup_keeps_data_when_a_manifest_is_unreadable(tmp_path) -> None:
    run = tmp_path / "run"
    with CheckpointManager(run, policy="lossless") as mgr:
        mgr.save(1, state_for(1))
    storage = open_storage(run)
    orphan = data_name(7, "0badf00d")
    storage.write_bytes(orphan, b"?")
    storage.write_bytes(manifest_name(5), b"{not json")
    removed = remove_stale(storage, storage.list_names())
    assert orphan not in removed and orphan in storage.list_names()


def test_a_manifest_without_its_data_is_reported_not_hidden(tmp_path) -> None:
    run = tmp_path / "run"
    with CheckpointManager(run, policy="lossless") as mgr:
        mgr.save(1, state_for(1))
        mgr.save(2, state_for(2))
    for path in run.glob("step-0000000002-*.ink"):
        path.unlink()
    problems = verify_run(str(run))
    assert len(problems) == 1 and problems[0].startswith("step 2:") and "missing" in problems[0]
