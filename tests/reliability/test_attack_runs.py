"""The committed corpus of hostile run files: each is refused with the right error, promptly,
nothing else in the run is disturbed, and ``verify_run`` reports it."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import time
from pathlib import Path
from types import ModuleType

import pytest

import inshrinkerator as ink
from inshrinkerator.store import CheckpointManager, verify_run

from ..helpers import assert_same
from .run_damage import READER_ERRORS, step_state

CORPUS = Path(__file__).resolve().parent / "attack_runs"
EXPECTED: dict[str, dict] = json.loads((CORPUS / "expected.json").read_text())
PROMPT_SECONDS = 2.0


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_attack_runs", CORPUS / "make_attack_runs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_corpus_matches_its_script() -> None:
    script = load_script()
    on_disk = {p.name for p in CORPUS.iterdir() if p.is_file()} - {"make_attack_runs.py", "expected.json"}
    assert on_disk == set(EXPECTED) == set(script.corpus())
    for name, (_, target, step, error, pattern, verify) in script.corpus().items():
        assert EXPECTED[name] == {"file": target, "step": step, "error": error, "match": pattern, "verify": verify}


def test_the_base_run_is_sound_and_restores_the_states_it_was_made_from() -> None:
    """The golden run also pins the run format: these files must keep loading."""
    reader = CheckpointManager(CORPUS / "base_run")
    assert reader.steps() == list(range(6))
    for step in range(6):
        assert_same(reader.load(step), step_state(step))
    assert verify_run(str(CORPUS / "base_run")) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attack_is_refused_cleanly(name: str, tmp_path: Path, tally) -> None:
    expected = EXPECTED[name]
    run = tmp_path / "run"
    shutil.copytree(CORPUS / "base_run", run)
    shutil.copyfile(CORPUS / name, run / expected["file"])
    reader = CheckpointManager(run)
    started = time.perf_counter()
    if expected["error"] == "ok":
        assert_same(reader.load(expected["step"]), step_state(expected["step"]))
    else:
        with pytest.raises(READER_ERRORS) as caught:
            reader.load(expected["step"])
        assert type(caught.value).__name__ == expected["error"], str(caught.value)
        assert re.search(expected["match"], str(caught.value)), str(caught.value)
        assert str(run) in str(caught.value), "the message names the run"
    assert time.perf_counter() - started < PROMPT_SECONDS
    assert_same(reader.load(2), step_state(2))  # a chain the attack does not touch
    problems = verify_run(str(run))
    assert any(re.search(expected["verify"], line) for line in problems), problems
    with pytest.raises(ink.FormatError):
        ink.load(run / expected["file"])  # no run file is mistaken for a checkpoint file
    tally["run attack files"] += 1
