"""Policies written as text, as the CLI and CheckpointManager take them."""

from __future__ import annotations

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.bench.policy_specs import build_policy
from inshrinkerator.policies import DynaQuant, LCCheckpoint, Lossless, resolve_policy


def test_a_spec_sets_the_options_it_names_and_leaves_the_rest_at_their_defaults() -> None:
    policy = resolve_policy("dynaquant: tolerance=0.01, bins=64|32, residual_bins=16|, precision_only_grows=false")
    assert policy == DynaQuant(tolerance=0.01, bins=(64, 32), residual_bins=(16,), precision_only_grows=False)
    assert resolve_policy("lc-checkpoint:bits=2") == LCCheckpoint(bits=2)
    assert resolve_policy("lossless:level=none") == Lossless(level=None)
    # A single value for a tuple option is a tuple of one; the plain name is the default.
    assert resolve_policy("dynaquant:bins=64").bins == (64,)
    assert resolve_policy("dynaquant") == DynaQuant()
    assert build_policy("dynaquant:movement_share=0.5") == DynaQuant(movement_share=0.5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown policy 'nope'"),
        ("dynaquant:colour=red", "has no option 'colour'"),
        ("dynaquant:evaluate=f", "has no option 'evaluate'"),  # a function has no text form
        ("dynaquant:name=x", "has no option 'name'"),
        ("dynaquant:tolerance", "is not option=value"),
        ("dynaquant:tolerance=1,tolerance=2", "given twice"),
        ("dynaquant:tolerance=-1", "tolerance must be a number"),
        ("dynaquant:bins=a|b", "bins"),
        ("lc-checkpoint:bits=two", "lc-checkpoint:bits=two"),
    ],
)
def test_a_bad_spec_is_a_value_error_that_says_what_is_wrong(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_policy(spec)


def test_a_manager_and_save_take_a_spec(tmp_path) -> None:
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    coarse = ink.save(state, tmp_path / "coarse.ink", policy="cnr:bits=2,min_numel=16")
    fine = ink.save(state, tmp_path / "fine.ink", policy="cnr:bits=8,min_numel=16")
    assert coarse.policy == fine.policy == "cnr"
    assert coarse.stored_bytes < fine.stored_bytes
    error = {
        name: float((ink.load(tmp_path / f"{name}.ink")["w"] - state["w"]).abs().max()) for name in ("coarse", "fine")
    }
    assert 0 < error["fine"] < error["coarse"]
    with ink.CheckpointManager(tmp_path / "run", policy="dynaquant:tolerance=0.01") as manager:
        assert manager.policy == DynaQuant(tolerance=0.01)
        manager.save(1, state)
        assert manager.load(1).keys() == state.keys()
