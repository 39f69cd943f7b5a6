"""DynaQuant's weights: which levels each weight is stored on, or whether it is stored as
its change since the reference, or as that reference (docs/dynaquant.md, *The quantizer*,
*The configuration search*)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..codecs import Codec, ResidualCodec
from ..codecs._parallel import parallel_map_sized
from ..codecs.base import Encoded
from ..codecs.bucket_delta import EntropyStats
from ..codecs.dynaquant import DynaQuantCodec, DynaQuantDeltaCodec
from ..codecs.dynaquant_context import SignGroupedResidualCodec
from ..codecs.lossy_input import all_finite, below_normal, working_dtype
from ..codecs.low_rank import LowRankResidualCodec
from ..codecs.nonuniform_quantizer import fit_centroids_batch
from ..codecs.octave_groups import GROUP_MIN_ELEMENTS
from ..codecs.passes import squared_differences, sum_of_squares
from ..codecs.prepared import PreparedEncoding
from ..codecs.unchanged import UnchangedCodec
from ..tree import TensorLeaf, format_key_path
from .base import encoded_size, leaf_nbytes, usable_reference
from .dynaquant_search import ConfigurationCube, Point, SearchRecord
from .even_levels import (
    change_energy,
    change_plan,
    even_levels,
    levels_reach,
    pooled_shares,
    spread,
    step_levels,
)
from .quantization_trials import MAGNITUDE, TrialConfig, WeightTrial
from .state_layout import StateLayout, TensorRole

if TYPE_CHECKING:
    from .dynaquant import _Memory

__all__ = ["PROXY_SCALE", "CHANGE_TRIAL_BITS", "POOLED_BUDGET_MARGIN", "WeightPlanning"]

#: Without ``evaluate``, the proxy must stay below ``tolerance * PROXY_SCALE``.
PROXY_SCALE = 1.0

#: A moving weight is also encoded as its change since the reference where its level ids
#: cost more than this many bits per element: a change on ``residual_bins`` = 10 levels
#: cost 2.3-3.3 bits per element on the benchmark's workloads, so below this it cannot win.
CHANGE_TRIAL_BITS = 1.5

#: With ``pooled_error``, a change's share of the pooled error stays within this much of
#: its own budget (in plain squared error). The budget also bounds the Fisher-weighted
#: error, which an unweighted pool does not see: 0.8 left room for it until the pool
#: was weighed by each weight's Fisher mean (``fisher_pooling``); with that, the whole
#: budget stored the yardstick's runs 0.3-3.9 % smaller at the same degradation.
POOLED_BUDGET_MARGIN = 1.0

#: The share of its own squared size a weight under ``min_numel`` stored as its change may
#: lose with ``evaluate``, which does not judge such weights: the proxy's default
#: ``tolerance`` (without ``evaluate`` it is ``tolerance`` itself).
SMALL_WEIGHT_BUDGET_WITH_EVALUATE = 0.003

#: A weight's change rounded a second time because the first missed its own budget
#: (mostly by the Fisher-weighted error, which the pool does not cap) aims at this much
#: of the budget.
RETRY_MARGIN = 0.97


def _second_moment_of(leaves: Sequence[TensorLeaf], layout: StateLayout, index: int) -> Optional[int]:
    """The index of weight ``index``'s second moment (Adam's ``exp_avg_sq``), the proxy's
    Fisher diagonal, where the optimizer keeps one of its shape; else None."""
    second = layout.optimizer_state_of(index).get(TensorRole.SECOND_MOMENT)
    return second if second is not None and leaves[second].tensor.shape == leaves[index].tensor.shape else None


def _guess_layer_type(leaf: TensorLeaf) -> str:
    if "embed" in format_key_path(leaf.path).lower():
        return "embedding"
    dims = leaf.tensor.dim()
    return "conv" if dims >= 3 else "linear" if dims == 2 else "vector"


class WeightPlanning:
    """How :class:`~.dynaquant.DynaQuant` plans the weights of a save: the sketches, the
    configuration search, the movement and frozen budgets, weights stored as their change
    or as their reference, and the check of what was stored. A base of ``DynaQuant``: it
    reads the policy's knobs and ``_memory``."""

    # The knobs and memory of DynaQuant's that this reads.
    tolerance: float
    frozen_tolerance: float
    movement_share: float
    evaluate: Optional[Callable[[dict[str, torch.Tensor]], float]]
    bins: tuple[int, ...]
    embedding_bins: tuple[int, ...]
    prune: tuple[float, ...]
    protect: tuple[float, ...]
    sigma: float
    stickiness: float
    neighbourhood: int
    precision_only_grows: bool
    residual_bins: tuple[int, ...]
    residual_error: Optional[float]
    cell_means: bool
    pooled_error: bool
    fisher_pooling: bool
    sign_grouped_changes: bool
    low_rank_changes: bool
    min_numel: int
    small_min_numel: int
    small_weight_error: Optional[float]
    refine_error: Optional[float]
    _memory: _Memory

    def _small_trained_weights(self, leaves: Sequence[TensorLeaf], layout: StateLayout, frozen: set[int]) -> list[int]:
        """The weights under ``min_numel`` from ``small_min_numel`` values (biases, norm
        layers) that have optimizer state, are not ``frozen`` (the watched model's frozen
        parameters) and hold no NaN or inf (such a tensor stays exact: the writer would
        store it so anyway), nor only zeros and subnormal values (exact: a few bytes)."""
        return [
            i for i in layout.indices(TensorRole.WEIGHT)
            if i not in frozen and leaves[i].tensor.is_floating_point()
            and self.small_min_numel <= leaves[i].tensor.numel() < self.min_numel
            and layout.optimizer_state_of(i) and all_finite(leaves[i].tensor)
            and not below_normal(leaves[i].tensor)
        ]

    def _plan_small_weights(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        codecs: list[Codec],
        frozen: set[int],
        round_whole: bool,
    ) -> dict[int, EntropyStats]:
        """Weights under ``min_numel`` (biases, norm layers; from ``small_min_numel`` values)
        that have optimizer state, where that is smaller than the lossless encoding already
        planned: against a usable reference (at a delta), their change since it, rounded as
        a large weight's change is (``residual_error``: levels of their own values would
        cost more than their record), at an error that is a share of the change; without
        one (at a full checkpoint) and where ``round_whole``, the weights themselves on
        evenly spaced levels that lose ``small_weight_error`` of their squared size.
        ``frozen``: the watched model's frozen parameters. Returns the entropy figures by
        leaf index."""
        small = self._small_trained_weights(leaves, layout, frozen)
        against = [i for i in small if usable_reference(leaves[i].tensor, references[i]) is not None]
        moving = [i for i in against if all_finite(references[i])]
        chosen: dict[int, EntropyStats] = {}
        stats = {index: EntropyStats() for index in small}
        # A change also loses no more than a weight's own budget of the weight's squared
        # size: where a change is far larger than the weight (a bias crossing zero, a run
        # taking huge steps) a share of the change alone could be more than the weight.
        budget = (self.tolerance if self.evaluate is None else SMALL_WEIGHT_BUDGET_WITH_EVALUATE) * PROXY_SCALE
        own = {index: budget * change_energy(leaves[index].tensor, None) for index in moving}
        shares = None
        if moving and self.residual_error is not None:
            shares = self._change_errors(leaves, references, moving, [leaf_nbytes(leaves[i]) for i in moving], own, {})
        coded = self._plain_change_codecs(leaves, references, moving, stats, shares=shares) if moving else []
        for index, (_, codec) in zip(moving, coded):
            if codec is None:
                continue  # no levels within its budget reach its change: it stays exact
            change = codec.prepare(leaves[index].tensor, references[index])
            rebuilt = change.reconstruction
            lost = math.inf if rebuilt is None else change_energy(rebuilt, leaves[index].tensor)
            if not lost <= own[index]:
                codec.drop_prepared()
                continue
            exact = codecs[index].encode(leaves[index].tensor, references[index])
            if encoded_size(change) < encoded_size(exact):
                codecs[index] = codec
                chosen[index] = stats[index]
        if self.small_weight_error is None or not round_whole:
            return chosen
        for index in (i for i in small if i not in against):
            tensor = leaves[index].tensor.detach()
            rms, largest = spread(tensor.reshape(-1).to(working_dtype(tensor.dtype)))
            if not levels_reach(rms, largest, self.small_weight_error):
                continue  # a budget finer than MAX_EVEN_LEVELS steps can span: it stays exact
            centroids, prune_below = even_levels(rms, largest, self.small_weight_error)
            # ``bins`` is unused with ready levels: the codec's default, which its config omits.
            codec = DynaQuantCodec(prune=0.0, protect=0.0, sigma=self.sigma).with_hints(
                centroids=centroids, prune_below=prune_below, stats=stats[index],
            )
            stored = codec.prepare(tensor)
            if encoded_size(stored) < encoded_size(codecs[index].encode(tensor, references[index])):
                codecs[index] = codec
                chosen[index] = stats[index]
            else:
                codec.drop_prepared()
        return chosen

    def _store_changes_where_smaller(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        codecs: list[Codec],
        weights: "_WeightPlan",
        encoded: dict[int, Any],
    ) -> None:
        """A moving weight whose level ids cost more than ``CHANGE_TRIAL_BITS`` per element is
        also encoded as its change since the reference (``residual_bins``, as for a weight
        that moved less than its levels' spacing), and stored so where that is smaller and
        within its own budget.

        Level ids pay for every cell an element crosses; a change coded on its own levels
        costs about the same per element however far it went, with an error that is a
        share of the change. Where weights cross several cells between checkpoints (the
        char GPT from its third checkpoint on) the change is the smaller encoding, at an
        error no larger (docs/dynaquant-measurements.md, *Weights stored as their change*).
        """
        candidates = [
            i for i in weights.indices
            if i in weights.moved and isinstance(codecs[i], DynaQuantDeltaCodec)
            and 8 * encoded_size(encoded[i]) > CHANGE_TRIAL_BITS * leaves[i].tensor.numel()
        ]
        if not candidates:
            return

        allowed = {index: weights.cube.own_budget(index) for index in candidates}
        shares = self._change_shares(leaves, references, candidates, weights.trials, allowed, weights.moved, weights.refining)
        stats = {index: EntropyStats() for index in candidates}
        coded = self._change_codecs(leaves, references, layout, candidates, weights.trials, allowed, stats, weights.moved, shares)
        as_change = {index: codec for index, (_, codec) in zip(candidates, coded) if codec is not None}
        candidates = list(as_change)
        changes = dict(zip(candidates, parallel_map_sized(
            lambda i: as_change[i].prepare(leaves[i].tensor, references[i]), candidates,
            [leaf_nbytes(leaves[i]) for i in candidates],
        )))
        # The pool caps each change by its plain error only; the budget bounds the
        # Fisher-weighted one too. A change that misses its budget while smaller is rounded
        # once more, finer by what it missed, instead of falling back to level ids at two
        # to three times its bytes.
        errors = {index: weights.error(index, changes[index]) for index in candidates}
        finer = {
            index: shares[index] * RETRY_MARGIN * allowed[index] / errors[index]
            for index in candidates
            if shares is not None and encoded_size(changes[index]) < encoded_size(encoded[index])
            and math.isfinite(errors[index]) and errors[index] > allowed[index]
        }
        if finer:
            stats.update({index: EntropyStats() for index in finer})
            coded = self._change_codecs(leaves, references, layout, list(finer), weights.trials, allowed, stats, weights.moved, finer)
            # A retry whose finer levels cannot reach the change keeps its first encoding.
            retried = {index: codec for index, (_, codec) in zip(finer, coded) if codec is not None}
            as_change.update(retried)
            changes.update(zip(retried, parallel_map_sized(
                lambda i: as_change[i].prepare(leaves[i].tensor, references[i]), retried,
                [leaf_nbytes(leaves[i]) for i in retried],
            )))
            errors.update((index, weights.error(index, changes[index])) for index in retried)
        changed = 0
        for index in candidates:
            change = changes[index]
            if encoded_size(change) < encoded_size(encoded[index]) and errors[index] <= allowed[index]:
                _drop_prepared(codecs[index])
                codecs[index], encoded[index], weights.stats[index] = as_change[index], change, stats[index]
                changed += 1
        weights.record.config["change_coded_tensors"] = changed
        weights.record.config["change_coded_retries"] = len(finer)

    def _store_whole_on_even_levels_where_smaller(
        self,
        leaves: Sequence[TensorLeaf],
        layout: StateLayout,
        codecs: list[Codec],
        weights: "_WeightPlan",
        encoded: dict[int, Any],
    ) -> None:
        """A weight stored whole on its search's k-means levels (at a full checkpoint, or
        without a usable reference) is also encoded on evenly spaced levels that lose the
        same share of its squared size, and stored so where that is smaller and loses no
        more than the k-means levels by the proxy's measure (the larger of the plain and
        the Fisher-weighted share; not with ``evaluate``, which judged the k-means levels).

        At the same squared error evenly spaced levels cost fewer coded bits than k-means
        levels, which put about equally many values in each cell (the first checkpoints of
        the char GPT and MiniLM: 6.5-6.7 % fewer bytes for their weights,
        docs/dynaquant-measurements.md, *Whole weights on evenly spaced levels*). Spread
        evenly, their error can weigh more by the Fisher diagonal; where it does they are
        tried once more, finer by what they missed.

        That guard needs a Fisher diagonal worth the name: a weight whose proxy weighs its
        error by the square of the watch's averaged gradient (an SGD run's; the mean of
        the squared gradients it is not) keeps its k-means levels. On the digits SGD run
        evenly spaced levels left 5 of 8 runs one or two test images worse.
        """
        if self.evaluate is not None:
            return
        candidates = [
            i for i in weights.indices
            if type(codecs[i]) is DynaQuantCodec and i in encoded and encoded[i].reconstruction is not None
            and all_finite(leaves[i].tensor)
            and (weights.trials[i].weights is None or _second_moment_of(leaves, layout, i) is not None)
        ]
        weights.record.config["even_level_tensors"] = 0
        if not candidates:
            return
        shares: dict[int, float] = {}
        for index in candidates:
            values = leaves[index].tensor.detach().reshape(-1).float()
            difference = encoded[index].reconstruction.reshape(-1).float() - values
            energy = float(torch.dot(values, values))
            if energy > 0 and math.isfinite(energy):
                shares[index] = float(torch.dot(difference, difference)) / energy
        candidates = [i for i in candidates if shares.get(i, 0.0) > 0]

        def sketched(index: int) -> bool:
            # Whether the search's sketch is of this very tensor (not of its change): its
            # keys and their histogram are then not computed again.
            trial, tensor = weights.trials[index], leaves[index].tensor
            return trial.flat.data_ptr() == tensor.data_ptr() and trial.numel == tensor.numel()

        def plan(index: int) -> tuple[torch.Tensor, float, float]:
            if sketched(index):
                tensor = leaves[index].tensor.detach()
                return weights.trials[index].counts, *spread(tensor.reshape(-1).to(working_dtype(tensor.dtype)))
            return change_plan(leaves[index].tensor, None)[:3]

        plans = dict(zip(candidates, parallel_map_sized(plan, candidates, [leaf_nbytes(leaves[i]) for i in candidates])))
        stats = {index: EntropyStats() for index in candidates}

        def levels(index: int) -> DynaQuantCodec:
            histogram, rms, largest = plans[index]
            centroids, prune_below = step_levels(histogram, rms, largest, shares[index], False)
            codec = DynaQuantCodec(
                bins=codecs[index].bins, prune=0.0, protect=0.0, sigma=self.sigma  # type: ignore[attr-defined]
            ).with_hints(counts=histogram, centroids=centroids, prune_below=prune_below, stats=stats[index])
            return codec.rehinted(keys=weights.trials[index].keys) if sketched(index) else codec

        # The levels' error as the proxy measures it (the larger of the plain and the
        # Fisher-weighted share): evenly spaced levels must not lose more.
        allowed = {index: weights.error(index, encoded[index]) for index in candidates}

        def store_where_smaller(index: int) -> bool:
            # The rounding's error is checked before its ids are coded (most of an encode's
            # time): spaced for the k-means levels' plain share, evenly spaced levels mostly
            # miss it (MiniLM's first checkpoint: 44 of 45 weights, 33 by their plain error,
            # 11 by the Fisher-weighted one alone), and are rounded once more, finer by what
            # they missed. Each tensor is
            # settled on its own, so that no more than one encoding per thread is held beside
            # the k-means ones (all of them at once: a 2 GiB state's full save peaked 0.23 of
            # its size higher).
            codec = levels(index)
            error = weights.error_of(index, codec.rounded(leaves[index].tensor))
            if math.isfinite(error) and error > allowed[index]:
                shares[index] *= RETRY_MARGIN * allowed[index] / error
                codec = levels(index)
                error = weights.error_of(index, codec.rounded(leaves[index].tensor))
            if not error <= allowed[index]:
                return False
            result = codec.prepare(leaves[index].tensor, None)
            if encoded_size(result) < encoded_size(encoded[index]):
                _drop_prepared(codecs[index])
                codecs[index], encoded[index], weights.stats[index] = codec, result, stats[index]
                return True
            return False

        chosen = sum(parallel_map_sized(store_where_smaller, candidates, [leaf_nbytes(leaves[i]) for i in candidates]))
        weights.record.config["even_level_tensors"] = chosen

    def _changes_to_group(
        self,
        leaves: Sequence[TensorLeaf],
        layout: StateLayout,
        codecs: list[Codec],
        whole: Collection[TensorRole],
    ) -> dict[int, int]:
        """The weights planned as their change (:class:`ResidualCodec`) whose ids may be coded
        per sign of their first moment (or momentum buffer) kept whole at this save (its role
        in ``whole``; empty unless ``sign_grouped_changes``): weight index -> that moment's
        index.

        The optimizer moves a weight against the running average of its gradient, so the
        change since the last checkpoint mostly has the opposite sign. A pruned moment knows
        too few signs: on the char GPT, whose first moments keep 5 %, the grouping took
        0.03 % off a run and added 7 % to each save's time.
        """
        chosen: dict[int, int] = {}
        if not whole:
            return chosen
        for index, codec in enumerate(codecs):
            if type(codec) is not ResidualCodec or leaves[index].tensor.numel() < 2 * GROUP_MIN_ELEMENTS:
                continue  # one group only
            moments = {role: i for role, i in layout.optimizer_state_of(index).items() if role in whole}
            moment = moments.get(TensorRole.FIRST_MOMENT, moments.get(TensorRole.MOMENTUM_BUFFER))
            if moment is not None and leaves[moment].tensor.numel() == leaves[index].tensor.numel():
                chosen[index] = moment
        return chosen

    def _group_changes_by_first_moment(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        codecs: list[Codec],
        encoded: dict[int, Any],
        stats: dict[int, EntropyStats],
        grouped: dict[int, int],
    ) -> None:
        """The weights of ``grouped`` (weight index -> its moment, :meth:`_changes_to_group`)
        stored as their change with their ids coded per sign of that moment
        (:class:`SignGroupedResidualCodec`); ``stats`` (weight index -> the entropy figures
        of its encoding) follows.

        A weight already encoded as its change (in ``encoded``: one that crossed many cells,
        :meth:`_store_changes_where_smaller`) keeps the smaller encoding; the others were
        not encoded yet and are stored grouped (13.5 % fewer bytes for MiniLM's changes,
        never more than a stream header worse). The moments must be encoded by now: their
        reconstruction is what the reader groups by.
        """
        candidates = []
        for index, moment in grouped.items():
            if type(codecs[index]) is not ResidualCodec:
                continue  # stored another way after all
            prepared = getattr(codecs[moment], "prepared_result", None)
            if prepared is not None and prepared.reconstruction is not None:
                candidates.append((index, moment, prepared.reconstruction))
        if not candidates:
            return

        def encode(item: tuple[int, int, torch.Tensor]) -> tuple[SignGroupedResidualCodec, Encoded, EntropyStats]:
            index, moment, context = item
            inner = codecs[index]._inner  # type: ignore[attr-defined]  # noqa: SLF001 - its levels, as hinted
            figures = EntropyStats()
            hinted = type(inner).from_config(inner.get_config())
            hinted._hints = {**inner._hints, "stats": figures}  # noqa: SLF001 - the same hints, its own figures
            codec = SignGroupedResidualCodec(hinted).against(format_key_path(leaves[moment].path))
            return codec, codec.prepare(leaves[index].tensor, references[index], context), figures

        tried = parallel_map_sized(encode, candidates, [leaf_nbytes(leaves[i]) for i, _, _ in candidates])
        for (index, _, _), (codec, result, figures) in zip(candidates, tried):
            if index not in encoded or encoded_size(result) < encoded_size(encoded[index]):
                codecs[index], encoded[index], stats[index] = codec, result, figures

    def _check_stored_weights(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        codecs: list[Codec],
        weights: "_WeightPlan",
        encoded: dict[int, Any],
    ) -> None:
        """Measure what the stored weights lose; re-encode without stickiness if over budget."""
        record = weights.record
        stored = weights.stored_quality(encoded)
        record.stored_quality, record.stickiness = stored, self.stickiness
        sticky = [i for i in weights.indices if isinstance(codecs[i], DynaQuantDeltaCodec) and self.stickiness > 0]
        if sticky and record.quality:
            self._memory.inflation = max(stored / record.quality, 1.0) if record.quality > 0 else None
        if stored <= weights.budget or not sticky:
            return
        for index in sticky:
            codec = codecs[index]
            plain = type(codec).from_config({**codec.get_config(), "stickiness": 0.0})
            weights.stats[index] = EntropyStats()  # the figures of the encoding stored
            plain._hints = {**codec._hints, "stats": weights.stats[index]}  # noqa: SLF001 - same hints, no stickiness
            codecs[index] = plain
        again = parallel_map_sized(
            lambda i: codecs[i].prepare(leaves[i].tensor, references[i]), sticky, [leaf_nbytes(leaves[i]) for i in sticky]
        )
        encoded.update(zip(sticky, again))
        record.stored_quality, record.stickiness = weights.stored_quality(encoded), 0.0

    def _trial(
        self, leaves: Sequence[TensorLeaf], layout: StateLayout, index: int, change: Optional[torch.Tensor] = None
    ) -> WeightTrial:
        """The sketch of weight ``index`` (or of its ``change`` since the reference) that
        answers trial configurations, with the proxy's Fisher weights and sensitivity."""
        watch = self._memory.watch
        leaf = leaves[index]
        gradient = watch.gradient_average(leaf) if watch.watching else None
        second = _second_moment_of(leaves, layout, index)
        fisher = None
        if second is not None:
            fisher = leaves[second].tensor.detach()
        elif gradient is not None:
            fisher = gradient.float() ** 2
        sensitivity = None
        if gradient is not None and change is None:
            sensitivity = (gradient.float() * leaf.tensor.detach().float()).abs()
        layer_type = (watch.layer_type(leaf) if watch.watching else None) or _guess_layer_type(leaf)
        values = leaf.tensor if change is None else change
        trial = WeightTrial(values, layer_type, fisher, sensitivity, self.sigma)
        if not torch.isfinite(trial.mass).all() or not torch.isfinite(torch.tensor(trial.total)):
            trial = WeightTrial(values, layer_type, None, sensitivity, self.sigma)
        return trial

    def _change_codecs(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        indices: list[int],
        trials: dict[int, WeightTrial],
        allowed: dict[int, float],
        stats: dict[int, EntropyStats],
        moved: dict[int, float],
        shares: Optional[dict[int, float]] = None,
        refining: Optional[dict[int, float]] = None,
    ) -> list[tuple[int, Optional[ResidualCodec]]]:
        """The codec of each weight in ``indices`` stored as its change since the reference
        (its entropy figures into ``stats``), with the number of levels it takes; None for a
        change that levels within its share cannot hold (:meth:`_plain_change_codecs`). ``moved``:
        the summed squared change of each, where known; ``shares``: the share of its squared
        size each change loses, where already chosen (:meth:`_change_shares`); ``refining``:
        see :meth:`_change_errors`.

        With ``residual_error`` (the default) the change is rounded to evenly spaced levels,
        ``sqrt(12 * residual_error)`` times its RMS apart, so that the rounding costs about
        ``residual_error`` of its squared size. Otherwise :meth:`_residual_codec` judges
        each change on the ``residual_bins`` grid; with a single level count nothing is
        judged per tensor (:meth:`_plain_change_codecs`).
        """
        if self.residual_error is None and len(self.residual_bins) > 1:
            return parallel_map_sized(
                lambda i: self._residual_codec(leaves, references, layout, i, trials[i], allowed[i], stats[i]),
                indices, [leaf_nbytes(leaves[i]) for i in indices],
            )
        if shares is None:
            shares = self._change_shares(leaves, references, indices, trials, allowed, moved, refining)
        return self._plain_change_codecs(leaves, references, indices, stats, shares=shares)

    def _change_shares(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        indices: list[int],
        trials: dict[int, WeightTrial],
        allowed: dict[int, float],
        moved: dict[int, float],
        refining: Optional[dict[int, float]] = None,
    ) -> Optional[dict[int, float]]:
        """The share of its squared size each change in ``indices`` loses on its evenly
        spaced levels (:meth:`_change_errors`), none more than its ``allowed`` budget; None
        where changes are judged on ``residual_bins`` instead (``residual_error=None``)."""
        if self.residual_error is None:
            return None
        # A change that loses more than its own budget is not stored as one: the most a
        # pooled spacing may give it, converted to a share of the change's squared size
        # (plain error; POOLED_BUDGET_MARGIN of the budget).
        caps = {i: POOLED_BUDGET_MARGIN * allowed[i] * trials[i].total_plain for i in indices if i in allowed}
        # The mean of each weight's Fisher diagonal (the proxy's weights), where it has one.
        fisher = {i: trials[i].mean_weight for i in indices if trials[i].weights is not None}
        return self._change_errors(
            leaves, references, indices, [leaf_nbytes(leaves[i]) for i in indices], caps, moved, fisher, refining
        )

    def _plain_change_codecs(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        indices: list[int],
        stats: dict[int, EntropyStats],
        shares: Optional[dict[int, float]] = None,
    ) -> list[tuple[int, Optional[ResidualCodec]]]:
        """Like :meth:`_change_codecs`, with nothing judged per tensor: each change on evenly
        spaced levels (``residual_error``; ``shares``: the share each loses, else pooled
        without caps; None for a change whose levels would not reach its largest value), or
        on ``residual_bins[0]`` k-means levels fitted for all the changes side by side, each
        exactly the fit its encode would run alone (one k-means of a few thousand histogram
        points is mostly per-operation overhead)."""
        sizes = [leaf_nbytes(leaves[i]) for i in indices]
        bins = self.residual_bins[0]
        inner = DynaQuantCodec(bins=bins, prune=0.0, protect=0.0, sigma=self.sigma)
        # No keys hint: the encode computes the change's keys again (one cheap pass), so the
        # keys of every change are not held at once until the encodes.
        if self.residual_error is not None:
            errors = shares if shares is not None else self._change_errors(leaves, references, indices, sizes, {}, {})
            factor_errors = errors if self.low_rank_changes else {}
            plans = parallel_map_sized(
                lambda i: change_plan(leaves[i].tensor, references[i], factor_errors.get(i)), indices, sizes
            )
            coded: list[tuple[int, Optional[ResidualCodec]]] = []
            for index, (histogram, rms, largest, factors) in zip(indices, plans):
                if not levels_reach(rms, largest, errors[index]):
                    # Levels that fine cannot reach its largest value (a share near 0: a
                    # weight of next to no size of its own, or a budget of 0): the change
                    # would be clipped to the last level.
                    coded.append((0, None))
                    continue
                # The levels' spacing follows the change; with factors, the levels reach as
                # far as what their product leaves (and their cells' means describe it).
                centroids, prune_below = step_levels(histogram, rms, largest, errors[index], self.cell_means)
                hinted = inner.with_hints(counts=histogram, centroids=centroids, prune_below=prune_below, stats=stats[index])
                if factors is None:
                    coded.append((centroids.numel(), ResidualCodec(hinted)))
                else:
                    coded.append((centroids.numel(), LowRankResidualCodec(hinted, factors.rank).with_factors(factors)))
            return coded
        counts = parallel_map_sized(lambda i: change_plan(leaves[i].tensor, references[i])[0], indices, sizes)
        levels = fit_centroids_batch([inner.centroid_fit(histogram) for histogram in counts])
        return [
            (bins, ResidualCodec(inner.with_hints(counts=histogram, centroids=centroids, stats=stats[index])))
            for index, histogram, centroids in zip(indices, counts, levels)
        ]

    def _change_errors(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        indices: list[int],
        sizes: list[int],
        caps: dict[int, float],
        moved: dict[int, float],
        fisher: Optional[dict[int, float]] = None,
        refining: Optional[dict[int, float]] = None,
    ) -> dict[int, float]:
        """The share of its squared size each change in ``indices`` loses on its evenly
        spaced levels: ``residual_error`` each, or with ``pooled_error`` the shares that put
        the changes on one spacing and lose ``residual_error`` of their summed squared size
        all together. A change that moved less than their mean square loses a larger share
        of itself, one that moved more a smaller share; none more than ``movement_share``
        or the squared error ``caps`` allows it (by leaf index), the others then sharing
        what is left (:func:`~.even_levels.pooled_shares`). ``moved``: the summed squared
        change of each, where already known.

        With ``fisher_pooling`` and a mean Fisher diagonal for every change (``fisher``, by
        leaf index), each change's squared size is weighed by it: the shares then put
        each change's values at a squared error inversely proportional to its Fisher
        mean, and the Fisher-weighted error lost is ``residual_error`` of the changes'
        Fisher-weighted squared size, as with each change at ``residual_error``.

        ``refining`` (by leaf index): the squared size of the training change of each
        weight whose change here also holds a carried error too large to keep (the rest of
        its change). Such a change is pooled as it is, and then loses at least
        ``refine_error`` times that training change's squared size (within its limits): the
        error it is left with is then the kind a delta carries, not a pooled share of the
        error it codes away (with ``refine_error=None``, ``refining`` is ignored). (Pooled
        with its training change's size instead, it took its whole size out of the pool's
        budget and every other change came out finer.)
        """
        error = self.residual_error
        assert error is not None
        planned = set(indices) if self.refine_error is not None else set()
        refining = {i: energy for i, energy in (refining or {}).items() if i in planned and energy > 0}
        pooled = self.pooled_error and len(indices) >= 2
        if not pooled and not refining and not caps:
            return dict.fromkeys(indices, error)
        totals = parallel_map_sized(
            lambda i: moved[i] if i in moved else change_energy(leaves[i].tensor, references[i]), indices, sizes
        )
        most = max(error, self.movement_share)
        # Each change's largest share of itself.
        limits = {
            index: min(most, caps.get(index, math.inf) / energy) if energy > 0 else error
            for index, energy in zip(indices, totals)
        }
        if not pooled:
            # Each at ``residual_error``, none over its limit (a change alone, or not pooled).
            shares = {index: min(error, limits[index]) for index in indices}
        else:
            energies = totals
            if self.fisher_pooling and fisher and all(fisher.get(i, 0.0) > 0 for i in indices):
                energies = [energy * fisher[i] for i, energy in zip(indices, energies)]
            shares = dict(zip(indices, pooled_shares(
                energies, [leaves[i].tensor.numel() for i in indices], error, [limits[i] for i in indices]
            )))
        for index, total in zip(indices, totals):
            if index in refining:
                floor = min(limits[index], self.refine_error * refining[index] / total)  # type: ignore[operator]
                shares[index] = max(shares[index], floor)
        return shares

    def _residual_codec(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        index: int,
        weight: WeightTrial,
        allowed: float,
        stats: EntropyStats,
    ) -> tuple[int, ResidualCodec]:
        """``(levels, codec)``: weight ``index`` stored as its change since the reference, on
        the fewest of ``residual_bins`` levels whose error stays within ``allowed``
        (relative to the weight, as the search judges it); the first (most) when none does.
        ``stats`` collects the entropy figures of its encoding.

        Such a weight moved less than its own levels' spacing, and its budget is a share
        of that movement (``movement_share``, 0.1). The default grid is one entry, 10 levels
        (on MiniLM 12 levels left ~0.02-0.08 of a change's squared size as error, 8 up to
        ~0.14), whose levels :meth:`_change_codecs` fits without this: a search for fewer
        levels per tensor saved more bytes there but cost accuracy
        (docs/dynaquant-measurements.md), so it is an option.
        """
        tensor = leaves[index].tensor.detach()
        compute = working_dtype(tensor.dtype)
        reference = references[index].detach().to(tensor.device)  # type: ignore[union-attr]
        # The residual exactly as ResidualCodec takes it, so the hints below describe it.
        change = tensor.reshape(-1).to(compute) - reference.reshape(-1).to(compute)
        trial = self._trial(leaves, layout, index, change)
        # Both of the weight's relative errors (plain and Fisher-weighted) within ``allowed``,
        # in units of the change's own energy: the stricter of the two conversions.
        bound = allowed * min(
            weight.total_plain / max(trial.total_plain, 1e-300), weight.total / max(trial.total, 1e-300)
        )
        bins = self.residual_bins[0]
        chosen = trial.run(TrialConfig(bins=bins, prune=0.0, protect=0.0), 0)
        for fewer in self.residual_bins[1:]:
            if chosen.error > bound:
                break  # the most levels already miss it: they are what is stored
            result = trial.run(TrialConfig(bins=fewer, prune=0.0, protect=0.0), 0)
            if result.error > bound:
                break
            bins, chosen = fewer, result
        table = chosen.table
        inner = DynaQuantCodec(bins=bins, prune=0.0, protect=0.0, sigma=self.sigma)
        return bins, ResidualCodec(inner.with_hints(
            counts=trial.counts, centroids=table.centroids(), prune_below=table.prune_below,
            protect_above=table.protect_above, stats=stats,
        ))

    def _frozen(self, leaves: Sequence[TensorLeaf], layout: StateLayout, indices: list[int]) -> tuple[list[int], set[int]]:
        """The weights that training does not change, and those of them the watch vouches for.

        A parameter of the watched model is frozen when it does not require grad at this
        save. Any other weight (nothing watched, a second model in the state, a watched
        model since replaced) is frozen when it has no optimizer state and the state pairs
        optimizer entries with weights at all (a bare model: every weight).
        """
        watch = self._memory.watch
        has_optimizer = any(role is not TensorRole.WEIGHT and role is not TensorRole.OTHER for role in layout.roles)
        # Optimizer entries that could not be matched to weights at all: assume all train.
        by_optimizer_state = any(layout.parameter_of) or not has_optimizer
        frozen: list[int] = []
        vouched: set[int] = set()
        for i in indices:
            trains = watch.trains(leaves[i]) if watch.watching else None
            if trains is None:
                if by_optimizer_state and not layout.optimizer_state_of(i):
                    frozen.append(i)
            elif not trains:
                frozen.append(i)
                vouched.add(i)
        return frozen, vouched

    def _unchanged(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        watched_frozen: set[int],
    ) -> set[int]:
        """The weights to store as their reference: those the watched model does not train
        whose relative squared distance from the reference is within the frozen budget.

        Their reference is what the previous checkpoint stored, so this keeps them on the
        levels they were stored with, as the search would, without re-coding them (MiniLM:
        21 frozen tensors, a third of a chain restore's decoding). A frozen weight given new
        values since (loaded by hand) is over the budget and quantized again.
        """
        # With ``evaluate`` the tolerance is in its units: the frozen budget stands alone.
        tolerance = self.tolerance if self.evaluate is None else math.inf
        bound = min(self.frozen_tolerance, tolerance) * PROXY_SCALE
        unchanged = set()
        for index in watched_frozen:
            tensor = leaves[index].tensor.detach()
            reference = usable_reference(tensor, references[index])
            if reference is None:
                continue
            flat = tensor.float().reshape(-1)
            difference = flat - reference.detach().to(tensor.device).float().reshape(-1)
            # One temporary of the tensor's size (float64 copies would be two of twice it).
            energy, distance = float(torch.dot(flat, flat)), float(torch.dot(difference, difference))
            if not (math.isfinite(energy) and math.isfinite(distance)):
                # Squares beyond float32 (values over ~1e19): inf <= inf would call a weight
                # scaled by 1e30 unchanged. Sums in float64 hold them (or stay inf for inf).
                energy, distance = sum_of_squares(flat), sum_of_squares(difference)
            if distance <= bound * energy and math.isfinite(energy):
                unchanged.add(index)
        return unchanged

    def _plan_weights(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        eligible: list[bool],
        codecs: list[Codec],
        change_stats: dict[int, EntropyStats],
        refining: dict[int, float],
        afresh: bool = False,
    ) -> Optional["_WeightPlan"]:
        """The codec of each weight; ``change_stats`` gets the entropy figures of the weights
        stored as their change because no levels of their own keep them within budget.
        ``refining``: the weights whose delta codes a carried error away, with the squared
        size of their training change (:meth:`_change_errors`). ``afresh``: a full
        checkpoint of a continuing run (``new_chain``), searched as a run's first."""
        indices = [i for i in layout.indices(TensorRole.WEIGHT) if eligible[i]]
        if not indices:
            return None
        started = time.perf_counter()
        # A weight the watched model does not train, still within the frozen budget of its
        # reference, is stored as that reference: no sketch, no search, no bytes.
        # Weights without optimizer state are frozen (or the state is a bare model): their
        # error is never trained away, so they get the tighter budget.
        frozen, watched_frozen = self._frozen(leaves, layout, indices)
        unchanged = self._unchanged(leaves, references, watched_frozen)
        for index in unchanged:
            codecs[index] = UnchangedCodec()
        indices = [i for i in indices if i not in unchanged]
        if not indices:
            return None
        frozen = [i for i in frozen if i not in unchanged]
        keys = {i: format_key_path(leaves[i].path) for i in indices}
        # Sketching reads every element of every weight: the large tensors are shared out
        # between threads (parallel_map_sized); the dict keeps the leaf order the search
        # depends on.
        sketched = dict(zip(indices, parallel_map_sized(
            lambda i: self._trial(leaves, layout, i), indices, [leaf_nbytes(leaves[i]) for i in indices]
        )))
        trials = {i: sketched[i] for i in indices}
        # A full checkpoint of a continuing run is searched as a run's first: what the search
        # remembers (its last point, each weight's bins as floors, warm-start centroids)
        # serves the deltas of a chain. The floors guard values restored into the same
        # process, which look easy (the manager does not call new_chain then, nor for a
        # re-based step); kept at a continuing run's full checkpoints they made its second
        # one larger than a new process's of the same state (a test model: 5,309 against
        # 4,278 B; docs/dynaquant-measurements.md, *Full checkpoints searched afresh*).
        whole = afresh and all(usable_reference(leaves[i].tensor, references[i]) is None for i in indices)
        init = {} if whole else {i: self._memory.centroids[keys[i]] for i in indices if keys[i] in self._memory.centroids}
        budget = self.tolerance * (PROXY_SCALE if self.evaluate is None else 1.0)
        inflation = 1.0
        if self.stickiness > 0:
            # Leave room for what stickiness adds to the nearest-level error of a delta, as
            # measured on the last one (a guess before the first). Full checkpoints get the
            # same room, so the next delta's search starts from a point that still fits.
            inflation = self._memory.inflation or 1.0 + 1.3 * self.stickiness
        # A weight the watched model does not train has not moved: what separates it from
        # its reference is the reference's own error, which the frozen budget bounded when
        # it was stored. Bounding it by that "movement" would re-code the error at every
        # delta (MiniLM: its frozen layers were 31 % of every delta step).
        movable = [i for i in indices if i not in watched_frozen]
        movement, moved = self._movement_budgets(leaves, references, trials, movable)
        scales: dict[int, float] = {}
        caps: dict[int, float] = {}
        if self.evaluate is None:
            # Under the proxy, a weight's budget is its share of ``budget``.
            scales = {i: min(self.frozen_tolerance / self.tolerance, 1.0) for i in frozen}
            for index, share in movement.items():
                scales[index] = min(scales.get(index, 1.0), share / budget)
        else:
            # ``evaluate`` judges the model now; what it cannot see stays bounded in the
            # proxy's units: a frozen weight's error, which training never removes, and what
            # a restore takes from a moved weight's change (without these a fine-tune's
            # first checkpoint, whose untrained head hides the encoder's damage, pruned 30 %
            # of MiniLM's frozen layers).
            caps = {i: self.frozen_tolerance * PROXY_SCALE for i in frozen}
            for index, share in movement.items():
                caps[index] = min(caps.get(index, math.inf), share)
        cube = ConfigurationCube(
            trials, leaves, self.bins, self.embedding_bins, self.prune, self.protect, budget / inflation,
            self.evaluate, init, scales, caps,
        )
        hard: list[int] = []
        residual: list[int] = []
        residual_levels: dict[int, int] = {}  # levels -> residual-coded weights stored with them
        if self.evaluate is None or caps:
            # Every tensor's own budget is judged alone: one that misses it even at the least
            # aggressive point is stored another way, instead of failing the search (and so
            # the quantization) of all the others: as its quantized change since the
            # reference when it moved (levels of its own values cannot hold a change smaller
            # than their spacing), else losslessly.
            origin = tuple(0 for _ in cube.shape)
            hard = [i for i, ok in zip(indices, cube.within_own_budgets(indices, origin, MAGNITUDE)) if not ok]
            residual = [i for i in hard if i in moved]
            allowed = {i: cube.own_budget(i) for i in residual}
            figures = {i: change_stats.setdefault(i, EntropyStats()) for i in residual}
            coded = self._change_codecs(leaves, references, layout, residual, trials, allowed, figures, moved, refining=refining)
            for index, (levels, codec) in zip(residual, coded):
                if codec is None:
                    continue  # stays lossless: no levels within its budget reach its change
                codecs[index] = codec
                residual_levels[levels] = residual_levels.get(levels, 0) + 1
            if hard:
                indices = [i for i in indices if i not in hard]
                if not indices:
                    self._memory.searches.append(SearchRecord(
                        kind="none", evaluations=0, seconds=time.perf_counter() - started,
                        config={
                            "lossless_tensors": len(hard) - len(residual), "residual_tensors": len(residual),
                            "residual_tensors_by_bins": dict(sorted(residual_levels.items())),
                        },
                        quality=None, feasible=False,
                    ))
                    return None
                trials = {i: trials[i] for i in indices}
                cube = ConfigurationCube(
                    trials, leaves, self.bins, self.embedding_bins, self.prune, self.protect, budget / inflation,
                    self.evaluate, init, scales, caps,
                )
        point, metric, kind = cube.search(None if whole else self._memory.best, self.neighbourhood,
                                          not self.precision_only_grows)
        floors = {}
        if self.precision_only_grows and not whole:
            floors = {i: self._memory.bins[keys[i]] for i in indices if keys[i] in self._memory.bins}
        refinements = cube.refine(point, metric, floors) if point is not None else 0
        record = SearchRecord(
            kind=kind,
            evaluations=cube.evaluations + refinements,
            seconds=time.perf_counter() - started,
            config=self._describe(cube, point, metric, indices, hard, residual_levels) if point is not None else {},
            quality=cube.quality(point, metric) if point is not None else None,
            feasible=point is not None,
        )
        self._memory.searches.append(record)
        if point is None:
            return None  # nothing meets the tolerance: the weights stay lossless this time
        self._memory.best = (point, metric)
        # Each weight's entropy figures are held apart until its encoding is chosen (a moving
        # weight may be stored as its change instead).
        stats = {index: EntropyStats() for index in indices}
        for index in indices:
            result = cube.result(index, point, metric)
            trial = trials[index]
            self._memory.bins[keys[index]] = cube.config(index, point, metric).bins
            table = result.table
            self._memory.centroids[keys[index]] = table.centroids()
            reference = usable_reference(leaves[index].tensor, references[index])
            codec_type = DynaQuantDeltaCodec if reference is not None else DynaQuantCodec
            codec = codec_type(
                bins=cube.config(index, point, metric).bins, prune=0.0, protect=0.0,
                sigma=self.sigma, stickiness=self.stickiness if reference is not None else 0.0,
            )
            codecs[index] = codec.with_hints(
                keys=trial.keys,
                counts=trial.counts,
                centroids=table.centroids(),
                prune_below=table.prune_below,
                protect_above=table.protect_above,
                prune_mask=result.prune_mask,
                protect_mask=result.protect_mask,
                stats=stats[index],
            )
        return _WeightPlan(indices, trials, cube, record, budget, self.evaluate, scales, moved, stats, refining)

    @staticmethod
    def _describe(
        cube: ConfigurationCube, point: Point, metric: str, indices: list[int], hard: list[int],
        residual_levels: dict[int, int],
    ) -> dict[str, Any]:
        config = cube.describe(point, metric)
        residual = sum(residual_levels.values())
        config["lossless_tensors"] = len(hard) - residual
        config["residual_tensors"] = residual
        config["residual_tensors_by_bins"] = dict(sorted(residual_levels.items()))
        tensors: dict[int, int] = {}
        for index in indices:
            bins = cube.config(index, point, metric).bins
            tensors[bins] = tensors.get(bins, 0) + 1
        config["tensors_by_bins"] = dict(sorted(tensors.items()))
        return config

    def _movement_budgets(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        trials: dict[int, WeightTrial],
        indices: list[int],
    ) -> tuple[dict[int, float], dict[int, float]]:
        """For each weight that moved since its reference: ``movement_share`` of its squared
        change relative to its energy, the most of its proxy error a restore may lose; and
        that squared change.

        After a restore the run continues from the stored values: an element that moved
        less than its cell since the last checkpoint is put back on its old level, and the
        training since is lost. Over the benchmark's 10 restores a fine-tune whose steps
        are far smaller than the cells (MiniLM: 1e-5..1e-4 of the weights' energy per
        checkpoint, below the 1.5e-4 error of 128 levels) lost half its accuracy.
        """
        budgets: dict[int, float] = {}
        squared: dict[int, float] = {}
        for index in indices:
            tensor = leaves[index].tensor
            reference = usable_reference(tensor, references[index])
            if reference is None:
                continue
            difference = tensor.detach().float() - reference.detach().to(tensor.device).float()
            moved = float(torch.dot(difference.reshape(-1), difference.reshape(-1)))
            # Unchanged (nothing to lose), or not finite: a weight holding NaN or inf (or
            # whose reference does) is not stored as its change, which cannot hold them.
            if not (moved > 0 and math.isfinite(moved)):
                continue
            budgets[index] = self.movement_share * moved / max(trials[index].total_plain, 1e-300)
            squared[index] = moved
        return budgets, squared


