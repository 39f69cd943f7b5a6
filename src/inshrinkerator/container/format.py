"""The ``.ink`` file layout (see docs/format.md), its constants and header validation.

::

    offset  size  field
    0       8     magic  b"\\x89INK\\r\\n\\x1a\\n"
    8       4     format version (u32, little-endian)
    12      4     flags (u32, must be 0)
    16      8     header length H (u64, at most MAX_HEADER_BYTES)
    24      4     CRC-32 of the header bytes (u32)
    28      4     reserved (must be 0)
    32      H     header: UTF-8 JSON
    ...           zero padding to a multiple of 64: the data region starts here
    data    D     sections, each starting at a multiple of 64 from the data start

The file is exactly ``data_start + data_bytes`` long; anything else is truncation
or trailing garbage. Every section has an offset, a length and a CRC-32 in the
header, sections lie in order and never overlap.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ..codecs.base import TensorSpec, dtype_from_name
from ..errors import CorruptCheckpointError, FormatError

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "PREAMBLE",
    "ALIGNMENT",
    "MAX_HEADER_BYTES",
    "Section",
    "TensorRecord",
    "Header",
    "pack_preamble",
    "unpack_preamble",
    "parse_header",
    "aligned",
]

MAGIC = b"\x89INK\r\n\x1a\n"
FORMAT_VERSION = 1
PREAMBLE = struct.Struct("<8sIIQII")
ALIGNMENT = 64
MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 64
# A decoded tensor may be at most this many times larger than its stored bytes
# (plus a small allowance), so a forged header cannot make a reader allocate
# far more memory than the file could plausibly hold.
MAX_EXPANSION = 1 << 20
EXPANSION_ALLOWANCE = 1 << 20


def aligned(offset: int) -> int:
    """``offset`` rounded up to the next multiple of :data:`ALIGNMENT`."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def pack_preamble(header_length: int, header_crc: int) -> bytes:
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, header_length, header_crc, 0)


def unpack_preamble(data: bytes, source: str) -> tuple[int, int]:
    """Check the preamble; return ``(header_length, header_crc)``."""
    if len(data) < PREAMBLE.size:
        if MAGIC.startswith(data[: len(MAGIC)]) and data:
            raise CorruptCheckpointError(f"{source}: file is truncated inside its preamble")
        raise FormatError(f"{source}: not an inshrinkerator file (too short for the .ink preamble)")
    magic, version, flags, header_length, header_crc, reserved = PREAMBLE.unpack(data[: PREAMBLE.size])
    if magic != MAGIC:
        hint = " (it looks like a pickle/torch.save file; use `inshrink compress` to convert it)" if data[:1] in (b"\x80", b"PK") else ""
        raise FormatError(f"{source}: not an inshrinkerator file (bad magic){hint}")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{source}: .ink format version {version} is not supported (this build reads "
            f"version {FORMAT_VERSION}); upgrade inshrinkerator"
        )
    if flags or reserved:
        raise FormatError(f"{source}: reserved preamble fields are set; file is damaged or newer")
    if header_length == 0 or header_length > MAX_HEADER_BYTES:
        raise FormatError(
            f"{source}: header length {header_length} is outside 1..{MAX_HEADER_BYTES} bytes"
        )
    return header_length, header_crc


@dataclass(frozen=True)
class Section:
    """One stored byte stream: where it lies in the data region and its CRC-32."""

    offset: int
    length: int
    crc32: int


@dataclass(frozen=True)
class TensorRecord:
    """How one tensor is stored."""

    spec: TensorSpec
    codec: dict[str, Any]
    params: dict[str, Any]
    sections: tuple[Section, ...]
    reference: Any  # None, or a JSON value naming what a delta codec decodes against

    @property
    def stored_bytes(self) -> int:
        return sum(s.length for s in self.sections)


@dataclass(frozen=True)
class Header:
    skeleton: Any
    tensors: tuple[TensorRecord, ...]
    meta: dict[str, Any]
    data_bytes: int


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def parse_header(raw: bytes, source: str) -> Header:
    """Decode and validate the JSON header; :class:`FormatError` on anything inconsistent."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{source}: header is not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(doc, dict) or doc.get("format") != "inshrinkerator":
        raise FormatError(f"{source}: header does not describe an inshrinkerator file")
    data_bytes = doc.get("data_bytes")
    tensors = doc.get("tensors")
    meta = doc.get("meta", {})
    if not _is_uint(data_bytes) or not isinstance(tensors, list) or not isinstance(meta, dict):
        raise FormatError(f"{source}: header lacks data_bytes/tensors/meta of the right types")
    records = []
    cursor = 0
    for index, item in enumerate(tensors):
        where = f"{source}: tensor #{index}"
        if not isinstance(item, dict):
            raise FormatError(f"{where}: record is not an object")
        shape = item.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(_is_uint(d) and d < (1 << 48) for d in shape)
        ):
            raise FormatError(f"{where}: bad shape {str(shape)[:80]}")
        spec = TensorSpec(dtype_from_name(item.get("dtype")), tuple(shape))
        codec, params = item.get("codec"), item.get("params", {})
        if not isinstance(codec, dict) or not isinstance(params, dict):
            raise FormatError(f"{where}: codec and params must be objects")
        sections = []
        raw_sections = item.get("sections")
        if not isinstance(raw_sections, list):
            raise FormatError(f"{where}: sections must be a list")
        for entry in raw_sections:
            if not (isinstance(entry, list) and len(entry) == 3 and all(_is_uint(v) for v in entry)):
                raise FormatError(f"{where}: bad section entry {str(entry)[:80]}")
            offset, length, crc = entry
            if offset < cursor or offset % ALIGNMENT or offset + length > data_bytes or crc >= 1 << 32:
                raise FormatError(
                    f"{where}: section [{offset}, +{length}) overlaps another, is misaligned or "
                    f"lies outside the data region of {data_bytes} bytes"
                )
            cursor = offset + length
            sections.append(Section(offset, length, crc))
        stored = sum(s.length for s in sections)
        if spec.numel >= 1 << 62 or spec.nbytes > MAX_EXPANSION * stored + EXPANSION_ALLOWANCE:
            raise FormatError(
                f"{where}: claims {spec.nbytes} bytes of {spec.dtype} {list(spec.shape)} from "
                f"{stored} stored bytes, which no codec produces"
            )
        records.append(TensorRecord(spec, codec, params, tuple(sections), item.get("reference")))
    return Header(doc.get("skeleton"), tuple(records), meta, data_bytes)
