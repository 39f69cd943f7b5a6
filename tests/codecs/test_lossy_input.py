"""What lossy codecs accept: the finiteness check every save runs on every float tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.lossy_input import all_finite, checked_float_input

_SPECIAL = st.sampled_from([float("nan"), float("inf"), float("-inf")])
_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=16), max_size=64),
    huge=st.booleans(),
    special=st.lists(st.tuples(st.integers(0, 63), _SPECIAL), max_size=3),
    dtype=_DTYPES,
)
def test_all_finite_agrees_with_the_elementwise_check(values, huge, special, dtype) -> None:
    tensor = torch.tensor(values, dtype=torch.float64)
    if huge and tensor.numel():
        # sums of finite values that overflow the dtype: the fast path must not be fooled
        tensor = tensor.sign() * torch.finfo(dtype).max * 0.75
    tensor = tensor.to(dtype)
    for position, value in special:
        if tensor.numel():
            tensor[position % tensor.numel()] = value
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())


def test_overflowing_sum_of_finite_values_is_finite() -> None:
    assert all_finite(torch.full((8,), 3e38))
    assert all_finite(torch.full((8,), 6e4, dtype=torch.float16))
    assert not all_finite(torch.tensor([3e38, float("nan")]))


def test_lossy_input_refuses_non_finite_values() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        checked_float_input(torch.tensor([1.0, float("inf")]), "probe")
    with pytest.raises(ValueError, match="floating"):
        checked_float_input(torch.tensor([1, 2]), "probe")
    assert checked_float_input(torch.tensor([1.0, 2.0], dtype=torch.float16), "probe").dtype == torch.float32
