"""The ``.ink`` file layout (see docs/format.md), its limits and header validation.

Version 2 (written by this build)::

    offset  size  field
    0       8     magic  b"\\x89INK\\r\\n\\x1a\\n"
    8       4     format version (u32, little-endian)
    12      4     flags (u32, must be 0)
    16      8     header length H (u64, 1..MAX_HEADER_BYTES)
    24      4     CRC-32 of the header bytes (u32)
    28      4     reserved (must be 0)
    32      H     header: one zstd frame (content size declared) of UTF-8 JSON
    32+H    D     data region: sections back to back, in header order

Version 1 (still read) differs in two ways: the header is plain JSON, and the data
region and every section start at a multiple of 64, the gaps zero-filled. Version 2
drops both costs: on a small model the JSON describing some 200 tensors was 6 % of a
delta checkpoint and the padding another 1 %.

The layout is canonical: every byte of a valid file is either fixed (magic,
version, zero padding) or covered by a CRC-32 (the header, each section), and
the file is exactly ``data_start + data_bytes`` long, so any truncation,
trailing garbage or single damaged byte is detected.
"""

from __future__ import annotations

import gc
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import zstandard

from ..codecs.base import TensorSpec, dtype_from_name
from ..codecs.registry import registered_codecs
from ..errors import CorruptCheckpointError, FormatError
from ..tree import KeyPath, tensor_paths

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "PREAMBLE",
    "ALIGNMENT",
    "MAX_HEADER_BYTES",
    "MAX_DIMS",
    "MAX_EXPANSION",
    "EXPANSION_ALLOWANCE",
    "Section",
    "TensorRecord",
    "Header",
    "Preamble",
    "pack_preamble",
    "unpack_preamble",
    "pack_header",
    "unpack_header",
    "parse_header",
    "aligned",
    "context_depths",
    "section_alignment",
    "section_entry",
    "data_start",
    "expansion_limit",
    "check_expansion",
]

MAGIC = b"\x89INK\r\n\x1a\n"
FORMAT_VERSION = 3
#: The versions this build reads (docs/format.md describes each).
READABLE_VERSIONS = (1, 2, 3)
PREAMBLE = struct.Struct("<8sIIQII")
#: Version 1's alignment of the data region and of every section.
ALIGNMENT = 64
# About 170 JSON bytes per tensor with the lossless codecs: 16 MiB describes some
# 100 000 tensors. The costliest 16 MiB of JSON (millions of empty containers)
# parses in about 2 s and ~350 MB. The limit bounds the JSON, compressed or not.
MAX_HEADER_BYTES = 16 << 20
# zstd level of a version-2 header: ~10x smaller JSON in well under a millisecond for
# a few hundred tensors (levels above 12 gain under 10 % more at 10-80x the time).
HEADER_ZSTD_LEVEL = 9
MAX_DIMS = 64
MAX_DIM_SIZE = 1 << 48
MAX_NUMEL = 1 << 62
# Codec configs and params are small flat objects; nesting beyond this is an attack.
MAX_CONFIG_DEPTH = 16
# A tensor may decode to at most ``max_expansion`` times its stored bytes plus
# EXPANSION_ALLOWANCE, so a forged header cannot make a reader allocate far more
# memory than the file could hold. zstd cannot exceed about 32768x (one 4-byte RLE
# block per 128 KiB); codecs that store constant tensors in a few bytes declare a
# larger ``max_expansion`` class attribute. The writer applies the same rule, so
# it never writes a file the reader refuses.
MAX_EXPANSION = 1 << 16
EXPANSION_ALLOWANCE = 1 << 20


