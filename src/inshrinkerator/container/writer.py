"""Write a ``.ink`` container: sections are spooled as they are produced, header first on disk."""

from __future__ import annotations

import json
import shutil
import tempfile
import zlib
from typing import IO, Any, Optional

from ..codecs.base import Encoded, TensorSpec, dtype_name
from ..errors import FormatError, UnsupportedStateError
from .format import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    PREAMBLE,
    aligned,
    check_expansion,
    context_depths,
    data_start,
    pack_header,
    pack_preamble,
    section_alignment,
    section_entry,
)

__all__ = ["ContainerWriter"]

# Encoded sections stay in memory up to this size, then spill to a temporary file,
# so writing a huge state never holds all of its compressed bytes in RAM.
SPOOL_IN_MEMORY_BYTES = 256 << 20


class ContainerWriter:
    """Collects encoded tensors, then writes the file in one pass.

    Usage::

        writer = ContainerWriter()
        writer.add(spec, codec.get_config(), codec.encode(tensor))
        writer.finish(file, skeleton, meta)
    """

    def __init__(self) -> None:
        self._spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES)
        self._records: list[dict[str, Any]] = []
        self._cursor = 0
        self._alignment = section_alignment(FORMAT_VERSION)

    def add(
        self,
        spec: TensorSpec,
        codec_config: dict[str, Any],
        encoded: Encoded,
        reference: Optional[str] = None,
        context: Optional[int] = None,
    ) -> int:
        """Append one tensor's streams; returns the bytes stored for it. ``context``: the
        index of another record (added before or after this one) its codec decodes with;
        :meth:`finish` checks that it exists and that no chain of contexts runs in a circle.

        ``encoded.streams`` is iterated once, and each stream is written to the spool before
        the next is taken, so streams produced lazily (``ByteGroupingCodec.encode_lazily``)
        are never all in memory at once.

        Raises:
            FormatError: the codec's output breaks a rule the reader enforces (it decodes
                to more than the codec's ``max_expansion`` allows): a bug in the codec.
            ValueError: ``context`` is this record, or a negative index.
        """
        index = len(self._records)
        if context is not None and not (context >= 0 and context != index):
            raise ValueError(f"a record's context must be another record, not #{context}")
        start = self._cursor
        sections = []
        stored = 0
        try:
            for stream in encoded.streams:
                view = memoryview(stream).cast("B")
                offset = aligned(self._cursor, self._alignment)
                if offset > self._cursor:
                    self._spool.write(b"\0" * (offset - self._cursor))
                self._spool.write(view)
                sections.append(section_entry(offset, view.nbytes, zlib.crc32(view)))
                self._cursor = offset + view.nbytes
                stored += view.nbytes
                del view, stream  # before the next stream is produced
            problem = check_expansion(spec, stored, codec_config)
            if problem is not None:
                raise FormatError(
                    f"refusing to write a file the reader would reject: {problem}; the codec must "
                    "declare a larger max_expansion class attribute"
                )
        except BaseException:
            # nothing of this tensor stays: the writer can go on with other tensors
            self._spool.seek(start)
            self._spool.truncate()
            self._cursor = start
            raise
        self._records.append(
            {
                "dtype": dtype_name(spec.dtype),
                "shape": list(spec.shape),
                "codec": codec_config,
                "params": encoded.params,
                "sections": sections,
                "reference": reference,
                **({} if context is None else {"context": context}),
            }
        )
        return stored

    def finish(self, out: IO[bytes], skeleton: Any, meta: dict[str, Any]) -> int:
        """Write preamble, header and data to ``out``; returns the file size.

        Raises:
            UnsupportedStateError: the header would exceed the format's size limit (a state
                with millions of plain values: store long lists of numbers as tensors).
            ValueError: a record's context is no other record, or contexts run in a circle.
        """
        context_depths([record.get("context") for record in self._records])
        document = json.dumps(
            {
                "format": "inshrinkerator",
                "data_bytes": self._cursor,
                "skeleton": skeleton,
                "tensors": self._records,
                "meta": meta,
            },
            separators=(",", ":"),
            allow_nan=False,
        ).encode("utf-8")
        if len(document) > MAX_HEADER_BYTES:
            raise UnsupportedStateError(
                f"the state's structure needs a {len(document)}-byte header, over the "
                f"{MAX_HEADER_BYTES}-byte limit of the .ink format; store long lists of plain "
                "numbers as tensors, or split the state"
            )
        header = pack_header(document)
        out.write(pack_preamble(len(header), zlib.crc32(header)))
        out.write(header)
        start = data_start(FORMAT_VERSION, len(header))
        out.write(b"\0" * (start - PREAMBLE.size - len(header)))
        self._spool.seek(0)
        shutil.copyfileobj(self._spool, out, length=8 << 20)
        self._spool.close()
        return start + self._cursor

    def close(self) -> None:
        self._spool.close()

