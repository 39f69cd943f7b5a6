"""RawCodec and the byte view every lossless codec starts from."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import RawCodec, TensorSpec, dtype_from_name, get_codec
from inshrinkerator.codecs.raw import tensor_byte_view, tensor_bytes, tensor_from_bytes
from inshrinkerator.errors import CorruptCheckpointError

from ..helpers import ALL_DTYPES, assert_same, check_codec_roundtrip, make_tensor

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "codecs" / "raw"


@pytest.mark.parametrize("dtype", ALL_DTYPES + [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (1,), (5, 7)], ids=str)
def test_round_trip_is_exact(dtype, shape):
    tensor = make_tensor(dtype, shape) if not dtype.is_complex else torch.randn(shape, dtype=dtype)
    assert_same(check_codec_roundtrip(RawCodec(), tensor), tensor)


def test_views_are_stored_as_their_values():
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    for view in (base.t(), base[::2, 3:], base[1].expand(4, 10), torch.randn(4, dtype=torch.complex64).conj()):
        expected = view.resolve_conj().contiguous()
        assert_same(check_codec_roundtrip(RawCodec(), view), expected)


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=400), dtype=st.sampled_from([d for d in ALL_DTYPES if d != torch.bool]))
def test_bytes_survive_exactly(data, dtype):
    usable = len(data) - len(data) % dtype.itemsize
    spec = TensorSpec(dtype, (usable // dtype.itemsize,))
    tensor = tensor_from_bytes(data[:usable], spec)
    assert tensor_bytes(tensor) == data[:usable]


def test_the_byte_view_shares_memory_only_when_it_can():
    tensor = torch.arange(10, dtype=torch.int32)
    view = tensor_byte_view(tensor)
    assert view.dtype.itemsize == 1 and view.size == 40
    tensor[0] = 7
    assert view[0] == 7  # contiguous CPU tensor: no copy
    strided = tensor[::2]
    assert tensor_byte_view(strided).size == 20


def test_size_mismatch_stream_count_and_bad_bools_are_corruption():
    spec = TensorSpec(torch.float32, (4,))
    with pytest.raises(CorruptCheckpointError):
        RawCodec().decode([b"\0" * 15], {}, spec)
    with pytest.raises(CorruptCheckpointError):
        RawCodec().decode([b"\0" * 16, b""], {}, spec)
    with pytest.raises(CorruptCheckpointError, match="bool"):
        RawCodec().decode([bytes([0, 1, 2])], {}, TensorSpec(torch.bool, (3,)))


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_golden_encodings_still_decode(path):
    doc = json.loads(path.read_text())
    spec = TensorSpec(dtype_from_name(doc["dtype"]), tuple(doc["shape"]))
    decoded = get_codec(doc["codec"]).decode([base64.b64decode(s) for s in doc["streams"]], doc["params"], spec)
    assert tensor_bytes(decoded) == base64.b64decode(doc["expected"])
