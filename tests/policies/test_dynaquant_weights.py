"""How DynaQuant stores weights: budgets (frozen, movement, evaluate), levels per tensor,\nchanges, frozen layers and precision that only grows."""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import DynaQuantCodec, DynaQuantDeltaCodec
from inshrinkerator.policies import DynaQuant
from inshrinkerator.tree import flatten, format_key_path

from ..helpers import encode_planned
from .dynaquant_states import by_key, one_thread, train_steps, trained_states  # noqa: F401 - one_thread: autouse


def test_user_evaluate_decides_and_tolerance_trades_size_for_quality() -> None:
    _, (state,) = trained_states(1)
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


@pytest.mark.parametrize("returned", ["0.5", None, True, torch.ones(2)], ids=["str", "None", "bool", "tensor of 2"])
def test_evaluate_must_return_a_number(returned) -> None:
    _, (state,) = trained_states(1)
    flat = flatten(state)
    policy = DynaQuant(evaluate=lambda model_state: returned)
    with pytest.raises(TypeError, match="evaluate must return a number"):
        policy.plan(flat.tensors, [None] * len(flat.tensors))


def test_an_evaluate_that_is_not_finite_before_quantization_fails_that_save_only(tmp_path) -> None:
    # Judged against nan, every configuration would look infeasible and the weights would
    # be stored exactly without a word; the save says why instead, and the run keeps its
    # earlier checkpoints. A quantized model judged nan is only an infeasible point.
    _, (first, second) = trained_states(2)
    diverged = {"now": False}

    def evaluate(model_state: dict[str, torch.Tensor]) -> float:
        return float("nan") if diverged["now"] else float(model_state["3.weight"].abs().sum())

    with ink.CheckpointManager(tmp_path / "run", policy=DynaQuant(evaluate=evaluate)) as manager:
        manager.save(1, first)
        diverged["now"] = True
        with pytest.raises(ValueError, match="before any quantization"):
            manager.save(2, second)
        assert manager.steps() == [1]
        restored = manager.load()
    assert restored["model"].keys() == first["model"].keys()


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
    _, (state,) = trained_states(1)
    policy = DynaQuant(evaluate=lambda model_state: float(torch.rand(1)) + 10.0, tolerance=1e-9)
    flat = flatten(state)
    codecs = policy.plan(flat.tensors, [None] * len(flat.tensors))
    weights = [c for leaf, c in zip(flat.tensors, codecs) if leaf.path[0] == "model"]
    assert all(codec.lossless for codec in weights)
    assert policy.search_log[-1].feasible is False


def test_frozen_weights_get_the_tighter_budget() -> None:
    model, _ = trained_states(1)
    model[0].weight.requires_grad_(False)
    policy = DynaQuant(tolerance=0.01, frozen_tolerance=0.0001)
    policy.watch(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    train_steps(model, optimizer, 2, start=50)
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


def test_a_weight_that_moved_less_than_its_levels_can_hold_is_stored_as_its_quantized_change() -> None:
    from inshrinkerator.codecs import ResidualCodec

    _, (state,) = trained_states(1)
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
    planned = policy.plan(flat.tensors, references)
    codec = planned[keys.index("model/3.weight")]
    assert isinstance(codec, ResidualCodec)
    assert policy.search_log[-1].config.get("residual_tensors", 1) == 1
    # (Its ids per sign of its first moment, which these 5 steps keep whole: a context.)
    restored = encode_planned(flat.tensors, planned, references)[keys.index("model/3.weight")].reconstruction
    moved, error = float((weight - reference).pow(2).sum()), float((restored - weight).pow(2).sum())
    assert error <= 0.1 * moved


def test_changes_coded_on_one_level_count_get_the_levels_their_encode_would_fit_alone() -> None:
    # Every weight moved far less than its levels' spacing: each is stored as its change,
    # and (with k-means levels) the levels of all of them are fitted side by side while
    # planning. Each encoding must be, byte for byte, the one of the change's own codec
    # fitting its levels alone.
    from inshrinkerator.codecs import ResidualCodec

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 40), torch.nn.Linear(40, 32))
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        optimizer.step()
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    generator = torch.Generator().manual_seed(1)
    references = [
        leaf.tensor + 1e-3 * leaf.tensor.std() * torch.randn(leaf.tensor.shape, generator=generator)
        if key.endswith(".weight") else None
        for key, leaf in zip(keys, flat.tensors)
    ]
    policy = DynaQuant(residual_error=None)
    codecs = policy.plan(flat.tensors, references)
    changes = [i for i, codec in enumerate(codecs) if isinstance(codec, ResidualCodec)]
    assert len(changes) == 3
    alone = ResidualCodec(DynaQuantCodec(bins=10, prune=0.0, protect=0.0, sigma=policy.sigma))
    for i in changes:
        # (Coded per sign of a first moment kept whole; the same levels and ids alone.)
        codec = codecs[i].standalone() if codecs[i].uses_context else codecs[i]  # type: ignore[attr-defined]
        planned = codec.encode(flat.tensors[i].tensor, references[i])
        assert planned.streams == alone.encode(flat.tensors[i].tensor, references[i]).streams


def _moved_weight_coding(policy: DynaQuant, spread: float = 1e-3) -> tuple[dict, float, int]:
    """(the search's configuration, error / squared movement, bytes) of model/3.weight
    planned by ``policy`` against a reference ``spread`` of its standard deviation away."""
    _, (state,) = trained_states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    weight = flat.tensors[keys.index("model/3.weight")].tensor
    reference = weight + spread * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    references = [reference if key == "model/3.weight" else None for key in keys]
    encoded = encode_planned(flat.tensors, policy.plan(flat.tensors, references), references)[keys.index("model/3.weight")]
    error = float((encoded.reconstruction - weight).pow(2).sum()) / float((weight - reference).pow(2).sum())
    return policy.search_log[-1].config, error, sum(len(s) for s in encoded.streams)


def _residual_coding(grid: tuple[int, ...]) -> tuple[dict, float, int]:
    """(levels used, error / squared movement, bytes) of model/3.weight coded as its change
    since a reference 1e-3 of its spread away, on k-means levels: ``residual_bins=grid``."""
    config, error, size = _moved_weight_coding(DynaQuant(residual_bins=grid, residual_error=None))
    return config["residual_tensors_by_bins"], error, size


