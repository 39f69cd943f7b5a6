"""The process the fault test kills: it saves consecutive steps to a run until killed.

Kept importable (no test functions) so a forkserver can preload it together with torch,
which makes starting each victim process cheap.
"""

from __future__ import annotations

from typing import Any

import torch

from inshrinkerator.store import CheckpointManager

from .support import state_for

#: Saves of a child that is never killed (a safety stop).
MAX_SAVES = 5000
NUMEL = 1 << 12
FULL_EVERY = 4
KEEP_LAST = 5


def expected_state(step: int) -> dict[str, Any]:
    return state_for(step, numel=NUMEL)


def save_until_killed(url: str, async_save: bool, saves_done: Any) -> None:
    """Open the run, continue it from its latest step, count every ``save`` that returned."""
    torch.set_num_threads(1)
    mgr = CheckpointManager(url, full_every=FULL_EVERY, keep_last=KEEP_LAST, async_save=async_save, policy="lossless")
    latest = mgr.latest_step()
    step = 0 if latest is None else latest + 1
    for _ in range(MAX_SAVES):
        mgr.save(step, expected_state(step))
        saves_done.value += 1  # a lock-free shared value, written by this process only
        step += 1
    mgr.close()
