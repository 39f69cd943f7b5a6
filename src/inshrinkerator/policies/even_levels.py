"""Evenly spaced levels around an exact zero, spaced for a given share of a tensor's energy
as the error of rounding to them, and what a tensor stored on them looks like, a matrix
perhaps as a low-rank product plus what it leaves (docs/dynaquant.md)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..codecs.dynaquant import even_level_values
from ..codecs.log_sketch import MAGNITUDE_KEYS, SIGNED_KEYS, magnitude_keys, signed_keys
from ..codecs.lossy_input import working_dtype
from ..codecs.low_rank import MIN_SIDE, LowRankFactors, choose_low_rank, matrix_shape
from ..codecs.nonuniform_quantizer import key_centres
from ..codecs.passes import key_counts, largest_magnitude, sum_of_squares
from ..codecs.weighted_kmeans import distinct_float32_levels

__all__ = [
    "MAX_EVEN_LEVELS", "change_energy", "change_plan", "even_levels", "even_step", "mean_levels", "pooled_shares",
    "spread", "step_levels",
]

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
    count = max(1, min(MAX_EVEN_LEVELS, _steps_out(largest, step)))
    levels = even_level_values(step, count)
    centroids = torch.cat([levels[:count], levels[count + 1:]])
    prune_below = max(int(magnitude_keys(torch.tensor([step / 2], dtype=torch.float32))[0]), 1)
    return centroids, prune_below


def levels_reach(rms: float, largest: float, error: float) -> bool:
    """Whether :func:`even_levels` for a tensor of root mean square ``rms`` that loses
    ``error`` of its squared size reach its ``largest`` magnitude: at most
    :data:`MAX_EVEN_LEVELS` steps out (a value further out would be rounded to the last
    level). Levels for no values (``rms`` 0) reach anything."""
    if not (rms > 0.0 and math.isfinite(rms) and math.isfinite(largest)):
        return rms == 0.0
    return _steps_out(largest, even_step(rms, error)) <= MAX_EVEN_LEVELS


def _steps_out(largest: float, step: float) -> int:
    """How many levels ``step`` apart reach ``largest`` (rounded to the nearest level)."""
    return math.floor(largest / step + 0.5)


#: The spacings :func:`mean_levels` tries, as multiples of :func:`even_step`'s: 1/16 of an
#: octave apart, from 0.71x to 5.7x.
_SPACINGS = 2.0 ** (torch.arange(-8, 41, dtype=torch.float64) / 16)
#: What a stored level costs in a stream's header (float32), and an evenly spaced table.
_LEVEL_BITS = 32
#: Fewer values than this keep evenly spaced levels (a table would cost what it saves).
_MEAN_LEVELS_MIN_VALUES = 1024


def mean_levels(
    counts: torch.Tensor, rms: float, largest: float, error: float, within_even: bool = True
) -> Optional[tuple[torch.Tensor, int]]:
    """``(centroids, prune_below)`` of levels whose cells are evenly spaced but whose values
    are the means of the values in them, for a tensor of root mean square ``rms`` with
    signed-key histogram ``counts``; None where :func:`even_levels` cost fewer bits.

    Evenly spaced levels reconstruct a cell at its middle. Where most values sit in the
    zero cell and the next few (a change that a low-rank product has mostly taken out, a
    peaked distribution) the values of a cell crowd towards zero, and its middle is far
    from most of them: the rounding loses less than the ``error`` share it is spaced for.
    Here each cell's level is the mean of its values (from the histogram), a value below
    half a step rounds to 0 as before, and the others go to the nearest level (what the
    codec does with a table of levels); the spacing is the widest of :data:`_SPACINGS`
    whose error, so computed, stays within ``error`` of the tensor's squared size. Wider
    cells leave more values in the zero cell: the same error in fewer coded bits (on the
    exact changes of the yardstick's workloads, 3-9 % fewer at the error evenly spaced
    levels actually lose, ``within_even``; 8-35 % at the one they are spaced for). The
    levels are stored one by one (4 bytes each, against one step), so they are kept only
    where the histogram's order-0 entropy says they pay for that.
    """
    total = float(counts.sum())
    if not (total >= _MEAN_LEVELS_MIN_VALUES and rms > 0.0 and math.isfinite(rms) and math.isfinite(largest)):
        return None
    step = even_step(rms, error)
    cells = int(math.floor(largest / (step * float(_SPACINGS[0])) + 0.5)) + 1
    if cells > MAX_EVEN_LEVELS:
        return None
    keys = torch.nonzero(counts).reshape(-1)
    weight = counts.index_select(0, keys).to(torch.float64)
    value = key_centres().index_select(0, keys)
    magnitude = value.abs()
    histogram = (weight, magnitude, keys, (value < 0).long(), cells)
    budget = error * total * rms * rms
    if within_even:
        # What evenly spaced levels lose: the error share they are spaced for where the
        # values spread over a few steps, less where most round to 0.
        kept = (keys & (MAGNITUDE_KEYS - 1)) >= max(int(magnitude_keys(torch.tensor([step / 2], dtype=torch.float32))[0]), 1)
        side = max(1, min(MAX_EVEN_LEVELS, math.floor(largest / step + 0.5)))
        rounded = torch.floor(magnitude / step + 0.5).clamp_(1, side) * step
        budget = min(budget, float((weight * torch.where(kept, magnitude - rounded, magnitude).pow(2)).sum()))
    # The spacings in two rounds: every fourth (the plain step among them, for the
    # comparison below), then the three between the widest within the error and the next.
    coarse = _cells_error(*histogram, step * _SPACINGS[::4])
    within = torch.nonzero(coarse[0] <= budget).reshape(-1)
    if within.numel() == 0:
        return None
    best = int(within[-1])
    finer = _cells_error(*histogram, step * _SPACINGS[4 * best + 1 : 4 * best + 4])
    squared, in_cell, means, prune = (torch.cat([a[best : best + 1], b]) for a, b in zip(coarse, finer))
    row = int(torch.nonzero(squared <= budget).reshape(-1)[-1])
    filled = in_cell[row] > 0
    filled[:2] = False
    signs = 1.0 - 2.0 * (torch.arange(filled.numel()) % 2).to(torch.float64)
    centroids = distinct_float32_levels((means[row] * signs)[filled])
    plain = coarse[1][int(torch.nonzero(_SPACINGS[::4] == 1.0)[0])]
    if _order0_bits(in_cell[row], total) + _LEVEL_BITS * centroids.numel() >= _order0_bits(plain, total) + _LEVEL_BITS:
        return None
    return centroids, int(prune[row])


def _cells_error(
    weight: torch.Tensor, magnitude: torch.Tensor, keys: torch.Tensor, negative: torch.Tensor, cells: int, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For histogram keys of ``weight`` values each (``magnitude``, signed ``keys``,
    ``negative``) and each spacing of ``steps``: ``(squared error, values per signed cell,
    mean magnitude per signed cell, prune key)``, a cell ``2 * k + negative`` (k >= 1)."""
    count = steps.numel()
    # The magnitude key under which a value rounds to 0, per spacing (as even_levels).
    prune = magnitude_keys((steps / 2).to(torch.float32)).long().clamp_(min=1)
    kept = (keys & (MAGNITUDE_KEYS - 1))[None, :] >= prune[:, None]
    cell = torch.floor(magnitude[None, :] / steps[:, None] + 0.5).clamp_(1, cells).long()
    width = 2 * cells + 2
    flat = (cell * 2 + negative[None, :] + torch.arange(count)[:, None] * width).reshape(-1)
    held = torch.where(kept, weight[None, :], torch.zeros(()))
    in_cell = torch.zeros(count * width, dtype=torch.float64).index_add_(0, flat, held.reshape(-1))
    sums = torch.zeros_like(in_cell).index_add_(0, flat, (held * magnitude[None, :]).reshape(-1))
    means = (sums / in_cell.clamp(min=1e-300)).reshape(count, width)
    in_cell = in_cell.reshape(count, width)
    # Every kept value at its nearest level (never the zero level: a kept value lies above
    # half a step, the first level above half of that). The levels in ascending order,
    # an empty cell taking its nearest filled neighbour's value (no distance changes).
    signed = torch.cat([-means[:, 3::2].flip(1), torch.zeros(count, 1, dtype=torch.float64), means[:, 2::2]], dim=1)
    filled = torch.cat([in_cell[:, 3::2].flip(1) > 0, torch.ones(count, 1, dtype=torch.bool), in_cell[:, 2::2] > 0], dim=1)
    levels = _filled(signed, filled)
    value = torch.where(negative > 0, -magnitude, magnitude)[None, :].expand(count, -1).contiguous()
    nearest = torch.searchsorted(((levels[:, 1:] + levels[:, :-1]) / 2).contiguous(), value)
    gap = value - torch.gather(levels, 1, nearest)
    squared = torch.where(kept, held * gap.pow(2), (weight * magnitude.pow(2))[None, :]).sum(dim=1)
    return squared, in_cell, means, prune


