"""DynaQuant's optimizer state: first moments and momentum buffers on symmetric levels
around zero, pruned in ExCP's spirit; second moments on log-domain levels, delta-coded,
whole or with the first moment's zeros (docs/dynaquant.md, *Optimizer state*)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from ..codecs import Codec
from ..codecs._numpy_paths import select
from ..codecs._parallel import parallel_map_sized
from ..codecs.base import Encoded
from ..codecs.bucket_delta import EntropyStats
from ..codecs.dynaquant import (
    LATTICE_DIVISIONS,
    DynaQuantCodec,
    DynaQuantDeltaCodec,
    magnitude_thresholds,
)
from ..codecs.dynaquant_context import (
    DynaQuantGroupedCodec,
    DynaQuantMaskedCodec,
    DynaQuantMaskedDeltaCodec,
)
from ..codecs.factored_moment import FactoredMomentCodec, factored_shape
from ..codecs.log_lattice import lattice_range, lattice_values
from ..codecs.log_sketch import MAGNITUDE_KEYS, SIGNED_KEYS, magnitude_keys, signed_keys
from ..codecs.lossy_input import all_finite
from ..codecs.low_rank import (
    FACTOR_BITS,
    MIN_SIDE,
    GroupedLowRankCodec,
    LowRankCodec,
    ScaledLowRankCodec,
    low_rank_within,
    matrix_shape,
    step_scale,
)
from ..codecs.nonuniform_quantizer import FIRST_NON_FINITE_KEY, LOG, LevelTable, fit_centroids_batch
from ..codecs.passes import key_counts
from ..tree import TensorLeaf, format_key_path
from .base import encoded_size, leaf_nbytes, usable_reference
from .even_levels import change_plan, even_levels, levels_reach, spread
from .first_moment_levels import zero_level_hints_batch
from .lossless import Lossless
from .quantization_trials import quantile_key
from .state_layout import StateLayout, TensorRole

if TYPE_CHECKING:
    from .dynaquant import _Memory

__all__ = ["RESTART_STEP_GROWTH", "MomentPlanning", "restart_step_growth"]

#: The joint moment mask is used where a restart grows Adam's steps at most this much
#: (:func:`restart_step_growth`): the first moment's levels never more than double an
#: entry either.
RESTART_STEP_GROWTH = 2.0
_RESTART_HORIZON = 10_000
_FIRST_ORDER = (TensorRole.FIRST_MOMENT, TensorRole.MOMENTUM_BUFFER)
#: Non-negative optimizer statistics, coded in the log domain.
_POSITIVE = (TensorRole.SECOND_MOMENT, TensorRole.ACCUMULATOR)
MOMENT_ROLES = _FIRST_ORDER + _POSITIVE
#: Fraction of each second moment (its largest entries) kept in 16 bits.
SECOND_MOMENT_PROTECT = 0.005
#: The share of a whole first moment's estimated bits a low-rank product must save.
FIRST_MOMENT_LOW_RANK_MARGIN = 0.15
#: About what a pruned momentum buffer's kept entry costs beyond the mask (its level id),
#: in bits: a product is stored where its factors (``FACTOR_BITS`` an entry) are estimated
#: to take fewer bits than the pruned buffer.
_KEPT_ENTRY_BITS = 2.0
#: The same for an Adam first moment's kept entry (``moment_bins`` = 8 levels).
_KEPT_FIRST_MOMENT_BITS = 3.0
#: The largest step ``|m| / (sqrt(v) + eps)`` a first moment stored as a product of its
#: steps may have. Adam's own keep below ``(1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))``
#: (7.3 for the default betas, by Cauchy-Schwarz over the gradients' history); far larger
#: ones mean a second moment that underflowed (fp16) or was damaged, whose outsized steps
#: would take over the product and, scaled back, spread errors of thousands of times the
#: moment over the rest of it.
MAX_PRODUCT_STEP = 1e3
#: Level-count factor of the moments of tensors under ``min_numel`` (biases, norm layers).
SMALL_MOMENT_LEVEL_FACTOR = 2
#: The share of its squared size an Adam first moment under ``min_numel`` loses on its
#: evenly spaced levels (at most ``first_moment_error``). Its level table would be a third
#: of its bytes; one stored step replaces it. On the small first moments of the digits
#: CNN's and the char GPT's seed-0 runs, 0.002 stores 21-24 % fewer bytes than 16 k-means
#: levels, which lost 0.6-0.7 % (docs/dynaquant-measurements.md, *Small first moments on
#: evenly spaced levels*). Momentum buffers keep their k-means levels: so spaced, the
#: digits SGD run grew.
SMALL_MOMENT_ERROR = 0.002
#: The most levels a moment may have (the knobs' bound, and the factor's cap).
MAX_MOMENT_BINS = 1024
#: A second moment (or accumulator) under ``min_numel`` is rounded to the levels
#: ``2 ** (k / 4)``: within 11 % of each value (5.3 % of its square root; an eighth of an
#: octave plus the width of a sketch key), its table stored as two numbers. On the char
#: GPT's 34 small second moments (seed 0, step 360, whole and
#: against step 320) that stored 23-29 % fewer bytes than 16 k-means levels in log2 (whose
#: table was 68 bytes a tensor) at about half their error in log2 of ``sqrt(v)``
#: (``benchmarks/small_tensors.py``; docs/dynaquant-measurements.md, *Small tensors at
#: full checkpoints and on a log lattice*).
SMALL_MOMENT_DIVISIONS = LATTICE_DIVISIONS[0]
#: A lattice of more levels than this (a moment spread over more than 256 octaves)
#: keeps k-means levels.
MAX_LATTICE_LEVELS = MAX_MOMENT_BINS
#: The grouped first moment is only encoded where it could make the whole second moment's
#: pair the smaller one: the joint encoding's lead is under this share of the first
#: moment's plain bytes.
REGROUP_MARGIN = 0.5


class MomentPlanning:
    """How :class:`~.dynaquant.DynaQuant` plans the optimizer's moments: their levels,
    pruning, joint masks and octave groups. A base of ``DynaQuant``: it reads the policy's
    knobs and ``_memory``."""

    # The knobs and memory of DynaQuant's that this reads.
    sigma: float
    stickiness: float
    moment_bins: int
    first_moment_error: Optional[float]
    low_rank_first_moments: bool
    low_rank_momentum: bool
    low_rank_steps: bool
    momentum_bins: int
    second_moment_bins: int
    second_moment: str
    joint_moment_mask: bool
    first_moment_octaves: bool
    min_numel: int
    _memory: _Memory

    def _plan_moments(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        eligible: list[bool],
        codecs: list[Codec],
        first_keep: float,
        momentum_keep: float,
        betas: dict[int, Any],
    ) -> dict[int, "_SecondMomentChoice"]:
        """Plan every moment's codec into ``codecs``; returns the second moments that may be
        stored either whole or with their first moment's mask (``joint_moment_mask``), with
        their first moments: the smaller pair is kept once all are encoded."""
        # Each moment is sketched (every element read) on its own, the large ones shared out
        # between threads (parallel_map_sized). Their levels are then fitted all at once (a
        # moment's histogram is a few thousand buckets: one k-means each would cost mostly
        # per-operation overhead), and codecs and warm-start bookkeeping are assigned in leaf
        # order. A statistic named as a non-negative one that holds a negative value (or NaN)
        # is not what its name says (another optimizer's entry of the same name): it stays
        # exact.
        items = [
            (index, role) for index, role in enumerate(layout.roles)
            if eligible[index] and (
                role in _FIRST_ORDER or (role in _POSITIVE and float(leaves[index].tensor.min()) >= 0)
            )
        ]
        joint_masks = self._joint_masks(leaves, layout, items, first_keep, betas)
        # A pruned moment stored as a low-rank product instead is neither sketched nor fitted.
        products: dict[int, Codec] = {}
        if self.low_rank_steps:
            products.update(self._step_products(leaves, layout, items, first_keep, set(joint_masks)))
        if self.low_rank_momentum:
            products.update(self._momentum_products(leaves, items, momentum_keep))
        items = [item for item in items if item[0] not in products]
        sketched = parallel_map_sized(
            lambda item: self._sketch_moment(
                leaves, references, layout, *item, first_keep, momentum_keep, joint_masks.get(item[0])
            ),
            items, [leaf_nbytes(leaves[index]) for index, _ in items],
        )
        plans = [
            plan for entry in sketched
            for plan in (entry if isinstance(entry, tuple) else (entry,)) if isinstance(plan, _MomentPlan)
        ]
        zero_levels = [plan for plan in plans if plan.zero_levels is not None]
        for plan, extra in zip(zero_levels, zero_level_hints_batch([p.zero_levels for p in zero_levels], self.sigma)):
            plan.hints.update(extra)
        fitting = [plan for plan in plans if "centroids" not in plan.hints]
        fits = [plan.codec.with_hints(**plan.hints).centroid_fit(plan.hints["counts"]) for plan in fitting]
        for plan, centroids in zip(fitting, fit_centroids_batch(fits)):
            plan.hints["centroids"] = centroids
        grouped = self._group_by_octaves(leaves, layout, items, sketched) if self.first_moment_octaves else {}
        planned = dict(zip((index for index, _ in items), sketched))
        choices: dict[int, _SecondMomentChoice] = {}
        for (index, _), plan in zip(items, sketched):
            if isinstance(plan, tuple):
                whole, joint = plan
                first = layout.entry_moments(index)[TensorRole.FIRST_MOMENT]
                first_plan, alternative = planned[first], grouped.get(first)
                assert isinstance(first_plan, _MomentPlan)
                choices[index] = _SecondMomentChoice(
                    _Candidate.of(whole, self._memory), _Candidate.of(joint, self._memory), first,
                    _Candidate.of(first_plan, self._memory),
                    None if alternative is None else _Candidate.of(alternative, self._memory),
                )
                codecs[index] = choices[index].whole.codec
                codecs[first] = choices[index].first_plain.codec
        chosen_later = {choice.first for choice in choices.values()} | set(choices)
        for (index, _), plan in sorted(zip(items, sketched), key=lambda pair: pair[0][0]):
            if index in chosen_later:
                continue
            if index in grouped:
                plan = grouped[index]
            codecs[index] = plan.finish(self._memory) if isinstance(plan, _MomentPlan) else plan
        if self.low_rank_first_moments and self.first_moment_error is not None and first_keep >= 1.0:
            self._factor_first_moments(leaves, codecs, [i for i in grouped if i not in chosen_later])
        for index, codec in products.items():
            codecs[index] = codec
        return choices

    def _step_products(
        self,
        leaves: Sequence[TensorLeaf],
        layout: StateLayout,
        items: Sequence[tuple[int, TensorRole]],
        keep: float,
        jointly_masked: set[int],
    ) -> dict[int, Codec]:
        """Adam first moments pruned at this checkpoint (``keep`` < 1) to be stored instead as
        a low-rank product of their steps ``m / sqrt(v)`` times ``sqrt(v)`` as stored
        (``low_rank_scaled``, its second moment the context), by leaf index. Where a matrix's steps (both sides at least 16) have a product
        of the least rank up to a quarter of the smaller side that loses no more of their
        squared size than keeping the largest ``keep`` of them would (what the pruning
        keeps), and its factors are estimated to take fewer bits than the pruned moment's
        mask and kept entries. Not where the second moment may take the first moment's
        zeros (``jointly_masked``, :meth:`_joint_masks`): a product has none, and a second
        moment with ``beta2`` = 0.95 coded whole took 8x the bytes of the masked one (the
        char GPT)."""
        if keep >= 1.0:
            return {}
        planned = dict(items)
        pairs = []
        for index, role in items:
            if role is not TensorRole.FIRST_MOMENT or leaves[index].tensor.numel() < self.min_numel or index in jointly_masked:
                continue
            second = layout.entry_moments(index).get(TensorRole.SECOND_MOMENT)
            shape = matrix_shape(tuple(leaves[index].tensor.shape))
            if (
                second is not None and planned.get(second) is TensorRole.SECOND_MOMENT
                and leaves[second].tensor.shape == leaves[index].tensor.shape
                and not self._factored(leaves[second].tensor)
                and shape is not None and min(shape) >= MIN_SIDE
                # The product is scaled by the stored second moment: an inf or NaN there
                # (kept exact) would turn a finite first moment's entry into inf or NaN.
                and all_finite(leaves[second].tensor)
            ):
                pairs.append((index, second, shape))

        def factors_of(pair: tuple[int, int, tuple[int, int]]) -> Any:
            index, second, shape = pair
            steps = leaves[index].tensor.detach().reshape(-1).float() / step_scale(
                leaves[second].tensor.detach().reshape(-1), torch.float32
            )
            if not bool(steps.abs().max() <= MAX_PRODUCT_STEP):
                return None
            return _product_within_pruning(steps, shape, keep, _KEPT_FIRST_MOMENT_BITS)

        chosen = parallel_map_sized(factors_of, pairs, [leaf_nbytes(leaves[index]) for index, _, _ in pairs])
        return {
            index: ScaledLowRankCodec(factors.rank).with_factors(factors).against(format_key_path(leaves[second].path))
            for (index, second, _), factors in zip(pairs, chosen) if factors is not None
        }

    def _momentum_products(
        self, leaves: Sequence[TensorLeaf], items: Sequence[tuple[int, TensorRole]], keep: float
    ) -> dict[int, Codec]:
        """Momentum buffers (of weights of at least ``min_numel``) pruned to their ``keep``
        largest entries at this checkpoint, to be stored instead as a low-rank product alone
        (``low_rank``), by leaf index: where one of
        rank up to a quarter of the matrix's smaller side loses no more of the buffer's
        squared size than the pruning would, and its factors are estimated to take fewer
        bits than the pruned buffer (its mask and kept entries). A buffer is an average of
        recent gradients, sums of outer products: on the digits SGD benchmark a rank-2 or
        rank-4 product holds more of it than its largest 5 % of entries
        (docs/dynaquant-measurements.md, *Momentum buffers as a low-rank product*)."""
        if keep >= 1.0:
            return {}
        indices = [
            index for index, role in items
            if role is TensorRole.MOMENTUM_BUFFER and leaves[index].tensor.numel() >= self.min_numel
        ]

        def factors_of(index: int) -> Any:
            tensor = leaves[index].tensor.detach()
            shape = matrix_shape(tuple(tensor.shape))
            if shape is None or min(shape) < MIN_SIDE:
                return None
            return _product_within_pruning(tensor.reshape(-1).float(), shape, keep, _KEPT_ENTRY_BITS)

        chosen = parallel_map_sized(factors_of, indices, [leaf_nbytes(leaves[i]) for i in indices])
        return {index: LowRankCodec(factors.rank).with_factors(factors) for index, factors in zip(indices, chosen) if factors is not None}

    def _factor_first_moments(self, leaves: Sequence[TensorLeaf], codecs: list[Codec], indices: list[int]) -> None:
        """Adam's first moments kept whole and coded per octave of their second moment
        (``indices``), stored instead as a low-rank product plus what it leaves where that
        is estimated to take 15 % fewer bits (``GroupedLowRankCodec``): the leftover on
        the same evenly spaced levels, its ids still per octave. The margin is wider than
        a weight change's, since the octaves take ~9 % off the moment itself."""
        error = self.first_moment_error
        assert error is not None
        indices = [i for i in indices if type(codecs[i]) is DynaQuantGroupedCodec]
        plans = parallel_map_sized(
            lambda i: change_plan(leaves[i].tensor, None, error, FIRST_MOMENT_LOW_RANK_MARGIN),
            indices, [leaf_nbytes(leaves[i]) for i in indices],
        )
        for index, (histogram, rms, largest, factors) in zip(indices, plans):
            if factors is None or not levels_reach(rms, largest, error):
                continue
            grouped: DynaQuantGroupedCodec = codecs[index]  # type: ignore[assignment]
            centroids, prune_below = even_levels(rms, largest, error)
            inner = grouped.rehinted(counts=histogram, centroids=centroids, prune_below=prune_below)
            codec = GroupedLowRankCodec(inner, factors.rank).with_factors(factors)
            codecs[index] = codec.against(grouped.context_key)  # type: ignore[arg-type]

    def _group_by_octaves(
        self,
        leaves: Sequence[TensorLeaf],
        layout: StateLayout,
        items: Sequence[tuple[int, TensorRole]],
        sketched: Sequence[Any],
    ) -> dict[int, "_MomentPlan"]:
        """Adam's first moments (of weights of at least ``min_numel``) planned to code their
        ids per octave of their second moment, by leaf index: where that one is quantized
        (not factored), its reconstruction is the context. Where the second moment may be
        stored with the first moment's zeros instead, the plan is an alternative, used if
        the whole second moment is stored (:class:`_SecondMomentChoice`)."""
        seconds = {
            index: plan for (index, role), plan in zip(items, sketched)
            if role is TensorRole.SECOND_MOMENT and isinstance(plan, (_MomentPlan, tuple))
        }
        grouped = {}
        for (index, role), plan in zip(items, sketched):
            if role is not TensorRole.FIRST_MOMENT or not isinstance(plan, _MomentPlan):
                continue
            second = layout.entry_moments(index).get(TensorRole.SECOND_MOMENT)
            numel = leaves[index].tensor.numel()
            if second in seconds and numel >= self.min_numel and leaves[second].tensor.numel() == numel:
                codec = DynaQuantGroupedCodec.from_config({**plan.codec.get_config(), "id": DynaQuantGroupedCodec.codec_id})
                grouped[index] = dataclasses.replace(plan, codec=codec, context=format_key_path(leaves[second].path))
        return grouped

    def _sketch_moment(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        index: int,
        role: TensorRole,
        first_keep: float,
        momentum_keep: float,
        joint_mask: Optional[torch.Tensor] = None,
    ) -> "Codec | _MomentPlan | tuple[_MomentPlan, _MomentPlan]":
        """The codec of one first or second moment, or what is left to fit of it (reads the
        policy's memory; the codec writes back the levels it fits when it encodes);
        ``first_keep`` / ``momentum_keep``: the fraction of Adam's first moment / of a
        momentum buffer kept at this checkpoint;
        ``joint_mask``: the entry's first-moment pruning mask, shared with its second moment
        (:meth:`_joint_masks`); a second moment given one (and stored against a reference)
        returns both plans, whole and with the first moment's zeros."""
        tensor = leaves[index].tensor.detach()
        key = format_key_path(leaves[index].path)
        if role is TensorRole.SECOND_MOMENT and self._factored(tensor):
            return FactoredMomentCodec()
        flat = tensor.reshape(-1)
        counts = key_counts(signed_keys, flat, SIGNED_KEYS).cpu()
        # The moment of a bias or a norm layer's scale (a weight under ``min_numel``) costs
        # mostly its record and level table: twice the levels (an Adam first moment's: fine
        # evenly spaced ones, SMALL_MOMENT_ERROR) and no pruning add few bytes.
        small = tensor.numel() < self.min_numel
        finer = SMALL_MOMENT_LEVEL_FACTOR if small else 1
        zero_levels = None
        if role in _FIRST_ORDER:
            bins = self.momentum_bins if role is TensorRole.MOMENTUM_BUFFER else self.moment_bins
            bins = min(bins * finer, MAX_MOMENT_BINS)
            codec: DynaQuantCodec = DynaQuantCodec(bins=bins, prune=0.0, protect=0.0, sigma=self.sigma)
            second = layout.entry_moments(index).get(TensorRole.SECOND_MOMENT)
            partner = leaves[second].tensor if second is not None else None
            if small:
                keep = 1.0
            elif role is TensorRole.MOMENTUM_BUFFER:
                keep = momentum_keep
            else:
                keep = first_keep
            whole = keep >= 1.0 and not small and role is TensorRole.FIRST_MOMENT
            small_first = small and role is TensorRole.FIRST_MOMENT
            if (whole or small_first) and self.first_moment_error is not None:
                # Every entry kept: evenly spaced levels, with the zero cell below half a step
                # (a small moment's finer, and stored as their step instead of a table).
                error = min(SMALL_MOMENT_ERROR, self.first_moment_error) if small_first else self.first_moment_error
                rms, largest = spread(tensor.reshape(-1).float())
                if not levels_reach(rms, largest, error):
                    # A budget finer than MAX_EVEN_LEVELS steps can span: exact instead
                    # (levels that stop short would clip the largest entries).
                    return Lossless().plan([leaves[index]], [references[index]])[0]
                centroids, prune_below = even_levels(rms, largest, error)
                extra, zero_levels = {"centroids": centroids, "prune_below": prune_below}, None
            else:
                extra, zero_levels = self._first_moment_hints(tensor, counts, role, partner, keep, bins, joint_mask)
        else:
            reference = usable_reference(tensor, references[index])
            codec_type = DynaQuantDeltaCodec if reference is not None else DynaQuantCodec
            # The largest entries are the most active parameters: a level below their
            # value would make their restored steps too large, so they are protected.
            # Half the stickiness: a second moment held above its value slows those
            # parameters down until it is replaced.
            bins = min(self.second_moment_bins * finer, MAX_MOMENT_BINS)
            codec = codec_type(
                bins=bins, prune=0.0, protect=SECOND_MOMENT_PROTECT, domain=LOG,
                sigma=0.5, stickiness=self.stickiness / 2,
            )
            extra = {}
            # A small one on a log lattice (SMALL_MOMENT_DIVISIONS per octave): the table is
            # two numbers, not one per level, and a lattice is the same at every checkpoint,
            # so a delta's predicted ids hold wherever the moment stayed within its cell.
            ceiling = torch.finfo(tensor.dtype).max
            reach = lattice_range(tensor.reshape(-1), SMALL_MOMENT_DIVISIONS, ceiling) if small else None
            if reach is not None and reach[1] <= MAX_LATTICE_LEVELS:
                extra = {"centroids": lattice_values(SMALL_MOMENT_DIVISIONS, *reach)}
        init = self._memory.centroids.get(key)
        init = init if init is not None and init.numel() == bins else None
        # No keys hint: the codec recomputes them (one cheap pass) when the writer encodes, so
        # the moments' keys are not all held at once between planning and writing.
        plan = _MomentPlan(key, codec, {"counts": counts, "init": init, **extra}, zero_levels)
        if role in _FIRST_ORDER or joint_mask is None:
            return plan
        # ExCP's joint mask: where the first moment is pruned (stored as 0), so is the
        # second, and the levels (and the protected largest values) are those of the kept
        # entries. The zeros are the first moment's, read back from its reconstruction.
        first = layout.entry_moments(index)[TensorRole.FIRST_MOMENT]
        kept = _kept_counts(flat, joint_mask)
        masked_type = DynaQuantMaskedDeltaCodec if reference is not None else DynaQuantMaskedCodec
        masked = masked_type.from_config({**codec.get_config(), "id": masked_type.codec_id})
        joint = _MomentPlan(key, masked, {"counts": kept, "init": init}, None, format_key_path(leaves[first].path))
        return plan, joint

    def _joint_masks(
        self,
        leaves: Sequence[TensorLeaf],
        layout: StateLayout,
        items: Sequence[tuple[int, TensorRole]],
        first_keep: float,
        betas: dict[int, Any],
    ) -> dict[int, torch.Tensor]:
        """The first-moment pruning mask of each Adam entry whose first moment this
        checkpoint prunes (``first_keep`` < 1, neither under ``min_numel``) when
        ``joint_moment_mask`` is on and their ``betas`` keep a restart's steps within
        ``RESTART_STEP_GROWTH`` of their steady size, by the leaf index of both its first
        and its second moment: that second moment may be pruned with the same mask."""
        if not self.joint_moment_mask or first_keep >= 1.0:
            return {}
        planned = dict(items)
        joint: list[tuple[int, int]] = []
        for index, role in items:
            if role is not TensorRole.FIRST_MOMENT or leaves[index].tensor.numel() < self.min_numel:
                continue
            second = layout.entry_moments(index).get(TensorRole.SECOND_MOMENT)
            if (
                second is not None
                and restart_step_growth(betas.get(second)) <= RESTART_STEP_GROWTH
                and planned.get(second) is TensorRole.SECOND_MOMENT
                and leaves[second].tensor.shape == leaves[index].tensor.shape
                and not self._factored(leaves[second].tensor)
            ):
                joint.append((index, second))
        masks = parallel_map_sized(
            lambda pair: _first_moment_prune_mask(leaves[pair[0]].tensor, leaves[pair[1]].tensor, first_keep), joint,
            [leaf_nbytes(leaves[first]) for first, _ in joint],
        )
        return {index: mask for pair, mask in zip(joint, masks) for index in pair}

    def _factored(self, tensor: torch.Tensor) -> bool:
        if self.second_moment != "factored" or factored_shape(tuple(tensor.shape)) is None:
            return False
        low, high = torch.aminmax(tensor)
        return float(low) >= 0 and float(high) < float("inf")  # NaN fails both

    def _first_moment_hints(
        self,
        moment: torch.Tensor,
        counts: torch.Tensor,
        role: TensorRole,
        second: Optional[torch.Tensor],
        keep: float,
        bins: int,
        prune_mask: Optional[torch.Tensor] = None,
    ) -> tuple[dict[str, Any], Optional[tuple[torch.Tensor, int]]]:
        """Which first-moment entries to keep (the fraction ``keep``; the rest are stored as
        0), on ``bins`` levels: the codec's hints, and the histogram and level count of its
        symmetric levels around zero (:func:`_zero_level_hints_batch`) when it has them.

        Adam's ``exp_avg`` keeps the entries with the largest ``|m| / sqrt(v)`` (whose
        steps are large and steady; the others move little either way); an SGD momentum
        buffer, which is the step itself, keeps those largest in magnitude. ``prune_mask``:
        Adam's mask when it was already made (:meth:`_joint_masks`).
        """
        if keep >= 1.0:
            return {}, (counts, bins)
        if role is TensorRole.MOMENTUM_BUFFER or second is None or second.shape != moment.shape:
            prune_below, _ = magnitude_thresholds(counts, 1.0 - keep, 0.0)
            return {"prune_below": prune_below}, None
        if prune_mask is None:
            prune_mask = _first_moment_prune_mask(moment, second, keep)
        kept = _kept_counts(moment.reshape(-1), prune_mask)
        # The kept entries get the same symmetric levels around an exact zero as a whole
        # moment: plain k-means rounded some small |m| (high score: small v) up to a far
        # larger level, and those restored steps blew up a digits run.
        return {"prune_mask": prune_mask}, (kept, bins)


