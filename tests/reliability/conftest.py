from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path

import pytest

from .run_damage import RunFiles, build_run

#: Figures the reliability tests count (inputs fuzzed, trials, losses); printed at the end
#: of the session with ``-s`` so a long run (``INSHRINK_FUZZ_EXAMPLES=...``) reports them.
TALLY: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="session")
def tally() -> Iterator[collections.Counter[str]]:
    yield TALLY
    if TALLY:
        print("\nreliability figures: " + ", ".join(f"{key} {value}" for key, value in sorted(TALLY.items())))


@pytest.fixture(scope="session")
def template_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunFiles]:
    """A lossless run of steps 0..5 (full_every=3) that tests copy before damaging."""
    folder = tmp_path_factory.mktemp("template") / "run"
    return folder, build_run(folder)
