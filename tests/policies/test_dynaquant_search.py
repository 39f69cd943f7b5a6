"""The configuration-cube searches on synthetic monotone feasibility functions."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.policies.dynaquant_search import (
    MonotoneOracle,
    cube_points,
    exhaustive_search,
    guided_search,
    neighbourhood_search,
)


def _problem(shape: tuple[int, ...], weights: tuple[float, ...], limit: float):
    """Feasible iff a weighted sum of the coordinates stays under ``limit`` (monotone)."""

    def feasible(point: tuple[int, ...]) -> bool:
        return sum(w * p for w, p in zip(weights, point)) <= limit

    def score(point: tuple[int, ...]) -> float:
        return sum((i + 1) * p for i, p in enumerate(point)) + 0.001 * sum(point)

    return feasible, score


def _best(shape: tuple[int, ...], feasible, score):
    points = [p for p in cube_points(shape) if feasible(p)]
    return max(points, key=score) if points else None


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple),
    weights=st.lists(st.floats(0.1, 3.0), min_size=4, max_size=4).map(tuple),
    limit=st.floats(-1.0, 12.0),
)
def test_guided_and_exhaustive_find_the_best_feasible_point(shape, weights, limit) -> None:
    feasible, score = _problem(shape, weights, limit)
    expected = _best(shape, feasible, score)
    guided = guided_search(shape, MonotoneOracle(feasible), score)
    exhaustive = exhaustive_search(shape, MonotoneOracle(feasible), score)
    if expected is None:
        assert guided is None and exhaustive is None
    else:
        assert score(guided) == pytest.approx(score(expected))
        assert score(exhaustive) == pytest.approx(score(expected))


def test_guided_search_evaluates_far_fewer_points_than_the_cube() -> None:
    shape = (6, 2, 6, 3)
    feasible, score = _problem(shape, (1.0, 0.5, 1.0, 0.7), 6.0)
    oracle = MonotoneOracle(feasible)
    guided_search(shape, oracle, score)
    assert oracle.evaluations < len(cube_points(shape)) / 3


def test_oracle_infers_by_dominance() -> None:
    calls = []

    def feasible(point):
        calls.append(point)
        return sum(point) <= 3

    oracle = MonotoneOracle(feasible)
    assert oracle((2, 1)) and not oracle((3, 1))
    assert oracle.infer((1, 1)) is True and oracle.infer((3, 2)) is False and oracle.infer((0, 4)) is None
    assert oracle((1, 0)) and oracle((4, 4)) is False
    assert calls == [(2, 1), (3, 1)] and oracle.evaluations == 2


def test_neighbourhood_search_moves_one_axis_step() -> None:
    shape = (6, 6)
    feasible, score = _problem(shape, (1.0, 1.0), 10.0)  # everything feasible
    found = neighbourhood_search(shape, MonotoneOracle(feasible), score, (2, 2), radius=1)
    assert found == (2, 3)  # the best of the centre and its four axis neighbours
    kept = neighbourhood_search(shape, MonotoneOracle(feasible), score, (2, 2), 1, allow_more_aggressive=False)
    assert kept == (2, 2)  # more aggressive neighbours are not tried
    tight, _ = _problem(shape, (1.0, 1.0), 3.0)
    assert neighbourhood_search(shape, MonotoneOracle(tight), score, (2, 2), radius=1) == (1, 2)
    nothing = neighbourhood_search(shape, MonotoneOracle(lambda p: False), score, (2, 2), radius=1)
    assert nothing is None


def test_cube_points_cover_the_cube() -> None:
    assert cube_points((2, 3)) == list(itertools.product(range(2), range(3)))


def test_proxy_feasibility_agrees_with_the_quality_and_stops_at_the_first_failing_tensor() -> None:
    import torch

    from inshrinkerator.policies.dynaquant_search import ConfigurationCube
    from inshrinkerator.policies.quantization_trials import WeightTrial
    from inshrinkerator.tree import flatten

    generator = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(2048, generator=generator) * (1.0 + i) for i in range(4)}
    state["hard"] = torch.randn(4096, generator=generator)
    leaves = flatten(state).tensors

    def cube() -> ConfigurationCube:
        trials = {i: WeightTrial(leaf.tensor, "linear", None, None, 1.0) for i, leaf in enumerate(leaves)}
        return ConfigurationCube(trials, leaves, (64, 16, 4, 2), (128,), (0.0,), (0.0,), 0.002)

    reference, checked = cube(), cube()
    runs: list[int] = []
    real_results = checked.results

    def counting_results(indices, point, metric, stop=None):
        # The tensors run side by side up to the first over budget: those are the runs.
        results = real_results(indices, point, metric, stop)
        runs.extend(indices[: len(results)])
        return results

    checked.results = counting_results  # type: ignore[method-assign]
    for bins in range(4):
        point = (bins, 0, 0, 0)
        assert checked.feasible(point, "magnitude") == (reference.quality(point, "magnitude") <= 0.002)
    coarsest = (3, 0, 0, 0)
    assert reference.quality(coarsest, "magnitude") > 0.002
    runs.clear()
    assert not checked.feasible(coarsest, "magnitude")
    assert len(runs) == 1  # the tensor that failed last fails first here too


@pytest.mark.parametrize("with_evaluate", [False, True])
def test_own_budgets_under_a_tensors_error_floor_are_decided_without_its_trial(with_evaluate: bool) -> None:
    import torch

    from inshrinkerator.codecs.log_sketch import ALPHA
    from inshrinkerator.policies.dynaquant_search import ConfigurationCube
    from inshrinkerator.policies.quantization_trials import WeightTrial
    from inshrinkerator.tree import flatten

    generator = torch.Generator().manual_seed(4)
    state = {f"w{i}": torch.randn(3000, generator=generator) * 0.05 for i in range(6)}
    leaves = flatten(state).tensors
    spread = (2 * ALPHA) ** 2 / 12  # what every value costs at least, whatever its levels
    # Budgets of each tensor (the proxy's share, or a cap with evaluate): three far under the
    # floor, one a little over it, two far over.
    bounds = {0: spread / 50, 1: spread / 3, 2: spread * 0.9, 3: spread * 1.2, 4: 1.0, 5: 1.0}

    def cube() -> ConfigurationCube:
        trials = {i: WeightTrial(leaf.tensor, "linear", None, None, 1.0) for i, leaf in enumerate(leaves)}
        if with_evaluate:
            return ConfigurationCube(trials, leaves, (256, 4), (256,), (0.0,), (0.0,), 1.0, lambda _: 0.0, caps=bounds)
        return ConfigurationCube(trials, leaves, (256, 4), (256,), (0.0,), (0.0,), 1.0, scales=bounds)

    checked, reference = cube(), cube()
    tried: list[int] = []
    real_results = checked.results

    def counting_results(indices, point, metric, stop=None):
        tried.extend(indices)
        return real_results(indices, point, metric, stop)

    checked.results = counting_results  # type: ignore[method-assign]
    for point in ((0, 0, 0, 0), (1, 0, 0, 0)):
        tried.clear()
        answers = checked.within_own_budgets(list(range(6)), point, "magnitude")
        expected = [reference.result(i, point, "magnitude").error <= bounds[i] for i in range(6)]
        assert answers == expected
        assert not any(answers[:3]) and sorted(tried) == [3, 4, 5]
    assert checked.within_own_budgets([0, 4], (0, 0, 0, 0), "magnitude") == [False, True]
