"""Low-rank factors coded column by column: the model family, round trips, sizes, damage."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from inshrinkerator.codecs import DynaQuantCodec, LowRankResidualCodec, get_codec
from inshrinkerator.codecs.base import TensorSpec
from inshrinkerator.codecs.factor_columns import (
    MODEL_COUNT,
    decode_factor_columns,
    encode_factor_columns,
    model_probabilities,
)
from inshrinkerator.codecs.low_rank import FACTOR_LEVELS, LowRankFactors, low_rank_factors
from inshrinkerator.errors import CorruptCheckpointError, FormatError

from .test_low_rank import _moved

LIMIT = FACTOR_LEVELS


def _exact(code: int, limit: int) -> list[Fraction]:
    """The documented family, computed with exact fractions (independently of the module)."""
    if code < 128:
        ratio, power = Fraction(code, 128), (lambda k: k)
    else:
        ratio, power = Fraction(code - 127, 129), (lambda k: k * k)
    half = [max(1, int(2**20 * ratio ** power(k))) for k in range(limit + 1)]
    weights = half[:0:-1] + half
    return [Fraction(w, sum(weights)) for w in weights]


@pytest.mark.parametrize("code", [1, 2, 64, 127, 128, 129, 200, 255])
def test_each_model_is_the_documented_distribution(code: int) -> None:
    probabilities = model_probabilities(code, LIMIT)
    assert probabilities.dtype.name == "float32" and probabilities.shape == (2 * LIMIT + 1,)
    expected = torch.tensor([float(p) for p in _exact(code, LIMIT)], dtype=torch.float32)
    assert torch.equal(torch.tensor(probabilities), expected)
    with pytest.raises(ValueError):  # cached and shared: read-only
        probabilities[0] = 0
    assert (probabilities > 0).all() and abs(float(probabilities.sum()) - 1) < 1e-5
    assert (probabilities == probabilities[::-1]).all()  # symmetric about 0
    assert probabilities.argmax() == LIMIT


def test_model_codes_outside_the_family_are_refused() -> None:
    for code in (0, MODEL_COUNT + 1):
        with pytest.raises(ValueError, match="1..255"):
            model_probabilities(code, LIMIT)


def _decaying_factors(rows: int, cols: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer factors whose columns shrink as a product's do (the square roots of falling
    singular values on one scale)."""
    generator = torch.Generator().manual_seed(seed)
    decay = torch.logspace(0, -1.2, rank)
    def side(count: int) -> torch.Tensor:
        values = torch.randn(count, rank, generator=generator) * 6 * decay
        return values.round().clamp(-LIMIT, LIMIT).to(torch.int8)
    return side(rows), side(cols)


@pytest.mark.parametrize(("rows", "cols", "rank"), [(40, 24, 3), (7, 300, 1), (128, 64, 16)])
def test_columns_round_trip(rows: int, cols: int, rank: int) -> None:
    left, right = _decaying_factors(rows, cols, rank, seed=rows + rank)
    left[0, 0], right[-1, -1] = -LIMIT, LIMIT  # the range's ends
    if rank > 1:
        left[:, 1] = 0  # a column of zeros
    data = encode_factor_columns(left, right, LIMIT)
    again_left, again_right = decode_factor_columns(data, rows, cols, rank, LIMIT)
    assert again_left.shape == (rows, rank) and again_right.shape == (cols, rank)
    assert torch.equal(again_left, left.to(torch.int64)) and torch.equal(again_right, right.to(torch.int64))


def test_each_column_gets_the_model_that_codes_it_cheapest() -> None:
    generator = torch.Generator().manual_seed(3)
    wide = torch.randint(-LIMIT, LIMIT + 1, (4000, 1), generator=generator)
    zeros = torch.zeros(4000, 1, dtype=torch.int64)
    data = encode_factor_columns(wide, zeros, LIMIT)
    codes = list(data[:2])
    # A column spread evenly over the range takes the flattest geometric model; a column
    # of zeros the sharpest one (the Gaussian-shaped model of the smallest ratio).
    assert codes == [127, 128]
    # About log2(31) bits a value for the first, next to nothing for the second.
    assert 4000 * 4.9 / 8 < len(data) < 4000 * 5.0 / 8 + 64


def test_columns_code_decaying_factors_smaller_than_one_count_table() -> None:
    left, right = _decaying_factors(256, 512, 16, seed=5)
    factors = LowRankFactors(left, right, 0.5, 0.25)
    by_columns, by_counts = factors.to_bytes("columns"), factors.to_bytes("counts")
    assert len(by_columns) < 0.93 * len(by_counts)
    for coding, data in (("columns", by_columns), ("counts", by_counts)):
        again = LowRankFactors.from_bytes(data, 256, 512, 16, coding)
        assert torch.equal(again.left, left) and torch.equal(again.right, right)
        assert (again.left_scale, again.right_scale) == (0.5, 0.25)
    with pytest.raises(ValueError, match="factor coding"):
        factors.to_bytes("zstd")


def test_damaged_column_streams_are_refused() -> None:
    left, right = _decaying_factors(64, 48, 4, seed=7)
    data = encode_factor_columns(left, right, LIMIT)
    with pytest.raises(FormatError, match="column models"):
        decode_factor_columns(data[:5], 64, 48, 4, LIMIT)
    with pytest.raises(FormatError, match="model 0"):
        decode_factor_columns(b"\x00" + data[1:], 64, 48, 4, LIMIT)
    for damaged in (data[:-1], data[:-4], data + b"\x00" * 4, data[:8] + data[12:]):
        with pytest.raises(CorruptCheckpointError):
            decode_factor_columns(damaged, 64, 48, 4, LIMIT)
    with pytest.raises(FormatError):  # the same stream read as factors of another size
        decode_factor_columns(data, 64, 47, 4, LIMIT)


def test_the_codec_writes_columns_and_reads_files_written_with_one_table() -> None:
    tensor, reference = _moved((96, 80), 4, seed=9)
    factors = low_rank_factors(tensor - reference, 4)
    spec = TensorSpec.of(tensor)
    new = LowRankResidualCodec(DynaQuantCodec(bins=10), 4).with_factors(factors)
    assert new.get_config()["factor_coding"] == "columns"
    encoded = new.encode(tensor, reference)
    legacy_config = {"id": "residual_low_rank", "inner": {"id": "dynaquant", "bins": 10}, "rank": 4}
    legacy = get_codec(legacy_config)
    assert legacy.factor_coding == "counts"
    legacy_encoded = legacy.with_factors(factors).encode(tensor, reference)
    # The same reconstruction either way; each reads only its own layout.
    assert torch.equal(encoded.reconstruction, legacy_encoded.reconstruction)
    config = json.loads(json.dumps(new.get_config()))
    assert torch.equal(get_codec(config).decode(encoded.streams, encoded.params, spec, reference), encoded.reconstruction)
    assert torch.equal(legacy.decode(legacy_encoded.streams, legacy_encoded.params, spec, reference), encoded.reconstruction)
    with pytest.raises(FormatError):
        legacy.decode(encoded.streams, encoded.params, spec, reference)
    with pytest.raises(FormatError, match="factor_coding"):
        get_codec({**legacy_config, "factor_coding": "zstd"})
    with pytest.raises(ValueError, match="factor_coding"):
        LowRankResidualCodec(DynaQuantCodec(bins=10), 4, factor_coding="zstd")
