"""Searching DynaQuant's configuration cube for the most compressive feasible configuration.

The cube has one axis per knob (bins, embedding bins, prune fraction, protect
fraction), each ordered from the least to the most aggressive setting, so that
quality can only get worse along every axis: if a point is infeasible (quality
outside the tolerance) every point at least as aggressive on all axes is too, and
if it is feasible every point at most as aggressive is too. The
:class:`MonotoneOracle` exploits that to answer many questions without
evaluating, and counts the evaluations it does make (the search cost).

* :func:`guided_search` (first checkpoint): branch and bound over boxes of the
  cube. A box whose least aggressive corner is infeasible is dropped; one whose
  most aggressive corner is feasible is solved by that corner; otherwise a binary
  search along its diagonal finds the last feasible and first infeasible points
  and the box is split around the latter. Boxes are visited best bound first, and
  skipped when their best corner cannot beat the best found so far.
* :func:`neighbourhood_search` (later checkpoints): the points within a few axis
  steps of the previous best, by decreasing estimated compression, first feasible wins.
* :func:`exhaustive_search`: every point by decreasing estimated compression,
  first feasible wins (dominance still skips evaluations). When the neighbourhood
  holds nothing feasible, :class:`ConfigurationCube` falls back to the guided search
  of the whole cube, which decides every point too (most by dominance) at a fraction
  of the evaluations.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..codecs._numpy_paths import positions_of
from ..codecs.nonuniform_quantizer import assign_ids, reconstruct
from ..tree import TensorLeaf
from .quantization_trials import (
    MAGNITUDE,
    SENSITIVITY,
    TrialConfig,
    TrialResult,
    WeightTrial,
    quantile_key,
    run_trials,
)

__all__ = [
    "ConfigurationCube",
    "Point",
    "MonotoneOracle",
    "cube_points",
    "guided_search",
    "neighbourhood_search",
    "exhaustive_search",
    "SearchRecord",
]

Point = tuple[int, ...]


@dataclass
class SearchRecord:
    """What one save's configuration search did; its cost is ``evaluations`` and ``seconds``."""

    kind: str  # "guided", "neighbourhood" or "neighbourhood+exhaustive"
    evaluations: int
    seconds: float
    config: dict[str, Any]
    quality: Optional[float]  # of the nearest-level quantization the search judged
    feasible: bool
    stored_quality: Optional[float] = None  # of what was stored (stickiness included)
    stickiness: float = 0.0  # what the deltas used (0 after a fallback)


def _dominates(a: Point, b: Point) -> bool:
    """``a`` is at least as aggressive as ``b`` on every axis."""
    return all(x >= y for x, y in zip(a, b))


class MonotoneOracle:
    """Feasibility of cube points, evaluated at most once each and inferred by dominance.

    Args:
        feasible: the expensive test of one point.
    """

    def __init__(self, feasible: Callable[[Point], bool]) -> None:
        self._feasible = feasible
        self._known: dict[Point, bool] = {}
        self._yes: list[Point] = []
        self._no: list[Point] = []
        self.evaluations = 0

    def infer(self, point: Point) -> Optional[bool]:
        """What is known about ``point`` without evaluating it (``None``: unknown)."""
        if point in self._known:
            return self._known[point]
        if any(_dominates(yes, point) for yes in self._yes):
            return True
        if any(_dominates(point, no) for no in self._no):
            return False
        return None

    def __call__(self, point: Point) -> bool:
        known = self.infer(point)
        if known is not None:
            return known
        self.evaluations += 1
        result = bool(self._feasible(point))
        self._known[point] = result
        (self._yes if result else self._no).append(point)
        return result


def cube_points(shape: Sequence[int]) -> list[Point]:
    """Every point of a cube with ``shape[i]`` levels on axis ``i``."""
    return [tuple(p) for p in itertools.product(*(range(n) for n in shape))]


def _diagonal(lo: Point, hi: Point) -> list[Point]:
    steps = max(high - low for low, high in zip(lo, hi))
    points = []
    for t in range(steps + 1):
        point = tuple(low + round((high - low) * t / steps) if steps else low for low, high in zip(lo, hi))
        if not points or points[-1] != point:
            points.append(point)
    return points


