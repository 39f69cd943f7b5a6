"""The float-bit log-histogram sketch: key order, relative accuracy, quantiles, merging."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.log_sketch import (
    ALPHA,
    MAGNITUDE_KEYS,
    SIGNED_KEYS,
    LogHistogram,
    magnitude_key_centres,
    magnitude_keys,
    signed_key_centres,
    signed_keys,
)

finite = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=50, deadline=None)
@given(values=st.lists(finite, min_size=1, max_size=100))
def test_every_value_is_within_alpha_of_its_bucket_centre(values: list[float]) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    keys = signed_keys(tensor)
    assert keys.dtype == torch.int32 and int(keys.min()) >= 0 and int(keys.max()) < SIGNED_KEYS
    centres = signed_key_centres(keys)
    x = tensor.double()
    normal = x.abs() > 1e-37  # below that, subnormals share the zero bucket
    assert torch.all((centres[normal] - x[normal]).abs() <= ALPHA * x[normal].abs() * 1.0001)
    assert torch.all(torch.sign(centres[normal]) == torch.sign(x[normal]))


@settings(max_examples=50, deadline=None)
@given(a=finite, b=finite)
def test_magnitude_keys_are_monotone(a: float, b: float) -> None:
    a, b = (float(v) for v in torch.tensor([a, b], dtype=torch.float32))
    keys = magnitude_keys(torch.tensor([a, b], dtype=torch.float32))
    if abs(a) < abs(b):
        assert keys[0] <= keys[1]
    if abs(a) > abs(b):
        assert keys[0] >= keys[1]


def test_signs_zeros_and_non_finite_values_have_their_own_keys() -> None:
    tensor = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("nan")])
    keys = signed_keys(tensor).tolist()
    assert keys[0] == 0 and keys[1] == MAGNITUDE_KEYS
    assert keys[3] == keys[2] + MAGNITUDE_KEYS
    assert all(k & (MAGNITUDE_KEYS - 1) >= 255 << 6 for k in keys[4:])
    assert float(magnitude_key_centres(torch.tensor([0]))[0]) == 0.0


def test_other_dtypes_key_like_their_float32_value() -> None:
    values = torch.tensor([0.5, -3.25, 1e-3], dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert torch.equal(signed_keys(values.to(dtype)), signed_keys(values.to(dtype).float()))


def test_quantiles_split_the_counts() -> None:
    values = torch.linspace(0.001, 1.0, 10_000)
    sketch = LogHistogram.of(values, signed=False)
    assert sketch.total == 10_000
    for fraction in (0.1, 0.5, 0.9):
        key = sketch.quantile_key(fraction)
        below = int((magnitude_keys(values) < key).sum())
        assert below < fraction * 10_000 <= below + int(sketch.counts[key])
    assert sketch.quantile_key(0.0) == -1


def test_merged_sketches_count_both_inputs() -> None:
    a, b = torch.randn(500), torch.randn(300) * 10
    merged = LogHistogram.of(a).merge(LogHistogram.of(b))
    assert torch.equal(merged.counts, LogHistogram.of(torch.cat([a, b])).counts)
    keys, centres, counts = merged.occupied()
    assert int(counts.sum()) == 800 and keys.numel() == centres.numel()
