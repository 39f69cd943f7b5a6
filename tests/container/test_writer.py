"""writer: canonical layout (every byte fixed or checksummed), ASCII header, spooling."""

from __future__ import annotations

import io
import json
import zlib
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.base import Encoded, TensorSpec
from inshrinkerator.container import ContainerReader, ContainerWriter
from inshrinkerator.container import writer as writer_module
from inshrinkerator.container.format import FORMAT_VERSION, PREAMBLE, unpack_header

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
    version, header_length = PREAMBLE.unpack(data[: PREAMBLE.size])[1:4:2]
    assert version == FORMAT_VERSION
    stored = data[PREAMBLE.size : PREAMBLE.size + header_length]
    assert zlib.crc32(stored) == PREAMBLE.unpack(data[: PREAMBLE.size])[4]
    header = json.loads(unpack_header(stored, version, "x"))
    # the data region follows the header directly, and its sections follow each other
    data_start = PREAMBLE.size + header_length
    covered = bytearray(len(data) - data_start)
    cursor = 0
    for record, streams in zip(header["tensors"], stream_lists):
        assert len(record["sections"]) == len(streams)
        for (length, crc), stream in zip(record["sections"], streams):
            offset = cursor  # version 3 lists no offsets: each section follows the previous one
            assert length == len(stream) and crc == zlib.crc32(stream)
            assert data[data_start + offset : data_start + offset + length] == stream
            covered[cursor:offset + length] = b"\1" * (offset + length - cursor)
            cursor = offset + length
    assert header["data_bytes"] == cursor == len(covered) and all(covered)
    with ContainerReader(io.BytesIO(data), "x") as reader:
        for record, streams in zip(reader.header.tensors, stream_lists):
            assert reader.read_streams(record) == streams


def test_header_is_ascii_even_for_unicode_keys() -> None:
    data = write_streams([[b"abc"]], skeleton={"d": [["ключ 🚀", {"t": 0}]]}, meta={"note": "é"})
    version, header_length = PREAMBLE.unpack(data[: PREAMBLE.size])[1:4:2]
    assert unpack_header(data[PREAMBLE.size : PREAMBLE.size + header_length], version, "x").isascii()


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


def test_lazy_streams_are_written_one_at_a_time() -> None:
    """Each stream is in the spool, and no longer referenced, before the next one is made."""
    import gc
    import weakref

    import numpy as np

    writer = ContainerWriter()
    made: list[weakref.ref] = []

    def streams():
        for index in range(4):
            if made:
                gc.collect()
                assert made[-1]() is None, "the previous stream is still held"
                assert writer._cursor > 0
            stream = np.full(1000 + index, index, dtype=np.uint8)
            made.append(weakref.ref(stream))
            yield stream
            del stream  # the generator's own reference

    writer.add(TensorSpec(torch.uint8, (4006,)), RAW, Encoded(streams=streams()))  # type: ignore[arg-type]
    out = io.BytesIO()
    writer.finish(out, {"t": 0}, {})
    with ContainerReader(io.BytesIO(out.getvalue()), "x") as reader:
        assert [len(s) for s in reader.read_streams(reader.header.tensors[0])] == [1000, 1001, 1002, 1003]


def test_a_stream_that_fails_midway_leaves_nothing_of_its_tensor() -> None:
    def failing():
        yield b"x" * 5000
        raise OSError("encoder failed")

    writer = ContainerWriter()
    writer.add(TensorSpec(torch.uint8, (3,)), RAW, Encoded(streams=[b"abc"]))
    with pytest.raises(OSError, match="encoder failed"):
        writer.add(TensorSpec(torch.uint8, (5000,)), RAW, Encoded(streams=failing()))  # type: ignore[arg-type]
    with pytest.raises(Exception, match="reader would reject"):  # written, then refused: rolled back too
        writer.add(TensorSpec(torch.uint8, (1 << 40,)), RAW, Encoded(streams=[b"y" * 100]))
    writer.add(TensorSpec(torch.uint8, (2,)), RAW, Encoded(streams=[b"de"]))
    out = io.BytesIO()
    writer.finish(out, {"l": [{"t": 0}, {"t": 1}]}, {})
    with ContainerReader(io.BytesIO(out.getvalue()), "x") as reader:
        assert [reader.read_streams(r) for r in reader.header.tensors] == [[b"abc"], [b"de"]]


def test_a_tensor_coded_in_slices_round_trips_through_a_file() -> None:
    from inshrinkerator.codecs import ByteGroupingCodec

    codec = ByteGroupingCodec(chunk_bytes=4096, slice_bytes=16384)
    tensor = torch.randn(70, 300)
    writer = ContainerWriter()
    writer.add(TensorSpec.of(tensor), codec.get_config(), codec.encode_lazily(tensor))
    out = io.BytesIO()
    writer.finish(out, {"t": 0}, {})
    with ContainerReader(io.BytesIO(out.getvalue()), "x") as reader:
        record = reader.header.tensors[0]
        assert len(record.sections) == -(-tensor.numel() // record.params["slice"]) > 1
        assert torch.equal(reader.decode(record), tensor)


def test_a_context_must_name_another_record() -> None:
    writer = ContainerWriter()
    spec = TensorSpec(torch.uint8, (2,))
    with pytest.raises(ValueError, match="another record"):
        writer.add(spec, RAW, Encoded(streams=[b"ab"]), context=0)  # this record itself
    writer.add(spec, RAW, Encoded(streams=[b"ab"]))
    writer.add(spec, RAW, Encoded(streams=[b"cd"]), context=0)
    for bad in (2, -1):  # #2 is this record
        with pytest.raises(ValueError, match="another record"):
            writer.add(spec, RAW, Encoded(streams=[b"ef"]), context=bad)
    writer.add(spec, RAW, Encoded(streams=[b"gh"]), context=1)  # a chain: #1 has a context of its own
    writer.add(spec, RAW, Encoded(streams=[b"ij"]), context=4)  # a record added later
    writer.add(spec, RAW, Encoded(streams=[b"kl"]))
    out = io.BytesIO()
    writer.finish(out, {"l": [{"t": i} for i in range(5)]}, {})
    with ContainerReader(io.BytesIO(out.getvalue()), "ctx.ink") as reader:
        assert [record.context for record in reader.header.tensors] == [None, 0, 1, 4, None]


@pytest.mark.parametrize("contexts, problem", [
    ([2, None], "no record"),  # #2 never added
    ([2, None, 0], "circle"),
    ([1, 2, 0], "circle"),
])
def test_finish_refuses_a_context_that_never_came_or_a_circle(contexts: list[Optional[int]], problem: str) -> None:
    writer = ContainerWriter()
    spec = TensorSpec(torch.uint8, (2,))
    for context in contexts:
        writer.add(spec, RAW, Encoded(streams=[b"ab"]), context=context)
    with pytest.raises(ValueError, match=problem):
        writer.finish(io.BytesIO(), {"l": [{"t": i} for i in range(len(contexts))]}, {})