def aligned(offset: int, alignment: int = ALIGNMENT) -> int:
    """``offset`` rounded up to the next multiple of ``alignment``."""
    return -(-offset // alignment) * alignment


def section_alignment(version: int) -> int:
    """Where sections may start in a file of ``version``: a multiple of this."""
    return ALIGNMENT if version == 1 else 1


def data_start(version: int, header_length: int) -> int:
    """The file offset of the data region of a file of ``version``."""
    return aligned(PREAMBLE.size + header_length, section_alignment(version))


class Preamble(NamedTuple):
    """The checked fields of a file's first 32 bytes."""

    version: int
    header_length: int
    header_crc: int


def pack_preamble(header_length: int, header_crc: int, version: int = FORMAT_VERSION) -> bytes:
    """The 32 bytes that start every ``.ink`` file."""
    return PREAMBLE.pack(MAGIC, version, 0, header_length, header_crc, 0)


def unpack_preamble(data: bytes, source: str) -> Preamble:
    """Check the preamble; return its version, header length and header CRC.

    Raises:
        FormatError: not an ``.ink`` file, an unsupported version or a header length out of
            bounds; CorruptCheckpointError: the file ends inside the preamble.
    """
    if len(data) < PREAMBLE.size:
        if data and MAGIC.startswith(data[: len(MAGIC)]):
            raise CorruptCheckpointError(f"{source}: file is truncated inside its preamble")
        raise FormatError(f"{source}: not an inshrinkerator file (too short for the .ink preamble)")
    magic, version, flags, header_length, header_crc, reserved = PREAMBLE.unpack(data[: PREAMBLE.size])
    if magic != MAGIC:
        looks_pickled = data[:1] == b"\x80" or data[:2] == b"PK"
        hint = " (it looks like a pickle/torch.save file; convert it with `inshrink compress`)" if looks_pickled else ""
        raise FormatError(f"{source}: not an inshrinkerator file (bad magic){hint}")
    if version not in READABLE_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise FormatError(
            f"{source}: .ink format version {version} is not supported (this build reads "
            f"versions {readable}); use the inshrinkerator release that wrote it"
        )
    if flags or reserved:
        raise FormatError(f"{source}: reserved preamble fields are set; the file is damaged or newer")
    if header_length == 0 or header_length > MAX_HEADER_BYTES:
        raise FormatError(f"{source}: header length {header_length} is outside 1..{MAX_HEADER_BYTES} bytes")
    return Preamble(version, header_length, header_crc)


def pack_header(document: bytes, version: int = FORMAT_VERSION) -> bytes:
    """The stored header of a file of ``version`` holding the JSON ``document``."""
    if version == 1:
        return document
    return zstandard.ZstdCompressor(level=HEADER_ZSTD_LEVEL, write_content_size=True).compress(document)


def unpack_header(stored: bytes, version: int, source: str) -> bytes:
    """The JSON document of a header as stored in a file of ``version``.

    A header from version 2 on is exactly one zstd frame that declares its content size, at
    most :data:`MAX_HEADER_BYTES`; the size is checked before anything is inflated, so
    a forged header cannot make the reader allocate more.

    Raises:
        FormatError: not one well-formed frame of a permitted size.
    """
    if version == 1:
        return stored
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError:
        raise FormatError(f"{source}: header is not a zstd frame") from None
    if size < 0:
        raise FormatError(f"{source}: the header's zstd frame does not declare its size")
    if size == 0 or size > MAX_HEADER_BYTES:
        raise FormatError(f"{source}: the header inflates to {size} bytes, outside 1..{MAX_HEADER_BYTES}")
    try:
        document = zstandard.ZstdDecompressor().decompress(stored)
        # the frame must end exactly where the header does (nothing unchecked after it)
        frame = zstandard.ZstdDecompressor().decompressobj()
        frame.decompress(stored)
        whole = frame.eof and not frame.unused_data
    except zstandard.ZstdError as exc:
        raise FormatError(f"{source}: the header's zstd frame does not decode ({str(exc)[:100]})") from None
    if not whole or len(document) != size:
        raise FormatError(f"{source}: the header holds more or less than one zstd frame")
    return document


@dataclass(frozen=True)
class Section:
    """One stored byte stream: where it lies in the data region, its CRC-32, and the
    number of zero bytes (alignment padding) just before it."""

    offset: int
    length: int
    crc32: int
    padding: int = 0


@dataclass(frozen=True)
class TensorRecord:
    """How one tensor is stored."""

    spec: TensorSpec
    codec: dict[str, Any]
    params: dict[str, Any]
    sections: tuple[Section, ...]
    reference: Optional[str]  # None, or the name of what a delta codec decodes against
    #: None, or the index of another record of the file whose decoded tensor the codec also
    #: decodes with (``Codec.uses_context``); chains of contexts end at a record without one
    #: (:func:`context_depths`)
    context: Optional[int] = None

    @property
    def stored_bytes(self) -> int:
        return sum(s.length for s in self.sections)


@dataclass(frozen=True)
class Header:
    """A validated header: the state's skeleton, one record per tensor, free-form meta."""

    skeleton: Any
    tensors: tuple[TensorRecord, ...]
    meta: dict[str, Any]
    data_bytes: int
    #: tensor index -> the first key path it appears at in the skeleton
    tensor_paths: dict[int, KeyPath] = field(default_factory=dict)


def _is_uint(value: Any) -> bool:
    return type(value) is int and value >= 0


def context_depths(contexts: Sequence[Optional[int]]) -> list[int]:
    """How many context records each record decodes after (0: it has no context), for the
    ``context`` index of every record of a file (None: none).

    A record's context is another record, which may have a context of its own: a chain
    that ends at a record without one. A reader decodes the records of depth 0 first, then
    those of depth 1, and so on.

    Raises:
        ValueError: a context is the record itself, no record of the file, or part of a cycle.
    """
    depths: list[Optional[int]] = [None] * len(contexts)
    for start in range(len(contexts)):
        path: list[int] = []
        index: Optional[int] = start
        while index is not None and depths[index] is None:
            if index in path:
                raise ValueError(f"record #{index}: its context chain runs in a circle")
            path.append(index)
            context = contexts[index]
            if context is not None and not 0 <= context < len(contexts):
                raise ValueError(f"record #{index}: its context #{context} is no record of the file")
            if context == index:
                raise ValueError(f"record #{index}: a record cannot be its own context")
            index = context
        depth = -1 if index is None else depths[index]
        for index in reversed(path):
            depth += 1  # type: ignore[operator]
            depths[index] = depth
    return depths  # type: ignore[return-value]


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value holds containers more than ``limit`` levels deep."""
    level, frontier = 1, [value] if type(value) in (dict, list) else []
    while frontier:
        if level > limit:
            return True
        inner: list[Any] = []
        for node in frontier:
            children = node.values() if type(node) is dict else node
            inner.extend(child for child in children if type(child) is dict or type(child) is list)
        frontier, level = inner, level + 1
    return False


def expansion_limit(codec_config: dict[str, Any]) -> int:
    """How many times its stored bytes a tensor of this codec may decode to."""
    cls = registered_codecs().get(codec_config.get("id"))
    limit = getattr(cls, "max_expansion", MAX_EXPANSION)
    return limit if _is_uint(limit) else MAX_EXPANSION


def check_expansion(spec: TensorSpec, stored_bytes: int, codec_config: dict[str, Any]) -> Optional[str]:
    """``None`` if ``spec`` may come from ``stored_bytes`` with this codec, else why not."""
    limit = expansion_limit(codec_config)
    # a record stores at least its params in the header: count one byte for them
    if spec.nbytes <= limit * max(stored_bytes, 1) + EXPANSION_ALLOWANCE:
        return None
    return (
        f"{spec.nbytes} bytes of {str(spec.dtype).removeprefix('torch.')} {list(spec.shape)} from "
        f"{stored_bytes} stored bytes is beyond what codec {codec_config.get('id')!r} may produce "
        f"({limit}x + {EXPANSION_ALLOWANCE} bytes)"
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _load_json(raw: bytes, source: str) -> Any:
    # The collector would rescan the millions of containers a hostile header can hold,
    # turning a one-second parse into tens of seconds; nothing here forms cycles.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{source}: header is not valid UTF-8 JSON ({str(exc)[:100]})") from None
    finally:
        if collecting:
            gc.enable()


def section_entry(offset: int, length: int, crc: int, version: int = FORMAT_VERSION) -> list[int]:
    """A section as the header of a file of ``version`` lists it: ``[length, crc32]`` from
    version 3 on (each section starts where the previous one ends), ``[offset, length,
    crc32]`` before."""
    return [length, crc] if version >= 3 else [offset, length, crc]


def _parse_sections(
    raw_sections: Any, cursor: int, data_bytes: int, alignment: int, where: str, version: int
) -> tuple[tuple[Section, ...], int]:
    if type(raw_sections) is not list:
        raise FormatError(f"{where}: sections must be a list")
    sections = []
    width = 2 if version >= 3 else 3
    for entry in raw_sections:
        if not (type(entry) is list and len(entry) == width and all(_is_uint(v) for v in entry)):
            raise FormatError(f"{where}: bad section entry {str(entry)[:80]}")
        if width == 2:  # the section starts where the previous one ended
            offset, (length, crc) = cursor, entry
        else:
            offset, length, crc = entry
        expected = aligned(cursor, alignment)
        if offset != expected or offset + length > data_bytes or crc >= 1 << 32:
            raise FormatError(
                f"{where}: section [{offset}, +{length}) does not start at the next aligned offset "
                f"{expected} after the previous section (it overlaps, leaves a gap or is "
                f"misaligned) or lies outside the data region of {data_bytes} bytes"
            )
        sections.append(Section(offset, length, crc, offset - cursor))
        cursor = offset + length
    return tuple(sections), cursor


def _parse_record(
    item: Any, cursor: int, data_bytes: int, alignment: int, where: str, version: int
) -> tuple[TensorRecord, int]:
    if type(item) is not dict:
        raise FormatError(f"{where}: record is not an object")
    shape = item.get("shape")
    if (
        type(shape) is not list
        or len(shape) > MAX_DIMS
        or not all(_is_uint(d) and d < MAX_DIM_SIZE for d in shape)
    ):
        raise FormatError(f"{where}: bad shape {str(shape)[:80]} (at most {MAX_DIMS} dims, each below 2**48)")
    try:
        dtype = dtype_from_name(item.get("dtype"))
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    spec = TensorSpec(dtype, tuple(shape))
    if spec.numel >= MAX_NUMEL:
        raise FormatError(f"{where}: shape {list(spec.shape)} has more than 2**62 elements")
    codec, params, reference = item.get("codec"), item.get("params", {}), item.get("reference")
    if type(codec) is not dict or type(codec.get("id")) is not str or type(params) is not dict:
        raise FormatError(f"{where}: codec must be an object with a string 'id' and params an object")
    if _nests_deeper(codec, MAX_CONFIG_DEPTH) or _nests_deeper(params, MAX_CONFIG_DEPTH):
        raise FormatError(f"{where}: codec config or params nest deeper than {MAX_CONFIG_DEPTH} levels")
    if reference is not None and type(reference) is not str:
        raise FormatError(f"{where}: reference must be null or a string")
    context = item.get("context")
    if context is not None and not _is_uint(context):
        raise FormatError(f"{where}: context must be null or a record index")
    sections, cursor = _parse_sections(item.get("sections"), cursor, data_bytes, alignment, where, version)
    record = TensorRecord(spec, codec, params, sections, reference, context)
    problem = check_expansion(spec, record.stored_bytes, codec)
    if problem is not None:
        raise FormatError(f"{where}: claims {problem}")
    return record, cursor


def parse_header(raw: bytes, source: str, version: int = FORMAT_VERSION) -> Header:
    """Decode and validate the JSON header (``raw``: the document, as :func:`unpack_header`
    returns it) of a file of ``version``.

    Checks every record (dtype, shape, codec config, sections laid out canonically inside the
    data region, claimed size against stored size) and the skeleton (well formed, pointing at
    every tensor record and at nothing else).

    Raises:
        FormatError: anything invalid or inconsistent; the message names ``source``.
    """
    doc = _load_json(raw, source)
    if type(doc) is not dict or doc.get("format") != "inshrinkerator" or "skeleton" not in doc:
        raise FormatError(f"{source}: header does not describe an inshrinkerator file")
    data_bytes, tensors, meta = doc.get("data_bytes"), doc.get("tensors"), doc.get("meta", {})
    if not _is_uint(data_bytes) or type(tensors) is not list or type(meta) is not dict:
        raise FormatError(f"{source}: header lacks data_bytes/tensors/meta of the right types")
    if "raw_bytes" in meta and not _is_uint(meta["raw_bytes"]) or "policy" in meta and type(meta["policy"]) is not str:
        raise FormatError(f"{source}: header meta has a bad raw_bytes or policy")
    records = []
    cursor = 0
    alignment = section_alignment(version)
    for index, item in enumerate(tensors):
        record, cursor = _parse_record(item, cursor, data_bytes, alignment, f"{source}: tensor #{index}", version)
        records.append(record)
    try:
        context_depths([record.context for record in records])
    except ValueError as exc:
        raise FormatError(f"{source}: tensor {exc}") from None
    if cursor != data_bytes:
        raise FormatError(f"{source}: the data region is {data_bytes} bytes but its sections end at {cursor}")
    try:
        paths = tensor_paths(doc["skeleton"])
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}") from None
    if set(paths) != set(range(len(records))):
        missing = sorted(set(range(len(records))) - set(paths))[:5]
        extra = sorted(set(paths) - set(range(len(records))))[:5]
        raise FormatError(
            f"{source}: skeleton and tensor records disagree (records never used: {missing}, "
            f"missing records: {extra})"
        )
    return Header(doc["skeleton"], tuple(records), meta, data_bytes, paths)