def test_a_change_on_even_levels_loses_about_residual_error_of_its_size() -> None:
    # The default codes a moved weight's change on levels sqrt(12 e) of its RMS apart: the
    # rounding loses ~e of the change's energy, and a larger e stores fewer bytes.
    from inshrinkerator.codecs import ResidualCodec

    sizes = []
    for share in (0.01, 0.03, 0.1):
        policy = DynaQuant(residual_error=share)
        config, error, size = _moved_weight_coding(policy)
        assert config["residual_tensors"] == 1
        assert 0.8 * share <= error <= 1.2 * share
        sizes.append(size)
    assert sizes[0] > sizes[1] > sizes[2]
    _, (state,) = trained_states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    weight = flat.tensors[keys.index("model/3.weight")].tensor
    reference = weight + 1e-3 * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    codec = DynaQuant().plan(flat.tensors, [reference if key == "model/3.weight" else None for key in keys])[
        keys.index("model/3.weight")
    ]
    assert isinstance(codec, ResidualCodec)
    levels = codec._inner._hints["centroids"].double()  # noqa: SLF001
    gaps = torch.diff(torch.cat([levels[levels < 0], torch.zeros(1, dtype=torch.float64), levels[levels > 0]]))
    assert torch.allclose(gaps, gaps[0].expand_as(gaps), rtol=1e-5)


def test_even_levels_store_a_change_in_fewer_bytes_than_kmeans_levels_of_its_error() -> None:
    # Gaussian changes: 16 k-means levels leave ~1 % of the change's energy as error; even
    # levels at that error take fewer coded bits (most values fall in the central cells).
    _, kmeans_error, kmeans_bytes = _moved_weight_coding(DynaQuant(residual_error=None, residual_bins=(16,)))
    _, even_error, even_bytes = _moved_weight_coding(DynaQuant(residual_error=kmeans_error))
    assert even_error <= 1.05 * kmeans_error
    assert even_bytes < 0.97 * kmeans_bytes


def test_even_levels_round_to_the_nearest_step_and_to_zero_below_half_a_step() -> None:
    from inshrinkerator.policies.even_levels import MAX_EVEN_LEVELS, even_levels

    step = 0.25 * (12 * 0.03) ** 0.5
    centroids, prune_below = even_levels(0.25, 3.2 * step, 0.03)
    assert torch.allclose(centroids.double(), torch.tensor([-3, -2, -1, 1, 2, 3], dtype=torch.float64) * step)
    values = torch.tensor([0.4, 0.6, -0.6, 1.4, 1.6, -2.6, 0.0]) * step
    codec = DynaQuantCodec(bins=10, prune=0.0, protect=0.0).with_hints(centroids=centroids, prune_below=prune_below)
    rebuilt = codec.encode(values).reconstruction.double() / step
    assert torch.allclose(rebuilt, torch.tensor([0.0, 1.0, -1.0, 1.0, 2.0, -3.0, 0.0], dtype=torch.float64), atol=1e-5)
    # Nothing moved: any levels do. A far outlier is clipped to the last of the allowed ones.
    assert even_levels(0.0, 0.0, 0.03)[0].numel() == 2
    assert even_levels(1.0, 1e9, 0.03)[0].numel() == 2 * MAX_EVEN_LEVELS


def _leftover_coding(means: bool, within_even: bool = True) -> tuple[int, float, torch.Tensor]:
    """(bytes, error / squared change, levels) of a rank-8 change plus noise, stored as a
    low-rank product and what it leaves on ``residual_error`` 0.03's levels."""
    from inshrinkerator.codecs import LowRankResidualCodec
    from inshrinkerator.policies.even_levels import change_plan, step_levels

    generator = torch.Generator().manual_seed(0)
    change = torch.randn(256, 8, generator=generator) @ torch.randn(128, 8, generator=generator).T
    change += 0.6 * torch.randn(256, 128, generator=generator)
    reference = torch.randn(256, 128, generator=generator)
    tensor = reference + change
    histogram, rms, largest, factors = change_plan(tensor, reference, 0.03)
    assert factors is not None
    centroids, prune_below = step_levels(histogram, rms, largest, 0.03, means, within_even)
    inner = DynaQuantCodec(bins=10, prune=0.0, protect=0.0).with_hints(counts=histogram, centroids=centroids, prune_below=prune_below)
    encoded = LowRankResidualCodec(inner, factors.rank).with_factors(factors).encode(tensor, reference)
    error = float((encoded.reconstruction - tensor).pow(2).sum() / change.pow(2).sum())
    return sum(len(stream) for stream in encoded.streams), error, centroids


def test_cell_means_code_what_a_product_leaves_in_fewer_bytes_at_no_more_error() -> None:
    # What a product leaves mostly rounds to 0 and its cells' values crowd towards zero:
    # evenly spaced levels lose less than they are spaced for. Cell means at that same
    # error take wider cells and fewer bytes.
    even_bytes, even_error, even = _leftover_coding(means=False)
    mean_bytes, mean_error, levels = _leftover_coding(means=True)
    assert even_error < 0.03 and mean_error <= even_error * 1.01
    assert mean_bytes < 0.9 * even_bytes
    # Not multiples of the plain step (whose error they spend), and never 0.
    step = float(even[even > 0].min())
    positive = levels[levels > 0].double()
    assert not torch.allclose(positive / step, (positive / step).round(), atol=1e-3)
    assert float(positive.min()) > 0.5 * step and bool((levels != 0).all())
    # Spending the whole share instead: more error, still within it.
    _, full_error, _ = _leftover_coding(means=True, within_even=False)
    assert mean_error < full_error <= 0.03


def test_the_policy_stores_a_low_rank_change_on_cell_means_in_fewer_bytes_at_no_more_error() -> None:
    # model/3.weight moved by a rank-2 change plus a little noise: stored as a product and
    # what it leaves, on cell means with cell_means=True, on evenly spaced levels without
    # (the default).
    _, (state,) = trained_states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    index = keys.index("model/3.weight")
    weight = flat.tensors[index].tensor
    generator = torch.Generator().manual_seed(5)
    change = torch.randn(32, 2, generator=generator) @ torch.randn(512, 2, generator=generator).T
    change = (change + 0.3 * torch.randn(32, 512, generator=generator)) * 1e-3 * float(weight.std())
    references = [weight - change if key == "model/3.weight" else None for key in keys]
    stored = {}
    for means in (False, True):
        codecs = DynaQuant(cell_means=means).plan(flat.tensors, references)
        assert codecs[index].codec_id == "residual_low_rank"
        encoded = encode_planned(flat.tensors, codecs, references)[index]
        error = float((encoded.reconstruction - weight).pow(2).sum() / change.pow(2).sum())
        stored[means] = (sum(len(s) for s in encoded.streams), error)
    assert stored[True][0] < 0.95 * stored[False][0]
    assert stored[True][1] <= 1.01 * stored[False][1] < 0.03
    assert not DynaQuant().cell_means


