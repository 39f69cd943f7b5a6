"""kill -9 while ``ink.save`` overwrites a file: the file is always a whole, loadable version.

Each kill point starts a process that keeps overwriting one file with new versions, kills
it with SIGKILL at a random moment, then loads the file: it must hold exactly the last
version whose save returned, or the one being saved when the process died (the rename had
happened). Long run: ``INSHRINK_FAULT_KILL_POINTS=250 pytest tests/reliability/test_kill_single_file.py -s``.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import inshrinkerator as ink

from ..helpers import assert_same
from .kill_child import save_until_killed, version_state

KILL_POINTS = int(os.environ.get("INSHRINK_FAULT_KILL_POINTS", "6"))


@pytest.fixture(scope="module")
def forkserver() -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the forkserver start method (POSIX)")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.reliability.kill_child"])
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(sys.modules["__main__"], "__file__", raising=False)
        yield context


def test_kill_9_during_single_file_saves_never_damages_the_file(tmp_path: Path, forkserver: Any, tally: Any) -> None:
    path = tmp_path / "model.ink"
    ink.save(version_state(0), path)
    rng = random.Random(7)
    last = 0
    for point in range(KILL_POINTS):
        # No lock: a process killed while holding one would leave it held, and the read
        # below would wait forever. Only the child writes it; it is read after the child died.
        saves_done = forkserver.Value("q", last, lock=False)
        victim = forkserver.Process(target=save_until_killed, args=(str(path), last + 1, saves_done))
        victim.start()
        target = last + rng.randint(1, 4)
        deadline = time.monotonic() + 60
        while saves_done.value < target and victim.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert victim.is_alive(), f"kill point {point}: the saving process died on its own"
        time.sleep(rng.uniform(0.0, 0.05))  # a random moment inside a later save
        victim.kill()
        victim.join()
        returned = saves_done.value
        state = ink.load(path)
        assert state["version"] in (returned, returned + 1), (state["version"], returned)
        assert_same(state, version_state(state["version"]))
        last = state["version"]
        tally["kill points (single file)"] += 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.ink"]
    # A killed save leaves its hidden temporary (".model.ink.*.tmp") behind; nothing else.
    assert all(name.startswith(".model.ink.") and name.endswith(".tmp") for name in leftovers), leftovers
