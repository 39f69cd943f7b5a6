"""Snapshot a state: a private CPU copy the caller may mutate right after ``save`` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..codecs._parallel import parallel_map
from ..tree import flatten, unflatten

__all__ = ["Snapshot", "snapshot_state", "tensor_bytes_of"]


@dataclass
class Snapshot:
    """A copied state and the raw bytes of its distinct tensors."""

    state: Any
    raw_bytes: int


def tensor_bytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot_state(state: Any) -> Snapshot:
    """Copy every distinct tensor of ``state`` to the CPU and rebuild the structure around the copies.

    Plain values come back from the flattened skeleton, so they are copies too. Tensors
    that were one tensor (tied weights) stay one tensor in the snapshot.

    Raises:
        UnsupportedStateError: the state holds something that cannot be stored (raised
            here, on the caller's thread, not later in the background).
    """
    flat = flatten(state)
    # The caller is blocked while this runs: the copies are shared out between the codec
    # threads, largest first (copies release the GIL; two threads halve a large state's
    # copy time once the allocator has memory to reuse).
    tensors = [leaf.tensor for leaf in flat.tensors]
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].numel())
    copies: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for index, copy in zip(order, parallel_map(lambda i: tensors[i].detach().to("cpu", copy=True), order)):
        copies[index] = copy
    return Snapshot(unflatten(flat.skeleton, copies), tensor_bytes_of(copies))
