"""Non-uniform quantization of a tensor: prune, protect, and k-means levels fitted on a sketch.

Every element gets an integer *bucket id* from a :class:`LevelTable`:

* pruned elements get the *zero level* (value exactly 0);
* protected elements get the *protect id* (``count - 1``); their values travel
  separately, in bf16 (or the tensor's own 16-bit dtype);
* the rest get the nearest *centroid*; the centroids come from weighted k-means
  over the tensor's log-histogram sketch (:mod:`.log_sketch`,
  :mod:`.weighted_kmeans`), in the linear domain, or in the log2 domain for
  positive tensors such as Adam's second moment (levels then stay positive and
  the error is relative).

The table maps every sketch key to an id: the nearest centroid of the key's
bucket centre, except that magnitudes below ``prune_below`` (a magnitude key)
map to the zero level and magnitudes above ``protect_above`` (and every
non-finite value) to the protect id. So the id of an element is one table
lookup by its key — the cheapest possible quantizer — and the decoder can
recompute the ids of a reference tensor exactly, on any device, from integer
arithmetic and comparisons only. Element masks (e.g. by sensitivity) can still
override the lookup at the encoder.

Ids are ordered like the values (the zero level sits between the negative and
positive centroids), so small moves between checkpoints are small deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from ._numpy_paths import positions_of
from .bucket_delta import id_dtype
from .log_sketch import MAGNITUDE_KEYS, SIGNED_KEYS, LogHistogram, signed_key_centres
from .passes import SLICE_ELEMENTS, slices
from .scratch import scratch
from .weighted_kmeans import (
    KMeansProblem,
    distinct_float32_levels,
    histogram_sample_weights,
    weighted_kmeans_1d_batch,
)

__all__ = [
    "LINEAR",
    "LOG",
    "DOMAINS",
    "FIRST_NON_FINITE_KEY",
    "LevelTable",
    "fit_centroids",
    "fit_centroids_batch",
    "CentroidFit",
    "make_level_table",
    "assign_ids",
    "stick_to_predicted",
    "sticky_bounds",
    "reconstruct",
    "key_centres",
]

LINEAR, LOG = "linear", "log"
DOMAINS = (LINEAR, LOG)
#: Magnitude keys from here on hold infinities and NaNs (exponent bits all ones).
FIRST_NON_FINITE_KEY = 255 << 6

#: Tensors of fewer than ``SIGNED_KEYS / DIRECT_IDS_FRACTION`` elements get their ids key by
#: key (:meth:`LevelTable.ids`) instead of from the whole key table.
DIRECT_IDS_FRACTION = 8

_CENTRES: dict[torch.device, torch.Tensor] = {}
_MAGNITUDE_CENTRES: dict[torch.device, torch.Tensor] = {}


def _magnitude_centres(device: torch.device) -> torch.Tensor:
    """Per device: the centres of the magnitude keys (ascending)."""
    centres = _MAGNITUDE_CENTRES.get(device)
    if centres is None:
        centres = _MAGNITUDE_CENTRES[device] = key_centres(device)[:MAGNITUDE_KEYS].contiguous()
    return centres


def key_centres(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The float64 bucket centre of every signed key (cached per device)."""
    centres = _CENTRES.get(device)
    if centres is None:
        centres = signed_key_centres(torch.arange(SIGNED_KEYS, device=device))
        _CENTRES[device] = centres
    return centres


