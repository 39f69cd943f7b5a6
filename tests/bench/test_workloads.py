"""Every workload trains (its loss falls), is deterministic per seed, and resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from inshrinkerator.bench.workloads import WORKLOADS, make_workload, training_loss_evaluator

_STEPS = {"digits-cnn": 15, "digits-cnn-sgd": 15, "stdlib-char-gpt": 15, "minilm-docstrings": 8}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_loss_falls_in_a_few_steps(name: str) -> None:
    workload = make_workload(name, seed=0, quick=True)
    losses = [workload.train_step(step) for step in range(_STEPS[name])]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < losses[0]
    evaluation = workload.evaluate()
    assert evaluation.metric in ("accuracy", "val_loss")


@pytest.mark.parametrize("name", ["digits-cnn-sgd", "stdlib-char-gpt", "minilm-docstrings"])
def test_resume_from_exact_state_reproduces_the_run(name: str) -> None:
    workload = make_workload(name, seed=3, quick=True)
    for step in range(3):
        workload.train_step(step)
    saved = copy.deepcopy(workload.state())
    straight = [workload.train_step(step) for step in (3, 4)]
    workload.build()  # a fresh model and optimizer, as after a crash
    workload.restore(saved)
    resumed = [workload.train_step(step) for step in (3, 4)]
    assert resumed == straight


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_loss_on_measures_the_training_loss_without_changing_anything(name: str) -> None:
    workload = make_workload(name, seed=0, quick=True)
    before = copy.deepcopy(workload.state())
    first = workload.loss_on([100, 101])
    assert first == workload.loss_on([100, 101]) and torch.isfinite(torch.tensor(first))
    assert workload.model.training  # the mode it was in comes back
    for key, value in workload.model.state_dict().items():
        assert torch.equal(value, before["model"][key])
    evaluate = training_loss_evaluator(lambda: WORKLOADS[name](seed=0, quick=True), batches=2)
    untrained = evaluate(workload.model.state_dict())
    for step in range(_STEPS[name]):
        workload.train_step(step)
    trained = evaluate(workload.model.state_dict())
    assert trained < untrained
    # The evaluator loads the state into a model of its own, never the one being trained.
    kept = copy.deepcopy(workload.model.state_dict())
    damaged = {key: torch.zeros_like(value) for key, value in kept.items()}
    assert evaluate(damaged) != trained
    for key, value in workload.model.state_dict().items():
        assert torch.equal(value, kept[key])


def test_seed_decides_init_and_data() -> None:
    a, b, c = (make_workload("digits-cnn", seed=s, quick=True) for s in (1, 1, 2))
    first = [a.train_step(s) for s in range(3)]
    assert first == [b.train_step(s) for s in range(3)]
    assert first != [c.train_step(s) for s in range(3)]


def test_minilm_loads_the_pretrained_weights_by_name() -> None:
    workload = make_workload("minilm-docstrings", seed=0, quick=True)
    pretrained = workload.pretrained_state()
    encoder = workload.model["encoder"].state_dict()
    assert set(encoder) == set(pretrained)
    assert all(torch.equal(encoder[key], pretrained[key]) for key in pretrained)


def test_unknown_workload_names_the_choices() -> None:
    with pytest.raises(ValueError, match="digits-cnn"):
        make_workload("imagenet")
