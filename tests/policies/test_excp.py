"""The excp policy: weight residuals pruned by the second moment, moments pruned jointly, k-means + LZMA."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import KMeansQuantizeCodec, ResidualCodec
from inshrinkerator.policies import ExCP, Lossless, resolve_policy
from inshrinkerator.policies.excp import weight_prune_multiplier

from ..helpers import assert_same
from .baseline_policy_checks import (
    LARGE_WEIGHTS,
    assert_exact_where_lossless,
    max_error,
    planned_codecs,
    save_chain,
    training_chain,
)


def synthetic_states(second_moment_mean: float, optimizer: str = "adam") -> tuple[dict, dict]:
    """A previous and a current state of one 64x64 weight with hand-made optimizer state."""
    generator = torch.Generator().manual_seed(3)
    previous_weight = torch.randn(64, 64, generator=generator) * 0.05
    weight = previous_weight + torch.randn(64, 64, generator=generator) * 1e-3
    first = torch.randn(64, 64, generator=generator) * 1e-3
    if optimizer == "adam":
        entry = {
            "step": torch.tensor(5.0),
            "exp_avg": first,
            "exp_avg_sq": torch.rand(64, 64, generator=generator) * 2 * second_moment_mean,
        }
    else:
        entry = {"momentum_buffer": first}
    group = {"lr": 1e-3, "params": [0]}

    def state(w: torch.Tensor, entry: dict) -> dict:
        return {"model": {"w": w}, "optimizer": {"state": {0: entry}, "param_groups": [group]}}

    previous_entry = {k: v.clone() * 0.9 for k, v in entry.items()}
    return state(previous_weight, previous_entry), state(weight, entry)


def test_registered_under_its_name() -> None:
    policy = resolve_policy("excp")
    assert isinstance(policy, ExCP) and (policy.bits, policy.alpha, policy.beta) == (4, 5e-5, 2.0)


def test_prune_multiplier_follows_the_official_rule() -> None:
    assert weight_prune_multiplier(torch.full((10,), 1e-8), 5e-5, 2.5) == pytest.approx(0.5)
    assert weight_prune_multiplier(torch.full((10,), 1e-12), 5e-5, 2.5) == 2.5  # capped
    assert weight_prune_multiplier(torch.zeros(10), 5e-5, 2.5) == 2.5
    assert weight_prune_multiplier(None, 5e-5, 2.5) == 0.0


def test_joint_weight_momentum_pruning(tmp_path: Path) -> None:
    alpha = 5e-5
    previous, current = synthetic_states(second_moment_mean=alpha**2)  # multiplier close to 1
    ink.save(previous, tmp_path / "a.ink", policy="lossless")
    base = ink.load(tmp_path / "a.ink")
    ink.save(current, tmp_path / "b.ink", policy="excp", base=base)
    loaded = ink.load(tmp_path / "b.ink", base=base)

    residual = (current["model"]["w"] - base["model"]["w"]).abs()
    second = current["optimizer"]["state"][0]["exp_avg_sq"]
    threshold = residual.median() * min(2.5, alpha / math.sqrt(float(second.double().mean())))
    kept = residual > threshold
    assert 0.3 < kept.float().mean() < 0.7
    changed = loaded["model"]["w"] != base["model"]["w"]
    assert torch.equal(changed, kept)  # pruned residuals leave the weight at its reference

    first = current["optimizer"]["state"][0]["exp_avg"]
    moment_mask = (first.abs() > 2.0 * first.abs().mean()) & kept
    restored = loaded["optimizer"]["state"][0]
    assert torch.equal(restored["exp_avg"] != 0, moment_mask)
    assert torch.equal(restored["exp_avg_sq"] != 0, moment_mask)  # the same mask on both moments
    assert torch.all(restored["exp_avg_sq"][moment_mask] > 0)
    assert torch.unique(restored["exp_avg"]).numel() <= 16  # 15 centres + zero
    assert_same(restored["step"], current["optimizer"]["state"][0]["step"])


def test_sgd_momentum_without_second_moment_keeps_every_residual(tmp_path: Path) -> None:
    previous, current = synthetic_states(0.0, optimizer="sgd")
    codecs = planned_codecs(ExCP(), current, base=previous)
    ink.save(current, tmp_path / "b.ink", policy="excp", base=previous)
    loaded = ink.load(tmp_path / "b.ink", base=previous)
    assert isinstance(codecs["model/w"], ResidualCodec)
    assert torch.all(loaded["model"]["w"] != previous["model"]["w"])
    momentum = current["optimizer"]["state"][0]["momentum_buffer"]
    restored = loaded["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(restored != 0, momentum.abs() > 2.0 * momentum.abs().mean())


def test_first_checkpoint_keeps_weights_exact_and_still_compresses_moments(tmp_path: Path) -> None:
    state = training_chain(checkpoints=1)[0]
    codecs = planned_codecs(ExCP(), state)
    assert all(codecs[key].lossless for key in LARGE_WEIGHTS)
    assert isinstance(codecs["optimizer/state/0/exp_avg"], KMeansQuantizeCodec)
    info = ink.save(state, tmp_path / "a.ink", policy="excp")
    loaded = ink.load(tmp_path / "a.ink")
    assert_same(loaded["model"], state["model"])
    assert info.ratio > ink.save(state, tmp_path / "b.ink", policy=Lossless()).ratio


def test_end_to_end_chain(tmp_path: Path) -> None:
    states = training_chain(checkpoints=3)
    results = save_chain("excp", states, tmp_path)
    previous = None
    for state, (info, loaded) in zip(states, results):
        lossy = assert_exact_where_lossless(ExCP(), state, loaded, previous)
        assert "optimizer/state/0/exp_avg_sq" in lossy and "optimizer/state/0/step" not in lossy
        if previous is not None:
            assert set(LARGE_WEIGHTS) <= set(lossy)
            for key in LARGE_WEIGHTS:
                assert max_error(state, loaded, key) < 0.02
        previous = loaded
    lossless = sum(ink.save(s, tmp_path / "l.ink").stored_bytes for s in states[1:])
    assert sum(info.stored_bytes for info, _ in results[1:]) < lossless / 3


def test_through_the_checkpoint_manager(tmp_path: Path) -> None:
    states = training_chain(checkpoints=3)
    with ink.CheckpointManager(tmp_path / "run", policy=ExCP(lzma_preset=1), full_every=2) as manager:
        kinds = [manager.save(step, state).kind for step, state in enumerate(states)]
        assert kinds == ["full", "delta", "full"]
        for step, state in enumerate(states):
            loaded = manager.load(step)
            assert_same(loaded["labels"], state["labels"])
            assert loaded["step"] == state["step"] and loaded["config"] == state["config"]
            assert_same(loaded["optimizer"]["param_groups"], state["optimizer"]["param_groups"])
            assert max_error(state, loaded, "model/0.weight") < 0.02


def test_config_round_trip_and_bad_knobs() -> None:
    policy = ExCP(bits=3, alpha=1e-4, beta=1.5, prune_cap=2.0, kmeans_iterations=10, lzma_preset=6, min_numel=64)
    assert ExCP(**json.loads(json.dumps(dataclasses.asdict(policy)))) == policy
    for knobs in ({"bits": 0}, {"alpha": -1.0}, {"beta": float("inf")}, {"lzma_preset": 10}, {"min_numel": 0}):
        with pytest.raises(ValueError):
            ExCP(**knobs)


def test_moments_join_their_own_weights_masks_under_a_decay_split(tmp_path: Path) -> None:
    # A frozen layer, then a trained one of the same shape, with AdamW's decay / no-decay
    # groups (matrices, then vectors): in parameter order the trained layer's moments would
    # meet the frozen layer, whose residual is all zero, and be pruned away entirely.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    trained = list(model[1].parameters())
    optimizer = torch.optim.AdamW([{"params": [trained[0]]}, {"params": [trained[1]], "weight_decay": 0.0}])

    def train(steps: int) -> dict:
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(16, 64)).pow(2).mean().backward()
            optimizer.step()
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    ink.save(train(5), tmp_path / "a.ink", policy="lossless")
    base = ink.load(tmp_path / "a.ink")
    current = train(5)
    ink.save(current, tmp_path / "b.ink", policy="excp", base=base)
    loaded = ink.load(tmp_path / "b.ink", base=base)
    kept = loaded["model"]["1.weight"] != base["model"]["1.weight"]  # residuals the weight kept
    first = current["optimizer"]["state"][0]["exp_avg"]
    restored = loaded["optimizer"]["state"][0]["exp_avg"]
    assert bool((restored != 0).any())
    assert torch.equal(restored != 0, (first.abs() > 2.0 * first.abs().mean()) & kept)