def test_cell_means_are_kept_only_where_they_pay_for_their_table() -> None:
    from inshrinkerator.policies.even_levels import change_plan, mean_levels

    generator = torch.Generator().manual_seed(1)
    # Too few values for a table of levels, and nothing that moved.
    small = torch.randn(1000, generator=generator)
    histogram, rms, largest, _ = change_plan(small, None)
    assert mean_levels(histogram, rms, largest, 0.03) is None
    histogram, rms, largest, _ = change_plan(torch.zeros(4096), None)
    assert mean_levels(histogram, rms, largest, 0.03) is None
    # A Gaussian spread over many steps: its cells' means are their middles, no gain.
    wide = torch.randn(65536, generator=generator)
    histogram, rms, largest, _ = change_plan(wide, None)
    assert mean_levels(histogram, rms, largest, 0.03) is None
    # Nearly everything at 0 and a few far values about 1 and -3: the widest spacing tried
    # holds the error with a level or two for each group, where evenly spaced ones take
    # many; those few means pay for their table.
    sparse = torch.zeros(65536)
    sparse[:40] = torch.linspace(0.9, 1.1, 40)
    sparse[40:50] = -3.0
    histogram, rms, largest, _ = change_plan(sparse, None)
    chosen = mean_levels(histogram, rms, largest, 0.03, within_even=False)
    assert chosen is not None
    levels, _ = chosen
    assert levels.numel() <= 3 and abs(float(levels[0]) + 3.0) < 0.03
    assert bool(((levels[1:] > 0.9) & (levels[1:] < 1.1)).all())


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
        policy = DynaQuant(movement_share=share, residual_bins=(16, 12, 8, 6, 4, 3, 2), residual_error=None)
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
    import inshrinkerator.policies.dynaquant_weights as weights_module
    from inshrinkerator.codecs import ResidualCodec

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
    _, (state,) = trained_states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    monkeypatch.undo()
    weight = flat.tensors[keys.index("model/3.weight")].tensor
    reference = weight + spread * weight.std() * torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
    codecs = DynaQuant().plan(flat.tensors, [reference if key == "model/3.weight" else None for key in keys])
    assert isinstance(codecs[keys.index("model/3.weight")], ResidualCodec) == as_change


def test_a_change_that_misses_its_budget_once_is_rounded_finer_not_given_up(monkeypatch) -> None:
    # model/3.weight moved 0.3 of its spread. With residual_error=0.1 its change would lose
    # ~0.1 of 0.09 of the weight's squared size, three times its own budget (tolerance
    # 0.003): the first rounding misses it, the second aims at RETRY_MARGIN of the budget.
    # The change is stored, within its budget and in fewer bytes than the level ids the
    # policy falls back to without the retry.
    import inshrinkerator.policies.dynaquant_weights as weights_module

    config, error, size = _moved_weight_coding(DynaQuant(residual_error=0.1), 0.3)
    assert config["change_coded_retries"] == 1 and config["change_coded_tensors"] == 1
    assert error < 0.1 * 0.5  # well below what residual_error alone would lose of the movement
    monkeypatch.setattr(weights_module, "RETRY_MARGIN", 1e-12)  # the retry cannot win
    levels_config, _, levels_size = _moved_weight_coding(DynaQuant(residual_error=0.1), 0.3)
    assert levels_config["change_coded_tensors"] == 0 and size < 0.9 * levels_size
    # A change within its budget at the first rounding is rounded once.
    config, _, _ = _moved_weight_coding(DynaQuant(), 0.3)
    assert config["change_coded_retries"] == 0 and config["change_coded_tensors"] == 1


def test_a_weight_stored_whole_takes_evenly_spaced_levels_where_they_are_smaller(monkeypatch) -> None:
    # At a full checkpoint the search puts model/3.weight on k-means levels. The same share
    # of its squared size lost on evenly spaced levels codes it in fewer bytes (k-means
    # levels put about as many values in each cell), and that is what is stored.
    import inshrinkerator.policies.dynaquant_weights as weights_module

    _, (state,) = trained_states(1)
    flat = flatten(state)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    index = keys.index("model/3.weight")
    weight = flat.tensors[index].tensor

    def stored() -> tuple[dict, torch.Tensor, float, int]:
        policy = DynaQuant()
        codecs = policy.plan(flat.tensors, [None] * len(keys))
        encoded = encode_planned(flat.tensors, codecs)[index]
        error = float((encoded.reconstruction - weight).pow(2).sum() / weight.pow(2).sum())
        levels = torch.unique(encoded.reconstruction)
        return policy.search_log[-1].config, levels, error, sum(len(s) for s in encoded.streams)

    config, levels, error, size = stored()
    monkeypatch.setattr(
        weights_module.WeightPlanning, "_store_whole_on_even_levels_where_smaller", lambda *args: None
    )
    kmeans_config, kmeans_levels, kmeans_error, kmeans_size = stored()
    assert config["even_level_tensors"] >= 1 and "even_level_tensors" not in kmeans_config
    step = float(levels[levels > 0].min())
    assert torch.allclose(levels / step, torch.round(levels / step), atol=1e-3)  # k * step
    assert not torch.allclose(kmeans_levels / float(kmeans_levels[kmeans_levels > 0].min()),
                              torch.round(kmeans_levels / float(kmeans_levels[kmeans_levels > 0].min())), atol=1e-3)
    assert size < kmeans_size
    assert error <= 1.1 * kmeans_error and error <= DynaQuant().tolerance


def test_a_weight_whose_fisher_is_a_squared_average_gradient_keeps_its_kmeans_levels() -> None:
    # Watched under SGD, a weight's proxy weighs its error by the square of its averaged
    # gradient, too weak a guard for levels that spread the error evenly: its k-means
    # levels stay. Unwatched, the plain error is the whole measure, and evenly spaced
    # levels are taken where smaller.
    import copy

    from .dynaquant_states import small_model

    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    watched = DynaQuant()
    watched.watch(model)
    train_steps(model, optimizer, 5)
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    leaves = flatten(state).tensors
    watched.plan(leaves, [None] * len(leaves))
    unwatched = DynaQuant()
    unwatched.plan(leaves, [None] * len(leaves))
    assert watched.search_log[-1].config["even_level_tensors"] == 0
    assert unwatched.search_log[-1].config["even_level_tensors"] >= 1


def test_the_entropy_figures_count_the_encodings_stored_not_those_discarded(monkeypatch) -> None:
    # model/3.weight moved 0.3 of its spread: its level ids are encoded, then its change,
    # which is stored. The policy's entropy figures count the change's coded symbols, not
    # the discarded ids'; everything else is planned alike with and without the change trial.
    import inshrinkerator.policies.dynaquant_weights as weights_module
    from inshrinkerator.codecs import ResidualCodec
    from inshrinkerator.codecs.bucket_delta import EntropyStats

    _, (state,) = trained_states(1)
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


