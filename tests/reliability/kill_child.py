"""The process the single-file kill test kills: it overwrites one ``.ink`` file until killed.

Kept importable (no test functions) so a forkserver can preload it with torch.
"""

from __future__ import annotations

from typing import Any

import torch

import inshrinkerator as ink

#: Saves of a child that is never killed (a safety stop).
MAX_SAVES = 5000


def version_state(version: int) -> dict[str, Any]:
    """What the file holds after save number ``version``: 1.5 MiB of weights, a counter."""
    generator = torch.Generator().manual_seed(version)
    return {"weight": torch.randn(3 << 17, generator=generator), "version": version}


def save_until_killed(path: str, first: int, saves_done: Any) -> None:
    torch.set_num_threads(1)
    for version in range(first, first + MAX_SAVES):
        ink.save(version_state(version), path)
        saves_done.value = version  # a lock-free shared value (see the test)
