"""Weighted 1-D k-means with weighted k-means++ seeding, run on histogram buckets.

Clustering a tensor's log-histogram buckets (a few thousand points) instead of
its elements makes non-uniform quantization cost nearly nothing; the
clustering loss differs from the one on raw data by at most the sketch's
relative accuracy. :func:`histogram_sample_weights` gives each bucket the
weight ``sigma * count + (1 - sigma) * |centre|`` (both normalised), which moves
resolution from the dense mass near zero toward the large weights that matter.

Everything is deterministic for a given input: the seeding draws from a
generator seeded with ``seed``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "histogram_sample_weights",
    "kmeans_plus_plus_1d",
    "weighted_kmeans_1d",
    "nearest_level",
    "float32_levels",
    "distinct_float32_levels",
]


def histogram_sample_weights(centres: torch.Tensor, counts: torch.Tensor, sigma: float) -> torch.Tensor:
    """``sigma * counts/sum(counts) + (1 - sigma) * |centres|/sum(|centres|)`` (float64)."""
    if not 0.0 <= sigma <= 1.0:
        raise ValueError(f"sigma must be in [0, 1], got {sigma}")
    counts = counts.double()
    magnitude = centres.double().abs()
    count_part = counts / counts.sum().clamp_min(1e-300)
    magnitude_sum = magnitude.sum()
    if float(magnitude_sum) <= 0.0:
        return count_part
    return sigma * count_part + (1.0 - sigma) * magnitude / magnitude_sum


def kmeans_plus_plus_1d(
    points: torch.Tensor, weights: torch.Tensor, k: int, generator: torch.Generator
) -> torch.Tensor:
    """``k`` seeds drawn by weighted k-means++ (the first ∝ weight, then ∝ weight·distance²)."""
    dtype = torch.result_type(points, weights)  # every draw and buffer in one dtype
    points, weights = points.to(dtype), weights.to(dtype)
    cumulative = torch.cumsum(weights, 0)
    # All the uniform numbers at once: the generator yields the same ones as k single draws.
    uniforms = torch.rand(k, generator=generator, dtype=cumulative.dtype, device=cumulative.device)
    first = _draw(cumulative, uniforms[0:1])
    if first is None:
        raise ValueError("weighted k-means++ needs a point with positive weight")
    chosen = [first]
    # Buffers reused across draws: a seeding makes up to k of them over a few thousand
    # points, where allocating small tensors costs as much as the arithmetic.
    distance = torch.sub(points, points[first]).square_()
    nearer = torch.empty_like(distance)
    scores = torch.empty_like(distance)
    cumulative = torch.empty_like(distance)
    for draw in range(1, k):
        torch.cumsum(torch.mul(weights, distance, out=scores), 0, out=cumulative)
        index = _draw(cumulative, uniforms[draw : draw + 1])
        if index is None:
            break  # every point already coincides with a seed
        chosen.append(index)
        torch.minimum(distance, torch.sub(points, points[index], out=nearer).square_(), out=distance)
    return torch.sort(points[chosen]).values


def _draw(cumulative: torch.Tensor, uniform: torch.Tensor) -> Optional[int]:
    """One index drawn in proportion to the increments of ``cumulative`` (a running sum of
    finite non-negative scores) by the ``uniform`` number (a 1-element tensor in [0, 1));
    None when they are all 0.

    Inverse-CDF sampling: one uniform number and one binary search per draw, where an
    exponential race (``torch.multinomial``) draws a random number per point, which made
    most of the cost of a k-means++ seeding. One host sync per draw.
    """
    target = uniform * cumulative[-1:]
    index = int(torch.searchsorted(cumulative, target, right=True))
    if index < cumulative.numel():
        return index
    # The target rounded up to the total (or the total is 0): the last point that adds to it.
    if float(cumulative[-1]) <= 0.0:
        return None
    return int(torch.searchsorted(cumulative, cumulative[-1:], right=False))


def nearest_level(points: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted ``levels`` for each point (ties go to the lower level)."""
    if levels.numel() == 1:
        return torch.zeros(points.shape, dtype=torch.long, device=points.device)
    boundaries = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(points, boundaries, right=False)


