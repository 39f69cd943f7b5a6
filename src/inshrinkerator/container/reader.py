"""Read a ``.ink`` container: validate everything before trusting any of it.

Opening a file checks the preamble, the header's CRC-32 and every field of the
header (see :func:`~.format.parse_header`), the zero padding after it and the
exact file size. Section bytes are checked (CRC-32 and the zero padding before
them) when they are read, before any codec sees them. A tensor stored in many
sections (slices of a large tensor) is read one section at a time, as its codec
asks for them, so decoding it holds one compressed slice in memory, not all of
them. Nothing in a file is ever
executed: the header is JSON (in version 2 inside one zstd frame whose size is checked
before it is inflated), the sections are bytes handed to the registered
codec that the header names.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Sequence
from typing import IO, Any, Optional

import torch

from ..codecs._parallel import parallel_map_sized
from ..codecs.registry import get_codec
from ..codecs.scratch import reusing_scratch
from ..errors import CorruptCheckpointError, FormatError, InkError
from .format import (
    PREAMBLE,
    Header,
    TensorRecord,
    data_start,
    parse_header,
    unpack_header,
    unpack_preamble,
)

__all__ = ["ContainerReader"]

# A record of more than one section and more than this many bytes is read lazily.
_LAZY_RECORD_BYTES = 64 << 20


class _Failure:
    """An exception raised while decoding one of several tensors, kept until all are done."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _ReadFailure(Exception):
    """Reading a lazily read section failed: the original error is re-raised as it is, not
    reported as data that does not decode."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _LazySections(Sequence):
    """The checked streams of one record, each read from the file when it is asked for."""

    def __init__(self, reader: "ContainerReader", record: TensorRecord) -> None:
        self._reader = reader
        self._record = record

    def __len__(self) -> int:
        return len(self._record.sections)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        section = self._record.sections[index]
        try:
            return self._reader._check_section(section, self._reader._read_section(section))
        except BaseException as exc:
            raise _ReadFailure(exc) from exc


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
        handle: a binary file object that supports ``seek`` (local or fsspec); closed by
            :meth:`close`.
        source: the name used in error messages (the path or URL).
        parsed: headers already parsed, by their stored bytes (and version): a header
            stored byte for byte the same is not parsed again, and one parsed here is added.
            For a caller that opens the same files more than once.

    Raises:
        FormatError: not a valid file; CorruptCheckpointError: truncated or damaged.
    """

    def __init__(self, handle: IO[bytes], source: str, parsed: Optional[dict[tuple[int, bytes], Header]] = None) -> None:
        self._handle = handle
        self._lock = threading.Lock()  # lazily read sections are read from codec threads
        self.source = source
        size = _file_size(handle)
        handle.seek(0)
        version, header_length, header_crc = unpack_preamble(handle.read(PREAMBLE.size), source)
        self.version = version
        self.data_start = data_start(version, header_length)
        if self.data_start > size:
            raise CorruptCheckpointError(
                f"{source}: file is truncated ({size} bytes; its header alone claims {header_length})"
            )
        raw = handle.read(self.data_start - PREAMBLE.size)
        if len(raw) != self.data_start - PREAMBLE.size:
            raise CorruptCheckpointError(f"{source}: file is truncated inside its header")
        raw, padding = raw[:header_length], raw[header_length:]
        if zlib.crc32(raw) != header_crc:
            raise CorruptCheckpointError(f"{source}: header checksum mismatch; the file is damaged")
        if padding.count(0) != len(padding):
            raise CorruptCheckpointError(f"{source}: the padding after the header is not zero; the file is damaged")
        header = None if parsed is None else parsed.get((version, raw))
        if header is None:
            header = parse_header(unpack_header(raw, version, source), source, version)
            if parsed is not None:
                parsed[(version, raw)] = header
        self.header: Header = header
        expected = self.data_start + self.header.data_bytes
        if size != expected:
            state = "truncated" if size < expected else "followed by unexpected bytes"
            raise CorruptCheckpointError(f"{source}: file is {state} ({size} bytes, expected {expected})")

    @property
    def meta(self) -> dict[str, Any]:
        """The header's free-form ``meta`` object (policy name, raw bytes, store fields)."""
        return self.header.meta

    @property
    def file_bytes(self) -> int:
        """The size of the file."""
        return self.data_start + self.header.data_bytes

    def _read_section(self, section: Any) -> bytes:
        # The raw bytes of one section, padding included (one reader of the handle at a time).
        with self._lock:
            self._handle.seek(self.data_start + section.offset - section.padding)
            data = self._handle.read(section.padding + section.length)
        if len(data) != section.padding + section.length:
            raise CorruptCheckpointError(f"{self.source}: file is truncated inside a section")
        return data

    def _read_sections(self, record: TensorRecord) -> list[bytes]:
        return [self._read_section(section) for section in record.sections]

    def _check_section(self, section: Any, data: bytes) -> Any:
        # Padding and checksum of what _read_section read; safe on any thread.
        if data[: section.padding].count(0) != section.padding:
            raise CorruptCheckpointError(
                f"{self.source}: the padding before data offset {section.offset} is not zero; "
                "the file is damaged"
            )
        stream = memoryview(data)[section.padding :] if section.padding else data
        if zlib.crc32(stream) != section.crc32:
            raise CorruptCheckpointError(
                f"{self.source}: section checksum mismatch at data offset {section.offset}; "
                "the file is damaged"
            )
        return stream

    def _check_sections(self, record: TensorRecord, sections: list[bytes]) -> list[Any]:
        return [self._check_section(section, data) for section, data in zip(record.sections, sections)]

    def read_streams(self, record: TensorRecord) -> list[Any]:
        """The checked bytes of every section of ``record`` (bytes-like objects).

        Raises:
            CorruptCheckpointError: a checksum mismatch, non-zero padding or a short read.
        """
        return [bytes(stream) for stream in self._check_sections(record, self._read_sections(record))]

    def check_record(self, record: TensorRecord) -> int:
        """Check the bytes of every section of ``record`` (checksums and padding), one
        section in memory at a time; returns the number of data bytes checked.

        Raises:
            CorruptCheckpointError: a checksum mismatch, non-zero padding or a short read.
        """
        return sum(len(self._check_section(section, self._read_section(section))) for section in record.sections)

    def verify(self) -> int:
        """Check every section's bytes (checksums and padding) without decoding; returns
        the number of data bytes checked.

        Raises:
            CorruptCheckpointError: the first damaged section found.
        """
        return sum(self.check_record(record) for record in self.header.tensors)

    def decode(
        self,
        record: TensorRecord,
        reference: Optional[torch.Tensor] = None,
        where: str = "",
        context: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Read and decode one tensor, checking the result's dtype and shape. ``context``:
        the decoded tensor of ``record.context``, when it has one.

        Raises:
            FormatError / CorruptCheckpointError: the record does not decode to its spec.
            BrokenChainError: the codec needs a reference that is missing or wrong.
        """
        return self.decode_many([record], [reference], [where], [context])[0]

    def decode_many(
        self,
        records: Sequence[TensorRecord],
        references: Optional[Sequence[Optional[torch.Tensor]]] = None,
        wheres: Optional[Sequence[str]] = None,
        contexts: Optional[Sequence[Optional[torch.Tensor]]] = None,
    ) -> list[torch.Tensor]:
        """Read several tensors (in order, on this thread) and decode them in parallel.

        The file is read serially (the handle is not shared between threads); checksums
        and codecs run on the shared codec pool. Errors are those of :meth:`decode`; when
        several tensors fail, the one raised is that of the earliest record among them.
        """
        records = list(records)
        references = list(references) if references is not None else [None] * len(records)
        wheres = list(wheres) if wheres is not None else [""] * len(records)
        contexts = list(contexts) if contexts is not None else [None] * len(records)
        if not len(records) == len(references) == len(wheres) == len(contexts):
            raise ValueError("decode_many needs one reference, location and context per record")
        codecs = []
        for record, where in zip(records, wheres):
            try:
                codecs.append(get_codec(record.codec))
            except InkError as exc:
                raise type(exc)(f"{self.source}: {self._where(record, where)}: {exc}") from None
        # Small records are read here, in order (I/O errors propagate); a large record in
        # many sections is read by its codec, section by section.
        sections = [
            _LazySections(self, record) if _reads_lazily(record) else self._read_sections(record)
            for record in records
        ]

        def one(index: int) -> Any:
            try:
                return self._decode_checked(
                    codecs[index], records[index], sections[index], references[index], wheres[index], contexts[index]
                )
            except BaseException as exc:  # reported in record order below
                return _Failure(exc)

        # Large tensors decode in parallel, small ones on this thread (parallel_map_sized).
        with reusing_scratch():  # large decoding temporaries reuse their buffers within the batch
            by_record = parallel_map_sized(one, range(len(records)), [record.spec.nbytes for record in records])
        for result in by_record:
            if isinstance(result, _Failure):
                raise result.error
        return by_record

    @staticmethod
    def _where(record: TensorRecord, where: str) -> str:
        return where or f"tensor {record.spec.dtype} {list(record.spec.shape)}"

    def _decode_checked(
        self,
        codec: Any,
        record: TensorRecord,
        sections: Any,
        reference: Optional[torch.Tensor],
        where: str,
        context: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        where = self._where(record, where)
        if codec.uses_context != (record.context is not None):
            needs = "needs" if codec.uses_context else "does not take"
            raise FormatError(f"{self.source}: {where}: codec {codec.codec_id!r} {needs} a context record")
        streams = sections if isinstance(sections, _LazySections) else self._check_sections(record, sections)
        try:
            if record.context is None:
                tensor = codec.decode(streams, record.params, record.spec, reference)
            else:
                tensor = codec.decode(streams, record.params, record.spec, reference, context=context)
        except _ReadFailure as failure:
            raise failure.error from None
        except InkError as exc:
            if str(exc).startswith(self.source):
                raise
            raise type(exc)(f"{self.source}: {where}: {exc}") from None
        except MemoryError:
            raise
        except Exception as exc:
            # The codec is the trust boundary: whatever damaged or forged bytes make it
            # raise (struct.error, zstd, numpy, torch errors) is a property of the file.
            raise FormatError(
                f"{self.source}: {where}: stored data does not decode ({type(exc).__name__}: "
                f"{str(exc)[:160]})"
            ) from exc
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dtype != record.spec.dtype
            or tuple(tensor.shape) != record.spec.shape
        ):
            raise FormatError(f"{self.source}: {where}: decoded tensor does not match its record")
        return tensor

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "ContainerReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reads_lazily(record: TensorRecord) -> bool:
    return len(record.sections) > 1 and sum(section.length for section in record.sections) > _LAZY_RECORD_BYTES
