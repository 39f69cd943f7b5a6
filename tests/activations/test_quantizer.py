import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.activations.quantizer import quantize

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
    scale=st.floats(1e-3, 1e3),
    relative=st.floats(1e-4, 0.3),
    relu=st.booleans(),
    size=st.integers(1, 3000),
)
def test_bound_is_guaranteed_and_no_sign_flips(seed, dtype, scale, relative, relu, size) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, generator=generator, dtype=torch.float64) * scale
    x[torch.rand(size, generator=generator) < 0.05] = 0.0
    if relu:
        x = x.clamp_min(0)
    x = x.to(dtype)
    value_range = float(x.max() - x.min()) or 1.0
    bound = relative * value_range
    packed = quantize(x, bound)
    if packed is None:  # only allowed when the dtype cannot resolve the bound
        assert dtype in (torch.float16, torch.bfloat16)
        assert bound < float(x.abs().max()) * torch.finfo(dtype).eps * 4
        return
    y = packed.decode()
    assert y.dtype == x.dtype and y.shape == x.shape
    assert float((x.double() - y.double()).abs().max()) <= bound
    # zeros stay zero and no value changes sign; only values within the bound may become zero
    assert bool((y[x == 0] == 0).all())
    assert bool((torch.sign(x) * torch.sign(y) >= 0).all())
    became_zero = (y == 0) & (x != 0)
    assert bool((x[became_zero].double().abs() <= bound).all())
    if relu and bool((x == 0).any()):  # a ReLU output: its mask comes back exactly
        assert torch.equal(x == 0, y == 0)


def test_shapes_and_layouts() -> None:
    x = torch.relu(torch.randn(32, 16, 8, 8))
    packed = quantize(x, 0.05)
    assert packed.positive  # non-negative with exact zeros: the mask-exact layout
    assert all(chunk.sparse_mask is not None for chunk in packed.chunks)  # half zeros: mask wins
    assert not quantize(torch.randn(100), 0.05).positive
    assert not quantize(torch.rand(100) + 0.5, 0.05).positive  # no zeros: mid-tread is smaller
    assert packed.decode().shape == x.shape
    assert packed.nbytes * 4 < x.numel() * 4


def test_large_tensors_are_coded_in_chunks() -> None:
    x = torch.randn(3 * (1 << 20) + 5)
    packed = quantize(x, 0.01)
    assert [chunk.count for chunk in packed.chunks] == [1 << 20] * 3 + [5]
    assert float((packed.decode() - x).abs().max()) <= 0.01


def test_error_is_centred_and_uniform() -> None:
    x = torch.randn(200_000, dtype=torch.float64)
    bound = 0.05
    error = quantize(x, bound).decode() - x
    assert abs(float(error.mean())) < 3 * bound / math.sqrt(3 * x.numel()) * 3
    assert math.isclose(float(error.std()), bound / math.sqrt(3), rel_tol=0.02)


def test_non_finite_or_bad_bound_is_refused() -> None:
    x = torch.randn(100)
    assert quantize(torch.cat([x, torch.tensor([math.nan])]), 0.1) is None
    assert quantize(torch.cat([x, torch.tensor([math.inf])]), 0.1) is None
    assert quantize(x, 0.0) is None
    assert quantize(x, math.nan) is None
    assert quantize(torch.arange(10), 0.1) is None  # integers are not quantized


def test_a_bound_that_underflows_is_refused_not_divided_by() -> None:
    # subnormal activations: the bound, relative to their range, is 0 in float32
    x = torch.randn(100) * 1e-41
    assert quantize(x, 1e-6 * float(x.max() - x.min())) is None


@pytest.mark.parametrize("dtype, peak", [(torch.float32, 3.1e38), (torch.float16, 65000.0), (torch.bfloat16, 3.3e38)])
def test_a_bin_beyond_the_dtypes_largest_value_is_refused_not_stored_as_inf(dtype: torch.dtype, peak: float) -> None:
    # Values near the dtype's largest under a bound a tenth of their range: the nearest bin
    # of the extreme values lies past the largest value and would come back as inf.
    x = (torch.linspace(-1, 1, 240, dtype=torch.float64) * peak).to(dtype)
    assert bool(x.isfinite().all())
    bound = 0.1 * (float(x.double().max()) - float(x.double().min()))
    quantized = quantize(x, bound)
    if quantized is not None:  # if it is stored, every value comes back finite, within the bound
        back = quantized.decode()
        assert bool(back.isfinite().all())
        assert float((back.double() - x.double()).abs().max()) <= bound
    # A bound whose bins all fit is still quantized, at the same magnitude.
    small = quantize(x, 1e-3 * (float(x.double().max()) - float(x.double().min())))
    assert small is not None and bool(small.decode().isfinite().all())
