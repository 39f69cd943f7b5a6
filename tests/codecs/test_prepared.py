"""Encoding ahead of the writer: the kept result is returned only for the very same inputs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from inshrinkerator.codecs import DynaQuantCodec, ResidualCodec


def _codecs():
    inner = DynaQuantCodec(bins=16, prune=0.0, protect=0.0)
    return [DynaQuantCodec(bins=16, prune=0.0, protect=0.0), ResidualCodec(inner)]


def _case(seed: int, index: int):
    """A generator, a tensor, codec ``index`` of ``_codecs`` and the reference it needs (or None)."""
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(4096, generator=generator)
    reference = tensor + 0.01 * torch.randn(4096, generator=generator)
    codec = _codecs()[index]
    return generator, tensor, codec, reference if codec.uses_reference else None


@pytest.mark.parametrize("index", [0, 1])
def test_prepared_result_is_what_encode_computes_and_is_used_once(index) -> None:
    _, tensor, codec, needs = _case(index, index)
    prepared = codec.prepare(tensor, needs)
    assert codec.encode(tensor, needs) is prepared  # the writer's call costs nothing
    again = codec.encode(tensor, needs)  # taken once: encoded anew, to the same result
    assert again is not prepared
    assert again.streams == prepared.streams
    assert torch.equal(again.reconstruction, prepared.reconstruction)


@pytest.mark.parametrize("index", [0, 1])
def test_inputs_changed_since_prepare_are_encoded_again(index) -> None:
    generator, tensor, codec, needs = _case(10 + index, index)
    prepared = codec.prepare(tensor, needs)
    tensor.mul_(2.0)  # changed in place: same object, new version counter
    fresh = codec.encode(tensor, needs)
    assert fresh is not prepared
    assert fresh.streams != prepared.streams
    other = torch.randn(4096, generator=generator)
    kept = codec.prepare(tensor, needs)
    encoded = codec.encode(other, needs)  # a different tensor never gets the kept result
    assert encoded is not kept
    assert not torch.equal(encoded.reconstruction, kept.reconstruction)


@pytest.mark.parametrize("index", [0, 1])
def test_a_dropped_result_is_not_held_and_encode_works_anew(index) -> None:
    _, tensor, codec, needs = _case(20 + index, index)
    held = weakref.ref(codec.prepare(tensor, needs).reconstruction)
    codec.drop_prepared()
    gc.collect()
    assert codec.prepared_result is None and held() is None  # the reconstruction is freed
    again = codec.encode(tensor, needs)
    assert again.reconstruction is not None and again.reconstruction.shape == tensor.shape