def _product_within_pruning(flat: torch.Tensor, shape: tuple[int, int], keep: float, kept_bits: float) -> Any:
    """The factors of the least-rank product of ``flat`` (as a ``shape`` matrix) that loses
    no more of its squared size than keeping its ``keep`` largest entries would, where
    they are estimated to take fewer bits than that pruned tensor (the mask's binary
    entropy, ``kept_bits`` per kept entry); else None."""
    kept = max(1, int(round(keep * flat.numel()))) if keep > 0 else 0
    energy = float(torch.dot(flat, flat))
    factors = low_rank_within(flat.reshape(shape), energy - _largest_energy(flat, kept))
    if factors is None:
        return None
    mask_bits = _binary_entropy(kept / flat.numel()) * flat.numel()
    if FACTOR_BITS * factors.rank * sum(shape) >= mask_bits + kept_bits * kept:
        return None
    return factors


def _kept_counts(flat: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """The signed-key histogram (on the CPU) of the entries of ``flat`` that ``pruned``
    (a mask) does not prune."""
    return torch.bincount(signed_keys(select(flat, ~pruned.reshape(-1))), minlength=SIGNED_KEYS).cpu()


def _largest_energy(flat: torch.Tensor, count: int) -> float:
    """The summed squares of the ``count`` entries of ``flat`` largest in magnitude (on the
    CPU by NumPy's selection, ~10x faster than a top-k on millions of entries)."""
    if count <= 0:
        return 0.0
    if flat.device.type == "cpu":
        magnitudes = np.abs(flat.detach().float().contiguous().numpy())
        largest = np.partition(magnitudes, magnitudes.size - count)[magnitudes.size - count:]
        return float(np.dot(largest.astype(np.float64), largest.astype(np.float64)))
    largest = flat.abs().topk(count).values.double()
    return float(torch.dot(largest, largest))


def _binary_entropy(p: float) -> float:
    """Bits per entry of a mask that keeps the fraction ``p``."""
    if not 0 < p < 1:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _first_moment_prune_mask(moment: torch.Tensor, second: torch.Tensor, keep: float) -> torch.Tensor:
    """The flat mask of the Adam first-moment entries stored as 0: all but the ``keep``
    fraction with the largest ``|m| / sqrt(v)`` (to the sketch's accuracy), and any whose
    score is not finite."""
    # In place on fresh tensors: each large temporary costs more to allocate than to fill.
    score = moment.detach().abs().float().reshape(-1)
    score.div_(second.detach().float().sqrt().reshape(-1).add_(1e-8))
    score_keys = magnitude_keys(score)
    cut = quantile_key(torch.bincount(score_keys, minlength=MAGNITUDE_KEYS), 1.0 - keep)
    # A score that is not finite (nan or inf) has its float32 exponent all ones.
    return (score_keys < cut) | (score_keys >= FIRST_NON_FINITE_KEY)


@dataclass
class _MomentPlan:
    """A moment's codec and hints, waiting for the levels fitted for every moment at once."""

    key: str
    codec: DynaQuantCodec
    hints: dict[str, Any]
    #: the histogram and level count of symmetric levels around zero (first moments)
    zero_levels: Optional[tuple[torch.Tensor, int]]
    #: the key of the tensor the codec decodes with (a masked second moment's first moment,
    #: a grouped first moment's second moment)
    context: Optional[str] = None

    def finish(
        self,
        memory: "_Memory",
        stats: Optional[EntropyStats] = None,
        centroids: Optional[dict[str, torch.Tensor]] = None,
    ) -> Codec:
        """The codec with its hints; the levels it encodes with warm-start this moment's
        k-means at the next checkpoint (kept in ``centroids``, by default the memory's).
        ``stats``: where its entropy-stage figures go (default: the memory's)."""
        centroids = memory.centroids if centroids is None else centroids
        key = self.key

        def remember(table: LevelTable) -> None:
            centroids[key] = table.centroids()

        codec = self.codec.with_hints(stats=memory.entropy if stats is None else stats, on_fitted=remember, **self.hints)
        if self.context is not None:
            assert isinstance(codec, (DynaQuantGroupedCodec, DynaQuantMaskedCodec, DynaQuantMaskedDeltaCodec))
            codec.against(self.context)
        return codec


@dataclass
class _Candidate:
    """One way to store a second moment, its figures and fitted levels held apart until chosen."""

    codec: Codec
    stats: EntropyStats
    centroids: dict[str, torch.Tensor]

    @classmethod
    def of(cls, plan: _MomentPlan, memory: "_Memory") -> "_Candidate":
        stats, centroids = EntropyStats(), {}
        return cls(plan.finish(memory, stats, centroids), stats, centroids)

    def adopt(self, memory: "_Memory") -> Codec:
        """Count this candidate's figures and levels as the policy's; its codec."""
        memory.entropy.merge(self.stats)
        memory.centroids.update(self.centroids)
        return self.codec


@dataclass
class _SecondMomentChoice:
    """A second moment stored whole or with its first moment's zeros, whichever pair of
    moments is smaller.

    The joint encoding stores only the entries whose first moment is kept (the mask itself
    is read from the first moment), but the kept entries move from checkpoint to checkpoint:
    one whose second moment was 0 at the reference is coded afresh. Where the second
    moment barely changes between checkpoints (its ids are cheap deltas) the whole moment
    can be the smaller one, and then the first moment may be coded per octave of it
    (which the joint encoding rules out: each would need the other decoded first).
    """

    whole: _Candidate
    joint: _Candidate
    #: the leaf index of the entry's first moment (the joint encoding's context)
    first: int
    #: that first moment coded alone (the joint encoding's context), and per octave of the
    #: whole second moment (None: not planned), one of which is stored with it
    first_plain: _Candidate
    first_grouped: Optional[_Candidate] = None

    def may_regroup(self, whole: Encoded, joint: Optional[Encoded], plain: Encoded) -> bool:
        """Whether the grouped first moment is worth encoding: the joint second moment is
        not smaller than the whole one by more than ``REGROUP_MARGIN`` of the first
        moment's plain bytes (grouping by octave took 5-22 % off them where measured)."""
        if self.first_grouped is None:
            return False
        return joint is None or encoded_size(whole) - encoded_size(joint) < REGROUP_MARGIN * encoded_size(plain)

    def settle(
        self,
        whole: Encoded,
        joint: Optional[Encoded],
        plain: Encoded,
        grouped: Optional[Encoded],
        memory: "_Memory",
    ) -> tuple[Codec, Codec]:
        """The codecs of the second and the first moment, of the smaller pair: the joint
        second moment with the first moment coded alone, or the whole second moment with the
        smaller of the first moment's encodings (None: not encoded, it could not win); a tie
        keeps the whole second moment."""
        first, first_size = self.first_plain, encoded_size(plain)
        if grouped is not None and encoded_size(grouped) < first_size:
            first, first_size = self.first_grouped, encoded_size(grouped)  # type: ignore[assignment]
        if joint is not None and encoded_size(joint) + encoded_size(plain) < encoded_size(whole) + first_size:
            return self.joint.adopt(memory), self.first_plain.adopt(memory)
        return self.whole.adopt(memory), first.adopt(memory)


@functools.lru_cache(maxsize=64)
def _restart_growth(beta1: float, beta2: float) -> float:
    k = torch.arange(1, _RESTART_HORIZON + 1, dtype=torch.float64)
    return float(((1 - beta1 ** (2 * k)) / (1 - beta2 ** k)).sqrt().max())


def restart_step_growth(betas: Any) -> float:
    """How much larger Adam's steps get, at most, after an entry's two moments restart
    from 0 late in training (``inf`` for betas that are not two numbers in [0, 1)).

    For an entry whose gradients are noise of a steady size (those the first moment's
    pruning drops: small ``|m| / sqrt(v)``), the step ``k`` steps after the restart is
    ``sqrt((1 - beta1^2k) / (1 - beta2^k))`` times its steady size: Adam's bias correction
    is ``1 - beta^t`` of the run's own step count ``t``, which no longer corrects the
    restarted averages. The largest over ``k``: 1.95 for ``(0.9, 0.95)``, 13.8 for
    ``(0.9, 0.999)``.
    """
    try:
        beta1, beta2 = (float(beta) for beta in betas)
    except (TypeError, ValueError):
        return math.inf
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        return math.inf
    return _restart_growth(beta1, beta2)
