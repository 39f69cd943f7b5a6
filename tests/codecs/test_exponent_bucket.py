"""ExponentBucketCodec (LC-Checkpoint): sign/exponent buckets, priority promotion, ANS-coded ids."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import ExponentBucketCodec, ResidualCodec, get_codec, order0_entropy_bits
from inshrinkerator.errors import FormatError

from .lossy_codec_checks import (
    chain_errors,
    check_damaged_streams,
    check_golden,
    encode_decode,
    golden_cases,
    one_step_errors,
    random_walk,
)


def check_stated_bound(original: torch.Tensor, decoded: torch.Tensor, bits: int, representative: str) -> None:
    """Kept values keep their sign within |x|/2 (midrange) or |x| (mean); dropped ones are
    smaller than twice any kept one; at most 2**bits - 1 distinct nonzero values."""
    x, y = original.double().reshape(-1), decoded.double().reshape(-1)
    kept = y != 0
    assert torch.all(torch.sign(y[kept]) == torch.sign(x[kept]))
    factor = 0.5 if representative == "midrange" else 1.0
    assert torch.all((x[kept] - y[kept]).abs() <= x[kept].abs() * factor * (1 + 1e-6))
    dropped = (~kept) & (x != 0)
    if dropped.any() and kept.any():
        assert float(x[dropped].abs().max()) < 2 * float(x[kept].abs().min())
    assert torch.unique(y[kept]).numel() <= (1 << bits) - 1


finite_floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(finite_floats, min_size=0, max_size=300),
    bits=st.integers(1, 6),
    representative=st.sampled_from(["midrange", "mean"]),
)
def test_round_trip_within_stated_bound(values: list[float], bits: int, representative: str) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    codec = ExponentBucketCodec(bits, representative)
    check_stated_bound(tensor, encode_decode(codec, tensor), bits, representative)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    tensor = (torch.randn(40, 30, dtype=torch.float64) * 0.05).to(dtype)
    decoded = encode_decode(ExponentBucketCodec(4), tensor)
    kept = decoded != 0
    assert kept.any()
    # Half precision adds its own rounding of the representative (8 significant bits for bf16).
    assert torch.all((tensor.double() - decoded.double()).abs()[kept] <= tensor.double().abs()[kept] * 0.51)


def test_promotion_keeps_the_largest_buckets() -> None:
    tensor = torch.tensor([1.5, 3.0, -3.0, 0.3, 0.03, -0.003, 6.0, 0.0])
    decoded = encode_decode(ExponentBucketCodec(2, "mean"), tensor)  # 3 buckets survive
    assert decoded.tolist() == [0.0, 3.0, -3.0, 0.0, 0.0, 0.0, 6.0, 0.0]


def test_fewer_bits_store_less() -> None:
    tensor = torch.randn(100, 100) * 1e-3
    sizes = [sum(len(s) for s in ExponentBucketCodec(bits).encode(tensor).streams) for bits in (2, 3, 4, 6)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_codes_are_entropy_coded_near_their_entropy() -> None:
    tensor = torch.randn(128, 128) * 1e-3
    codec = ExponentBucketCodec(3)
    encoded = codec.encode(tensor)
    table = torch.unique(encoded.reconstruction)
    codes = torch.bucketize(encoded.reconstruction.reshape(-1), table)
    entropy_bytes = order0_entropy_bits(codes, table.numel()) / 8
    assert len(encoded.streams[1]) < entropy_bytes * 1.02 + 200


def test_closed_loop_chain_does_not_drift() -> None:
    states = random_walk(10)
    codec = ResidualCodec(ExponentBucketCodec(3))
    closed = chain_errors(codec, states)
    open_loop = chain_errors(codec, states, closed_loop=False)
    assert closed[-1] <= 1.5 * max(one_step_errors(codec, states))
    assert open_loop[-1] > 2 * closed[-1]  # what the closed loop prevents


@pytest.mark.parametrize("case", golden_cases("exponent_bucket"), ids=lambda p: p.name)
def test_golden(case) -> None:
    check_golden(case)


def test_goldens_exist() -> None:
    assert len(golden_cases("exponent_bucket")) >= 2


def test_config_json_round_trip() -> None:
    codec = ExponentBucketCodec(5, "mean")
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec


@pytest.mark.parametrize("options", [{"bits": 0}, {"bits": 17}, {"bits": 2.0}, {"representative": "median"}])
def test_bad_options(options: dict) -> None:
    with pytest.raises(ValueError):
        ExponentBucketCodec(**options)
    with pytest.raises(FormatError):
        get_codec({"id": "exponent_bucket", **options})


def test_bad_input_and_damaged_streams() -> None:
    with pytest.raises(ValueError, match="floating"):
        ExponentBucketCodec().encode(torch.arange(10))
    with pytest.raises(ValueError, match="NaN or infinite"):
        ExponentBucketCodec().encode(torch.tensor([1.0, float("inf")]))

    def too_many_buckets(params: dict) -> None:
        params["buckets"] = 99

    check_damaged_streams(ExponentBucketCodec(3), torch.randn(30, 20), mutate_params=too_many_buckets)
