"""What a quantization configuration would do to a weight tensor, answered from its sketch.

A :class:`WeightTrial` holds one weight tensor's signed sketch keys, their
histogram, and the same histogram weighted by the quality proxy's element
weights (a diagonal Fisher estimate when one is known). For a
:class:`TrialConfig` it returns the prune / protect thresholds (and element
masks when a sensitivity score decides), the fitted centroids, the proxy (the
larger of the plain and the Fisher-weighted relative squared error) and an
estimate of the coded size — without touching
the elements again when magnitude decides (whole buckets are pruned or
protected); when sensitivity decides, from a table of (key, sensitivity class)
cells made in one pass, whose class boundaries are the search's cuts. The
error counts every bucket at its centre plus the spread inside it, so it tracks
the real quantization error to the sketch's accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..codecs._parallel import parallel_map_sized
from ..codecs.dynaquant import magnitude_thresholds
from ..codecs.log_sketch import ALPHA, MAGNITUDE_KEYS, SIGNED_KEYS, magnitude_keys, signed_keys
from ..codecs.nonuniform_quantizer import (
    FIRST_NON_FINITE_KEY,
    LINEAR,
    LevelTable,
    key_centres,
    make_level_table,
)
from ..codecs.weighted_kmeans import KMeansProblem, float32_levels_batch, histogram_sample_weights

__all__ = ["TrialConfig", "TrialResult", "WeightTrial", "MAGNITUDE", "SENSITIVITY", "quantile_key", "run_trials"]

MAGNITUDE, SENSITIVITY = "magnitude", "sensitivity"
#: Pruned error counts this many times in the proxy: pruning moves every pruned weight the
#: same way (towards zero), which the benchmark showed hurts more than random rounding
#: error of the same size (docs/dynaquant.md). Pruned elements are also weighted by the
#: tensor's mean proxy weight rather than their own.
PRUNE_PENALTY = 2.0
# A value is spread uniformly over its bucket (about 2 * ALPHA of it wide): variance (2a)^2/12.
_SPREAD = (2.0 * ALPHA) ** 2 / 12.0
_MAGNITUDE_OF_KEY = torch.arange(SIGNED_KEYS) & (MAGNITUDE_KEYS - 1)


@dataclass(frozen=True)
class TrialConfig:
    """One point of the configuration cube, for one tensor."""

    bins: int
    prune: float
    protect: float
    metric: str = MAGNITUDE


@dataclass
class TrialResult:
    """A configuration applied to one tensor (what the codec needs, and the proxy's view)."""

    table: LevelTable
    prune_mask: Optional[torch.Tensor]
    protect_mask: Optional[torch.Tensor]
    #: the proxy: the larger of the plain and the Fisher-weighted relative squared error,
    #: pruned elements counted PRUNE_PENALTY times (and at the mean Fisher weight)
    error: float
    estimated_bits: float
    pruned_error: float = 0.0  # sum of w^2 over the pruned elements


class _ClassTable(NamedTuple):
    """Element counts and proxy mass per (signed key, sensitivity class); the rows of the
    occupied keys only. Class ``c``: ``c`` of the sorted ``boundaries`` are <= the
    element's sensitivity key."""

    boundaries: list[int]
    rows: torch.Tensor
    counts: torch.Tensor
    mass: torch.Tensor


def quantile_key(counts: torch.Tensor, fraction: float) -> int:
    """The smallest key whose cumulative count reaches ``fraction`` of the total (-1 for none)."""
    total = int(counts.sum())
    if fraction <= 0 or total == 0:
        return -1
    cumulative = torch.cumsum(counts, 0)
    target = torch.tensor(math.ceil(min(fraction, 1.0) * total), dtype=cumulative.dtype)
    return int(torch.searchsorted(cumulative, target))


class WeightTrial:
    """Sketches of one weight tensor that answer trial configurations.

    Args:
        tensor: the weight.
        layer_type: its layer type (prune thresholds are shared per type).
        proxy_weights: per-element weights of the quality proxy (e.g. a Fisher diagonal), or None.
        sensitivity: per-element sensitivity scores ``|g * w|``, or None.
        sigma: k-means sample-weight balance.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        layer_type: str,
        proxy_weights: Optional[torch.Tensor],
        sensitivity: Optional[torch.Tensor],
        sigma: float,
    ) -> None:
        flat = tensor.detach().reshape(-1)
        self.flat = flat
        self.numel = flat.numel()
        self.layer_type = layer_type
        self.sigma = sigma
        self.keys = signed_keys(flat)
        self.counts = torch.bincount(self.keys, minlength=SIGNED_KEYS).cpu()
        self.weights = None
        if proxy_weights is not None:
            self.weights = proxy_weights.detach().reshape(-1).float()
            self.mass = torch.bincount(self.keys, weights=self.weights, minlength=SIGNED_KEYS).double().cpu()
            self.mean_weight = float(self.mass.sum()) / max(self.numel, 1)
        else:
            self.mass = self.counts.double()
            self.mean_weight = 1.0
        self._centres = key_centres()
        self.total = float((self.mass * self._centres**2).sum()) * (1 + _SPREAD)
        self.total_plain = float((self.counts.double() * self._centres**2).sum()) * (1 + _SPREAD)
        self.magnitude_counts = self.counts[:MAGNITUDE_KEYS] + self.counts[MAGNITUDE_KEYS:]
        self.sensitivity_keys = magnitude_keys(sensitivity) if sensitivity is not None else None
        self.sensitivity_counts = None
        if self.sensitivity_keys is not None:
            self.sensitivity_counts = torch.bincount(self.sensitivity_keys, minlength=MAGNITUDE_KEYS).cpu()
        self._cache: dict[tuple, object] = {}
        self._classes: Optional[_ClassTable] = None
        self._seeds: dict[int, torch.Tensor] = {}
        self._expected_bounds: set[int] = set()

    @property
    def has_sensitivity(self) -> bool:
        return self.sensitivity_keys is not None

    def expect_sensitivity_cuts(self, prune_thresholds: Sequence[int], protect_fractions: Sequence[float]) -> None:
        """Announce the sensitivity prune thresholds and protect fractions a search may try,
        so that the class table behind sensitivity trials is built in one pass."""
        if self.sensitivity_counts is None:
            return
        self._expected_bounds.update(threshold for threshold in prune_thresholds if threshold > 0)
        for fraction in protect_fractions:
            if fraction > 0:
                self._expected_bounds.add(quantile_key(self.sensitivity_counts, 1.0 - fraction) + 1)

    def _class_table(self, bounds: set[int]) -> "_ClassTable":
        """Counts and proxy mass per (occupied signed key, sensitivity class), with ``bounds``
        among the class boundaries.

        Class ``c`` holds the elements with exactly ``c`` boundaries at or below their
        sensitivity key, so every prune threshold and protect cut of the search is a class
        boundary and a trial's kept histogram is a sum over classes, not a pass over the
        elements. Made in one pass, again only if a boundary that was not announced
        (:meth:`expect_sensitivity_cuts`) is asked for.
        """
        table = self._classes
        if table is not None and bounds <= set(table.boundaries):
            return table
        sensitivity_keys = self.sensitivity_keys
        if sensitivity_keys is None:
            raise RuntimeError("a sensitivity class table needs sensitivity scores")
        known = set(table.boundaries) if table is not None else set()
        boundaries = sorted(known | bounds | self._expected_bounds)
        device = self.keys.device
        classes = len(boundaries) + 1
        # The class of every sensitivity key, looked up per element (a search per element
        # costs ~10x more); cells in int32 (SIGNED_KEYS * classes is far below 2**31).
        edges = torch.tensor(boundaries, dtype=torch.int32, device=device)
        class_of_key = torch.bucketize(
            torch.arange(MAGNITUDE_KEYS, dtype=torch.int32, device=device), edges, right=True, out_int32=True
        )
        cell = self.keys * classes + class_of_key[sensitivity_keys]
        counts = torch.bincount(cell, minlength=SIGNED_KEYS * classes).view(SIGNED_KEYS, classes)
        if self.weights is None:
            mass = counts.double()
        else:
            mass = torch.bincount(cell, weights=self.weights, minlength=SIGNED_KEYS * classes).double()
            mass = mass.view(SIGNED_KEYS, classes)
        # Only the occupied keys are kept (a few thousand rows of SIGNED_KEYS).
        rows = torch.nonzero(counts.sum(1)).reshape(-1)
        self._classes = _ClassTable(boundaries, rows.cpu(), counts[rows].cpu(), mass[rows].cpu())
        return self._classes

    def _sensitivity_prune(self, threshold: int) -> Optional[torch.Tensor]:
        if threshold <= 0 or self.sensitivity_keys is None:
            return None
        key = ("prune", threshold)
        if key not in self._cache:
            self._cache[key] = self.sensitivity_keys < threshold
        return self._cache[key]  # type: ignore[return-value]

    def _sensitivity_protect(self, fraction: float) -> tuple[Optional[torch.Tensor], int]:
        """The elements a sensitivity protect ``fraction`` keeps in 16 bits (None if none),
        and the cut: those with a sensitivity key above it."""
        key = ("protect", fraction)
        if key not in self._cache:
            mask, cut = None, -1
            if fraction > 0 and self.sensitivity_counts is not None:
                cut = quantile_key(self.sensitivity_counts, 1.0 - fraction)
                mask = self.sensitivity_keys > cut
                if not bool(mask.any()):
                    mask = None
            self._cache[key] = (mask, cut)
        return self._cache[key]  # type: ignore[return-value]

    def error_floor(self, protect: float) -> float:
        """A floor under the proxy error (plain, so under the larger of plain and weighted)
        of every trial that protects the fraction ``protect``, whatever its levels and
        pruning: each value that is not protected costs at least its bucket's spread
        (pruned values cost more), and the protected ones are at most those above the
        magnitude cut plus the largest ``protect`` share of the rest (the sensitivity
        cut's). A tensor whose floor is over its budget needs no trial to be over it.
        0 where nothing is known (everything protected, a total that is not finite)."""
        key = ("floor", protect)
        if key not in self._cache:
            self._cache[key] = self._error_floor(protect)
        return self._cache[key]  # type: ignore[return-value]

    def _error_floor(self, protect: float) -> float:
        if not (math.isfinite(self.total_plain) and self.total_plain > 0) or protect >= 1.0:
            return 0.0
        last = self._protect_above(protect)  # magnitude keys above it are protected
        counts = self.magnitude_counts[: last + 1].double()
        energy = counts * self._centres[: last + 1] ** 2
        if self.sensitivity_counts is not None and protect > 0:
            # The sensitivity cut protects at most floor(protect * numel) values (one more
            # for rounding): taken from the largest magnitudes down, the most they can hold.
            take = float(int(protect * self.numel) + 1)
            above = torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0])  # values at or above each key
            whole = above <= take  # keys all of whose values may be protected
            energy = torch.where(whole, torch.zeros_like(energy), energy)
            partial = int(torch.count_nonzero(~whole)) - 1  # the highest key not wholly taken
            if partial >= 0:
                taken = take - (float(above[partial + 1]) if partial + 1 < above.numel() else 0.0)
                energy[partial] -= max(taken, 0.0) * float(self._centres[partial]) ** 2
        floor = _SPREAD * float(energy.sum()) / self.total_plain
        return floor * (1.0 - 1e-9) if math.isfinite(floor) and floor > 0 else 0.0

    def _protect_above(self, fraction: float) -> int:
        key = ("protect_above", fraction)
        if key not in self._cache:
            self._cache[key] = magnitude_thresholds(self.counts, 0.0, fraction)[1]
        return self._cache[key]  # type: ignore[return-value]

    def _kept(
        self,
        prune_below: int,
        protect_above: int,
        prune_below_sensitivity: Optional[int],
        protect_above_sensitivity: Optional[int],
    ) -> "_KeptHistogram":
        """What stays after pruning and protecting, as the occupied buckets only.

        Magnitude prunes keys below ``prune_below`` and protects keys above
        ``protect_above``; where sensitivity decides too, elements with a sensitivity key
        below ``prune_below_sensitivity`` are pruned and above ``protect_above_sensitivity``
        protected (None: not by sensitivity). Shared by every trial with the same
        thresholds (they differ in bins and warm start only).
        """
        key = ("kept", prune_below, protect_above, prune_below_sensitivity, protect_above_sensitivity)
        if key in self._cache:
            return self._cache[key]  # type: ignore[return-value]
        pruned_buckets = _MAGNITUDE_OF_KEY < prune_below
        protected_buckets = _MAGNITUDE_OF_KEY > protect_above
        if prune_below_sensitivity is None and protect_above_sensitivity is None:
            # Magnitude decides alone: whole buckets are pruned (error x^2) or protected (~0).
            removed = pruned_buckets | protected_buckets
            counts = torch.where(removed, 0, self.counts)
            mass = torch.where(removed, 0.0, self.mass)
            pruned_buckets &= ~protected_buckets
            pruned_counts = torch.where(pruned_buckets, self.counts, 0)
            pruned_count = float(torch.where(pruned_buckets, self.counts, 0).sum())
            protected_count = float(torch.where(protected_buckets, self.counts, 0).sum())
        else:
            # Per (key, sensitivity class) cell, which is pruned, protected or kept.
            bounds = set()
            if prune_below_sensitivity is not None:
                bounds.add(prune_below_sensitivity)
            if protect_above_sensitivity is not None:
                bounds.add(protect_above_sensitivity + 1)
            table = self._class_table(bounds)
            boundaries, rows, cell_counts, cell_mass = table.boundaries, table.rows, table.counts, table.mass
            classes = torch.arange(len(boundaries) + 1)
            by_sensitivity_pruned = torch.zeros(classes.numel(), dtype=torch.bool)
            by_sensitivity_protected = torch.zeros(classes.numel(), dtype=torch.bool)
            if prune_below_sensitivity is not None:
                by_sensitivity_pruned = classes <= boundaries.index(prune_below_sensitivity)
            if protect_above_sensitivity is not None:
                by_sensitivity_protected = classes > boundaries.index(protect_above_sensitivity + 1)
            protected = protected_buckets[rows, None] | by_sensitivity_protected[None, :]
            pruned = (pruned_buckets[rows, None] | by_sensitivity_pruned[None, :]) & ~protected
            kept_cells = ~(protected | pruned)
            counts = torch.zeros(SIGNED_KEYS, dtype=cell_counts.dtype)
            counts[rows] = torch.where(kept_cells, cell_counts, 0).sum(1)
            mass = torch.zeros(SIGNED_KEYS, dtype=torch.float64)
            mass[rows] = torch.where(kept_cells, cell_mass, 0.0).sum(1)
            pruned_counts = torch.zeros(SIGNED_KEYS, dtype=cell_counts.dtype)
            pruned_counts[rows] = torch.where(pruned, cell_counts, 0).sum(1)
            pruned_count = float(pruned_counts.sum())
            protected_count = float(torch.where(protected, cell_counts, 0).sum())
        # Pruned elements are weighted by the tensor's mean proxy weight, not their own: a
        # weight whose gradient is small now (a tiny Fisher estimate) need not stay
        # unimportant, and zeroing many of them at once moves the model coherently.
        pruned_plain = float((pruned_counts.double() * self._centres**2).sum()) * (1 + _SPREAD)
        counts = counts.clamp_min(0)
        occupied = torch.nonzero(counts).reshape(-1)
        kept = _KeptHistogram(
            occupied, self._centres[occupied], counts[occupied], mass[occupied].clamp_min(0),
            pruned_plain, pruned_count, protected_count, self.sigma,
        )
        self._cache[key] = kept
        return kept

    def run(self, config: TrialConfig, prune_threshold: int, init: Optional[torch.Tensor] = None) -> TrialResult:
        """Thresholds, masks, levels, proxy error and size estimate of ``config``.

        ``prune_threshold`` is the layer type's key threshold for ``config.prune``: a
        magnitude key (magnitude metric) or a sensitivity key (sensitivity metric);
        elements with a smaller key are pruned.
        """
        return run_trials([(self, config, prune_threshold, init)])[0]

    def _pending(self, config: TrialConfig, prune_threshold: int, init: Optional[torch.Tensor]) -> "TrialResult | _Pending":
        """The cached result of ``config``, or what is left to fit for it."""
        cache_key = ("run", config.bins, config.metric, prune_threshold, config.protect)
        if cache_key in self._cache:
            return self._cache[cache_key]  # type: ignore[return-value]
        protect_above = self._protect_above(config.protect)
        use_sensitivity = config.metric == SENSITIVITY and self.has_sensitivity
        prune_below = 1 if use_sensitivity else max(prune_threshold, 1)
        prune_mask = self._sensitivity_prune(prune_threshold) if use_sensitivity else None
        protect_mask, protect_cut = self._sensitivity_protect(config.protect)
        kept = self._kept(
            prune_below, protect_above,
            prune_threshold if prune_mask is not None else None,
            protect_cut if protect_mask is not None else None,
        )
        if init is None:
            init = self._seeds.get(config.bins)
        return _Pending(cache_key, config.bins, kept, prune_mask, protect_mask, prune_below, protect_above, init)

    def _finish(self, pending: "_Pending", centroids: torch.Tensor) -> TrialResult:
        """The result of a pending trial with its fitted ``centroids`` (cached)."""
        kept = pending.kept
        if centroids.numel() == pending.bins:
            self._seeds[pending.bins] = centroids  # warm start for this save's other trials
        table = make_level_table(centroids, LINEAR, pending.prune_below, pending.protect_above)
        # Only the kept buckets carry mass here: their nearest centroid is all that matters.
        levels = centroids.double()
        nearest = kept.nearest(levels) if centroids.numel() else torch.zeros_like(kept.keys)
        chosen = levels[nearest] if centroids.numel() else torch.zeros_like(kept.centres)
        squared = (kept.centres - chosen) ** 2 + _SPREAD * kept.centres**2
        rounding_plain = float((kept.counts.double() * squared).sum())
        rounding_weighted = float((kept.mass * squared).sum())
        # Both the plain and the Fisher-weighted relative error must stay small: the
        # Fisher estimate of a few training steps can be far from what a (pretrained)
        # model needs everywhere.
        pruned_plain = kept.pruned_plain
        error = (PRUNE_PENALTY * pruned_plain + rounding_plain) / max(self.total_plain, 1e-300)
        if self.weights is not None:
            weighted = (PRUNE_PENALTY * self.mean_weight * pruned_plain + rounding_weighted) / max(self.total, 1e-300)
            error = max(error, weighted)
        id_counts = torch.bincount(nearest, weights=kept.counts.double(), minlength=max(centroids.numel(), 1))
        id_counts = torch.cat([id_counts, torch.tensor([kept.pruned_count, kept.protected_count])])
        probabilities = id_counts[id_counts > 0] / max(float(id_counts.sum()), 1.0)
        entropy = float(-(probabilities * torch.log2(probabilities)).sum()) * self.numel
        result = TrialResult(
            table, pending.prune_mask, pending.protect_mask, max(error, 0.0),
            entropy + 16 * kept.protected_count + 32 * table.count, pruned_plain,
        )
        self._cache[pending.cache_key] = result
        return result


class _Pending(NamedTuple):
    """A trial waiting for its levels."""

    cache_key: tuple
    bins: int
    kept: "_KeptHistogram"
    prune_mask: Optional[torch.Tensor]
    protect_mask: Optional[torch.Tensor]
    prune_below: int
    protect_above: int
    init: Optional[torch.Tensor]


def run_trials(
    requests: Sequence[tuple[WeightTrial, TrialConfig, int, Optional[torch.Tensor]]],
    stop: Optional[Callable[[int, TrialResult], bool]] = None,
) -> list[TrialResult]:
    """``trial.run(config, prune_threshold, init)`` of every request, their k-means side by
    side; each result exactly what the trial's own ``run`` gives at this point (a trial's
    later runs warm-start from its earlier ones, so each trial may appear once).

    ``stop(position, result)``, called in request order, ends the runs early: the results
    up to the first for which it is true are returned, and the trials after it are left
    as if they had not run (nothing cached, no warm start kept), so a caller that would
    have stopped there running them one by one sees the same trials afterwards.

    Raises:
        ValueError: a trial appears twice.
    """
    trials = [request[0] for request in requests]
    if len({id(trial) for trial in trials}) != len(trials):
        raise ValueError("run_trials runs each trial once per call")
    # What each trial keeps is found side by side: a trial's first sensitivity request
    # makes its class table, a pass over all of its elements.
    pending = parallel_map_sized(
        lambda request: request[0]._pending(*request[1:]), requests, [4 * trial.numel for trial in trials]
    )
    waiting = [step for step in pending if isinstance(step, _Pending)]
    problems = [step.kept.problem(step.bins, step.init) for step in waiting]
    fitted = iter(float32_levels_batch([problem for problem in problems if problem is not None]))
    levels = {id(step): next(fitted) if problem is not None else None for step, problem in zip(waiting, problems)}
    results: list[TrialResult] = []
    for position, (trial, step) in enumerate(zip(trials, pending)):
        if isinstance(step, _Pending):
            centroids = levels[id(step)]
            step = trial._finish(step, centroids if centroids is not None else torch.empty(0, dtype=torch.float32))
        results.append(step)
        if stop is not None and stop(position, step):
            break
    return results


class _KeptHistogram:
    """The occupied buckets that a prune / protect setting keeps, in key order.

    Args:
        keys: the occupied signed keys; centres, counts, mass: theirs.
        pruned_plain, pruned_count, protected_count: what the setting removes.
        sigma: k-means sample-weight balance.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        centres: torch.Tensor,
        counts: torch.Tensor,
        mass: torch.Tensor,
        pruned_plain: float,
        pruned_count: float,
        protected_count: float,
        sigma: float,
    ) -> None:
        self.keys, self.centres, self.counts, self.mass = keys, centres, counts, mass
        self.pruned_plain, self.pruned_count, self.protected_count = pruned_plain, pruned_count, protected_count
        # fit_centroids' linear-domain points: the non-zero, finite buckets.
        usable = (keys != 0) & (keys != MAGNITUDE_KEYS) & torch.isfinite(centres)
        usable &= (keys & (MAGNITUDE_KEYS - 1)) < FIRST_NON_FINITE_KEY
        self._points = centres[usable]
        self._weights = histogram_sample_weights(self._points, counts[usable], sigma) if bool(usable.any()) else None
        self._order = torch.argsort(centres)
        self._sorted = centres[self._order]

    def problem(self, bins: int, init: Optional[torch.Tensor]) -> Optional[KMeansProblem]:
        """The k-means of ``fit_centroids(kept histogram, bins, sigma, LINEAR, init)``, on the
        occupied buckets alone (no pass over the whole key space); None when no bucket is
        left to fit (no levels)."""
        if self._weights is None:
            return None
        return KMeansProblem(self._points, self._weights, bins, init)

    def nearest(self, levels: torch.Tensor) -> torch.Tensor:
        """``nearest_level(centres, levels)``: one search per boundary over the sorted centres
        instead of one per bucket (a per-bucket search starts a thread team per call)."""
        index = torch.zeros_like(self.keys)
        if levels.numel() > 1:
            boundaries = (levels[1:] + levels[:-1]) / 2
            # A centre lies above boundary j exactly when its sorted position is at least the
            # number of centres up to that boundary.
            ends = torch.searchsorted(self._sorted, boundaries, right=True)
            above = torch.cumsum(torch.bincount(ends, minlength=self._sorted.numel() + 1), 0)[:-1]
            index[self._order] = above
        return index
