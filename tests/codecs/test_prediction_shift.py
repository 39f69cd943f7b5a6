"""Scaled predictions: key shifts, the writer's choice of shift, and shifted DynaQuant deltas."""

from __future__ import annotations

import struct

import pytest
import torch

import inshrinkerator.codecs.dynaquant as dynaquant_module
from inshrinkerator.codecs import DynaQuantCodec, DynaQuantDeltaCodec, TensorSpec
from inshrinkerator.codecs.dynaquant_context import DynaQuantMaskedDeltaCodec
from inshrinkerator.codecs.log_sketch import MAGNITUDE_KEYS, MANTISSA_BITS, signed_keys
from inshrinkerator.codecs.nonuniform_quantizer import FIRST_NON_FINITE_KEY, LOG, assign_ids
from inshrinkerator.codecs.prediction_shift import (
    SHIFT_MIN_ELEMENTS,
    best_shift,
    shift_keys,
    shifted_ids,
)
from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError, FormatError

from .lossy_codec_checks import check_damaged_streams, encode_decode, same_bits

_SHIFT_FLAG = 16
_HEADER = struct.calcsize("<BBHHHHI")
_OCTAVE = 1 << MANTISSA_BITS


def _second_moment(shape: tuple[int, ...], seed: int, spread: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randn(shape, generator=generator, dtype=torch.float64) * spread - 20).float()


