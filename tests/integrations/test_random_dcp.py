"""Random training states through ``torch.distributed.checkpoint`` with the ink storage.

The states of ``tests/policies/random_states.py`` (random models, dtypes, optimizers,
damage between saves) saved in one process by ``dcp.save`` under a random policy and
loaded by ``dcp.load`` into a blank state of the same structure: the same checks as the
run's random-state test (structure and plain values exact, non-finite values in place,
DynaQuant's errors within its bounds, lossless exact). The last state alone, or (with
``keyframes`` > 0) every state of the run, each a checkpoint of its own, through one
``InkKeyframes`` with that ``full_every``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from inshrinkerator.integrations.dcp import (
    InkKeyframes,
    InkLoadPlanner,
    InkSavePlanner,
    InkStorageReader,
    InkStorageWriter,
)
from tests.policies.dynaquant_states import one_thread  # noqa: F401  (autouse fixture)
from tests.policies.random_states import (
    LONG,
    POLICIES,
    Scenario,
    Trainer,
    clone,
    fuzz_settings,
    identical,
    policy_named,
    problems,
    scenarios,
    variant_lists,
)

pytestmark = [pytest.mark.timeout(0)] if LONG else []

@dataclass(frozen=True)
class Shot:
    scenario: Scenario
    policy: str
    variants: tuple[str, ...]
    keyframes: int


def blank(state: Any) -> Any:
    """What ``dcp.load`` fills: ``state``'s structure, tied tensors still tied, every tensor
    zeroed and every number changed."""
    copied = clone(state)
    seen: set[int] = set()

    def wipe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                value.zero_()
            return value
        if isinstance(value, dict):
            return type(value)((key, wipe(item)) for key, item in value.items())
        if isinstance(value, list):
            return [wipe(item) for item in value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -1
        return value

    return wipe(copied)


@fuzz_settings(30)
@given(shot=st.builds(
    Shot, scenarios(), st.sampled_from(POLICIES),
    variant_lists(), st.sampled_from([0, 0, 1, 2, 3]),
))
def test_random_states_through_dcp(shot: Shot, tmp_path_factory: Any) -> None:
    folder: Path = tmp_path_factory.mktemp("dcp")
    trainer = Trainer(shot.scenario)
    policy = policy_named(shot.policy, shot.variants)
    keyframes = InkKeyframes(folder, policy=policy, full_every=shot.keyframes) if shot.keyframes else None
    saved = []
    for index, plan in enumerate(shot.scenario.saves):
        state = trainer.train(plan)
        if keyframes is None and index < len(shot.scenario.saves) - 1:
            continue
        target = folder / f"step-{index}"
        writer = InkStorageWriter(target, keyframes=keyframes) if keyframes else InkStorageWriter(target, policy=policy)
        dcp.save(state, storage_writer=writer, planner=InkSavePlanner(), no_dist=True)
        saved.append((target, clone(state)))
    for target, state in saved:
        restored = blank(state)
        dcp.load(restored, storage_reader=InkStorageReader(target), planner=InkLoadPlanner(), no_dist=True)
        if shot.policy == "lossless":
            assert identical(state, restored)
            continue
        found = problems(state, restored, bounded=shot.policy == "dynaquant" and "evaluate" not in shot.variants)
        assert found == [], (target.name, found)
