"""Weighted 1-D k-means with weighted k-means++ seeding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.weighted_kmeans import (
    KMeansProblem,
    histogram_sample_weights,
    kmeans_plus_plus_1d,
    nearest_level,
    weighted_kmeans_1d,
    weighted_kmeans_1d_batch,
)


def _loss(points: torch.Tensor, weights: torch.Tensor, centroids: torch.Tensor) -> float:
    return float((weights * (points - centroids[nearest_level(points, centroids)]) ** 2).sum())


def test_separated_clusters_are_found() -> None:
    points = torch.tensor([-5.0, -5.1, -4.9, 0.0, 0.1, 10.0, 10.2], dtype=torch.float64)
    centroids = weighted_kmeans_1d(points, torch.ones(7), 3)
    assert torch.allclose(centroids, torch.tensor([-5.0, 0.05, 10.1], dtype=torch.float64))


def test_weights_pull_centroids() -> None:
    points = torch.tensor([0.0, 1.0], dtype=torch.float64)
    centroid = weighted_kmeans_1d(points, torch.tensor([3.0, 1.0]), 1)
    assert torch.allclose(centroid, torch.tensor([0.25], dtype=torch.float64))


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=60),
    k=st.integers(1, 8),
    seed=st.integers(0, 5),
)
def test_result_is_sorted_distinct_and_not_worse_than_its_seeds(values: list[float], k: int, seed: int) -> None:
    points = torch.tensor(values, dtype=torch.float64)
    weights = torch.rand(points.numel(), generator=torch.Generator().manual_seed(seed)) + 0.01
    centroids = weighted_kmeans_1d(points, weights, k, seed=seed)
    assert 1 <= centroids.numel() <= k
    assert torch.all(centroids[1:] > centroids[:-1])
    assert float(centroids.min()) >= min(values) - 1e-9 and float(centroids.max()) <= max(values) + 1e-9
    seeds = weighted_kmeans_1d(points, weights, k, iterations=0, seed=seed)
    # Lloyd steps never raise the loss; float64 sums of up to 60 terms of ~1e4 round at ~1e-12 relative.
    seeded_loss = _loss(points, weights, seeds)
    assert _loss(points, weights, centroids) <= seeded_loss * (1 + 1e-9) + 1e-9


def test_deterministic_and_warm_started() -> None:
    points = torch.randn(500, dtype=torch.float64)
    weights = torch.rand(500)
    first = weighted_kmeans_1d(points, weights, 6, seed=3)
    assert torch.equal(first, weighted_kmeans_1d(points, weights, 6, seed=3))
    again = weighted_kmeans_1d(points, weights, 6, init=first)
    assert torch.allclose(again, first)


def test_seeding_draws_in_proportion_to_weight_and_never_a_weightless_point() -> None:
    # The first seed is drawn with probability proportional to weight: over many seeds the
    # frequencies match (3 sigma of a binomial), and a zero-weight point is never drawn.
    points = torch.arange(5, dtype=torch.float64)
    weights = torch.tensor([0.0, 1.0, 0.0, 3.0, 6.0], dtype=torch.float64)
    draws = 4000
    counts = torch.zeros(5)
    for seed in range(draws):
        first = kmeans_plus_plus_1d(points, weights, 1, torch.Generator().manual_seed(seed))
        counts[int(first[0])] += 1
    assert counts[0] == 0 and counts[2] == 0
    expected = weights / weights.sum() * draws
    spread = (expected * (1 - weights / weights.sum())).sqrt()
    assert bool(((counts.double() - expected).abs() <= 3 * spread + 1e-9).all()), counts


def test_seeding_stops_when_every_point_is_a_seed() -> None:
    points = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    seeds = kmeans_plus_plus_1d(points, torch.ones(3, dtype=torch.float64), 10, torch.Generator().manual_seed(0))
    assert torch.equal(seeds, points)


def test_sample_weights_blend_counts_and_magnitudes() -> None:
    centres = torch.tensor([-2.0, 1.0, 1.0])
    counts = torch.tensor([1, 1, 2])
    assert torch.allclose(histogram_sample_weights(centres, counts, 1.0), torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64))
    assert torch.allclose(histogram_sample_weights(centres, counts, 0.0), torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    with pytest.raises(ValueError):
        histogram_sample_weights(centres, counts, 1.5)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        weighted_kmeans_1d(torch.ones(3), torch.ones(3), 0)
    with pytest.raises(ValueError):
        weighted_kmeans_1d(torch.ones(3), torch.zeros(3), 2)


@st.composite
def _problems(draw: st.DrawFn) -> KMeansProblem:
    size = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 1000))
    generator = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        points = torch.randn(size, generator=generator, dtype=torch.float64) * 10 ** draw(st.integers(-6, 2))
    else:  # few distinct values: seeding runs out of points, clusters empty out
        points = torch.randint(0, draw(st.integers(1, 12)), (size,), generator=generator).double()
    weights = torch.rand(size, generator=generator, dtype=torch.float64)
    weights[torch.rand(size, generator=generator) < draw(st.sampled_from([0.0, 0.5]))] = 0.0
    weights[0] = 1.0
    k = draw(st.integers(1, 40))
    init = torch.randn(k, generator=generator, dtype=torch.float64) if draw(st.booleans()) else None
    return KMeansProblem(points, weights, k, init, draw(st.integers(0, 3)))


@settings(max_examples=40, deadline=None)
@given(problems=st.lists(_problems(), min_size=1, max_size=6), iterations=st.sampled_from([0, 2, 30]))
def test_a_batch_gives_each_problem_exactly_what_it_gives_alone(problems: list[KMeansProblem], iterations: int) -> None:
    # Rows of different lengths, level counts and starts share padded buffers; none of that
    # may change a single bit of any row's result.
    batched = weighted_kmeans_1d_batch(problems, iterations)
    for problem, result in zip(problems, batched):
        alone = weighted_kmeans_1d(problem.points, problem.weights, problem.k, iterations, problem.seed, problem.init)
        assert torch.equal(result, alone)


def test_a_batch_refuses_what_a_single_fit_refuses() -> None:
    good = KMeansProblem(torch.arange(5.0), torch.ones(5), 2)
    with pytest.raises(ValueError, match="k must be"):
        weighted_kmeans_1d_batch([good, KMeansProblem(torch.ones(3), torch.ones(3), 0)])
    with pytest.raises(ValueError, match="positive weight"):
        weighted_kmeans_1d_batch([good, KMeansProblem(torch.ones(3), torch.zeros(3), 2)])


def test_a_batch_larger_than_its_buffer_budget_is_fitted_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    from inshrinkerator.codecs import weighted_kmeans

    generator = torch.Generator().manual_seed(7)
    problems = [
        KMeansProblem(torch.randn(size, generator=generator, dtype=torch.float64), torch.rand(size, generator=generator), k)
        for size, k in ((40, 3), (300, 8), (90, 16), (500, 4), (41, 2), (200, 8))
    ]
    whole = weighted_kmeans_1d_batch(problems)
    sizes: list[int] = []
    real = weighted_kmeans._Rows.of

    def recording(prepared):  # type: ignore[no-untyped-def]
        sizes.append(len(prepared))
        return real(prepared)

    monkeypatch.setattr(weighted_kmeans, "BATCH_ELEMENTS", 700)
    monkeypatch.setattr(weighted_kmeans._Rows, "of", staticmethod(recording))
    parts = weighted_kmeans_1d_batch(problems)
    assert len(sizes) > 1 and sum(sizes) == len(problems)
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
