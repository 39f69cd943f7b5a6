"""Zero padding that keeps a codec's output within the expansion limit it declares.

A container refuses a tensor that decodes to more than ``max_expansion`` times its
stored bytes, so a forged header cannot make a reader allocate far more memory
than the file holds. Entropy-coded codes of an unchanged tensor (every delta 0)
take a few dozen bytes however many values there are, so the codecs that can
produce them end their output with a *padding stream* of zero bytes, sized so the
total is at least ``1 / max_expansion`` of the decoded size: 16 KiB per GiB at
the default 65536x, and nothing at all for any tensor that compresses less.
Decoders check that the padding holds only zeros and ignore it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["PADDED_MAX_EXPANSION", "padding_stream", "check_padding_stream"]

#: The ``max_expansion`` the padded codecs declare (the container's default).
PADDED_MAX_EXPANSION = 1 << 16


def padding_stream(streams: Sequence[Any], decoded_bytes: int, max_expansion: int = PADDED_MAX_EXPANSION) -> bytes:
    """The zero bytes to append to ``streams`` so they hold ``decoded_bytes / max_expansion`` bytes."""
    stored = sum(memoryview(stream).nbytes for stream in streams)
    needed = -(-decoded_bytes // max_expansion)
    return bytes(max(0, needed - stored))


def check_padding_stream(stream: Any, codec_id: str) -> None:
    """:class:`CorruptCheckpointError` unless ``stream`` holds only zero bytes."""
    view = memoryview(stream).cast("B")
    if view.tobytes() != bytes(view.nbytes):
        raise CorruptCheckpointError(f"{codec_id}: the padding stream holds nonzero bytes")
