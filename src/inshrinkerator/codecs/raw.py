"""The raw codec: a tensor's bytes as they are (for tiny tensors, where coding costs more)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError
from .base import Codec, Encoded, TensorSpec
from .registry import register_codec

__all__ = ["RawCodec", "tensor_bytes", "tensor_from_bytes"]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The little-endian C-order bytes of ``tensor``."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: Any, spec: TensorSpec) -> torch.Tensor:
    """A new tensor of ``spec`` from its bytes; :class:`CorruptCheckpointError` on a size mismatch."""
    if len(data) != spec.nbytes:
        raise CorruptCheckpointError(
            f"tensor data holds {len(data)} bytes, expected {spec.nbytes} for "
            f"{spec.dtype} {list(spec.shape)}"
        )
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if spec.nbytes else torch.empty(0, dtype=torch.uint8)
    return buffer.view(spec.dtype).reshape(spec.shape)


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