def _noisy(tensor: torch.Tensor, factor: float, seed: int, noise: float = 0.1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    wobble = torch.exp2(torch.randn(tensor.shape, generator=generator, dtype=torch.float64) * noise)
    return (tensor.double() * factor * wobble).float()


def _codec(codec_type: type = DynaQuantDeltaCodec) -> DynaQuantDeltaCodec:
    return codec_type(bins=8, domain=LOG, protect=0.005)


def _grown(factor: float = 1.4, shape: tuple[int, ...] = (96, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """A second moment ``factor`` times its reference (plus noise), and that reference (a
    reconstruction, as a chain's references are)."""
    before = _second_moment(shape, 1)
    reference = _codec(DynaQuantCodec).encode(before).reconstruction
    return _noisy(before, factor, 2), reference


def _flags(encoded) -> int:
    return bytes(encoded.streams[0])[1]


def test_a_shift_of_one_octave_is_doubling() -> None:
    values = _second_moment((4000,), 3, spread=4.0)
    keys = signed_keys(values)
    assert torch.equal(shift_keys(keys, _OCTAVE), signed_keys(values * 2).long())
    assert torch.equal(shift_keys(-keys + 0, 0), (-keys).long())
    negative = signed_keys(-values)
    assert torch.equal(shift_keys(negative, -_OCTAVE), signed_keys(-values / 2).long())


def test_zeros_and_non_finite_keys_stay_and_shifts_stay_finite() -> None:
    # Zeros (and denormals, whose keys are zero's), infinities and NaN keep their keys.
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3e38, tiny, -1.0])
    keys = signed_keys(special)
    up, down = shift_keys(keys, 127), shift_keys(keys, -127)
    for shifted in (up, down):
        assert torch.equal(shifted[:6], keys[:6].long())
        magnitude = shifted[6:] & (MAGNITUDE_KEYS - 1)
        assert bool(((magnitude >= 1) & (magnitude < FIRST_NON_FINITE_KEY)).all())
        assert torch.equal(shifted[6:] >= MAGNITUDE_KEYS, keys[6:] >= MAGNITUDE_KEYS)  # signs kept
    assert int(up[6] & (MAGNITUDE_KEYS - 1)) == FIRST_NON_FINITE_KEY - 1  # clamped below infinity
    assert int(down[7] & (MAGNITUDE_KEYS - 1)) == 1  # and above zero


@pytest.mark.parametrize("count", [50, 200_000])
def test_shifted_ids_agree_with_shifting_the_keys(count: int) -> None:
    # Few keys are looked up one by one, many through the shifted whole map: the same ids.
    values = _second_moment((count,), 4, spread=3.0)
    codec = _codec(DynaQuantCodec)
    codec.encode(values)
    table = codec.fitted_table
    keys = signed_keys(values)
    for shift in (-90, -7, 1, 33, 127):
        assert torch.equal(shifted_ids(table, keys, shift).long(), table.ids(shift_keys(keys, shift)).long())


def test_the_search_finds_the_growth_and_nothing_where_there_is_none() -> None:
    grown, reference = _grown(1.4)
    codec = _codec(DynaQuantCodec)
    codec.encode(grown)
    table = codec.fitted_table
    ids = assign_ids(signed_keys(grown), table)
    found = best_shift(table, signed_keys(reference), ids)
    expected = _OCTAVE * torch.log2(torch.tensor(1.4)).item()  # 31 keys
    assert abs(found - expected) <= _OCTAVE / 4
    # The same tensor against itself, and against a reference that moved every way at once.
    same = assign_ids(signed_keys(reference), table)
    assert best_shift(table, signed_keys(reference), same) == 0
    empty = torch.zeros(ids.numel(), dtype=torch.bool)
    assert best_shift(table, signed_keys(reference), ids, empty) == 0


def test_a_grown_second_moment_is_coded_shifted_smaller_and_decodes_the_same(monkeypatch) -> None:
    grown, reference = _grown(1.4)
    shifted = _codec().encode(grown, reference)
    assert _flags(shifted) & _SHIFT_FLAG
    decoded = encode_decode(_codec(), grown, reference)
    assert same_bits(decoded, shifted.reconstruction)
    monkeypatch.setattr(dynaquant_module, "SHIFT_MIN_ELEMENTS", 1 << 40)
    plain = _codec().encode(grown, reference)
    assert not _flags(plain) & _SHIFT_FLAG
    # Only which deltas are coded changes: the reconstruction is the same tensor.
    assert same_bits(plain.reconstruction, shifted.reconstruction)
    assert len(bytes(shifted.streams[0])) < 0.9 * len(bytes(plain.streams[0]))


def test_the_masked_delta_is_shifted_too() -> None:
    grown, reference = _grown(1.4)
    first = torch.randn(grown.shape, generator=torch.Generator().manual_seed(6))
    first.view(-1)[::3] = 0.0
    codec = _codec(DynaQuantMaskedDeltaCodec)
    encoded = codec.encode(grown, reference, context=first)
    assert _flags(encoded) & _SHIFT_FLAG
    decoded = codec.decode(encoded.streams, encoded.params, TensorSpec.of(grown), reference, context=first)
    assert same_bits(decoded, encoded.reconstruction)
    assert bool((decoded.reshape(-1)[::3] == 0).all())


def test_small_linear_or_unchanged_tensors_are_not_shifted() -> None:
    small, small_reference = _grown(1.4, shape=(SHIFT_MIN_ELEMENTS - 1,))
    assert not _flags(_codec().encode(small, small_reference)) & _SHIFT_FLAG
    grown, reference = _grown(1.4)
    linear = DynaQuantDeltaCodec(bins=8, protect=0.005)
    assert not _flags(linear.encode(grown, reference)) & _SHIFT_FLAG
    assert not _flags(_codec().encode(reference, reference)) & _SHIFT_FLAG


def _shifted_stream() -> tuple[DynaQuantDeltaCodec, torch.Tensor, torch.Tensor, bytearray]:
    grown, reference = _grown(1.4)
    codec = _codec()
    stream = bytearray(bytes(codec.encode(grown, reference).streams[0]))
    assert stream[1] & _SHIFT_FLAG
    return codec, grown, reference, stream


def test_forged_or_damaged_shifts_are_refused() -> None:
    codec, grown, reference, stream = _shifted_stream()
    spec = TensorSpec.of(grown)
    shift_at = _HEADER + 1  # after the header and the protected count's varint (one byte here)
    assert stream[_HEADER] < 0x80
    zero = bytearray(stream)
    zero[shift_at] = 0
    with pytest.raises(FormatError):
        codec.decode([bytes(zero)], {}, spec, reference)
    linear = bytearray(stream)
    linear[1] &= ~1  # a shifted prediction in the linear domain is never written
    with pytest.raises(FormatError):
        codec.decode([bytes(linear)], {}, spec, reference)
    unknown = bytearray(stream)
    unknown[1] |= 32
    with pytest.raises(FormatError):
        codec.decode([bytes(unknown)], {}, spec, reference)
    with pytest.raises(CorruptCheckpointError):
        codec.decode([bytes(stream[:shift_at])], {}, spec, reference)
    # A full tensor's stream claiming a shift: there is nothing to shift.
    full = DynaQuantCodec(bins=8, domain=LOG, protect=0.005)
    plain = bytearray(bytes(full.encode(grown).streams[0]))
    plain[1] |= _SHIFT_FLAG
    with pytest.raises(FormatError):
        full.decode([bytes(plain)], {}, spec, None)
    # Another shift than the writer's decodes to other ids, or is caught, never silently the same.
    other = bytearray(stream)
    other[shift_at] = (other[shift_at] + 5) & 0xFF
    try:
        decoded = codec.decode([bytes(other)], {}, spec, reference)
    except (FormatError, CorruptCheckpointError):
        pass
    else:
        assert not same_bits(decoded, codec.decode([bytes(stream)], {}, spec, reference))
    with pytest.raises(BrokenChainError):
        codec.decode([bytes(stream)], {}, spec, reference * 2)
    check_damaged_streams(codec, grown, reference)
