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

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch

__all__ = [
    "histogram_sample_weights",
    "kmeans_plus_plus_1d",
    "weighted_kmeans_1d",
    "weighted_kmeans_1d_batch",
    "KMeansProblem",
    "nearest_level",
    "float32_levels",
    "float32_levels_batch",
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


#: The most padded points one batch of :func:`weighted_kmeans_1d_batch` holds (a row alone may
#: be longer): its buffers of that many float64 values stay at 16 MiB each.
BATCH_ELEMENTS = 1 << 21


class KMeansProblem(NamedTuple):
    """One clustering of :func:`weighted_kmeans_1d_batch` (the arguments of :func:`weighted_kmeans_1d`)."""

    points: torch.Tensor
    weights: torch.Tensor
    k: int
    init: Optional[torch.Tensor] = None
    seed: int = 0


def kmeans_plus_plus_1d(
    points: torch.Tensor, weights: torch.Tensor, k: int, generator: torch.Generator
) -> torch.Tensor:
    """``k`` seeds drawn by weighted k-means++ (the first ∝ weight, then ∝ weight·distance²)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    dtype = torch.result_type(points, weights)  # every draw and buffer in one dtype
    rows = _Rows.of([(points.to(dtype).reshape(-1), weights.to(dtype).reshape(-1))])
    # All the uniform numbers at once: the generator yields the same ones as k single draws.
    uniforms = torch.rand(k, generator=generator, dtype=dtype, device=points.device)
    chosen = rows.seed([k], uniforms[None, :])[0]
    return torch.sort(points.to(dtype).reshape(-1)[chosen]).values


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
    return weighted_kmeans_1d_batch([KMeansProblem(points, weights, k, init, seed)], iterations)[0]


def weighted_kmeans_1d_batch(problems: Sequence[KMeansProblem], iterations: int = 30) -> list[torch.Tensor]:
    """:func:`weighted_kmeans_1d` of every problem, each result exactly what it returns alone.

    The problems are clustered side by side (padded to the longest), so a batch costs
    about as many tensor operations as one problem: fitting the levels of many small
    tensors is dominated by the cost of each operation, not by its arithmetic.
    """
    results: list[Optional[torch.Tensor]] = [None] * len(problems)
    batched: list[int] = []
    prepared: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, problem in enumerate(problems):
        if problem.k < 1:
            raise ValueError(f"k must be >= 1, got {problem.k}")
        points = problem.points.double().reshape(-1)
        weights = problem.weights.double().reshape(-1)
        keep = weights > 0
        points, weights = points[keep], weights[keep]
        if points.numel() == 0:
            raise ValueError("weighted k-means needs at least one point with positive weight")
        order = torch.argsort(points)
        points, weights = points[order], weights[order]
        k = problem.k
        if points.numel() <= k or (points.numel() <= 4 * k and torch.unique(points).numel() <= k):
            results[index] = torch.unique(points)
            continue
        batched.append(index)
        prepared.append((points, weights))
    # Rows of similar length side by side, and no more of them at once than BATCH_ELEMENTS
    # padded points: a batch's buffers stay small whatever the number of tensors.
    order = sorted(range(len(batched)), key=lambda position: prepared[position][0].numel())
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * prepared[order[stop]][0].numel() <= BATCH_ELEMENTS:
            stop += 1
        chunk = order[start:stop]
        fitted = _fit_rows([problems[batched[p]] for p in chunk], [prepared[p] for p in chunk], iterations)
        for position, centroids in zip(chunk, fitted):
            results[batched[position]] = centroids
        start = stop
    return results  # type: ignore[return-value]


def _fit_rows(
    problems: Sequence[KMeansProblem], prepared: Sequence[tuple[torch.Tensor, torch.Tensor]], iterations: int
) -> list[torch.Tensor]:
    """Seeding (or warm starts) and Lloyd's iterations of problems whose sorted positive-weight
    points and weights are ``prepared``, as the rows of one batch."""
    rows = _Rows.of(prepared)
    starts: list[Optional[torch.Tensor]] = []
    seeded: list[int] = []
    for row, problem in enumerate(problems):
        init, k = problem.init, problem.k
        if init is not None and init.numel() == k and bool(torch.isfinite(init).all()):
            starts.append(torch.sort(init.double().to(rows.device).reshape(-1)).values)
        else:
            starts.append(None)
            seeded.append(row)
    if seeded:
        ks = [problems[row].k for row in seeded]
        # All of a row's uniform numbers at once: its generator yields the same ones as k
        # single draws.
        draws = [
            torch.rand(
                k, generator=torch.Generator(device=rows.device).manual_seed(problems[row].seed),
                dtype=torch.float64, device=rows.device,
            )
            for row, k in zip(seeded, ks)
        ]
        uniforms = torch.nn.utils.rnn.pad_sequence(draws, batch_first=True) if len(draws) > 1 else draws[0][None]
        subset = rows.subset(seeded)
        for row, chosen in zip(seeded, subset.seed(ks, uniforms)):
            starts[row] = torch.sort(prepared[row][0][chosen]).values
    return rows.lloyd(starts, iterations)  # type: ignore[arg-type]


class _Rows:
    """Sorted points and weights of several clusterings, one padded row each.

    A row is padded with its largest point at weight 0: it stays sorted, adds nothing to
    any sum, and every search over it is clamped to its true length, so each row's
    arithmetic is exactly that of the same clustering on its own.
    """

    def __init__(self, points: torch.Tensor, weights: torch.Tensor, moments: torch.Tensor, lengths: list[int]) -> None:
        self.points, self.weights, self.moments, self.lengths = points, weights, moments, lengths
        self.device = points.device
        self.limits = torch.tensor(lengths, dtype=torch.long, device=points.device)[:, None]
        # Rows of equal length need no clamp: a search over a row never passes its end.
        self.ragged = min(lengths) < max(lengths)

    @classmethod
    def of(cls, prepared: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "_Rows":
        count, size = len(prepared), max(points.numel() for points, _ in prepared)
        device, dtype = prepared[0][0].device, prepared[0][0].dtype
        points = torch.empty(count, size, dtype=dtype, device=device)
        weights = torch.zeros(count, size, dtype=dtype, device=device)
        moments = torch.zeros(count, size, dtype=dtype, device=device)
        for row, (row_points, row_weights) in enumerate(prepared):
            n = row_points.numel()
            points[row, :n] = row_points
            points[row, n:] = row_points[-1]
            weights[row, :n] = row_weights
            moments[row, :n] = row_weights * row_points
        return cls(points, weights, moments, [points.numel() for points, _ in prepared])

    def subset(self, rows: list[int]) -> "_Rows":
        if rows == list(range(len(self.lengths))):
            return self
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return _Rows(
            self.points[index], self.weights[index], self.moments[index], [self.lengths[row] for row in rows]
        )

    def seed(self, ks: Sequence[int], uniforms: torch.Tensor) -> list[list[int]]:
        """Weighted k-means++ draws of every row (``ks[r]`` of them at most, from the
        uniform numbers ``uniforms[r]``): indices into each row, in the order drawn."""
        points, weights = self.points, self.weights
        cumulative = torch.cumsum(weights, 1)
        first, drawn = self._draw(cumulative, uniforms[:, 0:1])
        if any(index is None for index in first):
            raise ValueError("weighted k-means++ needs a point with positive weight")
        chosen: list[list[int]] = [[index] for index in first]  # type: ignore[list-item]
        active = [k > 1 for k in ks]
        # Buffers reused across draws: a seeding makes up to k of them over a few thousand
        # points, where allocating small tensors costs as much as the arithmetic.
        distance = torch.sub(points, points.gather(1, drawn)).square_()
        nearer, scores = torch.empty_like(distance), torch.empty_like(distance)
        for draw in range(1, max(ks)):
            if not any(active):
                break
            torch.cumsum(torch.mul(weights, distance, out=scores), 1, out=cumulative)
            indices, drawn = self._draw(cumulative, uniforms[:, draw : draw + 1])
            for row, index in enumerate(indices):
                if active[row]:
                    if index is None:
                        active[row] = False  # every point already coincides with a seed
                    else:
                        chosen[row].append(index)
                        active[row] = len(chosen[row]) < ks[row]
            torch.minimum(distance, torch.sub(points, points.gather(1, drawn), out=nearer).square_(), out=distance)
        return chosen

    def _draw(self, cumulative: torch.Tensor, uniforms: torch.Tensor) -> tuple[list[Optional[int]], torch.Tensor]:
        """One index per row drawn in proportion to the increments of its ``cumulative`` (a
        running sum of finite non-negative scores) by its uniform number in [0, 1); None
        for a row whose scores are all 0. Also as a ``(rows, 1)`` tensor (0 for None).

        Inverse-CDF sampling: one uniform number and one binary search per draw, where an
        exponential race (``torch.multinomial``) draws a random number per point, which
        made most of the cost of a k-means++ seeding. One host sync per draw.
        """
        totals = cumulative[:, -1:]
        found = torch.searchsorted(cumulative, uniforms * totals, right=True)
        indices: list[Optional[int]] = found.reshape(-1).tolist()
        if all(index < length for index, length in zip(indices, self.lengths)):  # type: ignore[operator]
            return indices, found
        for row, (index, length) in enumerate(zip(indices, self.lengths)):
            if index < length:  # type: ignore[operator]
                continue
            if float(totals[row]) <= 0.0:
                indices[row] = None
            else:
                # The target rounded up to the total: the last point that adds to it.
                indices[row] = int(torch.searchsorted(cumulative[row], totals[row], right=False))
        drawn = torch.tensor([index or 0 for index in indices], dtype=torch.long, device=self.device)
        return indices, drawn[:, None]

    def lloyd(self, starts: Sequence[torch.Tensor], iterations: int) -> list[torch.Tensor]:
        """Lloyd's iterations from sorted ``starts`` (one per row); each row's distinct
        centroids that hold a point."""
        points, device = self.points, self.device
        rows, count = len(starts), max(start.numel() for start in starts)
        # A row with fewer centroids is padded with +inf ones: their boundaries cut at the
        # row's end and their clusters stay empty, so they never move.
        centroids = torch.full((rows, count), float("inf"), dtype=points.dtype, device=device)
        for row, start in enumerate(starts):
            centroids[row, : start.numel()] = start
        # Points are sorted, so every cluster is a contiguous run: Lloyd's update needs only
        # where each decision boundary cuts the points, and prefix sums give the cluster means
        # (weight and weighted position in one table, so each step is one gather and one diff).
        # The cuts and boundaries are written into buffers kept across iterations: a k-means
        # runs hundreds of times per save, on a few thousand points, where allocating and
        # concatenating small tensors costs as much as the arithmetic.
        prefix = torch.nn.functional.pad(torch.cumsum(torch.stack([self.weights, self.moments], 1), 2), (1, 0))
        # Two bound buffers in turn (this iteration's and the last one's), compared without a
        # copy; each with a view of its inner entries (the cuts proper) and one as the gather
        # index of both prefix sums.
        buffers = []
        for _ in range(2):
            buffer = torch.empty(rows, 1, count + 1, dtype=torch.long, device=device)
            buffer[:, 0, 0], buffer[:, 0, -1:] = 0, self.limits
            buffers.append((buffer, buffer[:, 0, 1:-1], buffer.expand(rows, 2, count + 1)))
        (bounds, cuts, index), previous = buffers
        boundaries = torch.empty(rows, count - 1, dtype=points.dtype, device=device)
        gathered = torch.empty(rows, 2, count + 1, dtype=points.dtype, device=device)
        sums = torch.empty(rows, 2, count, dtype=points.dtype, device=device)
        mass, moment = sums.unbind(1)
        updated = torch.empty_like(centroids)
        order = torch.empty(rows, count, dtype=torch.long, device=device)
        lower, upper = centroids[:, :-1], centroids[:, 1:]
        converged = False
        for iteration in range(iterations):
            self._cut(lower, upper, boundaries, cuts)
            # A row that settled earlier is a fixed point: it goes on giving the same means.
            if iteration and torch.equal(bounds, previous[0]):
                converged = True
                break
            torch.diff(torch.gather(prefix, 2, index, out=gathered), dim=2, out=sums)
            # An empty cluster keeps its position; the final cleanup drops it.
            occupied = mass > 0
            torch.where(occupied, moment.div_(mass.clamp_min_(1e-300)), centroids, out=updated)
            torch.sort(updated, dim=1, out=(centroids, order))
            (bounds, cuts, index), previous = previous, (bounds, cuts, index)
        # The clusters that hold a point, from the cuts: after convergence the last cuts
        # are those of the final centroids.
        if not converged:
            self._cut(lower, upper, boundaries, cuts)
        used = torch.diff(bounds[:, 0], dim=1) > 0
        # Means of clusters of tiny values (e.g. 1e-114 and 1e-213) can round to the same value.
        return [torch.unique(centroids[row][used[row]]) for row in range(rows)]

    def _cut(self, lower: torch.Tensor, upper: torch.Tensor, boundaries: torch.Tensor, cuts: torch.Tensor) -> None:
        """Where the decision boundaries of sorted centroids (``lower``: all but the last,
        ``upper``: all but the first) cut each row's points, into ``cuts`` (``boundaries``
        is scratch). Ties go to the lower centroid, as in :func:`nearest_level`."""
        torch.add(upper, lower, out=boundaries).mul_(0.5)
        torch.searchsorted(self.points, boundaries, right=True, out=cuts)
        if self.ragged:
            torch.minimum(cuts, self.limits, out=cuts)


def float32_levels(
    points: torch.Tensor, weights: torch.Tensor, k: int, init: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sorted distinct non-zero finite float32 levels of :func:`weighted_kmeans_1d`.

    The linear-domain step of ``nonuniform_quantizer.fit_centroids`` for buckets already
    selected (non-zero, finite, in key order) with their sample weights: callers that keep
    the occupied buckets of a histogram fit on them without a pass over the key space.
    """
    return float32_levels_batch([KMeansProblem(points, weights, k, init)])[0]


def float32_levels_batch(problems: Sequence[KMeansProblem]) -> list[torch.Tensor]:
    """:func:`float32_levels` of every problem (``seed`` is ignored: 0), clustered side by side."""
    starts = [
        KMeansProblem(p.points, p.weights, p.k, p.init.detach().cpu().double() if p.init is not None else None)
        for p in problems
    ]
    return [distinct_float32_levels(centroids) for centroids in weighted_kmeans_1d_batch(starts)]


def distinct_float32_levels(centroids: torch.Tensor) -> torch.Tensor:
    """``centroids`` as sorted distinct float32 values, without 0 and non-finite ones."""
    levels = torch.unique(centroids.to(torch.float32))
    return levels[(levels != 0) & torch.isfinite(levels)]
