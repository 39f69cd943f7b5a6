"""Write a ``.ink`` container: sections are spooled as they are produced, header first on disk."""

from __future__ import annotations

import json
import shutil
import tempfile
import zlib
from typing import IO, Any

from ..codecs.base import Encoded, TensorSpec, dtype_name
from .format import PREAMBLE, aligned, pack_preamble

__all__ = ["ContainerWriter"]

# Encoded sections stay in memory up to this size, then spill to a temporary file,
# so writing a huge state never holds all of its compressed bytes in RAM.
SPOOL_IN_MEMORY_BYTES = 64 << 20


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

    def add(self, spec: TensorSpec, codec_config: dict[str, Any], encoded: Encoded, reference: Any = None) -> int:
        """Append one tensor's streams; returns the bytes stored for it."""
        sections = []
        stored = 0
        for stream in encoded.streams:
            offset = aligned(self._cursor)
            if offset > self._cursor:
                self._spool.write(b"\0" * (offset - self._cursor))
            view = memoryview(stream).cast("B")
            self._spool.write(view)
            sections.append([offset, view.nbytes, zlib.crc32(view)])
            self._cursor = offset + view.nbytes
            stored += view.nbytes
        self._records.append(
            {
                "dtype": dtype_name(spec.dtype),
                "shape": list(spec.shape),
                "codec": codec_config,
                "params": encoded.params,
                "sections": sections,
                "reference": reference,
            }
        )
        return stored

    def finish(self, out: IO[bytes], skeleton: Any, meta: dict[str, Any]) -> int:
        """Write preamble, header and data to ``out``; returns the file size."""
        header = json.dumps(
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
        out.write(pack_preamble(len(header), zlib.crc32(header)))
        out.write(header)
        data_start = aligned(PREAMBLE.size + len(header))
        out.write(b"\0" * (data_start - PREAMBLE.size - len(header)))
        self._spool.seek(0)
        shutil.copyfileobj(self._spool, out, length=8 << 20)
        self._spool.close()
        return data_start + self._cursor

    def close(self) -> None:
        self._spool.close()

