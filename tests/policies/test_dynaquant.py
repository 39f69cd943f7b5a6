"""The DynaQuant policy: what it stores how, the search it runs, and runs through the manager."""

from __future__ import annotations

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import DynaQuantCodec, DynaQuantDeltaCodec, FactoredMomentCodec
from inshrinkerator.policies import DynaQuant, resolve_policy
from inshrinkerator.tree import flatten, format_key_path

from ..helpers import assert_same
from .dynaquant_states import (  # noqa: F401 - one_thread: autouse
    by_key,
    codecs_and_bytes,
    level_count,
    one_thread,
    train_steps,
    trained_states,
)


def test_knobs_are_checked() -> None:
    for options in (
        {"tolerance": 0}, {"bins": ()}, {"bins": (0,)}, {"prune": (1.5,)}, {"stickiness": -1},
        {"moment_bins": 0}, {"min_numel": True}, {"evaluate": 3}, {"sigma": 2.0}, {"second_moment": "none"},
        {"movement_share": 0}, {"movement_share": "0.1"}, {"moment_min_numel": 0},
    ):
        with pytest.raises(ValueError):
            DynaQuant(**options)
    assert isinstance(resolve_policy("dynaquant"), DynaQuant)
    assert ink.policies.DynaQuant is DynaQuant


def test_each_tensor_gets_the_codec_of_its_role() -> None:
    _, (state,) = trained_states(1)
    policy = DynaQuant()
    flat = flatten(state)
    codecs = policy.plan(flat.tensors, [None] * len(flat.tensors))
    by_path = {format_key_path(leaf.path): codec for leaf, codec in zip(flat.tensors, codecs)}
    assert isinstance(by_path["model/3.weight"], DynaQuantCodec) and not by_path["model/3.weight"].uses_reference
    assert by_path["optimizer/state/2/exp_avg_sq"].domain == "log"
    factored = DynaQuant(second_moment="factored").plan(flat.tensors, [None] * len(flat.tensors))
    paths = [format_key_path(leaf.path) for leaf in flat.tensors]
    assert isinstance(factored[paths.index("optimizer/state/2/exp_avg_sq")], FactoredMomentCodec)
    # A whole first moment (5 steps in) may be a low-rank product plus what it leaves.
    assert level_count(by_path["optimizer/state/2/exp_avg"]) == policy.moment_bins
    assert by_path["model/0.bias"].lossless  # small tensors stay exact
    assert all(codec.lossless for path, codec in by_path.items() if path.endswith("/step"))


def test_save_load_keeps_structure_and_everything_exact_that_must_be(tmp_path) -> None:
    _, (state,) = trained_states(1)
    info = ink.save(state, tmp_path / "one.ink", policy="dynaquant")
    loaded = ink.load(tmp_path / "one.ink")
    assert info.ratio > 5
    assert_same(loaded["step"], state["step"])
    assert_same(loaded["optimizer"]["param_groups"], state["optimizer"]["param_groups"])
    for key, value in state["optimizer"]["state"].items():
        assert_same(loaded["optimizer"]["state"][key]["step"], value["step"])
        assert torch.all(loaded["optimizer"]["state"][key]["exp_avg_sq"] >= 0)
    weight, restored = state["model"]["3.weight"], loaded["model"]["3.weight"]
    assert float((weight - restored).norm() / weight.norm()) < 0.2


def test_manager_chain_is_closed_loop_and_searches_then_refines(tmp_path) -> None:
    model, states = trained_states(4)
    policy = DynaQuant()
    with ink.CheckpointManager(tmp_path / "run", policy=policy, full_every=10) as manager:
        manager.watch(model)
        infos = [manager.save(5 * index, state) for index, state in enumerate(states)]
    assert [info.kind for info in infos] == ["full", "delta", "delta", "delta"]
    assert sum(i.stored_bytes for i in infos[1:]) < 3 * infos[0].stored_bytes
    kinds = [record.kind for record in policy.search_log]
    assert kinds[0] == "guided" and set(kinds[1:]) <= {"neighbourhood", "neighbourhood+exhaustive"}
    assert all(record.evaluations >= 1 and record.feasible for record in policy.search_log)
    assert all(record.quality <= policy.tolerance for record in policy.search_log)
    # A fresh reader decodes every step of the chain; each is one quantization away from
    # the truth (closed loop), however deep in the chain.
    reader = ink.CheckpointManager(tmp_path / "run")
    errors = []
    for index, state in enumerate(states):
        loaded, truth = by_key(reader.load(5 * index)), by_key(state)
        errors.append(float((loaded["model/3.weight"] - truth["model/3.weight"]).norm() / truth["model/3.weight"].norm()))
    assert max(errors) < 0.2 and errors[-1] < 2 * errors[0] + 0.02
    assert abs(policy.entropy_stats.payload_overhead) < 0.05