@dataclass(frozen=True)
class LevelTable:
    """The reconstruction values of a quantized tensor and the key -> id map.

    Attributes:
        values: float32, sorted: the centroids with the zero level inserted at ``zero_index``;
            id ``len(values)`` is the protect id.
        zero_index: position of the zero level.
        domain: ``"linear"`` or ``"log"`` (nearest centroid by value, or by log2 of it).
        prune_below: magnitude keys below it map to the zero level (at least 1: zero itself).
        protect_above: magnitude keys above it map to the protect id (non-finite ones always).
    """

    values: torch.Tensor
    zero_index: int
    domain: str = LINEAR
    prune_below: int = 1
    protect_above: int = FIRST_NON_FINITE_KEY - 1
    #: :meth:`lookup` per device, made once (an encode looks up the tensor and its reference)
    _lookups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def count(self) -> int:
        """Number of ids: the values plus the protect id."""
        return self.values.numel() + 1

    @property
    def protect_id(self) -> int:
        return self.values.numel()

    def centroids(self) -> torch.Tensor:
        """The non-zero levels (float32)."""
        return torch.cat([self.values[: self.zero_index], self.values[self.zero_index + 1 :]])

    def boundaries(self) -> torch.Tensor:
        """Float64 decision boundaries between consecutive centroids (nearest level).

        Linear domain: arithmetic midpoints; log domain: geometric midpoints. Both are
        correctly rounded IEEE operations, so every device computes the same bits.
        (Rounding a second moment *up* was tried: it ratchets upwards restore after
        restore and slows training down; nearest levels are unbiased in log2.)
        """
        centroids = self.centroids().double()
        low, high = centroids[:-1], centroids[1:]
        if self.domain == LOG:
            return torch.sqrt(low * high)
        return (low + high) / 2

    def lookup(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """Signed key -> id (length ``SIGNED_KEYS``, :func:`id_dtype`; do not modify it)."""
        device = torch.device(device or self.values.device)
        table = self._lookups.get(device)
        if table is None:
            table = self._lookups[device] = self._make_lookup(device)
        return table

    def _make_lookup(self, device: torch.device) -> torch.Tensor:
        positive = _magnitude_centres(device)
        boundaries = self.boundaries().to(device)
        count = boundaries.numel()
        # The nearest centroid of a value x is the number of boundaries below x, and its id
        # skips the zero level: the boundary just below that level counts twice (with the
        # zero level lowest, every id starts at 1). Bucket centres are sorted by magnitude
        # key, so each half of the table is a prefix sum of where the boundaries fall.
        steps = torch.ones(count, dtype=torch.long, device=device)
        start, total = (1 if self.zero_index == 0 else 0), count
        if 1 <= self.zero_index <= count:
            steps[self.zero_index - 1] = 2
            total += 1
        rises = torch.zeros(MAGNITUDE_KEYS, dtype=torch.long, device=device)
        falls = torch.zeros(MAGNITUDE_KEYS, dtype=torch.long, device=device)
        # (a boundary above every centre falls at MAGNITUDE_KEYS: it counts for no key)
        above = torch.searchsorted(positive, boundaries, right=True)
        reach = torch.searchsorted(positive, -boundaries, right=False)
        rises.index_add_(0, above.clamp(max=MAGNITUDE_KEYS - 1), steps.masked_fill(above >= MAGNITUDE_KEYS, 0))
        falls.index_add_(0, reach.clamp(max=MAGNITUDE_KEYS - 1), steps.masked_fill(reach >= MAGNITUDE_KEYS, 0))
        table = torch.empty(SIGNED_KEYS, dtype=id_dtype(self.count), device=device)
        table[:MAGNITUDE_KEYS] = torch.cumsum(rises, 0).add_(start)
        table[MAGNITUDE_KEYS:] = torch.cumsum(falls, 0).neg_().add_(start + total)
        # Pruning, then protection, by magnitude key: ranges of each half.
        pruned = min(max(self.prune_below, 1), MAGNITUDE_KEYS)
        protected = min(self.protect_above, FIRST_NON_FINITE_KEY - 1) + 1
        for half in (0, MAGNITUDE_KEYS):
            table[half : half + pruned] = self.zero_index
            table[half + protected : half + MAGNITUDE_KEYS] = self.protect_id
        if self.domain == LOG:
            # Only positive values have a level in the log domain; negative ones are protected.
            table[MAGNITUDE_KEYS + 1 :] = self.protect_id
        return table

    def ids(self, keys: torch.Tensor) -> torch.Tensor:
        """The id of each signed key: ``lookup()[keys]``, flattened.

        Few keys (a small tensor) get their ids directly (the nearest centroid of a value is
        the number of boundaries below it, found by one search per key), which is far
        cheaper than the whole table; the two agree on every key (tested on all of them).
        """
        keys = keys.reshape(-1)
        if keys.numel() * DIRECT_IDS_FRACTION >= SIGNED_KEYS:
            return self.lookup(keys.device).index_select(0, keys)
        positive = _magnitude_centres(keys.device)
        keys = keys.long()
        magnitude = keys & (MAGNITUDE_KEYS - 1)
        negative = keys >= MAGNITUDE_KEYS
        centres = positive.index_select(0, magnitude)
        nearest = torch.searchsorted(
            self.boundaries().to(keys.device), torch.where(negative, -centres, centres), right=False
        )
        return self._ids_from_nearest(nearest, magnitude, negative)

    def _ids_from_nearest(self, nearest: torch.Tensor, magnitude: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        """Ids of keys whose values have ``nearest`` centroids (indices among the centroids),
        given their magnitude keys and signs: the zero level skipped, then pruning and
        protection by magnitude key."""
        ids = nearest + (nearest >= self.zero_index).long()
        protect = magnitude > min(self.protect_above, FIRST_NON_FINITE_KEY - 1)
        if self.domain == LOG:
            # Only positive values have a level in the log domain; negative ones are protected.
            protect |= negative & (magnitude > 0)
        ids = torch.where(magnitude < max(self.prune_below, 1), self.zero_index, ids)
        ids = torch.where(protect, self.protect_id, ids)
        return ids.to(id_dtype(self.count))

    def to(self, device: torch.device) -> "LevelTable":
        """The same table with its values on ``device``."""
        return LevelTable(self.values.to(device), self.zero_index, self.domain, self.prune_below, self.protect_above)


class CentroidFit(NamedTuple):
    """One fit of :func:`fit_centroids_batch` (the arguments of :func:`fit_centroids`)."""

    counts: torch.Tensor
    bins: int
    sigma: float = 0.2
    domain: str = LINEAR
    init: Optional[torch.Tensor] = None
    prune_below: int = 1
    protect_above: int = FIRST_NON_FINITE_KEY - 1


def fit_centroids(
    counts: torch.Tensor,
    bins: int,
    sigma: float = 0.2,
    domain: str = LINEAR,
    init: Optional[torch.Tensor] = None,
    prune_below: int = 1,
    protect_above: int = FIRST_NON_FINITE_KEY - 1,
) -> torch.Tensor:
    """At most ``bins`` sorted non-zero float32 centroids fitted to a signed-key histogram.

    Linear domain: weighted k-means on the bucket centres with
    :func:`histogram_sample_weights`; log domain: k-means on log2 of the positive bucket
    centres, each weighted ``sigma * count share + (1 - sigma) / buckets`` so that levels
    reach the sparse tails, with the top level raised to cover the largest bucket.
    ``init`` (``bins`` values) warm-starts the clustering. Only the buckets whose
    magnitude key lies in ``[prune_below, protect_above]`` take part (the ones a table
    with these thresholds gives a level), as if the others were empty.
    """
    return fit_centroids_batch([CentroidFit(counts, bins, sigma, domain, init, prune_below, protect_above)])[0]


def fit_centroids_batch(fits: Sequence[CentroidFit]) -> list[torch.Tensor]:
    """:func:`fit_centroids` of every histogram, each exactly what it returns alone; the
    k-means of all of them run side by side (one set of tensor operations, not one each)."""
    results = [torch.empty(0, dtype=torch.float32) for _ in fits]
    problems: list[KMeansProblem] = []
    fitted: list[tuple[int, Optional[torch.Tensor]]] = []  # (fit, its log domain's largest centre)
    for index, (counts, bins, sigma, domain, init, prune_below, protect_above) in enumerate(fits):
        if domain not in (LINEAR, LOG):
            raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
        # The thresholds apply to the occupied buckets only: no pass over the key space.
        occupied, centres, counts = LogHistogram(counts.cpu(), signed=True).occupied()
        magnitude = occupied & (MAGNITUDE_KEYS - 1)
        # Zero (magnitude key 0) and non-finite buckets never take part; nor, in the log
        # domain, negative ones.
        used = (magnitude >= max(prune_below, 1)) & (magnitude <= min(protect_above, FIRST_NON_FINITE_KEY - 1))
        used &= torch.isfinite(centres)
        if domain == LOG:
            used &= centres > 0
        centres, counts = centres[used], counts[used]
        if centres.numel() == 0:
            continue
        if domain == LOG:
            start = torch.log2(init.detach().cpu().double()) if init is not None and bool((init > 0).all()) else None
            # Counts alone would leave the sparse upper tail (the largest gradients) without
            # levels; the uniform part spreads levels over the whole occupied log range.
            uniform = torch.full_like(centres, 1.0 / centres.numel())
            weights = sigma * counts.double() / counts.sum() + (1.0 - sigma) * uniform
            problems.append(KMeansProblem(torch.log2(centres), weights, bins, start))
            fitted.append((index, centres.max()))
        else:
            start = init.detach().cpu().double() if init is not None else None
            problems.append(KMeansProblem(centres, histogram_sample_weights(centres, counts, sigma), bins, start))
            fitted.append((index, None))
    for (index, largest), centroids in zip(fitted, weighted_kmeans_1d_batch(problems)):
        if largest is not None:
            centroids = torch.exp2(centroids)
            # The largest values are the most active parameters: the top level reaches the
            # largest bucket, so none of them is underestimated by more than half a cell.
            centroids[-1] = torch.maximum(centroids[-1], largest)
        results[index] = distinct_float32_levels(centroids)
    return results


def make_level_table(
    centroids: torch.Tensor,
    domain: str = LINEAR,
    prune_below: int = 1,
    protect_above: int = FIRST_NON_FINITE_KEY - 1,
) -> LevelTable:
    """The table of sorted non-zero ``centroids`` (the zero level is inserted)."""
    centroids = torch.sort(centroids.detach().cpu().to(torch.float32)).values
    zero_index = int((centroids < 0).sum())
    values = torch.cat([centroids[:zero_index], torch.zeros(1, dtype=torch.float32), centroids[zero_index:]])
    return LevelTable(values, zero_index, domain, max(int(prune_below), 1), int(protect_above))


def assign_ids(
    keys: torch.Tensor,
    table: LevelTable,
    prune: Optional[torch.Tensor] = None,
    protect: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The id of every element from its signed key; element masks override (protect wins)."""
    ids = table.ids(keys)
    if prune is not None:
        ids = ids.masked_fill(prune.reshape(-1), table.zero_index)
    if protect is not None:
        ids = ids.masked_fill(protect.reshape(-1), table.protect_id)
    return ids


def sticky_bounds(table: LevelTable, stickiness: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per id, the value interval in which an element keeps that (predicted) id.

    A centroid level's interval reaches ``(1 + stickiness)`` half-cells past its own cell
    on each side (measured in log2 in the log domain). The zero level and the protect id
    get empty intervals (prune and protect decisions are never overridden).
    """
    centroids = table.centroids().double()
    count = centroids.numel()
    low = torch.full((table.count,), float("inf"), dtype=torch.float64)
    high = torch.full((table.count,), -float("inf"), dtype=torch.float64)
    if count == 0:
        return low.float(), high.float()
    position = torch.log2(centroids) if table.domain == LOG else centroids
    reach = 1.0 + stickiness
    inf = torch.tensor([float("inf")], dtype=torch.float64)
    below = torch.cat([-inf, position[:-1]])
    above = torch.cat([position[1:], inf])
    lower = position - reach * (position - below) / 2
    upper = position + reach * (above - position) / 2
    if table.domain == LOG:
        lower, upper = torch.exp2(lower), torch.exp2(upper)
    ids = torch.arange(table.count - 2)
    ids = ids + (ids >= table.zero_index).long()
    low[ids], high[ids] = lower, upper
    return low.float(), high.float()


def stick_to_predicted(
    values: torch.Tensor,
    positions: torch.Tensor,
    ids: torch.Tensor,
    predicted: torch.Tensor,
    table: LevelTable,
    stickiness: float,
) -> torch.Tensor:
    """Which of ``positions`` (where id and prediction differ) keep their predicted level.

    An element keeps a predicted centroid level while its value lies within
    ``(1 + stickiness)`` half-cells of that level's cell (:func:`sticky_bounds`), and
    its own id is a centroid too: fewer ids change between checkpoints, and the error of
    such an element stays below ``(1 + stickiness)`` times the worst nearest-level error.
    Returns a bool mask over ``positions``.
    """
    low, high = (bound.to(values.device) for bound in sticky_bounds(table, stickiness))
    level = predicted.index_select(0, positions).long()
    own = ids.index_select(0, positions).long()
    x = values.index_select(0, positions).float()
    keep = (x >= low.index_select(0, level)) & (x <= high.index_select(0, level))
    return keep & (own != table.zero_index) & (own != table.protect_id)


def reconstruct(
    ids: torch.Tensor,
    table: LevelTable,
    protected_values: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    protected_positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The dequantized tensor: level values by id, protected elements from ``protected_values``."""
    ids = ids.reshape(-1)
    values = torch.cat([table.values, torch.zeros(1, dtype=torch.float32)]).to(device=ids.device, dtype=dtype)
    if ids.dtype in (torch.int32, torch.int64):
        out = values.index_select(0, ids)
    elif ids.numel() <= SLICE_ELEMENTS:
        out = values.index_select(0, scratch("ids", ids.numel(), torch.int32, ids.device).copy_(ids))
    else:
        # Narrow ids widened a slice at a time: a whole int32 copy, a fresh block unless
        # a scratch buffer is open, took 16 ms for 8M ids, as long as the lookup itself.
        out = torch.empty(ids.numel(), dtype=dtype, device=ids.device)
        for part in slices(ids.numel()):
            torch.index_select(values, 0, ids[part].to(torch.int32), out=out[part])
    if protected_values.numel():
        if protected_positions is None:
            protected_positions = positions_of(ids, table.protect_id)
        out[protected_positions] = protected_values.to(device=out.device, dtype=dtype)
    return out.reshape(shape)
