"""Padding streams: unchanged tensors stay within the container's expansion limit."""

from __future__ import annotations

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import (
    CyclicCodeDeltaCodec,
    EntropyWidthQuantizeCodec,
    ExponentBucketCodec,
    KMeansQuantizeCodec,
    ResidualCodec,
    TensorSpec,
)
from inshrinkerator.codecs.expansion_padding import (
    PADDED_MAX_EXPANSION,
    check_padding_stream,
    padding_stream,
)
from inshrinkerator.errors import CorruptCheckpointError


def test_padding_size() -> None:
    assert padding_stream([b"abc"], 3 * PADDED_MAX_EXPANSION) == b""
    assert padding_stream([b"abc"], 10 * PADDED_MAX_EXPANSION + 1) == bytes(8)
    check_padding_stream(bytes(10), "x")
    with pytest.raises(CorruptCheckpointError, match="nonzero"):
        check_padding_stream(b"\0\0\1", "x")


CONSTANT_OUTPUT = [
    (CyclicCodeDeltaCodec(), True),
    (ResidualCodec(ExponentBucketCodec()), True),
    (ResidualCodec(KMeansQuantizeCodec(lzma_preset=0, lzma_extreme=False)), True),
    (EntropyWidthQuantizeCodec(), False),
]


@pytest.mark.parametrize("codec, delta", CONSTANT_OUTPUT, ids=lambda c: getattr(c, "codec_id", ""))
def test_unchanged_tensor_is_padded_to_the_limit(codec, delta: bool) -> None:
    tensor = torch.zeros(1 << 20) if not delta else torch.randn(1 << 20)
    encoded = codec.encode(tensor, tensor if delta else None)
    stored = sum(len(memoryview(s).cast("B")) for s in encoded.streams)
    assert stored * type(codec).max_expansion >= TensorSpec.of(tensor).nbytes
    assert stored < TensorSpec.of(tensor).nbytes // 1000
    decoded = codec.decode(encoded.streams, encoded.params, TensorSpec.of(tensor), tensor if delta else None)
    assert torch.equal(decoded, encoded.reconstruction)


def test_an_unchanged_large_model_saves_and_loads(tmp_path) -> None:
    # 4 MiB, unchanged between checkpoints: unpadded, its ~40 stored bytes would exceed the
    # container's 65536x + 1 MiB limit and the writer would refuse the file.
    state = {"embedding": torch.randn(1024, 1024)}
    base = ink.load(tmp_path / "first.ink") if ink.save(state, tmp_path / "first.ink", policy="qd") else None
    info = ink.save(base, tmp_path / "second.ink", policy="qd", base=base)
    assert info.ratio > 1000
    assert torch.equal(ink.load(tmp_path / "second.ink", base=base)["embedding"], base["embedding"])
