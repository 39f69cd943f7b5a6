"""The DynaQuant policy: what it stores how, the search it runs, and runs through the manager."""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import DynaQuantCodec, DynaQuantDeltaCodec, DynaQuantGroupedCodec, FactoredMomentCodec
from inshrinkerator.policies import DynaQuant, resolve_policy
from inshrinkerator.tree import flatten, format_key_path

from ..helpers import assert_same, encode_planned


@pytest.fixture(autouse=True)
def _one_thread():
    # Many small tensor ops: a second OpenMP thread only adds contention on a busy machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10),
    )


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(16, 1, 8, 8, generator=generator)
        y = torch.randint(0, 10, (16,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _states(count: int, optimizer: str = "adam") -> tuple[torch.nn.Module, list[dict]]:
    model = _model()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    else:  # "adam", or "adam95": beta2 = 0.95, as large language models are trained
        opt = torch.optim.Adam(model.parameters(), 1e-3, betas=(0.9, 0.95 if optimizer == "adam95" else 0.999))
    states = []
    for index in range(count):
        _train(model, opt, 5, start=5 * index)
        states.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 5 * index}))
    return model, states


def _by_key(state) -> dict[str, torch.Tensor]:
    return {format_key_path(leaf.path): leaf.tensor for leaf in flatten(state).tensors}


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
    _, (state,) = _states(1)
    policy = DynaQuant()
    flat = flatten(state)
    codecs = policy.plan(flat.tensors, [None] * len(flat.tensors))
    by_path = {format_key_path(leaf.path): codec for leaf, codec in zip(flat.tensors, codecs)}
    assert isinstance(by_path["model/3.weight"], DynaQuantCodec) and not by_path["model/3.weight"].uses_reference
    assert by_path["optimizer/state/2/exp_avg_sq"].domain == "log"
    factored = DynaQuant(second_moment="factored").plan(flat.tensors, [None] * len(flat.tensors))
    paths = [format_key_path(leaf.path) for leaf in flat.tensors]
    assert isinstance(factored[paths.index("optimizer/state/2/exp_avg_sq")], FactoredMomentCodec)
    assert by_path["optimizer/state/2/exp_avg"].bins == policy.moment_bins
    assert by_path["model/0.bias"].lossless  # small tensors stay exact
    assert all(codec.lossless for path, codec in by_path.items() if path.endswith("/step"))


def test_the_moments_of_small_weights_are_quantized_but_not_the_weights() -> None:
    _, (state,) = _states(1)
    flat = flatten(state)
    paths = [format_key_path(leaf.path) for leaf in flat.tensors]
    by_path = dict(zip(paths, DynaQuant().plan(flat.tensors, [None] * len(flat.tensors))))
    # the last layer's weight has 320 values: under min_numel, over moment_min_numel
    assert by_path["model/5.weight"].lossless
    assert isinstance(by_path["optimizer/state/4/exp_avg"], DynaQuantCodec)
    assert by_path["optimizer/state/4/exp_avg_sq"].domain == "log"
    # its bias's 10 values are under both
    assert by_path["optimizer/state/5/exp_avg"].lossless and by_path["optimizer/state/5/exp_avg_sq"].lossless
    exact = dict(zip(paths, DynaQuant(moment_min_numel=1024).plan(flat.tensors, [None] * len(flat.tensors))))
    assert exact["optimizer/state/4/exp_avg"].lossless and exact["optimizer/state/4/exp_avg_sq"].lossless
    # their bytes are mostly the record and the level table: twice the levels cost little
    assert by_path["optimizer/state/4/exp_avg"].bins == 2 * by_path["optimizer/state/2/exp_avg"].bins
    assert by_path["optimizer/state/4/exp_avg_sq"].bins == 2 * by_path["optimizer/state/2/exp_avg_sq"].bins


def test_the_first_moments_of_small_weights_are_not_pruned(tmp_path) -> None:
    _, (state,) = _states(1)
    ink.save(state, tmp_path / "m.ink", policy=DynaQuant(first_moment_keep=0.1, first_moment_keep_after=0))
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"]
    m = state["optimizer"]["state"][4]["exp_avg"]
    assert float((loaded[2]["exp_avg"] != 0).float().mean()) < 0.13  # the large weight's: pruned
    # the small weight's: only entries nearer 0 than the smallest level become 0
    assert float(m.abs()[loaded[4]["exp_avg"] != 0].sum() / m.abs().sum()) > 0.9


def test_save_load_keeps_structure_and_everything_exact_that_must_be(tmp_path) -> None:
    _, (state,) = _states(1)
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
    model, states = _states(4)
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
        loaded, truth = _by_key(reader.load(5 * index)), _by_key(state)
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
    model, states = _states(2)
    policy = DynaQuant()
    with ink.CheckpointManager(tmp_path / "run", policy=policy) as manager:
        for index, state in enumerate(states):
            manager.save(index, state)
            held = [tuple(t.shape) for t in _tensors_held_by(policy) if t.numel() > 2048]
            assert held == [], f"after save {index}"


def test_user_evaluate_decides_and_tolerance_trades_size_for_quality() -> None:
    _, (state,) = _states(1)
    reference = state["model"]["3.weight"].clone()
    calls = []

    def evaluate(model_state: dict[str, torch.Tensor]) -> float:
        calls.append(sorted(model_state))
        return 1.0 + float((model_state["3.weight"] - reference).norm() / reference.norm())

    flat = flatten(state)
    chosen = []
    for tolerance in (0.1, 0.5):
        policy = DynaQuant(tolerance=tolerance, evaluate=evaluate)
        policy.plan(flat.tensors, [None] * len(flat.tensors))
        record = policy.search_log[-1]
        assert record.feasible and record.quality <= tolerance
        chosen.append(record.config["bins"] * (1 - record.config["prune"]))
    assert chosen[0] > chosen[1]
    assert calls and "3.weight" in calls[0] and "0.bias" in calls[0]


def test_evaluate_gets_every_key_of_a_model_with_tied_weights() -> None:
    # A language model's output layer shares the embedding's tensor: its state_dict holds
    # it under both keys, and a strict load_state_dict wants both.
    def language_model() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 256))
        model[2].weight = model[0].weight
        return model

    torch.manual_seed(0)
    model, scratch = language_model(), language_model()
    tokens = torch.randint(256, (8, 16), generator=torch.Generator().manual_seed(1))

    def evaluate(model_state: dict[str, torch.Tensor]) -> float:
        scratch.load_state_dict(model_state)  # strict
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(scratch(tokens).reshape(-1, 256), tokens.reshape(-1)))

    state = {"model": model.state_dict(), "step": 1}
    flat = flatten(state)
    assert [leaf.aliases for leaf in flat.tensors if leaf.path == ("model", "0.weight")] == [(("model", "2.weight"),)]
    policy = DynaQuant(evaluate=evaluate, tolerance=0.05)
    codecs = dict(zip((format_key_path(leaf.path) for leaf in flat.tensors), policy.plan(flat.tensors, [None] * len(flat.tensors))))
    assert policy.search_log[-1].feasible and not codecs["model/0.weight"].lossless


