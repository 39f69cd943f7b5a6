"""A delta tensor that is its reference: stored in no bytes, decoded as a copy of the reference.

A layer the model does not train keeps, checkpoint after checkpoint, the values it was
stored with: its reference (the previous *reconstructed* checkpoint) is already what a
new delta would reconstruct. This codec records only a fingerprint of that reference, so
decoding against another tensor is a :class:`~inshrinkerator.errors.BrokenChainError`,
never silent garbage. It is lossy: the reconstruction is the reference, whatever the
tensor; the policy that chooses it vouches that the reference is close enough (DynaQuant
checks the tensor's distance from it against the frozen budget first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError, FormatError
from .base import Codec, Encoded, TensorSpec, matching_reference
from .dynaquant import check_reference_fingerprint, reference_fingerprint
from .registry import register_codec

__all__ = ["UnchangedCodec"]

_STORED_AS = "its reference (unchanged)"


@register_codec
class UnchangedCodec(Codec):
    """Stores nothing but the reference's fingerprint; decodes to a copy of the reference."""

    codec_id = "unchanged"
    lossless = False
    uses_reference = True
    # No bytes decode to a whole tensor. That is no decompression bomb: the output is a copy
    # of a reference of the very same dtype and shape, which the reader must already hold
    # (decoding without one is refused before anything is allocated).
    max_expansion = 1 << 62

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        reference = matching_reference(TensorSpec.of(tensor), reference, _STORED_AS)
        # The reference itself is the reconstruction: a chain's next delta is taken against it.
        return Encoded(streams=[], params={"fingerprint": reference_fingerprint(reference)}, reconstruction=reference)

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        reference = matching_reference(spec, reference, _STORED_AS)
        if len(streams):
            raise CorruptCheckpointError(f"{self.codec_id}: expected no stream, got {len(streams)}")
        fingerprint = params.get("fingerprint") if isinstance(params, dict) else None
        if isinstance(fingerprint, bool) or not isinstance(fingerprint, int):
            raise FormatError(f"{self.codec_id}: params {str(params)[:80]!r} lack the reference's fingerprint")
        check_reference_fingerprint(self.codec_id, fingerprint, reference)
        # A copy: the caller owns what it loads, and the reference may be someone's base model.
        return reference.detach().to("cpu", copy=True)
