"""The lc-checkpoint policy: closed-loop residual exponent buckets on weights, everything else exact."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import inshrinkerator as ink
from inshrinkerator.codecs import ExponentBucketCodec, ResidualCodec
from inshrinkerator.policies import LCCheckpoint, resolve_policy

from ..helpers import assert_same
from .baseline_policy_checks import (
    LARGE_WEIGHTS,
    assert_exact_where_lossless,
    max_error,
    planned_codecs,
    save_chain,
    training_chain,
)


def test_registered_under_its_name() -> None:
    policy = resolve_policy("lc-checkpoint")
    assert isinstance(policy, LCCheckpoint) and policy.name == "lc-checkpoint" and policy.bits == 3


def test_plan_codes_large_weights_as_residuals_only_with_a_reference() -> None:
    first, second = training_chain(checkpoints=2)
    keyframe = planned_codecs(LCCheckpoint(), first)
    assert all(codec.lossless for codec in keyframe.values())
    delta = planned_codecs(LCCheckpoint(bits=2), second, base=first)
    lossy = {key for key, codec in delta.items() if not codec.lossless}
    assert lossy == set(LARGE_WEIGHTS)
    assert delta["model/0.weight"] == ResidualCodec(ExponentBucketCodec(2, "midrange"))
    with_moments = planned_codecs(LCCheckpoint(include_optimizer_state=True), second, base=first)
    assert not with_moments["optimizer/state/0/exp_avg_sq"].lossless
    assert with_moments["optimizer/state/0/step"].lossless


def test_end_to_end_chain_is_exact_where_lossless_and_bounded_elsewhere(tmp_path: Path) -> None:
    states = training_chain(optimizer="sgd", checkpoints=4)
    results = save_chain("lc-checkpoint", states, tmp_path)
    assert [info.kind for info, _ in results] == ["full", "delta", "delta", "delta"]
    previous = None
    for state, (info, loaded) in zip(states, results):
        lossy = assert_exact_where_lossless(LCCheckpoint(), state, loaded, previous)
        assert set(lossy) == (set(LARGE_WEIGHTS) if previous is not None else set())
        for key in lossy:
            update = float((state["model"][key.split("/")[1]] - previous["model"][key.split("/")[1]]).abs().max())
            assert max_error(state, loaded, key) <= update  # never worse than dropping the update
        previous = loaded
    assert results[-1][0].policy == "lc-checkpoint"


def test_fewer_bits_compress_more(tmp_path: Path) -> None:
    states = training_chain(optimizer="sgd", checkpoints=2)
    ratios = []
    for bits in (2, 4, 8):
        stored = 0
        for index, (info, _) in enumerate(save_chain(LCCheckpoint(bits=bits), states, tmp_path / str(bits))):
            stored += info.stored_bytes if index else 0
        ratios.append(stored)
    assert ratios[0] < ratios[1] < ratios[2]


def test_through_the_checkpoint_manager(tmp_path: Path) -> None:
    states = training_chain(checkpoints=4)
    with ink.CheckpointManager(tmp_path / "run", policy="lc-checkpoint", full_every=3) as manager:
        kinds = [manager.save(step, state).kind for step, state in enumerate(states)]
        assert kinds == ["full", "delta", "delta", "full"]
        for step, state in enumerate(states):
            loaded = manager.load(step)
            assert_same(loaded["optimizer"], state["optimizer"])  # LC leaves optimizer state exact
            assert_same(loaded["labels"], state["labels"])
            assert loaded["step"] == state["step"] and loaded["config"] == state["config"]
            assert max_error(state, loaded, "model/0.weight") < 0.05


def test_config_round_trip_and_bad_knobs() -> None:
    policy = LCCheckpoint(bits=4, representative="mean", include_optimizer_state=True, min_numel=10)
    assert LCCheckpoint(**json.loads(json.dumps(dataclasses.asdict(policy)))) == policy
    for knobs in ({"bits": 0}, {"representative": "median"}, {"min_numel": 0}, {"include_optimizer_state": "yes"}):
        with pytest.raises(ValueError):
            LCCheckpoint(**knobs)