def guided_search(
    shape: Sequence[int],
    oracle: MonotoneOracle,
    score: Callable[[Point], float],
    start: Optional[Point] = None,
) -> Optional[Point]:
    """The best-scoring feasible point of the cube (``None`` if even the least aggressive fails).

    ``score`` estimates the compression of a point (higher is better) and should grow
    with aggressiveness; it steers the order and the bound. ``start`` (default: the
    origin) is the least aggressive corner considered.
    """
    lo0 = tuple(start) if start is not None else tuple(0 for _ in shape)
    hi0 = tuple(n - 1 for n in shape)
    best: Optional[Point] = None
    counter = itertools.count()
    heap = [(-score(hi0), next(counter), lo0, hi0)]
    while heap:
        bound, _, lo, hi = heapq.heappop(heap)
        if best is not None and -bound <= score(best):
            continue
        if not oracle(lo):
            continue
        if best is None or score(lo) > score(best):
            best = lo
        if oracle(hi):
            if score(hi) > score(best):
                best = hi
            continue
        diagonal = _diagonal(lo, hi)
        low, high = 0, len(diagonal) - 1  # diagonal[low] feasible, diagonal[high] infeasible
        while high - low > 1:
            middle = (low + high) // 2
            if oracle(diagonal[middle]):
                low = middle
            else:
                high = middle
        feasible_point, split = diagonal[low], diagonal[high]
        if score(feasible_point) > score(best):
            best = feasible_point
        # Split around the first infeasible point: per axis, below it or at/above it.
        for sides in itertools.product((0, 1), repeat=len(shape)):
            if all(sides):
                continue  # at least as aggressive as an infeasible point
            box_lo = tuple(s if side else low for low, s, side in zip(lo, split, sides))
            box_hi = tuple(h if side else s - 1 for h, s, side in zip(hi, split, sides))
            if any(a > b for a, b in zip(box_lo, box_hi)):
                continue
            if _dominates(feasible_point, box_hi):
                continue  # everything in it is dominated by a known feasible point
            heapq.heappush(heap, (-score(box_hi), next(counter), box_lo, box_hi))
    return best


def neighbourhood_search(
    shape: Sequence[int],
    oracle: MonotoneOracle,
    score: Callable[[Point], float],
    centre: Point,
    radius: int = 1,
    allow_more_aggressive: bool = True,
) -> Optional[Point]:
    """The best-scoring feasible point within ``radius`` cube steps of ``centre``.

    Steps are counted along the axes (a step moves one axis by one level), so radius 1
    offers the centre and its 2 x axes neighbours. Points more aggressive than the
    centre on every axis may be excluded (Inshrinkerator's rule: a model's precision only
    grows in training); by default they are tried, so the ratio can recover when
    training slows down.
    """
    candidates = []
    for offset in itertools.product(range(-radius, radius + 1), repeat=len(shape)):
        if sum(abs(o) for o in offset) > radius:
            continue
        point = tuple(c + o for c, o in zip(centre, offset))
        if any(not 0 <= p < n for p, n in zip(point, shape)):
            continue
        if not allow_more_aggressive and point != centre and _dominates(point, centre):
            continue
        candidates.append(point)
    candidates.sort(key=score, reverse=True)
    for point in candidates:
        if oracle(point):
            return point
    return None


def exhaustive_search(
    shape: Sequence[int], oracle: MonotoneOracle, score: Callable[[Point], float]
) -> Optional[Point]:
    """The best-scoring feasible point, trying every point by decreasing score."""
    for point in sorted(cube_points(shape), key=score, reverse=True):
        if oracle(point):
            return point
    return None


def _fraction_keys(counts: torch.Tensor, fractions: Sequence[float]) -> dict[float, int]:
    return {fraction: max(quantile_key(counts, fraction), 0) for fraction in fractions}