def step_levels(
    counts: torch.Tensor, rms: float, largest: float, error: float, means: bool, within_even: bool = True
) -> tuple[torch.Tensor, int]:
    """``(centroids, prune_below)`` for a tensor rounded to levels that lose about ``error``
    of its squared size: :func:`mean_levels` where asked for and they pay, else
    :func:`even_levels`."""
    chosen = mean_levels(counts, rms, largest, error, within_even) if means else None
    return chosen if chosen is not None else even_levels(rms, largest, error)


def _filled(levels: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Each row of ``levels`` (ascending where ``filled``; every row has a filled entry)
    with every unfilled entry taking the value of the filled one before it (after it, for
    those before the first)."""
    ahead = torch.where(filled, levels, torch.full_like(levels, -math.inf)).cummax(dim=1).values
    behind = torch.where(filled, levels, torch.full_like(levels, math.inf)).flip(1).cummin(dim=1).values.flip(1)
    return torch.where(torch.isfinite(ahead), ahead, behind)


def _order0_bits(in_cell: torch.Tensor, total: float) -> float:
    """Order-0 bits of ``total`` values whose kept ones lie in cells with counts ``in_cell``
    (the rest in the zero cell)."""
    counts = torch.cat([in_cell[in_cell > 0], torch.tensor([total - float(in_cell.sum())], dtype=torch.float64)])
    counts = counts[counts > 0.5]
    return float(-(counts * torch.log2(counts / counts.sum())).sum())


def even_step(rms: float, error: float) -> float:
    """The float32 spacing of :func:`even_levels`: ``rms * sqrt(12 * error)``."""
    return max(float(torch.tensor(rms * math.sqrt(12.0 * error), dtype=torch.float32)), torch.finfo(torch.float32).tiny)


def spread(values: torch.Tensor) -> tuple[float, float]:
    """``(rms, largest)`` of flat ``values``: the root mean square and the largest magnitude
    that :func:`even_levels` takes (0, 0 for no values)."""
    if values.numel() == 0:
        return 0.0, 0.0
    rms, largest = float(torch.linalg.vector_norm(values)) / values.numel() ** 0.5, largest_magnitude(values)
    if math.isfinite(largest) and not (math.isfinite(rms) and (rms > 0.0 or largest == 0.0)):
        # The squares overflowed (values beyond ~1e19) or underflowed (below ~1e-19) in
        # float32: the sum again in float64, which holds both.
        rms = float(torch.linalg.vector_norm(values, dtype=torch.float64)) / values.numel() ** 0.5
    return rms, largest


def _flat_pair(tensor: torch.Tensor, reference: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``tensor`` and ``reference`` (or None), flat, in the working dtype, on ``tensor``'s device."""
    dtype = working_dtype(tensor.dtype)
    flat = tensor.detach().reshape(-1).to(dtype)
    return flat, None if reference is None else reference.detach().to(tensor.device).reshape(-1).to(dtype)


def _flat_change(tensor: torch.Tensor, reference: Optional[torch.Tensor]) -> torch.Tensor:
    """``tensor - reference`` (``tensor`` with no reference), flat, in the working dtype."""
    flat, base = _flat_pair(tensor, reference)
    return flat if base is None else flat - base


def change_energy(tensor: torch.Tensor, reference: Optional[torch.Tensor]) -> float:
    """The summed square of ``tensor - reference`` (of ``tensor`` with no reference), as
    :func:`change_plan` takes the change (inf or nan where it is not finite). The change is
    formed a slice at a time: it is never held whole."""
    return sum_of_squares(*_flat_pair(tensor, reference))


def pooled_shares(energies: list[float], counts: list[int], error: float, limits: list[float]) -> list[float]:
    """The share of its own squared size each of several tensors loses when they are all
    rounded at one spacing that loses ``error`` of their summed squared size (``energies``:
    each one's summed square, ``counts``: its values): a tensor whose mean square is below
    the mean loses a larger share, one above it a smaller share, none more than its
    ``limits`` entry; where limits bind, the others share what is left. A tensor of no
    (or no finite) energy, or a set without any, keeps ``error``.

    At a given total squared error one spacing spends the fewest bits: a finer spacing
    costs every value about the same ``log2`` of the ratio (the equal-slope rule of bit
    allocation). With each energy weighed (by a tensor's mean Fisher diagonal), the
    shares equalize the weighted squared error per value, and the weighted error lost is
    ``error`` of the weighted total.
    """
    total = math.fsum(energies)
    if len(energies) < 2 or not (total > 0 and math.isfinite(total)):
        return [error] * len(energies)
    mean = total / sum(counts)
    # Per tensor of positive energy: the share of itself it loses at a scale of 1, its limit.
    terms = [
        (mean * count / energy, limit, energy)
        for energy, count, limit in zip(energies, counts, limits) if energy > 0
    ]

    def lost(scale: float) -> float:
        return math.fsum(min(limit, scale * share) * energy for share, limit, energy in terms)

    # The scale at which the limited shares lose ``error`` of the total: above ``error``
    # only where limits bind (without them the shares lose exactly that).
    budget, low, high = error * total, error, error
    while lost(high) < budget and high < 1e6 * error:
        low, high = high, 2 * high
    for _ in range(40):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if lost(middle) < budget else (low, middle)
    shares = iter(min(limit, low * share) for share, limit, _ in terms)
    return [next(shares) if energy > 0 else error for energy in energies]


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
    change = _flat_change(tensor, reference)
    compute = change.dtype
    rms, largest = spread(change)
    factors = None
    shape = matrix_shape(tensor.shape)
    if factor_error is not None and shape is not None and min(shape) >= MIN_SIDE and rms > 0 and math.isfinite(largest):
        factors = choose_low_rank(change.reshape(shape), even_step(rms, factor_error), margin)
        if factors is not None:
            # Exactly what LowRankResidualCodec leaves to its inner codec.
            change = change - factors.product(compute, change.device).reshape(-1)
            _, largest = spread(change)
    return key_counts(signed_keys, change, SIGNED_KEYS).cpu(), rms, largest, factors
