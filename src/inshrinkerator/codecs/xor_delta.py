"""Lossless delta against a reference tensor: XOR of the bit patterns, then an inner codec.

Consecutive checkpoints, or a fine-tuned model and its pretrained base, share
signs, exponents and the top mantissa bits of most elements; XOR turns those
shared bits into zeros that the inner codec's byte planes compress well. The
reference's checksum is recorded, so decoding against the wrong reference is a
:class:`BrokenChainError` instead of silent garbage.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..errors import BrokenChainError, FormatError
from .base import Codec, Encoded, TensorSpec, matching_reference
from .byte_grouping import ByteGroupingCodec
from .raw import tensor_byte_view
from .registry import get_codec, register_codec

__all__ = ["XorDeltaCodec", "reference_checksum", "xor_bits"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference_checksum(reference: torch.Tensor) -> int:
    """CRC-32 of the reference's bytes: identifies the exact tensor a delta was taken against."""
    return zlib.crc32(tensor_byte_view(reference))


def xor_bits(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A new CPU tensor of ``tensor``'s dtype and shape holding ``tensor`` XOR ``reference`` bitwise."""
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    a = torch.from_numpy(tensor_byte_view(tensor))
    b = torch.from_numpy(tensor_byte_view(reference))
    width = _INT_VIEW[8 if a.numel() % 8 == 0 else 1]  # wide words when the length allows
    out = torch.bitwise_xor(a.view(width), b.view(width)).view(torch.uint8)
    return out.view(tensor.dtype).reshape(tensor.shape)


@register_codec
class XorDeltaCodec(Codec):
    """``inner(tensor XOR reference)``; needs the same reference to decode."""

    codec_id = "xor_delta"
    uses_reference = True

    def __init__(self, inner: Optional[dict[str, Any]] = None) -> None:
        self.inner = inner if inner is not None else ByteGroupingCodec().get_config()
        try:
            self._inner = get_codec(self.inner)
        except FormatError as exc:
            raise ValueError(str(exc)) from None
        if not self._inner.lossless or self._inner.uses_reference:
            raise ValueError("xor_delta needs a lossless inner codec that takes no reference")

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        reference = matching_reference(TensorSpec.of(tensor), reference, "a delta")
        inner = self._inner.encode(xor_bits(tensor, reference))
        return Encoded(
            streams=inner.streams,
            params={"inner": inner.params, "reference_crc32": reference_checksum(reference)},
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        reference = matching_reference(spec, reference, "a delta")
        inner_params = params.get("inner") if isinstance(params, dict) else None
        if not isinstance(inner_params, dict):
            raise FormatError("xor_delta: params lack the inner codec's params")
        if params.get("reference_crc32") != reference_checksum(reference):
            raise BrokenChainError(
                "the reference tensor differs from the one this delta was taken against "
                "(checksum mismatch): pass the same base that was used when saving"
            )
        return xor_bits(self._inner.decode(streams, inner_params, spec), reference)
