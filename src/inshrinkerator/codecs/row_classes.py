"""Row classes: a matrix's bucket ids coded in one stream per class of rows.

The rows of a layer's tensors differ in kind: one output unit's Adam second moments sit
octaves above another's, and one unit's weights moved a lot since the last save while the
next barely did. An order-0 coder over the whole matrix pays for the mixture. Sorting the
rows into a few classes by their ids' statistics and coding each class as its own stream
pays for each class's narrower distribution instead, plus the class of every row (a
short side stream).

The encoder picks the classes (:func:`choose_row_classes`: rows binned by their mean id,
or by the log of their mean distance from the most frequent id, in whole, half or quarter
steps, bins merged up to :data:`~.octave_groups.GROUP_MIN_ELEMENTS` ids a class), codes
them where the order-0 estimate says they pay, and keeps them where the coded stream is
then the smaller; the decoder reads them back (:class:`RowGroups`), so any choice decodes.

A tensor of shape ``(d0, d1, ...)`` is the matrix ``d0 x (d1 * ...)``. Side stream: ``varint
classes`` (2-255), ``varint length`` + the rows' classes as a bucket-id stream
(:func:`~.bucket_delta.encode_bucket_ids`, ``classes`` levels), then one framed stream per
class in class order, as the octave groups' (``varint length`` + bytes).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import CorruptCheckpointError, FormatError
from .bucket_delta import EntropyStats, decode_bucket_ids, encode_bucket_ids
from .octave_groups import GROUP_MIN_ELEMENTS, ContextGroups
from .varint import decode_varint, encode_varint

__all__ = [
    "ROW_CLASS_MIN_ELEMENTS", "ROW_CLASS_GAIN", "ROW_CLASS_MIN_SAVING", "RowGroups", "choose_row_classes", "matrix_rows",
    "read_row_classes", "row_class_header",
]

#: Row classes are considered for matrices of at least this many ids.
ROW_CLASS_MIN_ELEMENTS = 4096
#: ...and coded so (besides whole, the smaller kept) only where their order-0 estimate,
#: every class's stream costs included, is below this share of the whole matrix's and at
#: least ``ROW_CLASS_MIN_SAVING`` bytes below it. On the yardstick's saves smaller estimated
#: gains seldom survived the coder, and the second coding costs time (several streams).
ROW_CLASS_GAIN = 0.98
ROW_CLASS_MIN_SAVING = 400
_MAX_CLASSES = 255
# Ids counted per block of rows (the keys' temporary): at most this many at once. A
# small temporary is reused by the allocator; one of 16 MB is mapped afresh each time
# (8M ids: 16 ms a matrix in blocks of 256K, 38 ms in blocks of 4M, one thread).
_HISTOGRAM_BLOCK = 1 << 18
# Estimated cost of one class's stream over the order-0 size of its ids (header, code
# table, frame), and per symbol it uses: a least-squares fit over the class streams of
# three yardstick runs gave ~80 bytes a stream and little per symbol. With 64 and 0.5
# instead of 8 and 1, the classes chosen for those runs' streams saved 1.6-24 % more.
_STREAM_BYTES, _SYMBOL_BYTES = 64.0, 0.5


def matrix_rows(shape: tuple[int, ...]) -> Optional[int]:
    """The rows of the matrix a tensor of ``shape`` is coded as (None: not a matrix)."""
    if len(shape) < 2 or shape[0] < 2 or math.prod(shape[1:]) < 1:
        return None
    return shape[0]


class RowGroups(ContextGroups):
    """The ids of a ``rows x cols`` matrix, row by row, grouped by their row's class
    (ascending; within a class, rows in order)."""

    def __init__(self, classes: torch.Tensor, count: int, cols: int) -> None:
        self.classes = classes
        self._cols = cols
        self._order = torch.argsort(classes.long(), stable=True)
        self.sizes = [size * cols for size in torch.bincount(classes.long(), minlength=count).tolist()]

    def order(self) -> torch.Tensor:
        columns = torch.arange(self._cols)
        return (self._order[:, None] * self._cols + columns).reshape(-1)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        rows = values.reshape(-1, self._cols)
        return rows.index_select(0, self._order.to(values.device)).reshape(-1)

    def scatter(self, grouped: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.reshape(-1, self._cols).index_copy_(0, self._order.to(out.device), grouped.reshape(-1, self._cols))
        return out


def _order0_bytes(histograms: torch.Tensor) -> float:
    # Estimated bytes of coding each row of ``histograms`` (counts) as its own order-0
    # stream, with its fixed and table costs.
    totals = histograms.sum(1, keepdim=True)
    probabilities = histograms / totals.clamp(min=1)
    bits = -(histograms * torch.log2(probabilities.clamp(min=1e-30))).sum()
    tables = _STREAM_BYTES * histograms.shape[0] + _SYMBOL_BYTES * float((histograms > 0).sum())
    return float(bits) / 8 + tables


def _dense_merged(keys: torch.Tensor, cols: int) -> torch.Tensor:
    """Each row's class: the distinct ``keys`` ascending, consecutive ones merged until a
    class holds at least ``GROUP_MIN_ELEMENTS`` ids (a short last class joins the one
    before)."""
    distinct, inverse = torch.unique(keys, return_inverse=True)
    counts = torch.bincount(inverse, minlength=distinct.numel()).tolist()
    mapping, current, pending = [], 0, 0
    for count in counts:
        mapping.append(current)
        pending += count * cols
        if pending >= GROUP_MIN_ELEMENTS:
            current, pending = current + 1, 0
    if pending and current > 0:
        mapping = [min(value, current - 1) for value in mapping]
    return torch.tensor(mapping, dtype=torch.long)[inverse]


def _row_histograms(matrix: torch.Tensor, levels: int) -> torch.Tensor:
    # Each row's id counts (float64, on the CPU), a block of rows at a time: the keys of a
    # block (row * levels + id) are its only temporary.
    rows, cols = matrix.shape
    block = max(1, _HISTOGRAM_BLOCK // cols)
    histograms = torch.empty(rows, levels, dtype=torch.float64)
    for start in range(0, rows, block):
        part = matrix[start : start + block]
        offsets = torch.arange(part.shape[0], dtype=torch.int32, device=matrix.device).mul_(levels)
        keys = part.to(torch.int32).add_(offsets[:, None]).reshape(-1)
        counts = torch.bincount(keys, minlength=part.shape[0] * levels)
        histograms[start : start + part.shape[0]] = counts.reshape(-1, levels).cpu().double()
    return histograms


def choose_row_classes(ids: torch.Tensor, levels: int, rows: int) -> Optional[torch.Tensor]:
    """The classes (uint8, dense from 0, one per row) to code the ``rows``-row matrix of
    ``ids`` (flat, in ``[0, levels)``) by, or None where no split is estimated to take
    ``1 - ROW_CLASS_GAIN`` and ``ROW_CLASS_MIN_SAVING`` bytes off its order-0 size.

    Six splits are weighed: rows binned by their mean id (second moments: one unit's level
    against another's) and by the log of their mean distance from the matrix's most
    frequent id (changes and first moments: a unit that moved against one that did not),
    each in whole, half and quarter steps; the one with the smallest estimate is kept.
    """
    count = ids.numel()
    if count < ROW_CLASS_MIN_ELEMENTS or rows < 2 or count % rows:
        return None
    cols = count // rows
    histograms = _row_histograms(ids.reshape(rows, cols), levels)
    whole = _order0_bytes(histograms.sum(0, keepdim=True))
    levels_axis = torch.arange(levels, dtype=torch.float64)
    mode = int(histograms.sum(0).argmax())
    mean = (histograms * levels_axis).sum(1) / cols
    spread = (histograms * (levels_axis - mode).abs()).sum(1) / cols
    best, best_bytes = None, min(ROW_CLASS_GAIN * whole, whole - ROW_CLASS_MIN_SAVING)
    log_spread = torch.log2(spread + 1 / 32)
    for key in [(key * scale).round() for key in (mean, log_spread) for scale in (1, 2, 4)]:
        classes = _dense_merged(key, cols)
        classes_count = int(classes.max()) + 1
        if not 2 <= classes_count <= _MAX_CLASSES:
            continue
        per_class = torch.zeros(classes_count, levels, dtype=torch.float64).index_add_(0, classes, histograms)
        estimate = _order0_bytes(per_class) + rows * math.log2(classes_count) / 8 + _STREAM_BYTES
        if estimate < best_bytes:
            best, best_bytes = classes, estimate
    return None if best is None else best.to(torch.uint8)


def row_class_header(groups: RowGroups, stats: Optional[EntropyStats] = None) -> bytes:
    """The side stream's head: the class count and the rows' classes."""
    count = len(groups.sizes)
    coded = encode_bucket_ids(groups.classes, count, None, False, stats)
    return encode_varint(count) + encode_varint(len(coded)) + coded


def read_row_classes(view: memoryview, start: int, shape: tuple[int, ...], codec_id: str) -> tuple[RowGroups, int]:
    """The row groups a stream's side stream at ``start`` describes, and where the class
    streams begin."""
    rows = matrix_rows(shape)
    if rows is None:
        raise FormatError(f"{codec_id}: row classes on a tensor of shape {list(shape)}, not a matrix")
    count, cursor = decode_varint(view, start)
    length, cursor = decode_varint(view, cursor)
    if not 2 <= count <= _MAX_CLASSES or length > len(view) - cursor:
        raise CorruptCheckpointError(f"{codec_id}: the row classes' header is damaged")
    classes = decode_bucket_ids(view[cursor : cursor + length], count, rows)
    groups = RowGroups(classes, count, math.prod(shape[1:]))
    if 0 in groups.sizes:
        raise CorruptCheckpointError(f"{codec_id}: a row class holds no rows")
    return groups, cursor + length
