"""Symmetric levels around an exact zero for first moments, fitted for many moments at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..codecs.log_sketch import MAGNITUDE_KEYS, magnitude_keys
from ..codecs.nonuniform_quantizer import FIRST_NON_FINITE_KEY, key_centres
from ..codecs.weighted_kmeans import KMeansProblem, float32_levels_batch, histogram_sample_weights

__all__ = ["zero_level_hints_for", "zero_level_hints_batch"]

def zero_level_hints_for(counts: torch.Tensor, bins: int, sigma: float) -> dict[str, Any]:
    """Symmetric levels ``0, +-c_1, ..., +-c_k`` (``k = bins // 2``) for a first moment.

    Entries nearer 0 than ``c_1`` become 0; every other entry keeps its sign and is at
    most doubled. Plain k-means on the signed values had neither guarantee: an entry far
    smaller than the smallest level was rounded up to it, or to a level of the other
    sign when its own side had no small level, and with its small second moment the
    restored Adam step ``m / sqrt(v)`` of that parameter was then many times too large,
    or reversed, for ~10 steps (on the MiniLM fine-tune 4 levels made 0.8% of the steps
    3x larger than the largest true step, and the failure runs lost half the accuracy).
    Rounded to 0, such an entry's momentum only restarts.
    """
    return zero_level_hints_batch([(counts, bins)], sigma)[0]


class _FoldedHistogram:
    """A first moment's histogram folded onto magnitudes: its occupied non-zero finite
    buckets in key order. Every fit of :func:`zero_level_hints_batch` is on a suffix of
    them (what fit_centroids would select from the folded histogram, without its passes
    over the whole key space)."""

    def __init__(self, counts: torch.Tensor, bins: int, sigma: float) -> None:
        magnitude = counts[:MAGNITUDE_KEYS] + counts[MAGNITUDE_KEYS:]  # all mass on the + side
        keys = torch.nonzero(magnitude[:FIRST_NON_FINITE_KEY]).reshape(-1)
        keys = keys[keys != 0]
        centres = key_centres()[keys]
        finite = torch.isfinite(centres)
        self.keys, self.centres = keys[finite], centres[finite]
        self.occupied = magnitude[self.keys]
        self.half = max(bins // 2, 1)
        self.sigma = sigma

    def problem(self, start: int, init: Optional[torch.Tensor]) -> Optional[KMeansProblem]:
        """The fit on the buckets from magnitude key ``start`` up (None: none is occupied)."""
        kept = self.keys >= start
        if not bool(kept.any()):
            return None
        weights = histogram_sample_weights(self.centres[kept], self.occupied[kept], self.sigma)
        return KMeansProblem(self.centres[kept], weights, self.half, init)


def _fit_folded(requests: Sequence[tuple[_FoldedHistogram, int, Optional[torch.Tensor]]]) -> list[torch.Tensor]:
    """The levels of each ``(histogram, start, init)`` fit, all clustered side by side."""
    problems = [histogram.problem(start, init) for histogram, start, init in requests]
    fitted = iter(float32_levels_batch([problem for problem in problems if problem is not None]))
    return [next(fitted) if problem is not None else torch.empty(0, dtype=torch.float32) for problem in problems]


def zero_level_hints_batch(histograms: Sequence[tuple[torch.Tensor, int]], sigma: float) -> list[dict[str, Any]]:
    """:func:`zero_level_hints_for` of every ``(counts, bins)``, each exactly what it gives
    alone: each round's fits of all the moments run side by side."""
    folded = [_FoldedHistogram(counts, bins, sigma) for counts, bins in histograms]
    levels = _fit_folded([(histogram, 0, None) for histogram in folded])
    refitting = [i for i, fitted in enumerate(levels) if fitted.numel()]
    for _ in range(2):  # refit on what stays: the zero cell grows with the smallest level
        requests = []
        for i in refitting:
            smallest = float(levels[i].abs().min())
            prune_below = max(int(magnitude_keys(torch.tensor([smallest / 2]))[0]), 1)
            requests.append((folded[i], prune_below, levels[i] if levels[i].numel() == folded[i].half else None))
        refitted = _fit_folded(requests)
        for i, fitted in zip(refitting, refitted):
            if fitted.numel():
                levels[i] = fitted
        # A fit that found nothing left to cluster ends that moment's rounds.
        refitting = [i for i, fitted in zip(refitting, refitted) if fitted.numel()]
    hints: list[dict[str, Any]] = []
    for fitted in levels:
        if fitted.numel() == 0:
            hints.append({})
            continue
        fitted = fitted.abs().sort().values
        prune_below = max(int(magnitude_keys(torch.tensor([float(fitted[0]) / 2]))[0]), 1)
        hints.append({"prune_below": prune_below, "centroids": torch.cat([-fitted.flip(0), fitted])})
    return hints
