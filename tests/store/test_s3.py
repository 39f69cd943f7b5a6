"""A run on ``s3://`` through s3fs, against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed")

from inshrinkerator.store import CheckpointManager, describe_run, is_run, verify_run  # noqa: E402
from inshrinkerator.store.manifest import data_name  # noqa: E402
from inshrinkerator.store.storage import FsspecRunStorage, open_storage  # noqa: E402

from ..helpers import assert_same  # noqa: E402
from ..policies.random_states import (  # noqa: E402
    LONG,
    Scenario,
    fuzz_settings,
    problems,
    run_through_manager,
    scenarios,
)
from .support import state_for  # noqa: E402

_runs = itertools.count()


@pytest.fixture
def s3_run(s3_bucket: str) -> str:
    return f"{s3_bucket}/run-{next(_runs)}"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_load_retention_reopen_on_s3(s3_run: str, async_save: bool) -> None:
    assert not is_run(s3_run)
    assert isinstance(open_storage(s3_run), FsspecRunStorage)
    with CheckpointManager(s3_run, full_every=3, keep_last=3, async_save=async_save, policy="lossless") as mgr:
        for step in range(6):
            mgr.save(step, state_for(step))
        assert mgr.steps() == [3, 4, 5]
        for step in (3, 4, 5):
            assert_same(mgr.load(step), state_for(step))
    s3fs.S3FileSystem.clear_instance_cache()  # a new process would start with nothing cached
    assert is_run(s3_run)
    with CheckpointManager(s3_run, full_every=3, keep_last=3, async_save=async_save, policy="lossless") as reopened:
        assert reopened.latest_step() == 5
        reopened.save(6, state_for(6))
        reopened.save(7, state_for(7))
        assert reopened.steps() == [5, 6, 7]
        for step in (5, 6, 7):
            assert_same(reopened.load(step), state_for(step))
    entries = describe_run(s3_run)
    assert [e.step for e in entries] == [5, 6, 7] and entries[0].kind == "full"
    assert all(e.base_step in (None, e.step - 1) for e in entries)
    assert verify_run(s3_run) == []


def test_uncommitted_objects_are_invisible_and_cleaned_by_the_next_writer(s3_run: str) -> None:
    with CheckpointManager(s3_run, policy="lossless") as mgr:
        mgr.save(1, state_for(1))
    storage = open_storage(s3_run)
    orphan = data_name(2, "deadbeef")
    storage.write_bytes(orphan, b"an upload whose manifest never came")
    assert CheckpointManager(s3_run).steps() == [1]
    assert orphan in storage.list_names()
    with CheckpointManager(s3_run, policy="lossless") as writer:
        writer.save(2, state_for(2))
    assert orphan not in storage.list_names()
    assert verify_run(s3_run) == []


def test_a_failed_upload_leaves_no_object(s3_run: str) -> None:
    storage = open_storage(s3_run)

    def fails_after_writing(handle):
        handle.write(b"x" * (6 << 20))  # past s3fs's 5 MiB block: a multipart upload has begun
        raise OSError("connection lost")

    with pytest.raises(OSError, match="connection lost"):
        storage.write_file(data_name(9, "0123abcd"), fails_after_writing)
    assert storage.list_names() == []


@(pytest.mark.timeout(0) if LONG else pytest.mark.usefixtures())  # a campaign takes as long as it takes
@fuzz_settings(3, share=20)
@given(scenario=scenarios())
def test_random_training_states_on_s3(s3_bucket: str, scenario: Scenario) -> None:
    """The random states of ``tests/policies/test_random_states.py`` (async saves, restarts,
    retention and all) in runs on the S3 server: the run verifies clean and every kept step
    restores within DynaQuant's bounds."""
    run = run_through_manager(scenario, f"{s3_bucket}/random-{next(_runs)}")
    for step, (saved, restored) in run.items():
        found = problems(saved, restored, bounded="evaluate" not in scenario.variants)
        assert found == [], f"step {step}: {found}"
