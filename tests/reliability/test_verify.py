"""``inshrink verify`` catches every corruption injected into a file or a run.

Single files: a bit flipped in every byte (every ``stride``-th byte in CI; set
``INSHRINK_VERIFY_EXHAUSTIVE=1`` for all of them), truncation to many lengths, bytes
appended, for a lossless file, a dynaquant file and a file of deltas against a base.
Runs: each kind of damage to each file of a run. Every trial must exit 1 and name the
damage; the undamaged originals exit 0. (Randomized damage to runs is in test_run_fuzz.py.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import inshrinkerator as ink
from inshrinkerator.cli import main
from inshrinkerator.store import verify_run

from .run_damage import Damage, RunFiles, copy_run, expected_damage, snapshot_files, step_state

EXHAUSTIVE = os.environ.get("INSHRINK_VERIFY_EXHAUSTIVE") == "1"


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["verify", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def corruptions(data: bytes, stride: int) -> Iterator[tuple[str, bytes]]:
    for position in range(0, len(data), 1 if EXHAUSTIVE else stride):
        flipped = bytearray(data)
        flipped[position] ^= 1 << (position % 8)
        yield f"bit flip at byte {position}", bytes(flipped)
    for length in sorted({0, 1, 8, 31, 32, 33, len(data) // 2, len(data) - 64, len(data) - 1}
                         | set(range(0, len(data), 1 if EXHAUSTIVE else stride * 4))):
        if 0 <= length < len(data):
            yield f"truncated to {length} bytes", data[:length]
    yield "one byte appended", data + b"\0"
    yield "a copy appended", data + data


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[str]]]:
    """name -> (file, extra verify arguments)."""
    folder = tmp_path_factory.mktemp("verify-files")
    made: dict[str, tuple[Path, list[str]]] = {}
    ink.save(step_state(1), folder / "lossless.ink")
    made["lossless"] = (folder / "lossless.ink", [])
    big = {"model": {"0.weight": step_state(1)["model"]["weight"].repeat(8).reshape(64, 48)}, "step": 1}
    ink.save(big, folder / "dynaquant.ink", policy="dynaquant")
    made["dynaquant"] = (folder / "dynaquant.ink", [])
    ink.save(step_state(0), folder / "base.ink")
    ink.save(step_state(1), folder / "delta.ink", base=folder / "base.ink")
    made["delta"] = (folder / "delta.ink", ["--base", str(folder / "base.ink")])
    return made


@pytest.mark.parametrize("name", ["lossless", "dynaquant", "delta"])
def test_verify_catches_every_corruption_of_a_file(
    name: str, files: dict[str, tuple[Path, list[str]]], tmp_path: Path, capsys: pytest.CaptureFixture[str], tally: Any
) -> None:
    path, extra = files[name]
    assert verify(capsys, *extra, str(path)) == (0, {"path": str(path), "ok": True, "problems": []})
    data = path.read_bytes()
    damaged = tmp_path / "damaged.ink"
    trials = 0
    for label, corrupted in corruptions(data, stride=max(1, len(data) // 150)):
        damaged.write_bytes(corrupted)
        code, report = verify(capsys, *extra, str(damaged))
        assert code == 1 and not report["ok"], f"{name}: {label} was not caught"
        assert all(str(damaged) in problem for problem in report["problems"]), report
        trials += 1
    tally["corruption trials (files)"] += trials
    assert trials > 150


DAMAGE_KINDS = {
    "first byte flipped": lambda target: Damage("flip", target, 0, 0x01),
    "middle byte flipped": lambda target: Damage("flip", target, 1 << 19, 0x40),  # any position: taken modulo the size
    "last byte flipped": lambda target: Damage("flip", target, -1, 0x80),
    "truncated by one": lambda target: Damage("truncate", target, -1),
    "emptied": lambda target: Damage("overwrite", target, payload=b""),
    "byte appended": lambda target: Damage("extend", target, payload=b"\n"),
    "deleted": lambda target: Damage("delete", target),
    "replaced by a directory": lambda target: Damage("directory", target),
}


def test_verify_catches_every_kind_of_damage_to_every_file_of_a_run(
    template_run: tuple[Path, RunFiles], tmp_path: Path, capsys: pytest.CaptureFixture[str], tally: Any
) -> None:
    template, files = template_run
    assert verify(capsys, str(template))[0] == 0
    undetectable = []
    for target in sorted(snapshot_files(template)):
        for kind, make in DAMAGE_KINDS.items():
            folder = tmp_path / f"{target}-{kind.replace(' ', '-')}"
            copy_run(template, folder)
            before = snapshot_files(folder)
            make(target).apply(folder)
            expected = expected_damage(files, before, folder)
            code, report = verify(capsys, str(folder))
            tally["corruption trials (runs)"] += 1
            if not expected.broken and not expected.marker_damaged:
                # Only deleting the manifest of a step nothing depends on: that is how a
                # step is deleted, and what an interrupted retention leaves; not damage.
                assert kind in ("deleted", "replaced by a directory") and target.endswith(".json"), (target, kind)
                assert code == 0
                undetectable.append(target)
                continue
            assert code == 1, f"{kind} {target} was not caught"
            flagged = {int(p.split(":")[0].split()[1]) for p in report["problems"] if p.startswith("step ")}
            assert flagged == expected.broken, (target, kind, report["problems"])
            assert verify_run(str(folder)) == report["problems"]
    assert sorted(set(undetectable)) == ["step-0000000002.json", "step-0000000005.json"]
