"""Bucket-id delta coding: exact round trips in every mode, size, and the entropy stage's efficiency."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.bucket_delta import (
    PLAIN,
    PREDICTED,
    REARRANGED,
    EntropyStats,
    decode_bucket_ids,
    encode_bucket_ids,
    encode_id_symbols,
)
from inshrinkerator.codecs.symmetric_models import encode_symmetric
from inshrinkerator.codecs.varint import encode_varint
from inshrinkerator.errors import CorruptCheckpointError, FormatError


def _ids_and_prediction(levels: int, count: int, changed: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    predicted = torch.randint(0, levels, (count,), generator=generator)
    step = torch.randint(-1, 2, (count,), generator=generator)
    moved = torch.rand(count, generator=generator) < changed
    ids = torch.where(moved, (predicted + step).clamp(0, levels - 1), predicted)
    return ids, predicted


@settings(max_examples=40, deadline=None)
@given(
    levels=st.integers(2, 300),
    count=st.integers(0, 2000),
    changed=st.floats(0.0, 1.0),
    rearrange=st.booleans(),
    seed=st.integers(0, 50),
)
def test_round_trip_in_every_mode(levels: int, count: int, changed: float, rearrange: bool, seed: int) -> None:
    ids, predicted = _ids_and_prediction(levels, count, changed, seed)
    plain = decode_bucket_ids(encode_bucket_ids(ids, levels), levels, count)
    assert torch.equal(plain.long(), ids)
    data = encode_bucket_ids(ids, levels, predicted, rearrange=rearrange)
    assert data[0] & 3 == (REARRANGED if rearrange else PREDICTED)
    assert torch.equal(decode_bucket_ids(data, levels, count, predicted).long(), ids)


def test_few_changes_cost_little_and_the_entropy_stage_is_near_order0() -> None:
    ids, predicted = _ids_and_prediction(18, 200_000, 0.03, seed=1)
    stats = EntropyStats()
    data = encode_bucket_ids(ids, 18, predicted, stats=stats)
    assert len(data) * 8 < 0.35 * ids.numel()  # under 0.35 bits per id
    # At most 5% above order-0; symbol tuples may code below it (run and value tokens alternate).
    assert stats.payload_overhead < 0.05
    assert len(encode_bucket_ids(ids, 18)) > 5 * len(data)  # the prediction is what pays


def test_plain_mode_codes_against_the_most_frequent_id() -> None:
    ids = torch.full((1000,), 7)
    ids[::100] = 3
    data = encode_bucket_ids(ids, 9)
    assert data[0] & 3 == PLAIN
    assert len(data) < 100  # headers and the count table; the ids themselves take ~2 bytes


def test_mismatched_inputs_are_refused() -> None:
    ids, predicted = _ids_and_prediction(10, 500, 0.1, seed=2)
    data = encode_bucket_ids(ids, 10, predicted)
    with pytest.raises(FormatError):
        decode_bucket_ids(data, 10, 500)  # the prediction is missing
    with pytest.raises(FormatError):
        decode_bucket_ids(data, 11, 500, predicted)
    with pytest.raises(FormatError):
        decode_bucket_ids(data[:-1], 10, 500, predicted)
    with pytest.raises(FormatError):
        decode_bucket_ids(data, 10, 499, predicted[:499])
    with pytest.raises(ValueError):
        encode_bucket_ids(ids, 1)


GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "codecs" / "bucket_delta"


VERSION_2 = ["plain", "predicted", "rearranged", "dense_predicted", "dense_rearranged", "wide_alphabet"]
CURRENT = [*VERSION_2, "small_predicted"]


def _golden(name: str) -> tuple[dict, torch.Tensor, torch.Tensor | None, bytes]:
    meta = json.loads((GOLDEN / f"{name}.json").read_text())
    predicted = torch.tensor(meta["predicted"]) if meta["predicted"] is not None else None
    return meta, torch.tensor(meta["ids"]), predicted, base64.b64decode(meta["stream"])


@pytest.mark.parametrize("name", CURRENT)
def test_golden_streams_decode_and_encode_the_same(name: str) -> None:
    meta, ids, predicted, stream = _golden(name)
    assert torch.equal(decode_bucket_ids(stream, meta["levels"], ids.numel(), predicted).long(), ids)
    assert encode_bucket_ids(ids, meta["levels"], predicted, rearrange="rearranged" in name) == stream


@pytest.mark.parametrize("name", ["v1_plain", "v1_predicted", "v1_rearranged"])
def test_version_1_streams_still_decode(name: str) -> None:
    meta, ids, predicted, stream = _golden(name)
    assert stream[0] & ~3 == 0  # run tokens and ANS: the only layout of version 1
    assert torch.equal(decode_bucket_ids(stream, meta["levels"], ids.numel(), predicted).long(), ids)


@pytest.mark.parametrize("name", [f"v2_{name}" for name in VERSION_2])
def test_version_2_streams_still_decode(name: str) -> None:
    meta, ids, predicted, stream = _golden(name)
    assert stream[0] & 0x10 == 0  # no symbol tuples before version 3
    assert torch.equal(decode_bucket_ids(stream, meta["levels"], ids.numel(), predicted).long(), ids)


def test_goldens_cover_both_layouts_and_every_coder() -> None:
    flags = {_golden(name)[3][0] & ~3 for name in CURRENT}
    # direct + Huffman, direct + ANS, run tokens + symbol tuples, direct + symmetric model
    assert {0x0C, 0x04, 0x10, 0x24} <= flags


def test_damaged_huffman_and_direct_streams_are_refused() -> None:
    ids, predicted = _ids_and_prediction(30, 5000, 0.7, seed=3)
    data = bytearray(encode_bucket_ids(ids, 30, predicted))
    assert data[0] & 0x04 and data[0] & 0x18  # dense changes: direct layout, Huffman coded (tuples or not)
    for position in range(8, len(data), max(1, len(data) // 40)):
        damaged = bytearray(data)
        damaged[position] ^= 0x5A
        try:
            out = decode_bucket_ids(bytes(damaged), 30, 5000, predicted)
        except FormatError:
            continue
        # A flip inside Huffman-coded literals can decode to other valid ids; the container's
        # checksum catches that. What must never happen: ids outside the alphabet.
        assert int(out.max()) < 30 and out.numel() == 5000
    with pytest.raises(FormatError):
        decode_bucket_ids(bytes(data[:-3]), 30, 5000, predicted)
    for flag in (0x40, 0x18, 0x28):  # an unknown flag; two coders at once
        forged = bytearray(data)
        forged[0] |= flag
        with pytest.raises(FormatError):
            decode_bucket_ids(bytes(forged), 30, 5000, predicted)


def test_the_ans_pass_is_skipped_only_where_it_could_not_win(monkeypatch) -> None:
    # A small stream is coded by Huffman (or symbol tuples) and by ANS, and the smaller
    # kept; where the Huffman candidate is within the ANS stage's floor the ANS pass is
    # not run. Every choice must be the one of running both.
    import inshrinkerator.codecs.bucket_delta as bucket_delta

    generator = torch.Generator().manual_seed(0)
    streams = []
    for _ in range(150):
        alphabet = int(torch.randint(2, 257, (1,), generator=generator))
        count = int(torch.randint(1, 5000, (1,), generator=generator))
        skew = float(torch.rand(1, generator=generator)) * 6
        probabilities = torch.softmax(torch.randn(alphabet, generator=generator) * skew, 0)
        streams.append((torch.multinomial(probabilities, count, replacement=True, generator=generator), alphabet))
    passes = []
    ans = bucket_delta.encode_symbols
    monkeypatch.setattr(bucket_delta, "encode_symbols", lambda *args: passes.append(1) or ans(*args))
    skipping = [encode_id_symbols(symbols, alphabet) for symbols, alphabet in streams]
    skipped = len(streams) - len(passes)
    monkeypatch.setattr(bucket_delta, "encoded_size_floor", lambda counts, bits: float("-inf"))
    assert [encode_id_symbols(symbols, alphabet) for symbols, alphabet in streams] == skipping
    assert 0 < skipped < len(streams)  # both kinds of stream were there



def _bias_like_ids(levels: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A short tensor's ids: most near the centre, a few steps out (a bias's, a norm's change).
    generator = torch.Generator().manual_seed(seed)
    predicted = torch.randint(0, levels, (count,), generator=generator)
    step = (torch.randn(count, generator=generator) * 1.5).round().long()
    return (predicted + step) % levels, predicted


@pytest.mark.parametrize("mode", [PLAIN, PREDICTED, REARRANGED])
def test_short_streams_name_a_symmetric_model_instead_of_a_table(mode: int) -> None:
    levels, count = 15, 300
    ids, predicted = _bias_like_ids(levels, count, seed=mode)
    if mode == PLAIN:
        ids, predicted = (ids + 7 - predicted) % levels, None  # around id 7, as a bias on even levels
    stats = EntropyStats()
    data = encode_bucket_ids(ids, levels, predicted, rearrange=mode == REARRANGED, stats=stats)
    assert data[0] == mode | 0x04 | 0x20  # direct layout, symmetric model
    assert torch.equal(decode_bucket_ids(data, levels, count, predicted).long(), ids)
    # Smaller than either table-carrying coder on the same direct symbols.
    dense = ids if predicted is None else (ids - predicted) % levels
    if mode == REARRANGED:
        dense = dense[torch.sort(predicted, stable=True).indices]
    tabled = encode_id_symbols(dense, levels, small_stream=1 << 16)[1]
    assert len(data) < len(tabled)
    assert stats.table_bytes == 2 and stats.parts == 1  # its limit and model code


def test_symmetric_models_are_not_tried_for_wide_or_long_streams() -> None:
    generator = torch.Generator().manual_seed(5)
    wide = torch.randint(0, 200, (300,), generator=generator)  # distances far beyond the family's limit
    assert not encode_bucket_ids(wide, 200)[0] & 0x20
    ids, predicted = _bias_like_ids(15, 5000, seed=6)  # a long stream keeps its faster coders
    assert not encode_bucket_ids(ids, 15, predicted)[0] & 0x20


def test_forged_symmetric_streams_are_refused() -> None:
    ids, predicted = _bias_like_ids(15, 300, seed=7)
    data = encode_bucket_ids(ids, 15, predicted)
    assert data[0] & 0x20
    with pytest.raises(FormatError):  # a symmetric model on run tokens
        decode_bucket_ids(bytes([data[0] & ~0x04]) + data[1:], 15, 300, predicted)
    # Values beyond half the levels would wrap onto ids another value stands for.
    values = torch.arange(-10, 11).repeat(10)
    coded = encode_symmetric(values, 10)
    for levels in (21, 15):
        head = bytes([0x24]) + levels.to_bytes(2, "little") + bytes(2)  # plain, centre 0
        stream = head + encode_varint(values.numel()) + encode_varint(len(coded)) + encode_varint(0) + coded
        if levels == 21:  # the control: within half of 21 levels the same words decode
            assert torch.equal(decode_bucket_ids(stream, levels, values.numel()).long(), values % levels)
        else:
            with pytest.raises(CorruptCheckpointError):
                decode_bucket_ids(stream, levels, values.numel())
