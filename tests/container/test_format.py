"""format: preamble, limits, and the expansion rule that writer and reader share."""

from __future__ import annotations

import io
import json
from typing import Any, Optional

import pytest
import torch
import zstandard

from inshrinkerator.codecs import registry
from inshrinkerator.codecs.base import Codec, Encoded, TensorSpec
from inshrinkerator.container import ContainerReader, ContainerWriter
from inshrinkerator.container.format import (
    ALIGNMENT,
    EXPANSION_ALLOWANCE,
    FORMAT_VERSION,
    MAGIC,
    MAX_CONFIG_DEPTH,
    MAX_EXPANSION,
    MAX_HEADER_BYTES,
    READABLE_VERSIONS,
    _nests_deeper,
    aligned,
    check_expansion,
    data_start,
    expansion_limit,
    pack_header,
    pack_preamble,
    parse_header,
    unpack_header,
    unpack_preamble,
)
from inshrinkerator.errors import CorruptCheckpointError, FormatError

from .test_attack_files import SCRIPT


class ConstantFill(Codec):
    """A codec that stores a constant tensor in its params and no bytes at all."""

    codec_id = "test_constant_fill"

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        return Encoded(streams=[], params={"value": float(tensor.reshape(-1)[0])})

    def decode(self, streams: Any, params: dict, spec: TensorSpec, reference: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.full(spec.shape, params["value"], dtype=spec.dtype)


class DeclaredConstantFill(ConstantFill):
    codec_id = "test_declared_constant_fill"
    max_expansion = 1 << 40


@pytest.fixture
def constant_codecs(monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in (ConstantFill, DeclaredConstantFill):
        monkeypatch.setitem(registry._REGISTRY, cls.codec_id, cls)


def test_preamble_round_trip_and_alignment() -> None:
    assert unpack_preamble(pack_preamble(123, 0xDEADBEEF), "x") == (FORMAT_VERSION, 123, 0xDEADBEEF)
    assert unpack_preamble(pack_preamble(5, 7, version=1), "x") == (1, 5, 7)
    assert pack_preamble(1, 0).startswith(MAGIC) and len(pack_preamble(1, 0)) == 32
    assert [aligned(n) for n in (0, 1, ALIGNMENT, ALIGNMENT + 1)] == [0, ALIGNMENT, ALIGNMENT, 2 * ALIGNMENT]
    # version 1 pads the header and the sections to multiples of 64; version 2 packs them
    assert [data_start(1, n) for n in (32, 33)] == [64, 128]
    assert [data_start(2, n) for n in (32, 33)] == [64, 65]


@pytest.mark.parametrize("version", READABLE_VERSIONS)
def test_headers_round_trip_in_every_readable_version(version: int) -> None:
    document = json.dumps({"format": "inshrinkerator", "meta": {"k": "v" * 500}}).encode()
    stored = pack_header(document, version)
    assert unpack_header(stored, version, "x") == document
    assert (len(stored) < len(document) / 5) == (version >= 2)


def test_a_version_2_header_is_checked_before_it_is_inflated() -> None:
    big = zstandard.ZstdCompressor().compress(b" " * (MAX_HEADER_BYTES + 1))
    with pytest.raises(FormatError, match="inflates to"):
        unpack_header(big, 2, "x")
    with pytest.raises(FormatError, match="not a zstd frame"):
        unpack_header(b'{"format":"inshrinkerator"}', 2, "x")


def test_truncated_preamble_is_corruption_and_foreign_bytes_are_format_errors() -> None:
    with pytest.raises(CorruptCheckpointError):
        unpack_preamble(MAGIC[:5], "x")
    for foreign in (b"", b"PK\x03\x04", b"\x80\x02}q\x00.", b"GIF89a" + bytes(40), b"{\"__metadata__\":{}}" + bytes(20)):
        with pytest.raises(FormatError) as caught:
            unpack_preamble(foreign, "x")
        assert not isinstance(caught.value, CorruptCheckpointError)


def test_max_expansion_covers_the_zstd_ceiling_with_margin() -> None:
    """Lossless codecs (zstd) never trip the default limit, even on all-zero tensors."""
    zeros = bytes(16 << 20)
    best = max(len(zeros) / len(zstandard.ZstdCompressor(level=level).compress(zeros)) for level in (1, 3, 19))
    assert 20_000 < best < MAX_EXPANSION / 1.5


def _depth(value: Any) -> int:
    # How many containers deep a parsed JSON value is (a scalar: 0).
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@pytest.mark.parametrize("depth", [1, 2, MAX_CONFIG_DEPTH - 1, MAX_CONFIG_DEPTH, MAX_CONFIG_DEPTH + 1, 40])
def test_config_depth_is_judged_at_the_limit(depth: int) -> None:
    """A codec config or params may nest exactly MAX_CONFIG_DEPTH containers deep, not one more,
    whichever branch goes deepest and whatever scalars lie beside it."""
    deep: Any = {"id": "raw"}
    for level in range(depth - 1):
        deep = {"levels": list(range(50)), "inner": deep} if level % 2 else [1.5, deep, "x", {}]
    config = {"id": "outer", "wide": [[0] * 3, {"a": None}], "deep": deep} if depth > 2 else deep
    assert _depth(config) >= depth
    assert _nests_deeper(config, MAX_CONFIG_DEPTH) == (_depth(config) > MAX_CONFIG_DEPTH)
    assert not _nests_deeper(config, _depth(config)) and _nests_deeper(config, _depth(config) - 1)


def test_expansion_limit_comes_from_the_codec_class(constant_codecs: None) -> None:
    assert expansion_limit({"id": "raw"}) == MAX_EXPANSION
    assert expansion_limit({"id": "no-such-codec"}) == MAX_EXPANSION
    assert expansion_limit({"id": DeclaredConstantFill.codec_id}) == 1 << 40
    spec = TensorSpec(torch.float32, (1 << 20,))  # 4 MiB
    assert check_expansion(spec, 64, {"id": "raw"}) is None  # 64 * 65536 + allowance
    assert "beyond what codec" in check_expansion(spec, 0, {"id": "raw"})
    assert check_expansion(TensorSpec(torch.uint8, (EXPANSION_ALLOWANCE,)), 0, {"id": "raw"}) is None


def write(state_tensor: torch.Tensor, codec: Codec) -> bytes:
    writer = ContainerWriter()
    out = io.BytesIO()
    try:
        writer.add(TensorSpec.of(state_tensor), codec.get_config(), codec.encode(state_tensor))
        writer.finish(out, {"t": 0}, {})
    finally:
        writer.close()
    return out.getvalue()


def test_writer_never_writes_what_the_reader_refuses(constant_codecs: None) -> None:
    big_constant = torch.full((1 << 20,), 3.0)  # 4 MiB from 0 stored bytes
    with pytest.raises(FormatError, match="max_expansion"):
        write(big_constant, ConstantFill())
    data = write(big_constant, DeclaredConstantFill())
    with ContainerReader(io.BytesIO(data), "constant.ink") as reader:
        (record,) = reader.header.tensors
        assert torch.equal(reader.decode(record), big_constant)
    # the same file naming the undeclared codec is refused before anything is decoded
    doc = SCRIPT.forge({"format": "inshrinkerator", "data_bytes": 0, "skeleton": {"t": 0}, "meta": {},
                        "tensors": [{"dtype": "float32", "shape": [1 << 20], "codec": {"id": ConstantFill.codec_id},
                                     "params": {"value": 3.0}, "sections": []}]})
    with pytest.raises(FormatError, match="beyond what codec 'test_constant_fill'"):
        ContainerReader(io.BytesIO(doc), "forged.ink")


def test_small_constant_tensors_fit_in_the_allowance(constant_codecs: None) -> None:
    small = torch.zeros(1000)
    data = write(small, ConstantFill())
    with ContainerReader(io.BytesIO(data), "small.ink") as reader:
        assert torch.equal(reader.decode(reader.header.tensors[0]), small)


def test_header_size_limit_is_enforced_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    from inshrinkerator.container import writer as writer_module
    from inshrinkerator.errors import UnsupportedStateError

    monkeypatch.setattr(writer_module, "MAX_HEADER_BYTES", 500)
    writer = ContainerWriter()
    with pytest.raises(UnsupportedStateError, match="500-byte limit"):
        writer.finish(io.BytesIO(), {"l": [{"i": i} for i in range(100)]}, {})
    with pytest.raises(FormatError, match="header length"):
        unpack_preamble(pack_preamble(MAX_HEADER_BYTES + 1, 0), "x")


def test_parse_header_reports_the_source() -> None:
    with pytest.raises(FormatError, match="^where.ink: "):
        parse_header(b'{"format": "inshrinkerator", "data_bytes": 0, "tensors": [], "skeleton": {"t": 0}}', "where.ink")


def _two_section_doc(entries: list[list[int]]) -> bytes:
    doc = SCRIPT.valid_doc()
    doc["data_bytes"] = 16
    doc["tensors"][0]["sections"] = entries
    return json.dumps(doc).encode()


def test_version_3_lists_sections_without_offsets() -> None:
    import zlib

    first, second = SCRIPT.W_BYTES[:6], SCRIPT.W_BYTES[6:]
    lengths = [[6, zlib.crc32(first)], [10, zlib.crc32(second)]]
    header = parse_header(_two_section_doc(lengths), "x", 3)
    assert [(s.offset, s.length) for s in header.tensors[0].sections] == [(0, 6), (6, 10)]
    with_offsets = [[0, *lengths[0]], [6, *lengths[1]]]
    assert parse_header(_two_section_doc(with_offsets), "x", 2).tensors[0].sections == header.tensors[0].sections
    # each version's entries only: an offset in version 3, none in version 2, is refused
    with pytest.raises(FormatError, match="bad section entry"):
        parse_header(_two_section_doc(with_offsets), "x", 3)
    with pytest.raises(FormatError, match="bad section entry"):
        parse_header(_two_section_doc(lengths), "x", 2)
    # lengths that do not add up to the data region are refused as before
    with pytest.raises(FormatError, match="data region"):
        parse_header(_two_section_doc([[6, 0], [9, 0]]), "x", 3)
    with pytest.raises(FormatError, match="outside the data region"):
        parse_header(_two_section_doc([[6, 0], [11, 0]]), "x", 3)
