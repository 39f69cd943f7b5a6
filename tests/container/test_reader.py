"""ContainerReader under damage and forgery: every malformed input raises FormatError or
CorruptCheckpointError promptly; nothing else escapes, nothing hangs."""

from __future__ import annotations

import copy
import io
import json
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import inshrinkerator as ink
from inshrinkerator.codecs.registry import registered_codecs
from inshrinkerator.container import ContainerReader
from inshrinkerator.container.format import (
    MAX_HEADER_BYTES,
    PREAMBLE,
    data_start,
    parse_header,
    unpack_header,
)
from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError, FormatError, InkError
from inshrinkerator.policies import resolve_policy
from inshrinkerator.serialize import read_state, write_state

from ..helpers import assert_same
from ..test_tree import assert_exact, states
from .test_attack_files import SCRIPT

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: one decode of a small file takes about a millisecond; this is generous for a loaded machine
PROMPT_SECONDS = 2.0


def small_state() -> dict[str, Any]:
    return {
        "w": torch.arange(96, dtype=torch.float32).reshape(8, 12) / 7,
        "ids": torch.arange(40, dtype=torch.int64),
        "b": torch.tensor([1.0, 2.0]),
        "step": 3,
        "cfg": OrderedDict(lr=0.1, name="x", none=None),
    }


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("small") / "small.ink"
    ink.save(small_state(), path)
    return path.read_bytes()


def load_bytes(data: bytes, name: str = "fuzz.ink") -> Any:
    """Open and fully decode ``data`` with the low-level reader (references: none)."""
    with ContainerReader(io.BytesIO(data), name) as reader:
        tensors = [reader.decode(record) for record in reader.header.tensors]
        for tensor, record in zip(tensors, reader.header.tensors):
            assert tensor.dtype == record.spec.dtype and tuple(tensor.shape) == record.spec.shape
        return tensors


def expect_refusal(data: bytes) -> InkError:
    started = time.perf_counter()
    with pytest.raises((FormatError, CorruptCheckpointError)) as caught:
        load_bytes(data)
    assert time.perf_counter() - started < PROMPT_SECONDS
    return caught.value


def header_doc(data: bytes) -> dict[str, Any]:
    version, length = PREAMBLE.unpack(data[: PREAMBLE.size])[1:4:2]
    return json.loads(unpack_header(data[PREAMBLE.size : PREAMBLE.size + length], version, "x"))


def data_region(data: bytes) -> bytes:
    version, length = PREAMBLE.unpack(data[: PREAMBLE.size])[1:4:2]
    return data[data_start(version, length) :]


def test_small_file_is_valid_and_fully_covered(small_file: bytes) -> None:
    back = load_bytes(small_file)
    assert len(back) == 3
    with ContainerReader(io.BytesIO(small_file), "x") as reader:
        assert reader.file_bytes == len(small_file)
        assert reader.verify() == sum(r.stored_bytes for r in reader.header.tensors)


def test_truncation_at_every_byte_is_detected(small_file: bytes) -> None:
    for end in range(len(small_file)):
        error = expect_refusal(small_file[:end])
        assert isinstance(error, CorruptCheckpointError) == (end > 0), (end, error)


@pytest.mark.parametrize("flip", [0x01, 0x80, 0xFF])
def test_a_damaged_byte_anywhere_is_detected(small_file: bytes, flip: int) -> None:
    for position in range(len(small_file)):
        damaged = bytearray(small_file)
        damaged[position] ^= flip
        expect_refusal(bytes(damaged))


@FUZZ
@given(st.data())
def test_random_damage_is_always_detected(small_file: bytes, data: st.DataObject) -> None:
    damaged = bytearray(small_file)
    positions = data.draw(st.lists(st.integers(0, len(small_file) - 1), min_size=1, max_size=8, unique=True))
    for position in positions:
        damaged[position] ^= data.draw(st.integers(1, 255))
    expect_refusal(bytes(damaged))


@FUZZ
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_arbitrary_header_bytes_with_a_valid_checksum_are_refused(header: bytes, body: bytes) -> None:
    expect_refusal(SCRIPT.forge(header=header or b" ", data=body))
    expect_refusal(SCRIPT.forge_v2(frame=header or b" ", data=body))


@FUZZ
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_arbitrary_header_frames_with_a_valid_checksum_are_refused(document: bytes, body: bytes) -> None:
    """Any zstd frame of bytes that are not a header document, in a version-2 file."""
    frame = zstandard.ZstdCompressor().compress(document or b" ")
    expect_refusal(SCRIPT.forge_v2(frame=frame, data=body))


