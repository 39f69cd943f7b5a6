"""Levels evenly spaced in log2: ``2 ** (k / q)`` for consecutive integers ``k``.

A log-domain level table on such a lattice is stored as ``q`` (divisions per octave) and
its first ``k`` instead of value by value. Each level is the float32 nearest its exact
value, found with integer arithmetic and scaled by an exact power of two, so every
machine rebuilds the very same bits from ``(q, first, count)`` (no ``exp2`` from a math
library, whose last bit may differ between CPUs).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

__all__ = ["MAX_DIVISIONS", "find_lattice", "lattice_range", "lattice_values", "octave_fractions"]

#: The most divisions per octave a stream may declare.
MAX_DIVISIONS = 64
# Octaves of float32 normal numbers: a lattice level is 2 ** e times a number in [1, 2).
_MIN_OCTAVE, _MAX_OCTAVE = -126, 127
_MANTISSA_BITS = 23


@functools.lru_cache(maxsize=MAX_DIVISIONS)
def octave_fractions(divisions: int) -> tuple[float, ...]:
    """The float32 nearest ``2 ** (j / divisions)`` for ``j = 0 .. divisions - 1``, as
    Python floats (each exactly a float32 in ``[1, 2)``)."""
    if not 1 <= divisions <= MAX_DIVISIONS:
        raise ValueError(f"divisions must be in [1, {MAX_DIVISIONS}], got {divisions}")
    fractions = []
    for j in range(divisions):
        # The largest mantissa m (value m / 2**23) with m**q <= 2**(j + 23 q), then m or
        # m + 1, whichever is nearer: the midpoint (2m + 1) / 2**24 lies below the exact
        # value where (2m + 1)**q < 2**(j + 24 q). 2 ** (j / q) is irrational for j > 0:
        # never a tie.
        power = j + _MANTISSA_BITS * divisions
        low, high = 1 << _MANTISSA_BITS, 1 << (_MANTISSA_BITS + 1)
        while high - low > 1:
            middle = (low + high) // 2
            if middle**divisions <= 1 << power:
                low = middle
            else:
                high = middle
        if (2 * low + 1) ** divisions < 1 << (power + divisions):
            low += 1
        fractions.append(low / (1 << _MANTISSA_BITS))
    return tuple(fractions)


def _in_range(divisions: int, first: int, count: int) -> bool:
    return (
        1 <= divisions <= MAX_DIVISIONS and count >= 1
        and first // divisions >= _MIN_OCTAVE and (first + count - 1) // divisions <= _MAX_OCTAVE
    )


def lattice_values(divisions: int, first: int, count: int) -> torch.Tensor:
    """The float32 levels ``2 ** (k / divisions)`` for ``k = first .. first + count - 1``,
    ascending. ValueError where a level would leave the float32 normal range."""
    if not _in_range(divisions, first, count):
        raise ValueError(
            f"a log lattice of {count} levels from 2**({first}/{divisions}) leaves the float32 normal range"
        )
    fractions = torch.tensor(octave_fractions(divisions), dtype=torch.float64)
    steps = torch.arange(first, first + count, dtype=torch.int64)
    octaves = torch.div(steps, divisions, rounding_mode="floor")
    # 2 ** e built from its float64 bits (no pow, whose vectorised forms may round), and a
    # float32 in [1, 2) times it: exact in float64 and, inside the normal range, in float32.
    powers = ((octaves + 1023) << 52).view(torch.float64)
    values = fractions[steps - octaves * divisions] * powers
    return values.to(torch.float32)


def lattice_range(values: torch.Tensor, divisions: int, ceiling: float = math.inf) -> Optional[tuple[int, int]]:
    """``(first, count)`` of the lattice levels reaching from the positive ``values``'
    smallest to their largest (each end the level nearest it in log2), clamped to the
    float32 normal range and to levels of at most ``ceiling`` (the largest finite value of
    the dtype the levels are restored in: float16's 65504 would otherwise round up to a
    level of 65536, restored as inf); None without a positive finite value."""
    positive = values[(values > 0) & torch.isfinite(values)]
    if positive.numel() == 0:
        return None
    low = math.log2(float(positive.min())) * divisions
    high = math.log2(float(positive.max())) * divisions
    top = _MAX_OCTAVE * divisions + divisions - 1
    if math.isfinite(ceiling):
        top = min(top, math.floor(math.log2(ceiling) * divisions))
    first = min(max(round(low), _MIN_OCTAVE * divisions), top)
    last = max(min(round(high), top), first)
    return first, last - first + 1


def find_lattice(levels: torch.Tensor, divisions_tried: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """``(divisions, first)`` where the ascending positive float32 ``levels`` are exactly
    :func:`lattice_values` of one of ``divisions_tried``, else None."""
    if levels.numel() == 0 or not bool((levels > 0).all()) or not bool(torch.isfinite(levels).all()):
        return None
    for divisions in divisions_tried:
        first = round(math.log2(float(levels[0])) * divisions)
        if _in_range(divisions, first, levels.numel()) and torch.equal(
            lattice_values(divisions, first, levels.numel()), levels.to(torch.float32)
        ):
            return divisions, first
    return None