def test_evaluate_cannot_spend_what_a_frozen_or_moved_weight_may_lose() -> None:
    # An evaluate blind to a weight (a head that is not trained yet hides the encoder) would
    # let the search prune and coarsen it at will; a frozen weight keeps its error for good,
    # and a moved one loses its training at a restore. Both stay within their own budgets.
    model, state = _two_layer_state(frozen_first=True)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    blind = DynaQuant(evaluate=lambda model_state: 1.0, frozen_tolerance=1e-3)
    blind.watch(model)
    trained = flat.tensors[keys.index("model/2.weight")].tensor
    reference = trained + 0.1 * trained.std() * torch.randn(trained.shape, generator=torch.Generator().manual_seed(5))
    references = [reference if key == "model/2.weight" else None for key in keys]
    codecs = dict(zip(keys, blind.plan(flat.tensors, references)))
    assert blind.search_log[-1].feasible

    def relative_error(key: str, ref=None) -> float:
        tensor = flat.tensors[keys.index(key)].tensor
        restored = codecs[key].encode(tensor, ref).reconstruction
        return float((restored - tensor).pow(2).sum() / tensor.pow(2).sum())

    assert relative_error("model/0.weight") <= 1e-3  # frozen: its own budget, not "anything goes"
    moved = float((trained - reference).pow(2).sum() / trained.pow(2).sum())
    assert relative_error("model/2.weight", reference) <= blind.movement_share * moved
    # The search still goes as far as those budgets allow: coarser than the proxy's default.
    proxy = DynaQuant(frozen_tolerance=1e-3)
    proxy.watch(model)
    proxy.plan(flat.tensors, references)
    assert blind.search_log[-1].config["prune"] >= proxy.search_log[-1].config["prune"]


def test_nothing_feasible_keeps_the_weights_exact() -> None:
    _, (state,) = _states(1)
    policy = DynaQuant(evaluate=lambda model_state: float(torch.rand(1)) + 10.0, tolerance=1e-9)
    flat = flatten(state)
    codecs = policy.plan(flat.tensors, [None] * len(flat.tensors))
    weights = [c for leaf, c in zip(flat.tensors, codecs) if leaf.path[0] == "model"]
    assert all(codec.lossless for codec in weights)
    assert policy.search_log[-1].feasible is False


def test_watched_gradients_add_the_sensitivity_metric(tmp_path) -> None:
    model, states = _states(1)
    policy = DynaQuant()
    policy.watch(model)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    _train(model, optimizer, 2, start=100)
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    policy.plan(flat.tensors, [None] * len(flat.tensors))
    assert policy.search_log[-1].feasible


def test_sgd_momentum_is_quantized_too(tmp_path) -> None:
    _, (state,) = _states(1, optimizer="sgd")
    flat = flatten(state)
    codecs = DynaQuant().plan(flat.tensors, [None] * len(flat.tensors))
    by_path = {format_key_path(leaf.path): codec for leaf, codec in zip(flat.tensors, codecs)}
    assert isinstance(by_path["optimizer/state/2/momentum_buffer"], DynaQuantCodec)
    ink.save(state, tmp_path / "sgd.ink", policy="dynaquant")
    assert ink.load(tmp_path / "sgd.ink")["optimizer"]["state"][2]["momentum_buffer"].shape == (32, 512)


def test_deltas_use_the_reference() -> None:
    _, states = _states(2)
    first, second = flatten(states[0]), flatten(states[1])
    policy = DynaQuant()
    policy.plan(first.tensors, [None] * len(first.tensors))
    references = [leaf.tensor for leaf in first.tensors]
    codecs = policy.plan(second.tensors, references)
    by_path = {format_key_path(leaf.path): codec for leaf, codec in zip(second.tensors, codecs)}
    assert isinstance(by_path["model/3.weight"], DynaQuantDeltaCodec)
    assert isinstance(by_path["optimizer/state/2/exp_avg_sq"], DynaQuantDeltaCodec)
    assert not by_path["optimizer/state/2/exp_avg"].uses_reference


def test_first_moments_keep_the_steadiest_entries(tmp_path) -> None:
    _, (state,) = _states(1)
    ink.save(state, tmp_path / "m.ink", policy=DynaQuant(first_moment_keep=0.1, first_moment_keep_after=0))
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"][2]
    m, v = state["optimizer"]["state"][2]["exp_avg"], state["optimizer"]["state"][2]["exp_avg_sq"]
    kept = loaded["exp_avg"] != 0
    assert 0.07 < float(kept.float().mean()) < 0.13
    score = m.abs() / (v.sqrt() + 1e-8)
    cut = float(torch.quantile(score.flatten(), 0.9))
    assert float(score[kept].min()) >= 0.95 * cut  # nothing below the score cut survives
    # ... and above it only the entries nearer 0 than the smallest level become 0
    assert float(kept[score >= cut].float().mean()) > 0.75
    ink.save(state, tmp_path / "all.ink", policy=DynaQuant())
    restored = ink.load(tmp_path / "all.ink")["optimizer"]["state"][2]["exp_avg"]
    # A full checkpoint prunes nothing by default: only entries nearer 0 than the smallest
    # level become 0.
    assert float(m.abs()[restored != 0].sum() / m.abs().sum()) > 0.8
    sgd = _states(1, optimizer="sgd")[1][0]
    ink.save(sgd, tmp_path / "s.ink", policy=DynaQuant(momentum_keep=0.3, first_moment_keep_after=0))
    buffer = ink.load(tmp_path / "s.ink")["optimizer"]["state"][2]["momentum_buffer"]
    assert 0.25 < float((buffer != 0).float().mean()) < 0.35


