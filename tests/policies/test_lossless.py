"""The lossless policy: which codec each tensor gets, and exact states through ink.save/load."""

from __future__ import annotations

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import ByteGroupingCodec, RawCodec, XorDeltaCodec
from inshrinkerator.errors import BrokenChainError
from inshrinkerator.policies import Lossless, resolve_policy
from inshrinkerator.tree import TensorLeaf

from ..helpers import assert_same, training_state


def _leaves(*tensors: torch.Tensor) -> list[TensorLeaf]:
    return [TensorLeaf((f"t{i}",), t) for i, t in enumerate(tensors)]


def test_small_tensors_are_raw_and_the_rest_byte_grouped():
    leaves = _leaves(torch.zeros(3), torch.tensor(5), torch.randn(1000), torch.zeros(64, dtype=torch.int32))
    codecs = Lossless().plan(leaves, [None] * 4)
    assert [type(c) for c in codecs] == [RawCodec, RawCodec, ByteGroupingCodec, ByteGroupingCodec]
    assert Lossless(small_bytes=0).plan(leaves[:1], [None])[0] == ByteGroupingCodec()


def test_a_matching_reference_makes_a_delta_and_a_mismatched_one_does_not():
    weight = torch.randn(40, 50)
    leaves = _leaves(weight, weight, weight, weight)
    references = [weight + 1e-4, weight.double(), weight[:39], None]
    codecs = Lossless(level=3).plan(leaves, references)
    assert isinstance(codecs[0], XorDeltaCodec)
    assert codecs[0].inner == ByteGroupingCodec(level=3).get_config()
    assert [type(c) for c in codecs[1:]] == [ByteGroupingCodec] * 3
    assert codecs[1] == ByteGroupingCodec(level=3)


def test_options_are_checked_and_the_name_resolves():
    with pytest.raises(ValueError):
        Lossless(level=40)
    with pytest.raises(ValueError):
        Lossless(small_bytes=-1)
    assert resolve_policy("lossless") == Lossless() and Lossless().name == "lossless"


def test_a_training_state_comes_back_bit_for_bit(tmp_path):
    state = training_state(steps=3)
    info = ink.save(state, tmp_path / "s.ink", policy=Lossless())
    assert info.policy == "lossless" and info.kind == "full" and info.ratio > 1.0
    assert_same(ink.load(tmp_path / "s.ink"), state)


def test_a_fine_tuned_state_is_stored_as_a_smaller_delta_that_needs_its_base(tmp_path):
    base = {"w": torch.randn(300, 200) * 0.02, "b": torch.zeros(200), "step": 0}
    tuned = {"w": base["w"] + torch.randn(300, 200) * 1e-6, "b": base["b"] + 1e-5, "step": 10}
    full = ink.save(tuned, tmp_path / "full.ink")
    delta = ink.save(tuned, tmp_path / "delta.ink", base=base)
    assert delta.kind == "delta" and delta.stored_bytes < 0.8 * full.stored_bytes
    assert_same(ink.load(tmp_path / "delta.ink", base=base), tuned)
    with pytest.raises(BrokenChainError):
        ink.load(tmp_path / "delta.ink")
    wrong = {**base, "w": base["w"] * 1.5}
    with pytest.raises(BrokenChainError):
        ink.load(tmp_path / "delta.ink", base=wrong)
