"""QD-Compressor's quantizer (as Inshrinkerator re-implemented it): entropy-driven bin count.

A tensor is quantized per layer on one uniform grid spanning its ``[min, max]``
with ``B`` levels, ``low + code * scale``; the codes are entropy coded. ``B`` is
chosen from the data: ``H``, the entropy (bits) the layer's values carry at the
finest allowed resolution ``(max - min) / max_bins``, says how many levels the
layer really uses; it gets ``2**ceil(H)`` levels, clamped to ``[min_bins,
max_bins]``. A layer whose values fill their range gets many levels; one whose
mass sits in a small part of it (outliers stretch the range) gets few.

``H`` is estimated from the standard deviation, as the entropy of a normal
distribution of that spread: ``log2(sqrt(2 pi e) * std / step)``. A histogram
count would be lower for a layer restored from a checkpoint (its values already
sit on a grid) and would coarsen the grid at every restore; the spread and range
of a quantized layer are those of the original, so it gets the same bin count.

Paper vs this code (QD-Compressor, TPDS 2023; research/algorithms.md §5):

- QD-Compressor adapts bits per layer from the "weighted entropy" of the value
  distribution; Inshrinkerator's QD+ re-implementation is described only as
  "entropy-based variable bit-width uniform quantization" with minimum and maximum
  bins in {8, ..., 256}. The ``2**ceil(H)`` rule and the normal-entropy estimate
  above are our reading; those bounds are our defaults.
- QD's error-feedback correction modifies training (it is not transparent to the
  training loop), so it is left out.
- The entropy stage is the project's order-0 ANS coder instead of Huffman (within
  ~0.1% of the order-0 entropy, never larger than Huffman's whole-bit codes).

This codec stores a tensor on its own (the first checkpoint of a chain);
:mod:`.cyclic_code_delta` stores the codes as cyclic differences against the
previous checkpoint.

Error bound: every value is within ``scale / 2`` of its decoded value, with
``scale = (max - min) / (B - 1)``.

Streams: ``[entropy-coded codes, zero padding]`` (see :mod:`.expansion_padding`);
params: ``bins``, ``low``, ``scale``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError, FormatError
from .base import Codec, Encoded, TensorSpec
from .entropy import decode_symbols, encode_symbols
from .expansion_padding import PADDED_MAX_EXPANSION, check_padding_stream, padding_stream
from .lossy_input import checked_float_input, require_float_spec
from .registry import register_codec
from .uniform_quantize import dequantize_rows, quantize_rows

__all__ = ["EntropyWidthQuantizeCodec", "UniformGrid", "entropy_bin_count", "check_bin_bounds"]

MAX_BINS = 1 << 16


def check_bin_bounds(codec_id: str, min_bins: Any, max_bins: Any) -> None:
    """``ValueError`` unless ``2 <= min_bins <= max_bins <= 65536`` (ints)."""
    for name, value in (("min_bins", min_bins), ("max_bins", max_bins)):
        if not isinstance(value, int) or isinstance(value, bool) or not 2 <= value <= MAX_BINS:
            raise ValueError(f"{codec_id}: {name} must be an int in [2, {MAX_BINS}], got {value!r}")
    if min_bins > max_bins:
        raise ValueError(f"{codec_id}: min_bins {min_bins} exceeds max_bins {max_bins}")


def entropy_bin_count(values: torch.Tensor, min_bins: int, max_bins: int) -> int:
    """``2**ceil(H)`` clamped to ``[min_bins, max_bins]``, ``H`` the layer's entropy estimate.

    ``H = log2(sqrt(2 pi e) * std / step)`` bits, with ``step = (max - min) / max_bins``:
    the entropy of a normal distribution of the layer's spread, read at the finest
    resolution allowed.
    """
    flat = values.reshape(-1).to(torch.float64)
    if flat.numel() < 2:
        return min_bins
    span = float(flat.max() - flat.min())
    spread = float(flat.std())
    if not span > 0 or not spread > 0:
        return min_bins
    entropy = math.log2(math.sqrt(2 * math.pi * math.e) * spread * max_bins / span)
    bits = max(1, math.ceil(entropy - 1e-9))
    return int(min(max(1 << min(bits, 30), min_bins), max_bins))


@dataclass(frozen=True)
class UniformGrid:
    """One uniform grid ``low + code * scale`` with ``bins`` levels, in a working dtype."""

    bins: int
    low: torch.Tensor  # shape (1,)
    scale: torch.Tensor  # shape (1,)

    @classmethod
    def spanning(cls, flat: torch.Tensor, bins: int) -> "UniformGrid":
        """The grid over ``[min, max]`` of ``flat`` (a constant tensor gets ``scale == 0``)."""
        if flat.numel() == 0:
            zero = flat.new_zeros(1)
            return cls(bins, zero, zero.clone())
        low, high = flat.min().reshape(1), flat.max().reshape(1)
        scale = (high - low) / (bins - 1)
        # Among subnormals the division can round the step down (even to 0), leaving the
        # top of the range off the grid and the stated bound broken: one step up fixes it.
        short = low + scale * (bins - 1) < high
        return cls(bins, low, torch.where(short, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale))

    @classmethod
    def from_params(cls, params: dict[str, Any], compute: torch.dtype, codec_id: str, max_bins: int) -> "UniformGrid":
        """The grid recorded in ``params``; :class:`FormatError` when it is malformed."""
        bins, low, scale = params.get("bins"), params.get("low"), params.get("scale")
        if not isinstance(bins, int) or isinstance(bins, bool) or not 2 <= bins <= max_bins:
            raise FormatError(f"{codec_id}: bad bin count {bins!r} (at most {max_bins})")
        for name, value in (("low", low), ("scale", scale)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise FormatError(f"{codec_id}: bad grid {name} {value!r}")
        if scale < 0:
            raise FormatError(f"{codec_id}: negative grid scale {scale!r}")
        return cls(bins, torch.tensor([low], dtype=compute), torch.tensor([scale], dtype=compute))

    def params(self) -> dict[str, Any]:
        return {"bins": self.bins, "low": float(self.low), "scale": float(self.scale)}

    def codes(self, flat: torch.Tensor) -> torch.Tensor:
        """Integer codes of ``flat`` (clamped to the grid)."""
        return quantize_rows(flat.reshape(1, -1), self.low.to(flat.device), self.scale.to(flat.device), self.bins).reshape(-1)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """The grid values of ``codes``."""
        return dequantize_rows(codes.reshape(1, -1), self.low.to(codes.device), self.scale.to(codes.device)).reshape(-1)


@register_codec
class EntropyWidthQuantizeCodec(Codec):
    """One uniform grid per tensor, its bin count set by the values' entropy; codes entropy coded.

    Args:
        min_bins: fewest grid levels a tensor gets.
        max_bins: most grid levels (and the histogram resolution of the entropy estimate).
    """

    codec_id = "entropy_width_quantize"
    lossless = False
    max_expansion = PADDED_MAX_EXPANSION

    def __init__(self, min_bins: int = 8, max_bins: int = 256) -> None:
        check_bin_bounds(self.codec_id, min_bins, max_bins)
        self.min_bins = min_bins
        self.max_bins = max_bins

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        flat = checked_float_input(tensor, self.codec_id)
        grid = UniformGrid.spanning(flat, entropy_bin_count(flat, self.min_bins, self.max_bins))
        codes = grid.codes(flat)
        streams = [encode_symbols(codes, grid.bins)]
        return Encoded(
            streams=[*streams, padding_stream(streams, TensorSpec.of(tensor).nbytes)],
            params=grid.params(),
            reconstruction=grid.values(codes).reshape(tensor.shape).to(tensor.dtype),
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        compute = require_float_spec(spec, self.codec_id)
        grid = UniformGrid.from_params(params, compute, self.codec_id, self.max_bins)
        if len(streams) != 2:
            raise CorruptCheckpointError(f"{self.codec_id}: expected 2 streams, got {len(streams)}")
        check_padding_stream(streams[1], self.codec_id)
        codes = decode_symbols(streams[0], spec.numel)
        if codes.numel() and int(codes.max()) >= grid.bins:
            raise CorruptCheckpointError(f"{self.codec_id}: a code lies outside the {grid.bins}-level grid")
        return grid.values(codes).reshape(spec.shape).to(spec.dtype)
