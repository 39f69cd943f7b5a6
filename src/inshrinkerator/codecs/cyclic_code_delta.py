"""QD-Compressor's delta: integer codes stored as cyclic differences against the previous codes.

The tensor is quantized as in :mod:`.entropy_width_quantize` (one uniform grid of
``B`` levels, ``B`` set by the values' entropy). The codes of the previous
checkpoint are taken from the *reference* (the previous reconstructed tensor)
quantized on the current grid; the stored symbols are ``(code - previous) mod B``,
entropy coded. When weights move less than a grid step most symbols are 0, which
the entropy coder stores in a fraction of a bit each.

Paper vs this code (QD-Compressor as re-implemented in Inshrinkerator;
research/algorithms.md §1.6 and §5):

- The difference is cyclic (mod ``B``), treating the bins as a circular buffer, so
  a symbol needs ``log2 B`` bits at most, as in QD.
- The previous codes: QD keeps the previous checkpoint's integer codes. We
  recompute them deterministically from the reference and the *current* grid
  (stored in this tensor's params), so no previous params or codes are stored or
  looked up: when the grid has not moved they are exactly the previous codes, and
  when it has, they are the previous reconstruction expressed on the new grid,
  which is what the decoder needs. Encoder and decoder run the same float
  operations on the same reference bits, so they agree exactly.
- Closed loop: the reconstruction is the current grid's value of the current
  codes, so the error of every checkpoint is that of one quantization
  (``<= scale / 2``) however long the chain is.

The reference's CRC-32 is recorded; decoding against another reference is a
:class:`BrokenChainError`.

Streams: ``[entropy-coded cyclic differences, zero padding]`` (see
:mod:`.expansion_padding`); params: ``bins``, ``low``, ``scale``, ``reference_crc32``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..errors import BrokenChainError, CorruptCheckpointError
from .base import Codec, Encoded, TensorSpec, matching_reference
from .entropy import decode_symbols, encode_symbols
from .entropy_width_quantize import UniformGrid, check_bin_bounds, entropy_bin_count
from .expansion_padding import PADDED_MAX_EXPANSION, check_padding_stream, padding_stream
from .lossy_input import checked_float_input, require_float_spec
from .registry import register_codec
from .xor_delta import reference_checksum

__all__ = ["CyclicCodeDeltaCodec"]


@register_codec
class CyclicCodeDeltaCodec(Codec):
    """Entropy-width uniform codes, stored as ``(code - reference code) mod B``.

    Args:
        min_bins: fewest grid levels a tensor gets.
        max_bins: most grid levels (and the histogram resolution of the entropy estimate).
    """

    codec_id = "cyclic_code_delta"
    lossless = False
    max_expansion = PADDED_MAX_EXPANSION
    uses_reference = True

    def __init__(self, min_bins: int = 8, max_bins: int = 256) -> None:
        check_bin_bounds(self.codec_id, min_bins, max_bins)
        self.min_bins = min_bins
        self.max_bins = max_bins

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        reference = matching_reference(TensorSpec.of(tensor), reference, "a code delta")
        flat = checked_float_input(tensor, self.codec_id)
        previous = checked_float_input(reference.to(flat.device), self.codec_id)
        grid = UniformGrid.spanning(flat, entropy_bin_count(flat, self.min_bins, self.max_bins))
        codes = grid.codes(flat)
        differences = torch.remainder(codes - grid.codes(previous), grid.bins)
        streams = [encode_symbols(differences, grid.bins)]
        return Encoded(
            streams=[*streams, padding_stream(streams, TensorSpec.of(tensor).nbytes)],
            params={**grid.params(), "reference_crc32": reference_checksum(reference)},
            reconstruction=grid.values(codes).reshape(tensor.shape).to(tensor.dtype),
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        reference = matching_reference(spec, reference, "a code delta")
        compute = require_float_spec(spec, self.codec_id)
        grid = UniformGrid.from_params(params, compute, self.codec_id, self.max_bins)
        if params.get("reference_crc32") != reference_checksum(reference):
            raise BrokenChainError(
                "the reference tensor differs from the one this code delta was taken against "
                "(checksum mismatch): load it against the same previous checkpoint or base"
            )
        if len(streams) != 2:
            raise CorruptCheckpointError(f"{self.codec_id}: expected 2 streams, got {len(streams)}")
        check_padding_stream(streams[1], self.codec_id)
        differences = decode_symbols(streams[0], spec.numel)
        if differences.numel() and int(differences.max()) >= grid.bins:
            raise CorruptCheckpointError(f"{self.codec_id}: a symbol lies outside the {grid.bins}-level grid")
        previous = grid.codes(reference.detach().reshape(-1).to("cpu", compute))
        codes = torch.remainder(previous + differences, grid.bins)
        return grid.values(codes).reshape(spec.shape).to(spec.dtype)
