"""Stored bytes by tensor class: weights, first moments, second moments and the rest.

A tensor's class follows from its key path alone (``policies.state_layout``), so a
container's split is read from its header, without decoding any data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .container import ContainerReader
from .policies.state_layout import TensorRole, layout_of
from .tree import TensorLeaf, tensor_paths

__all__ = ["TENSOR_CLASSES", "ClassBytes", "container_class_bytes", "tensor_class"]

#: The classes stored bytes are reported by, in report order.
TENSOR_CLASSES = ("weights", "first_moment", "second_moment", "other")

_ROLE_CLASS = {
    TensorRole.WEIGHT: "weights",
    TensorRole.FIRST_MOMENT: "first_moment",
    TensorRole.MOMENTUM_BUFFER: "first_moment",
    TensorRole.SECOND_MOMENT: "second_moment",
    TensorRole.ACCUMULATOR: "second_moment",
    TensorRole.OTHER: "other",
}


def tensor_class(role: TensorRole) -> str:
    """The report class of a tensor role."""
    return _ROLE_CLASS[role]


@dataclass
class ClassBytes:
    """Raw and stored bytes per tensor class, summed over one or more containers."""

    raw: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSOR_CLASSES, 0))
    stored: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TENSOR_CLASSES, 0))
    containers: int = 0

    def add(self, other: "ClassBytes") -> None:
        for name in TENSOR_CLASSES:
            self.raw[name] += other.raw[name]
            self.stored[name] += other.stored[name]
        self.containers += other.containers


def container_class_bytes(reader: ContainerReader) -> ClassBytes:
    """Raw and stored bytes per class of one open container, from its header alone.

    Roles come from the key paths (``policies.state_layout``); the tensors are stood in
    for by meta tensors of the recorded dtype and shape, so no data is decoded. Stored
    bytes are the tensors' data; the header is in none of the classes.
    """
    header = reader.header
    paths = tensor_paths(header.skeleton)
    leaves = [
        TensorLeaf(paths[index], torch.empty(record.spec.shape, dtype=record.spec.dtype, device="meta"))
        for index, record in enumerate(header.tensors)
    ]
    roles = layout_of(leaves).roles
    result = ClassBytes(containers=1)
    for record, role in zip(header.tensors, roles):
        name = tensor_class(role)
        result.raw[name] += record.spec.nbytes
        result.stored[name] += record.stored_bytes
    return result
