"""Level tables: key lookups with prune/protect thresholds, k-means levels, stickiness."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs.log_sketch import (
    MAGNITUDE_KEYS,
    SIGNED_KEYS,
    magnitude_keys,
    signed_keys,
)
from inshrinkerator.codecs.nonuniform_quantizer import (
    FIRST_NON_FINITE_KEY,
    LINEAR,
    LOG,
    CentroidFit,
    assign_ids,
    fit_centroids,
    fit_centroids_batch,
    make_level_table,
    reconstruct,
    stick_to_predicted,
)
from inshrinkerator.codecs.passes import SLICE_ELEMENTS

from .level_tables import random_level_tables


def _weights(count: int = 20_000, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_ids_follow_the_values_and_the_thresholds() -> None:
    values = _weights()
    keys = signed_keys(values)
    centroids = fit_centroids(torch.bincount(keys, minlength=SIGNED_KEYS), 8, sigma=1.0)
    assert 1 <= centroids.numel() <= 8 and bool((centroids != 0).all())
    prune_below, protect_above = int(magnitude_keys(torch.tensor([0.01]))), int(magnitude_keys(torch.tensor([0.12])))
    table = make_level_table(centroids, LINEAR, prune_below, protect_above)
    ids = assign_ids(keys, table).long()
    assert torch.all(ids[values.abs() < 0.0098] == table.zero_index)
    assert torch.all(ids[values.abs() > 0.1225] == table.protect_id)
    middle = (values.abs() > 0.0102) & (values.abs() < 0.118)
    decoded = table.values[ids[middle]]
    nearest = (values[middle, None] - table.centroids()[None, :]).abs().min(1).values
    # Nearest level up to the sketch's bucket accuracy.
    assert torch.all((values[middle] - decoded).abs() <= nearest + 0.02 * values[middle].abs() + 1e-7)
    order = torch.argsort(values[middle])
    assert torch.all(ids[middle][order][1:] >= ids[middle][order][:-1])  # ids are ordered like values


def test_element_masks_override_the_lookup() -> None:
    values = _weights(100)
    keys = signed_keys(values)
    table = make_level_table(torch.tensor([-0.05, 0.05]))
    prune = torch.zeros(100, dtype=torch.bool)
    protect = torch.zeros(100, dtype=torch.bool)
    prune[:10] = True
    protect[5:20] = True
    ids = assign_ids(keys, table, prune, protect)
    assert torch.all(ids[:5] == table.zero_index) and torch.all(ids[5:20] == table.protect_id)


def test_log_domain_levels_are_positive_and_relative() -> None:
    values = torch.exp2(torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * 6 - 20)
    values[:100] = 0.0
    keys = signed_keys(values)
    centroids = fit_centroids(torch.bincount(keys, minlength=SIGNED_KEYS), 16, domain=LOG)
    table = make_level_table(centroids, LOG)
    ids = assign_ids(keys, table)
    decoded = reconstruct(ids, table, torch.empty(0), torch.float32, (50_000,))
    assert torch.all(decoded[:100] == 0) and torch.all(decoded[100:] > 0)
    ratio = (decoded[100:] / values[100:]).log2()
    assert abs(float(ratio.mean())) < 0.3 and float(ratio.abs().mean()) < 1.0
    largest = int(values.argmax())
    assert abs(float((decoded[largest] / values[largest]).log2())) < 0.03  # the top level reaches it


def test_non_finite_values_get_the_protect_id_and_come_back() -> None:
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, -1.0])
    table = make_level_table(torch.tensor([-1.0, 1.0]))
    ids = assign_ids(signed_keys(values), table)
    assert ids[:3].tolist() == [table.protect_id] * 3
    decoded = reconstruct(ids, table, values[:3].to(torch.bfloat16), torch.float32, (5,))
    assert torch.isnan(decoded[0]) and decoded[1] == float("inf") and decoded[2] == -float("inf")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_reconstruct_of_many_narrow_ids_is_the_table_lookup(dtype: torch.dtype) -> None:
    # Over one slice of ids, narrow ones are widened a slice at a time into the output.
    count = 2 * SLICE_ELEMENTS + 17
    table = make_level_table(torch.tensor([-2.0, -0.5, 0.25, 1.0, 3.0]))
    ids = torch.randint(0, table.protect_id, (count,), generator=torch.Generator().manual_seed(3)).to(dtype)
    ids[-5:] = table.protect_id
    protected = torch.tensor([7.0, -7.0, 9.0, 11.0, 13.0], dtype=torch.bfloat16)
    decoded = reconstruct(ids, table, protected, torch.float32, (count,))
    expected = torch.cat([table.values, torch.zeros(1)])[ids.long()]
    expected[-5:] = protected.float()
    assert decoded.dtype == torch.float32 and torch.equal(decoded, expected)


def test_stickiness_keeps_predicted_levels_within_its_margin() -> None:
    table = make_level_table(torch.tensor([1.0, 2.0, 3.0]))
    values = torch.tensor([1.6, 1.9, 2.45, 2.9])
    ids = assign_ids(signed_keys(values), table)
    predicted = torch.full_like(ids, 1)  # the level 1.0 (index 1; the zero level is index 0)
    positions = torch.nonzero(ids != predicted).reshape(-1)
    keep = stick_to_predicted(values, positions, ids, predicted, table, stickiness=0.5)
    # Cell half-width towards 2.0 is 0.5; with stickiness 0.5 elements within 0.75 stay.
    assert keep.tolist() == [True, False, False, False]


def test_a_batch_of_fits_gives_each_histogram_what_it_gives_alone() -> None:
    # Linear and log domains, warm starts and an empty histogram in one batch.
    fits = []
    for seed in range(6):
        values = _weights(5_000 * (seed + 1), seed) * 10**-seed
        domain = LOG if seed % 2 else LINEAR
        if domain == LOG:
            values = values.square()
        counts = torch.bincount(signed_keys(values), minlength=SIGNED_KEYS)
        init = fit_centroids(counts, 4 + seed, 0.5, domain) if seed >= 4 else None
        fits.append(CentroidFit(counts, 4 + seed, 0.5, domain, init if init is not None and init.numel() == 4 + seed else None))
    fits.append(CentroidFit(torch.zeros(SIGNED_KEYS, dtype=torch.long), 8))
    results = fit_centroids_batch(fits)
    for fit, result in zip(fits, results):
        assert torch.equal(result, fit_centroids(*fit))
    assert results[-1].numel() == 0 and results[0].numel() > 0


@pytest.mark.parametrize("domain", [LINEAR, LOG])
def test_fit_thresholds_are_the_fit_of_the_histogram_without_those_buckets(domain: str) -> None:

    values = _weights(30_000, 7)
    if domain == LOG:
        values = values.square()
    values[:50] = float("inf")
    counts = torch.bincount(signed_keys(values), minlength=SIGNED_KEYS)
    occupied = torch.nonzero(counts[:MAGNITUDE_KEYS] + counts[MAGNITUDE_KEYS:]).reshape(-1)
    low, high = int(occupied[len(occupied) // 5]), int(occupied[-len(occupied) // 6])
    for prune_below, protect_above in [(low, high), (0, high), (low, 10**6), (-3, -1), (high, low)]:
        emptied = counts.clone()
        for half in (emptied[:MAGNITUDE_KEYS], emptied[MAGNITUDE_KEYS:]):
            half[: max(prune_below, 0)] = 0
            half[max(protect_above + 1, 0) :] = 0
        expected = fit_centroids(emptied, 6, 0.5, domain)
        got = fit_centroids(counts, 6, 0.5, domain, None, prune_below, protect_above)
        assert torch.equal(got, expected), (prune_below, protect_above)
        assert (got.numel() > 0) == (0 <= prune_below <= protect_above), (prune_below, protect_above)


@pytest.mark.parametrize("domain", [LINEAR, LOG])
def test_the_ids_of_a_few_keys_are_those_of_the_whole_key_table(domain: str) -> None:
    # A small tensor's ids are found key by key, a large one's from the table of all keys:
    # on every signed key (finite, zero, subnormal, infinite, NaN), for tables of either
    # domain with and without pruning and protection, the two must agree.
    from inshrinkerator.codecs.nonuniform_quantizer import DIRECT_IDS_FRACTION

    every_key = torch.arange(SIGNED_KEYS, dtype=torch.int32)
    chunk = SIGNED_KEYS // DIRECT_IDS_FRACTION - 1
    for trial, table in enumerate(random_level_tables(domain, trials=12, bins_step=3, seed=0)):
        whole = table.lookup()
        parts = torch.cat([table.ids(every_key[start : start + chunk]) for start in range(0, SIGNED_KEYS, chunk)])
        assert parts.dtype == whole.dtype and torch.equal(parts, whole), trial


@pytest.mark.parametrize(
    "centroids, domain",
    [
        ([0.5, 2.0, 3.0], LINEAR),  # the zero level lowest: every other id is one up
        ([-3.0, -2.0, -1e-30], LINEAR),  # the zero level highest
        ([-1e30, 1e-30, 1e30], LINEAR),  # boundaries beyond every key's centre
        ([1e-6], LOG),
        ([float(v) for v in torch.linspace(-4, 4, 300) if v != 0], LINEAR),  # ids beyond a byte
    ],
)
@pytest.mark.parametrize(
    "prune_below, protect_above",
    [(1, FIRST_NON_FINITE_KEY - 1), (MAGNITUDE_KEYS + 7, FIRST_NON_FINITE_KEY - 1), (1, 0), (9000, 8999), (5, 10 ** 6)],
)
def test_the_key_table_at_its_edges(centroids: list[float], domain: str, prune_below: int, protect_above: int) -> None:
    # The whole table is built from where the boundaries fall among the key centres; key by
    # key, each key's nearest level is searched for. The two must agree on every signed key
    # wherever the zero level lies, whatever the thresholds, and when ids need two bytes.
    table = make_level_table(torch.tensor(centroids), domain, prune_below, protect_above)
    every_key = torch.arange(SIGNED_KEYS, dtype=torch.int32)
    by_key = torch.cat([table.ids(every_key[start : start + 1000]) for start in range(0, SIGNED_KEYS, 1000)])
    whole = table.lookup()
    assert whole.dtype == by_key.dtype and torch.equal(whole, by_key)
    assert int(whole.max()) <= table.protect_id
