"""Sealed manifests and run markers: every damaged byte is detected, older files still read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inshrinkerator.errors import CorruptCheckpointError, FormatError
from inshrinkerator.store import CheckpointManager, verify_run
from inshrinkerator.store.manifest import (
    RUN_MARKER,
    manifest_name,
    parse_manifest,
    parse_run_marker,
)

from ..helpers import assert_same
from .run_damage import RunFiles, step_state


def _unsealed(blob: bytes) -> dict:
    document = json.loads(blob)
    del document["crc32"]
    return document


@pytest.fixture
def run(template_run: tuple[Path, RunFiles], tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(template_run[0], folder)
    return folder


def test_manifests_written_before_the_seal_still_load(run: Path) -> None:
    for step in (3, 4):
        document = _unsealed((run / manifest_name(step)).read_bytes())
        (run / manifest_name(step)).write_bytes(json.dumps(document, indent=1).encode())
    marker = _unsealed((run / RUN_MARKER).read_bytes())
    (run / RUN_MARKER).write_bytes(json.dumps(marker).encode())
    assert_same(CheckpointManager(run).load(4), step_state(4))
    assert verify_run(str(run)) == []


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(created="2020-01-01T00:00:00+00:00"), "checksum"),
    (lambda d: d.update(policy="lossles5"), "checksum"),
    (lambda d: d.update(stored_bytes=d["stored_bytes"] + 1), "checksum"),
    (lambda d: d.update(crc32="00000000"), "checksum"),
    (lambda d: d.update(note="hello"), "unknown fields"),
])
def test_a_changed_field_breaks_the_seal(run: Path, edit, message: str) -> None:
    blob = (run / manifest_name(4)).read_bytes()
    document = json.loads(blob)
    edit(document)
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_manifest(json.dumps(document, indent=1).encode(), "m", 4)


def test_reformatting_a_manifest_breaks_the_seal(run: Path) -> None:
    document = json.loads((run / manifest_name(4)).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        parse_manifest(json.dumps(document).encode(), "m", 4)  # same fields, other whitespace
    document.pop("crc32")
    document["crc33"] = "00000000"  # a damaged field name must not switch the seal off
    with pytest.raises(CorruptCheckpointError, match="unknown fields"):
        parse_manifest(json.dumps(document, indent=1).encode(), "m", 4)


def test_run_marker_checks(run: Path) -> None:
    blob = (run / RUN_MARKER).read_bytes()
    parse_run_marker(blob, "marker")
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        parse_run_marker(blob.replace(b'"created": "2', b'"created": "1'), "marker")
    document = json.loads(blob)
    document["version"] = 2
    with pytest.raises(FormatError, match="run version 2 is not supported"):
        parse_run_marker(json.dumps(document).encode(), "marker")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        parse_run_marker(b"\x80\x04N.", "marker")


def test_verify_reports_a_missing_or_damaged_marker_and_readers_do_not_care(run: Path) -> None:
    (run / RUN_MARKER).write_bytes(b"{}")
    problems = verify_run(str(run))
    assert problems and problems[0].startswith("run marker:") and "not an inshrinkerator run marker" in problems[0]
    (run / RUN_MARKER).unlink()
    assert verify_run(str(run)) == [f"run marker: {run / RUN_MARKER} is missing; the run was damaged"]
    assert_same(CheckpointManager(run).load(), step_state(5))
