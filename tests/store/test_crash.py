"""Fault test: kill -9 a process at random moments while it saves; nothing committed is lost.

Each kill point starts a process that continues the run (sync or async saves, with
``keep_last`` retention and re-basing), lets it complete a random number of saves, kills
it with SIGKILL at a random moment inside the next one, then checks that every listed step
loads and equals what was saved, that the run verifies, and that no partial step is listed.

The CI run uses a few kill points per mode; set ``INSHRINK_FAULT_KILL_POINTS`` for a long
run (``INSHRINK_FAULT_KILL_POINTS=500 pytest tests/store/test_crash.py -s`` prints a summary).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time

import pytest

from inshrinkerator.store import CheckpointManager, describe_run, verify_run
from inshrinkerator.store.manifest import step_of_data_name
from inshrinkerator.store.storage import is_temporary

from ..helpers import assert_same
from .crash_child import KEEP_LAST, expected_state, save_until_killed

KILL_POINTS = int(os.environ.get("INSHRINK_FAULT_KILL_POINTS", "15"))
CHILD_START_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def forkserver():
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the forkserver start method (POSIX)")
    context = multiprocessing.get_context("forkserver")
    # Each victim forks from a server that already imported torch: ~10 ms, not ~2 s.
    context.set_forkserver_preload(["tests.store.crash_child"])
    with pytest.MonkeyPatch.context() as patch:
        # Otherwise every victim re-imports the test runner's entry script as its __main__
        # (~0.5 s each); the victims need nothing from it.
        patch.delattr(sys.modules["__main__"], "__file__", raising=False)
        yield context


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return False


def _leftovers(run: str) -> list[str]:
    """Files of interrupted writes: temporaries and data files no manifest names."""
    committed = {entry.data_file for entry in describe_run(run)}
    return [
        name for name in os.listdir(run)
        if is_temporary(name) or (step_of_data_name(name) is not None and name not in committed)
    ]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill_9_at_random_moments_never_loses_a_committed_step(tmp_path, forkserver, async_save: bool) -> None:
    run = str(tmp_path / "run")
    rng = random.Random(1000 + async_save)
    saves = planned_saves = committed_total = kills_leaving_debris = 0
    previous_latest = -1
    for point in range(KILL_POINTS):
        # No lock: a process killed while holding one would leave it held, and reading the
        # count after the kill would wait forever. Only the child writes it.
        saves_done = forkserver.Value("i", 0, lock=False)
        target_saves = rng.randint(4, 10)
        planned_saves += target_saves
        victim = forkserver.Process(target=save_until_killed, args=(run, async_save, saves_done))
        victim.start()
        assert _wait_for(lambda: saves_done.value >= target_saves or not victim.is_alive(), CHILD_START_TIMEOUT)
        assert victim.is_alive(), f"kill point {point}: the saving process died on its own"
        time.sleep(rng.uniform(0.0, 0.03))  # a random moment inside the next save
        victim.kill()
        victim.join()
        saves += saves_done.value

        reader = CheckpointManager(run)
        steps = reader.steps()
        assert steps, f"kill point {point}: no step survived"
        for step in steps:
            assert_same(reader.load(step), expected_state(step))
        assert verify_run(run) == [], f"kill point {point}"
        assert steps[-1] >= previous_latest, f"kill point {point}: the latest step went back"
        assert len(steps) <= KEEP_LAST + 1, "retention fell behind by more than the step in flight"
        committed_total += steps[-1] - previous_latest
        previous_latest = steps[-1]
        kills_leaving_debris += bool(_leftovers(run))

    with CheckpointManager(run, keep_last=KEEP_LAST, policy="lossless") as writer:  # a writer cleans up on its first save
        writer.save(previous_latest + 1, expected_state(previous_latest + 1))
    assert _leftovers(run) == []
    assert verify_run(run) == []
    mode = "async" if async_save else "sync"
    print(
        f"\nfault test ({mode}): {KILL_POINTS} kill points, {saves} saves returned, "
        f"{committed_total} steps committed, {kills_leaving_debris} kills left partial files behind"
    )
    assert saves >= planned_saves  # 15 kill points plan 100+ saves per mode
