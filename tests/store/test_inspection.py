"""describe_run / verify_run / is_run: what the CLI shows for a run."""

from __future__ import annotations

import pytest

import inshrinkerator as ink
from inshrinkerator.errors import CheckpointNotFoundError
from inshrinkerator.store import (
    CheckpointManager,
    describe_run,
    is_run,
    run_class_bytes,
    verify_run,
)
from inshrinkerator.store.manifest import manifest_name

from ..helpers import training_state
from .support import state_for


def test_describe_lists_every_step_with_sizes_and_kinds(run_url: str) -> None:
    with CheckpointManager(run_url, full_every=2, policy="lossless") as mgr:
        infos = [mgr.save(step, state_for(step)) for step in (5, 10, 15)]
    entries = describe_run(run_url)
    assert [(e.step, e.kind, e.base_step) for e in entries] == [(5, "full", None), (10, "delta", 5), (15, "full", None)]
    for info, entry in zip(infos, entries):
        assert entry.raw_bytes == info.raw_bytes and entry.stored_bytes == info.stored_bytes
        assert entry.ratio == pytest.approx(entry.raw_bytes / entry.stored_bytes)
        assert entry.policy == "lossless" and entry.created.endswith("+00:00")
        assert set(vars(entry)) >= {"step", "kind", "base_step", "raw_bytes", "stored_bytes", "ratio", "policy", "created"}


def test_run_class_bytes_splits_each_step_from_its_header(run_url: str) -> None:
    states = [training_state(steps=steps) for steps in (2, 4, 6)]
    with CheckpointManager(run_url, full_every=2) as mgr:
        infos = [mgr.save(step, state) for step, state in enumerate(states)]
    by_step = run_class_bytes(run_url)
    assert list(by_step) == [0, 1, 2]
    parameters = 4 * sum(entry["exp_avg"].numel() for entry in states[0]["optimizer"]["state"].values())
    for info, entry, classes in zip(infos, describe_run(run_url), by_step.values()):
        assert classes.containers == 1
        assert sum(classes.raw.values()) == info.raw_bytes  # every tensor in one class
        # The tensors' data: less than the step's files (a header, a manifest), never nothing.
        assert 0 < sum(classes.stored.values()) < entry.stored_bytes
        for name in ("weights", "first_moment", "second_moment"):
            assert classes.raw[name] == parameters


def test_is_run_tells_runs_from_everything_else(tmp_path, run_url: str) -> None:
    assert not is_run(run_url)
    with CheckpointManager(run_url, policy="lossless") as mgr:
        mgr.save(1, state_for(1))
    assert is_run(run_url)
    ink.save(state_for(1), tmp_path / "single.ink")
    assert not is_run(tmp_path / "single.ink")
    assert not is_run(tmp_path / "missing")
    assert not is_run(tmp_path)
    assert not is_run("nosuchprotocol://bucket/run")


def test_describe_and_verify_refuse_a_non_run(tmp_path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no run here"):
        describe_run(str(tmp_path))
    assert len(verify_run(str(tmp_path))) == 1


def test_verify_reports_each_damaged_step_once_per_line(tmp_path) -> None:
    run = tmp_path / "run"
    with CheckpointManager(run, full_every=10, policy="lossless") as mgr:
        for step in range(5):
            mgr.save(step, state_for(step))
    assert verify_run(str(run)) == []
    (run / manifest_name(2)).write_text("{broken")
    problems = verify_run(str(run))
    # Step 2's manifest is damaged; 3 and 4 are deltas that need it.
    assert [p.split(":")[0] for p in problems] == ["step 2", "step 3", "step 4"]
    assert "CorruptCheckpointError" in problems[0] and "BrokenChainError" not in problems[0]
