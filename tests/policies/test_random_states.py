"""Random training states through ``CheckpointManager``: never a crash, never garbage.

Each example builds a random small model (linear and norm layers, perhaps an embedding, an
output layer tied to it and a convolution; fp32 / bf16 / fp16; some layers frozen), trains
it with a random optimizer (Adam's and SGD's families, RMSprop, Adagrad; learning rates
from 0 to 1; one or two param groups), saves it 2-6 times (synchronously or not; some
saves by a new manager and policy, as after a restart) under a random variant of the
policy, `full_every` and `keep_last`, in a local folder or fsspec's ``memory://`` store,
and between saves damages a weight or an optimizer entry: NaN, ±inf, zeroed, scaled far
beyond its range, or a subnormal value. The run must then verify clean (``verify_run``,
what ``inshrink verify`` reports), and every step retention keeps is restored by a fresh
manager and checked:

- structure, dtypes, shapes, non-float tensors and plain values exactly;
- non-finite values at their positions (infinities exactly, NaN as NaN);
- the finite rest within a bound of the tensor's own size: 0.6 of its norm for weights,
  1.5 for optimizer moments (a pruned moment loses most of its entries by design; an Adam
  first moment stored as a product of its steps keeps the steps ``m / sqrt(v)``, so either
  it or its steps), exactly for tensors of norm zero; second-order statistics (8 log levels over whatever range they
  span) for finiteness and sign only; a policy with ``evaluate`` for finiteness only, since
  the user's metric, not a norm, decides what it may lose.

The baselines (LC-Checkpoint, ExCP, Check-N-Run, QD) take the same states for the checks
that hold whatever a policy's errors: structure, exact non-float values, non-finite values
in place, finite values finite and second-order statistics not negative. Their errors are
the papers': LC-Checkpoint's buckets, for one, round a change to powers of two, so a
weight much smaller than its change (zeroed, then trained a few steps) comes back with an
error many times its own size until a later delta takes it back.

The CI budget is a few dozen states; ``INSHRINK_FUZZ_EXAMPLES=2000 pytest
tests/policies/test_random_states.py`` runs a long campaign.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any, Optional

import fsspec
import pytest
import torch
from hypothesis import given

from .dynaquant_states import one_thread  # noqa: F401  (autouse fixture)
from .random_states import (
    BASELINES,
    LONG,
    Scenario,
    fuzz_settings,
    problems,
    run_through_manager,
    scenarios,
    tensor_problems,
)

#: A long campaign runs for as long as it takes (the suite's per-test timeout is for CI).
pytestmark = [pytest.mark.timeout(0)] if LONG else []


def run(scenario: Scenario, folder: Path, policy: Optional[str] = None) -> dict[int, tuple[Any, Any]]:
    """Train and save as ``scenario`` says, under the policy named ``policy`` (default:
    DynaQuant with the scenario's variants); step -> (state saved, state restored)."""
    if not scenario.in_memory:
        return run_through_manager(scenario, str(folder), policy)
    url = f"memory://random-states/{uuid.uuid4().hex}"
    try:
        return run_through_manager(scenario, url, policy)
    finally:
        fsspec.filesystem("memory").rm(url, recursive=True)


@fuzz_settings(40)
@given(scenario=scenarios())
def test_random_states_restore_within_their_bounds(scenario: Scenario, tmp_path_factory: Any) -> None:
    folder = tmp_path_factory.mktemp("run") / "run"
    for step, (saved, restored) in run(scenario, folder).items():
        found = problems(saved, restored, bounded="evaluate" not in scenario.variants)
        assert found == [], f"step {step}: {found}"


@pytest.mark.parametrize("policy", BASELINES)
@fuzz_settings(10, share=4)
@given(scenario=scenarios())
def test_random_states_through_the_baselines(policy: str, scenario: Scenario, tmp_path_factory: Any) -> None:
    folder = tmp_path_factory.mktemp("run") / "run"
    for step, (saved, restored) in run(scenario, folder, policy).items():
        found = problems(saved, restored, bounded=False)
        assert found == [], f"step {step}: {found}"


def test_the_checks_catch_what_they_guard() -> None:
    """Control: each kind of broken restore is reported."""
    weight = torch.tensor([1.0, -2.0, float("nan"), float("inf")])
    assert tensor_problems("model/w", weight, weight.clone()) == []
    assert tensor_problems("model/w", weight, torch.tensor([1.0, -2.0, 0.0, float("inf")]))
    assert tensor_problems("model/w", weight, torch.tensor([1.0, -2.0, float("nan"), -math.inf]))
    assert tensor_problems("model/w", weight, torch.tensor([-1.0, 2.0, float("nan"), math.inf]))
    assert tensor_problems("model/w", torch.zeros(3), torch.tensor([0.0, 1e-3, 0.0]))
    assert tensor_problems("model/w", weight, weight.half())
    assert tensor_problems("optimizer/state/0/exp_avg_sq", torch.ones(3), torch.tensor([1.0, -1e-9, 1.0]))
    assert tensor_problems("optimizer/state/0/exp_avg_sq", torch.ones(3), torch.full((3,), 40.0)) == []
    assert tensor_problems("optimizer/state/0/exp_avg", torch.ones(3), -torch.ones(3))
    assert tensor_problems("model/w", torch.ones(3), -torch.ones(3), bounded=False) == []
    assert tensor_problems("model/w", torch.ones(3), torch.tensor([1.0, math.nan, 1.0]), bounded=False)
    assert problems({"step": 1, "w": torch.ones(2)}, {"step": 2, "w": torch.ones(2)})
    # A first moment off by 3x its norm is accepted only where its steps m / sqrt(v) are not.
    m, v = torch.ones(4), torch.full((4,), 4.0)
    state = {"optimizer": {"state": {0: {"exp_avg": m, "exp_avg_sq": v}}}}
    scaled = {"optimizer": {"state": {0: {"exp_avg": 4 * m, "exp_avg_sq": 16 * v}}}}
    assert problems(state, scaled) == []
    assert problems(state, {"optimizer": {"state": {0: {"exp_avg": 4 * m, "exp_avg_sq": v}}}})
