"""The cnr policy: per-row adaptive uniform quantization of weights, no delta, everything else exact."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import UniformQuantizeCodec
from inshrinkerator.policies import CheckNRun, resolve_policy

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
    policy = resolve_policy("cnr")
    assert isinstance(policy, CheckNRun) and policy.name == "cnr" and policy.bits == 4


def test_plan_quantizes_large_weights_and_ignores_references() -> None:
    first, second = training_chain(checkpoints=2)
    codecs = planned_codecs(CheckNRun(bits=3), second, base=first)
    assert {key for key, codec in codecs.items() if not codec.lossless} == set(LARGE_WEIGHTS)
    assert codecs["model/0.weight"] == UniformQuantizeCodec(3, True, 50, 0.25)
    assert not any(codec.uses_reference for codec in codecs.values())
    with_moments = planned_codecs(CheckNRun(include_optimizer_state=True), second)
    assert not with_moments["optimizer/state/0/exp_avg"].lossless
    assert with_moments["optimizer/state/0/step"].lossless


def test_end_to_end_every_checkpoint_stands_alone(tmp_path: Path) -> None:
    states = training_chain(checkpoints=3)
    results = save_chain("cnr", states, tmp_path)
    assert [info.kind for info, _ in results] == ["full"] * 3
    for index, (state, (info, loaded)) in enumerate(zip(states, results)):
        assert assert_exact_where_lossless(CheckNRun(), state, loaded) == list(LARGE_WEIGHTS)
        assert_same(ink.load(tmp_path / f"{index}.ink"), loaded)  # no base needed
        for key in LARGE_WEIGHTS:
            rows = state["model"][key.split("/")[1]]
            step = ((rows.amax(1) - rows.amin(1)) / 15).max()
            assert max_error(state, loaded, key) <= float(step)  # within one grid step (clipped tails)


def test_fewer_bits_compress_more(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 256)}
    sizes = [ink.save(state, tmp_path / f"{b}.ink", policy=CheckNRun(bits=b)).stored_bytes for b in (2, 4, 8)]
    assert sizes[0] < sizes[1] < sizes[2]


def test_through_the_checkpoint_manager(tmp_path: Path) -> None:
    states = training_chain(checkpoints=3)
    with ink.CheckpointManager(tmp_path / "run", policy="cnr") as manager:
        for step, state in enumerate(states):
            manager.save(step, state)
        for step, state in enumerate(states):
            loaded = manager.load(step)
            assert_same(loaded["optimizer"], state["optimizer"])
            assert_same(loaded["model"]["1.running_var"], state["model"]["1.running_var"])
            assert loaded["step"] == state["step"]
            assert max_error(state, loaded, "model/3.weight") < 0.05


def test_config_round_trip_and_bad_knobs() -> None:
    policy = CheckNRun(bits=3, search_steps=25, search_range=0.5, per_row=False, include_optimizer_state=True)
    assert CheckNRun(**json.loads(json.dumps(dataclasses.asdict(policy)))) == policy
    for knobs in ({"bits": 9}, {"search_steps": 0}, {"search_range": 1.5}, {"per_row": "no"}, {"min_numel": -1}):
        with pytest.raises(ValueError):
            CheckNRun(**knobs)
