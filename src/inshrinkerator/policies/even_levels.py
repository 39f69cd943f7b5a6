"""Evenly spaced levels around an exact zero, spaced for a given share of a tensor's energy
as the error of rounding to them, and what a tensor stored on them looks like, a matrix
perhaps as a low-rank product plus what it leaves (docs/dynaquant.md)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..codecs.dynaquant import even_level_values
from ..codecs.log_sketch import SIGNED_KEYS, magnitude_keys, signed_keys
from ..codecs.lossy_input import working_dtype
from ..codecs.low_rank import MIN_SIDE, LowRankFactors, choose_low_rank, matrix_shape

__all__ = ["MAX_EVEN_LEVELS", "change_plan", "even_levels", "even_step", "spread"]

#: The most evenly spaced levels on each side of 0 (the id coder holds 4,096 ids: these,
#: the zero level and the protect id); a value reaching further is rounded to the last.
MAX_EVEN_LEVELS = 2000


def even_levels(rms: float, largest: float, error: float) -> tuple[torch.Tensor, int]:
    """``(centroids, prune_below)``: the non-zero levels ``+-step, +-2 step, ...`` up to
    ``largest``, with ``step = rms * sqrt(12 * error)``, and the magnitude key under which
    a value rounds to 0 (below half a step).

    Rounding to levels ``step`` apart errs by ``step^2 / 12`` in the mean square, so a
    tensor of root mean square ``rms`` loses about ``error`` of its squared size wherever
    its values spread over a few steps or more. For the same error, such levels cost fewer
    coded bits than k-means levels: those have about equally many values in each cell,
    evenly spaced ones most values in the few central cells. A value keeps its sign and is
    at most doubled (one below half a step becomes 0).
    """
    if not (rms > 0.0 and math.isfinite(rms) and math.isfinite(largest)):
        return torch.tensor([-1.0, 1.0]), 1  # every value is 0: any levels do
    # A float32 step: the stream then stores the step alone, and the reader rebuilds these
    # very levels from it (codecs.dynaquant.even_level_values).
    step = even_step(rms, error)
    count = max(1, min(MAX_EVEN_LEVELS, math.floor(largest / step + 0.5)))
    levels = even_level_values(step, count)
    centroids = torch.cat([levels[:count], levels[count + 1:]])
    prune_below = max(int(magnitude_keys(torch.tensor([step / 2], dtype=torch.float32))[0]), 1)
    return centroids, prune_below


def even_step(rms: float, error: float) -> float:
    """The float32 spacing of :func:`even_levels`: ``rms * sqrt(12 * error)``."""
    return max(float(torch.tensor(rms * math.sqrt(12.0 * error), dtype=torch.float32)), torch.finfo(torch.float32).tiny)


def spread(values: torch.Tensor) -> tuple[float, float]:
    """``(rms, largest)`` of flat ``values``: the root mean square and the largest magnitude
    that :func:`even_levels` takes (0, 0 for no values)."""
    if values.numel() == 0:
        return 0.0, 0.0
    return float(torch.linalg.vector_norm(values)) / values.numel() ** 0.5, float(values.abs().max())


def change_plan(
    tensor: torch.Tensor, reference: Optional[torch.Tensor], factor_error: Optional[float] = None, margin: float = 0.05
) -> tuple[torch.Tensor, float, float, Optional[LowRankFactors]]:
    """``(histogram, rms, largest, factors)`` of ``tensor - reference`` (of ``tensor`` with
    no reference) as its codec takes it: its signed-key histogram, root mean square and
    largest magnitude. With ``factor_error`` (the share of its squared size its evenly
    spaced levels lose), a matrix may be a low-rank product (``factors``, saving at least
    ``margin`` of the estimated bits) plus what it leaves, which the histogram and the
    largest magnitude then describe; ``rms`` is always the matrix's own. The product is
    formed again when the codec encodes, rather than held for every tensor until then."""
    compute = working_dtype(tensor.dtype)
    change = tensor.detach().reshape(-1).to(compute)
    if reference is not None:
        change = change - reference.detach().to(tensor.device).reshape(-1).to(compute)
    rms, largest = spread(change)
    factors = None
    shape = matrix_shape(tensor.shape)
    if factor_error is not None and shape is not None and min(shape) >= MIN_SIDE and rms > 0 and math.isfinite(largest):
        factors = choose_low_rank(change.reshape(shape), even_step(rms, factor_error), margin)
        if factors is not None:
            # Exactly what LowRankResidualCodec leaves to its inner codec.
            change = change - factors.product(compute, change.device).reshape(-1)
            _, largest = spread(change)
    return torch.bincount(signed_keys(change), minlength=SIGNED_KEYS).cpu(), rms, largest, factors
