"""Symmetric levels around zero for first moments: each fit, and many fitted together."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs.log_sketch import (
    MAGNITUDE_KEYS,
    SIGNED_KEYS,
    magnitude_keys,
    signed_keys,
)
from inshrinkerator.codecs.nonuniform_quantizer import LINEAR, fit_centroids
from inshrinkerator.policies.first_moment_levels import zero_level_hints_batch, zero_level_hints_for


@pytest.mark.parametrize("bins", [2, 4, 8])
def test_first_moment_levels_are_the_fit_of_the_folded_histogram(bins) -> None:
    # The levels are fitted on the occupied buckets alone; they must be what fitting the
    # whole folded (all-positive) key space gives: a fit, then refits without the zero cell.
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