def test_precision_only_grows_between_checkpoints_until_a_new_chain() -> None:
    model, states = trained_states(2)
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
    # A full checkpoint of a continuing run (new_chain: no restore since the last save) is
    # searched as a new process's policy searches it, whatever the saves before chose.
    policy.new_chain()
    policy.plan(leaves, [None] * len(leaves))
    fresh = DynaQuant()
    fresh.watch(model)
    fresh.plan(leaves, [None] * len(leaves))
    assert policy.search_log[-1].kind == "guided"
    assert policy.search_log[-1].config == fresh.search_log[-1].config
    # It holds for that one plan only.
    policy.plan(leaves, [None] * len(leaves))
    assert policy.search_log[-1].kind != "guided"


def test_a_layer_unfrozen_after_watch_has_its_movement_coded() -> None:
    # Progressive unfreezing: the layer was frozen when the model was watched and trains
    # later. Whether a weight trains is read at save time, so its small steps are coded as
    # movement, not rounded away as a frozen layer's would be.
    model, _ = _two_layer_state(frozen_first=True)
    # The delta's own error, not the stored error a weight may carry on
    # (test_carried_error.py): measured against the reference's error.
    policy = DynaQuant(carry_error=0.0)
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


def _small_weight_plan(policy: DynaQuant, with_optimizer: bool = True) -> tuple[dict, dict, dict]:
    """(codecs, tensors, references) by key of the small model's second state planned
    against its first: model/5.weight (320 values) is under ``min_numel``."""
    _, (before, after) = trained_states(2)
    if not with_optimizer:
        before, after = {"model": before["model"]}, {"model": after["model"]}
    flat = flatten(after)
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    earlier = {format_key_path(leaf.path): leaf.tensor for leaf in flatten(before).tensors}
    references = [earlier[key] if key.startswith("model/") else None for key in keys]
    codecs = dict(zip(keys, policy.plan(flat.tensors, references)))
    return codecs, {k: leaf.tensor for k, leaf in zip(keys, flat.tensors)}, dict(zip(keys, references))


def test_a_small_weight_that_trains_is_stored_as_its_change_at_a_delta() -> None:
    # A bias or a small layer costs its lossless bytes at every delta; its change on evenly
    # spaced levels loses about residual_error of the change and takes far fewer bytes.
    from inshrinkerator.codecs import ResidualCodec

    codecs, tensors, references = _small_weight_plan(DynaQuant())
    key = "model/5.weight"
    assert tensors[key].numel() < DynaQuant().min_numel
    assert isinstance(codecs[key], ResidualCodec)
    change = codecs[key].encode(tensors[key], references[key])
    moved = float((tensors[key] - references[key]).pow(2).sum())
    error = float((change.reconstruction - tensors[key]).pow(2).sum())
    assert 0.5 * 0.03 * moved <= error <= 1.5 * 0.03 * moved
    exact_codecs, _, _ = _small_weight_plan(DynaQuant(small_min_numel=1024))
    assert not isinstance(exact_codecs[key], ResidualCodec)
    exact = exact_codecs[key].encode(tensors[key], references[key])
    assert sum(map(len, change.streams)) < 0.5 * sum(map(len, exact.streams))
    # Under small_min_numel (a 32-value bias) the weight stays exact.
    assert tensors["model/3.bias"].numel() < 64
    assert not isinstance(codecs["model/3.bias"], ResidualCodec)


def test_a_small_weight_without_optimizer_state_stays_exact() -> None:
    from inshrinkerator.codecs import ResidualCodec

    codecs, _, _ = _small_weight_plan(DynaQuant(), with_optimizer=False)
    assert codecs["model/5.weight"].lossless
    _, (state,) = trained_states(1)
    flat = flatten({"model": state["model"]})
    planned = DynaQuant().plan(flat.tensors, [None] * len(flat.tensors))
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    assert dict(zip(keys, planned))["model/5.weight"].lossless
    # with optimizer state and no reference: whole, on evenly spaced levels (not a change)
    flat = flatten(state)
    planned = DynaQuant().plan(flat.tensors, [None] * len(flat.tensors))
    assert not any(isinstance(codec, ResidualCodec) for codec in planned)


def _small_weights_saved(tmp_path, policy: DynaQuant) -> tuple[dict, dict, int]:
    """(the state, its restore, the file's bytes) of the small model saved whole."""
    _, (state,) = trained_states(1)
    path = tmp_path / f"{policy.small_weight_error}.ink"
    info = ink.save(state, path, policy=policy)
    return state, ink.load(path), info.stored_bytes


def test_a_small_weight_at_a_full_checkpoint_loses_about_small_weight_error_of_its_size(tmp_path) -> None:
    # model/5.weight has 320 values and model/0.weight 72 (under min_numel, from
    # small_min_numel); model/3.bias 32 (under small_min_numel: exact).
    state, exact, exact_bytes = _small_weights_saved(tmp_path, DynaQuant(small_weight_error=None))
    for key in ("5.weight", "0.weight", "3.bias"):
        assert torch.equal(exact["model"][key], state["model"][key])
    errors = {}
    for share in (1e-4, 1e-2):
        _, restored, stored = _small_weights_saved(tmp_path, DynaQuant(small_weight_error=share))
        assert stored < exact_bytes
        weight = state["model"]["5.weight"]
        errors[share] = float((restored["model"]["5.weight"] - weight).pow(2).sum() / weight.pow(2).sum())
        assert 0.5 * share <= errors[share] <= 1.5 * share
        small = state["model"]["0.weight"]
        assert 0 < float((restored["model"]["0.weight"] - small).pow(2).sum() / small.pow(2).sum()) <= 2 * share
        assert torch.equal(restored["model"]["3.bias"], state["model"]["3.bias"])


def test_the_delta_after_a_full_checkpoint_codes_a_small_weight_against_its_restore(tmp_path) -> None:
    # Closed loop: the change is taken from the full checkpoint's rounded weight, so the
    # delta restores within residual_error of its own change, not the full's error on top.
    _, (before, after) = trained_states(2)
    manager = ink.CheckpointManager(tmp_path / "run")
    manager.save(1, before)
    manager.save(2, after)
    first, second = manager.load(1)["model"]["5.weight"], manager.load(2)["model"]["5.weight"]
    manager.close()
    assert not torch.equal(first, before["model"]["5.weight"])
    moved = float((after["model"]["5.weight"] - first).pow(2).sum())
    error = float((second - after["model"]["5.weight"]).pow(2).sum())
    assert error <= 1.5 * DynaQuant().residual_error * moved


