"""Trial answers from sketches agree with what the codec really does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import DynaQuantCodec
from inshrinkerator.codecs.log_sketch import ALPHA, MAGNITUDE_KEYS, SIGNED_KEYS
from inshrinkerator.codecs.nonuniform_quantizer import LINEAR, fit_centroids, key_centres
from inshrinkerator.codecs.weighted_kmeans import nearest_level
from inshrinkerator.policies.quantization_trials import (
    MAGNITUDE,
    PRUNE_PENALTY,
    SENSITIVITY,
    TrialConfig,
    WeightTrial,
    quantile_key,
    run_trials,
)


def _weights() -> torch.Tensor:
    return torch.randn(40_000, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize("metric", [MAGNITUDE, SENSITIVITY])
def test_trial_error_matches_the_encoded_error(metric: str) -> None:
    weights = _weights()
    fisher = torch.rand(40_000, generator=torch.Generator().manual_seed(1)) + 0.5
    sensitivity = (weights * torch.randn(40_000, generator=torch.Generator().manual_seed(2))).abs()
    trial = WeightTrial(weights, "linear", fisher, sensitivity, sigma=0.2)
    counts = trial.sensitivity_counts if metric == SENSITIVITY else trial.magnitude_counts
    threshold = quantile_key(counts, 0.2)
    result = trial.run(TrialConfig(bins=8, prune=0.2, protect=0.005, metric=metric), threshold)
    table = result.table
    codec = DynaQuantCodec(bins=8).with_hints(
        centroids=table.centroids(), prune_below=table.prune_below, protect_above=table.protect_above,
        prune_mask=result.prune_mask, protect_mask=result.protect_mask,
    )
    decoded = codec.encode(weights).reconstruction
    pruned = decoded == 0
    squares = float((weights[pruned] ** 2).sum())
    plain = (PRUNE_PENALTY * squares + float(((decoded - weights)[~pruned] ** 2).sum())) / float((weights**2).sum())
    weighted = PRUNE_PENALTY * float(fisher.mean()) * squares
    weighted += float((fisher[~pruned] * (decoded[~pruned] - weights[~pruned]) ** 2).sum())
    weighted /= float((fisher * weights**2).sum())
    assert result.pruned_error == pytest.approx(squares, rel=0.1)
    assert result.error == pytest.approx(max(plain, weighted), rel=0.1)
    assert trial.total == pytest.approx(float((fisher * weights**2).sum()), rel=0.01)
    assert 0.17 < float(pruned.float().mean()) < 0.23


def test_more_bins_and_less_pruning_mean_less_error_and_more_bits() -> None:
    trial = WeightTrial(_weights(), "linear", None, None, sigma=0.2)
    threshold = quantile_key(trial.magnitude_counts, 0.3)
    coarse = trial.run(TrialConfig(4, 0.3, 0.0), threshold)
    fine = trial.run(TrialConfig(16, 0.0, 0.0), 0)
    assert fine.error < coarse.error and fine.estimated_bits > coarse.estimated_bits
    assert trial.run(TrialConfig(4, 0.3, 0.0), threshold) is coarse  # cached


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    bins=st.sampled_from([1, 4, 16, 48]),
    prune=st.sampled_from([0.0, 0.3]),
    protect=st.sampled_from([0.0005, 0.01]),
    zeros=st.booleans(),
)
def test_trial_levels_and_error_match_a_fit_of_the_whole_kept_histogram(
    seed: int, bins: int, prune: float, protect: float, zeros: bool
) -> None:
    # The trial fits on the occupied buckets only; the codec's fit_centroids reads the
    # whole key space: both must give the same levels, and the error must use the
    # nearest of them for every bucket.
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(3000, generator=generator) * 0.05
    if zeros:
        weights[::3] = 0.0
    trial = WeightTrial(weights, "linear", None, None, sigma=1.0)
    threshold = quantile_key(trial.magnitude_counts, prune)
    result = trial.run(TrialConfig(bins=bins, prune=prune, protect=protect), threshold)
    table = result.table
    magnitude = torch.arange(SIGNED_KEYS) & (MAGNITUDE_KEYS - 1)
    kept = (magnitude >= table.prune_below) & (magnitude <= table.protect_above)
    counts = torch.where(kept, trial.counts, 0)
    assert torch.equal(table.centroids(), fit_centroids(counts, bins, 1.0, LINEAR))
    occupied = torch.nonzero(counts).reshape(-1)
    centres = key_centres()[occupied]
    levels = table.centroids().double()
    spread = (2.0 * ALPHA) ** 2 / 12.0  # a value's variance inside its bucket
    chosen = levels[nearest_level(centres, levels)] if levels.numel() else torch.zeros_like(centres)
    rounding = float((counts[occupied].double() * ((centres - chosen) ** 2 + spread * centres**2)).sum())
    expected = (PRUNE_PENALTY * result.pruned_error + rounding) / trial.total_plain
    assert result.error == pytest.approx(expected, rel=1e-12, abs=1e-300)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    prune=st.sampled_from([0.0, 0.2, 0.5]),
    protect=st.sampled_from([0.0, 0.01, 0.1]),
    metric=st.sampled_from([MAGNITUDE, SENSITIVITY]),
    announce=st.booleans(),
)
def test_sensitivity_trials_keep_what_their_element_masks_keep(
    seed: int, prune: float, protect: float, metric: str, announce: bool
) -> None:
    # Where sensitivity decides, the kept histogram comes from a table of (key, sensitivity
    # class) cells: it must hold exactly the elements the trial's element masks keep.
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(5000, generator=generator) * 0.05
    weights[::7] = 0.0
    fisher = torch.rand(5000, generator=generator) + 0.1
    sensitivity = (weights * torch.randn(5000, generator=generator)).abs()
    trial = WeightTrial(weights, "linear", fisher, sensitivity, sigma=0.5)
    counts = trial.sensitivity_counts if metric == SENSITIVITY else trial.magnitude_counts
    threshold = quantile_key(counts, prune)
    if announce:  # as a search does: every cut it may ask for, up front
        trial.expect_sensitivity_cuts([quantile_key(trial.sensitivity_counts, f) for f in (0.2, 0.5)], [0.01, 0.1])
    trial.run(TrialConfig(bins=4, prune=0.5, protect=0.1, metric=metric), quantile_key(counts, 0.5))
    result = trial.run(TrialConfig(bins=8, prune=prune, protect=protect, metric=metric), threshold)
    table = result.table
    keys = trial.keys.long()
    magnitude = keys & (MAGNITUDE_KEYS - 1)
    protected = magnitude > table.protect_above
    if result.protect_mask is not None:
        protected |= result.protect_mask
    pruned = (magnitude < table.prune_below) & ~protected
    if result.prune_mask is not None:
        pruned |= result.prune_mask & ~protected
    kept = ~(protected | pruned)
    expected_counts = torch.bincount(keys[kept], minlength=SIGNED_KEYS)
    expected_mass = torch.bincount(keys[kept], weights=fisher[kept].double(), minlength=SIGNED_KEYS)
    histogram = trial._kept(
        table.prune_below, table.protect_above,
        threshold if result.prune_mask is not None else None,
        quantile_key(trial.sensitivity_counts, 1.0 - protect) if result.protect_mask is not None else None,
    )
    assert torch.equal(histogram.keys, torch.nonzero(expected_counts).reshape(-1))
    assert torch.equal(histogram.counts, expected_counts[histogram.keys])
    assert torch.allclose(histogram.mass, expected_mass[histogram.keys], rtol=1e-5)
    assert histogram.pruned_count == float(pruned.sum())
    assert histogram.protected_count == float(protected.sum())


def _trials() -> list[WeightTrial]:
    generator = torch.Generator().manual_seed(5)
    trials = []
    for size, scale, sensitive in ((30_000, 0.05, False), (4_000, 1e-3, True), (12_000, 2.0, True)):
        tensor = torch.randn(size, generator=generator) * scale
        sensitivity = (tensor * torch.randn(size, generator=generator)).abs() if sensitive else None
        trials.append(WeightTrial(tensor, "linear", sensitivity, sensitivity, 0.3))
    return trials


def test_trials_run_side_by_side_give_what_each_gives_alone() -> None:
    # Each trial warm-starts from its earlier runs: rounds of a search run side by side
    # must leave every trial with the results, in order, of running it alone.
    rounds = [
        [(TrialConfig(8, 0.0, 0.0), 0), (TrialConfig(16, 0.1, 0.01, SENSITIVITY), 40), (TrialConfig(4, 0.2, 0.0), 900)],
        [(TrialConfig(8, 0.1, 0.0), 800), (TrialConfig(8, 0.1, 0.01, SENSITIVITY), 40), (TrialConfig(4, 0.0, 0.01), 0)],
        [(TrialConfig(8, 0.0, 0.0), 0), (TrialConfig(2, 0.3, 0.0, SENSITIVITY), 60), (TrialConfig(4, 0.2, 0.0), 900)],
    ]
    together, alone = _trials(), _trials()
    for configs in rounds:
        batched = run_trials([(trial, config, threshold, None) for trial, (config, threshold) in zip(together, configs)])
        for trial, (config, threshold), result in zip(alone, configs, batched):
            single = trial.run(config, threshold)
            assert torch.equal(result.table.values, single.table.values)
            assert result.error == single.error and result.estimated_bits == single.estimated_bits
    trial = together[0]
    with pytest.raises(ValueError, match="once"):
        run_trials([(trial, TrialConfig(8, 0.0, 0.0), 0, None), (trial, TrialConfig(4, 0.0, 0.0), 0, None)])


def test_trials_after_a_stop_are_left_as_if_they_had_not_run() -> None:
    stopped, fresh = _trials(), _trials()
    first = TrialConfig(16, 0.0, 0.0)
    results = run_trials([(trial, first, 0, None) for trial in stopped], stop=lambda position, result: position == 1)
    assert len(results) == 2
    assert torch.equal(results[1].table.values, fresh[1].run(first, 0).table.values)
    # The third trial did not keep the first run's levels as its warm start: its next run
    # at the same level count is what it is in a trial that never ran.
    later = TrialConfig(16, 0.2, 0.0)
    assert torch.equal(stopped[2].run(later, 900).table.values, fresh[2].run(later, 900).table.values)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    bins=st.sampled_from([1, 2, 8, 64, 256]),
    prune=st.sampled_from([0.0, 0.2, 0.9]),
    protect=st.sampled_from([0.0, 0.001, 0.01, 0.3]),
    metric=st.sampled_from([MAGNITUDE, SENSITIVITY]),
    spread=st.sampled_from(["normal", "few values", "heavy tail"]),
)
def test_the_error_floor_is_under_every_trial_with_its_protect_fraction(
    seed: int, bins: int, prune: float, protect: float, metric: str, spread: str
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(3000, generator=generator) * 0.05
    if spread == "few values":  # every value on a bucket centre: only the spread term is left
        weights = key_centres()[torch.randint(1000, 1010, (3000,), generator=generator)].float()
    elif spread == "heavy tail":  # a few values hold most of the energy: protecting them matters
        weights[:20] *= 1000.0
    sensitivity = (weights * torch.randn(3000, generator=generator)).abs()
    trial = WeightTrial(weights, "linear", torch.rand(3000, generator=generator) + 0.1, sensitivity, sigma=0.5)
    counts = trial.sensitivity_counts if metric == SENSITIVITY else trial.magnitude_counts
    result = trial.run(TrialConfig(bins=bins, prune=prune, protect=protect, metric=metric), quantile_key(counts, prune))
    floor = trial.error_floor(protect)
    assert 0.0 < floor <= result.error
    if spread == "heavy tail" and protect == 0.0:
        assert floor > 0.9 * ALPHA**2 / 3  # nothing protected: the spread of every value


def test_the_error_floor_holds_with_non_finite_values_and_is_0_with_everything_protected() -> None:
    weights = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 0.05
    weights[3], weights[4] = float("inf"), float("nan")
    trial = WeightTrial(weights, "linear", None, None, 0.5)
    result = trial.run(TrialConfig(bins=16, prune=0.0, protect=0.0, metric=MAGNITUDE), 1)
    assert trial.error_floor(0.0) <= result.error
    assert trial.error_floor(1.0) == 0.0
