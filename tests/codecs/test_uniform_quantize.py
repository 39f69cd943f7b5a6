"""UniformQuantizeCodec (Check-N-Run): per-row asymmetric uniform grids, greedy clip search."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import UniformQuantizeCodec, get_codec
from inshrinkerator.errors import FormatError

from .lossy_codec_checks import check_damaged_streams, check_golden, encode_decode, golden_cases


def grids(codec: UniformQuantizeCodec, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored per-row ``low`` and ``scale``."""
    streams = codec.encode(tensor).streams
    return (
        torch.frombuffer(bytearray(streams[0]), dtype=torch.float32),
        torch.frombuffer(bytearray(streams[1]), dtype=torch.float32),
    )


def rows_of(tensor: torch.Tensor, per_row: bool) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1) if per_row and tensor.dim() == 2 else tensor.reshape(1, -1)


def check_stated_bound(codec: UniformQuantizeCodec, tensor: torch.Tensor, decoded: torch.Tensor) -> None:
    """Inside its row's clip range a value is within scale / 2; a row's squared error is at most
    that of the plain min/max grid."""
    low, scale = grids(codec, tensor)
    x = rows_of(tensor.double(), codec.per_row)
    y = rows_of(decoded.double(), codec.per_row)
    low, scale = low.double().unsqueeze(1), scale.double().unsqueeze(1)
    high = low + scale * ((1 << codec.bits) - 1)
    inside = (x >= low) & (x <= high)
    slack = 1e-6 * x.abs().amax(dim=1, keepdim=True) + 1e-30
    assert torch.all(((x - y).abs() <= scale / 2 + slack)[inside])
    plain = UniformQuantizeCodec(codec.bits, codec.per_row, codec.search_steps, 0.0)
    plain_error = (x - rows_of(plain.encode(tensor).reconstruction.double(), codec.per_row)).square().sum(1)
    assert torch.all((x - y).square().sum(1) <= plain_error * (1 + 1e-5) + 1e-20)


finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 6),
    columns=st.integers(1, 40),
    bits=st.integers(1, 8),
    per_row=st.booleans(),
    steps=st.sampled_from([10, 25, 50]),
    fraction=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_round_trip_within_stated_bound(data, rows, columns, bits, per_row, steps, fraction) -> None:
    values = data.draw(st.lists(finite, min_size=rows * columns, max_size=rows * columns))
    tensor = torch.tensor(values, dtype=torch.float32).reshape(rows, columns)
    codec = UniformQuantizeCodec(bits, per_row, steps, fraction)
    check_stated_bound(codec, tensor, encode_decode(codec, tensor))


@pytest.mark.parametrize("shape", [(0,), (7,), (3, 0), (4, 5, 6), ()], ids=str)
def test_shapes(shape: tuple) -> None:
    tensor = torch.randn(shape)
    encode_decode(UniformQuantizeCodec(), tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    tensor = (torch.randn(30, 40, dtype=torch.float64) * 0.05).to(dtype)
    decoded = encode_decode(UniformQuantizeCodec(4), tensor)
    assert float((tensor.double() - decoded.double()).abs().max()) < 0.05


def test_clip_search_lowers_the_error_of_heavy_tailed_rows() -> None:
    tensor = torch.distributions.StudentT(2.0).sample((64, 256)).float()  # seeded by conftest
    searched = UniformQuantizeCodec(4, search_range=0.5).encode(tensor).reconstruction
    plain = UniformQuantizeCodec(4, search_range=0.0).encode(tensor).reconstruction
    assert (tensor - searched).square().sum() < 0.8 * (tensor - plain).square().sum()


def test_codes_take_bits_per_value() -> None:
    tensor = torch.randn(64, 100)
    for bits in (2, 4, 8):
        streams = UniformQuantizeCodec(bits, search_range=0.0).encode(tensor).streams
        assert len(streams[2]) == 64 * 100 * bits // 8
        assert len(streams[0]) == len(streams[1]) == 64 * 4


@pytest.mark.parametrize("case", golden_cases("uniform_quantize"), ids=lambda p: p.name)
def test_golden(case) -> None:
    check_golden(case)


def test_goldens_exist() -> None:
    assert len(golden_cases("uniform_quantize")) >= 2


def test_config_json_round_trip() -> None:
    codec = UniformQuantizeCodec(3, False, 25, 0.4)
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec


@pytest.mark.parametrize(
    "options",
    [{"bits": 0}, {"bits": 9}, {"per_row": 1}, {"search_steps": 0}, {"search_range": 1.0}, {"search_range": -0.1}],
)
def test_bad_options(options: dict) -> None:
    with pytest.raises(ValueError):
        UniformQuantizeCodec(**options)
    with pytest.raises(FormatError):
        get_codec({"id": "uniform_quantize", **options})


def test_bad_input_and_damaged_streams() -> None:
    with pytest.raises(ValueError, match="floating"):
        UniformQuantizeCodec().encode(torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN"):
        UniformQuantizeCodec().encode(torch.tensor([[1.0, float("-inf")]]))

    def wrong_rows(params: dict) -> None:
        params["rows"] = 3

    check_damaged_streams(UniformQuantizeCodec(4), torch.randn(10, 30), mutate_params=wrong_rows)
