"""Entropy stages: ANS coding of symbols, and zstd coding of byte planes."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.entropy import (
    MAX_ALPHABET,
    byte_entropy_bits,
    decode_symbols,
    encode_symbols,
    encoded_size_floor,
    expand_frame,
    histogram_bits,
    huffman_frame,
    lz_frame,
    order0_entropy_bits,
)
from inshrinkerator.errors import CorruptCheckpointError, FormatError

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "codecs" / "entropy" / "symbols.json"


def _skewed_symbols(count: int, alphabet: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor([0.6**k for k in range(alphabet)])
    return torch.multinomial(weights, count, replacement=True, generator=generator)


# --- symbols (ANS) -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    alphabet=st.integers(min_value=1, max_value=300),
    values=st.lists(st.integers(min_value=0, max_value=10_000), max_size=500),
)
def test_symbols_round_trip(alphabet, values):
    symbols = torch.tensor([v % alphabet for v in values], dtype=torch.int64)
    stream = encode_symbols(symbols, alphabet)
    decoded = decode_symbols(stream, len(values))
    assert decoded.dtype == torch.int64 and torch.equal(decoded, symbols)


@settings(max_examples=80, deadline=None)
@given(
    alphabet=st.integers(min_value=1, max_value=300),
    skew=st.floats(min_value=0.0, max_value=6.0),
    count=st.integers(min_value=1, max_value=3000),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_no_symbol_stream_is_shorter_than_its_floor(alphabet, skew, count, seed):
    generator = torch.Generator().manual_seed(seed)
    probabilities = torch.softmax(torch.randn(alphabet, generator=generator) * skew, 0)
    symbols = torch.multinomial(probabilities, count, replacement=True, generator=generator)
    counts = torch.bincount(symbols, minlength=alphabet).numpy()
    floor = encoded_size_floor(counts, order0_entropy_bits(symbols, alphabet))
    assert floor <= len(encode_symbols(symbols, alphabet)) < floor + 16


def test_symbols_of_any_shape_and_integer_dtype_are_flattened():
    symbols = torch.randint(0, 9, (4, 5, 6), dtype=torch.int16)
    assert torch.equal(decode_symbols(encode_symbols(symbols, 9)), symbols.reshape(-1).long())


def test_coding_is_within_a_fraction_of_a_percent_of_order0_entropy():
    symbols = _skewed_symbols(200_000, 40, seed=1)
    bound_bytes = order0_entropy_bits(symbols, 40) / 8
    stream = encode_symbols(symbols, 40)
    assert len(stream) < bound_bytes * 1.002 + 400  # coder loss + header and count table


def test_one_distinct_symbol_costs_only_the_header():
    stream = encode_symbols(torch.full((100_000,), 3), 10)
    assert len(stream) < 100
    assert torch.equal(decode_symbols(stream, 100_000), torch.full((100_000,), 3))


def test_order0_entropy_matches_its_definition():
    symbols = torch.tensor([0, 0, 1, 2])
    assert order0_entropy_bits(symbols, 3) == pytest.approx(-(2 * math.log2(0.5) + 2 * math.log2(0.25)))
    assert order0_entropy_bits(torch.tensor([], dtype=torch.int64), 3) == 0.0


def test_histogram_bits_is_the_order0_entropy_of_its_counts():
    generator = torch.Generator().manual_seed(5)
    for alphabet in (1, 2, 17, 256, 8193):
        counts = torch.randint(0, 50, (alphabet,), generator=generator)
        counts[0] = 0  # zero counts are skipped
        kept = counts[counts > 0].double()
        expected = float(-(kept * torch.log2(kept / kept.sum())).sum()) if kept.numel() else 0.0
        assert histogram_bits(counts) == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert histogram_bits(counts.reshape(1, -1).double()) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert histogram_bits(torch.tensor([0, 7, 0])) == 0.0
    assert histogram_bits(torch.tensor([1, 1, 2])) == pytest.approx(6.0)


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError):
        encode_symbols(torch.tensor([0, 5]), 5)
    with pytest.raises(ValueError):
        encode_symbols(torch.tensor([-1]), 5)
    for alphabet in (0, MAX_ALPHABET + 1):
        with pytest.raises(ValueError):
            encode_symbols(torch.tensor([0]), alphabet)


@pytest.fixture(scope="module")
def symbol_stream() -> tuple[bytes, torch.Tensor]:
    symbols = _skewed_symbols(3000, 37, seed=2)
    return encode_symbols(symbols, 37), symbols


def test_a_symbol_stream_of_another_length_is_a_format_error(symbol_stream):
    stream, symbols = symbol_stream
    with pytest.raises(FormatError):
        decode_symbols(stream, symbols.numel() + 1)


def test_every_truncation_of_a_symbol_stream_is_refused(symbol_stream):
    stream, symbols = symbol_stream
    for cut in range(len(stream)):
        with pytest.raises(FormatError):  # CorruptCheckpointError is a FormatError
            decode_symbols(stream[:cut], symbols.numel())


def test_damaged_symbol_streams_are_corruption_not_garbage(symbol_stream):
    stream, symbols = symbol_stream
    rng = np.random.default_rng(3)
    undetected = 0
    for _ in range(400):
        damaged = bytearray(stream)
        damaged[int(rng.integers(0, len(stream)))] ^= 1 << int(rng.integers(0, 8))
        try:
            decoded = decode_symbols(bytes(damaged), symbols.numel())
        except FormatError:
            continue
        undetected += not torch.equal(decoded, symbols)
    assert undetected <= 4  # a flip the decoder cannot see must at least be rare


def test_golden_symbol_stream_still_decodes():
    doc = json.loads(GOLDEN.read_text())
    expected = torch.from_numpy(np.frombuffer(base64.b64decode(doc["symbols"]), dtype=np.int32).copy())
    decoded = decode_symbols(base64.b64decode(doc["stream"]), expected.numel())
    assert torch.equal(decoded, expected.long())


# --- byte planes (zstd) ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), level=st.sampled_from([1, 3, -1]))
def test_frames_round_trip(data, level):
    plane = np.frombuffer(data, dtype=np.uint8)
    for frame in (huffman_frame(plane), lz_frame(plane, level)):
        assert expand_frame(frame, len(data)) == data


def test_huffman_frames_come_close_to_order0_entropy_and_beat_stock_zstd_on_exponents():
    rng = np.random.default_rng(4)
    exponents = (122 - np.minimum(rng.geometric(0.45, 1 << 18), 40)).astype(np.uint8)  # weight-like
    bound = byte_entropy_bits(exponents) * exponents.size / 8
    frame = huffman_frame(exponents)
    assert len(frame) < bound * 1.04
    assert len(frame) < len(lz_frame(exponents, 1))


def test_lz_frames_find_repeats_an_order0_coder_cannot():
    sequence = np.tile(np.arange(256, dtype=np.uint8), 400)  # uniform bytes, fully repetitive
    assert byte_entropy_bits(sequence) == pytest.approx(8.0)
    assert len(lz_frame(sequence)) < sequence.size / 100


def test_byte_entropy_estimates():
    assert byte_entropy_bits(np.zeros(100, dtype=np.uint8)) == 0.0
    assert byte_entropy_bits(np.zeros(0, dtype=np.uint8)) == 0.0
    assert byte_entropy_bits(np.arange(256, dtype=np.uint8)) == pytest.approx(8.0)
    assert byte_entropy_bits(np.array([0, 1] * 50, dtype=np.uint8)) == pytest.approx(1.0)


def test_expand_frame_refuses_wrong_sizes_and_damage():
    data = bytes(range(256)) * 40
    frame = lz_frame(np.frombuffer(data, dtype=np.uint8))
    with pytest.raises(CorruptCheckpointError):
        expand_frame(frame, len(data) + 1)
    with pytest.raises(CorruptCheckpointError):
        expand_frame(frame + b"junk", len(data))
    with pytest.raises(CorruptCheckpointError):
        expand_frame(frame[:-3], len(data))
    with pytest.raises(CorruptCheckpointError):
        expand_frame(b"\x00\x01", 10)
    # a header that claims 2**60 bytes is refused before anything is allocated
    forged = b"\x28\xb5\x2f\xfd" + bytes([0xC0]) + (1 << 60).to_bytes(8, "little") + frame[6:]
    with pytest.raises(CorruptCheckpointError, match="claims"):
        expand_frame(forged, len(data))
    # every damaged byte of the frame header is refused as damage, never a zstd error
    for position in range(8):
        for flip in (0x01, 0x41, 0xFF):
            damaged = bytearray(frame)
            damaged[position] ^= flip
            try:
                assert expand_frame(bytes(damaged), len(data)) == data
            except CorruptCheckpointError:
                pass


def test_forged_symbol_headers_cannot_make_the_decoder_allocate_without_limit(symbol_stream):
    import struct

    import zstandard

    stream, symbols = symbol_stream
    alphabet, count, table_bytes = struct.unpack_from("<IQI", stream)
    # a count table whose zstd frame claims 2**40 bytes
    table = zstandard.ZstdCompressor().compress(b"\0" * 64)
    forged_table = b"\x28\xb5\x2f\xfd" + bytes([0xC0]) + (1 << 40).to_bytes(8, "little") + table[6:]
    forged = struct.pack("<IQI", alphabet, count, len(forged_table)) + forged_table + stream[16 + table_bytes :]
    with pytest.raises(CorruptCheckpointError, match="count table"):
        decode_symbols(forged, count)
    # a header claiming 2**60 symbols, decoded without an expected count
    huge = struct.pack("<IQI", alphabet, 1 << 60, table_bytes) + stream[16:]
    with pytest.raises(FormatError):
        decode_symbols(huge)
