"""Reusable scratch buffers for the large temporaries of decoding (CPU).

A fresh tensor of tens of MB costs more in page faults (the allocator hands such
blocks back to the system after every use) than the one pass that fills it: an
int32 copy of 12M bucket ids takes ~21 ms into a new tensor and ~5 ms into a reused
one. While a :func:`reusing_scratch` block is open (the container reader opens one
per batch of tensors it decodes), :func:`scratch` hands every thread its own buffer
per named slot, grown as needed; the buffers are dropped when the outermost block
closes, so nothing is held after a load. Outside such a block, and off the CPU,
:func:`scratch` is ``torch.empty``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["reusing_scratch", "scratch"]

# Smaller temporaries are cheap to allocate; keeping them would only hold memory.
_MIN_ELEMENTS = 1 << 16
_lock = threading.Lock()
_buffers: dict[tuple[int, str], torch.Tensor] = {}
_open_blocks = 0


@contextmanager
def reusing_scratch() -> Iterator[None]:
    """Let :func:`scratch` reuse buffers until the outermost such block closes."""
    global _open_blocks
    with _lock:
        _open_blocks += 1
    try:
        yield
    finally:
        with _lock:
            _open_blocks -= 1
            if not _open_blocks:
                _buffers.clear()


def scratch(slot: str, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``count`` elements.

    Inside :func:`reusing_scratch`, on the CPU, it is this thread's buffer of ``slot``: valid
    until the next call with the same slot on this thread, so a caller uses one slot per
    temporary that must stay alive at the same time and never returns such a tensor.
    """
    if device.type != "cpu" or count < _MIN_ELEMENTS or not _open_blocks:
        return torch.empty(count, dtype=dtype, device=device)
    key = (threading.get_ident(), slot)
    with _lock:
        buffer = _buffers.get(key)
    # Slots hold bytes: a buffer serves any dtype whose elements fit it.
    nbytes = count * dtype.itemsize
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        with _lock:
            if _open_blocks:
                _buffers[key] = buffer
    return buffer[:nbytes].view(dtype)
