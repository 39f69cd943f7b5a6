import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.activations.sz3 import SZ3_PREDICTORS, sz3_available, sz3_compress

pytestmark = pytest.mark.skipif(not sz3_available(), reason="pysz is not installed")


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    shape=st.sampled_from([(1,), (777,), (4, 33), (2, 3, 17, 9)]),
    relative=st.floats(1e-4, 0.2),
    relu=st.booleans(),
    predictor=st.sampled_from(SZ3_PREDICTORS),
)
def test_bound_is_guaranteed(seed, dtype, shape, relative, relu, predictor) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=dtype) * 3
    if relu:
        x = x.clamp_min(0)
    bound = relative * (float(x.max() - x.min()) or 1.0)
    packed = sz3_compress(x, bound, predictor)
    assert packed is not None
    y = packed.decode()
    assert y.dtype == x.dtype and y.shape == x.shape
    assert float((x.double() - y.double()).abs().max()) <= bound
    if relu:  # zeros and positivity of a non-negative tensor come back exactly
        assert torch.equal(x == 0, y == 0) and bool((y >= 0).all())


def test_only_compressed_bytes_stay_alive() -> None:
    x = torch.randn(64, 64, 16)
    packed = sz3_compress(x, 0.01)
    # pysz returns a view of a worst-case buffer; the payload must own just its bytes
    assert packed.payload.base is None
    assert packed.payload.nbytes < x.numel() * 4 / 3


def test_unsupported_inputs_are_declined() -> None:
    assert sz3_compress(torch.randn(10).half(), 0.1) is None
    assert sz3_compress(torch.tensor([1.0, float("nan")]), 0.1) is None
    assert sz3_compress(torch.randn(10), 0.0) is None
    assert sz3_compress(torch.randn(10) * 1e6, 1e-6) is None  # below float32 resolution
    with pytest.raises(ValueError, match="unknown SZ3 predictor"):
        sz3_compress(torch.randn(10), 0.1, "magic")
