"""Random level tables for the quantizer's tests: both domains, with and without pruning
and protection, some with levels on bucket centres (ids decided on boundaries exactly)."""

from __future__ import annotations

import torch

from inshrinkerator.codecs.log_sketch import SIGNED_KEYS, signed_keys
from inshrinkerator.codecs.nonuniform_quantizer import (
    FIRST_NON_FINITE_KEY,
    LOG,
    LevelTable,
    fit_centroids,
    key_centres,
    make_level_table,
)


def random_level_tables(domain: str, trials: int, bins_step: int, seed: int) -> list[LevelTable]:
    """``trials`` tables fitted to random values of many magnitudes, the i-th with up to
    ``1 + i * bins_step`` levels."""
    generator = torch.Generator().manual_seed(seed)
    tables = []
    for trial in range(trials):
        values = torch.randn(2_000, generator=generator) * 10.0 ** float(torch.randint(-20, 3, (1,), generator=generator))
        if domain == LOG:
            values = values.abs()
        keys = signed_keys(values)
        levels = fit_centroids(torch.bincount(keys, minlength=SIGNED_KEYS), 1 + trial * bins_step, 1.0, domain)
        if trial % 4 == 3:  # on level boundaries exactly: centroids at bucket centres
            levels = torch.unique(torch.cat([levels, key_centres()[keys[:5].long()].float()]))
            levels = levels[(levels != 0) & torch.isfinite(levels)]
        prune_below = int(torch.randint(1, 9000, (1,), generator=generator)) if trial % 2 else 1
        protect_above = int(torch.randint(8000, FIRST_NON_FINITE_KEY, (1,), generator=generator))
        tables.append(make_level_table(levels, domain, prune_below, protect_above))
    return tables
