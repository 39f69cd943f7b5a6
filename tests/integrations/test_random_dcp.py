"""Random training states through ``torch.distributed.checkpoint`` with the ink storage.

The states of ``tests/policies/random_states.py`` (random models, dtypes, optimizers,
damage between saves) saved in one process by ``dcp.save`` under a random policy and
loaded by ``dcp.load`` into a blank state of the same structure: the same checks as the
run's random-state test (structure and plain values exact, non-finite values in place,
DynaQuant's errors within its bounds, lossless exact).
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
    variant_lists(),
))
def test_random_states_through_dcp(shot: Shot, tmp_path_factory: Any) -> None:
    folder: Path = tmp_path_factory.mktemp("dcp")
    trainer = Trainer(shot.scenario)
    states = [trainer.train(plan) for plan in shot.scenario.saves]
    state = states[-1]
    dcp.save(state, storage_writer=InkStorageWriter(folder, policy=policy_named(shot.policy, shot.variants)), planner=InkSavePlanner(),
             no_dist=True)
    restored = blank(state)
    dcp.load(restored, storage_reader=InkStorageReader(folder), planner=InkLoadPlanner(), no_dist=True)
    if shot.policy == "lossless":
        assert identical(state, restored)
        return
    found = problems(state, restored, bounded=shot.policy == "dynaquant" and "evaluate" not in shot.variants)
    assert found == [], found
