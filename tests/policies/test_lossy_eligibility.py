"""What the baseline policies may quantize: finite float tensors big enough; the rest stays exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.policies.lossy_eligibility import quantizable, usable_reference

from ..helpers import assert_same


def test_quantizable() -> None:
    assert quantizable(torch.randn(2000), 1024)
    assert not quantizable(torch.randn(1000), 1024)
    assert not quantizable(torch.arange(5000), 1024)
    assert not quantizable(torch.tensor([1.0, float("nan")] * 1000), 1024)


def test_usable_reference() -> None:
    tensor = torch.randn(4, 4)
    assert usable_reference(tensor, tensor.clone()) is not None
    assert usable_reference(tensor, None) is None
    assert usable_reference(tensor, tensor.double()) is None
    assert usable_reference(tensor, tensor.reshape(16)) is None
    assert usable_reference(tensor, torch.full((4, 4), float("inf"))) is None


@pytest.mark.parametrize("policy", ["lc-checkpoint", "excp", "cnr", "qd"])
def test_odd_tensors_stay_exact_and_half_precision_weights_are_quantized(policy: str, tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    with_nan = torch.randn(64, 64, generator=generator).half()
    with_nan[3, 5] = float("nan")
    weights = (torch.randn(64, 64, generator=generator) * 0.05).bfloat16()
    state = {
        "model": {"odd.weight": with_nan, "fc.weight": weights, "fc.bias": torch.randn(64).bfloat16()},
        "ids": torch.arange(3000, dtype=torch.int32),
        "flags": torch.ones(5000, dtype=torch.bool),
        "step": 7,
    }
    base = {**state, "model": {**state["model"], "fc.weight": (weights.float() - 1e-3).bfloat16()}}
    ink.save(state, tmp_path / "s.ink", policy=policy, base=base)
    loaded = ink.load(tmp_path / "s.ink", base=base)
    for key in ("odd.weight", "fc.bias"):
        assert_same(loaded["model"][key], state["model"][key])
    assert_same(loaded["ids"], state["ids"])
    assert_same(loaded["flags"], state["flags"])
    assert loaded["step"] == 7
    restored = loaded["model"]["fc.weight"]
    assert restored.dtype == torch.bfloat16 and not torch.equal(restored, weights)
    assert float((restored.float() - weights.float()).abs().max()) < 0.02
