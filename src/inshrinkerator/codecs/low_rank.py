"""A weight's change since the reference as a low-rank product plus what it leaves:
:class:`LowRankResidualCodec` (``residual_low_rank``); a first moment so, what it
leaves coded per octave of its second moment: :class:`GroupedLowRankCodec`
(``dynaquant_grouped_low_rank``); and a tensor as the product alone, or the product plus
what it leaves coded by any codec without a reference: :class:`LowRankCodec`
(``low_rank``; an SGD momentum buffer, whose top few directions hold more of it than its
largest entries do); and a tensor as such a product times the square root of its context:
:class:`ScaledLowRankCodec` (``low_rank_scaled``; Adam's first moment as its steps
``m / sqrt(v)``, scaled back by the second moment of the same checkpoint as stored).

Between close checkpoints the change of a weight matrix is close to low rank: its
gradient steps are sums of outer products of layer inputs and output gradients, and
Adam's scaling keeps most of that structure. On the yardstick's workloads the top 16
directions of a change hold 80-97 % of its energy. Storing those directions as two small
factor matrices and rounding only what they leave to the change's levels (evenly spaced,
as for any stored change) codes the same change at the same error in fewer bits.

The factors are stored as small integers (``-15..15``) with one float32 scale per factor
matrix, entropy coded column by column (:mod:`.factor_columns`): ~3 bits an entry. Their
coarse rounding costs little, since what
the product misses is coded with the rest. The product is formed from the integers (every
partial sum is an integer below 2^24, exact in float32 in any order of summation, on any
device) and then scaled once, so the reader rebuilds the writer's reconstruction bit for
bit and a chain of such deltas carries no drift.

Stream 0 holds the factors: the two scales (float32, little-endian), then the left factor
(``rows x rank``) and the right factor (``cols x rank``) as the codec's ``factor_coding``
says: ``"columns"`` (what the codecs write), a model code per column and the columns'
ANS words (:func:`~.factor_columns.encode_factor_columns`), or ``"counts"`` (a config
without the key: files written before), one symbol stream (:func:`~.entropy.encode_symbols`,
symbol = integer + 15) of the left factor, row-major, then the right. A tensor of shape
``(d0, d1, ...)`` is the matrix ``d0 x (d1 * ...)``. The other streams are the inner
codec's, of ``change - product`` (of ``tensor - product`` for the grouped codec, whose inner
codec is a ``dynaquant_grouped`` reading the same context, and for ``low_rank``); a
``low_rank`` without an inner codec, and ``low_rank_scaled``, may end with a padding stream
of zero bytes instead (:mod:`.expansion_padding`: a product of a huge matrix is far smaller
than the matrix).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch

from ..errors import BrokenChainError, FormatError
from .base import Codec, Encoded, TensorSpec, matching_reference
from .dynaquant_context import DynaQuantGroupedCodec, _ContextKey
from .entropy import decode_symbols, encode_symbols, histogram_bits
from .expansion_padding import PADDED_MAX_EXPANSION, check_padding_stream, padding_stream
from .factor_columns import decode_factor_columns, encode_factor_columns
from .lossy_input import checked_float_input, require_float_spec, working_dtype
from .prepared import PreparedEncoding
from .registry import get_codec, register_codec
from .residual import ResidualCodec
from .xor_delta import reference_checksum

__all__ = [
    "GroupedLowRankCodec",
    "FACTOR_BITS",
    "MAX_RANK",
    "STEP_EPSILON",
    "LowRankCodec",
    "LowRankFactors",
    "LowRankResidualCodec",
    "ScaledLowRankCodec",
    "choose_low_rank",
    "low_rank_factors",
    "low_rank_within",
    "matrix_shape",
]

#: What :class:`ScaledLowRankCodec` adds to the square root of its context (Adam's default
#: ``eps``): a step ``m / (sqrt(v) + eps)`` where ``v`` is 0 stays finite.
STEP_EPSILON = 1e-8
#: The largest rank stored (factors of up to this rank multiply exactly in float32).
MAX_RANK = 64
#: Factor entries are integers in ``[-FACTOR_LEVELS, FACTOR_LEVELS]``.
FACTOR_LEVELS = 15
#: How stream 0 codes the factor entries: ``"columns"``, one model per factor column
#: (:mod:`.factor_columns`; what the codecs write), or ``"counts"``, one count table over
#: both factors (what they wrote before; a config without ``factor_coding`` means it).
FACTOR_CODINGS = ("columns", "counts")
#: What an entropy-coded factor entry costs, about, when ranks are weighed (set for one
#: count table over both factors; coded column by column an entry takes ~3 bits, but the
#: ranks, and so the reconstructions, were tuned with this figure).
FACTOR_BITS = 4.5
#: The ranks :func:`choose_low_rank` weighs.
CANDIDATE_RANKS = (1, 2, 4, 8, 16, 32)
#: Extra directions drawn by the randomized range finder, and its power iterations.
_OVERSAMPLE = 8
_POWER_ITERATIONS = 2
#: The smallest side of a matrix whose change is tried as a product.
MIN_SIDE = 16
#: About how many values :func:`choose_low_rank` checks its choice on.
_CHECK_SAMPLES = 1 << 16
#: What the factor stream adds to its entries' entropy (scales, header, count table), about.
_STREAM_BITS = 8 * 64


def matrix_shape(shape: Sequence[int]) -> Optional[tuple[int, int]]:
    """``(rows, cols)`` of the matrix a tensor of ``shape`` is factored as (its first
    dimension by the rest), or None for a tensor of fewer than two dimensions."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