class ConfigurationCube:
    """DynaQuant's cube for one save: axes, per-layer-type thresholds, trials and quality.

    Axes (least to most aggressive): bins, embedding bins, prune fraction, protect
    fraction; the prune metric (magnitude / sensitivity) is searched as two cubes.
    Quality is the proxy — the largest relative squared error of any tensor, plain or
    Fisher-weighted (a global ratio would let large, well-conditioned tensors hide the
    damage done to small ones) — or, when ``evaluate`` is given, the relative change of
    ``evaluate(model_state_dict)``.

    Args:
        trials: leaf index -> its :class:`WeightTrial`.
        leaves: the state's leaves (the model state_dict handed to ``evaluate`` is read
            from them).
        bins, embedding_bins, prune, protect: the axes.
        budget: the largest feasible quality value.
        evaluate: the user's quality function, or None for the proxy.
        init: leaf index -> previous centroids (warm start).
        scales: leaf index -> its share of the budget (default 1): the proxy divides each
            tensor's error by it, so a tensor with scale 0.1 must be 10x more precise.
    """

    def __init__(
        self,
        trials: dict[int, WeightTrial],
        leaves: Sequence[TensorLeaf],
        bins: Sequence[int],
        embedding_bins: Sequence[int],
        prune: Sequence[float],
        protect: Sequence[float],
        budget: float,
        evaluate: Optional[Callable[[dict[str, torch.Tensor]], float]] = None,
        init: Optional[dict[int, torch.Tensor]] = None,
        scales: Optional[dict[int, float]] = None,
        caps: Optional[dict[int, float]] = None,
    ) -> None:
        self.trials = trials
        self.scales = scales or {}
        #: with ``evaluate``: the largest proxy error some tensors may have, whatever it says
        self.caps = {i: cap for i, cap in (caps or {}).items() if i in trials}
        self.leaves = leaves
        self.embedding = {i for i, t in trials.items() if t.layer_type == "embedding"}
        self.axes: list[tuple] = [
            tuple(bins),
            tuple(embedding_bins) if self.embedding else (None,),
            tuple(prune),
            tuple(protect),
        ]
        self.shape = tuple(len(axis) for axis in self.axes)
        self.metrics = [MAGNITUDE] + ([SENSITIVITY] if any(t.has_sensitivity for t in trials.values()) else [])
        self.budget = budget
        self.evaluate = evaluate
        self.init = init or {}
        self.total_mass = sum(t.total for t in trials.values()) or 1.0
        self.evaluations = 0
        self._thresholds: dict[tuple[str, str], dict[float, int]] = {}
        self._baseline: Optional[float] = None
        self._quality: dict[tuple[Point, str], float] = {}
        self._announced: set[int] = set()  # trials told the sensitivity cuts they will be asked
        self._hardest: Optional[int] = None  # the tensor that last put a point over budget
        self.oracles = {metric: MonotoneOracle(lambda p, m=metric: self.feasible(p, m)) for metric in self.metrics}
        #: (index, point, metric) -> bins chosen for that tensor by :meth:`refine`
        self.refined: dict[tuple[int, Point, str], int] = {}

    # -- one tensor at one point
    def config(self, index: int, point: Point, metric: str) -> TrialConfig:
        bins = self.axes[1][point[1]] if index in self.embedding else self.axes[0][point[0]]
        bins = self.refined.get((index, point, metric), bins)
        return TrialConfig(bins=bins, prune=self.axes[2][point[2]], protect=self.axes[3][point[3]], metric=metric)

    def describe(self, point: Point, metric: str) -> dict[str, Any]:
        return {
            "bins": self.axes[0][point[0]],
            "embedding_bins": self.axes[1][point[1]],
            "prune": self.axes[2][point[2]],
            "protect": self.axes[3][point[3]],
            "metric": metric,
        }

    def _threshold(self, layer_type: str, metric: str, fraction: float) -> int:
        key = (layer_type, metric)
        if key not in self._thresholds:
            members = [t for t in self.trials.values() if t.layer_type == layer_type]
            if metric == SENSITIVITY:
                counts = [t.sensitivity_counts for t in members if t.sensitivity_counts is not None]
            else:
                counts = [t.magnitude_counts for t in members]
            # Summed in place: stacking first would copy every tensor's histogram at once.
            merged = counts[0].clone()
            for more in counts[1:]:
                merged += more
            self._thresholds[key] = _fraction_keys(merged, self.axes[2])
        return self._thresholds[key][fraction]

    def result(self, index: int, point: Point, metric: str) -> TrialResult:
        return self.results([index], point, metric)[0]

    def results(
        self,
        indices: Sequence[int],
        point: Point,
        metric: str,
        stop: Optional[Callable[[int, TrialResult], bool]] = None,
    ) -> list[TrialResult]:
        """The trial results of the tensors ``indices`` at ``point``, run side by side; with
        ``stop(index, result)``, only up to the first for which it is true (the tensors after
        it are not run: :func:`run_trials`)."""
        requests = []
        for index in indices:
            trial = self.trials[index]
            if trial.has_sensitivity and index not in self._announced:
                self._announced.add(index)
                trial.expect_sensitivity_cuts(
                    [self._threshold(trial.layer_type, SENSITIVITY, fraction) for fraction in self.axes[2]],
                    self.axes[3],
                )
            config = self.config(index, point, metric)
            if metric == SENSITIVITY and not trial.has_sensitivity:
                config = TrialConfig(config.bins, config.prune, config.protect, MAGNITUDE)
            threshold = self._threshold(trial.layer_type, config.metric, config.prune)
            init = self.init.get(index)
            if init is not None and init.numel() != config.bins:
                init = None
            requests.append((trial, config, threshold, init))
        if stop is None:
            return run_trials(requests)
        return run_trials(requests, lambda position, result: stop(indices[position], result))

    def _first_over(
        self, indices: Sequence[int], point: Point, metric: str, over: Callable[[int, TrialResult], bool]
    ) -> tuple[Optional[int], list[tuple[int, TrialResult]]]:
        """The first of ``indices`` (in order) whose result is ``over`` its bound (None if
        none is), and the results up to it: exactly what running them one by one until then
        gives. They run side by side in growing groups, so a point decided by its first
        tensor (the usual infeasible point) costs one trial."""
        seen: list[tuple[int, TrialResult]] = []
        start, size = 0, 1
        while start < len(indices):
            group = indices[start : start + size]
            for index, result in zip(group, self.results(group, point, metric, over)):
                seen.append((index, result))
                if over(index, result):
                    return index, seen
            start, size = start + size, size * 4
        return None, seen

    def tensor_error(self, index: int, point: Point, metric: str) -> float:
        """The proxy's judgement of one tensor at ``point``: its error over its budget share."""
        return self.result(index, point, metric).error / self.scales.get(index, 1.0)

    def own_budget(self, index: int) -> float:
        """The largest proxy error tensor ``index`` may have on its own (inf: no bound of its
        own, with ``evaluate`` judging the model)."""
        if self.evaluate is None:
            return self.scales.get(index, 1.0) * self.budget
        return self.caps.get(index, math.inf)

    def within_own_budget(self, index: int, point: Point, metric: str) -> bool:
        return self.within_own_budgets([index], point, metric)[0]

    def within_own_budgets(self, indices: Sequence[int], point: Point, metric: str) -> list[bool]:
        """:meth:`within_own_budget` of each of ``indices`` (their trials run side by side).

        A tensor whose error floor at this point (:meth:`WeightTrial.error_floor`) is
        already over its budget is over it without a trial: at a delta, most of a
        fine-tune's trained weights have budgets under the sketch's own spread (MiniLM's
        seed-0 run: 169 of its 243 trials here; at its fourth save budgets of 1/40 to 2/3
        of it), and their trials at the least aggressive point took 9 % of each delta's
        time to say so (69 -> 16 ms; ``benchmarks/save_stages.py``)."""
        protect = self.axes[3][point[3]]
        if self.evaluate is None:
            over = {i for i in indices if self.trials[i].error_floor(protect) / self.scales.get(i, 1.0) > self.budget}
            tried = [i for i in indices if i not in over]
            errors = dict(zip(tried, (result.error for result in self.results(tried, point, metric))))
            return [i not in over and not errors[i] / self.scales.get(i, 1.0) > self.budget for i in indices]
        capped = [i for i in indices if i in self.caps]
        over = {i for i in capped if self.trials[i].error_floor(protect) > self.caps[i]}
        tried = [i for i in capped if i not in over]
        errors = dict(zip(tried, (result.error for result in self.results(tried, point, metric))))
        return [i not in capped or (i not in over and errors[i] <= self.caps[i]) for i in indices]

    def _hardest_first(self, indices: Iterable[int]) -> list[int]:
        # The tensor that put the last point over budget goes first: it usually fails again.
        order = list(indices)
        if self._hardest in order:
            order.remove(self._hardest)
            order.insert(0, self._hardest)
        return order

    def _within_caps(self, point: Point, metric: str) -> bool:
        failed, _ = self._first_over(
            self._hardest_first(self.caps), point, metric, lambda index, result: not result.error <= self.caps[index]
        )
        if failed is not None:
            self._hardest = failed
        return failed is None

    def refine(self, point: Point, metric: str, floors: Optional[dict[int, int]] = None) -> int:
        """Give each tensor the fewest bins that keep *its own* error within budget (proxy only).

        The cube shares one bin count among all tensors (one among embeddings), so the
        hardest tensor decides it for all; under the proxy every tensor's error is judged
        alone, so each may go coarser on its own. Walks each tensor's bin axis from the
        chosen setting towards fewer bins and stops at the first one over budget.
        Returns the number of trial runs (part of the search cost). The point's quality
        stays within budget; :meth:`config`, :meth:`result` and :meth:`quality` use the
        refined bins from now on. ``floors`` (index -> bins) are the fewest bins a tensor may
        get: with them, a tensor is never stored coarser than before (and is raised to its
        floor when the shared setting is coarser).
        """
        floors = floors or {}
        walks: dict[int, tuple[Sequence[int], int]] = {}  # index -> (its bin axis, position)
        for index in self.trials:
            axis, position = (self.axes[1], point[1]) if index in self.embedding else (self.axes[0], point[0])
            if axis[position] < floors.get(index, 0):
                self.refined[(index, point, metric)] = floors[index]
            walks[index] = (axis, position)
        if self.evaluate is not None:
            return 0
        # The tensors walk their axes side by side, one step each per round (each tensor's
        # trials run in the order they would alone, so warm starts are the same).
        walking = list(self.trials)
        errors = {index: error / self.scales.get(index, 1.0) for index, error in self._errors(walking, point, metric)}
        chosen = {index: self.config(index, point, metric).bins for index in walking}
        runs = 0
        step = 1
        while walking:
            stepping = []
            for index in walking:
                axis, position = walks[index]
                if position + step < len(axis) and axis[position + step] >= floors.get(index, 0):
                    self.refined[(index, point, metric)] = axis[position + step]
                    stepping.append(index)
            runs += len(stepping)
            walking = []
            for index, error in self._errors(stepping, point, metric):
                error /= self.scales.get(index, 1.0)
                if error > self.budget:
                    continue
                chosen[index], errors[index] = walks[index][0][walks[index][1] + step], error
                walking.append(index)
            step += 1
        for index, bins in chosen.items():
            self.refined[(index, point, metric)] = bins
        self._quality[(point, metric)] = max(errors.values(), default=0.0)
        return runs

    def _errors(self, indices: Sequence[int], point: Point, metric: str) -> list[tuple[int, float]]:
        return [(index, result.error) for index, result in zip(indices, self.results(indices, point, metric))]

    # -- quality and feasibility
    def quality(self, point: Point, metric: str) -> float:
        """Proxy: the largest relative squared error (plain or Fisher-weighted) of any
        tensor; with ``evaluate``: the relative quality loss."""
        key = (point, metric)
        if key not in self._quality:
            if self.evaluate is None:
                results = self.results(list(self.trials), point, metric)
                self._quality[key] = max(r.error / self.scales.get(i, 1.0) for i, r in zip(self.trials, results))
            elif not self._within_caps(point, metric):
                self._quality[key] = math.inf  # decided without calling evaluate
            else:
                self._quality[key] = self._evaluated_loss(point, metric)
        return self._quality[key]

    def feasible(self, point: Point, metric: str) -> bool:
        """Whether ``point`` meets the budget. Under the proxy an infeasible point is known
        at its first tensor over budget: the tensor that failed last is tried first (it
        usually fails again), and the others are not run at all."""
        self.evaluations += 1
        key = (point, metric)
        if self.evaluate is not None or key in self._quality:
            return self.quality(point, metric) <= self.budget
        failed, seen = self._first_over(
            self._hardest_first(self.trials), point, metric,
            lambda index, result: result.error / self.scales.get(index, 1.0) > self.budget,
        )
        if failed is not None:
            self._hardest = failed
            return False
        self._quality[key] = max((result.error / self.scales.get(i, 1.0) for i, result in seen), default=0.0)
        return True

    def _model_state(self, replace: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The model state_dict: the leaves under the key-path prefix holding the most weights,
        # a tied tensor under each of its keys (a strict load_state_dict wants them all).
        prefixes: dict[tuple, int] = {}
        for index in self.trials:
            prefix = self.leaves[index].path[:-1]
            prefixes[prefix] = prefixes.get(prefix, 0) + 1
        prefix = max(prefixes, key=lambda p: prefixes[p])
        return {
            str(path[-1]): replace.get(index, leaf.tensor)
            for index, leaf in enumerate(self.leaves)
            for path in (leaf.path, *leaf.aliases)
            if path and path[:-1] == prefix
        }

    def _evaluated_loss(self, point: Point, metric: str) -> float:
        return self.relative_loss({i: self.dequantize(i, point, metric) for i in self.trials})

    def relative_loss(self, replaced: dict[int, torch.Tensor]) -> float:
        """``(evaluate(model with these tensors) - evaluate(model)) / |evaluate(model)|``."""
        if self._baseline is None:
            baseline = _quality_value(self.evaluate(self._model_state({})))  # type: ignore[misc]
            if not math.isfinite(baseline):
                raise ValueError(
                    f"DynaQuant's evaluate returned {baseline} for the model as it is, before any "
                    "quantization: nothing can be judged against that. It must return a finite "
                    "number, lower is better (a diverged model's loss is not finite)"
                )
            self._baseline = baseline
        value = _quality_value(self.evaluate(self._model_state(replaced)))  # type: ignore[misc]
        if not math.isfinite(value):
            return math.inf
        return (value - self._baseline) / max(abs(self._baseline), 1e-12)

    def dequantize(self, index: int, point: Point, metric: str) -> torch.Tensor:
        """The weight as the configuration stores it (nearest levels, no delta stickiness)."""
        trial, result = self.trials[index], self.result(index, point, metric)
        table = result.table
        ids = assign_ids(trial.keys, table.to(trial.flat.device), result.prune_mask, result.protect_mask)
        positions = positions_of(ids, table.protect_id)
        tensor = self.leaves[index].tensor
        protected = trial.flat[positions].to(torch.float16 if tensor.dtype == torch.float16 else torch.bfloat16)
        return reconstruct(ids, table, protected, tensor.dtype, tuple(tensor.shape), positions)

    # -- compression estimate (steers the search; grows with aggressiveness)
    def score(self, point: Point) -> float:
        prune, protect = self.axes[2][point[2]], self.axes[3][point[3]]
        bits = 0.0
        for index, trial in self.trials.items():
            bins = self.axes[1][point[1]] if index in self.embedding else self.axes[0][point[0]]
            bits += trial.numel * ((1.0 - prune) * math.log2(bins + 1) + 16.0 * protect)
        return -bits

    # -- the searches
    def search(
        self, previous: Optional[tuple[Point, str]], radius: int, allow_more_aggressive: bool = True
    ) -> tuple[Optional[Point], str, str]:
        """``(point, metric, kind)``: guided search the first time, neighbourhood search after
        (more aggressive neighbours only when ``allow_more_aggressive``)."""
        valid = previous is not None and len(previous[0]) == len(self.shape) and all(
            0 <= p < n for p, n in zip(previous[0], self.shape)
        )
        if valid:
            centre, metric = previous  # type: ignore[misc]
            if metric not in self.metrics:
                metric = MAGNITUDE
            for other in self.metrics:
                # Switch metric when the other one is clearly better at the same point.
                if other != metric and self.quality(centre, other) < 0.8 * self.quality(centre, metric):
                    metric = other
            found = neighbourhood_search(
                self.shape, self.oracles[metric], self.score, centre, radius, allow_more_aggressive
            )
            if found is not None:
                return found, metric, "neighbourhood"
            # Nothing near the previous best: search the whole cube again. The guided search
            # is exhaustive under monotone quality (every point is decided, most by dominance).
            best = self._best_over_metrics(guided_search)
            kind = "neighbourhood+exhaustive"
        else:
            best = self._best_over_metrics(guided_search)
            kind = "guided"
        return (best[0], best[1], kind) if best is not None else (None, MAGNITUDE, kind)

    def _best_over_metrics(self, method: Callable[..., Optional[Point]]) -> Optional[tuple[Point, str]]:
        found = []
        for metric in self.metrics:
            point = method(self.shape, self.oracles[metric], self.score)
            if point is not None:
                found.append((self.score(point), -self.quality(point, metric), point, metric))
        if not found:
            return None
        _, _, point, metric = max(found)
        return point, metric


def _quality_value(value: Any) -> float:
    """What the user's ``evaluate`` returned, as a float: a real number or a one-element tensor.

    Raises:
        TypeError: anything else (a string, a bool, a tensor of many elements, None).
    """
    many = torch.is_tensor(value) and value.numel() != 1
    if not isinstance(value, (str, bytes, bool)) and not many:
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(
        "DynaQuant's evaluate must return a number (lower is better), "
        f"got {type(value).__name__}: {value!r:.60}"
    )
