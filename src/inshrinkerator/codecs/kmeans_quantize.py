"""ExCP's quantizer: 1-D k-means on the kept values, a zero code, fp16 codebook, LZMA.

Values outside the *keep mask* (pruned by the policy) and exact zeros get code 0
and decode to 0. The kept nonzero values are clustered by 1-D k-means into
``2**bits - 1`` centres, coded ``1 ..`` in ascending centre order; each value
takes its nearest centre. Codes are bit-packed (two 4-bit codes per byte) and
compressed with LZMA.

Paper vs this code (ExCP, ICML 2024; research/algorithms.md §3):

- k-means: ExCP runs faiss k-means (random init, 25 iterations). We run exact
  Lloyd iterations on the sorted values (boundaries by binary search, cluster
  sums by prefix sums: O(k log n) per iteration after one sort), initialised at
  evenly spaced quantiles so the result is deterministic; ``iterations`` caps them.
- Codebook in fp16 as the paper, but scaled by a power of two (stored as
  ``scale_exponent``) so that Adam second moments around 1e-10 do not underflow
  fp16's range, and a nonzero centre never rounds to 0 (it is kept at fp16's
  smallest subnormal of its sign): a zero second moment with a nonzero first
  moment would blow up the Adam update after a restore.
- "If the non-zero count is at most 2**n - 1, the raw values are stored": when the
  kept values take at most ``2**bits - 1`` distinct values, they are the codebook,
  stored exactly in the working dtype, and the tensor decodes exactly.
- Back end: the paper packs the checkpoint with 7-Zip, LZMA2 "ultra"; we compress
  the packed codes with the stdlib ``lzma`` at preset 9 | PRESET_EXTREME (the same
  LZMA2 coder and settings), the codebook is a separate small stream.

The keep mask is an encode-time input (:meth:`KMeansQuantizeCodec.keeping`), not
part of the config: the decoder does not need it, pruned values are the zero code.

Error bound: a pruned value decodes to 0; a kept value decodes to its nearest
codebook entry (up to a rounding of the midpoint between two entries).

Streams: ``[codebook, LZMA(packed codes), zero padding]`` (see :mod:`.expansion_padding`).
"""

from __future__ import annotations

import lzma
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError, FormatError
from .base import Codec, Encoded, TensorSpec, dtype_from_name, dtype_name
from .bit_packing import MAX_BITS, pack_codes, packed_size, unpack_codes
from .expansion_padding import PADDED_MAX_EXPANSION, check_padding_stream, padding_stream
from .lossy_input import checked_float_input, require_float_spec
from .raw import tensor_bytes, tensor_from_bytes
from .registry import register_codec

__all__ = ["KMeansQuantizeCodec", "kmeans_1d"]

# Lookups use index_select / masked_select / masked_scatter_: advanced indexing (x[mask])
# costs tens of milliseconds per call on a busy multi-threaded CPU.
_FP16_SMALLEST = 2.0**-24
_LZMA_MIN_DICTIONARY = 1 << 12
_LZMA_MAX_DICTIONARY = 1 << 26  # preset 9's dictionary


def kmeans_1d(values: torch.Tensor, clusters: int, iterations: int) -> torch.Tensor:
    """Sorted centres of a 1-D k-means (Lloyd) of ``values`` (at most ``clusters`` of them).

    Initialised at evenly spaced quantiles; stops early when the centres stop moving.
    """
    ordered = values.reshape(-1).to(torch.float64).sort().values
    return _kmeans_sorted(ordered, clusters, iterations)


