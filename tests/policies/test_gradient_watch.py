"""Gradient averages collected by hooks, matched to saved tensors by storage or by name."""

from __future__ import annotations

import copy

import pytest
import torch

from inshrinkerator.policies.gradient_watch import GradientWatch
from inshrinkerator.tree import TensorLeaf


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 3))


def _backward(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    model.zero_grad()
    loss = model(torch.randint(0, 10, (5, 2), generator=generator)).pow(2).sum()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_average_weights_the_newest_gradient_by_beta() -> None:
    model = _model()
    watch = GradientWatch(beta=0.9)
    watch.attach(model)
    first = _backward(model, 0)
    second = _backward(model, 1)
    leaf = TensorLeaf(("model", "2.weight"), model.state_dict()["2.weight"])
    expected = 0.9 * second["2.weight"] + 0.1 * first["2.weight"]
    assert torch.allclose(watch.gradient_average(leaf), expected)
    assert watch.layer_type(leaf) == "linear"
    assert watch.layer_type(TensorLeaf(("0.weight",), model.state_dict()["0.weight"])) == "embedding"


def test_copied_states_match_by_name_and_shape() -> None:
    model = _model()
    watch = GradientWatch()
    watch.attach(model)
    _backward(model, 0)
    copied = copy.deepcopy(model.state_dict())
    assert watch.gradient_average(TensorLeaf(("model", "2.bias"), copied["2.bias"])) is not None
    assert watch.gradient_average(TensorLeaf(("model", "2.bias"), torch.zeros(7))) is None
    assert watch.gradient_average(TensorLeaf(("model", "other"), copied["2.bias"])) is None


def test_detach_and_rewatch() -> None:
    model = _model()
    watch = GradientWatch()
    watch.attach(model)
    assert watch.watching
    watch.detach()
    _backward(model, 0)
    assert not watch.watching
    leaf = TensorLeaf(("2.weight",), model.state_dict()["2.weight"])
    assert watch.gradient_average(leaf) is None
    watch.attach(model)
    _backward(model, 1)
    assert watch.gradient_average(leaf) is not None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        GradientWatch(beta=0.0)
    with pytest.raises(TypeError):
        GradientWatch().attach("not a model")  # type: ignore[arg-type]


def test_trains_tells_trainable_parameters_from_frozen_ones() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    watch = GradientWatch()
    watch.attach(model)
    state = model.state_dict()
    assert not watch.trains(TensorLeaf(("0.weight",), state["0.weight"]))
    assert watch.trains(TensorLeaf(("2.weight",), state["2.weight"]))


def test_trains_reads_requires_grad_at_save_time() -> None:
    # Progressive unfreezing (and freezing) after the model was watched.
    model = _model()
    model[0].weight.requires_grad_(False)
    watch = GradientWatch()
    watch.attach(model)
    model[0].weight.requires_grad_(True)
    model[2].weight.requires_grad_(False)
    state = model.state_dict()
    embedding, linear = TensorLeaf(("0.weight",), state["0.weight"]), TensorLeaf(("2.weight",), state["2.weight"])
    assert watch.trains(embedding) and not watch.trains(linear)
    # The unfrozen layer has no hook yet (torch hooks only tensors that require grad), so no
    # average and no layer type until hook_unfrozen(); the averages collected so far stay.
    def backward() -> None:
        model(torch.randint(0, 10, (5, 2), generator=torch.Generator().manual_seed(0))).pow(2).sum().backward()

    bias = TensorLeaf(("2.bias",), state["2.bias"])
    backward()
    assert watch.gradient_average(embedding) is None and watch.layer_type(embedding) is None
    kept = watch.gradient_average(bias)
    assert kept is not None
    assert watch.hook_unfrozen() == 1
    assert watch.hook_unfrozen() == 0  # hooked once only
    assert torch.equal(watch.gradient_average(bias), kept)
    backward()
    assert watch.gradient_average(embedding) is not None and watch.layer_type(embedding) == "embedding"
    assert not torch.equal(watch.gradient_average(bias), kept)  # still averaging


def test_hook_unfrozen_leaves_buffers_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    model[0].weight.requires_grad_(False)
    watch = GradientWatch()
    watch.attach(model)
    model[1].running_mean.requires_grad_(True)  # odd, but a buffer is not trained by a gradient
    assert watch.hook_unfrozen() == 0
    model[0].weight.requires_grad_(True)
    assert watch.hook_unfrozen() == 1


def test_a_copied_leaf_matches_its_own_name_before_a_shorter_one() -> None:
    # A top-level "weight" and an "inner.weight" of the same shape: a copied (async) state's
    # "inner.weight" is inner's, though it also ends in ".weight".
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3, 3))
            self.inner = torch.nn.Linear(3, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x @ self.weight)

    model = Model()
    watch = GradientWatch(beta=1.0)
    watch.attach(model)
    model(torch.ones(2, 3)).sum().backward()
    copied = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for name in ("weight", "inner.weight"):
        average = watch.gradient_average(TensorLeaf(("model", name), copied[name]))
        assert torch.equal(average, dict(model.named_parameters())[name].grad)
    # Storage that moved (a parameter given new data) is found again after refresh().
    model.inner.weight.data = model.inner.weight.data.clone() * 2
    watch.refresh()
    moved = TensorLeaf(("renamed",), model.inner.weight.detach())
    assert watch.trains(moved) is True and watch.layer_type(moved) == "linear"