# ----------------------------------------------------------------------------- structured fuzz

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10)
    | st.sampled_from(["float32", "raw", "byte_grouping", "xor_delta", "t", "d", "l"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)


def json_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location in a JSON document, as a tuple of keys and indices."""
    paths = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            paths += json_paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            paths += json_paths(value, prefix + (index,))
    return paths


def mutate(doc: Any, path: tuple, how: str, value: Any) -> Any:
    doc = copy.deepcopy(doc)
    if not path:
        return value
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    old = parent[last]
    if how == "delete":
        del parent[last]
    elif how == "replace":
        parent[last] = value
    elif how == "nudge" and type(old) is int:
        parent[last] = old + (value if type(value) is int else -1)
    elif how == "scale" and type(old) is int:
        parent[last] = old * (1 << 40) + 1
    elif how == "duplicate" and isinstance(parent, list):
        parent.insert(last, copy.deepcopy(old))
    else:
        parent[last] = value
    return doc


@FUZZ
@given(st.data())
def test_forged_headers_are_refused_or_decode_to_their_spec(small_file: bytes, data: st.DataObject) -> None:
    doc = header_doc(small_file)
    body = data_region(small_file)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(json_paths(doc)))
        how = data.draw(st.sampled_from(["replace", "delete", "nudge", "scale", "duplicate"]))
        doc = mutate(doc, path, how, data.draw(JSON_VALUES))
    forged = SCRIPT.forge_v2(doc, body)
    started = time.perf_counter()
    try:
        load_bytes(forged)
        event("decoded")
    except (FormatError, BrokenChainError) as exc:  # CorruptCheckpointError is a FormatError
        event(f"refused: {type(exc).__name__}")
    assert time.perf_counter() - started < PROMPT_SECONDS


def encodable_codecs() -> list[tuple[str, Any, Any, torch.Tensor, torch.Tensor]]:
    """(id, codec, encoded, tensor, reference) for each registered codec that encodes a small
    float tensor with its default options (encoded once: some codecs search)."""
    found = []
    tensor = torch.linspace(-1, 1, 300).reshape(20, 15)
    reference = tensor + 1e-3
    for codec_id, cls in sorted(registered_codecs().items()):
        try:
            codec = cls()
            encoded = codec.encode(tensor, reference if cls.uses_reference else None)
        except Exception:  # a codec that needs options or other inputs: not fuzzed here
            continue
        found.append((codec_id, codec, encoded, tensor, reference))
    return found


CODECS = encodable_codecs()


@pytest.mark.parametrize("codec_id,codec,encoded,tensor,reference", CODECS, ids=[c[0] for c in CODECS])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_codec_survives_forged_streams_and_params(
    codec_id: str, codec: Any, encoded: Any, tensor: torch.Tensor, reference: torch.Tensor, data: st.DataObject
) -> None:
    """Valid container, hostile codec payload: checksums are recomputed, so the codec sees it."""
    streams = [bytes(memoryview(s).cast("B")) for s in encoded.streams]
    params = json.loads(json.dumps(encoded.params))
    target = data.draw(st.sampled_from(["stream", "params", "both"]))
    if target != "params" and streams:
        index = data.draw(st.integers(0, len(streams) - 1))
        stream = bytearray(streams[index])
        action = data.draw(st.sampled_from(["flip", "truncate", "extend", "random"]))
        if action == "flip" and stream:
            stream[data.draw(st.integers(0, len(stream) - 1))] ^= data.draw(st.integers(1, 255))
        elif action == "truncate":
            del stream[data.draw(st.integers(0, len(stream))) :]
        elif action == "extend":
            stream += data.draw(st.binary(min_size=1, max_size=64))
        else:
            stream = bytearray(data.draw(st.binary(max_size=2 * len(stream) + 8)))
        streams[index] = bytes(stream)
    if target != "stream":
        params = mutate(params, data.draw(st.sampled_from(json_paths(params))), "replace", data.draw(JSON_VALUES))
        if type(params) is not dict:
            params = {"value": params}
    forged = forge_record(codec.get_config(), params, streams, tensor)
    started = time.perf_counter()
    try:
        with ContainerReader(io.BytesIO(forged), "fuzz.ink") as reader:
            (record,) = reader.header.tensors
            decoded = reader.decode(record, reference if codec.uses_reference else None)
        assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
        event("decoded")
    except (FormatError, BrokenChainError) as exc:
        cause = exc.__cause__
        event(f"refused: {type(exc).__name__}" + (f" from {type(cause).__name__}" if cause else ""))
    assert time.perf_counter() - started < PROMPT_SECONDS


def forge_record(config: dict, params: dict, streams: list[bytes], tensor: torch.Tensor) -> bytes:
    sections, body, cursor = [], b"", 0
    for stream in streams:
        body += stream
        sections.append([cursor, len(stream), zlib.crc32(stream)])
        cursor += len(stream)
    doc = {
        "format": "inshrinkerator",
        "data_bytes": cursor,
        "skeleton": {"t": 0},
        "tensors": [{"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                     "codec": config, "params": params, "sections": sections, "reference": None}],
        "meta": {},
    }
    return SCRIPT.forge_v2(doc, body)


# ----------------------------------------------------------------------------- specific cases


def test_refusals_name_the_file(tmp_path: Path, small_file: bytes) -> None:
    path = tmp_path / "named.ink"
    path.write_bytes(small_file[:-3])
    with pytest.raises(CorruptCheckpointError, match="named.ink"):
        ink.load(path)


def test_verify_finds_damage_without_decoding(small_file: bytes) -> None:
    damaged = bytearray(small_file)
    damaged[-5] ^= 0x10
    with ContainerReader(io.BytesIO(bytes(damaged)), "x") as reader:  # the header is intact
        with pytest.raises(CorruptCheckpointError, match="section checksum"):
            reader.verify()


def test_a_maximal_hostile_header_parses_promptly() -> None:
    """16 MiB of the costliest JSON (millions of empty containers) is refused in seconds."""
    header = b'{"format":"inshrinkerator","skeleton":[' + b"[]," * ((MAX_HEADER_BYTES - 64) // 3) + b'[]]}'
    assert len(header) <= MAX_HEADER_BYTES
    started = time.perf_counter()
    with pytest.raises(FormatError):
        parse_header(header, "big.ink")
    assert time.perf_counter() - started < 10


def test_a_maximal_hostile_header_in_a_small_frame_is_refused_promptly() -> None:
    """The same document compressed to a few kB: inflating it is bounded, parsing it prompt."""
    document = b'{"format":"inshrinkerator","skeleton":[' + b"[]," * ((MAX_HEADER_BYTES - 64) // 3) + b'[]]}'
    frame = zstandard.ZstdCompressor().compress(document)
    assert len(frame) < 10_000
    started = time.perf_counter()
    expect_refusal(SCRIPT.forge_v2(frame=frame))
    assert time.perf_counter() - started < 10


def test_io_errors_are_not_disguised_as_format_errors(small_file: bytes) -> None:
    class FailingAfterOpen(io.BytesIO):
        reads = 0

        def read(self, size: int = -1) -> bytes:
            self.reads += 1
            if self.reads > 2:
                raise OSError("network went away")
            return super().read(size)

    with ContainerReader(FailingAfterOpen(small_file), "remote.ink") as reader:
        with pytest.raises(OSError, match="network went away"):
            reader.decode(reader.header.tensors[0])


def test_full_round_trip_through_the_reader(tmp_path: Path) -> None:
    state = small_state()
    ink.save(state, tmp_path / "s.ink")
    assert_same(state, ink.load(tmp_path / "s.ink"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=st.dictionaries(st.text(max_size=6) | st.integers() | st.none() | st.booleans(), states, max_size=4))
def test_odd_keys_and_values_round_trip_through_a_file(state: Any) -> None:
    """The real writer and reader, not just the tree: unicode keys, NaN payloads, big ints."""
    out = io.BytesIO()
    try:
        write_state(out, state, resolve_policy("lossless"))
    except ink.UnsupportedStateError as exc:
        assert "rename one" in str(exc)  # tensors under keys such as 1 and "1"
        return
    with ContainerReader(io.BytesIO(out.getvalue()), "odd.ink") as reader:
        assert_exact(state, read_state(reader))


def test_decode_many_matches_decode_one_by_one_and_reports_the_earliest_damage(small_file: bytes) -> None:
    with ContainerReader(io.BytesIO(small_file), "many.ink") as reader:
        records = reader.header.tensors
        together = reader.decode_many(records)
        for tensor, record in zip(together, records):
            assert_exact(tensor, reader.decode(record))
    # Damage the last two sections: the error names the earlier of the two tensors.
    with ContainerReader(io.BytesIO(small_file), "many.ink") as reader:
        sections = [s for r in reader.header.tensors for s in r.sections if s.length]
        first_damaged = max(sections[-2:], key=lambda s: -s.offset)
        data_start = reader.data_start
    damaged = bytearray(small_file)
    for section in sections[-2:]:
        damaged[data_start + section.offset] ^= 0xFF
    with ContainerReader(io.BytesIO(bytes(damaged)), "many.ink") as reader:
        with pytest.raises(CorruptCheckpointError, match=f"data offset {first_damaged.offset}"):
            reader.decode_many(reader.header.tensors)


# ------------------------------------------------------------------ large tensors in slices


class _SlicedPolicy:
    """Stores every tensor with the lossless codec in slices of 4 KiB."""

    name = "test-sliced"

    def plan(self, leaves, references):
        from inshrinkerator.codecs import ByteGroupingCodec

        return [ByteGroupingCodec(chunk_bytes=4096, slice_bytes=4096) for _ in leaves]


class _LoggingBytes(io.BytesIO):
    """Logs the size of every read; fails reads after ``fail_after`` of them, if given."""

    def __init__(self, data: bytes, log: list, fail_after: int | None = None) -> None:
        super().__init__(data)
        self.log, self.fail_after, self.reads = log, fail_after, 0

    def read(self, size: int = -1) -> bytes:
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            raise OSError("network went away")
        data = super().read(size)
        self.log.append(("read", len(data)))
        return data


@pytest.fixture(scope="module")
def sliced_file() -> tuple[bytes, torch.Tensor]:
    from inshrinkerator.policies.base import Policy

    tensor = torch.randn(16384, generator=torch.Generator().manual_seed(0))
    out = io.BytesIO()
    write_state(out, {"big": tensor}, type("Sliced", (_SlicedPolicy, Policy), {})())
    return out.getvalue(), tensor


def test_a_large_tensor_in_slices_is_read_as_its_codec_decodes_it(sliced_file, monkeypatch) -> None:
    # So decoding it holds one compressed slice at a time, not the whole tensor's.
    from inshrinkerator.codecs import byte_grouping
    from inshrinkerator.container import reader as reader_module

    data, tensor = sliced_file
    log: list = []
    decode_rows = byte_grouping._decode_rows
    monkeypatch.setattr(byte_grouping, "_decode_rows", lambda *a: (log.append(("decode", 0)), decode_rows(*a))[1])
    monkeypatch.setattr(reader_module, "_LAZY_RECORD_BYTES", 1024)
    with ContainerReader(_LoggingBytes(data, log), "sliced.ink") as reader:
        (record,) = reader.header.tensors
        assert len(record.sections) == 16
        log.clear()
        assert torch.equal(reader.decode(record), tensor)
    kinds = [kind for kind, _ in log]
    assert kinds == ["read", "decode"] * 16


def test_damage_and_io_errors_in_a_lazily_read_slice_keep_their_meaning(sliced_file, monkeypatch) -> None:
    from inshrinkerator.container import reader as reader_module

    data, _ = sliced_file
    monkeypatch.setattr(reader_module, "_LAZY_RECORD_BYTES", 1024)
    with ContainerReader(io.BytesIO(data), "sliced.ink") as reader:
        section = reader.header.tensors[0].sections[9]
        offset = reader.data_start + section.offset
    damaged = bytearray(data)
    damaged[offset] ^= 0xFF
    with ContainerReader(io.BytesIO(bytes(damaged)), "sliced.ink") as reader:
        with pytest.raises(CorruptCheckpointError, match=f"sliced.ink: section checksum mismatch at data offset {section.offset}"):
            reader.decode(reader.header.tensors[0])
    with ContainerReader(_LoggingBytes(data, [], fail_after=8), "remote.ink") as reader:
        with pytest.raises(OSError, match="network went away"):
            reader.decode(reader.header.tensors[0])


def test_verify_holds_one_section_at_a_time(sliced_file) -> None:
    import tracemalloc

    data, tensor = sliced_file
    with ContainerReader(io.BytesIO(data), "sliced.ink") as reader:
        sections = reader.header.tensors[0].sections
        tracemalloc.start()
        try:
            checked = reader.verify()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    total = sum(s.length for s in sections)
    assert checked == total
    assert peak < total / 4  # a section is 1/16 of the tensor's bytes
