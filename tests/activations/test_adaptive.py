import math

import pytest
import torch
from torch import nn

from inshrinkerator.activations.adaptive import AdaptiveErrorBound, consumer_kind


def test_consumer_kinds() -> None:
    assert consumer_kind(nn.Linear(2, 2)) == "linear"
    assert consumer_kind(nn.Conv2d(1, 1, 3)) == "conv"
    assert consumer_kind(nn.BatchNorm2d(3)) == "batchnorm"
    assert consumer_kind(nn.LayerNorm(3)) == "layernorm"
    assert consumer_kind(nn.ReLU()) == "mask" and consumer_kind(nn.MaxPool2d(2)) == "mask"
    assert consumer_kind(nn.GELU()) == "other" and consumer_kind(nn.BatchNorm2d(3, affine=False)) == "other"


def test_fixed_bound_before_statistics_and_when_not_adaptive() -> None:
    fixed = AdaptiveErrorBound(0.02, adaptive=False)
    assert fixed.bound(["0"], 10.0) == pytest.approx(0.2)
    adaptive = AdaptiveErrorBound(0.02)
    assert adaptive.bound(None, 10.0) == pytest.approx(0.2)
    assert adaptive.bound(["unseen"], 10.0) == pytest.approx(0.2)


def test_rule_matches_the_noise_formula_on_a_linear_layer() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    model = nn.Sequential(layer, nn.ReLU())
    bounds = AdaptiveErrorBound(0.02, noise=0.1, every=1, max_relative=0.99)
    bounds.attach(model)
    x = torch.relu(torch.randn(512, 64))
    bounds.begin_step()
    out = layer(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    bounds.detach()
    zeros = float((x == 0).double().mean())
    r = float(layer.weight.grad.double().square().mean().sqrt())
    g = math.sqrt(float(grad_out.double().square().sum()) / 32)
    expected = math.sqrt(3) * 0.1 * r / (g * math.sqrt(1 - zeros))
    assert bounds.layer_bounds()["0"] == pytest.approx(expected, rel=1e-6)
    # a tensor consumed by the layer and by a ReLU takes the layer's bound; ReLU alone: the cap
    value_range = 5.0
    assert bounds.bound(["0", "1"], value_range) == pytest.approx(min(expected, 0.99 * value_range))


def test_mask_consumers_do_not_constrain_and_clamps_hold() -> None:
    model = nn.Sequential(nn.ReLU(), nn.GELU())
    bounds = AdaptiveErrorBound(0.02, max_relative=0.1, min_relative=0.01)
    bounds.attach(model)
    assert bounds.bound(["0"], 4.0) == pytest.approx(0.4)  # only a ReLU: the cap
    assert bounds.bound(["1"], 4.0) == pytest.approx(0.08)  # GELU: the fixed bound
    assert bounds.bound(["0", "1"], 4.0) == pytest.approx(0.08)


def test_measures_one_step_in_every() -> None:
    bounds = AdaptiveErrorBound(0.02, every=3)
    flags = []
    for _ in range(7):
        bounds.begin_step()
        flags.append(bounds.measuring)
    assert flags == [True, False, False, True, False, False, True]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="relative to each tensor's value range"):
        AdaptiveErrorBound(2.0)
    with pytest.raises(ValueError):
        AdaptiveErrorBound(0.01, every=0)