@pytest.mark.parametrize("share", [0, -1e-4, 2.0, float("nan"), "0.001", True])
def test_small_weight_error_must_be_a_share_or_none(share) -> None:
    with pytest.raises(ValueError, match="small_weight_error"):
        DynaQuant(small_weight_error=share)


def test_a_small_weight_holding_nan_or_inf_is_stored_exactly_at_a_delta(tmp_path) -> None:
    # A diverging bias must not fail the save: it is stored bit for bit, as every
    # non-finite tensor is, and the other small weights still as their change.
    model, (before, after) = trained_states(2)
    after["model"]["5.weight"].view(-1)[3] = float("nan")
    after["model"]["5.weight"].view(-1)[7] = float("inf")
    manager = ink.CheckpointManager(tmp_path / "run")
    manager.save(1, before)
    manager.save(2, after)
    restored = manager.load(2)["model"]["5.weight"]
    manager.close()
    assert torch.equal(restored.isnan(), after["model"]["5.weight"].isnan())
    assert torch.equal(restored.nan_to_num(), after["model"]["5.weight"].nan_to_num())


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("change_trial_bits", [None, 0.0])
def test_a_large_weight_turning_non_finite_at_a_delta_is_saved_and_kept(tmp_path, monkeypatch, value, change_trial_bits) -> None:
    # A large weight that moved and now holds inf (or nan) is not stored as its change,
    # which cannot hold it: the save used to fail with the residual codec's ValueError
    # (an inf made the movement infinite, so the weight counted as moved). With
    # CHANGE_TRIAL_BITS at 0 every moving weight is also tried as its change.
    import inshrinkerator.policies.dynaquant_weights as weights_module

    if change_trial_bits is not None:
        monkeypatch.setattr(weights_module, "CHANGE_TRIAL_BITS", change_trial_bits)
    model, (before, after) = trained_states(2)
    weight = after["model"]["3.weight"]
    weight.view(-1)[11] = value
    with ink.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, before)
        manager.save(2, after)
        restored = manager.load(2)["model"]["3.weight"]
    finite = torch.isfinite(weight)
    assert torch.equal(torch.isfinite(restored), finite)
    assert torch.equal(restored[~finite].nan_to_num(), weight[~finite].nan_to_num())
    error = (restored[finite] - weight[finite]).norm() / weight[finite].norm()
    assert float(error) < 0.1

@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_spread_holds_values_whose_squares_leave_float32(scale) -> None:
    # Squares of values beyond ~1e19 overflow float32 and those below ~1e-19 underflow:
    # the root mean square is then taken in float64 instead of coming back inf or 0.
    from inshrinkerator.policies.even_levels import spread

    values = torch.linspace(-1.0, 1.0, 301)
    rms, largest = spread(values)
    big_rms, big_largest = spread(values * scale)
    assert math.isclose(big_rms, rms * scale, rel_tol=1e-5)
    assert math.isclose(big_largest, largest * scale, rel_tol=1e-6)
    assert spread(torch.zeros(5)) == (0.0, 0.0)


@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_a_small_weight_of_extreme_magnitude_is_kept_at_a_full_checkpoint(tmp_path, scale) -> None:
    # A small weight's evenly spaced levels came from an RMS that overflowed (or
    # underflowed) in float32, and an RMS of inf was taken for a tensor of zeros: such a
    # norm-layer scale of ~1e20 restored as 1.0 everywhere.
    model, (state,) = trained_states(1)
    weight = state["model"]["5.weight"]
    weight.mul_(scale)
    with ink.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, state)
        restored = manager.load(1)["model"]["5.weight"]
    error = (restored.double() - weight.double()).norm() / weight.double().norm()
    assert float(error) < 0.05


def test_levels_reach_only_as_far_as_max_even_levels_steps() -> None:
    from inshrinkerator.policies.even_levels import MAX_EVEN_LEVELS, even_step, levels_reach

    assert levels_reach(1.0, 4.0, 0.03)
    step = even_step(1.0, 1e-12)
    assert levels_reach(1.0, (MAX_EVEN_LEVELS - 1) * step, 1e-12)
    assert not levels_reach(1.0, (MAX_EVEN_LEVELS + 1) * step, 1e-12)
    assert not levels_reach(1.0, 4.0, 0.0)  # a share of 0: no step can hold it
    assert levels_reach(0.0, 0.0, 0.03)  # nothing to hold
    assert not levels_reach(math.inf, 1.0, 0.03)


@pytest.mark.parametrize("pooled_error", [True, False])
def test_a_change_alone_or_unpooled_keeps_within_its_cap(pooled_error) -> None:
    # A change alone in its save (or with pooled_error=False) was rounded at
    # residual_error whatever its cap: a weight no optimizer trains, zeroed between saves
    # (a budget of 0 of its own), restored with 3 % of its old squared size.
    _, (before, after) = trained_states(2)
    leaves, references = flatten(after).tensors, flatten(before).tensors
    index = [format_key_path(leaf.path) for leaf in leaves].index("model/3.weight")
    policy = DynaQuant(pooled_error=pooled_error)
    tensors = [leaf.tensor for leaf in references]
    args = (leaves, tensors, [index], [1], {index: 1e-9}, {index: 1.0})
    assert policy._change_errors(*args) == {index: 1e-9}
    # Without a binding cap it keeps residual_error.
    assert policy._change_errors(leaves, tensors, [index], [1], {index: 1.0}, {index: 1.0}) == {index: policy.residual_error}


