"""Snapshot a state: a private CPU copy the caller may mutate right after ``save`` returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..codecs._parallel import parallel_map
from ..tree import flatten, unflatten

__all__ = ["Snapshot", "SpareBuffers", "snapshot_state", "tensor_bytes_of"]


@dataclass
class Snapshot:
    """A copied state, its distinct tensors (the copies) and their raw bytes."""

    state: Any
    raw_bytes: int
    tensors: list[torch.Tensor]


def tensor_bytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot_state(state: Any, spare: Optional["SpareBuffers"] = None) -> Snapshot:
    """Copy every distinct tensor of ``state`` to the CPU and rebuild the structure around the copies.

    Plain values come back from the flattened skeleton, so they are copies too. Tensors
    that were one tensor (tied weights) stay one tensor in the snapshot. With ``spare``
    (buffers laid out like a previous snapshot), each tensor that matches its buffer's
    shape, dtype and strides is copied into it instead of into fresh memory.

    Raises:
        UnsupportedStateError: the state holds something that cannot be stored (raised
            here, on the caller's thread, not later in the background).
    """
    flat = flatten(state)
    # The caller is blocked while this runs: the copies are shared out between the codec
    # threads, largest first (copies release the GIL; two threads halve a large state's
    # copy time once the allocator has memory to reuse).
    tensors = [leaf.tensor for leaf in flat.tensors]
    buffers = spare.matching(tensors) if spare is not None else [None] * len(tensors)
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].numel())

    def copy(index: int) -> torch.Tensor:
        buffer, tensor = buffers[index], tensors[index].detach()
        return buffer.copy_(tensor) if buffer is not None else tensor.to("cpu", copy=True)

    copies: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for index, copied in zip(order, parallel_map(copy, order)):
        copies[index] = copied
    return Snapshot(unflatten(flat.skeleton, copies), tensor_bytes_of(copies), copies)


#: A tensor's shape, strides and dtype.
Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


class SpareBuffers:
    """Fresh CPU tensors laid out like a snapshot's, every page already written.

    Copying a large state into new memory costs about as much again in page faults as
    the copy itself (MiniLM's 89 MB: 12-21 ms against 8-9 ms into written memory), and an
    async save blocks the training loop for that copy. A manager makes these in the
    background after a save is written, for the next snapshot to copy into. They share
    no memory with the snapshot they are laid out like (whose tensors may live on as a
    closed-loop reference), so nothing they hold is ever read.
    """

    def __init__(self, layout: Sequence[Layout]) -> None:
        self._buffers = [
            torch.empty_strided(shape, stride, dtype=dtype, device="cpu").zero_() for shape, stride, dtype in layout
        ]

    @staticmethod
    def layout_of(tensors: Sequence[torch.Tensor]) -> list["Layout"]:
        """The shape, strides and dtype of each of ``tensors`` (of a snapshot)."""
        return [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors]

    def matching(self, tensors: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """The buffer for each of ``tensors`` (in snapshot order), or None where it does not
        fit: another count of tensors, shape, stride or dtype. Each buffer is handed out once."""
        buffers, self._buffers = self._buffers, []
        if len(buffers) != len(tensors):
            return [None] * len(tensors)
        return [
            buffer if (buffer.shape == tensor.shape and buffer.stride() == tensor.stride() and buffer.dtype == tensor.dtype)
            else None
            for buffer, tensor in zip(buffers, tensors)
        ]
