"""Closed-loop residual: code ``tensor - reference`` with an inner lossy codec.

The reference is the previous *reconstructed* checkpoint (or a base model), so
``reconstruction = reference + decoded residual`` is exactly what a reader
rebuilds; the next residual is taken against it, and the quantization error
of one step is carried into the next residual instead of piling up along the
chain. LC-Checkpoint and ExCP both code such residuals.

Arithmetic runs in the working precision (float32, or float64), then the sum is
cast to the tensor's dtype. The reference's CRC-32 is recorded, so decoding
against a different reference is a :class:`BrokenChainError`, not garbage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch

from ..errors import BrokenChainError, FormatError
from .base import Codec, Encoded, TensorSpec, matching_reference
from .expansion_padding import PADDED_MAX_EXPANSION
from .lossy_input import checked_float_input, require_float_spec, working_dtype
from .prepared import PreparedEncoding
from .registry import get_codec, register_codec
from .xor_delta import reference_checksum

__all__ = ["ResidualCodec"]


@register_codec
class ResidualCodec(PreparedEncoding, Codec):
    """``inner(tensor - reference)``; decodes to ``reference + inner's output``.

    Args:
        inner: the codec of the residual, as a config or a codec object (an object
            keeps encode-time settings that are not part of its config, such as a
            prune mask). It must not itself use a reference.
    """

    codec_id = "residual"
    lossless = False
    uses_reference = True
    # The inner codec keeps its output within this limit of the residual's size, which is
    # at least the tensor's (the residual is float32 or float64).
    max_expansion = PADDED_MAX_EXPANSION

    def __init__(self, inner: Union[dict[str, Any], Codec]) -> None:
        if isinstance(inner, Codec):
            self._inner = inner
            self.inner = inner.get_config()
        else:
            self._inner = get_codec(inner)
            self.inner = inner
        if self._inner.uses_reference:
            raise ValueError("residual: the inner codec must not use a reference of its own")

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        prepared = self._take_prepared(tensor, reference)
        if prepared is not None:
            return prepared
        return self._encode_residual(tensor, reference, self._inner.encode)

    def _encode_residual(
        self, tensor: torch.Tensor, reference: Optional[torch.Tensor], encode_inner: Callable[[torch.Tensor], Encoded]
    ) -> Encoded:
        """``tensor - reference`` coded by ``encode_inner`` (the inner codec's encode)."""
        spec = TensorSpec.of(tensor)
        reference = matching_reference(spec, reference, "a residual")
        compute = working_dtype(tensor.dtype)
        flat = checked_float_input(tensor, self.codec_id)
        base = checked_float_input(reference.to(tensor.device), self.codec_id)
        residual = (flat - base).reshape(spec.shape)
        inner = encode_inner(residual)
        decoded = inner.reconstruction if inner.reconstruction is not None else residual
        rebuilt = (base.reshape(spec.shape) + decoded.to(compute)).to(tensor.dtype)
        return Encoded(
            streams=inner.streams,
            params={"inner": inner.params, "reference_crc32": reference_checksum(reference)},
            reconstruction=rebuilt,
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._decode_residual(
            params, spec, reference,
            lambda inner_params, residual_spec: self._inner.decode(streams, inner_params, residual_spec),
        )

    def _decode_residual(
        self,
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor],
        decode_inner: Callable[[dict[str, Any], TensorSpec], torch.Tensor],
    ) -> torch.Tensor:
        """``reference`` plus the residual ``decode_inner(inner params, residual spec)`` gives."""
        reference = matching_reference(spec, reference, "a residual")
        compute = require_float_spec(spec, self.codec_id)
        inner_params = params.get("inner")
        if not isinstance(inner_params, dict):
            raise FormatError(f"{self.codec_id}: params lack the inner codec's params")
        if params.get("reference_crc32") != reference_checksum(reference):
            raise BrokenChainError(
                "the reference tensor differs from the one this residual was taken against "
                "(checksum mismatch): load it against the same previous checkpoint or base"
            )
        residual = decode_inner(inner_params, TensorSpec(compute, spec.shape))
        base = reference.detach().to("cpu", compute)
        return (base + residual.to(compute)).to(spec.dtype)