def test_a_frozen_weight_scaled_far_beyond_float32_squares_is_not_taken_as_unchanged(tmp_path) -> None:
    # A watched layer that does not train is stored as its reference while it stays
    # within the frozen budget; its squares summed in float32 overflowed for values of
    # ~1e25, inf <= inf held, and the scaled weight restored as the old one.
    from .dynaquant_states import small_model

    model = small_model()
    model[3].weight.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    with ink.CheckpointManager(tmp_path / "run") as manager:
        manager.watch(model)
        train_steps(model, optimizer, 3)
        manager.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        train_steps(model, optimizer, 3, start=3)
        with torch.no_grad():
            model[3].weight.mul_(1e25)
        expected = model[3].weight.detach().clone()
        manager.save(2, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        restored = manager.load(2)["model"]["3.weight"]
    error = (restored.double() - expected.double()).norm() / expected.double().norm()
    assert float(error) < 0.1


@pytest.mark.parametrize("evaluate", [False, True])
def test_a_small_weight_whose_change_dwarfs_it_loses_no_more_than_its_own_budget(tmp_path, evaluate) -> None:
    # A change far larger than the weight (a bias crossing zero, a run taking huge
    # steps): a share of the change alone was up to several times the weight's own
    # squared size. Now at most the budget of a weight (tolerance, or with ``evaluate``,
    # which does not judge small weights, the proxy's default), else exact.
    from inshrinkerator.policies.dynaquant_weights import SMALL_WEIGHT_BUDGET_WITH_EVALUATE

    model, (before, after) = trained_states(2)
    after["model"]["5.weight"] = -0.02 * before["model"]["5.weight"]
    policy = DynaQuant(evaluate=(lambda state: 0.0) if evaluate else None)
    with ink.CheckpointManager(tmp_path / "run", policy=policy) as manager:
        manager.save(1, before)
        manager.save(2, after)
        restored = manager.load(2)["model"]["5.weight"]
    weight = after["model"]["5.weight"].double()
    budget = SMALL_WEIGHT_BUDGET_WITH_EVALUATE if evaluate else policy.tolerance
    assert float(((restored.double() - weight) ** 2).sum()) <= budget * float((weight ** 2).sum())


@pytest.mark.parametrize("value", [0.0, 1e-41])
@pytest.mark.parametrize("at_delta", [True, False])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("key", ["3.weight", "5.weight"])  # a large weight, a small one
def test_a_weight_of_zeros_or_subnormals_comes_back_exactly(tmp_path, value, at_delta, optimizer, key) -> None:
    # A large weight zeroed between saves, with the error of its last save carried (the
    # same weights saved twice: the second save codes the first one's error away), was
    # coded as its change from the reference and came back as that change's rounding
    # error (norm 0.04 for a weight of zeros); one of subnormal values came back as
    # zeros, a small one too. All are stored exactly now.
    model, (before,) = trained_states(1, optimizer)
    earlier = [before, before]
    after = copy.deepcopy(before)
    after["model"][key] = torch.full_like(after["model"][key], value)
    with ink.CheckpointManager(tmp_path / "run") as manager:
        for step, state in enumerate(earlier if at_delta else []):
            manager.save(step, state)
        manager.save(2, after)
        restored = manager.load(2)
    assert torch.equal(restored["model"][key], after["model"][key])
    # The rest of the state is still quantized.
    name = "exp_avg" if optimizer == "adam" else "momentum_buffer"
    moment = after["optimizer"]["state"][2][name]
    assert moment.shape == after["model"]["3.weight"].shape
    assert not torch.equal(restored["optimizer"]["state"][2][name], moment)


def test_a_small_weight_budget_finer_than_even_levels_can_span_keeps_the_weight_exact(tmp_path) -> None:
    # With `small_weight_error=1e-12` the evenly spaced levels stopped MAX_EVEN_LEVELS
    # steps out, far below the weights' values, and the biases and small matrices of a
    # full checkpoint came back with 99.4 % of their norm as error. Exact instead.
    _, (state,) = trained_states(1)
    path = tmp_path / "fine.ink"
    ink.save(state, path, policy=DynaQuant(small_weight_error=1e-12))
    restored = ink.load(path)["model"]
    small = [key for key, value in state["model"].items() if 64 <= value.numel() < DynaQuant().min_numel]
    assert small
    for key in small:
        weight = state["model"][key]
        assert float((restored[key] - weight).pow(2).sum()) <= 1e-12 * float(weight.pow(2).sum()), key


def test_sign_grouped_changes_code_a_change_by_the_sign_of_a_first_moment_kept_whole(tmp_path) -> None:
    # Saves 5 steps apart keep the first moment whole; with sign_grouped_changes the weights
    # stored as their change code their ids per sign of it, in fewer bytes, and every step
    # restores the same as without.
    from inshrinkerator.codecs import ResidualCodec, SignGroupedResidualCodec
    from inshrinkerator.store import CheckpointManager

    from .dynaquant_states import codecs_and_bytes

    _, states = trained_states(3)

    def run(folder, policy: DynaQuant) -> tuple[dict[int, dict], list[dict[str, tuple[str, int]]]]:
        manager = CheckpointManager(folder, policy=policy)
        for step, state in enumerate(states):
            manager.save(step, state)
        files = [codecs_and_bytes(next(folder.glob(f"step-{step:010d}-*.ink"))) for step in range(3)]
        return {step: by_key(CheckpointManager(folder).load(step)) for step in range(3)}, files

    grouped, files = run(tmp_path / "grouped", DynaQuant(sign_grouped_changes=True))
    plain, plain_files = run(tmp_path / "plain", DynaQuant())
    assert not any(codec == SignGroupedResidualCodec.codec_id for step in plain_files for codec, _ in step.values())
    signed = [key for key, (codec, _) in files[2].items() if codec == SignGroupedResidualCodec.codec_id]
    assert signed and all(key.startswith("model/") for key in signed)
    assert all(plain_files[2][key][0] == ResidualCodec.codec_id for key in signed)
    assert sum(files[2][key][1] for key in signed) < 0.97 * sum(plain_files[2][key][1] for key in signed)
    for step in range(3):
        for key, tensor in grouped[step].items():
            assert torch.equal(tensor, plain[step][key]), (step, key)


def test_low_rank_changes_store_a_matrix_change_as_a_product_plus_what_it_leaves(tmp_path) -> None:
    # A matrix stored as its change takes fewer bytes as a low-rank product plus what it
    # leaves, loses about the same share of the change, and restores from a fresh manager
    # (whose chain checksums hold only if decoding rebuilds the writer's reconstruction).
    from inshrinkerator.codecs import LowRankResidualCodec
    from inshrinkerator.store import CheckpointManager

    from .dynaquant_states import codecs_and_bytes

    _, states = trained_states(3)
    # The last step moves the hidden layer mostly along three directions (as training moves
    # a layer between close checkpoints); its other weights did not move further.
    generator = torch.Generator().manual_seed(0)
    hidden = states[2]["model"]["3.weight"]
    states[2]["model"]["3.weight"] = states[1]["model"]["3.weight"] + (
        torch.randn(hidden.shape[0], 3, generator=generator) @ torch.randn(3, hidden.shape[1], generator=generator) * 1e-3
        + torch.randn(hidden.shape, generator=generator) * 1e-4
    )
    truth = [by_key(state) for state in states]

    def run(folder, policy: DynaQuant) -> tuple[list[dict], list[dict[str, tuple[str, int]]]]:
        manager = CheckpointManager(folder, policy=policy)
        for step, state in enumerate(states):
            manager.save(step, state)
        manager.close()
        files = [codecs_and_bytes(next(folder.glob(f"step-{step:010d}-*.ink"))) for step in range(3)]
        return [by_key(CheckpointManager(folder).load(step)) for step in range(3)], files

    # Each delta's own error against the change, without the stored error a weight may
    # carry on (test_carried_error.py).
    factored, files = run(tmp_path / "factored", DynaQuant(carry_error=0.0))
    plain, plain_files = run(tmp_path / "plain", DynaQuant(low_rank_changes=False, carry_error=0.0))
    assert not any(codec == LowRankResidualCodec.codec_id for step in plain_files for codec, _ in step.values())
    low = [key for key, (codec, _) in files[2].items() if codec == LowRankResidualCodec.codec_id]
    assert low == ["model/3.weight"]
    key = low[0]
    # Without the product the change crosses too many of the weight's own levels to be
    # stored as those levels' ids cheaply: the plain policy's best is larger.
    assert files[2][key][1] < 0.8 * plain_files[2][key][1]
    moved = float((truth[2][key] - factored[1][key]).pow(2).sum())
    error = float((factored[2][key] - truth[2][key]).pow(2).sum())
    assert error < 0.05 * moved


def test_low_rank_changes_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="low_rank_changes"):
        DynaQuant(low_rank_changes=1)  # type: ignore[arg-type]


