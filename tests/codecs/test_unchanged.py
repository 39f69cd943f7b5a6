"""UnchangedCodec: a tensor stored as its reference, in no bytes."""

from __future__ import annotations

import io

import pytest
import torch

from inshrinkerator.codecs import TensorSpec, UnchangedCodec
from inshrinkerator.container import ContainerReader
from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError, FormatError
from inshrinkerator.policies.base import Policy
from inshrinkerator.serialize import read_state, write_state

from .lossy_codec_checks import check_golden, encode_decode, golden_cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_it_decodes_to_a_copy_of_the_reference_whatever_the_tensor(dtype: torch.dtype) -> None:
    reference = torch.randn(30, 20, generator=torch.Generator().manual_seed(0)).to(dtype)
    tensor = reference + 1e-3  # the policy vouched that this is close enough
    decoded = encode_decode(UnchangedCodec(), tensor, reference)
    assert torch.equal(decoded, reference)
    decoded.add_(1.0)  # the caller owns what it loads: the reference is not touched
    assert not torch.equal(decoded, reference)


def test_it_stores_no_bytes_in_a_container() -> None:
    class AllUnchanged(Policy):
        name = "test-unchanged"

        def plan(self, leaves, references):
            return [UnchangedCodec() for _ in leaves]

    reference = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    out = io.BytesIO()
    write_state(out, {"w": reference["w"] * 1.0001, "b": reference["b"]}, AllUnchanged(), references=reference)
    with ContainerReader(io.BytesIO(out.getvalue()), "unchanged.ink") as reader:
        assert reader.header.data_bytes == 0
        loaded = read_state(reader, reference)
    assert torch.equal(loaded["w"], reference["w"]) and torch.equal(loaded["b"], reference["b"])


def test_another_or_missing_reference_is_a_broken_chain() -> None:
    codec = UnchangedCodec()
    reference = torch.randn(100)
    encoded = codec.encode(reference.clone(), reference)
    spec = TensorSpec.of(reference)
    with pytest.raises(BrokenChainError, match="fingerprint"):
        codec.decode(encoded.streams, encoded.params, spec, reference + 1)
    with pytest.raises(BrokenChainError, match="missing"):
        codec.decode(encoded.streams, encoded.params, spec, None)
    with pytest.raises(BrokenChainError):
        codec.decode(encoded.streams, encoded.params, spec, reference.double())
    with pytest.raises(BrokenChainError):
        codec.encode(reference, None)


def test_forged_params_and_streams_are_refused() -> None:
    codec = UnchangedCodec()
    reference = torch.randn(100)
    spec = TensorSpec.of(reference)
    params = codec.encode(reference, reference).params
    for forged in ({}, {"fingerprint": "1"}, {"fingerprint": True}, []):
        with pytest.raises(FormatError):
            codec.decode([], forged, spec, reference)
    with pytest.raises(CorruptCheckpointError):
        codec.decode([b"x"], params, spec, reference)


@pytest.mark.parametrize("case", golden_cases("unchanged"), ids=lambda p: p.name)
def test_golden_files_decode_and_encode_the_same(case) -> None:
    check_golden(case)


def test_goldens_exist() -> None:
    assert golden_cases("unchanged")
