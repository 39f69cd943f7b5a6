"""fsspec I/O errors at every operation of a save: nothing committed is lost, the error is clear.

A ``flaky://`` filesystem fails the N-th operation of a save (or, for an *outage*, every
operation from the N-th on) for every N until the save gets through. The save under test
continues a run with retention, so the sweep crosses the data upload, the commit, the
re-base of the oldest kept step and the deletions. After each failure: the step is in
the run only if the error says it was committed, every listed step restores exactly, the
run verifies, and the same manager then carries on (a new writer finally cleans up).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
from fsspec.implementations.memory import MemoryFile

import inshrinkerator as ink
from inshrinkerator.errors import AsyncSaveError
from inshrinkerator.store import CheckpointManager, describe_run, verify_run
from inshrinkerator.store.manifest import RUN_MARKER, manifest_name

from ..helpers import assert_same
from .flaky_fs import FlakyFileSystem, flaky_filesystem
from .run_damage import step_state

RUN = "flaky://runs/exp"
OPTIONS = {"policy": "lossless", "full_every": 3, "keep_last": 2}
#: No save of these small states takes this many operations; a sweep that reaches it is stuck.
MAX_OPERATIONS = 400


def _files(fs: FlakyFileSystem) -> dict[str, bytes]:
    return {path: file.getvalue() for path, file in fs.store.items()}


def _restore(fs: FlakyFileSystem, files: dict[str, bytes], folders: list[str]) -> None:
    fs.reset()
    fs.pseudo_dirs[:] = folders
    for path, data in files.items():
        fs.store[path] = MemoryFile(fs, path, data)


def _underlying(error: BaseException) -> BaseException:
    return error.__cause__ if isinstance(error, AsyncSaveError) and error.__cause__ is not None else error


def _check_run(expected: set[int], must_have: set[int]) -> list[int]:
    steps = CheckpointManager(RUN).steps()
    assert must_have <= set(steps) <= expected, steps
    reader = CheckpointManager(RUN)
    for step in steps:
        assert_same(reader.load(step), step_state(step))
    assert verify_run(RUN) == []
    return steps


def _leftovers(fs: FlakyFileSystem) -> list[str]:
    entries = describe_run(RUN)
    kept = {RUN_MARKER} | {manifest_name(e.step) for e in entries} | {e.data_file for e in entries}
    assert kept <= set(fs.names("/runs/exp"))
    return sorted(set(fs.names("/runs/exp")) - kept)


@pytest.mark.parametrize(
    "async_save, outage", [(False, False), (False, True), (True, False)], ids=["sync", "sync-outage", "async"]
)
def test_an_io_error_at_any_operation_of_a_save_loses_nothing(async_save: bool, outage: bool, tally: Any) -> None:
    fs = flaky_filesystem()
    with CheckpointManager(RUN, **OPTIONS) as writer:
        for step in range(3):
            writer.save(step, step_state(step))
    assert CheckpointManager(RUN).steps() == [1, 2]  # step 1 was re-based to full, step 0 deleted
    baseline, folders = _files(fs), list(fs.pseudo_dirs)
    committed_after_error = 0
    for fault in range(1, MAX_OPERATIONS):
        _restore(fs, baseline, folders)
        manager = CheckpointManager(RUN, async_save=async_save, **OPTIONS)
        fs.arm(fault, outage)
        error: Optional[BaseException] = None
        try:
            manager.save(3, step_state(3))
            manager.wait()
        except (OSError, AsyncSaveError) as exc:
            error = exc
        operations = fs.disarm()
        if error is None:
            assert fault > operations, "the save succeeded although an operation failed"
            break
        tally["I/O fault points"] += 1
        cause = _underlying(error)
        assert isinstance(cause, OSError) and "injected I/O error" in str(cause), repr(error)
        notes = " ".join(getattr(cause, "__notes__", []))
        steps = _check_run({1, 2, 3}, {2})
        if 3 in steps:
            committed_after_error += 1
            assert "was committed" in notes, notes
        else:
            assert steps == [1, 2]
            assert "was committed" not in notes
        # the training loop goes on with the same manager, then a new writer cleans up
        following = 4 if 3 in steps else 3
        manager.save(following, step_state(following))
        manager.close()
        assert CheckpointManager(RUN).steps() == [following - 1, following]
        with CheckpointManager(RUN, **OPTIONS) as cleaner:
            cleaner.save(following + 1, step_state(following + 1))
        assert _leftovers(fs) == []
        assert verify_run(RUN) == []
    else:
        raise AssertionError(f"a save never got through {MAX_OPERATIONS} operations")
    assert fault > 20, "the sweep should cross a whole save"
    assert committed_after_error > 0, "the sweep should reach the retention after the commit"


@pytest.mark.parametrize("outage", [False, True], ids=["one-failure", "outage"])
def test_a_failed_single_file_save_to_a_url_keeps_the_previous_file(outage: bool, tally: Any) -> None:
    fs = flaky_filesystem()
    url = "flaky://files/model.ink"
    ink.save(step_state(0), url)
    for fault in range(1, MAX_OPERATIONS):
        fs.arm(fault, outage)
        try:
            ink.save(step_state(1), url)
        except OSError as exc:
            assert "injected I/O error" in str(exc)
            assert any("unchanged" in note for note in getattr(exc, "__notes__", []))
        else:
            if fault > fs.disarm():
                break
            # Only the removal of the temporary, after the file was in place, may fail quietly.
            assert len(fs.failures) == 1 and fs.failures[0].startswith("rm "), fs.failures
            assert_same(ink.load(url), step_state(1))
            ink.save(step_state(0), url)
            tally["I/O fault points"] += 1
            continue
        fs.disarm()
        tally["I/O fault points"] += 1
        assert_same(ink.load(url), step_state(0))
        if not outage:
            assert fs.names("/files") == ["model.ink"], "the temporary object was removed"
        for path in [p for p in fs.store if p != "/files/model.ink"]:
            del fs.store[path]  # what an outage left behind
    else:
        raise AssertionError("the save never got through")
    assert_same(ink.load(url), step_state(1))