def test_frozen_weights_get_the_tighter_budget() -> None:
    model, _ = _states(1)
    model[0].weight.requires_grad_(False)
    policy = DynaQuant(tolerance=0.01, frozen_tolerance=0.0001)
    policy.watch(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    _train(model, optimizer, 2, start=50)
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    from inshrinkerator.policies.state_layout import TensorRole, layout_of

    layout = layout_of(flat.tensors)
    weights = [i for i in layout.indices(TensorRole.WEIGHT) if flat.tensors[i].tensor.numel() >= policy.min_numel]
    frozen, _ = policy._frozen(flat.tensors, layout, weights)
    assert [format_key_path(flat.tensors[i].path) for i in frozen] == []  # conv weight is small
    model[3].weight.requires_grad_(False)  # read at the save: no need to watch again
    frozen, vouched = policy._frozen(flat.tensors, layout, weights)
    assert [format_key_path(flat.tensors[i].path) for i in frozen] == ["model/3.weight"]
    assert vouched == set(frozen)


def test_weights_the_watch_does_not_know_are_judged_by_their_optimizer_state() -> None:
    # A second model in the state (only one watched), or a watched model since replaced:
    # the watch cannot say whether their weights train, so, as when nothing is watched, a
    # weight with optimizer state trains (it used to count as frozen and stay on its levels).
    from inshrinkerator.policies.state_layout import TensorRole, layout_of

    watched, _ = _two_layer_state(frozen_first=False)
    other = torch.nn.Sequential(torch.nn.Identity(), *_two_layer_state(frozen_first=False)[0])  # other names
    optimizer = torch.optim.Adam([*watched.parameters(), *other.parameters()], 1e-3)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    (watched(x).pow(2).mean() + other(x).pow(2).mean()).backward()
    optimizer.step()
    policy = DynaQuant()
    policy.watch(watched)
    watched[2].requires_grad_(False)
    flat = flatten({"a": watched.state_dict(), "b": other.state_dict(), "optimizer": optimizer.state_dict()})
    layout = layout_of(flat.tensors)
    weights = [i for i in layout.indices(TensorRole.WEIGHT) if flat.tensors[i].tensor.numel() >= policy.min_numel]
    assert len(weights) == 4

    def named(indices) -> list[str]:
        return sorted(format_key_path(flat.tensors[i].path) for i in indices)

    frozen, vouched = policy._frozen(flat.tensors, layout, weights)
    assert named(frozen) == named(vouched) == ["a/2.weight"]  # the watch knows only model a
    # Rebuilt in the same process (after a restore, say) without watching the new model:
    # the watched parameters are gone, and every weight of the new state has optimizer state.
    del watched, other, optimizer, flat
    gc.collect()
    rebuilt, _ = _two_layer_state(frozen_first=False)
    optimizer = torch.optim.Adam(rebuilt.parameters(), 1e-3)
    rebuilt(x).pow(2).mean().backward()
    optimizer.step()
    flat = flatten({"a": rebuilt.state_dict(), "optimizer": optimizer.state_dict()})
    layout = layout_of(flat.tensors)
    weights = [i for i in layout.indices(TensorRole.WEIGHT) if flat.tensors[i].tensor.numel() >= policy.min_numel]
    assert len(weights) == 2 and policy._frozen(flat.tensors, layout, weights) == ([], set())


def _two_layer_state(frozen_first: bool) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    if frozen_first:
        model[0].requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_a_weight_that_cannot_meet_its_budget_is_stored_exactly_and_the_others_quantized() -> None:
    model, state = _two_layer_state(frozen_first=True)
    policy = DynaQuant(frozen_tolerance=1e-9)  # no grid point reaches it
    policy.watch(model)
    flat = flatten(state)
    codecs = dict(zip((format_key_path(leaf.path) for leaf in flat.tensors), policy.plan(flat.tensors, [None] * len(flat.tensors))))
    assert codecs["model/0.weight"].lossless
    assert isinstance(codecs["model/2.weight"], DynaQuantCodec)
    record = policy.search_log[-1]
    assert record.feasible and record.config["lossless_tensors"] == 1
    assert record.quality <= policy.tolerance


def test_each_weight_gets_the_fewest_bins_that_keep_its_own_error_within_budget() -> None:
    from inshrinkerator.policies.dynaquant_search import ConfigurationCube
    from inshrinkerator.policies.quantization_trials import WeightTrial

    generator = torch.Generator().manual_seed(1)
    hard = torch.randn(4096, generator=generator)
    easy = torch.tensor([-0.5, 0.25, 1.0])[torch.randint(0, 3, (4096,), generator=generator)]
    leaves = flatten({"hard": hard, "easy": easy}).tensors
    trials = {i: WeightTrial(leaf.tensor, "linear", None, None, 1.0) for i, leaf in enumerate(leaves)}
    bins, budget = (128, 64, 32, 16, 8, 4), 0.003
    cube = ConfigurationCube(trials, leaves, bins, (128,), (0.0,), (0.0,), budget)
    point, metric, _ = cube.search(None, 1)
    shared = bins[point[0]]
    cube.refine(point, metric)
    assert cube.quality(point, metric) <= budget
    chosen = {format_key_path(leaves[i].path): cube.config(i, point, metric).bins for i in trials}
    assert chosen["hard"] == shared  # the hardest tensor set the shared count
    assert chosen["easy"] == 4 < shared
    for index in trials:
        assert cube.result(index, point, metric).error <= budget


@pytest.mark.parametrize("bins, keep", [(4, 1.0), (16, 1.0), (4, 0.15)])
def test_first_moments_are_never_rounded_to_more_than_twice_their_size(tmp_path, bins, keep) -> None:
    # 0 is one of the levels: a tiny entry becomes 0 rather than the smallest level, so a
    # restored Adam step m / sqrt(v) is never blown up by the first moment (also among the
    # entries first_moment_keep keeps, whose |m| can be small where v is small).
    _, states = _states(2)
    state = states[1]
    ink.save(state, tmp_path / "m.ink", policy=DynaQuant(moment_bins=bins, first_moment_keep=keep, first_moment_keep_after=0))
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"]
    for key, entry in state["optimizer"]["state"].items():
        m, restored = entry["exp_avg"], loaded[key]["exp_avg"]
        if m.numel() < 1024:
            continue
        assert bool((restored * m >= 0).all())
        # 2x, plus the sketch's bucket width (1.6%) on both sides of a cell boundary
        assert bool((restored.abs() <= 2.1 * m.abs()).all())
        zeros = float((restored == 0).float().mean())
        assert 0 < zeros < 0.9 if keep == 1.0 else 1.0 - keep - 0.02 < zeros < 1.0


@pytest.mark.parametrize("bins", [2, 4, 8])
def test_first_moment_levels_are_the_fit_of_the_folded_histogram(bins) -> None:
    # The levels are fitted on the occupied buckets alone; they must be what fitting the
    # whole folded (all-positive) key space gives: a fit, then refits without the zero cell.
    from inshrinkerator.codecs.log_sketch import MAGNITUDE_KEYS, SIGNED_KEYS, magnitude_keys, signed_keys
    from inshrinkerator.codecs.nonuniform_quantizer import LINEAR, fit_centroids
    from inshrinkerator.policies.first_moment_levels import zero_level_hints_for

    moment = torch.randn(20_000, generator=torch.Generator().manual_seed(bins)) * 1e-4
    moment[::4] = 0.0
    counts = torch.bincount(signed_keys(moment), minlength=SIGNED_KEYS)
    hints = zero_level_hints_for(counts, bins, 1.0)
    magnitude = counts[:MAGNITUDE_KEYS] + counts[MAGNITUDE_KEYS:]
    folded = torch.cat([magnitude, torch.zeros_like(magnitude)])
    half = bins // 2
    levels = fit_centroids(folded, half, 1.0)
    for _ in range(2):
        prune_below = max(int(magnitude_keys(torch.tensor([float(levels.min()) / 2]))[0]), 1)
        kept = folded.clone()
        kept[:prune_below] = 0  # the pruned buckets emptied: the whole key space, refitted
        levels = fit_centroids(kept, half, 1.0, LINEAR, levels if levels.numel() == half else None)
    assert torch.equal(hints["centroids"], torch.cat([-levels.flip(0), levels]))
    assert hints["prune_below"] == max(int(magnitude_keys(torch.tensor([float(levels[0]) / 2]))[0]), 1)


def test_first_moment_levels_fitted_together_are_those_fitted_alone() -> None:
    from inshrinkerator.codecs.log_sketch import SIGNED_KEYS, signed_keys
    from inshrinkerator.policies.first_moment_levels import zero_level_hints_batch, zero_level_hints_for

    generator = torch.Generator().manual_seed(0)
    histograms = []
    for size, scale, bins in ((20_000, 1e-4, 8), (300, 1e-2, 16), (5_000, 1.0, 2), (64, 1e-6, 16)):
        moment = torch.randn(size, generator=generator) * scale
        moment[::3] = 0.0
        histograms.append((torch.bincount(signed_keys(moment), minlength=SIGNED_KEYS), bins))
    histograms.append((torch.zeros(SIGNED_KEYS, dtype=torch.long), 8))  # an all-zero moment
    together = zero_level_hints_batch(histograms, 0.5)
    for (counts, bins), hints in zip(histograms, together):
        alone = zero_level_hints_for(counts, bins, 0.5)
        assert hints.keys() == alone.keys()
        for name, value in alone.items():
            assert torch.equal(hints[name], value) if isinstance(value, torch.Tensor) else hints[name] == value
    assert together[-1] == {} and together[0]["centroids"].numel() == 8


def test_a_weight_that_moved_less_than_its_levels_can_hold_is_stored_as_its_quantized_change() -> None:
    from inshrinkerator.codecs import ResidualCodec

    _, (state,) = _states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    generator = torch.Generator().manual_seed(3)
    # The reference differs from model/3.weight by 1e-6 of its energy: far less than the
    # error of any level grid; the other tensors have no reference.
    references = [None] * len(keys)
    weight = flat.tensors[keys.index("model/3.weight")].tensor
    reference = weight + 1e-3 * weight.std() * torch.randn(weight.shape, generator=generator)
    references[keys.index("model/3.weight")] = reference
    policy = DynaQuant()
    codecs = dict(zip(keys, policy.plan(flat.tensors, references)))
    codec = codecs["model/3.weight"]
    assert isinstance(codec, ResidualCodec)
    assert policy.search_log[-1].config.get("residual_tensors", 1) == 1
    restored = codec.encode(weight, reference).reconstruction
    moved, error = float((weight - reference).pow(2).sum()), float((restored - weight).pow(2).sum())
    assert error <= 0.1 * moved


def _moved_weight_coding(policy: DynaQuant, spread: float = 1e-3) -> tuple[dict, float, int]:
    """(the search's configuration, error / squared movement, bytes) of model/3.weight
    planned by ``policy`` against a reference ``spread`` of its standard deviation away."""
    _, (state,) = _states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    weight = flat.tensors[keys.index("model/3.weight")].tensor
    reference = weight + spread * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    references = [reference if key == "model/3.weight" else None for key in keys]
    codec = dict(zip(keys, policy.plan(flat.tensors, references)))["model/3.weight"]
    encoded = codec.encode(weight, reference)
    error = float((encoded.reconstruction - weight).pow(2).sum()) / float((weight - reference).pow(2).sum())
    return policy.search_log[-1].config, error, sum(len(s) for s in encoded.streams)


def _residual_coding(grid: tuple[int, ...]) -> tuple[dict, float, int]:
    """(levels used, error / squared movement, bytes) of model/3.weight coded as its change
    since a reference 1e-3 of its spread away, under ``residual_bins=grid``."""
    config, error, size = _moved_weight_coding(DynaQuant(residual_bins=grid))
    return config["residual_tensors_by_bins"], error, size


def test_a_stored_change_takes_the_fewest_levels_that_keep_it_within_the_movement_budget() -> None:
    # 16 fixed levels leave a Gaussian change ~1 % of its energy as error, 10x inside the
    # budget (0.1 of it); the search goes to fewer levels and stops before crossing it.
    fixed, fixed_error, fixed_bytes = _residual_coding((16,))
    assert fixed == {16: 1} and fixed_error < 0.03
    levels, error, size = _residual_coding((16, 12, 8, 6, 4))
    (chosen,) = levels
    assert chosen < 16 and fixed_error < error <= 0.1
    assert size < 0.8 * fixed_bytes
    # The next coarser grid entry would have crossed it.
    grid = (16, 12, 8, 6, 4)
    _, coarser_error, _ = _residual_coding((grid[grid.index(chosen) + 1],))
    assert coarser_error > 0.1
    # When even the first grid entry misses the budget, the change is stored with it.
    first, first_error, _ = _residual_coding((4, 2))
    assert first == {4: 1} and first_error > 0.1


@pytest.mark.parametrize("spread", [1e-3, 0.1], ids=["change-coded", "level-coded"])
def test_movement_share_bounds_what_a_moved_weight_may_lose(spread) -> None:
    # A weight that moved 1e-3 of its spread is stored as its change; one that moved 0.1
    # of it on the search's levels. Either way its error stays within movement_share of
    # its squared movement, and a larger share stores it in fewer bytes.
    results = {}
    for share in (0.05, 0.5):
        policy = DynaQuant(movement_share=share, residual_bins=(16, 12, 8, 6, 4, 3, 2))
        config, error, size = _moved_weight_coding(policy, spread)
        assert error <= share
        assert bool(config["residual_tensors"]) == (spread < 0.01)
        results[share] = error, size
    (tight_error, tight_bytes), (loose_error, loose_bytes) = results[0.05], results[0.5]
    assert loose_error > tight_error and loose_bytes < 0.8 * tight_bytes


@pytest.mark.parametrize("spread, as_change", [(0.3, True), (0.1, False)], ids=["far", "near"])
def test_a_weight_that_crossed_many_cells_is_stored_as_its_change_where_that_is_smaller(
    monkeypatch, spread, as_change
) -> None:
    # Moved 0.3 of its spread, model/3.weight's level ids cost ~3.6 bits per element and its
    # change on 10 levels ~3.2: the change is stored. Moved 0.1, the ids cost ~2.7 bits, the
    # change is encoded too but loses, and the level ids stay.
    from inshrinkerator.codecs import ResidualCodec
    import inshrinkerator.policies.dynaquant_weights as weights_module

    config, error, size = _moved_weight_coding(DynaQuant(), spread)
    assert config["change_coded_tensors"] == int(as_change)
    assert error <= 0.1  # within movement_share of the squared movement either way
    monkeypatch.setattr(weights_module, "CHANGE_TRIAL_BITS", float("inf"))  # never tried
    levels_config, levels_error, levels_size = _moved_weight_coding(DynaQuant(), spread)
    assert "change_coded_tensors" not in levels_config
    if as_change:
        assert size < levels_size and error != levels_error
    else:
        assert (size, error) == (levels_size, levels_error)
    # The codec the writer gets is the one that was measured.
    _, (state,) = _states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    monkeypatch.undo()
    weight = flat.tensors[keys.index("model/3.weight")].tensor
    reference = weight + spread * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    codecs = DynaQuant().plan(flat.tensors, [reference if key == "model/3.weight" else None for key in keys])
    assert isinstance(codecs[keys.index("model/3.weight")], ResidualCodec) == as_change


def test_the_entropy_figures_count_the_encodings_stored_not_those_discarded(monkeypatch) -> None:
    # model/3.weight moved 0.3 of its spread: its level ids are encoded, then its change,
    # which is stored. The policy's entropy figures count the change's coded symbols, not
    # the discarded ids'; everything else is planned alike with and without the change trial.
    from inshrinkerator.codecs import ResidualCodec
    from inshrinkerator.codecs.bucket_delta import EntropyStats
    import inshrinkerator.policies.dynaquant_weights as weights_module

    _, (state,) = _states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    index = keys.index("model/3.weight")
    weight = flat.tensors[index].tensor
    reference = weight + 0.3 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    references = [reference if key == "model/3.weight" else None for key in keys]

    def payload_counted(codec) -> int:
        # The coded symbols' bytes of one more encoding of ``codec``, counted apart.
        stats = EntropyStats()
        inner = codec._inner if isinstance(codec, ResidualCodec) else codec  # noqa: SLF001
        counted = type(inner).from_config(inner.get_config())
        counted._hints = {**inner._hints, "stats": stats}  # noqa: SLF001
        (ResidualCodec(counted) if isinstance(codec, ResidualCodec) else counted).encode(weight, reference)
        return stats.payload_bytes

    with_change = DynaQuant()
    change = with_change.plan(flat.tensors, references)[index]
    monkeypatch.setattr(weights_module, "CHANGE_TRIAL_BITS", float("inf"))
    levels_only = DynaQuant()
    levels = levels_only.plan(flat.tensors, references)[index]
    assert isinstance(change, ResidualCodec) and isinstance(levels, DynaQuantDeltaCodec)
    counted = with_change.entropy_stats.payload_bytes - levels_only.entropy_stats.payload_bytes
    assert counted == payload_counted(change) - payload_counted(levels) < 0


def _train_two_layers(model: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int) -> None:
    for step in range(start, start + 3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _plan_and_encode(policy: DynaQuant, model: torch.nn.Module, optimizer: torch.optim.Optimizer, references):
    """(codecs, encodings, true tensors) by key, of the model and optimizer state now."""
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    refs = [references.get(key) for key in keys] if references else [None] * len(keys)
    codecs = policy.plan(flat.tensors, refs)
    encoded = dict(zip(keys, encode_planned(flat.tensors, codecs, refs)))
    return dict(zip(keys, codecs)), encoded, {key: leaf.tensor.clone() for key, leaf in zip(keys, flat.tensors)}


def test_a_frozen_weight_is_not_recoded_at_every_delta() -> None:
    # Its difference from the reference is the reference's own error, not movement: the
    # delta stores it as its reference (no bytes) instead of coding that error again.
    from inshrinkerator.codecs import ResidualCodec, UnchangedCodec

    model, _ = _two_layer_state(frozen_first=True)
    policy = DynaQuant()
    policy.watch(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)

    def size(encoded) -> int:
        return sum(len(bytes(stream)) for stream in encoded.streams)

    _train_two_layers(model, optimizer, 0)
    _, full, _ = _plan_and_encode(policy, model, optimizer, None)
    _train_two_layers(model, optimizer, 10)
    references = {key: e.reconstruction for key, e in full.items() if e.reconstruction is not None}
    codecs, delta, true = _plan_and_encode(policy, model, optimizer, references)
    frozen, trained = "model/0.weight", "model/2.weight"
    # Coding its error again took ~3 bits per value; re-coding it on the same levels, a
    # level table and a fraction of a bit per value; now nothing.
    assert isinstance(codecs[frozen], UnchangedCodec)
    assert size(delta[frozen]) == 0
    assert torch.equal(delta[frozen].reconstruction, references[frozen])  # the stored levels
    # A frozen layer given new values by hand is over the frozen budget: stored again.
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    codecs, again, true = _plan_and_encode(policy, model, optimizer, references)
    assert not isinstance(codecs[frozen], UnchangedCodec)
    rebuilt = again[frozen].reconstruction if again[frozen].reconstruction is not None else true[frozen]
    assert float((rebuilt - true[frozen]).pow(2).sum()) <= policy.frozen_tolerance * float(true[frozen].pow(2).sum())
    # The trained weight moved, so its delta still codes the movement.
    assert isinstance(codecs[trained], (ResidualCodec, DynaQuantDeltaCodec))
    assert size(delta[trained]) > 0.2 * size(full[trained])


def test_precision_only_grows_between_checkpoints() -> None:
    model, states = _states(2)
    policy = DynaQuant()
    policy.watch(model)
    flat = flatten(states[0])
    codecs = policy.plan(flat.tensors, [None] * len(flat.tensors))
    first = policy.search_log[-1].config["tensors_by_bins"]
    # Re-save what a restore would hold: the quantized weights, which now look easy.
    restored = [encoded.reconstruction if not codec.lossless else None
                for codec, encoded in zip(codecs, encode_planned(flat.tensors, codecs))]
    leaves = [type(leaf)(leaf.path, rebuilt if rebuilt is not None else leaf.tensor)
              for leaf, rebuilt in zip(flat.tensors, restored)]
    policy.plan(leaves, [None] * len(leaves))
    second = policy.search_log[-1].config["tensors_by_bins"]
    assert min(int(b) for b in second) >= min(int(b) for b in first)
    loose = DynaQuant(precision_only_grows=False)
    loose.watch(model)
    loose.plan(flat.tensors, [None] * len(flat.tensors))
    loose.plan(leaves, [None] * len(leaves))
    assert min(int(b) for b in loose.search_log[-1].config["tensors_by_bins"]) <= min(int(b) for b in second)



@pytest.mark.parametrize("joint, beta2", [(True, 0.95), (False, 0.95), (True, 0.999)])
def test_a_pruned_first_moment_entry_restarts_with_a_zero_second_moment(tmp_path, joint, beta2) -> None:
    # With beta2 = 0.999 a restart would grow the steps up to 14x: the moment stays whole.
    _, (state,) = _states(1, optimizer="adam95" if beta2 == 0.95 else "adam")
    joint = joint and beta2 == 0.95
    policy = DynaQuant(first_moment_keep=0.1, first_moment_keep_after=0, joint_moment_mask=joint)
    info = ink.save(state, tmp_path / "m.ink", policy=policy)
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"]
    large = [key for key, entry in state["optimizer"]["state"].items() if entry["exp_avg"].numel() >= 1024]
    assert large
    for key in large:
        v = state["optimizer"]["state"][key]["exp_avg_sq"]
        m_restored, v_restored = loaded[key]["exp_avg"], loaded[key]["exp_avg_sq"]
        assert float((m_restored != 0).float().mean()) < 0.13
        # no restored step divides a kept momentum by a zero second moment
        assert bool((v_restored[m_restored != 0] > 0).all())
        zeros = v_restored == 0
        if joint:
            assert 0.85 < float(zeros.float().mean()) < 0.95
            assert bool((m_restored[zeros] == 0).all())
            # the levels are fitted on the kept entries alone: each stays near its value
            octaves = (v_restored[~zeros] / v[~zeros]).log2().abs()
            assert float(octaves.max()) < 2.0 and float(octaves.mean()) < 0.4  # 0.49 if fitted on all
        else:
            assert bool((zeros == (v == 0)).all())
    whole = ink.save(state, tmp_path / "whole.ink", policy=dataclasses.replace(policy, joint_moment_mask=False))
    assert (info.stored_bytes < whole.stored_bytes) if joint else (info.stored_bytes == whole.stored_bytes)
    with pytest.raises(ValueError, match="joint_moment_mask"):
        DynaQuant(joint_moment_mask=1)


def _adam_entry(step: int, m: torch.Tensor, v: torch.Tensor) -> dict:
    weight = torch.linspace(-1, 1, m.numel()).reshape(m.shape)
    return {
        "model": {"w": weight},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
    }


@pytest.mark.parametrize("v_moves", [False, True])
def test_the_second_moment_keeps_the_smaller_of_whole_and_joint(tmp_path, v_moves) -> None:
    # Between two checkpoints 40 steps apart the first moment changes (so does its pruning
    # mask). The joint encoding stores only the kept entries (the mask is read from the
    # first moment): where the second moment moved everywhere it is far smaller; where it
    # barely moved both are cheap deltas, and the smaller is stored.
    generator = torch.Generator().manual_seed(7)
    shape = (256, 64)
    v0 = torch.rand(shape, generator=generator).pow(4) * 1e-4 + 1e-8
    v1 = torch.rand(shape, generator=generator).pow(4) * 1e-4 + 1e-8 if v_moves else v0 * 1.0001
    states = [
        _adam_entry(0, torch.randn(shape, generator=generator) * 1e-3, v0),
        _adam_entry(40, torch.randn(shape, generator=generator) * 1e-3, v1),
    ]
    stored, kinds = {}, {}
    for joint in (True, False):
        folder = tmp_path / str(joint)
        with ink.CheckpointManager(folder, policy=DynaQuant(joint_moment_mask=joint)) as manager:
            for step, state in zip((0, 40), states):
                manager.save(step, state)
        with ink.CheckpointManager(folder) as reader:
            restored = reader.load(40)["optimizer"]["state"][0]
        stored[joint] = sum(f.stat().st_size for f in folder.rglob("*.ink"))
        m_zeros = restored["exp_avg"] == 0
        v_zeros = restored["exp_avg_sq"] == 0
        assert float(m_zeros.float().mean()) > 0.85  # pruned either way
        kinds[joint] = "joint" if bool(v_zeros.any()) else "whole"
        if kinds[joint] == "joint":
            assert torch.equal(v_zeros, m_zeros)
    assert kinds[False] == "whole"
    assert stored[True] <= stored[False]
    if v_moves:
        assert kinds[True] == "joint" and stored[True] < 0.9 * stored[False]


def test_a_chain_of_jointly_masked_moments_restores_at_every_step(tmp_path) -> None:
    # Each masked second moment is a delta against the previous one and reads its zeros from
    # its own checkpoint's first moment: restoring the end of the chain decodes, of every
    # base step, the second moment and the first moment it takes its zeros from.
    generator = torch.Generator().manual_seed(11)
    shape = (128, 64)
    states = [
        _adam_entry(40 * k, torch.randn(shape, generator=generator) * 1e-3,
                    torch.rand(shape, generator=generator).pow(4) * 1e-4 + 1e-8)
        for k in range(4)
    ]
    with ink.CheckpointManager(tmp_path / "run", policy=DynaQuant()) as manager:
        for state in states:
            manager.save(int(state["optimizer"]["state"][0]["step"]), state)
    from inshrinkerator.container import ContainerReader

    masked = 0
    for path in (tmp_path / "run").rglob("*.ink"):
        with ContainerReader(open(path, "rb"), str(path)) as container:
            masked += sum(record.codec["id"] == "dynaquant_masked_delta" for record in container.header.tensors)
    assert masked == 3  # the second moment of every delta
    with ink.CheckpointManager(tmp_path / "run") as reader:
        for step in (120, 80, 40, 0):  # the longest chain first
            entry = reader.load(step)["optimizer"]["state"][0]
            m_zeros, v_zeros = entry["exp_avg"] == 0, entry["exp_avg_sq"] == 0
            if step:
                assert float(m_zeros.float().mean()) > 0.85 and torch.equal(v_zeros, m_zeros)
            else:  # a full checkpoint: nothing pruned
                assert not bool(v_zeros.any())


def test_the_second_moment_choice_settles_on_the_smaller_encoding() -> None:
    from inshrinkerator.codecs.base import Encoded
    from inshrinkerator.codecs.bucket_delta import EntropyStats
    from inshrinkerator.policies.dynaquant import _Memory
    from inshrinkerator.policies.dynaquant_moments import _Candidate, _SecondMomentChoice

    def candidate(codec):
        return _Candidate(codec, EntropyStats(), {})

    whole, joint = DynaQuantDeltaCodec(bins=8), DynaQuantDeltaCodec(bins=4)
    plain, grouped = DynaQuantCodec(bins=8), DynaQuantGroupedCodec(bins=8)

    def size(n):
        return Encoded([b"x" * n])

    choice = _SecondMomentChoice(candidate(whole), candidate(joint), 0, candidate(plain), candidate(grouped))
    alone = _SecondMomentChoice(candidate(whole), candidate(joint), 0, candidate(plain))
    assert choice.settle(size(20), size(10), size(30), None, _Memory()) == (joint, plain)
    assert choice.settle(size(10), size(20), size(30), None, _Memory()) == (whole, plain)
    assert choice.settle(size(10), size(10), size(30), None, _Memory()) == (whole, plain)  # a tie keeps it whole
    assert choice.settle(size(10), None, size(30), None, _Memory()) == (whole, plain)  # no joint encoding
    # The pair decides: the joint second moment is smaller alone, the grouped first moment
    # (which needs the whole second moment) more than makes up for it.
    assert choice.settle(size(20), size(10), size(30), size(15), _Memory()) == (whole, grouped)
    assert choice.settle(size(20), size(10), size(30), size(25), _Memory()) == (joint, plain)
    assert choice.settle(size(20), size(30), size(30), size(35), _Memory()) == (whole, plain)
    assert alone.settle(size(20), size(10), size(30), None, _Memory()) == (joint, plain)


def test_the_joint_mask_needs_betas_that_keep_a_restart_s_steps_within_twice() -> None:
    from inshrinkerator.policies.dynaquant_moments import RESTART_STEP_GROWTH, restart_step_growth

    assert 1.9 < restart_step_growth((0.9, 0.95)) <= RESTART_STEP_GROWTH == 2.0
    assert 13.0 < restart_step_growth([0.9, 0.999]) < 14.0
    assert restart_step_growth((0.9, 0.5)) == pytest.approx(1.0)  # a short memory: no growth
    for unknown in (None, (0.9,), (0.9, 1.0), ("a", "b"), 0.9):
        assert restart_step_growth(unknown) == float("inf")
    # Without the state (plan() alone) the betas are unknown: the moment stays whole.
    generator = torch.Generator().manual_seed(5)
    state = _adam_entry(0, torch.randn(256, 64, generator=generator), torch.rand(256, 64, generator=generator) + 0.1)
    leaves = flatten(state).tensors
    codecs = DynaQuant(first_moment_keep_after=0).plan(leaves, [None] * len(leaves))
    paths = [format_key_path(leaf.path) for leaf in leaves]
    second = paths.index("optimizer/state/0/exp_avg_sq")
    restored = codecs[second].encode(leaves[second].tensor).reconstruction
    assert bool((restored > 0).all())
    planned = DynaQuant(first_moment_keep_after=0).plan_state(state, leaves, [None] * len(leaves))
    first = paths.index("optimizer/state/0/exp_avg")
    assert planned[second].uses_context and planned[second].context_key == paths[first]
    context = planned[first].encode(leaves[first].tensor).reconstruction
    restored = planned[second].encode(leaves[second].tensor, context=context).reconstruction
    assert float((restored == 0).float().mean()) > 0.85 and torch.equal(restored == 0, context == 0)


def _kept_first_moment(run, step) -> float:
    reader = ink.CheckpointManager(run)
    moment = reader.load(step)["optimizer"]["state"][2]["exp_avg"]
    reader.close()
    return float((moment != 0).float().mean())


@pytest.mark.parametrize("after, pruned", [(5, True), (6, False)])
def test_first_moments_are_pruned_only_far_enough_from_the_checkpoint_before(tmp_path, after, pruned) -> None:
    # The states are 5 Adam steps apart, the first 5 steps after the optimizer's start: the
    # full checkpoint and the delta both prune when first_moment_keep_after <= 5.
    _, states = _states(2)
    manager = ink.CheckpointManager(tmp_path / "run", policy=DynaQuant(first_moment_keep=0.1, first_moment_keep_after=after))
    for step, state in enumerate(states):
        manager.save(step, state)
    manager.close()
    for step in (0, 1):
        kept = _kept_first_moment(tmp_path / "run", step)
        assert kept <= 0.11 if pruned else kept > 0.5


def test_a_full_checkpoint_counts_its_steps_from_the_save_before_it(tmp_path) -> None:
    # Every checkpoint full, 5 Adam steps apart: the policy remembers its previous save (5
    # steps: every entry kept); a fresh policy counts from the optimizer's start (15: pruned).
    _, states = _states(3)
    options = {"first_moment_keep": 0.1, "first_moment_keep_after": 6}
    manager = ink.CheckpointManager(tmp_path / "run", policy=DynaQuant(**options), full_every=1)
    for step, state in enumerate(states):
        manager.save(step, state)
    manager.close()
    assert all(_kept_first_moment(tmp_path / "run", step) > 0.5 for step in range(3))
    fresh = ink.CheckpointManager(tmp_path / "fresh", policy=DynaQuant(**options))
    fresh.save(2, states[2])
    fresh.close()
    assert _kept_first_moment(tmp_path / "fresh", 2) <= 0.11


def test_an_older_state_planned_again_does_not_move_the_remembered_counter_back() -> None:
    # Full checkpoints (no references) of states 5 optimizer steps apart (counters 5 ... 20).
    _, states = _states(4)
    leaves = [flatten(state).tensors for state in states]
    policy = DynaQuant()

    def steps(index: int) -> int:
        return policy._steps_since_last_checkpoint(leaves[index], [None] * len(leaves[index]))

    assert steps(0) == 5  # the first: since the optimizer started
    assert steps(1) == 5
    assert steps(0) == 5  # an older step re-planned (a re-base): counted from the start
    assert steps(3) == 10  # still from the last save (counter 10), not from the re-based 5


def _kept_momentum(run, step) -> float:
    reader = ink.CheckpointManager(run)
    buffer = reader.load(step)["optimizer"]["state"][2]["momentum_buffer"]
    reader.close()
    return float((buffer != 0).float().mean())


@pytest.mark.parametrize("watched, steps, pruned", [(True, 6, True), (True, 5, False), (False, 6, False)])
def test_sgd_momentum_is_pruned_only_when_the_watch_counts_the_steps(tmp_path, watched, steps, pruned) -> None:
    # SGD keeps no step counters: the watched model's backward passes since it was watched
    # (first save) and since the previous save (the delta) are the steps.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    manager = ink.CheckpointManager(tmp_path / "run", policy=DynaQuant(first_moment_keep_after=6))
    if watched:
        manager.watch(model)
    for save in range(2):
        _train(model, optimizer, steps, start=steps * save)
        manager.save(save, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    manager.close()
    for save in range(2):
        kept = _kept_momentum(tmp_path / "run", save)
        assert kept <= 0.11 if pruned else kept > 0.5


def test_steps_since_reference_come_from_the_optimizer_step_counters() -> None:
    from inshrinkerator.policies.dynaquant import _optimizer_steps, _steps_since_reference

    _, states = _states(3)
    leaves = flatten(states[2]).tensors
    earlier = _by_key(states[0])
    references = [earlier.get(format_key_path(leaf.path)) for leaf in leaves]
    assert _steps_since_reference(leaves, references) == 10
    assert _steps_since_reference(leaves, [None] * len(leaves)) is None
    assert _optimizer_steps(leaves) == 15
    # a model buffer that happens to be called "step" is not an optimizer counter
    counter = {"model": {"step": torch.tensor(100.0)}, "optimizer": {"state": {}}}
    earlier_counter = {"model/step": torch.tensor(0.0)}
    buffer_leaves = flatten(counter).tensors
    assert _steps_since_reference(buffer_leaves, [earlier_counter.get(format_key_path(leaf.path)) for leaf in buffer_leaves]) is None
    assert _optimizer_steps(buffer_leaves) is None
    with pytest.raises(ValueError, match="first_moment_keep_after"):
        DynaQuant(first_moment_keep_after=-1)


def test_a_step_counter_that_is_no_real_number_is_no_counter(tmp_path) -> None:
    from inshrinkerator.policies.dynaquant import _optimizer_steps, _steps_since_reference

    _, states = _states(2)
    for state in states:  # a complex "step" (nothing torch writes, but a state may hold it)
        state["optimizer"]["state"][0]["step"] = torch.tensor(3 + 1j)
    leaves = flatten(states[1]).tensors
    references = [_by_key(states[0]).get(format_key_path(leaf.path)) for leaf in leaves]
    assert _optimizer_steps(leaves) == 10  # the other entries' counters
    assert _steps_since_reference(leaves, references) == 5
    manager = ink.CheckpointManager(tmp_path / "run")
    for step, state in enumerate(states):
        manager.save(step, state)
    manager.close()
    restored = ink.CheckpointManager(tmp_path / "run").load(1)["optimizer"]["state"][0]["step"]
    assert torch.equal(restored, torch.tensor(3 + 1j))


def test_adam_first_moments_and_sgd_momentum_get_their_own_level_counts() -> None:
    for optimizer, key, knob in (("adam", "exp_avg", "moment_bins"), ("sgd", "momentum_buffer", "momentum_bins")):
        _, (state,) = _states(1, optimizer=optimizer)
        leaves = flatten(state).tensors
        for bins in (4, 8):
            codecs = DynaQuant(**{knob: bins}).plan(leaves, [None] * len(leaves))
            planned = dict(zip((format_key_path(leaf.path) for leaf in leaves), codecs))
            assert planned[f"optimizer/state/2/{key}"].bins == bins
    defaults = DynaQuant()
    assert (defaults.moment_bins, defaults.momentum_bins) == (8, 4)
    with pytest.raises(ValueError, match="momentum_bins"):
        DynaQuant(momentum_bins=0)


def test_a_layer_unfrozen_after_watch_has_its_movement_coded() -> None:
    # Progressive unfreezing: the layer was frozen when the model was watched and trains
    # later. Whether a weight trains is read at save time, so its small steps are coded as
    # movement, not rounded away as a frozen layer's would be.
    model, _ = _two_layer_state(frozen_first=True)
    policy = DynaQuant()
    policy.watch(model)
    model[0].requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), 1e-4)
    key = "model/0.weight"
    _train_two_layers(model, optimizer, 0)
    _, full, before = _plan_and_encode(policy, model, optimizer, None)
    _train_two_layers(model, optimizer, 10)
    references = {k: e.reconstruction for k, e in full.items() if e.reconstruction is not None}
    _, delta, true = _plan_and_encode(policy, model, optimizer, references)
    # A frozen layer's delta keeps the full checkpoint's levels (its error stays about the
    # reference's); a trained one is bounded by its movement, measured from the reference.
    kept_error = float((references[key] - true[key]).pow(2).sum())
    delta_error = float((delta[key].reconstruction - true[key]).pow(2).sum())
    assert float((true[key] - before[key]).abs().max()) > 0
    assert delta_error < 0.5 * kept_error


def test_a_manager_averages_the_gradients_of_a_layer_unfrozen_after_watch(tmp_path) -> None:
    # Its sensitivity then comes from gradients from the save after unfreezing on, without
    # watching the model again (which would forget the other layers' averages).
    from inshrinkerator.tree import TensorLeaf

    model, _ = _two_layer_state(frozen_first=True)
    with ink.CheckpointManager(tmp_path / "run") as mgr:
        mgr.watch(model)
        watch = mgr.policy._memory.watch
        model[0].requires_grad_(True)
        optimizer = torch.optim.Adam(model.parameters(), 1e-4)
        _train_two_layers(model, optimizer, 0)
        first = TensorLeaf(("model", "0.weight"), model[0].weight.detach())
        assert watch.gradient_average(first) is None  # no hook before a save
        mgr.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        _train_two_layers(model, optimizer, 10)
        assert watch.gradient_average(first) is not None


def _codecs_and_bytes(path) -> dict[str, tuple[str, int]]:
    from inshrinkerator.container import ContainerReader
    from inshrinkerator.tree import tensor_paths

    with ContainerReader(open(path, "rb"), str(path)) as reader:
        paths = tensor_paths(reader.header.skeleton)
        return {
            format_key_path(paths[i]): (record.codec["id"], record.stored_bytes)
            for i, record in enumerate(reader.header.tensors)
        }


def test_a_tensor_equal_to_its_reference_is_stored_as_it_exactly(tmp_path) -> None:
    # A fine-tune's frozen layers saved against the pretrained base: no bytes, no error.
    generator = torch.Generator().manual_seed(0)
    base = {"frozen": torch.randn(256, 64, generator=generator), "tuned": torch.randn(256, 64, generator=generator)}
    tuned = {"frozen": base["frozen"].clone(), "tuned": base["tuned"] + 1e-2 * torch.randn(256, 64, generator=generator)}
    ink.save(tuned, tmp_path / "t.ink", policy="dynaquant", base=base)
    stored = _codecs_and_bytes(tmp_path / "t.ink")
    assert stored["frozen"] == ("unchanged", 0)
    assert stored["tuned"][0] != "unchanged"
    assert torch.equal(ink.load(tmp_path / "t.ink", base=base)["frozen"], base["frozen"])
    # Equal values in other bits (a zero of the other sign) are not the reference.
    plus, minus = base["frozen"].clone(), base["frozen"].clone()
    plus[3, 3], minus[3, 3] = 0.0, -0.0
    ink.save({"frozen": plus}, tmp_path / "z.ink", policy="dynaquant", base={"frozen": minus})
    assert _codecs_and_bytes(tmp_path / "z.ink")["frozen"][0] != "unchanged"


#: torch.optim optimizers beside Adam and SGD, with the statistics DynaQuant codes in the
#: log domain (non-negative) and those it codes as signed first-order state.
_OTHER_OPTIMIZERS = {
    "rmsprop": (lambda p: torch.optim.RMSprop(p, lr=1e-3), {"square_avg"}, set()),
    "rmsprop-momentum": (lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9), {"square_avg"}, {"momentum_buffer"}),
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.02), {"sum"}, set()),
    "amsgrad": (lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True), {"exp_avg_sq", "max_exp_avg_sq"}, {"exp_avg"}),
    "adamax": (lambda p: torch.optim.Adamax(p, lr=2e-3), {"exp_inf"}, {"exp_avg"}),
    "adadelta": (lambda p: torch.optim.Adadelta(p), {"square_avg", "acc_delta"}, set()),
}


