"""The raw codec: a tensor's bytes as they are (for tiny tensors, where coding costs more).

Also home of the byte view every lossless codec starts from: :func:`tensor_byte_view`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from .base import Codec, Encoded, TensorSpec
from .registry import register_codec

__all__ = ["RawCodec", "tensor_byte_view", "tensor_bytes", "tensor_from_bytes"]


def tensor_byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The little-endian C-order bytes of ``tensor`` as a 1-D uint8 numpy array on the CPU.

    No copy when ``tensor`` is already a contiguous CPU tensor: the array then shares
    its memory, so treat it as read-only. Lazy conjugate/negative views are resolved.
    """
    flat = tensor.detach()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.reshape(-1).contiguous()
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The little-endian C-order bytes of ``tensor`` (a copy)."""
    return tensor_byte_view(tensor).tobytes()


def tensor_from_bytes(data: Any, spec: TensorSpec) -> torch.Tensor:
    """A new tensor of ``spec`` from its bytes.

    Raises:
        CorruptCheckpointError: the byte count does not fit ``spec``, or a bool byte is not 0/1.
    """
    view = memoryview(data).cast("B")
    if view.nbytes != spec.nbytes:
        raise CorruptCheckpointError(
            f"tensor data holds {view.nbytes} bytes, expected {spec.nbytes} for "
            f"{spec.dtype} {list(spec.shape)}"
        )
    out = torch.empty(spec.shape, dtype=spec.dtype)
    if spec.nbytes:
        target = tensor_byte_view(out)
        target[:] = np.frombuffer(view, dtype=np.uint8)
        if spec.dtype == torch.bool and int(target.max()) > 1:
            raise CorruptCheckpointError("bool tensor data holds bytes other than 0 and 1")
    return out


@register_codec
class RawCodec(Codec):
    """Stores the tensor's bytes unchanged."""

    codec_id = "raw"

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        return Encoded(streams=[tensor_bytes(tensor)])

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if len(streams) != 1:
            raise CorruptCheckpointError(f"raw: expected 1 stream, got {len(streams)}")
        return tensor_from_bytes(streams[0], spec)
