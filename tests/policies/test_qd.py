"""The qd policy: entropy-width uniform codes, cyclic code deltas against the previous checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import inshrinkerator as ink
from inshrinkerator.codecs import CyclicCodeDeltaCodec, EntropyWidthQuantizeCodec
from inshrinkerator.codecs.entropy_width_quantize import entropy_bin_count
from inshrinkerator.policies import QDCompressor, resolve_policy

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
    policy = resolve_policy("qd")
    assert isinstance(policy, QDCompressor) and (policy.min_bins, policy.max_bins) == (8, 256)


def test_plan_uses_code_deltas_only_with_a_reference() -> None:
    first, second = training_chain(checkpoints=2)
    alone = planned_codecs(QDCompressor(), first)
    assert alone["model/0.weight"] == EntropyWidthQuantizeCodec(8, 256)
    delta = planned_codecs(QDCompressor(min_bins=16), second, base=first)
    assert delta["model/0.weight"] == CyclicCodeDeltaCodec(16, 256)
    assert {key for key, codec in delta.items() if not codec.lossless} == set(LARGE_WEIGHTS)
    assert delta["optimizer/state/0/exp_avg"].lossless
    with_moments = planned_codecs(QDCompressor(include_optimizer_state=True), second, base=first)
    assert isinstance(with_moments["optimizer/state/0/exp_avg"], CyclicCodeDeltaCodec)


def test_end_to_end_chain_error_stays_one_quantization(tmp_path: Path) -> None:
    states = training_chain(checkpoints=4)
    results = save_chain("qd", states, tmp_path)
    assert [info.kind for info, _ in results] == ["full", "delta", "delta", "delta"]
    previous = None
    for state, (info, loaded) in zip(states, results):
        assert set(assert_exact_where_lossless(QDCompressor(), state, loaded, previous)) == set(LARGE_WEIGHTS)
        for key in LARGE_WEIGHTS:
            weight = state["model"][key.split("/")[1]]
            grid = (weight.max() - weight.min()) / (entropy_bin_count(weight, 8, 256) - 1)
            assert max_error(state, loaded, key) <= float(grid) / 2 * (1 + 1e-5)
        previous = loaded


def test_deltas_store_less_than_standalone_codes(tmp_path: Path) -> None:
    states = training_chain(checkpoints=2, steps_between=1)
    weights = [{"w": s["model"]["0.weight"]} for s in states]
    standalone = ink.save(weights[1], tmp_path / "alone.ink", policy="qd").stored_bytes
    info, _ = save_chain("qd", weights, tmp_path)[1]
    assert info.kind == "delta" and info.stored_bytes < standalone


def test_through_the_checkpoint_manager(tmp_path: Path) -> None:
    states = training_chain(checkpoints=4)
    with ink.CheckpointManager(tmp_path / "run", policy="qd", full_every=2) as manager:
        kinds = [manager.save(step, state).kind for step, state in enumerate(states)]
        assert kinds == ["full", "delta", "full", "delta"]
        for step, state in enumerate(states):
            loaded = manager.load(step)
            assert_same(loaded["optimizer"], state["optimizer"])
            assert loaded["step"] == state["step"] and loaded["config"] == state["config"]
            assert max_error(state, loaded, "model/0.weight") < 0.05


def test_config_round_trip_and_bad_knobs() -> None:
    policy = QDCompressor(min_bins=16, max_bins=64, include_optimizer_state=True, min_numel=100)
    assert QDCompressor(**json.loads(json.dumps(dataclasses.asdict(policy)))) == policy
    for knobs in ({"min_bins": 1}, {"min_bins": 64, "max_bins": 16}, {"max_bins": 1 << 20}, {"min_numel": 0}):
        with pytest.raises(ValueError):
            QDCompressor(**knobs)