def _resume_loss(model_state: dict, optimizer_state: dict, make, steps: int = 8) -> float:
    model = _model()
    model.load_state_dict(model_state)
    optimizer = make(model.parameters())
    optimizer.load_state_dict(optimizer_state)
    _train(model, optimizer, steps, start=100)
    generator = torch.Generator().manual_seed(999)
    x, y = torch.randn(64, 1, 8, 8, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


@pytest.mark.parametrize("name", sorted(_OTHER_OPTIMIZERS))
def test_the_statistics_of_other_torch_optimizers_are_quantized_and_training_resumes(tmp_path, name) -> None:
    make, positive, signed = _OTHER_OPTIMIZERS[name]
    model = _model()
    optimizer = make(model.parameters())
    _train(model, optimizer, 12)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    exact = ink.save(state, tmp_path / "exact.ink", policy="lossless")
    info = ink.save(state, tmp_path / "dq.ink", policy="dynaquant")
    loaded = ink.load(tmp_path / "dq.ink")
    entry, restored = state["optimizer"]["state"][2], loaded["optimizer"]["state"][2]  # the (32, 512) weight's
    assert set(entry) == positive | signed | {"step"}
    assert_same(restored["step"], entry["step"])
    for key in positive | signed:
        assert not torch.equal(restored[key], entry[key]), f"{key} was stored exactly"
    for key in positive:
        value, got = entry[key], restored[key]
        assert torch.all(got >= 0) and torch.equal(got == 0, value == 0), key
        # Log-domain levels (8 over ~10 decades): nearly every entry within a factor of 4;
        # the largest 0.5 % (the most active parameters) kept in bf16.
        octaves = (got[value > 0] / value[value > 0]).log2().abs()
        assert float((octaves < 2).float().mean()) > 0.98, key
        top = torch.topk(value.reshape(-1), value.numel() // 400).indices  # inside the 0.5 %
        assert torch.allclose(got.reshape(-1)[top], value.reshape(-1)[top], rtol=2**-8, atol=0), key
    # Nothing large is left whole: every class is a fraction of its float32 bytes.
    assert info.stored_bytes * 4 < exact.stored_bytes
    # Training resumes from the restored state as it does from the exact one.
    resumed = _resume_loss(loaded["model"], loaded["optimizer"], make)
    reference = _resume_loss(state["model"], state["optimizer"], make)
    assert abs(resumed - reference) < 0.05 * reference


def test_centered_rmsprop_keeps_its_square_average_exact(tmp_path) -> None:
    model = _model()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
    _train(model, optimizer, 12)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    ink.save(state, tmp_path / "dq.ink", policy="dynaquant")
    entry, restored = state["optimizer"]["state"][2], ink.load(tmp_path / "dq.ink")["optimizer"]["state"][2]
    assert_same(restored["square_avg"], entry["square_avg"])
    assert_same(restored["grad_avg"], entry["grad_avg"])
    assert not torch.equal(restored["momentum_buffer"], entry["momentum_buffer"])  # a step: rounded
    denominator = restored["square_avg"] - restored["grad_avg"] ** 2
    assert torch.equal(denominator, entry["square_avg"] - entry["grad_avg"] ** 2)


@pytest.mark.parametrize("name", ["adagrad", "amsgrad"])
def test_other_optimizers_statistics_are_delta_coded_along_a_chain(tmp_path, name) -> None:
    make, positive, _ = _OTHER_OPTIMIZERS[name]
    model = _model()
    optimizer = make(model.parameters())
    states = []
    with ink.CheckpointManager(tmp_path / "run") as manager:
        manager.watch(model)
        for step in range(3):
            _train(model, optimizer, 5, start=5 * step)
            state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            states.append(state)
            manager.save(step, state)
        restored = manager.load(2)
    (last,) = (tmp_path / "run").glob("step-0000000002-*.ink")
    stored = _codecs_and_bytes(last)
    for key in positive:
        assert stored[f"optimizer/state/2/{key}"][0] == "dynaquant_delta", key
        value, got = states[2]["optimizer"]["state"][2][key], restored["optimizer"]["state"][2][key]
        assert not torch.equal(got, value)
        assert torch.all(got >= 0) and torch.equal(got == 0, value == 0)
        octaves = (got[value > 0] / value[value > 0]).log2().abs()
        assert float((octaves < 2).float().mean()) > 0.98, key
    assert_same(restored["optimizer"]["state"][2]["step"], states[2]["optimizer"]["state"][2]["step"])


def test_a_statistic_named_non_negative_that_is_not_stays_exact(tmp_path) -> None:
    # Another optimizer may keep a signed tensor under Adagrad's entry name "sum".
    generator = torch.Generator().manual_seed(0)
    signed, positive = torch.randn(64, 64, generator=generator), torch.rand(64, 64, generator=generator)
    state = {
        "model": {"a.weight": torch.randn(64, 64, generator=generator), "b.weight": torch.randn(64, 64, generator=generator)},
        "optimizer": {"state": {0: {"sum": signed}, 1: {"sum": positive}}, "param_groups": []},
    }
    ink.save(state, tmp_path / "s.ink", policy="dynaquant")
    loaded = ink.load(tmp_path / "s.ink")["optimizer"]["state"]
    assert_same(loaded[0]["sum"], signed)
    assert not torch.equal(loaded[1]["sum"], positive)  # a real accumulator is coded
    assert torch.all(loaded[1]["sum"] >= 0)
