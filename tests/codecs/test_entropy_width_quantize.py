"""EntropyWidthQuantizeCodec (QD-Compressor): entropy-chosen bin count, one uniform grid, ANS codes."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import EntropyWidthQuantizeCodec, get_codec
from inshrinkerator.codecs.entropy_width_quantize import entropy_bin_count
from inshrinkerator.errors import FormatError

from .lossy_codec_checks import check_damaged_streams, check_golden, encode_decode, golden_cases


def check_stated_bound(tensor: torch.Tensor, decoded: torch.Tensor, params: dict, codec: EntropyWidthQuantizeCodec) -> None:
    """Every value is within scale / 2 of its decoded value; the bin count lies in the bounds."""
    assert codec.min_bins <= params["bins"] <= codec.max_bins
    slack = 1e-6 * float(tensor.double().abs().max()) if tensor.numel() else 0.0
    assert torch.all((tensor.double() - decoded.double()).abs() <= params["scale"] / 2 + slack)


finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(finite, min_size=0, max_size=300),
    bounds=st.tuples(st.integers(2, 300), st.integers(2, 300)).map(sorted),
)
@example(values=[0.0, 1.401298464324817e-45], bounds=[2, 3])  # the step rounded to 0 among subnormals
@example(values=[-2.8e-45, 0.0, 9.8e-45], bounds=[2, 7])
def test_round_trip_within_stated_bound(values: list[float], bounds: list[int]) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    codec = EntropyWidthQuantizeCodec(*bounds)
    decoded = encode_decode(codec, tensor)
    check_stated_bound(tensor, decoded, codec.encode(tensor).params, codec)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    tensor = (torch.randn(30, 40, dtype=torch.float64) * 0.05).to(dtype)
    decoded = encode_decode(EntropyWidthQuantizeCodec(), tensor)
    assert float((tensor.double() - decoded.double()).abs().max()) < 0.01


def test_layers_that_fill_their_range_get_more_bins() -> None:
    generator = torch.Generator().manual_seed(0)
    flat = torch.rand(10000, generator=generator)  # fills its range: H = log2(4.13 * 0.29 * 256) = 8.2
    normal = torch.randn(10000, generator=generator)  # range about 7.6 std: H = 7.1
    stretched = torch.cat([normal, torch.tensor([-40.0, 40.0])])  # outliers: range 80 std, H = 3.7
    assert entropy_bin_count(flat, 8, 256) == 256
    assert entropy_bin_count(normal, 8, 256) == 256
    assert entropy_bin_count(stretched, 8, 256) == 16
    assert entropy_bin_count(stretched, 32, 256) == 32
    assert entropy_bin_count(torch.full((50,), 3.0), 8, 256) == 8


def test_quantizing_a_restored_layer_again_changes_nothing() -> None:
    tensor = torch.randn(300, 300) * 0.05
    codec = EntropyWidthQuantizeCodec()
    first = codec.encode(tensor)
    second = codec.encode(first.reconstruction)
    assert second.params["bins"] == first.params["bins"]
    assert torch.allclose(second.reconstruction, first.reconstruction, rtol=0, atol=1e-7)


def test_low_entropy_codes_take_less_than_their_width() -> None:
    tensor = torch.randn(200, 200)
    encoded = EntropyWidthQuantizeCodec().encode(tensor)
    bits_per_value = 8 * len(encoded.streams[0]) / tensor.numel()
    assert bits_per_value < torch.tensor(encoded.params["bins"]).log2().item() - 0.5


@pytest.mark.parametrize("case", golden_cases("entropy_width_quantize"), ids=lambda p: p.name)
def test_golden(case) -> None:
    check_golden(case)


def test_goldens_exist() -> None:
    assert len(golden_cases("entropy_width_quantize")) >= 2


def test_config_json_round_trip() -> None:
    codec = EntropyWidthQuantizeCodec(16, 64)
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec


@pytest.mark.parametrize(
    "options", [{"min_bins": 1}, {"max_bins": 1 << 17}, {"min_bins": 64, "max_bins": 32}, {"min_bins": 8.0}]
)
def test_bad_options(options: dict) -> None:
    with pytest.raises(ValueError):
        EntropyWidthQuantizeCodec(**options)
    with pytest.raises(FormatError):
        get_codec({"id": "entropy_width_quantize", **options})


@pytest.mark.parametrize(
    "change", [{"bins": 1}, {"bins": 100000}, {"low": "x"}, {"scale": -1.0}, {"scale": float("nan")}], ids=str
)
def test_bad_params(change: dict) -> None:
    tensor = torch.randn(20, 20)
    codec = EntropyWidthQuantizeCodec()

    def mutate(params: dict) -> None:
        params.update(change)

    check_damaged_streams(codec, tensor, mutate_params=mutate)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="floating"):
        EntropyWidthQuantizeCodec().encode(torch.ones(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="NaN"):
        EntropyWidthQuantizeCodec().encode(torch.tensor([float("nan")]))
