"""Scaled predictions for delta-coded ids: the reference's keys shifted before the lookup.

A delta codes each id against the id its reference value falls in under the current
level table. Where a whole tensor drifts by a common factor between checkpoints, many
elements cross a level boundary in the same direction, and every one of them is a
non-zero delta. Adam's second moment early in training is the usual case: it grows as
its bias correction ``1 - beta2^t`` does (about 1.25x between steps 40 and 50 with
``beta2 = 0.999``), so a tenth to a third of its ids move up one level at each save.

Multiplying the reference by ``2 ** (shift / 2 ** MANTISSA_BITS)`` before the lookup is
adding ``shift`` to the magnitude of its sketch keys (:mod:`.log_sketch`), which is exact,
cheap and the same on every machine. The writer picks the shift whose predictions give
the deltas of least order-0 entropy, from a sample of the tensor, and keeps it only where
that is estimated to save at least 1 % of the ids' bits; the decoder adds the stored shift to the reference's keys and
looks them up in the same table. The reconstruction does not depend on the shift: only
which deltas the stream carries.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._numpy_paths import select
from .log_sketch import MAGNITUDE_KEYS, MANTISSA_BITS, SIGNED_KEYS
from .nonuniform_quantizer import DIRECT_IDS_FRACTION, FIRST_NON_FINITE_KEY, LevelTable

__all__ = ["SHIFT_MIN_ELEMENTS", "best_shift", "shift_keys", "shifted_ids"]

#: Shifts tried: up to one octave either way, every key.
_SEARCH_SHIFT = 1 << MANTISSA_BITS
#: The first pass tries every this many keys.
_COARSE_STEP = 8
#: Tensors of fewer elements are not searched: their deltas are regrouped by
#: predicted bucket already, and the search would cost more than it saves.
SHIFT_MIN_ELEMENTS = 4096
#: The search reads at most this many elements, evenly strided.
_SAMPLE = 1 << 16
#: The search weighs the elements of the reference's most frequent keys only.
_KEYS_WEIGHED = 32
#: A shift is kept where its estimated ids cost at least this share less than no shift's
#: (and at least a few bytes): below it the estimate cannot tell them apart.
_MIN_GAIN = 0.01
_MIN_GAIN_BITS = 64.0


def shift_keys(keys: torch.Tensor, shift: "int | torch.Tensor") -> torch.Tensor:
    """``keys`` (signed sketch keys) of values scaled by ``2 ** (shift / 2 ** MANTISSA_BITS)``:
    each finite non-zero magnitude key moved by ``shift``, kept finite and non-zero; zeros,
    infinities and NaNs unchanged. A tensor of shifts broadcasts against ``keys``. Returns
    a new int64 tensor."""
    keys = keys.long()
    if isinstance(shift, int) and shift == 0:
        return keys.clone()
    magnitude = keys & (MAGNITUDE_KEYS - 1)
    sign = keys - magnitude
    movable = (magnitude > 0) & (magnitude < FIRST_NON_FINITE_KEY)
    moved = (magnitude + shift).clamp_(1, FIRST_NON_FINITE_KEY - 1)
    return torch.where(movable, sign + moved, keys)


def shifted_ids(table: LevelTable, keys: torch.Tensor, shift: int) -> torch.Tensor:
    """``table.ids(shift_keys(keys, shift))``; for many keys, by one lookup in the table's
    whole key -> id map shifted once, so a shifted prediction costs what a plain one does."""
    keys = keys.reshape(-1)
    if keys.numel() * DIRECT_IDS_FRACTION < SIGNED_KEYS:
        return table.ids(shift_keys(keys, shift))
    every_key = torch.arange(SIGNED_KEYS, device=keys.device)
    shifted = table.lookup(keys.device).index_select(0, shift_keys(every_key, shift))
    return shifted.index_select(0, keys)


def _order0_bits(histograms: torch.Tensor) -> torch.Tensor:
    """Order-0 cost in bits of each row of ``histograms`` (counts of symbols)."""
    counts = histograms.double()
    totals = counts.sum(dim=1, keepdim=True).clamp_min(1.0)
    logs = torch.where(counts > 0, torch.log2(counts / totals), torch.zeros_like(counts))
    return -(counts * logs).sum(dim=1)


def best_shift(
    table: LevelTable,
    reference_keys: torch.Tensor,
    ids: torch.Tensor,
    coded: Optional[torch.Tensor] = None,
) -> int:
    """The key shift of the reference that makes ``ids`` cheapest to code as deltas, or 0.

    ``reference_keys``: the signed keys of the reference, flat; ``ids``: the tensor's ids
    under ``table``, flat; ``coded``: a mask of the entries the stream codes (None: all).
    The cost is the order-0 entropy of the cyclic deltas on an evenly strided sample.
    """
    count = reference_keys.numel()
    stride = max(1, count // _SAMPLE)
    sample_keys = reference_keys.reshape(-1)[::stride].long()
    sample_ids = ids.reshape(-1)[::stride].long()
    if coded is not None:
        kept = coded.reshape(-1)[::stride]
        sample_keys, sample_ids = select(sample_keys, kept), select(sample_ids, kept)
    if sample_keys.numel() == 0:
        return 0
    levels = table.count
    # The reference is a reconstruction: its keys take few values (its levels, its protected
    # values), found by a histogram over every key rather than a sort.
    # Only the most frequent keys are weighed: the rest are protected values, a few
    # elements each.
    present = torch.bincount(sample_keys, minlength=SIGNED_KEYS)
    distinct = torch.nonzero(present).reshape(-1)
    if distinct.numel() > _KEYS_WEIGHED:
        distinct = distinct[torch.topk(present[distinct], _KEYS_WEIGHED).indices]
    index = torch.full((SIGNED_KEYS,), distinct.numel(), dtype=torch.int64)
    index[distinct] = torch.arange(distinct.numel())
    inverse = index.index_select(0, sample_keys)
    weighed = inverse < distinct.numel()
    inverse, sample_ids = select(inverse, weighed), select(sample_ids, weighed)
    joint = torch.bincount(inverse * levels + sample_ids, minlength=distinct.numel() * levels)
    joint = joint.reshape(distinct.numel(), levels)
    # Every eighth shift first, then every shift around the best of them.
    coarse = torch.arange(-_SEARCH_SHIFT, _SEARCH_SHIFT + 1, _COARSE_STEP)
    coarse_bits = _delta_bits(table, distinct, joint, coarse)
    centre = int(coarse[int(torch.argmin(coarse_bits))])
    fine = torch.arange(max(centre - _COARSE_STEP + 1, -_SEARCH_SHIFT), min(centre + _COARSE_STEP, _SEARCH_SHIFT + 1))
    fine_bits = _delta_bits(table, distinct, joint, fine)
    best = int(torch.argmin(fine_bits))
    unshifted = float(coarse_bits[_SEARCH_SHIFT // _COARSE_STEP])
    saved = (unshifted - float(fine_bits[best])) * stride
    if saved < max(_MIN_GAIN * unshifted * stride, _MIN_GAIN_BITS):
        return 0
    return int(fine[best])


def _delta_bits(table: LevelTable, keys: torch.Tensor, joint: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """The order-0 cost of the cyclic deltas under each of ``shifts``, where ``joint[k, b]``
    counts the elements whose reference has key ``keys[k]`` and whose id is ``b``."""
    levels = table.count
    predicted = table.ids(shift_keys(keys.reshape(1, -1), shifts.reshape(-1, 1))).long()
    predicted = predicted.reshape(shifts.numel(), keys.numel(), 1)
    # counts[s, k, d]: the elements of key k whose delta is d under shift s
    slots = (predicted + torch.arange(levels)) % levels
    counts = joint.unsqueeze(0).expand(shifts.numel(), -1, -1).gather(2, slots)
    return _order0_bits(counts.sum(dim=1))
