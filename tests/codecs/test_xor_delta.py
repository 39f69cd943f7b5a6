"""XorDeltaCodec: exact deltas against a reference, checked against a plain XOR of the bytes."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import (
    ByteGroupingCodec,
    RawCodec,
    TensorSpec,
    XorDeltaCodec,
    dtype_from_name,
    get_codec,
)
from inshrinkerator.codecs.raw import tensor_bytes, tensor_from_bytes
from inshrinkerator.codecs.xor_delta import xor_bits
from inshrinkerator.errors import BrokenChainError, FormatError

from ..helpers import ALL_DTYPES, assert_same, check_codec_roundtrip, make_tensor

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "codecs" / "xor_delta"
DELTA = XorDeltaCodec(inner=ByteGroupingCodec(chunk_bytes=4096).get_config())


def _reference_xor(a: bytes, b: bytes) -> bytes:
    """The delta as plain bytes, computed independently of the codec."""
    return (np.frombuffer(a, dtype=np.uint8) ^ np.frombuffer(b, dtype=np.uint8)).tobytes()


def _fine_tuned(base: torch.Tensor, seed: int) -> torch.Tensor:
    """``base`` nudged a little, as fine-tuning or one more training step would."""
    if base.dtype == torch.bool:
        return base.clone()
    if not base.dtype.is_floating_point:
        every_third = (torch.arange(base.numel()) % 3 == 0).reshape(base.shape)
        return base + every_third.to(base.dtype)
    generator = torch.Generator().manual_seed(seed)
    return (base.double() + torch.randn(base.shape, generator=generator, dtype=torch.float64) * 1e-4).to(base.dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (40, 70)], ids=str)
def test_round_trip_is_exact_against_the_reference(dtype, shape):
    base = make_tensor(dtype, shape, seed=1)
    tuned = _fine_tuned(base, seed=2)
    assert_same(check_codec_roundtrip(DELTA, tuned, base), tuned)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    pair=st.integers(min_value=0, max_value=300).flatmap(
        lambda n: st.tuples(st.binary(min_size=8 * n, max_size=8 * n), st.binary(min_size=8 * n, max_size=8 * n))
    ),
)
def test_the_delta_is_the_xor_of_the_bytes(dtype, pair):
    a_bytes, b_bytes = pair
    if dtype == torch.bool:
        a_bytes = bytes(x & 1 for x in a_bytes)
        b_bytes = bytes(x & 1 for x in b_bytes)
    spec = TensorSpec(dtype, (len(a_bytes) // dtype.itemsize,))
    tensor, reference = tensor_from_bytes(a_bytes, spec), tensor_from_bytes(b_bytes, spec)
    assert tensor_bytes(xor_bits(tensor, reference)) == _reference_xor(a_bytes, b_bytes)
    encoded = DELTA.encode(tensor, reference)
    inner = get_codec(DELTA.inner).decode(encoded.streams, encoded.params["inner"], spec)
    assert tensor_bytes(inner) == _reference_xor(a_bytes, b_bytes)
    assert tensor_bytes(DELTA.decode(encoded.streams, encoded.params, spec, reference)) == a_bytes


def test_close_checkpoints_compress_far_better_as_deltas():
    base = torch.randn(100_000) * 0.02
    tuned = base + torch.randn(100_000) * 1e-6
    delta = sum(memoryview(s).nbytes for s in XorDeltaCodec().encode(tuned, base).streams)
    plain = sum(memoryview(s).nbytes for s in ByteGroupingCodec().encode(tuned).streams)
    assert delta < 0.8 * plain


def test_a_wrong_missing_or_misshapen_reference_is_a_broken_chain():
    base = torch.randn(500)
    tuned = _fine_tuned(base, seed=3)
    encoded = DELTA.encode(tuned, base)
    spec = TensorSpec.of(tuned)
    other = base.clone()
    other[17] += 1.0
    with pytest.raises(BrokenChainError, match="checksum"):
        DELTA.decode(encoded.streams, encoded.params, spec, other)
    with pytest.raises(BrokenChainError, match="missing"):
        DELTA.decode(encoded.streams, encoded.params, spec, None)
    with pytest.raises(BrokenChainError):
        DELTA.decode(encoded.streams, encoded.params, spec, base[:499])
    with pytest.raises(BrokenChainError):
        DELTA.decode(encoded.streams, encoded.params, spec, base.double())
    with pytest.raises(BrokenChainError):
        DELTA.encode(tuned, None)


def test_params_without_the_inner_params_are_a_format_error():
    base = torch.randn(50)
    encoded = DELTA.encode(base * 2, base)
    for params in ({}, {"inner": None, "reference_crc32": encoded.params["reference_crc32"]}, {"inner": []}):
        with pytest.raises(FormatError):
            DELTA.decode(encoded.streams, params, TensorSpec.of(base), base)


def test_config_round_trip_and_inner_codec_checks():
    codec = XorDeltaCodec(inner=RawCodec().get_config())
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec
    assert XorDeltaCodec().inner["id"] == "byte_grouping"
    with pytest.raises(ValueError):
        XorDeltaCodec(inner=XorDeltaCodec().get_config())
    with pytest.raises(ValueError):
        XorDeltaCodec(inner={"id": "no-such-codec"})
    with pytest.raises(FormatError):
        get_codec({"id": "xor_delta", "inner": {"id": "no-such-codec"}})


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_golden_encodings_still_decode(path):
    doc = json.loads(path.read_text())
    spec = TensorSpec(dtype_from_name(doc["dtype"]), tuple(doc["shape"]))
    reference = tensor_from_bytes(base64.b64decode(doc["reference"]), spec)
    decoded = get_codec(doc["codec"]).decode(
        [base64.b64decode(s) for s in doc["streams"]], doc["params"], spec, reference
    )
    assert tensor_bytes(decoded) == base64.b64decode(doc["expected"])
