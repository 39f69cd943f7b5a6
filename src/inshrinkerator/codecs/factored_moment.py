"""A second moment stored as its row and column means (Adafactor's factorisation).

Adam's second moment ``v`` only sets each parameter's step size, and a restored
``v`` is replaced by fresh gradient statistics within ``1 / (1 - beta2)`` steps.
Adafactor showed that the factored estimate ``v_ij ~ r_i c_j / mean(v)`` (``r``, ``c``
the row and column means) trains as well as the full ``v``. Storing only ``r`` and
``c`` costs ``rows + cols`` floats instead of ``rows * cols``: a tensor of shape
``(d0, d1, ...)`` is read as ``d0`` rows of ``d1 * ...`` columns. The estimate is
positive wherever its row and column have any mass, so no restored step divides by a
spurious zero; exact zeros only come back where a whole row or column was zero.

Stream layout (little-endian): ``u32 rows, u32 columns, f32[rows] row means,
f32[columns] column means``; the decoder recomputes everything else.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError, FormatError
from .base import Codec, Encoded, TensorSpec
from .registry import register_codec

__all__ = ["FactoredMomentCodec", "factored_shape"]

_HEAD = struct.Struct("<II")


def factored_shape(shape: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """``(rows, columns)`` a tensor of ``shape`` is factored as, or None when it cannot be."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    columns = 1
    for dim in shape[1:]:
        columns *= dim
    return (rows, columns) if rows >= 2 and columns >= 2 else None


def _rebuild(rows: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    total = rows.double().mean()
    if float(total) <= 0:
        return torch.zeros(shape, dtype=dtype)
    estimate = torch.outer(rows.double(), columns.double()) / total
    return estimate.to(dtype).reshape(shape)


@register_codec
class FactoredMomentCodec(Codec):
    """Lossy: a non-negative tensor of 2+ dims as its row and column means."""

    codec_id = "factored_moment"
    lossless = False

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{self.codec_id} stores floating tensors only, got {tensor.dtype}")
        shape = factored_shape(tuple(tensor.shape))
        if shape is None:
            raise ValueError(f"{self.codec_id} needs at least 2 rows and 2 columns, got {list(tensor.shape)}")
        matrix = tensor.detach().reshape(shape)
        low, high = torch.aminmax(matrix)
        if not (float(low) >= 0 and float(high) < float("inf")):
            raise ValueError(f"{self.codec_id} stores finite non-negative tensors only")
        rows = matrix.mean(1, dtype=torch.float64).float().cpu()
        columns = matrix.mean(0, dtype=torch.float64).float().cpu()
        stream = _HEAD.pack(*shape) + rows.numpy().tobytes() + columns.numpy().tobytes()
        return Encoded(streams=[stream], reconstruction=_rebuild(rows, columns, tensor.dtype, tuple(tensor.shape)))

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if len(streams) != 1:
            raise CorruptCheckpointError(f"{self.codec_id}: expected 1 stream, got {len(streams)}")
        shape = factored_shape(spec.shape)
        if shape is None or not spec.dtype.is_floating_point:
            raise FormatError(f"{self.codec_id}: cannot decode a {spec.dtype} tensor of shape {list(spec.shape)}")
        view = memoryview(streams[0]).cast("B")
        if len(view) < _HEAD.size or _HEAD.unpack_from(view) != shape:
            raise FormatError(f"{self.codec_id}: stream does not describe a {shape[0]} x {shape[1]} matrix")
        if len(view) != _HEAD.size + 4 * (shape[0] + shape[1]):
            raise CorruptCheckpointError(f"{self.codec_id}: stream size does not match its shape")
        values = torch.frombuffer(bytearray(view[_HEAD.size :]), dtype=torch.float32)
        if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
            raise CorruptCheckpointError(f"{self.codec_id}: row or column means are damaged")
        return _rebuild(values[: shape[0]], values[shape[0] :], spec.dtype, spec.shape)
