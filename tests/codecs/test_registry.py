"""The codec registry and the config contract every codec shares."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from inshrinkerator.codecs import (
    ByteGroupingCodec,
    Codec,
    Encoded,
    RawCodec,
    get_codec,
    register_codec,
    registered_codecs,
)
from inshrinkerator.codecs import registry as registry_module
from inshrinkerator.errors import FormatError


class _Shift(Codec):
    """A toy codec: adds ``amount`` to integers (lossless, exercises the contract only)."""

    codec_id = "test-shift"

    def __init__(self, amount: int = 1) -> None:
        if not isinstance(amount, int):
            raise ValueError("amount must be an int")
        self.amount = amount

    def encode(self, tensor, reference=None):
        return Encoded(streams=[(tensor + self.amount).numpy().tobytes()])

    def decode(self, streams, params, spec, reference=None):
        return torch.frombuffer(bytearray(streams[0]), dtype=spec.dtype).reshape(spec.shape) - self.amount


@pytest.fixture
def shift_registered() -> Iterator[type[Codec]]:
    register_codec(_Shift)
    yield _Shift
    registry_module._REGISTRY.pop(_Shift.codec_id, None)


def test_a_registered_codec_is_built_from_its_json_config(shift_registered):
    codec = get_codec(json.loads(json.dumps({"id": "test-shift", "amount": 3})))
    assert isinstance(codec, _Shift) and codec.amount == 3
    assert codec == _Shift(3) and codec != _Shift(4) and hash(codec) == hash(_Shift(3))
    assert repr(codec) == "_Shift(amount=3)"
    assert "test-shift" in registered_codecs()


def test_registering_the_same_class_twice_is_harmless_but_an_id_clash_is_refused(shift_registered):
    assert register_codec(_Shift) is _Shift

    class Impostor(_Shift):
        codec_id = "test-shift"

    with pytest.raises(ValueError, match="already taken"):
        register_codec(Impostor)


def test_registered_codecs_is_a_copy():
    snapshot = registered_codecs()
    snapshot.pop("raw")
    assert "raw" in registered_codecs()


@pytest.mark.parametrize(
    "config",
    [None, [], "raw", {}, {"id": 5}, {"id": None}, {"id": "no-such-codec"}],
    ids=repr,
)
def test_configs_that_name_no_codec_are_format_errors(config):
    with pytest.raises(FormatError):
        get_codec(config)


def test_unknown_ids_name_the_known_codecs():
    with pytest.raises(FormatError, match="byte_grouping"):
        get_codec({"id": "zfp"})


@pytest.mark.parametrize(
    "config",
    [{"id": "raw", "level": 1}, {"id": "byte_grouping", "level": "fast"}, {"id": "byte_grouping", "chunk_bytes": -1}],
    ids=repr,
)
def test_configs_with_bad_options_are_format_errors(config):
    with pytest.raises(FormatError):
        get_codec(config)


def _default_codecs() -> list[Codec]:
    codecs = []
    for cls in registered_codecs().values():
        try:
            codecs.append(cls())
        except TypeError:  # needs arguments: covered by its own tests
            continue
    return codecs


@pytest.mark.parametrize("codec", _default_codecs(), ids=lambda c: c.codec_id)
def test_every_default_constructible_codec_has_a_json_config_that_rebuilds_it(codec):
    config = codec.get_config()
    assert config["id"] == codec.codec_id
    rebuilt = get_codec(json.loads(json.dumps(config)))
    assert type(rebuilt) is type(codec) and rebuilt == codec


def test_the_lossless_codecs_are_registered_by_their_ids():
    codecs = registered_codecs()
    assert codecs["raw"] is RawCodec and codecs["byte_grouping"] is ByteGroupingCodec
    assert codecs["xor_delta"].uses_reference and codecs["xor_delta"].lossless