@dataclass(frozen=True)
class LowRankFactors:
    """``left @ right.T * left_scale * right_scale``: the integer factors of one matrix."""

    left: torch.Tensor  # int8, rows x rank
    right: torch.Tensor  # int8, cols x rank
    left_scale: float  # float32 values
    right_scale: float

    @property
    def rank(self) -> int:
        return int(self.left.shape[1])

    def product(self, dtype: torch.dtype, device: Union[torch.device, str] = "cpu") -> torch.Tensor:
        """The ``rows x cols`` product in ``dtype`` (float32 or float64), the same bits on
        every device: the integer product is exact, then one rounding per element."""
        integers = self.left.to(device, torch.float32) @ self.right.to(device, torch.float32).T
        scale = torch.tensor(self.left_scale, dtype=torch.float32) * torch.tensor(self.right_scale, dtype=torch.float32)
        return integers.to(dtype) * scale.to(device, dtype)

    def symbols(self) -> torch.Tensor:
        """The entries of both factors as entropy-coder symbols (``0..2 * FACTOR_LEVELS``)."""
        return torch.cat([self.left.reshape(-1), self.right.reshape(-1)]).cpu().to(torch.int64) + FACTOR_LEVELS

    def to_bytes(self, coding: str = "columns") -> bytes:
        """Stream 0: the two scales, then the entries coded as ``coding`` names (one of
        :data:`FACTOR_CODINGS`)."""
        scales = np.array([self.left_scale, self.right_scale], dtype="<f4").tobytes()
        if coding == "columns":
            return scales + encode_factor_columns(self.left, self.right, FACTOR_LEVELS)
        if coding == "counts":
            return scales + encode_symbols(self.symbols(), 2 * FACTOR_LEVELS + 1)
        raise ValueError(f"factor coding must be one of {FACTOR_CODINGS}, got {coding!r}")

    @classmethod
    def from_bytes(cls, data: Any, rows: int, cols: int, rank: int, coding: str = "columns") -> "LowRankFactors":
        """Read stream 0 (written with ``coding``); :class:`FormatError` if it does not
        hold factors of this size."""
        view = memoryview(data).cast("B")
        if len(view) < 8:
            raise FormatError(f"low-rank factors: the factor stream holds {len(view)} bytes, less than its scales")
        left_scale, right_scale = (float(x) for x in np.frombuffer(view[:8], dtype="<f4"))
        if not all(math.isfinite(s) and s > 0 for s in (left_scale, right_scale)):
            raise FormatError("low-rank factors: a factor scale is not a positive finite number")
        if coding == "columns":
            left, right = decode_factor_columns(view[8:], rows, cols, rank, FACTOR_LEVELS)
            return cls(left.to(torch.int8), right.to(torch.int8), left_scale, right_scale)
        values = decode_symbols(view[8:], expected_count=rank * (rows + cols))
        if values.numel() and int(values.max()) > 2 * FACTOR_LEVELS:
            raise FormatError(f"low-rank factors: a factor entry lies outside +-{FACTOR_LEVELS}")
        values = (values - FACTOR_LEVELS).to(torch.int8)
        left = values[: rows * rank].reshape(rows, rank)
        right = values[rows * rank:].reshape(cols, rank)
        return cls(left, right, left_scale, right_scale)


