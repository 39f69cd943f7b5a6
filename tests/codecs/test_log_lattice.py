"""Log lattices: levels 2 ** (k / q) rebuilt bit for bit from (q, first, count), and the
DynaQuant streams whose log-domain table is stored so."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from inshrinkerator.codecs import DynaQuantCodec, DynaQuantDeltaCodec, TensorSpec
from inshrinkerator.codecs.log_lattice import (
    MAX_DIVISIONS,
    find_lattice,
    lattice_range,
    lattice_values,
    octave_fractions,
)
from inshrinkerator.errors import CorruptCheckpointError, FormatError

from .lossy_codec_checks import check_damaged_streams, same_bits


@pytest.mark.parametrize("divisions", [1, 2, 3, 4, 7, 16, MAX_DIVISIONS])
def test_each_fraction_is_the_float32_nearest_its_power_of_two(divisions: int) -> None:
    for j, value in enumerate(octave_fractions(divisions)):
        assert float(np.float32(value)) == value and 1.0 <= value < 2.0
        ulp = Fraction(1, 1 << 23)
        below, above = Fraction(value) - ulp / 2, Fraction(value) + ulp / 2
        # below < 2 ** (j / q) < above, compared exactly as q-th powers
        assert below**divisions < 2**j < above**divisions


def test_lattice_levels_step_by_a_qth_of_an_octave_and_hit_every_power_of_two() -> None:
    levels = lattice_values(4, -13, 30).double()
    ratios = torch.log2(levels[1:] / levels[:-1])
    assert torch.allclose(ratios, torch.full_like(ratios, 0.25), atol=1e-6)
    for k in range(-13, 17):
        if k % 4 == 0:
            assert float(levels[k + 13]) == 2.0 ** (k // 4)
    # the same bits whatever the start: a level depends on its k alone
    assert torch.equal(lattice_values(4, -5, 10), lattice_values(4, -13, 30)[8:18])


def test_a_lattice_beyond_float32_normals_is_refused() -> None:
    assert float(lattice_values(4, -126 * 4, 1)[0]) == 2.0**-126
    assert float(lattice_values(4, 127 * 4 + 3, 1)[0]) > 2.0**127
    for divisions, first, count in ((4, -126 * 4 - 1, 2), (4, 128 * 4 - 1, 2), (0, 0, 1), (MAX_DIVISIONS + 1, 0, 1), (4, 0, 0)):
        with pytest.raises(ValueError):
            lattice_values(divisions, first, count)


def test_the_range_reaches_from_the_smallest_positive_value_to_the_largest() -> None:
    values = torch.tensor([0.0, 3e-9, 5e-4, 0.7, float("inf")])
    first, count = lattice_range(values, 4)
    levels = lattice_values(4, first, count).double()
    assert abs(math.log2(float(levels[0]) / 3e-9)) <= 0.125 + 1e-9
    assert abs(math.log2(float(levels[-1]) / 0.7)) <= 0.125 + 1e-9
    assert lattice_range(torch.tensor([0.0, -1.0]), 4) is None
    # a denormal or huge value is clamped to the normal range
    first, count = lattice_range(torch.tensor([1e-44, 1e38]), 4)
    assert first == -126 * 4 and lattice_values(4, first, count)[-1] > 1e37


def test_the_range_stops_at_the_largest_level_the_dtype_holds() -> None:
    # float16's largest values: the nearest level, 2 ** 16, would be restored as inf
    values = torch.tensor([300.0, 61088.0], dtype=torch.float16)
    first, count = lattice_range(values, 4, torch.finfo(torch.float16).max)
    levels = lattice_values(4, first, count)
    assert torch.isfinite(levels.half()).all() and float(levels[-1]) > 50000
    assert lattice_range(values, 4)[1] == count + 1  # without the ceiling: one level more
    # subnormal values with a ceiling: the normal range's first level, as without one
    assert lattice_range(torch.tensor([1e-42, 2e-42]), 4, 3.0e38) == lattice_range(torch.tensor([1e-42, 2e-42]), 4) == (-504, 1)
    # a ceiling below every value: the one level under it
    first, count = lattice_range(torch.tensor([1e6]), 4, 65504.0)
    assert count == 1 and float(lattice_values(4, first, 1)[0]) <= 65504


def test_find_lattice_accepts_only_exact_lattice_levels() -> None:
    levels = lattice_values(4, -40, 25)
    assert find_lattice(levels, (4,)) == (4, -40)
    assert find_lattice(levels, (3,)) is None
    nudged = levels.clone()
    nudged[7] = torch.nextafter(nudged[7], torch.tensor(1.0))
    assert find_lattice(nudged, (4,)) is None
    assert find_lattice(torch.cat([torch.zeros(1), levels]), (4,)) is None


def _positive(seed: int, size: int = 3000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randn(size, generator=generator) * 3 - 20)


def _lattice_stream(delta: bool) -> tuple[DynaQuantCodec, torch.Tensor, object, torch.Tensor]:
    tensor = _positive(1)
    reference = _positive(2) if delta else None
    first, count = lattice_range(tensor, 4)
    codec_type = DynaQuantDeltaCodec if delta else DynaQuantCodec
    codec = codec_type(bins=16, protect=0.005, domain="log").with_hints(centroids=lattice_values(4, first, count))
    encoded = codec.encode(tensor, reference) if delta else codec.encode(tensor)
    return codec, tensor, encoded, reference


@pytest.mark.parametrize("delta", [False, True])
def test_a_log_table_on_a_lattice_is_stored_as_two_numbers(delta: bool) -> None:
    codec, tensor, encoded, reference = _lattice_stream(delta)
    stream = bytes(encoded.streams[0])
    assert stream[1] & 1 and stream[1] & 4  # log domain, on a lattice
    decoded = codec.decode(encoded.streams, encoded.params, TensorSpec.of(tensor), reference)
    assert same_bits(decoded, encoded.reconstruction)
    # every value not kept in 16 bits lies on the lattice, within an eighth of an octave
    # and the width of a sketch key (ids are assigned by key: 6 mantissa bits)
    first, count = lattice_range(tensor, 4)
    levels = set(lattice_values(4, first, count).tolist())
    on_levels = torch.tensor([float(x) in levels for x in decoded.tolist()])
    assert int((~on_levels).sum()) <= math.ceil(0.005 * tensor.numel())
    assert float(torch.log2(decoded[on_levels] / tensor[on_levels]).abs().max()) <= 0.125 + math.log2(1 + 2**-6)
    # the same levels one ulp off the lattice are stored value by value
    levels = lattice_values(4, first, count)
    levels[3] = torch.nextafter(levels[3], torch.tensor(1.0))
    uneven = type(codec)(bins=16, protect=0.005, domain="log").with_hints(centroids=levels)
    other = uneven.encode(tensor, reference) if delta else uneven.encode(tensor)
    assert not bytes(other.streams[0])[1] & 4
    assert len(bytes(other.streams[0])) == len(stream) + 4 * (count + 1) - struct.calcsize("<Bi")


def test_a_damaged_or_impossible_lattice_is_refused() -> None:
    codec, tensor, encoded, _ = _lattice_stream(False)
    spec = TensorSpec.of(tensor)
    stream = bytes(encoded.streams[0])
    protected = stream[struct.calcsize("<BBHHHHI")]
    assert protected < 0x80  # one varint byte: the lattice follows it
    values_at = struct.calcsize("<BBHHHHI") + 1
    for divisions, first in ((0, 0), (MAX_DIVISIONS + 1, 0), (4, -2**31), (4, 2**31 - 1), (4, 126 * 4)):
        damaged = bytearray(stream)
        damaged[values_at:values_at + 5] = struct.pack("<Bi", divisions, first)
        with pytest.raises(CorruptCheckpointError):
            codec.decode([bytes(damaged)], encoded.params, spec, None)
    damaged = bytearray(stream)
    struct.pack_into("<H", damaged, 4, 1)  # the zero level elsewhere than first
    with pytest.raises(FormatError):
        codec.decode([bytes(damaged)], encoded.params, spec, None)
    check_damaged_streams(codec, tensor)
