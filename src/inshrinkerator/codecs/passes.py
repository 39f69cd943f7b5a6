"""Reductions over large tensors, one slice at a time.

A reduction written as whole-tensor operations (``(a - b).square().sum()``) allocates a
temporary as large as its input for every step. On the CPU a fresh block of tens of MB
costs more in page faults than the arithmetic that fills it (the allocator hands such
blocks back to the system after each use): a float32 subtraction of 8M values took
~20 ms into a new tensor and ~6 ms into a reused one. These functions take slices of
:data:`SLICE_ELEMENTS`, whose temporaries the allocator keeps and reuses.

A tensor of at most one slice is reduced exactly as the whole-tensor expression would
be, bit for bit; a larger one sums its slices' results, in slice order (the same
result on every run, within rounding of the whole-tensor expression).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Optional

import torch

__all__ = ["SLICE_ELEMENTS", "slices", "squared_differences", "sum_of_squares", "largest_magnitude", "key_counts"]

#: Elements per slice: 4 MB of float32, small enough to stay below the allocator's
#: threshold for handing blocks back.
SLICE_ELEMENTS = 1 << 20


def slices(count: int) -> Iterator[slice]:
    """Consecutive slices of at most :data:`SLICE_ELEMENTS` covering ``range(count)``."""
    for start in range(0, count, SLICE_ELEMENTS):
        yield slice(start, min(start + SLICE_ELEMENTS, count))


def squared_differences(
    values: torch.Tensor, reference: Optional[torch.Tensor], weights: Optional[torch.Tensor] = None
) -> tuple[float, Optional[float]]:
    """``(sum(d * d), sum((d * w) * d))`` of ``d = values - reference`` (``values`` without
    a reference; flat, one dtype) in that dtype's dot products; the second is None without
    ``weights``."""
    plain = 0.0
    weighted = None if weights is None else 0.0
    for part in slices(values.numel()):
        difference = values[part] if reference is None else values[part] - reference[part]
        plain += float(torch.dot(difference, difference))
        if weights is not None:
            weighted += float(torch.dot(difference * weights[part], difference))  # type: ignore[operator]
    return plain, weighted


def sum_of_squares(values: torch.Tensor, reference: Optional[torch.Tensor] = None) -> float:
    """The summed squares of flat ``values`` (of ``values - reference``, both flat and of
    one dtype), accumulated in float64 (inf or nan where they are not finite)."""
    total = 0.0
    for part in slices(values.numel()):
        piece = values[part] if reference is None else values[part] - reference[part]
        total += float(torch.linalg.vector_norm(piece, dtype=torch.float64)) ** 2
    return total


def largest_magnitude(values: torch.Tensor) -> float:
    """``values.abs().max()`` of a flat non-empty tensor, from its least and largest value
    (no temporary; nan where a value is nan)."""
    least, largest = torch.aminmax(values)
    return max(-float(least), float(largest)) if not torch.isnan(least) else float("nan")


def key_counts(keys_of: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor, bins: int) -> torch.Tensor:
    """``torch.bincount(keys_of(values), minlength=bins)`` of flat ``values``, the keys of
    one slice at a time."""
    counts = torch.zeros(bins, dtype=torch.int64, device=values.device)
    for part in slices(values.numel()):
        counts += torch.bincount(keys_of(values[part]), minlength=bins)
    return counts