def _quantized(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(int8 integers within +-FACTOR_LEVELS, float32 scale)``, ``values ~ ints * scale``."""
    largest = float(values.abs().max()) if values.numel() else 0.0
    scale = float(torch.tensor(max(largest / FACTOR_LEVELS, torch.finfo(torch.float32).tiny), dtype=torch.float32))
    ints = torch.round(values / scale).clamp_(-FACTOR_LEVELS, FACTOR_LEVELS).to(torch.int8)
    return ints, scale


def _directions(matrix: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U, S, Vh)`` of the top ``count`` directions of ``matrix`` (randomized range finder
    with power iterations; a private generator, so the caller's random state is untouched)."""
    rows, cols = matrix.shape
    width = min(count + _OVERSAMPLE, rows, cols)
    generator = torch.Generator(device=matrix.device).manual_seed(0)
    probe = torch.randn(cols, width, generator=generator, dtype=matrix.dtype, device=matrix.device)
    basis = torch.linalg.qr(matrix @ probe).Q
    for _ in range(_POWER_ITERATIONS):
        basis = torch.linalg.qr(matrix @ (matrix.T @ basis)).Q
    small_u, singular, vh = torch.linalg.svd(basis.T @ matrix, full_matrices=False)
    return (basis @ small_u)[:, :count], singular[:count], vh[:count]


def low_rank_factors(matrix: torch.Tensor, rank: int) -> LowRankFactors:
    """The integer factors of the best rank-``rank`` approximation of ``matrix`` (2-D, float)."""
    if not 1 <= rank <= min(MAX_RANK, *matrix.shape):
        raise ValueError(f"rank must lie in 1..{min(MAX_RANK, *matrix.shape)}, got {rank}")
    return _factors(*_directions(matrix.to(torch.float32), rank), rank)


def _factors(u: torch.Tensor, singular: torch.Tensor, vh: torch.Tensor, rank: int) -> LowRankFactors:
    """The integer factors of the top ``rank`` directions ``(U, S, Vh)``, the singular
    values split evenly between the two sides."""
    root = singular[:rank].sqrt()
    left, left_scale = _quantized(u[:, :rank] * root)
    right, right_scale = _quantized(vh[:rank].T * root)
    return LowRankFactors(left, right, left_scale, right_scale)


def _rounded_entropy_bits(sigma: torch.Tensor) -> torch.Tensor:
    """Bits per value of a zero-mean Gaussian of standard deviation ``sigma`` (in steps)
    rounded to integers (one entry per ``sigma``)."""
    sigma = sigma.clamp(min=1e-6).to(torch.float64)
    if float(sigma.max()) > 64:  # fine levels: the high-rate formula, h = log2(sigma sqrt(2 pi e))
        return torch.log2(sigma * math.sqrt(2 * math.pi * math.e)).clamp(min=0)
    reach = int(math.ceil(float(sigma.max()) * 8)) + 1
    edges = torch.arange(-reach, reach + 2, dtype=torch.float64) - 0.5
    cdf = torch.special.ndtr(edges[None, :] / sigma[:, None])
    p = (cdf[:, 1:] - cdf[:, :-1]).clamp(min=0)
    return -(torch.where(p > 0, p * torch.log2(p), torch.zeros_like(p))).sum(dim=1)


def choose_low_rank(matrix: torch.Tensor, step: float, margin: float = 0.05) -> Optional[LowRankFactors]:
    """The factors whose product leaves the fewest bits to code ``matrix`` (a change) with
    on levels ``step`` apart, counting the factors' own bytes; None where no rank pays.

    The ranks are weighed on the singular values (each rank's leftover energy taken as a
    Gaussian rounded to the levels); the chosen one is then checked on the real leftover
    against the change itself, by the order-0 entropy of their rounded values: the
    factors must save ``margin`` of the change's bits (the real coder codes a change a
    little below its order-0 entropy, and what a product leaves a little less so: a 32 x
    512 change, order-0 7 % smaller with a rank-1 product, took 2 % more bytes).
    """
    rows, cols = matrix.shape
    ranks = [r for r in CANDIDATE_RANKS if r <= min(rows, cols) // 4]
    if not ranks or not step > 0 or not math.isfinite(step):
        return None
    work = matrix.to(torch.float32)
    total = float(torch.dot(work.reshape(-1), work.reshape(-1)))
    if not total > 0 or not math.isfinite(total):
        return None
    u, singular, vh = _directions(work, ranks[-1])
    energy = singular.double().pow(2)
    count = rows * cols
    left_over = torch.tensor([max(total - float(energy[:r].sum()), 0.0) for r in [0, *ranks]], dtype=torch.float64)
    bits = count * _rounded_entropy_bits((left_over / count).sqrt() / step)
    bits[1:] += torch.tensor([FACTOR_BITS * r * (rows + cols) + _STREAM_BITS for r in ranks], dtype=torch.float64)
    best = int(torch.argmin(bits))
    if best == 0:
        return None
    rank = ranks[best - 1]
    factors = _factors(u, singular, vh, rank)
    # Checked on every k-th row: about _CHECK_SAMPLES values of each.
    every = max(1, rows // max(1, _CHECK_SAMPLES // cols))
    sample = work[::every]
    leftover = sample - (factors.left[::every].to(torch.float32) @ factors.right.to(torch.float32).T) * (
        factors.left_scale * factors.right_scale
    )
    scale = count / sample.numel()
    plain = scale * _order0_bits(sample / step)
    with_factors = scale * _order0_bits(leftover / step) + _order0_bits(factors.symbols().to(torch.float32)) + _STREAM_BITS
    return factors if with_factors < (1 - margin) * plain else None


def low_rank_within(matrix: torch.Tensor, allowed: float) -> Optional[LowRankFactors]:
    """The integer factors of the smallest rank of :data:`CANDIDATE_RANKS` (up to a quarter
    of the matrix's smaller side) whose product leaves at most ``allowed`` of squared
    error, the factors' rounding counted; None where no such rank does (or ``matrix`` is
    not finite)."""
    rows, cols = matrix.shape
    ranks = [r for r in CANDIDATE_RANKS if r <= min(rows, cols) // 4]
    if not ranks or not allowed > 0 or not math.isfinite(allowed):
        return None
    work = matrix.to(torch.float32)
    total = float(torch.dot(work.reshape(-1), work.reshape(-1)))
    if not math.isfinite(total):
        return None
    if total <= allowed:
        return None  # nothing a product could add: the caller stores it otherwise
    u, singular, vh = _directions(work, ranks[-1])
    energy = singular.double().pow(2)
    for rank in ranks:
        if total - float(energy[:rank].sum()) > allowed:
            continue
        factors = _factors(u, singular, vh, rank)
        leftover = (work - factors.product(torch.float32, work.device)).reshape(-1)
        if float(torch.dot(leftover, leftover)) <= allowed:
            return factors
    return None


def _order0_bits(values: torch.Tensor) -> float:
    """Order-0 entropy, in bits, of ``values`` rounded to integers (clamped to +-4096)."""
    ints = torch.round(values.reshape(-1)).clamp_(-4096, 4096).to(torch.int64) + 4096
    return histogram_bits(torch.bincount(ints, minlength=8193))


class _Factored:
    """The rank and the factors hint of a low-rank codec, and the matrix its tensors are."""

    codec_id: str
    rank: int
    factor_coding: str
    max_expansion: int
    _factors: Optional[LowRankFactors] = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        # Files written before the column coding carry no ``factor_coding``: one count table.
        return super().from_config({"factor_coding": "counts", **config})  # type: ignore[misc]

    def _check_rank(self, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"{self.codec_id}: rank must be an int in 1..{MAX_RANK}, got {rank!r}")
        return rank

    def _check_coding(self, coding: Any) -> str:
        if coding not in FACTOR_CODINGS:
            raise ValueError(f"{self.codec_id}: factor_coding must be one of {FACTOR_CODINGS}, got {coding!r}")
        return str(coding)

    def with_factors(self, factors: LowRankFactors) -> Any:
        """This codec, encoding with ``factors`` (of the tensor it will be given) instead of
        finding its own: a policy that chose the rank has them already."""
        if factors.rank != self.rank:
            raise ValueError(f"{self.codec_id}: factors of rank {factors.rank} for a rank-{self.rank} codec")
        self._factors = factors
        return self

    def _shape(self, spec: TensorSpec) -> tuple[int, int]:
        shape = matrix_shape(spec.shape)
        if shape is None or self.rank > min(shape):
            raise FormatError(f"{self.codec_id}: a rank-{self.rank} product cannot make a tensor of shape {list(spec.shape)}")
        return shape

    def _encode_shape(self, spec: TensorSpec) -> tuple[int, int]:
        try:
            return self._shape(spec)
        except FormatError as exc:
            raise ValueError(str(exc)) from None

    def _factors_of(self, matrix: torch.Tensor) -> LowRankFactors:
        """The hinted factors if they fit ``matrix``, else its own."""
        factors = self._factors
        rows, cols = matrix.shape
        if factors is None or tuple(factors.left.shape) != (rows, self.rank) or tuple(factors.right.shape) != (cols, self.rank):
            factors = low_rank_factors(matrix, self.rank)
        return factors

    def _encode_factored(
        self, matrix: torch.Tensor, shape: tuple[int, ...], compute: torch.dtype, encode_inner: Callable[[torch.Tensor], Encoded]
    ) -> tuple[LowRankFactors, Encoded, torch.Tensor]:
        """``(factors, inner, rebuilt)``: the factors of ``matrix`` (the hinted ones if they
        fit), ``encode_inner``'s encoding of what their product leaves (in ``shape``), and
        the product plus that encoding's reconstruction (``rows x cols``, ``compute``)."""
        factors = self._factors_of(matrix)
        product = factors.product(compute, matrix.device)
        leftover = (matrix - product).reshape(shape)
        inner = encode_inner(leftover)
        left = inner.reconstruction if inner.reconstruction is not None else leftover
        return factors, inner, product + left.to(compute).reshape(matrix.shape)

    def _encode_product_plus(
        self, matrix: torch.Tensor, spec: TensorSpec, dtype: torch.dtype, encode_inner: Callable[[torch.Tensor], Encoded]
    ) -> Encoded:
        """``matrix`` (a tensor of ``spec``, as ``rows x cols`` in its working dtype) stored
        as its product and ``encode_inner``'s encoding of what the product leaves: the
        factor stream, then the inner streams; the reconstruction in ``dtype``."""
        factors, inner, rebuilt = self._encode_factored(matrix, spec.shape, working_dtype(dtype), encode_inner)
        return Encoded(
            streams=[factors.to_bytes(self.factor_coding), *inner.streams],
            params={"inner": inner.params},
            reconstruction=rebuilt.reshape(spec.shape).to(dtype),
        )

    def _product_streams(self, factors: LowRankFactors, decoded_bytes: int) -> list[Any]:
        """The streams of a product stored alone: the factors, then zero padding where they
        are too small for ``max_expansion`` (:mod:`.expansion_padding`)."""
        streams: list[Any] = [factors.to_bytes(self.factor_coding)]
        padding = padding_stream(streams, decoded_bytes, self.max_expansion)
        return [*streams, padding] if padding else streams

    def _read_product(self, streams: Sequence[Any], rows: int, cols: int) -> LowRankFactors:
        """The factors of a product stored alone (:meth:`_product_streams`)."""
        if not 1 <= len(streams) <= 2:
            raise FormatError(f"{self.codec_id}: expected the factor stream and at most a padding stream, got {len(streams)} streams")
        if len(streams) == 2:
            check_padding_stream(streams[1], self.codec_id)
        return LowRankFactors.from_bytes(streams[0], rows, cols, self.rank, self.factor_coding)

    def _read_factors(self, streams: Sequence[Any], params: dict[str, Any], rows: int, cols: int) -> tuple[LowRankFactors, dict[str, Any]]:
        """``(factors, inner params)`` of stored streams; :class:`FormatError` if missing."""
        if len(streams) < 1:
            raise FormatError(f"{self.codec_id}: the factor stream is missing")
        inner_params = params.get("inner")
        if not isinstance(inner_params, dict):
            raise FormatError(f"{self.codec_id}: params lack the inner codec's params")
        return LowRankFactors.from_bytes(streams[0], rows, cols, self.rank, self.factor_coding), inner_params


@register_codec
class LowRankResidualCodec(_Factored, ResidualCodec):
    """:class:`~.residual.ResidualCodec` whose change is a rank-``rank`` product of integer
    factors plus what the product leaves, coded by ``inner``.

    Args:
        inner: the codec of what the product leaves (config or codec object; no reference).
        rank: the factors' rank, 1 to :data:`MAX_RANK`.
        factor_coding: how the factor entries are coded (:data:`FACTOR_CODINGS`).
    """

    codec_id = "residual_low_rank"

    def __init__(self, inner: Union[dict[str, Any], Codec], rank: int, factor_coding: str = "columns") -> None:
        super().__init__(inner)
        self.rank = self._check_rank(rank)
        self.factor_coding = self._check_coding(factor_coding)

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        prepared = self._take_prepared(tensor, reference)
        if prepared is not None:
            return prepared
        spec = TensorSpec.of(tensor)
        reference = matching_reference(spec, reference, "a residual")
        rows, cols = self._encode_shape(spec)
        compute = working_dtype(tensor.dtype)
        flat = checked_float_input(tensor, self.codec_id)
        base = checked_float_input(reference.to(tensor.device), self.codec_id)
        change = (flat - base).reshape(rows, cols)
        factors, inner, change_back = self._encode_factored(change, spec.shape, compute, self._inner.encode)
        rebuilt = (base.reshape(rows, cols) + change_back).reshape(spec.shape)
        return Encoded(
            streams=[factors.to_bytes(self.factor_coding), *inner.streams],
            params={"inner": inner.params, "reference_crc32": reference_checksum(reference)},
            reconstruction=rebuilt.to(tensor.dtype),
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        reference = matching_reference(spec, reference, "a residual")
        compute = require_float_spec(spec, self.codec_id)
        rows, cols = self._shape(spec)
        factors, inner_params = self._read_factors(streams, params, rows, cols)
        if params.get("reference_crc32") != reference_checksum(reference):
            raise BrokenChainError(
                "the reference tensor differs from the one this residual was taken against "
                "(checksum mismatch): load it against the same previous checkpoint or base"
            )
        left = self._inner.decode(streams[1:], inner_params, TensorSpec(compute, spec.shape))
        base = reference.detach().to("cpu", compute).reshape(rows, cols)
        product = factors.product(compute)
        return (base + (product + left.to(compute).reshape(rows, cols))).reshape(spec.shape).to(spec.dtype)


@register_codec
class GroupedLowRankCodec(_ContextKey, _Factored, PreparedEncoding, Codec):
    """A tensor (Adam's first moment, kept whole) as a rank-``rank`` product of integer
    factors plus what the product leaves, coded by ``inner`` (a :class:`DynaQuantGroupedCodec`:
    ids per octave of the *context*, the second moment of the same checkpoint).

    Args:
        inner: the ``dynaquant_grouped`` codec of what the product leaves (config or codec).
        rank: the factors' rank, 1 to :data:`MAX_RANK`.
        factor_coding: how the factor entries are coded (:data:`FACTOR_CODINGS`).
    """

    codec_id = "dynaquant_grouped_low_rank"
    lossless = False

    def __init__(self, inner: Union[dict[str, Any], Codec], rank: int, factor_coding: str = "columns") -> None:
        codec = inner if isinstance(inner, Codec) else get_codec(inner)
        if type(codec) is not DynaQuantGroupedCodec:
            raise ValueError(f"{self.codec_id}: the inner codec must be 'dynaquant_grouped', got {codec.codec_id!r}")
        self._inner: DynaQuantGroupedCodec = codec
        self.inner = codec.get_config()
        self.rank = self._check_rank(rank)
        self.factor_coding = self._check_coding(factor_coding)

    def encode(
        self,
        tensor: torch.Tensor,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> Encoded:
        prepared = self._take_prepared(tensor, None, context)
        if prepared is not None:
            return prepared
        spec = TensorSpec.of(tensor)
        rows, cols = self._encode_shape(spec)
        context = self._context(spec, context)
        matrix = checked_float_input(tensor, self.codec_id).reshape(rows, cols)
        return self._encode_product_plus(
            matrix, spec, tensor.dtype, lambda leftover: self._inner.encode(leftover, None, context=context)
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        compute = require_float_spec(spec, self.codec_id)
        rows, cols = self._shape(spec)
        context = self._context(spec, context)
        factors, inner_params = self._read_factors(streams, params, rows, cols)
        left = self._inner.decode(streams[1:], inner_params, TensorSpec(compute, spec.shape), None, context=context)
        return (factors.product(compute) + left.to(compute).reshape(rows, cols)).reshape(spec.shape).to(spec.dtype)


@register_codec
class LowRankCodec(_Factored, PreparedEncoding, Codec):
    """A tensor as a rank-``rank`` product of integer factors, plus what the product leaves
    coded by ``inner`` when there is one (a codec without a reference or a context).
    Without one, what the product leaves is dropped: the tensor is stored as its top
    ``rank`` directions alone.

    Args:
        rank: the factors' rank, 1 to :data:`MAX_RANK`.
        inner: the codec of what the product leaves (config or codec object), or None.
        factor_coding: how the factor entries are coded (:data:`FACTOR_CODINGS`).
    """

    codec_id = "low_rank"
    lossless = False
    max_expansion = PADDED_MAX_EXPANSION

    def __init__(self, rank: int, inner: Union[dict[str, Any], Codec, None] = None, factor_coding: str = "columns") -> None:
        self.rank = self._check_rank(rank)
        self._inner: Optional[Codec] = None if inner is None else inner if isinstance(inner, Codec) else get_codec(inner)
        if self._inner is not None and (self._inner.uses_reference or self._inner.uses_context):
            raise ValueError(f"{self.codec_id}: the inner codec must use neither a reference nor a context")
        self.inner = None if self._inner is None else self._inner.get_config()
        self.factor_coding = self._check_coding(factor_coding)

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        prepared = self._take_prepared(tensor, None)
        if prepared is not None:
            return prepared
        spec = TensorSpec.of(tensor)
        rows, cols = self._encode_shape(spec)
        compute = working_dtype(tensor.dtype)
        matrix = checked_float_input(tensor, self.codec_id).reshape(rows, cols)
        if self._inner is None:
            factors = self._factors_of(matrix)
            rebuilt = factors.product(compute, matrix.device)
            return Encoded(
                streams=self._product_streams(factors, spec.nbytes), params={},
                reconstruction=rebuilt.reshape(spec.shape).to(tensor.dtype),
            )
        return self._encode_product_plus(matrix, spec, tensor.dtype, self._inner.encode)

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        compute = require_float_spec(spec, self.codec_id)
        rows, cols = self._shape(spec)
        if self._inner is None:
            return self._read_product(streams, rows, cols).product(compute).reshape(spec.shape).to(spec.dtype)
        factors, inner_params = self._read_factors(streams, params, rows, cols)
        left = self._inner.decode(streams[1:], inner_params, TensorSpec(compute, spec.shape))
        return (factors.product(compute) + left.to(compute).reshape(rows, cols)).reshape(spec.shape).to(spec.dtype)


def rounded_sqrt(values: torch.Tensor) -> torch.Tensor:
    """The square roots of non-negative float32 ``values``, correctly rounded to float32:
    the same bits on every device and instruction set. (``torch.sqrt`` on the CPU may run
    through a vector math library that lands an ulp off, differently per instruction set.)

    On the CPU, NumPy's square root (the processor's own instruction, correctly rounded as
    IEEE 754 requires). Elsewhere, a first estimate in float64 is within an ulp of the
    answer, and each float32 candidate is settled by comparing ``values`` with the square
    of the midpoint to its neighbour, which float64 holds exactly (25 significant bits
    squared)."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.sqrt(values.detach().float().contiguous().numpy()))
    return settled_sqrt(values)


def settled_sqrt(values: torch.Tensor) -> torch.Tensor:
    """:func:`rounded_sqrt` by torch operations alone, on any device: a float64 estimate,
    each float32 candidate settled against the exact square of its midpoints."""
    near = values.double().sqrt().float()
    up = torch.nextafter(near, torch.full_like(near, math.inf))
    down = torch.nextafter(near, torch.zeros_like(near))
    wide, target = near.double(), values.double()
    above = (wide + up.double()) * 0.5
    below = (wide + down.double()) * 0.5
    return torch.where(above * above <= target, up, torch.where(below * below > target, down, near))


def step_scale(context: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sqrt(max(context, 0)) + STEP_EPSILON`` in ``dtype`` (float32 or float64): what a
    step is multiplied by, the same bits wherever it is computed (:func:`rounded_sqrt`;
    in float64 the context is float32 at most, and the root of its float32 form is exact
    enough to be rounded once more)."""
    root = rounded_sqrt(context.float().clamp(min=0))
    return root.to(dtype).add_(STEP_EPSILON)


@register_codec
class ScaledLowRankCodec(_ContextKey, _Factored, PreparedEncoding, Codec):
    """A tensor as a rank-``rank`` product of integer factors times ``sqrt(context) + eps``
    (:data:`STEP_EPSILON`), elementwise; the context is the reconstruction of another
    tensor of the same file. For Adam's first moment ``m`` with its second moment ``v`` as
    context, the product holds the steps ``m / sqrt(v)``: what the optimizer uses, and a
    matrix of fewer directions than ``m`` itself. A negative context value counts as 0.

    Args:
        rank: the factors' rank, 1 to :data:`MAX_RANK`.
        factor_coding: how the factor entries are coded (:data:`FACTOR_CODINGS`).
    """

    codec_id = "low_rank_scaled"
    lossless = False
    max_expansion = PADDED_MAX_EXPANSION

    def __init__(self, rank: int, factor_coding: str = "columns") -> None:
        self.rank = self._check_rank(rank)
        self.factor_coding = self._check_coding(factor_coding)

    def encode(
        self,
        tensor: torch.Tensor,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> Encoded:
        prepared = self._take_prepared(tensor, None, context)
        if prepared is not None:
            return prepared
        spec = TensorSpec.of(tensor)
        rows, cols = self._encode_shape(spec)
        compute = working_dtype(tensor.dtype)
        try:
            scale = step_scale(self._context(spec, context).to(tensor.device), compute)
        except FormatError as exc:
            raise ValueError(str(exc)) from None
        steps = (checked_float_input(tensor, self.codec_id).reshape(-1) / scale).reshape(rows, cols)
        factors = self._factors_of(steps)
        rebuilt = factors.product(compute, tensor.device).reshape(-1) * scale
        return Encoded(
            streams=self._product_streams(factors, spec.nbytes), params={},
            reconstruction=rebuilt.reshape(spec.shape).to(tensor.dtype),
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        compute = require_float_spec(spec, self.codec_id)
        rows, cols = self._shape(spec)
        scale = step_scale(self._context(spec, context).to("cpu"), compute)
        factors = self._read_product(streams, rows, cols)
        return (factors.product(compute).reshape(-1) * scale).reshape(spec.shape).to(spec.dtype)
