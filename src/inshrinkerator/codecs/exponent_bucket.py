"""LC-Checkpoint's quantizer: exponent + sign buckets, priority promotion, entropy-coded ids.

Every nonzero value falls in the bucket of its sign and binary exponent ``e``
(``frexp``: ``|x|`` in ``[2**(e-1), 2**e)``), so buckets are a power-of-two,
log-scale grid. Each bucket has one representative value. *Priority promotion*
keeps only the ``2**bits - 1`` buckets whose representative is largest in
magnitude; every other value (the small ones) becomes 0, the remaining code.
Codes are ``0`` (zero) and ``1 .. k`` (kept buckets, largest first).

Paper vs this code (LC-Checkpoint, ICML 2020; research/algorithms.md §2):

- Representative: the reference adaptation's comment says "average of the max and
  min of the bucket" while its code takes the mean of the members. We follow the
  paper's description by default (``representative="midrange"``) and offer the
  mean (``"mean"``, lower squared error) as a knob.
- Entropy stage: LC Huffman-codes the bucket ids. We use the project's order-0 ANS
  coder (:func:`.entropy.encode_symbols`), which codes within ~0.1% of the order-0
  entropy; Huffman needs a whole number of bits per symbol (at least 1 bit even for
  a 95% zero code), so ANS is at least as small on the same ids.
- Representatives are stored in the working precision (float32; float64 for
  float64 input), one per kept bucket.

Error bound: a kept value keeps its sign and ``|x - x_hat| <= |x| / 2`` (midrange;
``<= |x|`` for the mean); a dropped value becomes 0 and is smaller than twice any
kept value (``max |dropped| < 2 * min |kept|``).

Streams: ``[representatives (k working-dtype values), entropy-coded codes, zero
padding]`` (see :mod:`.expansion_padding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError, FormatError
from .base import Codec, Encoded, TensorSpec
from .entropy import decode_symbols, encode_symbols
from .expansion_padding import PADDED_MAX_EXPANSION, check_padding_stream, padding_stream
from .lossy_input import checked_float_input, require_float_spec
from .raw import tensor_bytes, tensor_from_bytes
from .registry import register_codec

__all__ = ["ExponentBucketCodec", "REPRESENTATIVES"]

REPRESENTATIVES = ("midrange", "mean")
MAX_BITS = 16


def _bucket_representatives(values: torch.Tensor, bucket: torch.Tensor, count: int, how: str) -> torch.Tensor:
    if how == "mean":
        sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(0, bucket, values)
        members = torch.bincount(bucket, minlength=count).to(values.dtype)
        return sums / members
    low = torch.full((count,), float("inf"), dtype=values.dtype, device=values.device)
    high = torch.full((count,), float("-inf"), dtype=values.dtype, device=values.device)
    low = low.scatter_reduce(0, bucket, values, reduce="amin")
    high = high.scatter_reduce(0, bucket, values, reduce="amax")
    return (low + high) / 2


@register_codec
class ExponentBucketCodec(Codec):
    """Exponent/sign buckets; the ``2**bits - 1`` largest are kept, the rest become 0.

    Args:
        bits: code width n; ``2**n - 1`` buckets survive priority promotion.
        representative: ``"midrange"`` ((min + max) / 2 of the bucket) or ``"mean"``.
    """

    codec_id = "exponent_bucket"
    lossless = False
    max_expansion = PADDED_MAX_EXPANSION

    def __init__(self, bits: int = 3, representative: str = "midrange") -> None:
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS:
            raise ValueError(f"exponent_bucket: bits must be an int in [1, {MAX_BITS}], got {bits!r}")
        if representative not in REPRESENTATIVES:
            raise ValueError(
                f"exponent_bucket: representative must be one of {REPRESENTATIVES}, got {representative!r}"
            )
        self.bits = bits
        self.representative = representative

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        flat = checked_float_input(tensor, self.codec_id)
        nonzero = flat != 0
        values = torch.masked_select(flat, nonzero)
        _, exponent = torch.frexp(values)
        key = exponent.to(torch.int64) * 2 + (values < 0).to(torch.int64)
        keys, bucket = torch.unique(key, return_inverse=True)
        reps = _bucket_representatives(values, bucket, keys.numel(), self.representative)
        # Largest |representative| first; a stable sort keeps ties in key order (deterministic).
        order = torch.sort(reps.abs(), descending=True, stable=True).indices
        kept = order[: (1 << self.bits) - 1]
        rank_of_bucket = torch.zeros(keys.numel(), dtype=torch.int64, device=flat.device)
        rank_of_bucket.index_copy_(0, kept, torch.arange(1, kept.numel() + 1, device=flat.device))
        codes = torch.zeros(flat.numel(), dtype=torch.int64, device=flat.device)
        codes.masked_scatter_(nonzero, rank_of_bucket.index_select(0, bucket))
        table = reps.index_select(0, kept)
        rebuilt = torch.cat([table.new_zeros(1), table]).index_select(0, codes)
        streams = [tensor_bytes(table), encode_symbols(codes, kept.numel() + 1)]
        return Encoded(
            streams=[*streams, padding_stream(streams, TensorSpec.of(tensor).nbytes)],
            params={"buckets": int(kept.numel())},
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
        buckets = params.get("buckets")
        if not isinstance(buckets, int) or isinstance(buckets, bool) or not 0 <= buckets < 1 << self.bits:
            raise FormatError(f"exponent_bucket: bad bucket count {buckets!r} for {self.bits}-bit codes")
        if len(streams) != 3:
            raise CorruptCheckpointError(f"exponent_bucket: expected 3 streams, got {len(streams)}")
        check_padding_stream(streams[2], self.codec_id)
        table = tensor_from_bytes(streams[0], TensorSpec(compute, (buckets,)))
        codes = decode_symbols(streams[1], spec.numel)
        if codes.numel() and int(codes.max()) > buckets:
            raise CorruptCheckpointError("exponent_bucket: a code points past the bucket table")
        rebuilt = torch.cat([table.new_zeros(1), table]).index_select(0, codes)
        return rebuilt.reshape(spec.shape).to(spec.dtype)
