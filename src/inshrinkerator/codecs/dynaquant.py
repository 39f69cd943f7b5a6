"""The DynaQuant codecs: non-uniform quantization + quantization-aware delta coding of ids.

``DynaQuantCodec`` stores a float tensor as bucket ids over a small table of
levels (:mod:`.nonuniform_quantizer`), its protected elements in 16 bits, and
the ids run-length + entropy coded (:mod:`.bucket_delta`).
``DynaQuantDeltaCodec`` does the same against a reference tensor (the previous
*reconstructed* checkpoint): the ids are coded as deltas against the ids the
reference falls in under the *current* table, which the decoder recomputes from
the reference and the stored table. Nothing else of the previous checkpoint is
needed (no ids are carried), and because the reference is the reconstruction the
decoded tensor is exactly what the encoder produced: no drift along a chain. A
fingerprint of the reference is stored, so decoding against another tensor is a
:class:`~inshrinkerator.errors.BrokenChainError`, never silent garbage.
In :mod:`.dynaquant_context`, ``DynaQuantMaskedCodec`` and ``DynaQuantMaskedDeltaCodec``
code only the entries where another tensor of the same checkpoint (its context: a first
moment, for its second moment) is non-zero; the others are 0, and the mask costs nothing.
``DynaQuantGroupedCodec`` codes its ids in one stream per octave of its context (a
second moment, for its first moment): Adam's ``|m|`` follows ``sqrt(v)``, so each
octave's ids have a narrower distribution than the whole tensor's.

Without hints the codec prunes and protects by magnitude with its own fractions
and fits its own levels. A policy can pass ready thresholds, levels, element
masks (e.g. by sensitivity) and the tensor's sketch keys through
:meth:`DynaQuantCodec.with_hints`; hints only steer the encoder.

Stream layout (one stream, little-endian; ``varint`` is unsigned LEB128)::

    u8 version (3; versions 1 and 2 still decode), u8 flags (bit 0: log domain, bit 1: protected values in fp16, else bf16,
    bit 2: evenly spaced levels, bit 3: ids coded per class of rows, bit 4: shifted prediction),
    u16 values (n, incl. the zero level), u16 zero index, u16 prune below,
    u16 protect above, u32 reference fingerprint (0 for a full tensor), varint protected count,
    (bit 4: i8 key shift, not 0), f32[n] level values (bit 2: one f32 step s instead, n odd, zero index n // 2, the levels
    ``(k * s)`` for k = -(n // 2)..n // 2, each product in float64 rounded to f32: :func:`even_level_values`;
    bits 2 and 0, a log-domain table on a lattice: u8 divisions q (1..64) and i32 first k instead, zero index 0, the
    levels 0 and ``2 ** (k / q)`` for k = first..first + n - 2, each the f32 nearest it: :mod:`.log_lattice`),
    protected values (2 bytes each), id stream (the rest)

In ``dynaquant_grouped`` streams the id stream is one framed stream per octave group of
the context, ascending (:func:`~.octave_groups.octave_groups`): ``varint length`` + that
many bytes, and nothing after the last.

With flag bit 4 (a log-domain delta) the predicted ids are those of the reference's keys
shifted by the stored amount, the reference scaled by ``2 ** (shift / 64)``
(:mod:`.prediction_shift`): the writer sets it where a second moment has grown or shrunk
as a whole since its reference. Readers from before it refuse such a stream with a
``FormatError`` (an unknown flag).

Flag bits 2 and 0 together (a log-domain table on a lattice) were refused by readers from
before them with a ``FormatError``.

With flag bit 3 (a tensor of two or more dimensions coded whole, without a reference)
the id stream is the rows' classes followed by one framed stream per class
(:mod:`.row_classes`): the writer sets it where that coding is the smaller.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from ..errors import BrokenChainError, CorruptCheckpointError, FormatError
from ._numpy_paths import nonzero_positions, positions_differing, positions_of, select
from ._parallel import parallel_map_sized
from .base import Codec, Encoded, TensorSpec
from .bucket_delta import MAX_LEVELS, EntropyStats, decode_bucket_ids, encode_bucket_ids, id_dtype
from .log_lattice import MAX_DIVISIONS, find_lattice, lattice_values
from .log_sketch import MAGNITUDE_KEYS, MANTISSA_BITS, SIGNED_KEYS, signed_keys
from .nonuniform_quantizer import (
    DOMAINS,
    FIRST_NON_FINITE_KEY,
    LINEAR,
    LOG,
    CentroidFit,
    LevelTable,
    assign_ids,
    fit_centroids,
    make_level_table,
    reconstruct,
    stick_to_predicted,
)
from .octave_groups import ContextGroups
from .prediction_shift import SHIFT_MIN_ELEMENTS, best_shift, shifted_ids
from .prepared import PreparedEncoding
from .registry import register_codec
from .row_classes import (
    RowGroups,
    choose_row_classes,
    matrix_rows,
    read_row_classes,
    row_class_header,
)
from .scratch import scratch
from .small_tensor_decode import small_predicted_ids, small_reconstruction
from .varint import decode_varint, encode_varint

__all__ = [
    "LATTICE_DIVISIONS", "DynaQuantCodec", "DynaQuantDeltaCodec", "check_reference_fingerprint", "magnitude_thresholds",
    "predicted_ids", "reference_fingerprint",
]

_LAYOUT = struct.Struct("<BBHHHHI")
_VERSION = 3
# Version 1 streams (run tokens and ANS only) and version 2 (direct layout, Huffman) are
# subsets of version 3 (symbol tuples) and still decode.
_READABLE_VERSIONS = (1, 2, 3)
_LOG_FLAG, _FP16_FLAG, _EVEN_FLAG, _ROWS_FLAG, _SHIFT_FLAG = 1, 2, 4, 8, 16
_KNOWN_FLAGS = _LOG_FLAG | _FP16_FLAG | _EVEN_FLAG | _ROWS_FLAG | _SHIFT_FLAG
_SHIFT = struct.Struct("<b")
_LATTICE = struct.Struct("<Bi")
#: The divisions per octave of the log lattices a writer recognises in a table (a policy
#: that wants its levels stored as a lattice builds them with one of these).
LATTICE_DIVISIONS = (4,)

_MAX_BINS = 1024
#: Deltas of tensors up to this size are regrouped by predicted bucket (the sort pays off
#: there; above it, it would dominate the encoding time).
REARRANGE_MAX_ELEMENTS = 1 << 18
_FINGERPRINT_SAMPLES = 4096
# A group's ids are also ANS-coded (and the smaller coding kept) only up to this many: above
# it the Huffman frames' fixed cost is small, and the ANS pass would double the group's time.
_GROUP_SMALL_STREAM = 4096
_DEFAULTS = {"bins": 16, "prune": 0.0, "protect": 0.0, "sigma": 0.2, "domain": LINEAR, "stickiness": 0.0}


def even_level_values(step: float, side: int) -> torch.Tensor:
    """The level table ``-side * step, ..., -step, 0, step, ..., side * step`` in float32,
    each level rounded once from its float64 product (what a stream with evenly spaced
    levels holds: its ``step`` alone)."""
    return (torch.arange(-side, side + 1, dtype=torch.float64) * step).to(torch.float32)


def _even_step(table: LevelTable) -> Optional[float]:
    """The step of a linear table whose levels are exactly :func:`even_level_values` of
    it, else None (the table is stored value by value)."""
    values, count = table.values, table.values.numel()
    if table.domain != LINEAR or count < 3 or count % 2 == 0 or table.zero_index != count // 2:
        return None
    step = float(values[table.zero_index + 1])
    if not 0.0 < step < float("inf") or not torch.equal(even_level_values(step, count // 2), values):
        return None
    return step


def _log_lattice(table: LevelTable) -> Optional[tuple[int, int]]:
    """``(divisions, first)`` of a log-domain table whose non-zero levels are exactly a
    lattice of :data:`LATTICE_DIVISIONS` (:mod:`.log_lattice`), else None."""
    if table.domain != LOG or table.zero_index != 0 or table.values.numel() < 2:
        return None
    return find_lattice(table.values[1:], LATTICE_DIVISIONS)


def reference_fingerprint(reference: torch.Tensor) -> int:
    """CRC-32 of an evenly strided sample of the reference's bytes, plus its size (never 0)."""
    flat = reference.detach().reshape(-1)
    step = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
    sample = flat[::step].contiguous().cpu()
    crc = zlib.crc32(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"", flat.numel())
    return crc or 1