def _drop_prepared(codec: Codec) -> None:
    """Let a codec the plan no longer stores with forget its kept encoding (a whole
    reconstruction among it): another object may still hold the codec until the plan ends."""
    if isinstance(codec, PreparedEncoding):
        codec.drop_prepared()


@dataclass
class _WeightPlan:
    """The weights one save quantizes, and how to judge what was stored for them."""

    indices: list[int]
    trials: dict[int, WeightTrial]
    cube: ConfigurationCube
    record: SearchRecord
    budget: float
    evaluate: Optional[Callable[[dict[str, torch.Tensor]], float]]
    scales: dict[int, float]
    #: the weights that moved since their reference (each has a movement budget): their
    #: summed squared change
    moved: dict[int, float]
    #: each weight's entropy figures, of the encoding to be stored
    stats: dict[int, EntropyStats]
    #: the weights whose delta codes a carried error away: their training change's squared size
    refining: dict[int, float]

    def stored_quality(self, encoded: dict[int, Any]) -> float:
        """The quality measure of the weights as stored (the proxy, or ``evaluate``)."""
        if self.evaluate is not None:
            return self.cube.relative_loss({i: encoded[i].reconstruction for i in self.indices})
        return max((self.error(i, encoded[i]) / self.scales.get(i, 1.0) for i in self.indices), default=0.0)

    def within_own_budget(self, index: int, encoded: Encoded) -> bool:
        """Whether weight ``index`` as ``encoded`` stays within the error it may have alone."""
        return self.error(index, encoded) <= self.cube.own_budget(index)

    def error(self, index: int, encoded: Encoded) -> float:
        """The proxy's relative error of weight ``index`` as ``encoded``: the larger of the
        plain and the Fisher-weighted one."""
        return self.error_of(index, encoded.reconstruction)

    def error_of(self, index: int, reconstruction: torch.Tensor) -> float:
        """:meth:`error` of weight ``index`` stored as ``reconstruction``."""
        trial = self.trials[index]
        rebuilt, original = reconstruction.reshape(-1).float(), trial.flat.float()
        plain, weighted = squared_differences(rebuilt, original, trial.weights)
        if not math.isfinite(plain):  # non-finite weights are stored exactly (protected)
            difference = rebuilt - original
            difference = torch.where(torch.isfinite(difference), difference, 0.0)
            plain, weighted = squared_differences(difference, None, trial.weights)
        error = plain / max(trial.total_plain, 1e-300)
        if weighted is not None:
            error = max(error, weighted / max(trial.total, 1e-300))
        return error