def weighted_kmeans_1d(
    points: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    iterations: int = 30,
    seed: int = 0,
    init: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sorted centroids (float64, at most ``k``) minimising ``sum(w * (x - c(x))**2)``.

    Args:
        points: 1-D positions (e.g. histogram bucket centres).
        weights: non-negative weight per point, not all zero.
        k: the number of centroids wanted (>= 1).
        iterations: Lloyd iterations at most (stops early once assignments settle).
        seed: seeds the k-means++ draw.
        init: optional starting centroids (e.g. the previous checkpoint's), used instead
            of k-means++ when it has exactly ``k`` finite values.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    points = points.double().reshape(-1)
    weights = weights.double().reshape(-1)
    keep = weights > 0
    points, weights = points[keep], weights[keep]
    if points.numel() == 0:
        raise ValueError("weighted k-means needs at least one point with positive weight")
    order = torch.argsort(points)
    points, weights = points[order], weights[order]
    if points.numel() <= k or (points.numel() <= 4 * k and torch.unique(points).numel() <= k):
        return torch.unique(points)
    if init is not None and init.numel() == k and bool(torch.isfinite(init).all()):
        centroids = torch.sort(init.double().to(points.device)).values
    else:
        generator = torch.Generator(device=points.device).manual_seed(seed)
        centroids = kmeans_plus_plus_1d(points, weights, k, generator)
    # Points are sorted, so every cluster is a contiguous run: Lloyd's update needs only
    # where each decision boundary cuts the points, and prefix sums give the cluster means
    # (weight and weighted position in one table, so each step is one gather and one diff).
    # The cuts and boundaries are written into buffers kept across iterations: a k-means
    # runs hundreds of times per save, on a few thousand points, where allocating and
    # concatenating small tensors costs as much as the arithmetic.
    prefix = torch.nn.functional.pad(torch.cumsum(torch.stack([weights, weights * points]), 1), (1, 0))
    count = centroids.numel()
    # Two cut buffers in turn (this iteration's and the last one's), compared without a copy;
    # each with a view of its inner entries, the cuts proper.
    bounds, previous = (torch.empty(count + 1, dtype=torch.long, device=points.device) for _ in range(2))
    for buffer in (bounds, previous):
        buffer[0], buffer[-1] = 0, points.numel()
    cuts, previous_cuts = bounds[1:-1], previous[1:-1]
    boundaries = torch.empty(count - 1, dtype=points.dtype, device=points.device)
    # The centroids live in one buffer (updated into scratch, then sorted back into it), so
    # the views _cut reads stay valid.
    centroids = centroids.clone()
    updated = torch.empty_like(centroids)
    order = torch.empty(count, dtype=torch.long, device=points.device)
    lower, upper = centroids[:-1], centroids[1:]
    converged = False
    for iteration in range(iterations):
        _cut(points, lower, upper, boundaries, cuts)
        if iteration and torch.equal(bounds, previous):
            converged = True
            break
        mass, moment = torch.diff(prefix.index_select(1, bounds), dim=1).unbind(0)
        # An empty cluster keeps its position; the final cleanup drops it.
        occupied = mass > 0
        torch.where(occupied, moment.div_(mass.clamp_min_(1e-300)), centroids, out=updated)
        torch.sort(updated, out=(centroids, order))
        bounds, previous, cuts, previous_cuts = previous, bounds, previous_cuts, cuts
    # The clusters that hold a point (what nearest_level would assign), from the cuts: a
    # search per boundary instead of one per point (bucketize over thousands of points
    # starts a thread team per call, which costs milliseconds on a busy machine). After
    # convergence the last cuts are those of the final centroids.
    if not converged:
        _cut(points, lower, upper, boundaries, cuts)
    used = torch.nonzero(torch.diff(bounds) > 0).reshape(-1)
    # Means of clusters of tiny values (e.g. 1e-114 and 1e-213) can round to the same value.
    return torch.unique(centroids[used])


def _cut(
    points: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, boundaries: torch.Tensor, cuts: torch.Tensor
) -> None:
    """Where the decision boundaries of sorted centroids (``lower``: all but the last,
    ``upper``: all but the first) cut the sorted ``points``, into ``cuts`` (``boundaries``
    is scratch). Ties go to the lower centroid, as in :func:`nearest_level`."""
    torch.add(upper, lower, out=boundaries).mul_(0.5)
    torch.searchsorted(points, boundaries, right=True, out=cuts)


def float32_levels(
    points: torch.Tensor, weights: torch.Tensor, k: int, init: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sorted distinct non-zero finite float32 levels of :func:`weighted_kmeans_1d`.

    The linear-domain step of ``nonuniform_quantizer.fit_centroids`` for buckets already
    selected (non-zero, finite, in key order) with their sample weights: callers that keep
    the occupied buckets of a histogram fit on them without a pass over the key space.
    """
    start = init.detach().cpu().double() if init is not None else None
    return distinct_float32_levels(weighted_kmeans_1d(points, weights, k, init=start))


def distinct_float32_levels(centroids: torch.Tensor) -> torch.Tensor:
    """``centroids`` as sorted distinct float32 values, without 0 and non-finite ones."""
    levels = torch.unique(centroids.to(torch.float32))
    return levels[(levels != 0) & torch.isfinite(levels)]
