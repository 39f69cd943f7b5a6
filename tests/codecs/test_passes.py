"""Reductions one slice at a time: bit for bit the whole-tensor expression on one slice,
the slices' sum (within rounding) on more."""

from __future__ import annotations

import math

import pytest
import torch

from inshrinkerator.codecs.log_sketch import SIGNED_KEYS, signed_keys
from inshrinkerator.codecs.passes import (
    SLICE_ELEMENTS,
    key_counts,
    largest_magnitude,
    slices,
    squared_differences,
    sum_of_squares,
)


def _values(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, generator=torch.Generator().manual_seed(seed)) * 3


def test_slices_cover_the_range_in_order() -> None:
    count = 2 * SLICE_ELEMENTS + 5
    parts = list(slices(count))
    assert [p.start for p in parts] == [0, SLICE_ELEMENTS, 2 * SLICE_ELEMENTS]
    assert parts[-1].stop == count
    assert list(slices(0)) == []


def test_squared_differences_match_the_whole_expression_on_one_slice() -> None:
    values, reference, weights = _values(5000, 1), _values(5000, 2), _values(5000, 3).abs()
    difference = values - reference
    plain, weighted = squared_differences(values, reference, weights)
    assert plain == float(torch.dot(difference, difference))
    assert weighted == float(torch.dot(difference * weights, difference))
    assert squared_differences(values, reference) == (plain, None)
    assert squared_differences(difference, None, weights) == (plain, weighted)


def test_squared_differences_sum_the_slices_of_a_large_tensor() -> None:
    count = 2 * SLICE_ELEMENTS + 1234
    values, reference, weights = _values(count, 4), _values(count, 5), _values(count, 6).abs()
    difference = (values - reference).double()
    plain, weighted = squared_differences(values, reference, weights)
    assert plain == pytest.approx(float((difference * difference).sum()), rel=1e-5)
    assert weighted == pytest.approx(float((difference * weights.double() * difference).sum()), rel=1e-5)


def test_sum_of_squares_in_float64() -> None:
    small = _values(1000, 7)
    assert sum_of_squares(small) == float(torch.linalg.vector_norm(small, dtype=torch.float64)) ** 2
    large = _values(SLICE_ELEMENTS + 10, 8)
    assert sum_of_squares(large) == pytest.approx(float((large.double() ** 2).sum()), rel=1e-12)
    assert sum_of_squares(torch.empty(0)) == 0.0
    large[-1] = float("inf")
    assert sum_of_squares(large) == math.inf
    large[-1] = float("nan")
    assert math.isnan(sum_of_squares(large))


@pytest.mark.parametrize("position", [0, 1, 77, 4095, 4096, 9999])
@pytest.mark.parametrize("special", [-1e30, 1e30, float("inf"), -float("inf"), -0.0])
def test_largest_magnitude_is_abs_max(position: int, special: float) -> None:
    values = _values(10000, 9)
    values[position] = special
    assert largest_magnitude(values) == float(values.abs().max())


@pytest.mark.parametrize("position", [0, 5, 4096, 9999])
def test_largest_magnitude_is_nan_with_a_nan(position: int) -> None:
    values = _values(10000, 10)
    values[position] = float("nan")
    assert math.isnan(largest_magnitude(values))
    assert math.isnan(float(values.abs().max()))


def test_largest_magnitude_of_zeros() -> None:
    assert largest_magnitude(torch.tensor([-0.0, 0.0])) == 0.0
    assert largest_magnitude(torch.tensor([-2.5])) == 2.5


def test_key_counts_are_the_whole_histogram() -> None:
    values = _values(2 * SLICE_ELEMENTS + 99, 11)
    values[::1000] = 0.0
    expected = torch.bincount(signed_keys(values), minlength=SIGNED_KEYS)
    counts = key_counts(signed_keys, values, SIGNED_KEYS)
    assert counts.dtype == expected.dtype and torch.equal(counts, expected)
