"""CyclicCodeDeltaCodec (QD-Compressor): codes stored as (code - previous code) mod B."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import CyclicCodeDeltaCodec, EntropyWidthQuantizeCodec, get_codec
from inshrinkerator.errors import BrokenChainError, FormatError

from .lossy_codec_checks import (
    chain_errors,
    check_damaged_streams,
    check_golden,
    encode_decode,
    golden_cases,
    random_walk,
)

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), count=st.integers(0, 200), move=st.sampled_from([0.0, 1e-3, 1.0, 100.0]))
def test_round_trip_within_stated_bound(data, count: int, move: float) -> None:
    values = data.draw(st.lists(finite, min_size=count, max_size=count))
    reference = torch.tensor(values, dtype=torch.float32)
    tensor = reference + torch.randn(count, generator=torch.Generator().manual_seed(count)) * move
    codec = CyclicCodeDeltaCodec()
    decoded = encode_decode(codec, tensor, reference)
    params = codec.encode(tensor, reference).params
    slack = 1e-6 * float(tensor.abs().max()) if count else 0.0
    assert torch.all((tensor - decoded).abs() <= params["scale"] / 2 + slack)


def test_same_codes_as_the_standalone_quantizer() -> None:
    tensor, reference = torch.randn(50, 40), torch.randn(50, 40)
    delta = CyclicCodeDeltaCodec(16, 128).encode(tensor, reference)
    standalone = EntropyWidthQuantizeCodec(16, 128).encode(tensor)
    assert torch.equal(delta.reconstruction, standalone.reconstruction)
    assert {k: v for k, v in delta.params.items() if k != "reference_crc32"} == standalone.params


def test_unchanged_weights_cost_almost_nothing() -> None:
    states = random_walk(1, shape=(128, 128))
    first = EntropyWidthQuantizeCodec().encode(states[0])
    again = CyclicCodeDeltaCodec().encode(states[0], first.reconstruction)
    moved = CyclicCodeDeltaCodec().encode(states[1], first.reconstruction)
    first_size = len(first.streams[0])
    assert len(again.streams[0]) < 100 < first_size
    assert len(moved.streams[0]) < first_size / 2


def test_closed_loop_chain_error_stays_one_quantization() -> None:
    states = random_walk(10)
    codec = CyclicCodeDeltaCodec()
    errors = chain_errors(codec, states)
    for state, error in zip(states[1:], errors):
        scale = (state.max() - state.min()) / (codec.encode(state, state).params["bins"] - 1)
        assert error <= float(scale) / 2 * (1 + 1e-5)


def test_wrong_or_missing_reference() -> None:
    tensor, reference = torch.randn(10, 10), torch.randn(10, 10)
    codec = CyclicCodeDeltaCodec()
    encoded = codec.encode(tensor, reference)
    spec_args = (encoded.streams, encoded.params)
    from inshrinkerator.codecs import TensorSpec

    spec = TensorSpec.of(tensor)
    with pytest.raises(BrokenChainError, match="checksum"):
        codec.decode(*spec_args, spec, reference + 1)
    with pytest.raises(BrokenChainError, match="missing"):
        codec.decode(*spec_args, spec, None)
    with pytest.raises(BrokenChainError, match="reference is"):
        codec.decode(*spec_args, spec, reference.double())
    with pytest.raises(BrokenChainError, match="missing"):
        codec.encode(tensor)


@pytest.mark.parametrize("case", golden_cases("cyclic_code_delta"), ids=lambda p: p.name)
def test_golden(case) -> None:
    check_golden(case)


def test_goldens_exist() -> None:
    assert len(golden_cases("cyclic_code_delta")) >= 1


def test_config_json_round_trip() -> None:
    codec = CyclicCodeDeltaCodec(4, 1024)
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec


@pytest.mark.parametrize("options", [{"min_bins": 0}, {"min_bins": 300, "max_bins": 200}, {"max_bins": "256"}])
def test_bad_options(options: dict) -> None:
    with pytest.raises(ValueError):
        CyclicCodeDeltaCodec(**options)
    with pytest.raises(FormatError):
        get_codec({"id": "cyclic_code_delta", **options})


def test_bad_input_and_damaged_streams() -> None:
    reference = torch.randn(30, 30)
    with pytest.raises(ValueError, match="NaN"):
        CyclicCodeDeltaCodec().encode(torch.full((30, 30), float("nan")), reference)

    def fewer_bins(params: dict) -> None:
        params["bins"] = 1

    check_damaged_streams(CyclicCodeDeltaCodec(), reference + 0.01, reference, mutate_params=fewer_bins)
