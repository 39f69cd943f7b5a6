"""Unsigned LEB128 integers: compact counts in stream headers (one byte below 128).

Small tensors compress to a few hundred bytes, so fixed 8-byte counts in their
headers would be a noticeable part of a checkpoint.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["encode_varint", "decode_varint", "MAX_VARINT_BYTES"]

#: A u64 needs at most 10 bytes.
MAX_VARINT_BYTES = 10


def encode_varint(value: int) -> bytes:
    """The LEB128 bytes of a non-negative int below 2**64."""
    if not 0 <= value < 1 << 64:
        raise ValueError(f"varint value {value} is outside [0, 2**64)")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(data: Any, offset: int) -> tuple[int, int]:
    """``(value, next offset)`` of the varint at ``offset``; :class:`CorruptCheckpointError` if cut."""
    view = memoryview(data).cast("B")
    value = shift = 0
    for index in range(offset, min(offset + MAX_VARINT_BYTES, len(view))):
        byte = view[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >= 1 << 64:
                break
            return value, index + 1
        shift += 7
    raise CorruptCheckpointError("a varint in the stream header is cut off or too long")
