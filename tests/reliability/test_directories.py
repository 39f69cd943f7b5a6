"""A directory where a run file or an ``.ink`` file belongs: a clear error naming it.

Reading: ``CorruptCheckpointError`` naming the path (the run was damaged), for the steps
whose chain needs that file only; ``verify`` reports exactly those. Writing: the save fails
with an error naming the path, writes nothing there, and every earlier step stays intact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import inshrinkerator as ink
from inshrinkerator.errors import CorruptCheckpointError
from inshrinkerator.store import CheckpointManager, describe_run, verify_run
from inshrinkerator.store.manifest import RUN_MARKER, manifest_name, step_of_data_name
from inshrinkerator.store.storage import open_storage

from ..helpers import assert_same
from .run_damage import RunFiles, chain_of, copy_run, snapshot_files, step_state


def _targets(files: RunFiles) -> dict[str, tuple[str, set[int]]]:
    """label -> (file to replace by a directory, the steps that must then fail to load)."""
    needs = {step: set(chain_of(files, step)) for step in files.base}
    return {
        "manifest of a delta's base": (manifest_name(1), {s for s, chain in needs.items() if 1 in chain}),
        "data file of a full step": (files.data_file[3], {s for s, chain in needs.items() if 3 in chain}),
        "manifest of the newest step": (manifest_name(5), {5}),
        "run marker": (RUN_MARKER, set()),
    }


@pytest.mark.parametrize("label", ["manifest of a delta's base", "data file of a full step",
                                   "manifest of the newest step", "run marker"])
def test_a_directory_in_place_of_a_run_file_is_a_clear_read_error(
    template_run: tuple[Path, RunFiles], tmp_path: Path, label: str
) -> None:
    template, files = template_run
    name, broken = _targets(files)[label]
    folder = tmp_path / "run"
    copy_run(template, folder)
    (folder / name).unlink()
    (folder / name).mkdir()
    where = f"{folder}/{name}"
    reader = CheckpointManager(folder)
    assert reader.steps() == sorted(files.base)
    for step in files.base:
        if step in broken:
            with pytest.raises(CorruptCheckpointError, match="is a directory where a run file belongs") as caught:
                reader.load(step)
            assert where in str(caught.value)
        else:
            assert_same(reader.load(step), step_state(step))
    problems = verify_run(str(folder))
    flagged = {int(line.split(":")[0].split()[1]) for line in problems if line.startswith("step ")}
    assert flagged == broken, problems
    assert all("CorruptCheckpointError" in line and where in line for line in problems), problems
    if name == RUN_MARKER:
        assert problems == [f"run marker: CorruptCheckpointError: {where} is a directory where a run file "
                            "belongs; the run was damaged (move the directory away; `inshrink verify` lists "
                            "the steps this breaks)"]


def test_a_directory_where_the_next_manifest_belongs_fails_the_save_cleanly(
    template_run: tuple[Path, RunFiles], tmp_path: Path
) -> None:
    template, files = template_run
    folder = tmp_path / "run"
    copy_run(template, folder)
    before = snapshot_files(folder)
    (folder / manifest_name(6)).mkdir()
    manager = CheckpointManager(folder, policy="lossless", full_every=3)
    with pytest.raises(CorruptCheckpointError, match="is a directory") as caught:
        manager.save(6, step_state(6))
    assert f"{folder}/{manifest_name(6)}" in str(caught.value)
    assert any("failed before its commit" in note for note in caught.value.__notes__)
    assert snapshot_files(folder) == before  # nothing written, nothing removed
    for step in files.base:
        assert_same(manager.load(step), step_state(step))


def test_writing_a_run_file_over_a_directory_names_it_and_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "step-0000000001.json").mkdir()
    (folder / "step-0000000001.json" / "inside").write_bytes(b"kept")
    storage = open_storage(str(folder))
    for write in (lambda: storage.write_bytes("step-0000000001.json", b"{}"),
                  lambda: storage.write_file("step-0000000001.json", lambda out: out.write(b"{}"))):
        with pytest.raises(IsADirectoryError, match="nothing was written") as caught:
            write()
        assert str(folder / "step-0000000001.json") in str(caught.value)
    assert sorted(p.name for p in folder.iterdir()) == ["step-0000000001.json"]  # no temporaries
    assert (folder / "step-0000000001.json" / "inside").read_bytes() == b"kept"


def test_a_directory_named_like_a_leftover_data_file_is_left_alone(
    template_run: tuple[Path, RunFiles], tmp_path: Path
) -> None:
    template, files = template_run
    folder = tmp_path / "run"
    copy_run(template, folder)
    stray = folder / "step-0000000004-0badc0de.ink"
    assert step_of_data_name(stray.name) == 4
    stray.mkdir()
    with CheckpointManager(folder, policy="lossless", full_every=3) as manager:
        manager.save(6, step_state(6))  # the writer's cleanup skips it
    assert stray.is_dir()
    assert [e.step for e in describe_run(str(folder))] == [*sorted(files.base), 6]
    assert verify_run(str(folder)) == []


def test_single_files_and_directories(tmp_path: Path) -> None:
    folder = tmp_path / "model.ink"
    folder.mkdir()
    (folder / "inside").write_bytes(b"kept")
    state: dict[str, Any] = step_state(0)
    with pytest.raises(IsADirectoryError, match="is a directory: ink.save writes one file") as caught:
        ink.save(state, folder)
    assert str(folder) in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ink"]
    assert [p.name for p in folder.iterdir()] == ["inside"]
    with pytest.raises(ink.FormatError, match="is a directory"):
        ink.load(folder)
