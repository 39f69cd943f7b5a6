"""Lossless reference rows measured on the uninterrupted run's checkpoint states.

A lossless format restores bit for bit, so its failure-recovery run *is* the
uninterrupted run: its size, speed and overhead are measured on the states that run
checkpoints, without training again. Rows: ``torch.save``; ``zstd`` of the
``torch.save`` bytes; the ``zipnn`` package on each tensor's raw bytes (its published
setting). Every row is checked to restore exactly.
"""

from __future__ import annotations

import io
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import zstandard

from ..policies.state_layout import layout_of
from ..tree import flatten
from .measures import TENSOR_CLASSES, tensor_class

__all__ = ["LosslessRow", "LosslessTotals", "LOSSLESS_ROWS", "measure_state"]


def _torch_save_bytes(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _torch_load_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _same(a: Any, b: Any) -> bool:
    left, right = flatten(a).tensors, flatten(b).tensors
    return len(left) == len(right) and all(
        x.tensor.dtype == y.tensor.dtype
        and x.tensor.shape == y.tensor.shape
        and torch.equal(x.tensor.reshape(-1).view(torch.uint8), y.tensor.reshape(-1).view(torch.uint8))
        for x, y in zip(left, right)
    )


class LosslessRow(ABC):
    """A lossless way to store a whole state: ``pack`` to bytes-like parts and back."""

    name: str

    @abstractmethod
    def pack(self, state: Any) -> Any:
        """An opaque packed form; :meth:`stored_bytes` tells its size."""

    @abstractmethod
    def unpack(self, packed: Any) -> Any:
        """The state back, bit for bit."""

    @abstractmethod
    def stored_bytes(self, packed: Any) -> int:
        """Bytes the packed form occupies."""


class TorchSaveRow(LosslessRow):
    name = "torch.save"

    def pack(self, state: Any) -> bytes:
        return _torch_save_bytes(state)

    def unpack(self, packed: bytes) -> Any:
        return _torch_load_bytes(packed)

    def stored_bytes(self, packed: bytes) -> int:
        return len(packed)


class ZstdRow(LosslessRow):
    """zstd (level 3, its default) of the ``torch.save`` bytes."""

    name = "zstd"

    def __init__(self, level: int = 3) -> None:
        self.level = level

    def pack(self, state: Any) -> bytes:
        return zstandard.ZstdCompressor(level=self.level).compress(_torch_save_bytes(state))

    def unpack(self, packed: bytes) -> Any:
        return _torch_load_bytes(zstandard.ZstdDecompressor().decompress(packed))

    def stored_bytes(self, packed: bytes) -> int:
        return len(packed)


_ZIPNN_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class ZipNNRow(LosslessRow):
    """The ``zipnn`` package (byte grouping + Huffman/zstd) on every float tensor's raw bytes;
    other tensors are kept raw. Structure (key paths, shapes) is not counted."""

    name = "zipnn"

    def pack(self, state: Any) -> tuple[Any, list[tuple[torch.Tensor, bytes]]]:
        import zipnn

        flat = flatten(state)
        parts = []
        for leaf in flat.tensors:
            tensor = leaf.tensor.detach().cpu().contiguous()
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
            kind = _ZIPNN_DTYPES.get(tensor.dtype)
            if kind is None or len(raw) == 0:
                parts.append((tensor, raw))
                continue
            # zipnn 0.5.4 rewrites its input buffer in place: give it a private copy.
            packer = zipnn.ZipNN(input_format="byte", bytearray_dtype=kind)
            parts.append((tensor, bytes(packer.compress(bytearray(raw)))))
        return flat.skeleton, parts

    def unpack(self, packed: tuple[Any, list[tuple[torch.Tensor, bytes]]]) -> Any:
        import zipnn

        from ..tree import unflatten

        skeleton, parts = packed
        tensors = []
        for like, data in parts:
            kind = _ZIPNN_DTYPES.get(like.dtype)
            if kind is not None and data:
                data = bytes(zipnn.ZipNN(input_format="byte", bytearray_dtype=kind).decompress(data))
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            tensors.append(flat.view(like.dtype).reshape(like.shape))
        return unflatten(skeleton, tensors)

    def stored_bytes(self, packed: tuple[Any, list[tuple[torch.Tensor, bytes]]]) -> int:
        return sum(len(data) for _, data in packed[1])

    def class_bytes(self, packed: tuple[Any, list[tuple[torch.Tensor, bytes]]], state: Any) -> dict[str, int]:
        """Stored bytes per tensor class."""
        roles = layout_of(flatten(state).tensors).roles
        result = dict.fromkeys(TENSOR_CLASSES, 0)
        for (_, data), role in zip(packed[1], roles):
            result[tensor_class(role)] += len(data)
        return result


#: The rows, in report order.
LOSSLESS_ROWS: tuple[LosslessRow, ...] = (TorchSaveRow(), ZstdRow(), ZipNNRow())


@dataclass
class LosslessTotals:
    """One row's sums over the checkpoints of a run."""

    name: str
    raw_bytes: int = 0
    stored_bytes: int = 0
    weights_raw_bytes: int = 0
    weights_stored_bytes: int = 0
    pack_seconds: float = 0.0
    unpack_seconds: float = 0.0
    torch_load_seconds: float = 0.0
    exact: bool = True
    per_checkpoint_ratio: list[float] = field(default_factory=list)
    class_stored: dict[str, int] = field(default_factory=dict)


def _raw_bytes(state: Any) -> int:
    return sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flatten(state).tensors)


def measure_state(row: LosslessRow, state: dict[str, Any], totals: LosslessTotals) -> None:
    """Pack, unpack and check one checkpoint state with ``row``, adding to ``totals``.

    The weights-only size is the same row applied to ``state["model"]`` alone.
    """
    raw = _raw_bytes(state)
    started = time.perf_counter()
    packed = row.pack(state)
    totals.pack_seconds += time.perf_counter() - started
    stored = row.stored_bytes(packed)
    started = time.perf_counter()
    restored = row.unpack(packed)
    totals.unpack_seconds += time.perf_counter() - started
    totals.exact &= _same(state, restored)
    plain = _torch_save_bytes(state)
    started = time.perf_counter()
    _torch_load_bytes(plain)
    totals.torch_load_seconds += time.perf_counter() - started
    totals.raw_bytes += raw
    totals.stored_bytes += stored
    totals.per_checkpoint_ratio.append(raw / max(stored, 1))
    totals.weights_raw_bytes += _raw_bytes(state["model"])
    totals.weights_stored_bytes += row.stored_bytes(row.pack(state["model"]))
    if isinstance(row, ZipNNRow):
        for name, count in row.class_bytes(packed, state).items():
            totals.class_stored[name] = totals.class_stored.get(name, 0) + count