def _two_changes(
    pooled: bool, scales: tuple[float, float] = (1e-3, 1e-4), sharper: float = 1.0, fisher_pooling: bool = True
) -> dict[str, tuple[int, float, float, float]]:
    """Two 64 x 64 weights of a trained model, moved by ``scales`` since their references
    (the first weight's second moment ``sharper`` times its own), planned and stored:
    ``key -> (bytes, squared error, its share of the squared change, mean second moment)``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        loss = model(torch.randn(16, 64, generator=generator)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    optimizer.state[model[0].weight]["exp_avg_sq"].mul_(sharper)
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    keys = [format_key_path(leaf.path) for leaf in flat.tensors]
    generator = torch.Generator().manual_seed(7)
    changes = {
        key: torch.randn(64, 64, generator=generator) * scale
        for key, scale in zip(("model/0.weight", "model/2.weight"), scales)
    }
    references = [leaf.tensor - changes[key] if key in changes else None for key, leaf in zip(keys, flat.tensors)]
    codecs = DynaQuant(pooled_error=pooled, fisher_pooling=fisher_pooling).plan(flat.tensors, references)
    encoded = encode_planned(flat.tensors, codecs, references)
    stored = {}
    seconds = ("optimizer/state/0/exp_avg_sq", "optimizer/state/2/exp_avg_sq")
    for key, change, second in zip(changes, changes.values(), seconds):
        index = keys.index(key)
        assert codecs[index].codec_id == "residual"
        squared = float((encoded[index].reconstruction - flat.tensors[index].tensor).double().pow(2).sum())
        size = sum(len(stream) for stream in encoded[index].streams)
        fisher = float(flat.tensors[keys.index(second)].tensor.double().mean())
        stored[key] = (size, squared, squared / float(change.double().pow(2).sum()), fisher)
    return stored


def test_pooled_error_puts_the_changes_on_one_spacing_for_fewer_bytes_at_the_same_total_error() -> None:
    plain, pooled = _two_changes(False), _two_changes(True)
    far, near = "model/0.weight", "model/2.weight"
    # Each change on its own: about the same share of itself lost (under residual_error).
    assert 0.5 < plain[far][2] / plain[near][2] < 2 and plain[far][2] < 0.03
    # One spacing: the change that moved less loses a larger share of itself (within
    # movement_share), the far one a smaller share...
    assert plain[near][2] < pooled[near][2] <= 0.1
    assert pooled[far][2] < plain[far][2]
    # ...about the same squared error in all, in fewer bytes.
    assert pooled[far][1] + pooled[near][1] <= 1.1 * (plain[far][1] + plain[near][1])
    assert pooled[far][0] + pooled[near][0] < 0.95 * (plain[far][0] + plain[near][0])
    assert DynaQuant().pooled_error


def test_fisher_pooling_rounds_the_change_the_loss_is_more_sensitive_to_more_finely() -> None:
    # Two changes of the same size; the first weight's second moment is 30x the second's.
    scales = (1e-3, 1e-3)
    plain = _two_changes(True, scales, sharper=30.0, fisher_pooling=False)
    weighted = _two_changes(True, scales, sharper=30.0)
    sharp, flat_ = "model/0.weight", "model/2.weight"
    assert weighted[sharp][3] > 10 * weighted[flat_][3]
    # One plain spacing: about the same share each.
    assert 0.8 < plain[sharp][2] / plain[flat_][2] < 1.25
    # Weighed by the Fisher mean: the other change loses a much larger share (up to its
    # cap, its budget: movement_share), the sensitive one a little less...
    assert 2 * plain[flat_][2] < weighted[flat_][2] <= 0.1
    assert weighted[sharp][2] < plain[sharp][2]

    def fisher_error(stored: dict[str, tuple[int, float, float, float]]) -> float:
        return sum(squared * fisher for _, squared, _, fisher in stored.values())

    # ...at no more Fisher-weighted error, in fewer bytes.
    assert fisher_error(weighted) <= 1.1 * fisher_error(plain)
    assert weighted[sharp][0] + weighted[flat_][0] < plain[sharp][0] + plain[flat_][0]
    assert DynaQuant().fisher_pooling


def test_fisher_pooling_weighs_each_change_by_its_fisher_mean() -> None:
    # Two changes of 1,000 values of the same size, Fisher means 1 and 2.
    leaves = flatten({key: torch.full((1000,), 1.0) for key in "ab"}).tensors
    references = [torch.zeros(1000)] * 2
    indices, sizes, fisher = [0, 1], [4000] * 2, {0: 1.0, 1: 2.0}

    def shares_of(policy: DynaQuant, means: dict[int, float]) -> dict[int, float]:
        return policy._change_errors(leaves, references, indices, sizes, {}, {}, means)

    shares = shares_of(DynaQuant(), fisher)
    # Squared error per value inversely proportional to the Fisher mean, and the
    # Fisher-weighted error lost is 0.03 of the Fisher-weighted squared size.
    assert shares[0] == pytest.approx(2 * shares[1], rel=1e-6) and shares[0] < 0.1
    assert shares[0] * 1000 * 1.0 + shares[1] * 1000 * 2.0 == pytest.approx(0.03 * 3000, rel=1e-6)
    # Off, or a change without a Fisher mean: the plain pool (here 0.03 each).
    unweighted = [0.03, 0.03]
    assert list(shares_of(DynaQuant(fisher_pooling=False), fisher).values()) == pytest.approx(unweighted)
    assert list(shares_of(DynaQuant(), {0: 1.0}).values()) == pytest.approx(unweighted)
    assert list(shares_of(DynaQuant(), {0: 1.0, 1: 0.0}).values()) == pytest.approx(unweighted)
    with pytest.raises(ValueError, match="fisher_pooling"):
        DynaQuant(fisher_pooling="yes")  # type: ignore[arg-type]


def test_pooled_shares_lose_the_whole_budget_and_respect_each_changes_cap() -> None:
    # Four changes of 1,000 values against zero references, of mean squares 1, 1/2, 2 and
    # 1/100. One spacing: each loses the same squared error per value, together 0.03 of
    # their summed squared size; d would lose 2.6 of itself and is capped at movement_share.
    values = {"a": 1.0, "b": 0.5**0.5, "c": 2.0**0.5, "d": 0.1}
    leaves = flatten({key: torch.full((1000,), value) for key, value in values.items()}).tensors
    references = [torch.zeros(1000)] * 4
    energies = [1000 * value**2 for value in values.values()]
    indices, sizes = [0, 1, 2, 3], [4000] * 4

    def per_value(shares: dict[int, float]) -> list[float]:
        return [shares[i] * energies[i] / 1000 for i in indices]

    def lost(shares: dict[int, float]) -> float:
        return sum(shares[i] * energies[i] for i in indices)

    policy = DynaQuant()
    shares = policy._change_errors(leaves, references, indices, sizes, {}, {})
    assert shares[3] == pytest.approx(0.1)
    a, b, c, _ = per_value(shares)
    assert a == pytest.approx(b, rel=1e-6) and a == pytest.approx(c, rel=1e-6)
    assert shares[1] > shares[0] > 0.03 > shares[2]
    assert lost(shares) == pytest.approx(0.03 * sum(energies), rel=1e-6)
    # A cap (a squared error, by leaf index) binds on b: b loses exactly it, a and c more.
    capped = policy._change_errors(leaves, references, indices, sizes, {1: 10.0}, {})
    assert capped[1] == pytest.approx(10.0 / energies[1]) and capped[3] == pytest.approx(0.1)
    assert capped[0] > shares[0] and capped[2] > shares[2]
    assert per_value(capped)[0] == pytest.approx(per_value(capped)[2], rel=1e-6)
    assert lost(capped) == pytest.approx(0.03 * sum(energies), rel=1e-6)
    # Off: every change at residual_error.
    assert DynaQuant(pooled_error=False)._change_errors(leaves, references, indices, sizes, {}, {}) == dict.fromkeys(indices, 0.03)


def test_a_change_that_codes_a_carried_error_away_loses_refine_error_of_its_training_change() -> None:
    # Three changes of 1,000 values against zero references, mean squares 1, 1 and 16;
    # c's change is mostly a carried error: its training change has squared size 1,000.
    leaves = flatten({key: torch.full((1000,), value) for key, value in {"a": 1.0, "b": 1.0, "c": 4.0}.items()}).tensors
    references = [torch.zeros(1000)] * 3
    indices, sizes, energy_c = [0, 1, 2], [4000] * 3, 16_000.0
    pooled = DynaQuant()._change_errors(leaves, references, indices, sizes, {}, {})
    for refine in (0.5, 1.0):
        shares = DynaQuant(refine_error=refine)._change_errors(leaves, references, indices, sizes, {}, {}, None, {2: 1000.0})
        # c loses refine_error times its training change, more than the pool gives it...
        assert shares[2] * energy_c == pytest.approx(refine * 1000.0) and shares[2] > pooled[2]
        # ... and the pool of the others is as without it.
        assert shares[0] == pooled[0] and shares[1] == pooled[1]
    # Within the change's own limit (movement_share of its squared size, or its cap)...
    assert DynaQuant(refine_error=4.0)._change_errors(leaves, references, indices, sizes, {}, {}, None, {2: 1000.0})[2] == pytest.approx(0.1)
    capped = DynaQuant(refine_error=1.0)._change_errors(leaves, references, indices, sizes, {2: 500.0}, {}, None, {2: 1000.0})
    assert capped[2] * energy_c == pytest.approx(500.0)
    # ... never below the pool's share, not at all with refine_error=None, and a change
    # planned alone (no pool) gets it as well.
    assert DynaQuant(refine_error=1e-6)._change_errors(leaves, references, indices, sizes, {}, {}, None, {2: 1000.0})[2] == pooled[2]
    assert DynaQuant(refine_error=None)._change_errors(leaves, references, indices, sizes, {}, {}, None, {2: 1000.0}) == pooled
    alone = DynaQuant()._change_errors(leaves[2:], references[2:], [0], sizes[:1], {}, {}, None, {0: 1000.0})
    assert alone[0] * energy_c == pytest.approx(DynaQuant().refine_error * 1000.0)


def test_pooled_shares_keep_the_plain_share_where_there_is_nothing_to_pool() -> None:
    from inshrinkerator.policies.even_levels import pooled_shares

    # A tensor that did not move keeps the plain share and the others pool without it.
    shares = pooled_shares([0.0, 100.0, 400.0], [100, 100, 100], 0.03, [1.0] * 3)
    assert shares[0] == 0.03 and shares[1] == pytest.approx(4 * shares[2], rel=1e-6)
    assert shares[1] * 100 + shares[2] * 400 == pytest.approx(0.03 * 500, rel=1e-6)
    # Non-finite energy (a tensor holding inf or nan), a single tensor: nothing pooled.
    assert pooled_shares([math.inf, 1.0], [10, 10], 0.03, [1.0, 1.0]) == [0.03, 0.03]
    assert pooled_shares([math.nan, 1.0], [10, 10], 0.03, [1.0, 1.0]) == [0.03, 0.03]
    assert pooled_shares([5.0], [10], 0.03, [1.0]) == [0.03]


def test_a_small_float16_second_moment_near_the_largest_float16_stays_finite(tmp_path) -> None:
    """On the log lattice the level nearest 61088 is 2 ** 16, which float16 holds as inf."""
    torch.manual_seed(0)
    model = torch.nn.Conv1d(1, 4, 3).half()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1, 8).half()).float().pow(2).mean().backward()
    optimizer.step()
    for state in optimizer.state.values():
        state["square_avg"].fill_(350.25).view(-1)[:4] = 61088.0
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    ink.save(state, tmp_path / "s.ink", policy=DynaQuant(min_numel=16, moment_min_numel=1, small_min_numel=1))
    restored = ink.load(tmp_path / "s.ink")
    for key, entry in restored["optimizer"]["state"].items():
        saved = state["optimizer"]["state"][key]["square_avg"].float()
        back = entry["square_avg"].float()
        assert torch.isfinite(back).all(), key
        assert ((back / saved).log2().abs() <= 0.25).all(), key  # within a quarter octave
