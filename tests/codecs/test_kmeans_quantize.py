"""KMeansQuantizeCodec (ExCP): k-means centres + a zero code, fp16 codebook, LZMA back end."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import KMeansQuantizeCodec, ResidualCodec, get_codec
from inshrinkerator.codecs.kmeans_quantize import kmeans_1d
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


def check_nearest_centre(original: torch.Tensor, decoded: torch.Tensor, keep: torch.Tensor, bits: int) -> None:
    """Pruned values and zeros decode to 0; every kept value decodes to its nearest codebook entry."""
    x, y, keep = original.double().reshape(-1), decoded.double().reshape(-1), keep.reshape(-1)
    assert torch.all(y[~keep | (x == 0)] == 0)
    kept = keep & (x != 0)
    codebook = torch.unique(y[kept])
    assert codebook.numel() <= (1 << bits) - 1
    if codebook.numel():
        nearest = (x[kept].unsqueeze(1) - codebook).abs().min(dim=1).values
        assert torch.all((x[kept] - y[kept]).abs() <= nearest + 1e-6 * x[kept].abs().max())


finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=30, deadline=None)
@given(values=st.lists(finite, min_size=0, max_size=200), bits=st.integers(1, 5), seed=st.integers(0, 9))
def test_round_trip_within_stated_bound(values: list[float], bits: int, seed: int) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    keep = torch.rand(tensor.shape, generator=torch.Generator().manual_seed(seed)) < 0.7
    codec = KMeansQuantizeCodec(bits, lzma_preset=1, lzma_extreme=False)
    check_nearest_centre(tensor, encode_decode(codec.keeping(keep), tensor), keep, bits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    tensor = (torch.randn(50, 20, dtype=torch.float64) * 0.05).to(dtype)
    decoded = encode_decode(KMeansQuantizeCodec(4), tensor)
    assert torch.unique(decoded).numel() <= 15
    assert float((tensor.double() - decoded.double()).abs().max()) < 0.05


def test_few_distinct_values_are_stored_exactly() -> None:
    tensor = torch.tensor([0.1, -7.25, 0.0, 3e-9, 0.1, 12345.5] * 20)
    encoded = KMeansQuantizeCodec(4).encode(tensor)
    assert encoded.params["codebook_dtype"] == "float32"
    assert torch.equal(encode_decode(KMeansQuantizeCodec(4), tensor), tensor)


def test_codebook_is_fp16_and_tiny_moments_do_not_underflow() -> None:
    # Adam second moments: positive, spanning orders of magnitude far below fp16's normal range.
    second_moment = torch.rand(4000).pow(4) * 1e-9 + 1e-14
    encoded = KMeansQuantizeCodec(4).encode(second_moment)
    assert encoded.params["codebook_dtype"] == "float16" and len(encoded.streams[0]) == 2 * 15
    decoded = encode_decode(KMeansQuantizeCodec(4), second_moment)
    assert torch.all(decoded > 0)  # a zero second moment under a nonzero first one would blow up Adam
    relative = ((decoded - second_moment).abs() / second_moment.max()).max()
    assert relative < 0.1


def test_kmeans_beats_evenly_spaced_levels() -> None:
    values = torch.randn(20000, dtype=torch.float64)
    centres = kmeans_1d(values, 15, 25)
    uniform = torch.linspace(float(values.min()), float(values.max()), 15, dtype=torch.float64)

    def error(codebook: torch.Tensor) -> float:
        return float((values.unsqueeze(1) - codebook).abs().min(dim=1).values.square().sum())

    assert centres.numel() == 15 and torch.all(centres[1:] > centres[:-1])
    assert error(centres) < 0.5 * error(uniform)


def test_pruned_values_compress_well() -> None:
    tensor = torch.randn(100, 100)
    keep = tensor.abs() > 2.0  # about 95% pruned
    dense = sum(len(s) for s in KMeansQuantizeCodec(4).encode(tensor).streams)
    sparse = sum(len(s) for s in KMeansQuantizeCodec(4).keeping(keep).encode(tensor).streams)
    assert sparse < dense / 3


def test_closed_loop_chain_does_not_drift() -> None:
    states = random_walk(10)
    codec = ResidualCodec(KMeansQuantizeCodec(4, lzma_preset=1, lzma_extreme=False))
    closed = chain_errors(codec, states)
    assert closed[-1] <= 1.5 * max(one_step_errors(codec, states))


@pytest.mark.parametrize("case", golden_cases("kmeans_quantize"), ids=lambda p: p.name)
def test_golden(case) -> None:
    check_golden(case)


def test_goldens_exist() -> None:
    assert len(golden_cases("kmeans_quantize")) >= 3


def test_config_json_round_trip_leaves_the_mask_out() -> None:
    codec = KMeansQuantizeCodec(3, iterations=10, lzma_preset=6, lzma_extreme=False)
    masked = codec.keeping(torch.ones(4, dtype=torch.bool))
    assert get_codec(json.loads(json.dumps(masked.get_config()))) == codec
    assert "keep" not in json.dumps(masked.get_config())


@pytest.mark.parametrize(
    "options", [{"bits": 0}, {"bits": 9}, {"iterations": -1}, {"lzma_preset": 10}, {"lzma_extreme": 1}]
)
def test_bad_options(options: dict) -> None:
    with pytest.raises(ValueError):
        KMeansQuantizeCodec(**options)
    with pytest.raises(FormatError):
        get_codec({"id": "kmeans_quantize", **options})


def test_bad_input_and_damaged_streams() -> None:
    with pytest.raises(ValueError, match="floating"):
        KMeansQuantizeCodec().encode(torch.ones(5, dtype=torch.int16))
    with pytest.raises(ValueError, match="NaN"):
        KMeansQuantizeCodec().encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="keep mask"):
        KMeansQuantizeCodec().keeping(torch.ones(3, dtype=torch.bool)).encode(torch.randn(4))
    with pytest.raises(ValueError, match="bool"):
        KMeansQuantizeCodec().keeping(torch.ones(4))

    def bad_exponent(params: dict) -> None:
        params["scale_exponent"] = "big"

    check_damaged_streams(KMeansQuantizeCodec(4), torch.randn(40, 30), mutate_params=bad_exponent)
