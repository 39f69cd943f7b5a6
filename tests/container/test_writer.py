"""writer: canonical layout (every byte fixed or checksummed), ASCII header, spooling."""

from __future__ import annotations

import io
import json
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.base import Encoded, TensorSpec
from inshrinkerator.container import ContainerReader, ContainerWriter
from inshrinkerator.container import writer as writer_module
from inshrinkerator.container.format import ALIGNMENT, PREAMBLE, aligned

RAW = {"id": "raw"}


def write_streams(stream_lists: list[list[bytes]], skeleton: object = None, meta: dict | None = None) -> bytes:
    """One uint8 tensor per stream list; its bytes are the streams concatenated (raw codec
    when there is exactly one stream)."""
    writer = ContainerWriter()
    out = io.BytesIO()
    for streams in stream_lists:
        size = sum(len(s) for s in streams)
        writer.add(TensorSpec(torch.uint8, (size,)), RAW, Encoded(streams=list(streams)))
    skeleton = {"l": [{"t": i} for i in range(len(stream_lists))]} if skeleton is None else skeleton
    size = writer.finish(out, skeleton, meta or {})
    data = out.getvalue()
    assert size == len(data)
    return data


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=150), max_size=3), max_size=5))
def test_layout_is_canonical_and_every_byte_is_accounted_for(stream_lists: list[list[bytes]]) -> None:
    data = write_streams(stream_lists)
    header_length = PREAMBLE.unpack(data[: PREAMBLE.size])[3]
    header = json.loads(data[PREAMBLE.size : PREAMBLE.size + header_length])
    data_start = aligned(PREAMBLE.size + header_length)
    assert data_start % ALIGNMENT == 0 and set(data[PREAMBLE.size + header_length : data_start]) <= {0}
    covered = bytearray(len(data) - data_start)
    cursor = 0
    for record, streams in zip(header["tensors"], stream_lists):
        assert len(record["sections"]) == len(streams)
        for (offset, length, crc), stream in zip(record["sections"], streams):
            assert offset == aligned(cursor) and length == len(stream) and crc == zlib.crc32(stream)
            assert data[data_start + offset : data_start + offset + length] == stream
            assert set(data[data_start + cursor : data_start + offset]) <= {0}  # padding
            covered[cursor:offset + length] = b"\1" * (offset + length - cursor)
            cursor = offset + length
    assert header["data_bytes"] == cursor == len(covered) and all(covered)
    with ContainerReader(io.BytesIO(data), "x") as reader:
        for record, streams in zip(reader.header.tensors, stream_lists):
            assert reader.read_streams(record) == streams


def test_header_is_ascii_even_for_unicode_keys() -> None:
    data = write_streams([[b"abc"]], skeleton={"d": [["ключ 🚀", {"t": 0}]]}, meta={"note": "é"})
    header_length = PREAMBLE.unpack(data[: PREAMBLE.size])[3]
    assert data[PREAMBLE.size : PREAMBLE.size + header_length].isascii()


def test_large_outputs_spill_to_disk_and_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "SPOOL_IN_MEMORY_BYTES", 1000)
    streams = [bytes(range(256)) * 10, b"tail"]
    data = write_streams([streams])
    with ContainerReader(io.BytesIO(data), "x") as reader:
        assert reader.read_streams(reader.header.tensors[0]) == streams


def test_streams_may_be_any_buffer() -> None:
    import numpy as np

    streams = [bytearray(b"ab"), memoryview(b"cd"), np.frombuffer(b"efgh", dtype=np.uint8)]
    data = write_streams([streams])
    with ContainerReader(io.BytesIO(data), "x") as reader:
        assert reader.read_streams(reader.header.tensors[0]) == [b"ab", b"cd", b"efgh"]