def _signed_keys(values: torch.Tensor) -> torch.Tensor:
    # log_sketch.signed_keys into a scratch buffer, the mask applied in place (the keys are
    # consumed at once by a table lookup).
    flat = values.detach().reshape(-1)
    if flat.dtype != torch.float32:
        return signed_keys(flat)
    keys = scratch("keys", flat.numel(), torch.int32, flat.device)
    torch.bitwise_right_shift(flat.contiguous().view(torch.int32), 23 - MANTISSA_BITS, out=keys)
    return keys.bitwise_and_(SIGNED_KEYS - 1)


def check_reference_fingerprint(codec_id: str, fingerprint: int, reference: torch.Tensor) -> None:
    """Raise :class:`BrokenChainError` unless ``reference`` has the stored ``fingerprint``."""
    if fingerprint != reference_fingerprint(reference):
        raise BrokenChainError(
            f"{codec_id}: the reference differs from the tensor this delta was taken against "
            "(fingerprint mismatch): decode it against the same previous checkpoint"
        )


def predicted_ids(table: LevelTable, reference: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """The id every element of ``reference`` gets under ``table`` (what a delta is coded
    against), its keys first shifted by ``shift`` (:mod:`.prediction_shift`)."""
    flat = reference.detach().reshape(-1)
    keys = _signed_keys(flat)
    return table.ids(keys) if shift == 0 else shifted_ids(table, keys, shift)


def magnitude_thresholds(counts: torch.Tensor, prune: float, protect: float) -> tuple[int, int]:
    """``(prune_below, protect_above)`` magnitude keys for fractions of a signed-key histogram.

    About ``prune`` of the elements have a magnitude key below the first and about
    ``protect`` one above the second (to the sketch's bucket accuracy).
    """
    magnitude = counts[:MAGNITUDE_KEYS] + counts[MAGNITUDE_KEYS:]
    total = int(magnitude.sum())
    cumulative = torch.cumsum(magnitude, 0)
    prune_below = 1
    protect_above = FIRST_NON_FINITE_KEY - 1
    if total and prune > 0:
        target = torch.tensor(int(prune * total + 0.5), dtype=cumulative.dtype)
        prune_below = max(1, int(torch.searchsorted(cumulative, target)))
    if total and protect > 0:
        target = torch.tensor(total - max(1, int(protect * total + 0.5)), dtype=cumulative.dtype)
        protect_above = min(int(torch.searchsorted(cumulative, target, right=True)), FIRST_NON_FINITE_KEY - 1)
    return prune_below, protect_above


def _fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a fraction in [0, 1), got {value!r}")
    return float(value)


@register_codec
class DynaQuantCodec(PreparedEncoding, Codec):
    """Lossy: prune / protect / k-means quantize; ids run-length + ANS coded.

    Args:
        bins: centroids (non-zero levels) at most, 1..1024.
        prune: fraction of smallest-magnitude elements set to exactly 0 (without hints).
        protect: fraction of largest-magnitude elements kept in 16 bits (without hints).
        sigma: count-vs-magnitude balance of the k-means sample weights (linear domain).
        domain: ``"linear"``, or ``"log"`` for positive tensors (relative error, levels > 0).
        stickiness: delta codec only: how far (in half-cells) past its bucket an element may
            drift before its id changes (0: always the nearest level).
    """

    codec_id = "dynaquant"
    lossless = False

    def __init__(
        self,
        bins: int = 16,
        prune: float = 0.0,
        protect: float = 0.0,
        sigma: float = 0.2,
        domain: str = LINEAR,
        stickiness: float = 0.0,
    ) -> None:
        if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= _MAX_BINS:
            raise ValueError(f"bins must be an int in [1, {_MAX_BINS}], got {bins!r}")
        if domain not in DOMAINS:
            raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
        if isinstance(stickiness, bool) or not isinstance(stickiness, (int, float)) or not 0 <= stickiness <= 4:
            raise ValueError(f"stickiness must be in [0, 4], got {stickiness!r}")
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma <= 1:
            raise ValueError(f"sigma must be in [0, 1], got {sigma!r}")
        self.bins = bins
        self.prune = _fraction("prune", prune)
        self.protect = _fraction("protect", protect)
        self.sigma = float(sigma)
        self.domain = domain
        self.stickiness = float(stickiness)
        self._hints: dict[str, Any] = {}
        self._fitted: Optional[LevelTable] = None

    def with_hints(
        self,
        keys: Optional[torch.Tensor] = None,
        counts: Optional[torch.Tensor] = None,
        centroids: Optional[torch.Tensor] = None,
        init: Optional[torch.Tensor] = None,
        prune_below: Optional[int] = None,
        protect_above: Optional[int] = None,
        prune_mask: Optional[torch.Tensor] = None,
        protect_mask: Optional[torch.Tensor] = None,
        stats: Optional[EntropyStats] = None,
        on_fitted: Optional[Callable[[LevelTable], None]] = None,
    ) -> "DynaQuantCodec":
        """A copy that encodes with what a policy already knows about the tensor.

        ``keys`` / ``counts``: its signed sketch keys and their histogram; ``centroids``:
        ready levels (else k-means, warm-started from ``init``); ``prune_below`` /
        ``protect_above``: magnitude-key thresholds (else the codec's fractions);
        ``prune_mask`` / ``protect_mask``: element masks on top; ``stats``: collects the
        entropy stage's figures; ``on_fitted``: called with the levels of each encode (a
        policy warm-starts the next checkpoint from them without keeping the codec). Hints
        steer the encoder only.
        """
        codec = type(self).from_config(self.get_config())
        codec._hints = {
            name: value
            for name, value in (
                ("keys", keys), ("counts", counts), ("centroids", centroids), ("init", init),
                ("prune_below", prune_below), ("protect_above", protect_above),
                ("prune_mask", prune_mask), ("protect_mask", protect_mask), ("stats", stats),
                ("on_fitted", on_fitted),
            )
            if value is not None
        }
        return codec

    def rehinted(self, **changes: Any) -> "DynaQuantCodec":
        """A copy with this codec's hints, those named in ``changes`` replaced (the names of
        :meth:`with_hints`): e.g. the same codec for what a low-rank product leaves of the
        tensor, whose histogram and reach differ."""
        return self.with_hints(**{**self._hints, **changes})

    def get_config(self) -> dict[str, Any]:
        """The options that differ from the defaults (files hold one config per tensor)."""
        config = super().get_config()
        return {k: v for k, v in config.items() if k == "id" or _DEFAULTS.get(k, object()) != v}

    @property
    def fitted_table(self) -> Optional[LevelTable]:
        """The levels of the last encode (for warm-starting the next checkpoint's k-means)."""
        return self._fitted

    # -- encoding -----------------------------------------------------------------

    def _thresholds(self, counts: torch.Tensor) -> tuple[int, int]:
        prune_below, protect_above = magnitude_thresholds(counts, self.prune, self.protect)
        return self._hints.get("prune_below", prune_below), self._hints.get("protect_above", protect_above)

    def centroid_fit(self, counts: torch.Tensor) -> CentroidFit:
        """The k-means fit an encode of a tensor with the signed-key histogram ``counts``
        runs when no ``centroids`` hint is given. A policy that fits many tensors' levels
        at once (``fit_centroids_batch``) hands the results back as ``centroids`` hints."""
        counts = counts.cpu()
        prune_below, protect_above = self._thresholds(counts)
        return CentroidFit(counts, self.bins, self.sigma, self.domain, self._hints.get("init"), prune_below, protect_above)

    def _table(self, keys: torch.Tensor) -> LevelTable:
        counts = self._hints.get("counts")
        if counts is None:
            counts = torch.bincount(keys, minlength=SIGNED_KEYS)
        counts = counts.cpu()
        centroids = self._hints.get("centroids")
        if centroids is None:
            centroids = fit_centroids(*self.centroid_fit(counts))
        return make_level_table(centroids, self.domain, *self._thresholds(counts))

    def _encode(
        self,
        tensor: torch.Tensor,
        reference: Optional[torch.Tensor],
        zeros: Optional[torch.Tensor] = None,
        groups: Optional[ContextGroups] = None,
    ) -> Encoded:
        # zeros: a flat mask of entries stored as 0 that the decoder knows (not coded);
        # groups: octave_groups of a context, whose groups' ids are coded one stream each.
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{self.codec_id} stores floating tensors only, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1)
        table, ids = self._ids(flat, zeros)
        self._fitted = table
        predicted = changed = None
        fingerprint = shift = 0
        if reference is not None:
            fingerprint = reference_fingerprint(reference)
            reference_keys = _signed_keys(reference)
            coded = None if zeros is None else ~zeros
            if table.domain == LOG and reference_keys.numel() >= SHIFT_MIN_ELEMENTS:
                shift = best_shift(table, reference_keys, ids, coded)
            predicted = table.ids(reference_keys) if shift == 0 else shifted_ids(table, reference_keys, shift)
            if zeros is None:
                changed = positions_differing(ids, predicted)
            else:
                changed = nonzero_positions((ids != predicted) & ~zeros)
            if self.stickiness > 0 and changed.numel():
                keep = stick_to_predicted(flat, changed, ids, predicted, table, self.stickiness)
                if bool(keep.any()):
                    ids[changed[keep]] = predicted[changed[keep]]
                    changed = changed[~keep]
        protected_positions, protected = _protected(flat, ids, table)
        protected_dtype = protected.dtype
        step = _even_step(table)
        lattice = _log_lattice(table)
        flags = (
            (_LOG_FLAG if table.domain == LOG else 0) | (_FP16_FLAG if protected_dtype == torch.float16 else 0)
            | (_EVEN_FLAG if step is not None or lattice is not None else 0) | (_SHIFT_FLAG if shift else 0)
        )
        coded_ids, coded_predicted = ids, predicted
        if zeros is not None:  # only the other entries are coded
            stored = ~zeros
            coded_ids = select(ids, stored)
            coded_predicted = None if predicted is None else select(predicted, stored)
            changed = None  # positions among the coded entries: the id coder finds them
        stats = self._hints.get("stats")
        if groups is not None:
            if zeros is not None or predicted is not None:
                raise ValueError(f"{self.codec_id}: octave groups code whole tensors only")
            id_stream = _encode_groups(ids, groups, table.count, stats, flat.element_size())
        else:
            # A whole tensor coded without a reference may code its ids per class of rows,
            # where that is estimated to pay; both codings are then made and the smaller kept.
            rows = matrix_rows(tuple(tensor.shape)) if coded_predicted is None and zeros is None else None
            classes = None if rows is None else choose_row_classes(coded_ids, table.count, rows)
            plain_stats = stats if classes is None or stats is None else EntropyStats()
            rearrange = coded_predicted is not None and coded_ids.numel() <= REARRANGE_MAX_ELEMENTS
            id_stream = encode_bucket_ids(
                coded_ids.cpu(), table.count, None if coded_predicted is None else coded_predicted.cpu(), rearrange,
                plain_stats, None if changed is None else changed.cpu(),
            )
            if classes is not None:
                class_stats = None if stats is None else EntropyStats()
                row_groups = RowGroups(classes, int(classes.max()) + 1, coded_ids.numel() // classes.numel())
                by_rows = row_class_header(row_groups, class_stats) + _encode_groups(
                    coded_ids, row_groups, table.count, class_stats, flat.element_size()
                )
                chosen = plain_stats
                if len(by_rows) < len(id_stream):
                    id_stream, flags, chosen = by_rows, flags | _ROWS_FLAG, class_stats
                if stats is not None and chosen is not None:
                    stats.merge(chosen)
        head = _LAYOUT.pack(
            _VERSION, flags, table.values.numel(), table.zero_index, table.prune_below,
            table.protect_above, fingerprint,
        ) + encode_varint(protected.numel()) + (_SHIFT.pack(shift) if shift else b"")
        if lattice is not None:
            values_bytes = _LATTICE.pack(*lattice)
        elif step is not None:
            values_bytes = struct.pack("<f", step)
        else:
            values_bytes = table.values.contiguous().numpy().tobytes()
        protected_bytes = protected.cpu().contiguous().view(torch.uint8).numpy().tobytes()
        rebuilt = reconstruct(ids, table, protected, tensor.dtype, tuple(tensor.shape), protected_positions)
        # The keys are a function of the tensor (recomputed if it is encoded again): a codec
        # kept after encoding does not hold the tensor's size again in int32.
        self._hints.pop("keys", None)
        on_fitted = self._hints.get("on_fitted")
        if on_fitted is not None:
            on_fitted(table)
        return Encoded(streams=[b"".join([head, values_bytes, protected_bytes, id_stream])], reconstruction=rebuilt)

    def _ids(self, flat: torch.Tensor, zeros: Optional[torch.Tensor] = None) -> tuple[LevelTable, torch.Tensor]:
        """``(table, ids)`` of flat values: the level table and each value's id (``zeros``:
        entries stored as 0 whatever their value)."""
        keys = self._hints.get("keys")
        if keys is None or keys.numel() != flat.numel():
            keys = signed_keys(flat)
        table = self._table(keys)
        if table.count > MAX_LEVELS:
            raise ValueError(f"{table.count} levels exceed the id coder's {MAX_LEVELS}")
        prune_mask = self._hints.get("prune_mask")
        if zeros is not None:
            prune_mask = zeros if prune_mask is None else prune_mask | zeros
        return table, assign_ids(keys, table, prune_mask, self._hints.get("protect_mask"))

    def rounded(self, tensor: torch.Tensor) -> torch.Tensor:
        """What :meth:`encode` of ``tensor`` with no reference would reconstruct, without
        coding its ids (a fraction of an encode's time): a policy checks a rounding's error
        before paying for its coding. The hints are kept for the encode that follows."""
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{self.codec_id} stores floating tensors only, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1)
        table, ids = self._ids(flat)
        positions, protected = _protected(flat, ids, table)
        return reconstruct(ids, table, protected, tensor.dtype, tuple(tensor.shape), positions)

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        return self._take_prepared(tensor, None) or self._encode(tensor, None)

    def encode_in_groups(self, tensor: torch.Tensor, groups: ContextGroups) -> Encoded:
        """Encode with the ids coded one stream per group of ``groups`` (of a context the
        decoder has too, for :meth:`decode_in_groups`); levels and reconstruction as
        :meth:`encode`'s."""
        return self._encode(tensor, None, groups=groups)

    def decode_in_groups(self, streams: Sequence[Any], spec: TensorSpec, groups: ContextGroups) -> torch.Tensor:
        """Inverse of :meth:`encode_in_groups`."""
        return self._decode(streams, spec, None, groups=groups)

    # -- decoding -----------------------------------------------------------------

    def _decode(
        self,
        streams: Sequence[Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor],
        zeros: Optional[torch.Tensor] = None,
        groups: Optional[ContextGroups] = None,
    ) -> torch.Tensor:
        if len(streams) != 1:
            raise CorruptCheckpointError(f"{self.codec_id}: expected 1 stream, got {len(streams)}")
        if not spec.dtype.is_floating_point:
            raise FormatError(f"{self.codec_id}: cannot decode into {spec.dtype}")
        view = memoryview(streams[0]).cast("B")
        if len(view) < _LAYOUT.size:
            raise CorruptCheckpointError(f"{self.codec_id}: stream is shorter than its header")
        version, flags, count, zero_index, prune_below, protect_above, fingerprint = _LAYOUT.unpack_from(view)
        protected_count, values_start = decode_varint(view, _LAYOUT.size)
        if version not in _READABLE_VERSIONS or flags & ~_KNOWN_FLAGS:
            raise FormatError(f"{self.codec_id}: unknown stream version {version} or flags {flags:#x}")
        shift = 0
        if flags & _SHIFT_FLAG:
            if reference is None or not flags & _LOG_FLAG or version < 3:
                raise FormatError(f"{self.codec_id}: a shifted prediction needs a log-domain delta")
            if values_start + _SHIFT.size > len(view):
                raise CorruptCheckpointError(f"{self.codec_id}: stream is shorter than its header")
            (shift,) = _SHIFT.unpack_from(view, values_start)
            values_start += _SHIFT.size
            if shift == 0:
                raise FormatError(f"{self.codec_id}: a shifted prediction's shift is 0")
        if not 1 <= count < MAX_LEVELS or zero_index >= count or protected_count > spec.numel:
            raise FormatError(f"{self.codec_id}: header ({count} levels, zero at {zero_index}) is invalid")
        if not 1 <= prune_below <= MAGNITUDE_KEYS or protect_above >= MAGNITUDE_KEYS:
            raise FormatError(f"{self.codec_id}: thresholds ({prune_below}, {protect_above}) are invalid")
        if (fingerprint != 0) != (reference is not None):
            raise FormatError(f"{self.codec_id}: stream and codec disagree on whether there is a reference")
        if reference is not None:
            check_reference_fingerprint(self.codec_id, fingerprint, reference)
        protected_dtype = torch.float16 if flags & _FP16_FLAG else torch.bfloat16
        even = bool(flags & _EVEN_FLAG)
        lattice = even and bool(flags & _LOG_FLAG)
        if lattice and (zero_index != 0 or count < 2):
            raise FormatError(f"{self.codec_id}: a log lattice needs the zero level first and a level after it")
        if even and not lattice and (count % 2 == 0 or zero_index != count // 2):
            raise FormatError(f"{self.codec_id}: evenly spaced levels need an odd count around the zero level")
        values_end = values_start + (_LATTICE.size if lattice else 4 if even else 4 * count)
        protected_end = values_end + protected_count * protected_dtype.itemsize
        if protected_end > len(view):
            raise CorruptCheckpointError(f"{self.codec_id}: stream is shorter than its header says")
        if lattice:
            divisions, first = _LATTICE.unpack_from(view, values_start)
            if not 1 <= divisions <= MAX_DIVISIONS:
                raise CorruptCheckpointError(f"{self.codec_id}: {divisions} divisions per octave: the lattice is damaged")
            try:
                levels = lattice_values(divisions, first, count - 1)
            except ValueError as error:
                raise CorruptCheckpointError(f"{self.codec_id}: {error}: the lattice is damaged") from None
            values = torch.cat([torch.zeros(1, dtype=torch.float32), levels])
        elif even:
            (step,) = struct.unpack_from("<f", view, values_start)
            if not 0.0 < step < float("inf"):
                raise CorruptCheckpointError(f"{self.codec_id}: level step {step} is damaged")
            values = even_level_values(step, count // 2)
        else:
            values = torch.frombuffer(bytearray(view[values_start:values_end]), dtype=torch.float32)
        # The table's checks in NumPy: on a few dozen values its calls cost a fraction of
        # torch's, and every decode makes them.
        levels = values.numpy()
        if not bool(np.isfinite(levels).all()) or float(levels[zero_index]) != 0.0:
            raise CorruptCheckpointError(f"{self.codec_id}: level table is damaged")
        if count > 1 and not bool((levels[1:] >= levels[:-1]).all()):
            raise CorruptCheckpointError(f"{self.codec_id}: level table is not sorted")
        table = LevelTable(values, zero_index, LOG if flags & _LOG_FLAG else LINEAR, prune_below, protect_above)
        if protected_count:
            protected = torch.frombuffer(bytearray(view[values_end:protected_end]), dtype=protected_dtype)
        else:
            protected = torch.empty(0, dtype=protected_dtype)
        predicted = None
        if reference is not None:
            predicted = small_predicted_ids(table, reference, shift)
            if predicted is None:
                predicted = predicted_ids(table, reference, shift)
        if flags & _ROWS_FLAG:
            if groups is not None or zeros is not None or reference is not None:
                raise FormatError(f"{self.codec_id}: row classes code whole tensors without a reference only")
            row_groups, classes_end = read_row_classes(view, protected_end, spec.shape, self.codec_id)
            ids = self._decode_groups(view, classes_end, table.count, spec, row_groups)
        elif groups is not None:
            ids = self._decode_groups(view, protected_end, table.count, spec, groups)
        elif zeros is None:
            ids = decode_bucket_ids(view[protected_end:], table.count, spec.numel, predicted)
        else:
            stored = ~zeros
            coded = decode_bucket_ids(
                view[protected_end:], table.count, int(stored.sum()), None if predicted is None else select(predicted, stored)
            )
            ids = torch.full((spec.numel,), table.zero_index, dtype=coded.dtype)
            ids[stored] = coded
        positions = None
        if protected_count:
            positions = positions_of(ids, table.protect_id)
            mismatch = positions.numel() != protected_count
        else:  # the protect id is the largest: a maximum is much cheaper than a comparison
            mismatch = bool(ids.numel()) and int(ids.max()) == table.protect_id
        if mismatch:
            raise CorruptCheckpointError(f"{self.codec_id}: protected ids and values disagree")
        small = small_reconstruction(ids, table, protected, spec.dtype, spec.shape, positions)
        return small if small is not None else reconstruct(ids, table, protected, spec.dtype, spec.shape, positions)

    def _decode_groups(
        self, view: memoryview, start: int, levels: int, spec: TensorSpec, groups: ContextGroups
    ) -> torch.Tensor:
        sizes = groups.sizes
        streams = []
        cursor = start
        for _ in sizes:
            length, cursor = decode_varint(view, cursor)
            if length > len(view) - cursor:
                raise CorruptCheckpointError(f"{self.codec_id}: a group's ids run past the stream's end")
            streams.append(view[cursor : cursor + length])
            cursor += length
        if cursor != len(view):
            raise CorruptCheckpointError(f"{self.codec_id}: {len(view) - cursor} bytes follow the last group")
        # Independent streams: a large tensor's groups are decoded in parallel.
        parts = parallel_map_sized(
            lambda group: decode_bucket_ids(streams[group], levels, sizes[group]),
            range(len(sizes)), [size * spec.dtype.itemsize for size in sizes],
        )
        ids = torch.empty(spec.numel, dtype=parts[0].dtype if parts else id_dtype(levels))
        return groups.scatter(torch.cat(parts), ids) if parts else ids

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._decode(streams, spec, None)


def _protected(flat: torch.Tensor, ids: torch.Tensor, table: LevelTable) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, values)`` of the protected entries of ``flat`` (id ``table.protect_id``),
    their values in float16 for a float16 tensor, else bfloat16."""
    if ids.numel() and int(ids.max()) == table.protect_id:  # the largest id: a cheap test first
        positions = positions_of(ids, table.protect_id)
    else:
        positions = torch.empty(0, dtype=torch.int64, device=ids.device)
    return positions, flat[positions].to(torch.float16 if flat.dtype == torch.float16 else torch.bfloat16)


def _encode_groups(
    ids: torch.Tensor, groups: ContextGroups, levels: int, stats: Optional[EntropyStats], element_size: int
) -> bytes:
    """The ids of each group of ``groups`` coded as one framed stream (``varint length`` +
    bytes), in group order."""
    sizes = groups.sizes
    parts = torch.split(groups.gather(ids).cpu(), sizes)
    # The groups are independent streams: a large tensor's are coded in parallel.
    coded = parallel_map_sized(
        lambda part: encode_bucket_ids(part, levels, None, False, stats, small_stream=_GROUP_SMALL_STREAM),
        parts, [size * element_size for size in sizes],
    )
    return b"".join(encode_varint(len(part)) + part for part in coded)


@register_codec
class DynaQuantDeltaCodec(DynaQuantCodec):
    """:class:`DynaQuantCodec` with ids coded against the reference tensor (closed loop)."""

    codec_id = "dynaquant_delta"
    uses_reference = True

    def _check_reference(self, spec: TensorSpec, reference: Optional[torch.Tensor]) -> torch.Tensor:
        if reference is None:
            raise BrokenChainError(f"{self.codec_id}: this tensor is a delta and its reference is missing")
        if tuple(reference.shape) != spec.shape or not reference.dtype.is_floating_point:
            raise BrokenChainError(
                f"{self.codec_id}: the reference is {reference.dtype} {list(reference.shape)}, the "
                f"delta was taken against a float tensor of shape {list(spec.shape)}"
            )
        return reference

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        reference = self._check_reference(TensorSpec.of(tensor), reference)
        return self._take_prepared(tensor, reference) or self._encode(tensor, reference)

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return self._decode(streams, spec, self._check_reference(spec, reference))
