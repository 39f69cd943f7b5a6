"""Symmetric streams: one byte names a model of the fixed family instead of a count table."""

from __future__ import annotations

import math

import pytest
import torch

from inshrinkerator.codecs.symmetric_models import (
    MAX_STREAM_LIMIT,
    best_model,
    decode_symmetric,
    encode_symmetric,
    model_costs,
    model_probabilities,
    symmetric_header_bytes,
)
from inshrinkerator.errors import CorruptCheckpointError, FormatError


def _laplace(count: int, scale: float, limit: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.distributions.Exponential(1 / scale).sample((count,)).round()
    sign = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
    return (sign * magnitude).clamp(-limit, limit).to(torch.int64)


@pytest.mark.parametrize("limit", [1, 3, 12, 40, MAX_STREAM_LIMIT])
def test_values_round_trip(limit: int) -> None:
    torch.manual_seed(limit)
    values = _laplace(300, limit / 4 + 0.5, limit, seed=limit)
    values[0], values[1] = -limit, limit  # both ends of the range
    data = encode_symmetric(values, limit)
    assert torch.equal(decode_symmetric(data, values.numel()), values)
    assert symmetric_header_bytes(data) == 2  # a one-byte limit and the code


def test_an_empty_stream_round_trips() -> None:
    data = encode_symmetric(torch.empty(0, dtype=torch.int64), 4)
    assert decode_symmetric(data, 0).numel() == 0


def test_the_chosen_model_is_the_cheapest_and_near_the_entropy() -> None:
    limit = 10
    values = _laplace(2000, 2.0, limit, seed=1)
    counts = torch.bincount(values + limit, minlength=2 * limit + 1)
    code, bits = best_model(counts, limit)
    every = model_costs(limit) @ counts.double()
    assert bits == pytest.approx(float(every.min())) and code == int(every.argmin()) + 1
    frequencies = counts[counts > 0].double() / counts.sum()
    entropy = float(-(counts[counts > 0] * torch.log2(frequencies)).sum())
    assert entropy <= bits <= 1.03 * entropy  # a Laplace sample under the Laplace family
    data = encode_symmetric(values, limit)
    # The coder adds at most its final state (two words) to what the model spends.
    assert len(data) - 2 <= math.ceil(bits / 8) + 8


def test_probabilities_are_symmetric_and_cover_every_value() -> None:
    for code in (1, 100, 128, 255):
        probabilities = model_probabilities(code, 6)
        assert probabilities.shape == (13,)
        assert (probabilities > 0).all()
        assert list(probabilities) == list(probabilities[::-1])


def test_values_outside_the_limit_or_a_limit_outside_the_range_are_refused() -> None:
    with pytest.raises(ValueError):
        encode_symmetric(torch.tensor([0, 5]), 4)
    for limit in (0, MAX_STREAM_LIMIT + 1):
        with pytest.raises(ValueError):
            encode_symmetric(torch.tensor([0]), limit)


def test_malformed_streams_are_refused() -> None:
    values = _laplace(400, 1.5, 8, seed=2)
    data = encode_symmetric(values, 8)
    with pytest.raises(FormatError):
        decode_symmetric(bytes([0]) + data[1:], values.numel())  # limit 0
    with pytest.raises(FormatError):
        decode_symmetric(bytes([MAX_STREAM_LIMIT + 1]) + data[1:], values.numel())
    with pytest.raises(FormatError):
        decode_symmetric(data[:1] + bytes([0]) + data[2:], values.numel())  # model 0
    with pytest.raises(CorruptCheckpointError):
        decode_symmetric(data[:1], values.numel())  # no code
    with pytest.raises(CorruptCheckpointError):
        decode_symmetric(data[:-1], values.numel())  # not whole words
    with pytest.raises(CorruptCheckpointError):
        decode_symmetric(data + bytes(4), values.numel())  # words left over


def test_damaged_words_never_decode_outside_the_limit() -> None:
    values = _laplace(400, 1.5, 8, seed=3)
    data = encode_symmetric(values, 8)
    for position in range(2, len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x5A
        try:
            out = decode_symmetric(bytes(damaged), values.numel())
        except (CorruptCheckpointError, FormatError):
            continue
        # Damage inside the words can decode to other valid values; the container's
        # checksum catches that. What must never happen: values outside the range.
        assert out.numel() == values.numel() and int(out.abs().max()) <= 8


def test_a_given_model_codes_the_values_and_the_cheapest_by_default() -> None:
    values = _laplace(500, 2.0, 9, seed=4)
    counts = torch.bincount(values + 9, minlength=19)
    code, _ = best_model(counts, 9)
    assert encode_symmetric(values, 9, code) == encode_symmetric(values, 9)
    other = 255 if code != 255 else 1
    data = encode_symmetric(values, 9, other)
    assert data[1] == other and torch.equal(decode_symmetric(data, values.numel()), values)
    assert len(data) > len(encode_symmetric(values, 9))
    with pytest.raises(ValueError):
        encode_symmetric(values, 9, 0)