def _tensors_held_by(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through attributes, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    else:
        children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    return [t for child in children for t in _tensors_held_by(child, seen)]


def test_the_policy_holds_no_large_tensor_between_saves(tmp_path) -> None:
    # What an unwatched policy keeps from one save to the next (levels to warm-start from,
    # bin counts) is small; the encoders' inputs (sketch keys, histograms, masks) are
    # dropped, or a large model's state would be held again, in int32, between saves.
    # The one exception is deliberate: the errors the weights carry (carry_error), in
    # bfloat16, one per lossy weight; without the option nothing large is held.
    model, states = trained_states(2)
    for carry in (False, True):
        policy = DynaQuant(carry_error=4.0 if carry else 0.0)
        with ink.CheckpointManager(tmp_path / f"run-{carry}", policy=policy) as manager:
            for index, state in enumerate(states):
                manager.save(index, state)
                carried = _tensors_held_by(policy._memory.carried)
                held = [
                    tuple(t.shape) for t in _tensors_held_by(policy)
                    if t.numel() > 2048 and not any(t is c for c in carried)
                ]
                assert held == [], f"after save {index}"
                assert all(t.dtype == torch.bfloat16 for t in carried)
                assert bool(carried) == carry


def test_watched_gradients_add_the_sensitivity_metric(tmp_path) -> None:
    model, states = trained_states(1)
    policy = DynaQuant()
    policy.watch(model)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    train_steps(model, optimizer, 2, start=100)
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    policy.plan(flat.tensors, [None] * len(flat.tensors))
    assert policy.search_log[-1].feasible


def test_deltas_use_the_reference() -> None:
    _, states = trained_states(2)
    first, second = flatten(states[0]), flatten(states[1])
    policy = DynaQuant()
    policy.plan(first.tensors, [None] * len(first.tensors))
    references = [leaf.tensor for leaf in first.tensors]
    codecs = policy.plan(second.tensors, references)
    by_path = {format_key_path(leaf.path): codec for leaf, codec in zip(second.tensors, codecs)}
    assert isinstance(by_path["model/3.weight"], DynaQuantDeltaCodec)
    assert isinstance(by_path["optimizer/state/2/exp_avg_sq"], DynaQuantDeltaCodec)
    assert not by_path["optimizer/state/2/exp_avg"].uses_reference


def test_a_tensor_equal_to_its_reference_is_stored_as_it_exactly(tmp_path) -> None:
    # A fine-tune's frozen layers saved against the pretrained base: no bytes, no error.
    generator = torch.Generator().manual_seed(0)
    base = {"frozen": torch.randn(256, 64, generator=generator), "tuned": torch.randn(256, 64, generator=generator)}
    tuned = {"frozen": base["frozen"].clone(), "tuned": base["tuned"] + 1e-2 * torch.randn(256, 64, generator=generator)}
    ink.save(tuned, tmp_path / "t.ink", policy="dynaquant", base=base)
    stored = codecs_and_bytes(tmp_path / "t.ink")
    assert stored["frozen"] == ("unchanged", 0)
    assert stored["tuned"][0] != "unchanged"
    assert torch.equal(ink.load(tmp_path / "t.ink", base=base)["frozen"], base["frozen"])
    # Equal values in other bits (a zero of the other sign) are not the reference.
    plus, minus = base["frozen"].clone(), base["frozen"].clone()
    plus[3, 3], minus[3, 3] = 0.0, -0.0
    ink.save({"frozen": plus}, tmp_path / "z.ink", policy="dynaquant", base={"frozen": minus})
    assert codecs_and_bytes(tmp_path / "z.ink")["frozen"][0] != "unchanged"


