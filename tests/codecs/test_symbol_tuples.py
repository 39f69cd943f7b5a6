"""Symbol tuples: exact round trips (with and without escapes), efficiency on low-entropy symbols, damage."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import symbol_tuples
from inshrinkerator.codecs.entropy import huffman_frame, order0_entropy_bits
from inshrinkerator.codecs.symbol_tuples import (
    decode_symbol_tuples,
    encode_symbol_tuples,
    tuple_header_bytes,
)
from inshrinkerator.errors import CorruptCheckpointError


def _skewed(count: int, alphabet: int, zero_share: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    others = torch.randint(0, alphabet, (count,), generator=generator)
    return torch.where(torch.rand(count, generator=generator) < zero_share, 0, others).to(torch.uint8)


def _code(symbols: torch.Tensor, size: int, alphabet: int = 256) -> bytes:
    return encode_symbol_tuples(symbols, torch.bincount(symbols.long(), minlength=alphabet), size)


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 3000),
    alphabet=st.integers(1, 256),
    zero_share=st.floats(0.0, 1.0),
    size=st.sampled_from([2, 4]),
    seed=st.integers(0, 100),
)
def test_round_trip(count: int, alphabet: int, zero_share: float, size: int, seed: int) -> None:
    symbols = _skewed(count, alphabet, zero_share, seed)
    decoded = decode_symbol_tuples(_code(symbols, size, alphabet), count)
    assert decoded.dtype == torch.uint8 and torch.equal(decoded, symbols)


def test_the_most_frequent_symbols_get_digits_and_the_rest_escape() -> None:
    symbols = torch.tensor([5, 5, 5, 9, 9, 200, 5, 1, 5, 9, 7], dtype=torch.uint8)
    data = _code(symbols, 4)
    assert data[0] == 4 and data[1] == 3  # radix 4: three digits for symbols, one escape digit
    assert list(data[2:5]) == [5, 9, 1]  # by frequency, ties by value
    assert torch.equal(decode_symbol_tuples(data, symbols.numel()), symbols)


def test_low_entropy_symbols_cost_near_their_order0_entropy_unlike_single_bytes() -> None:
    symbols = _skewed(400_000, 10, 0.85, seed=3)
    bound = order0_entropy_bits(symbols, 10) / 8
    data = _code(symbols, 4, 10)
    assert len(data) - tuple_header_bytes(data) < 1.05 * bound
    assert len(huffman_frame(symbols.numpy())) > 1.3 * bound  # one bit per byte at least


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        _code(torch.zeros(10, dtype=torch.uint8), 3)
    with pytest.raises(ValueError):
        encode_symbol_tuples(torch.tensor([300]), torch.bincount(torch.tensor([300])), 2)


def test_damaged_data_raises_or_decodes_to_some_symbols() -> None:
    symbols = _skewed(20_000, 40, 0.7, seed=5)
    data = _code(symbols, 4, 40)
    with pytest.raises(CorruptCheckpointError):
        decode_symbol_tuples(data[:-2], symbols.numel())
    with pytest.raises(CorruptCheckpointError):
        decode_symbol_tuples(data, symbols.numel() + 8)
    with pytest.raises(CorruptCheckpointError):
        decode_symbol_tuples(bytes([3]) + data[1:], symbols.numel())
    for position in range(0, len(data), max(1, len(data) // 60)):
        damaged = bytearray(data)
        damaged[position] ^= 0x41
        try:
            out = decode_symbol_tuples(bytes(damaged), symbols.numel())
        except CorruptCheckpointError:
            continue
        # A flip inside Huffman-coded bytes can decode to other symbols (the container's
        # checksum catches that); the count never changes.
        assert out.numel() == symbols.numel()


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 5000),
    alphabet=st.integers(1, 256),
    zero_share=st.floats(0.0, 1.0),
    size=st.sampled_from([2, 4]),
    seed=st.integers(0, 100),
    dtype=st.sampled_from([torch.uint8, torch.int16, torch.int64]),
)
def test_short_streams_packed_in_numpy_give_the_same_bytes_as_torch(
    count: int, alphabet: int, zero_share: float, size: int, seed: int, dtype: torch.dtype
) -> None:
    symbols = _skewed(count, alphabet, zero_share, seed).to(dtype)
    counts = torch.bincount(symbols.long(), minlength=alphabet)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(symbol_tuples, "_NUMPY_UP_TO", 1 << 30)
        in_numpy = encode_symbol_tuples(symbols, counts, size)
        patch.setattr(symbol_tuples, "_NUMPY_UP_TO", 0)
        in_torch = encode_symbol_tuples(symbols, counts, size)
    assert in_numpy == in_torch
    assert torch.equal(decode_symbol_tuples(in_numpy, count), symbols.to(torch.uint8))


def _decoded_or_error(data: bytes, count: int) -> "torch.Tensor | str":
    try:
        return decode_symbol_tuples(data, count)
    except Exception as error:  # compared by type and message: both paths must fail alike
        return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("size, alphabet, zero_share", [(4, 40, 0.7), (2, 200, 0.3), (4, 3, 0.9), (2, 16, 0.5)])
def test_short_streams_decode_in_numpy_to_what_torch_decodes_damaged_or_not(size: int, alphabet: int, zero_share: float) -> None:
    symbols = _skewed(3_001, alphabet, zero_share, seed=size + alphabet)
    data = _code(symbols, size, alphabet)
    cases = [(data, symbols.numel()), (data[:-2], symbols.numel()), (data, symbols.numel() + 8)]
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x41
        cases.append((bytes(damaged), symbols.numel()))
    for case, count in cases:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(symbol_tuples, "_NUMPY_UP_TO", 1 << 30)
            in_numpy = _decoded_or_error(case, count)
            patch.setattr(symbol_tuples, "_NUMPY_UP_TO", -1)
            in_torch = _decoded_or_error(case, count)
        if isinstance(in_torch, str):
            assert in_numpy == in_torch
        else:
            assert isinstance(in_numpy, torch.Tensor) and in_numpy.dtype == torch.uint8 and torch.equal(in_numpy, in_torch)
    assert torch.equal(decode_symbol_tuples(data, symbols.numel()), symbols)