def _kmeans_sorted(ordered: torch.Tensor, clusters: int, iterations: int) -> torch.Tensor:
    count = ordered.numel()
    prefix = torch.cat([ordered.new_zeros(1), ordered.cumsum(0)])
    positions = ((torch.arange(clusters, dtype=torch.float64) + 0.5) * count / clusters).long()
    centres = torch.unique(ordered.index_select(0, positions.clamp(max=count - 1).to(ordered.device)))
    for _ in range(iterations):
        bounds = (centres[:-1] + centres[1:]) / 2
        cuts = torch.searchsorted(ordered, bounds)
        starts = torch.cat([cuts.new_zeros(1), cuts])
        ends = torch.cat([cuts, cuts.new_full((1,), count)])
        members = (ends - starts).to(torch.float64)
        sums = prefix.index_select(0, ends) - prefix.index_select(0, starts)
        moved = torch.where(members > 0, sums / members.clamp(min=1), centres).sort().values
        if torch.equal(moved, centres):
            break
        centres = moved
    return centres


def _fp16_codebook(centres: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp16 centres scaled by ``2**-exponent`` (largest magnitude in [0.5, 1)), never 0."""
    largest = float(centres.abs().max())
    exponent = int(torch.frexp(torch.tensor(largest, dtype=torch.float64)).exponent)
    scaled = torch.ldexp(centres, torch.tensor(-exponent, dtype=torch.float64)).to(torch.float16)
    lost = (scaled == 0) & (centres != 0)
    floor = torch.where(centres < 0, -_FP16_SMALLEST, _FP16_SMALLEST).to(torch.float16)
    return torch.where(lost, floor, scaled), exponent


def _codebook_values(codebook: torch.Tensor, exponent: int, compute: torch.dtype) -> torch.Tensor:
    return torch.ldexp(codebook.to(compute), torch.tensor(exponent, dtype=compute))


def _nearest(values: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``codebook`` for each value."""
    bounds = (codebook[:-1] + codebook[1:]) / 2
    return torch.bucketize(values, bounds)


@register_codec
class KMeansQuantizeCodec(Codec):
    """``2**bits - 1`` k-means centres plus a zero code; fp16 codebook; LZMA back end.

    Args:
        bits: code width (ExCP: 4, i.e. 15 centres + the zero code).
        iterations: at most this many Lloyd iterations.
        lzma_preset: LZMA preset level 0-9.
        lzma_extreme: add ``lzma.PRESET_EXTREME`` (slower, slightly smaller).
    """

    codec_id = "kmeans_quantize"
    lossless = False
    max_expansion = PADDED_MAX_EXPANSION

    def __init__(
        self, bits: int = 4, iterations: int = 25, lzma_preset: int = 9, lzma_extreme: bool = True
    ) -> None:
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS:
            raise ValueError(f"kmeans_quantize: bits must be an int in [1, {MAX_BITS}], got {bits!r}")
        if not isinstance(iterations, int) or isinstance(iterations, bool) or not 0 <= iterations <= 1000:
            raise ValueError(f"kmeans_quantize: iterations must be an int in [0, 1000], got {iterations!r}")
        if not isinstance(lzma_preset, int) or isinstance(lzma_preset, bool) or not 0 <= lzma_preset <= 9:
            raise ValueError(f"kmeans_quantize: lzma_preset must be an int in [0, 9], got {lzma_preset!r}")
        if not isinstance(lzma_extreme, bool):
            raise ValueError(f"kmeans_quantize: lzma_extreme must be a bool, got {lzma_extreme!r}")
        self.bits = bits
        self.iterations = iterations
        self.lzma_preset = lzma_preset
        self.lzma_extreme = lzma_extreme
        self._keep: Optional[torch.Tensor] = None

    def keeping(self, keep: Optional[torch.Tensor]) -> "KMeansQuantizeCodec":
        """A copy that stores the values where ``keep`` is False as 0 (``None``: keep all)."""
        bound = KMeansQuantizeCodec(self.bits, self.iterations, self.lzma_preset, self.lzma_extreme)
        if keep is not None and keep.dtype != torch.bool:
            raise ValueError(f"kmeans_quantize: the keep mask must be a bool tensor, got {keep.dtype}")
        bound._keep = keep
        return bound

    def _lzma(self, data: bytes) -> bytes:
        preset = self.lzma_preset | (lzma.PRESET_EXTREME if self.lzma_extreme else 0)
        # A dictionary larger than the input cannot find more matches, so it is capped at
        # the input size: the same output as the preset's 64 MiB, without allocating it.
        dictionary = min(max(len(data), _LZMA_MIN_DICTIONARY), _LZMA_MAX_DICTIONARY)
        filters = [{"id": lzma.FILTER_LZMA2, "preset": preset, "dict_size": dictionary}]
        return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_NONE, filters=filters)

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        flat = checked_float_input(tensor, self.codec_id)
        compute = flat.dtype
        kept = flat != 0
        if self._keep is not None:
            if tuple(self._keep.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"kmeans_quantize: keep mask of shape {list(self._keep.shape)} does not fit a "
                    f"tensor of shape {list(tensor.shape)}"
                )
            kept &= self._keep.reshape(-1).to(flat.device)
        values = torch.masked_select(flat, kept)
        ordered = values.sort().values
        distinct = torch.unique_consecutive(ordered)
        centres = (1 << self.bits) - 1
        if distinct.numel() <= centres:
            table, exponent, stored = distinct, 0, distinct
        else:
            clustered = _kmeans_sorted(ordered.to(torch.float64), centres, self.iterations)
            stored, exponent = _fp16_codebook(clustered)
            table = _codebook_values(stored, exponent, compute)
        codes = torch.zeros(flat.numel(), dtype=torch.int64, device=flat.device)
        if table.numel():
            codes.masked_scatter_(kept, _nearest(values, table) + 1)
        rebuilt = torch.cat([table.new_zeros(1), table]).index_select(0, codes)
        streams = [tensor_bytes(stored), self._lzma(pack_codes(codes, self.bits))]
        return Encoded(
            streams=[*streams, padding_stream(streams, TensorSpec.of(tensor).nbytes)],
            params={
                "centres": int(table.numel()),
                "codebook_dtype": dtype_name(stored.dtype),
                "scale_exponent": exponent,
            },
            reconstruction=rebuilt.reshape(tensor.shape).to(tensor.dtype),
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        compute = require_float_spec(spec, self.codec_id)
        centres = params.get("centres")
        exponent = params.get("scale_exponent")
        if not isinstance(centres, int) or isinstance(centres, bool) or not 0 <= centres < 1 << self.bits:
            raise FormatError(f"kmeans_quantize: bad centre count {centres!r} for {self.bits}-bit codes")
        if not isinstance(exponent, int) or isinstance(exponent, bool) or not -1100 <= exponent <= 1100:
            raise FormatError(f"kmeans_quantize: bad codebook scale exponent {exponent!r}")
        codebook_dtype = dtype_from_name(params.get("codebook_dtype"))
        if codebook_dtype not in (torch.float16, compute):
            raise FormatError(f"kmeans_quantize: codebook dtype {codebook_dtype} does not fit {spec.dtype}")
        if len(streams) != 3:
            raise CorruptCheckpointError(f"kmeans_quantize: expected 3 streams, got {len(streams)}")
        check_padding_stream(streams[2], self.codec_id)
        stored = tensor_from_bytes(streams[0], TensorSpec(codebook_dtype, (centres,)))
        table = _codebook_values(stored, exponent, compute)
        expected = packed_size(spec.numel, self.bits)
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        try:
            # One byte more than expected, so an over-long stream is noticed without inflating it all.
            packed = decompressor.decompress(bytes(memoryview(streams[1]).cast("B")), max_length=expected + 1)
        except lzma.LZMAError as exc:
            raise CorruptCheckpointError(f"kmeans_quantize: the LZMA stream does not decode ({exc})") from None
        if len(packed) != expected or not decompressor.eof:
            raise CorruptCheckpointError(
                f"kmeans_quantize: the LZMA stream holds the wrong amount of data for {spec.numel} codes"
            )
        codes = unpack_codes(packed, self.bits, spec.numel)
        if codes.numel() and int(codes.max()) > centres:
            raise CorruptCheckpointError("kmeans_quantize: a code points past the codebook")
        rebuilt = torch.cat([table.new_zeros(1), table]).index_select(0, codes)
        return rebuilt.reshape(spec.shape).to(spec.dtype)
