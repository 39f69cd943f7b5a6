"""Random training states through ``ink.save`` / ``ink.load``, against random bases.

The one-shot API takes any state as ``base=``: the previous state of the same run, the
state itself, a file saved under any policy, or a base that only partly fits (tensors
reshaped, of another dtype, missing, added, holding NaN or ±inf, replaced by a plain
value). Each example trains a random model (``random_states.py``), saves its last state
under a random policy against such a base, and checks:

- the restore against that base keeps the promises of ``test_random_states.py`` (bounded
  errors for DynaQuant, exact for ``lossless``, the structural checks for the baselines);
- a file stored without deltas loads the same without the base; one with deltas refuses
  to load without it (``BrokenChainError``);
- against a wrong base (every float tensor of the right one moved by 1) a file either
  refuses to load (``BrokenChainError``) or restores exactly what the right base gives
  (its deltas did not need the moved tensors): never values decoded against the wrong
  reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import inshrinkerator as ink

from .dynaquant_states import one_thread  # noqa: F401  (autouse fixture)
from .random_states import (
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

BASES = ("none", "earlier", "earlier", "same", "file", "altered", "altered")
ALTERATIONS = ("reshape", "dtype", "drop", "extra", "non-finite", "plain", "zero")


@dataclass(frozen=True)
class OneShot:
    scenario: Scenario
    policy: str
    variants: tuple[str, ...]  # DynaQuant's knobs (``random_states.VARIANTS``)
    base: str  # one of BASES
    base_policy: str  # the policy a "file" base was saved under
    alterations: tuple[tuple[str, int], ...]  # an "altered" base: (what, which tensor)


def one_shots() -> st.SearchStrategy[OneShot]:
    return st.builds(
        OneShot,
        scenario=scenarios(),
        policy=st.sampled_from(POLICIES),
        variants=variant_lists(),
        base=st.sampled_from(BASES),
        base_policy=st.sampled_from(POLICIES),
        alterations=st.lists(st.tuples(st.sampled_from(ALTERATIONS), st.integers(0, 20)), min_size=1, max_size=3).map(tuple),
    )


def altered(base: dict[str, Any], alterations: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    """``base`` with its model's tensors changed so that some no longer fit the state."""
    model = dict(base["model"])
    for what, pick in alterations:
        names = [name for name, value in model.items() if isinstance(value, torch.Tensor) and value.is_floating_point()]
        if not names:
            break
        name = names[pick % len(names)]
        tensor = model[name]
        if what == "reshape":
            model[name] = tensor.reshape(-1) if tensor.dim() != 1 else tensor.reshape(1, -1)
        elif what == "dtype":
            model[name] = tensor.double()
        elif what == "drop":
            del model[name]
        elif what == "extra":
            model[f"{name}.extra"] = torch.randn(7, 3)
        elif what == "non-finite":
            tensor = tensor.clone()
            tensor.view(-1)[0] = float("nan")
            tensor.view(-1)[-1] = float("-inf")
            model[name] = tensor
        elif what == "plain":
            model[name] = 3
        else:
            model[name] = torch.zeros_like(tensor)
    return {**base, "model": model}


def moved(state: Any) -> Any:
    """Every float tensor of ``state`` plus 1: a base that is not the one a file was saved against."""
    if isinstance(state, torch.Tensor):
        return state + 1 if state.is_floating_point() else state
    if isinstance(state, dict):
        return {key: moved(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(moved(value) for value in state)
    return state


def save_against_a_base(shot: OneShot, folder: Path) -> tuple[Any, Any, Any, ink.SaveInfo]:
    """Train, save the last state against the shot's base; (state, base as a state, the
    ``base=`` argument given, what ``save`` returned)."""
    trainer = Trainer(shot.scenario)
    states = [trainer.train(plan) for plan in shot.scenario.saves]
    state, earlier = states[-1], states[0]
    base_state: Any = None
    given_base: Any = None
    if shot.base == "earlier":
        base_state = given_base = earlier
    elif shot.base == "same":
        base_state = given_base = clone(state)
    elif shot.base == "file":
        given_base = folder / "base.ink"
        ink.save(earlier, given_base, policy=shot.base_policy)
        base_state = ink.load(given_base)
    elif shot.base == "altered":
        base_state = given_base = altered(earlier, shot.alterations)
    info = ink.save(state, folder / "state.ink", policy=policy_named(shot.policy, shot.variants), base=given_base)
    return state, base_state, given_base, info


@fuzz_settings(40)
@given(shot=one_shots())
def test_random_states_in_single_files_against_random_bases(shot: OneShot, tmp_path_factory: Any) -> None:
    folder = tmp_path_factory.mktemp("one-shot")
    state, base_state, given_base, info = save_against_a_base(shot, folder)
    path = folder / "state.ink"
    event(f"{shot.policy}: {info.kind}")
    restored = ink.load(path, base=given_base)
    if shot.policy == "lossless":
        assert identical(state, restored)
    else:
        bounded = shot.policy == "dynaquant" and "evaluate" not in shot.variants
        found = problems(state, restored, bounded=bounded)
        assert found == [], found
    assert identical(ink.load(path, base=given_base), restored), "a second load differs"
    if info.kind == "full":
        assert identical(ink.load(path), restored)
        return
    assert base_state is not None
    with pytest.raises(ink.BrokenChainError):
        ink.load(path)
    try:
        against_wrong = ink.load(path, base=moved(base_state))
    except ink.BrokenChainError:
        event("a wrong base refused")
        return
    event("a wrong base not needed")
    assert identical(against_wrong, restored), "decoded against a wrong base"
