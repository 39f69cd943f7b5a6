"""Trial answers from sketches agree with what the codec really does."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs import DynaQuantCodec
from inshrinkerator.policies.quantization_trials import (
    MAGNITUDE,
    PRUNE_PENALTY,
    SENSITIVITY,
    TrialConfig,
    WeightTrial,
    quantile_key,
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
