"""The yardstick's arithmetic: degradation, ratios, spread, failure placement, class bytes."""

from __future__ import annotations

import math

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.bench.measures import (
    degradation_percent,
    ratio,
    run_class_bytes,
    spread,
)
from inshrinkerator.bench.recovery import failure_steps
from tests.helpers import training_state


def test_degradation_follows_the_design_formula() -> None:
    assert degradation_percent(0.80, 0.76, higher_is_better=True) == pytest.approx(5.0)
    assert degradation_percent(0.80, 0.84, higher_is_better=True) == pytest.approx(-5.0)
    assert degradation_percent(2.0, 2.1, higher_is_better=False) == pytest.approx(5.0)
    assert degradation_percent(2.0, 1.9, higher_is_better=False) == pytest.approx(-5.0)
    with pytest.raises(ValueError):
        degradation_percent(0.0, 0.1, higher_is_better=True)


def test_ratio_and_spread() -> None:
    assert ratio(100, 25) == 4.0
    assert math.isinf(ratio(10, 0))
    summary = spread([1.0, 2.0, 3.0])
    assert summary["mean"] == 2.0 and summary["std"] == pytest.approx(1.0)
    assert (summary["min"], summary["max"], summary["n"]) == (1.0, 3.0, 3)
    assert spread([5.0])["std"] == 0.0


@pytest.mark.parametrize("total", [22, 60, 1000])
def test_failures_are_ten_evenly_spaced_steps_inside_the_run(total: int) -> None:
    steps = failure_steps(total, 10)
    assert len(steps) == 10 == len(set(steps))
    assert steps == sorted(steps) and 0 < steps[0] and steps[-1] < total
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert max(gaps) - min(gaps) <= 1


def test_class_bytes_come_from_container_headers(tmp_path) -> None:
    state = training_state()
    ink.save(state, tmp_path / "a.ink")
    (tmp_path / "notes.json").write_text("{}")  # not a container: skipped
    classes = run_class_bytes(sorted(tmp_path.iterdir()))
    model_bytes = sum(
        t.numel() * t.element_size()
        for k, t in state["model"].items()
        if t.dtype.is_floating_point and "running" not in k
    )
    moments = [s for s in state["optimizer"]["state"].values()]
    assert classes.containers == 1
    assert classes.raw["weights"] == model_bytes
    assert classes.raw["first_moment"] == sum(m["exp_avg"].numel() * 4 for m in moments)
    assert classes.raw["second_moment"] == sum(m["exp_avg_sq"].numel() * 4 for m in moments)
    total_raw = sum(t.numel() * t.element_size() for t in _tensors(state))
    assert sum(classes.raw.values()) == total_raw
    assert 0 < sum(classes.stored.values()) < (tmp_path / "a.ink").stat().st_size


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
