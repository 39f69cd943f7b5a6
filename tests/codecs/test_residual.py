"""ResidualCodec: closed-loop residual against a reference, any reference-free inner codec."""

from __future__ import annotations

import json

import pytest
import torch

from inshrinkerator.codecs import (
    ByteGroupingCodec,
    CyclicCodeDeltaCodec,
    ExponentBucketCodec,
    KMeansQuantizeCodec,
    ResidualCodec,
    TensorSpec,
    get_codec,
)
from inshrinkerator.errors import BrokenChainError, FormatError

from .lossy_codec_checks import check_damaged_streams, check_golden, encode_decode, golden_cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_reconstruction_is_reference_plus_decoded_residual(dtype: torch.dtype) -> None:
    reference = (torch.randn(40, 30, dtype=torch.float64) * 0.05).to(dtype)
    tensor = (reference.double() + torch.randn(40, 30, dtype=torch.float64) * 1e-3).to(dtype)
    inner = ExponentBucketCodec(4)
    decoded = encode_decode(ResidualCodec(inner), tensor, reference)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    residual = tensor.to(compute) - reference.to(compute)
    expected = (reference.to(compute) + inner.encode(residual).reconstruction).to(dtype)
    assert torch.equal(decoded, expected)


def test_lossless_inner_gives_the_tensor_back() -> None:
    reference = torch.randn(64, 64)
    tensor = reference + torch.randn(64, 64) * 1e-3
    decoded = encode_decode(ResidualCodec(ByteGroupingCodec()), tensor, reference)
    assert torch.allclose(decoded, tensor, rtol=0, atol=1e-6)


def test_inner_may_be_a_config_or_an_object() -> None:
    by_config = ResidualCodec(KMeansQuantizeCodec(3).get_config())
    by_object = ResidualCodec(KMeansQuantizeCodec(3))
    assert by_config == by_object
    assert get_codec(json.loads(json.dumps(by_object.get_config()))) == by_object


def test_inner_with_its_own_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="inner"):
        ResidualCodec(CyclicCodeDeltaCodec())
    with pytest.raises(FormatError):
        get_codec({"id": "residual", "inner": {"id": "no_such_codec"}})


def test_wrong_or_missing_reference() -> None:
    reference = torch.randn(20, 20)
    tensor = reference + 0.01
    codec = ResidualCodec(ExponentBucketCodec())
    encoded = codec.encode(tensor, reference)
    spec = TensorSpec.of(tensor)
    with pytest.raises(BrokenChainError, match="checksum"):
        codec.decode(encoded.streams, encoded.params, spec, reference * 2)
    with pytest.raises(BrokenChainError, match="missing"):
        codec.decode(encoded.streams, encoded.params, spec, None)
    with pytest.raises(BrokenChainError, match="reference is"):
        codec.encode(tensor, reference[:10])


@pytest.mark.parametrize("case", golden_cases("residual"), ids=lambda p: p.name)
def test_golden(case) -> None:
    check_golden(case)


def test_goldens_exist() -> None:
    assert len(golden_cases("residual")) >= 2


def test_bad_input_and_damaged_streams() -> None:
    reference = torch.randn(30, 30)
    with pytest.raises(ValueError, match="floating"):
        ResidualCodec(ExponentBucketCodec()).encode(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))

    def no_inner(params: dict) -> None:
        del params["inner"]

    check_damaged_streams(ResidualCodec(ExponentBucketCodec()), reference + 0.01, reference, mutate_params=no_inner)
