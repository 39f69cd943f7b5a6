"""Snapshot a state: a private CPU copy the caller may mutate right after ``save`` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
    copies = [leaf.tensor.detach().to("cpu", copy=True) for leaf in flat.tensors]
    return Snapshot(unflatten(flat.skeleton, copies), tensor_bytes_of(copies))
