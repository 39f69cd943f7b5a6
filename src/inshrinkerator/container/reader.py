"""Read a ``.ink`` container: validate everything before trusting any of it."""

from __future__ import annotations

import os
import zlib
from typing import IO, Any, Optional

import torch

from ..codecs.base import TensorSpec
from ..codecs.registry import get_codec
from ..errors import CorruptCheckpointError, FormatError, InkError
from .format import MAX_EXPANSION, PREAMBLE, Header, TensorRecord, aligned, parse_header, unpack_preamble

__all__ = ["ContainerReader"]


def _file_size(handle: IO[bytes]) -> int:
    try:
        return os.fstat(handle.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        size = getattr(handle, "size", None)
        if isinstance(size, int):
            return size
        position = handle.tell()
        end = handle.seek(0, os.SEEK_END)
        handle.seek(position)
        return end


class ContainerReader:
    """An open ``.ink`` file: a validated :class:`Header` and checked access to its sections.

    Args:
        handle: a binary file object that supports ``seek`` (local or fsspec).
        source: the name used in error messages (the path or URL).

    Raises:
        FormatError: not a valid file; CorruptCheckpointError: truncated or damaged.
    """

    def __init__(self, handle: IO[bytes], source: str) -> None:
        self._handle = handle
        self.source = source
        size = _file_size(handle)
        handle.seek(0)
        header_length, header_crc = unpack_preamble(handle.read(PREAMBLE.size), source)
        if PREAMBLE.size + header_length > size:
            raise CorruptCheckpointError(
                f"{source}: file is truncated ({size} bytes, header alone claims {header_length})"
            )
        raw = handle.read(header_length)
        if zlib.crc32(raw) != header_crc:
            raise CorruptCheckpointError(f"{source}: header checksum mismatch; the file is damaged")
        self.header: Header = parse_header(raw, source)
        self.data_start = aligned(PREAMBLE.size + header_length)
        expected = self.data_start + self.header.data_bytes
        if size != expected:
            state = "truncated" if size < expected else "followed by unexpected bytes"
            raise CorruptCheckpointError(
                f"{source}: file is {state} ({size} bytes, expected {expected})"
            )

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta

    def read_streams(self, record: TensorRecord) -> list[bytes]:
        """The checked bytes of every section of ``record``."""
        streams = []
        for section in record.sections:
            self._handle.seek(self.data_start + section.offset)
            data = self._handle.read(section.length)
            if len(data) != section.length:
                raise CorruptCheckpointError(f"{self.source}: file is truncated inside a section")
            if zlib.crc32(data) != section.crc32:
                raise CorruptCheckpointError(
                    f"{self.source}: section checksum mismatch at data offset {section.offset}; "
                    "the file is damaged"
                )
            streams.append(data)
        return streams

    def decode(self, record: TensorRecord, reference: Optional[torch.Tensor] = None, where: str = "") -> torch.Tensor:
        """Read and decode one tensor, checking the result's dtype and shape."""
        codec = get_codec(record.codec)
        limit = getattr(codec, "max_expansion", MAX_EXPANSION)
        if record.spec.nbytes > limit * max(record.stored_bytes, 1) + (1 << 20):
            raise FormatError(f"{self.source}: {where} claims more data than its codec can produce")
        streams = self.read_streams(record)
        try:
            tensor = codec.decode(streams, record.params, record.spec, reference)
        except InkError as exc:
            raise type(exc)(f"{self.source}: {where}: {exc}") from None
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError) as exc:
            raise FormatError(
                f"{self.source}: {where}: stored data does not decode ({type(exc).__name__}: "
                f"{str(exc)[:120]})"
            ) from None
        if tensor.dtype != record.spec.dtype or tuple(tensor.shape) != record.spec.shape:
            raise FormatError(f"{self.source}: {where}: decoded tensor does not match its record")
        return tensor

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "ContainerReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


