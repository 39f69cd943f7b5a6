"""DynaQuant: the Inshrinkerator system plus compressed optimizer state (the default policy).

Per checkpoint:

1. **Weights** (floating model parameters of at least ``min_numel`` values): a
   configuration search (:mod:`.dynaquant_search`) picks bins, embedding bins, prune
   fraction, prune metric (magnitude ``|w|`` or sensitivity ``|g w|``) and protect
   fraction: the most compressive point whose quality stays within ``tolerance``.
   Quality is the user's ``evaluate(model_state_dict)`` (lower is better; relative
   change at most ``tolerance``) when given, else a proxy: every weight tensor's
   relative reconstruction error, plain ``sum((w_hat - w)^2) / sum(w^2)`` and
   Fisher-weighted ``sum(F (w_hat - w)^2) / sum(F w^2)`` (``F`` the paired Adam second
   moment, or the squared gradient average of a watched model), must stay below
   ``tolerance * PROXY_SCALE`` (calibrated on the benchmark workloads:
   docs/dynaquant.md), and below ``movement_share`` of the tensor's squared change
   since the reference (else a restore would undo the training since). The first
   checkpoint runs a guided search of the whole cube; later ones search around the
   previous best (never more aggressive, and no tensor gets fewer bins than before)
   and fall back to an exhaustive search when nothing near it is feasible; then each
   tensor takes the fewest bins that keep its own error within budget. Prune
   thresholds are shared per layer type. Weights are stored by
   :class:`~inshrinkerator.codecs.DynaQuantDeltaCodec` against the previous
   reconstruction (:class:`~inshrinkerator.codecs.DynaQuantCodec` in a full
   checkpoint); one that misses its budget at every grid point is stored as its
   quantized change since the reference (``ResidualCodec``) when it moved, else
   losslessly.
2. **First moments** (Adam ``exp_avg``, SGD and RMSprop ``momentum_buffer``): the symmetric levels
   ``0, +-c_1, ..., +-c_k`` (``k = moment_bins // 2``, ``momentum_bins // 2`` for SGD), so no entry changes sign or more
   than doubles, coded without a reference (moments decorrelate between saves). Pruning in
   ExCP's spirit: at a checkpoint at least ``first_moment_keep_after`` optimizer steps
   after the one before it, ``exp_avg`` keeps only the ``first_moment_keep`` fraction with
   the largest ``|m| / sqrt(v)``; with ``joint_moment_mask`` (the default) the others'
   second moments may be stored as 0 too, when that is the smaller encoding, so that
   their whole optimizer state restarts from 0 after a restore (pruning at every
   checkpoint cost 4% accuracy on the MiniLM fine-tune, which checkpoints every 10 steps;
   docs/dynaquant.md). ``momentum_keep`` prunes a momentum buffer to its largest 10 % by
   magnitude at the same checkpoints (for SGD, which keeps no step counters, the watched
   model's backward passes count the steps; unwatched, nothing is pruned).
3. **Second moments** (Adam's ``exp_avg_sq``; RMSprop's and Adadelta's ``square_avg``,
   Adagrad's ``sum``) and the optimizers' other non-negative statistics (AMSGrad's
   ``max_exp_avg_sq``, Adamax's ``exp_inf``, Adadelta's ``acc_delta``; see
   :mod:`.state_layout`; one holding a negative value is not what its name says and
   stays exact): ``second_moment_bins`` positive levels fitted in
   the log2 domain (exact zeros stay zero; the largest 0.5% kept in bf16: they are the
   most active parameters, whose restored steps must not grow), delta-coded like the
   weights; or, with
   ``second_moment="factored"``, the row and column means of each matrix (Adafactor's
   estimate, :class:`~inshrinkerator.codecs.FactoredMomentCodec`).
4. Everything else — step counters, ``param_groups``, integer tensors, buffers,
   tensors smaller than ``min_numel`` — is stored losslessly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..codecs import Codec, ResidualCodec
from ..codecs.base import Encoded, same_bits
from ..codecs._parallel import parallel_map_sized
from ..codecs.bucket_delta import EntropyStats
from ..codecs.dynaquant import (
    DynaQuantCodec,
    DynaQuantDeltaCodec,
    DynaQuantGroupedCodec,
    DynaQuantMaskedCodec,
    DynaQuantMaskedDeltaCodec,
)
from ..codecs.factored_moment import FactoredMomentCodec, factored_shape
from ..codecs.unchanged import UnchangedCodec
from ..codecs.dynaquant import magnitude_thresholds
from ..codecs.prepared import PreparedEncoding
from ..codecs.lossy_input import working_dtype
from ..codecs.log_sketch import MAGNITUDE_KEYS, SIGNED_KEYS, magnitude_keys, signed_keys
from ..codecs.nonuniform_quantizer import FIRST_NON_FINITE_KEY, LOG, LevelTable, fit_centroids_batch, key_centres
from ..codecs.weighted_kmeans import KMeansProblem, float32_levels_batch, histogram_sample_weights
from ..tree import KeyPath, TensorLeaf, format_key_path
from .base import ParamGroupPolicy
from .dynaquant_search import ConfigurationCube, Point
from .gradient_watch import GradientWatch
from .lossless import Lossless
from .quantization_trials import MAGNITUDE, TrialConfig, WeightTrial, quantile_key
from .state_layout import StateLayout, TensorRole, layout_of, optimizer_entry_name

__all__ = ["DynaQuant", "PROXY_SCALE", "SearchRecord"]

#: Without ``evaluate``, the proxy must stay below ``tolerance * PROXY_SCALE``.
PROXY_SCALE = 1.0

#: The joint moment mask is used where a restart grows Adam's steps at most this much
#: (:func:`restart_step_growth`): the first moment's levels never more than double an
#: entry either.
RESTART_STEP_GROWTH = 2.0
_RESTART_HORIZON = 10_000
_FIRST_ORDER = (TensorRole.FIRST_MOMENT, TensorRole.MOMENTUM_BUFFER)
#: Non-negative optimizer statistics, coded in the log domain.
_POSITIVE = (TensorRole.SECOND_MOMENT, TensorRole.ACCUMULATOR)
_MOMENTS = _FIRST_ORDER + _POSITIVE
#: Fraction of each second moment (its largest entries) kept in 16 bits.
SECOND_MOMENT_PROTECT = 0.005
#: Level-count factor of the moments of tensors under ``min_numel`` (biases, norm layers).
SMALL_MOMENT_LEVEL_FACTOR = 2
#: The most levels a moment may have (the knobs' bound, and the factor's cap).
MAX_MOMENT_BINS = 1024


@dataclass
class SearchRecord:
    """What one save's configuration search did; its cost is ``evaluations`` and ``seconds``."""

    kind: str  # "guided", "neighbourhood" or "neighbourhood+exhaustive"
    evaluations: int
    seconds: float
    config: dict[str, Any]
    quality: Optional[float]  # of the nearest-level quantization the search judged
    feasible: bool
    stored_quality: Optional[float] = None  # of what was stored (stickiness included)
    stickiness: float = 0.0  # what the deltas used (0 after a fallback)


@dataclass
class _Memory:
    """What the policy remembers between saves (not part of its identity)."""

    watch: GradientWatch = field(default_factory=GradientWatch)
    best: Optional[tuple[Point, str]] = None
    centroids: dict[str, torch.Tensor] = field(default_factory=dict)
    searches: list[SearchRecord] = field(default_factory=list)
    entropy: EntropyStats = field(default_factory=EntropyStats)
    #: stored proxy error / nearest-level proxy error of the last delta (stickiness's cost)
    inflation: Optional[float] = None
    #: weight key -> bins it was last stored with (the floor when precision only grows)
    bins: dict[str, int] = field(default_factory=dict)
    #: the optimizer's ``step`` counter at the last save planned (None: none yet, or no counters)
    optimizer_steps: Optional[int] = None
    #: the watch's backward passes at the last save planned (None: none yet, or nothing watched)
    watched_steps: Optional[int] = None


def _guess_layer_type(leaf: TensorLeaf) -> str:
    if "embed" in format_key_path(leaf.path).lower():
        return "embedding"
    dims = leaf.tensor.dim()
    return "conv" if dims >= 3 else "linear" if dims == 2 else "vector"


def _check_grid(name: str, values: Any, kind: type, low: float, high: float) -> None:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty tuple, got {values!r}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (kind, int)) or not low <= value <= high:
            raise ValueError(f"{name}: {value!r} is not a {kind.__name__} in [{low}, {high}]")


def _check_number(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def _usable_reference(tensor: torch.Tensor, reference: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if reference is None or reference.dtype != tensor.dtype or reference.shape != tensor.shape:
        return None
    return reference


def _equal_to_reference(
    leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]], eligible: list[bool]
) -> list[int]:
    """The eligible leaves whose bytes equal their reference's (one comparison pass each)."""
    equal = []
    for index, leaf in enumerate(leaves):
        reference = _usable_reference(leaf.tensor, references[index]) if eligible[index] else None
        if reference is not None and same_bits(leaf.tensor, reference):
            equal.append(index)
    return equal


@dataclass(frozen=True)
class DynaQuant(ParamGroupPolicy):
    """Dynamic non-uniform quantization with a quality-controlled search (the default policy).

    Args:
        tolerance: the relative quality loss one checkpoint may cause (with ``evaluate``),
            or, without it, the largest relative squared error of a weight tensor (the
            proxy, in units of ``PROXY_SCALE``).
        frozen_tolerance: the proxy budget of weights without optimizer state (frozen
            layers, or a bare model): their error is never trained away.
        movement_share: a weight that moved since its reference (the previous checkpoint's
            reconstruction) may lose at most this share of its squared change, with
            ``evaluate`` too: a restore continues from the stored values, so what is lost
            there is training undone. 0.1 kept the MiniLM fine-tune within the benchmark's bound;
            runs that tolerate more (the digits CNNs) store their weights in fewer bytes
            with more (docs/dynaquant.md, *Trading degradation for bytes*).
        evaluate: ``evaluate(model_state_dict) -> float``, lower is better; called on
            quantized models during the search. It decides instead of the proxy, within
            the bounds it cannot see: frozen weights stay within ``frozen_tolerance`` and
            moved ones within ``movement_share`` (in the proxy's units).
        bins, embedding_bins, prune, protect: the search grid, each from the least to the
            most aggressive setting (the paper's grid, extended to finer bins: the benchmark's
            frequent restores need them).
        sigma: k-means sample-weight balance between counts and magnitudes.
        stickiness: how far (in half-cells) an element may drift past its bucket before its
            id changes in a delta; more means smaller deltas and a little more error.
        neighbourhood: search radius around the previous best, in cube steps.
        precision_only_grows: a later checkpoint never stores a weight with fewer bins than
            the one before, nor searches more aggressive neighbours (Inshrinkerator's rule).
            A restore bakes a checkpoint's error into the run; the next save quantizes the
            restored (already quantized) values, which look easy, and going coarser then
            adds new error on top: over the benchmark's 10 restores that compounded.
        moment_bins: non-zero levels of Adam's first moments (symmetric pairs around 0).
        momentum_bins: the same for SGD momentum buffers (the step itself: 4 kept the
            digits SGD run within one test image; 8 cost 12% of its full-state ratio).
        first_moment_keep: fraction of Adam's first moment kept (largest ``|m| / sqrt(v)``;
            1 keeps all) at checkpoints ``first_moment_keep_after`` or more optimizer
            steps after the checkpoint before them (Adam's ``step`` counters tell: the
            reference's at a delta; at a full checkpoint, the last save this policy object
            planned, or the optimizer's start for its first); every entry is kept at the
            others (0: prune at every checkpoint).
        momentum_keep: fraction of an SGD or RMSprop momentum buffer kept (largest
            magnitude), at the checkpoints where ``first_moment_keep`` applies. SGD keeps no
            ``step`` counters: the steps are the backward passes of the watched model (with
            gradient accumulation, several per step: scale ``first_moment_keep_after`` by
            them), and without one every entry is kept (on the digits SGD benchmark, 0.1
            stored 1.28x fewer bytes at the same accuracy; docs/dynaquant.md).
        second_moment_bins: log-domain levels of Adam's second moments (``"quantized"``).
        second_moment: ``"quantized"`` (log-domain levels, delta-coded) or ``"factored"``
            (row and column means, Adafactor's estimate, for tensors of 2+ dims; vectors
            are quantized): far smaller, but it cost up to 1% on the char-GPT benchmark.
        joint_moment_mask: where ``first_moment_keep`` prunes an Adam entry's first moment,
            also encode its second moment with the pruned entries as 0 (ExCP's joint mask)
            and store whichever encoding is smaller. Where the mask wins (second moments
            that change fast between checkpoints: 26 % fewer second-moment bytes on the
            char-GPT benchmark, whose ``beta2`` is 0.95), the pruned entries' optimizer
            state restarts from zero after a restore, and their first steps are larger than
            before it; with the moment whole, only their momentum restarts, and their first
            steps are smaller. Only entries whose param group's ``betas`` keep a restarted
            step within ``RESTART_STEP_GROWTH`` (2x) of its steady size are masked: ``(0.9,
            0.95)`` qualifies (1.95x), ``(0.9, 0.999)`` would reach 14x and does not, nor do
            entries whose ``betas`` are unknown. False keeps every second moment whole
            (docs/dynaquant.md, *Joint moment mask*).
        first_moment_octaves: code an Adam first moment's ids in one stream per octave of
            its second moment as stored (``dynaquant_grouped``), where that second moment
            is not itself stored with the first moment's zeros: the same values in fewer
            first-moment bytes (on the benchmark 8-13 % on the digits CNN, 9 % on MiniLM,
            1-5 % on the char GPT), for ~25 % more time in MiniLM's saves
            (docs/dynaquant.md, *First moment by octave*).
        residual_bins: the levels tried, most first, for a weight that moved less than its
            own levels' spacing and is stored as its change since the reference: it takes
            the fewest whose error stays within its budget (the first when none does). The
            default, 10 alone: on MiniLM's 8 yardstick seeds it ends every run where 12
            levels do, for ~3 % fewer bytes (12 stored 5.5 % fewer than 16 at +0.06 points
            of mean degradation; 8 levels cost +0.26 points; docs/dynaquant.md,
            *Residual levels*).
        min_numel: smaller tensors are stored losslessly (moments: ``moment_min_numel``).
        moment_min_numel: smaller first and second moments are stored losslessly. Those
            of weights under ``min_numel`` (biases, norm layers) get twice the levels and
            are never pruned; stored exactly, they were 6 % of the char GPT benchmark's
            bytes.
    """

    tolerance: float = 0.003
    frozen_tolerance: float = 0.0002
    movement_share: float = 0.1
    evaluate: Optional[Callable[[dict[str, torch.Tensor]], float]] = field(default=None, compare=False)
    bins: tuple[int, ...] = (128, 64, 48, 32, 24, 16, 12, 8, 6, 4)
    embedding_bins: tuple[int, ...] = (128, 64, 32, 16)
    prune: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
    protect: tuple[float, ...] = (0.01, 0.005, 0.0005)
    sigma: float = 1.0
    stickiness: float = 0.0
    neighbourhood: int = 1
    precision_only_grows: bool = True
    moment_bins: int = 8
    momentum_bins: int = 4
    first_moment_keep: float = 0.1
    first_moment_keep_after: int = 30
    momentum_keep: float = 0.1
    second_moment_bins: int = 8
    second_moment: str = "quantized"
    joint_moment_mask: bool = True
    first_moment_octaves: bool = True
    residual_bins: tuple[int, ...] = (10,)
    min_numel: int = 1024
    moment_min_numel: int = 64
    name: str = "dynaquant"
    _memory: _Memory = field(default_factory=_Memory, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_number("tolerance", self.tolerance, 1e-12, 1e6)
        _check_number("frozen_tolerance", self.frozen_tolerance, 1e-12, 1e6)
        _check_number("movement_share", self.movement_share, 1e-12, 1e6)
        if self.evaluate is not None and not callable(self.evaluate):
            raise ValueError("evaluate must be a callable taking a model state_dict and returning a float")
        _check_grid("bins", self.bins, int, 1, 1024)
        _check_grid("embedding_bins", self.embedding_bins, int, 1, 1024)
        _check_grid("prune", self.prune, float, 0.0, 0.99)
        _check_grid("protect", self.protect, float, 0.0, 0.5)
        _check_grid("residual_bins", self.residual_bins, int, 1, 1024)
        _check_number("sigma", self.sigma, 0.0, 1.0)
        _check_number("stickiness", self.stickiness, 0.0, 4.0)
        for knob in ("precision_only_grows", "joint_moment_mask", "first_moment_octaves"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{knob} must be a bool, got {getattr(self, knob)!r}")
        _check_number("first_moment_keep", self.first_moment_keep, 0.0, 1.0)
        _check_number("momentum_keep", self.momentum_keep, 0.0, 1.0)
        after = self.first_moment_keep_after
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"first_moment_keep_after must be an int >= 0, got {after!r}")
        if self.second_moment not in ("factored", "quantized"):
            raise ValueError(f"second_moment must be 'factored' or 'quantized', got {self.second_moment!r}")
        for knob in (
            "neighbourhood", "moment_bins", "momentum_bins", "second_moment_bins", "min_numel", "moment_min_numel"
        ):
            value = getattr(self, knob)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{knob} must be a positive int, got {value!r}")
        for knob in ("moment_bins", "momentum_bins", "second_moment_bins"):
            if getattr(self, knob) > MAX_MOMENT_BINS:
                raise ValueError(f"{knob} must be at most {MAX_MOMENT_BINS}")

    # ------------------------------------------------------------------ public

    def watch(self, model: torch.nn.Module) -> None:
        """Average ``model``'s gradients from now on (sensitivity scores, Fisher weights)."""
        self._memory.watch.attach(model)

    def before_save(self) -> None:
        """Average the gradients of watched layers unfrozen since the last save too."""
        self._memory.watch.hook_unfrozen()

    @property
    def search_log(self) -> list[SearchRecord]:
        """One record per save that searched (evaluations, seconds, chosen configuration)."""
        return list(self._memory.searches)

    @property
    def entropy_stats(self) -> EntropyStats:
        """The entropy stage's bytes against the order-0 entropy of its symbols, so far."""
        return self._memory.entropy

    group_options = ("betas",)  # a class attribute, not a knob

    def plan_grouped(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        param_groups: Optional[dict[KeyPath, list[list[int]]]],
        group_options: Optional[dict[str, dict[int, Any]]] = None,
    ) -> list[Codec]:
        """One codec per leaf; ``group_options["betas"]``: leaf index -> the ``betas`` of the
        param group holding that optimizer entry (read from the state by ``plan_state``;
        the joint moment mask is only used where they are known)."""
        betas = (group_options or {}).get("betas", {})
        codecs = Lossless().plan(leaves, references)
        watch = self._memory.watch
        watch.refresh()
        # The watched model's frozen parameters (and buffers) are no optimizer entry's weight.
        frozen = [
            i for i, leaf in enumerate(leaves)
            if param_groups and watch.watching and leaf.tensor.is_floating_point() and watch.trains(leaf) is False
        ]
        layout = layout_of(leaves, param_groups, frozen)
        eligible = [
            leaf.tensor.dtype.is_floating_point
            and leaf.tensor.numel() >= (self.moment_min_numel if role in _MOMENTS else self.min_numel)
            for leaf, role in zip(leaves, layout.roles)
        ]
        # A tensor bit for bit equal to its reference (a fine-tune's frozen layer saved against
        # its pretrained base) is stored as the reference: exact, and no bytes.
        for index in _equal_to_reference(leaves, references, eligible):
            codecs[index] = UnchangedCodec()
            eligible[index] = False
        weights = self._plan_weights(leaves, references, layout, eligible, codecs)
        steps = self._steps_since_last_checkpoint(leaves, references)
        first_keep = self._keep_at(self.first_moment_keep, steps)
        momentum_keep = self._keep_at(self.momentum_keep, steps)
        choices = self._plan_moments(leaves, references, layout, eligible, codecs, first_keep, momentum_keep, betas)
        # Encode now (the large tensors in parallel): the writer's encode calls then return at
        # once, and the stored weights' real error (stickiness included) can be checked
        # against the budget.
        prepared = [
            (i, codecs[i]) for i in range(len(leaves))
            if isinstance(codecs[i], PreparedEncoding) and not codecs[i].uses_context
        ]
        # A tensor planned to read another's reconstruction (a first moment per octave of its
        # second moment) is encoded right after that one, by the same thread: no thread waits
        # for a whole batch to finish before it can start.
        index_of = {format_key_path(leaf.path): i for i, leaf in enumerate(leaves)}
        readers: dict[int, list[int]] = defaultdict(list)
        for i, codec in enumerate(codecs):
            if codec.uses_context and isinstance(codec, PreparedEncoding):
                readers[index_of[codec.context_key]].append(i)  # type: ignore[attr-defined]

        def prepare_with_context(index: int, codec: Codec, context: Encoded) -> Encoded:
            reference = _reference_for(codec, leaves[index], references[index])
            return codec.prepare(leaves[index].tensor, reference, context.reconstruction)  # type: ignore[attr-defined]

        def prepare(item: tuple[int, Codec]) -> dict[int, Encoded]:
            index, codec = item
            done = {index: codec.prepare(leaves[index].tensor, _reference_for(codec, leaves[index], references[index]))}  # type: ignore[attr-defined]
            for reader in readers.get(index, ()):
                done[reader] = prepare_with_context(reader, codecs[reader], done[index])
            return done

        encoded: dict[int, Encoded] = {}
        with_context: dict[int, Encoded] = {}
        for (index, _), done in zip(prepared, parallel_map_sized(
            prepare, prepared, [_nbytes(leaves[i]) + sum(_nbytes(leaves[r]) for r in readers.get(i, ())) for i, _ in prepared]
        )):
            encoded[index] = done.pop(index)
            with_context.update(done)

        def prepare_all(items: list[tuple[int, Codec, int]]) -> dict[int, Encoded]:
            # (index, codec, the index of its context) for contexts encoded above
            items = [item for item in items if item[2] in encoded]
            return dict(zip((i for i, _, _ in items), parallel_map_sized(
                lambda item: prepare_with_context(item[0], item[1], encoded[item[2]]), items,
                [_nbytes(leaves[i]) for i, _, _ in items],
            )))

        # Then where the joint mask is tried: the second moment with its first moment's zeros.
        with_context.update(prepare_all([(i, choice.joint.codec, choice.first) for i, choice in choices.items()]))
        # Last, where the whole second moment may still win with the grouped first moment,
        # that grouping (the pair decides).
        regrouped = prepare_all([
            (choice.first, choice.first_grouped.codec, i) for i, choice in choices.items()  # type: ignore[union-attr]
            if choice.may_regroup(encoded[i], with_context.get(i), encoded[choice.first])
        ])
        for index, choice in choices.items():
            codecs[index], codecs[choice.first] = choice.settle(
                encoded[index], with_context.get(index), encoded[choice.first], regrouped.get(choice.first),
                self._memory,
            )
        if weights is not None:
            self._store_changes_where_smaller(leaves, references, layout, codecs, weights, encoded)
            self._check_stored_weights(leaves, references, codecs, weights, encoded)
            for stats in weights.stats.values():
                self._memory.entropy.merge(stats)
        return codecs

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
        error no larger (docs/dynaquant.md, *Weights stored as their change*).
        """
        candidates = [
            i for i in weights.indices
            if i in weights.moving and isinstance(codecs[i], DynaQuantDeltaCodec)
            and 8 * _encoded_size(encoded[i]) > CHANGE_TRIAL_BITS * leaves[i].tensor.numel()
        ]
        if not candidates:
            return

        def as_change(index: int) -> tuple[ResidualCodec, Encoded, EntropyStats]:
            stats = EntropyStats()
            _, codec = self._residual_codec(
                leaves, references, layout, index, weights.trials[index], weights.cube.own_budget(index), stats
            )
            return codec, codec.prepare(leaves[index].tensor, references[index]), stats

        changed = 0
        for index, (codec, change, stats) in zip(candidates, parallel_map_sized(
            as_change, candidates, [_nbytes(leaves[i]) for i in candidates]
        )):
            if _encoded_size(change) < _encoded_size(encoded[index]) and weights.within_own_budget(index, change):
                codecs[index], encoded[index], weights.stats[index] = codec, change, stats
                changed += 1
        weights.record.config["change_coded_tensors"] = changed

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
            lambda i: codecs[i].prepare(leaves[i].tensor, references[i]), sticky, [_nbytes(leaves[i]) for i in sticky]
        )
        encoded.update(zip(sticky, again))
        record.stored_quality, record.stickiness = weights.stored_quality(encoded), 0.0

    # ----------------------------------------------------------------- weights

    def _trial(
        self, leaves: Sequence[TensorLeaf], layout: StateLayout, index: int, change: Optional[torch.Tensor] = None
    ) -> WeightTrial:
        """The sketch of weight ``index`` (or of its ``change`` since the reference) that
        answers trial configurations, with the proxy's Fisher weights and sensitivity."""
        watch = self._memory.watch
        leaf = leaves[index]
        gradient = watch.gradient_average(leaf) if watch.watching else None
        second = layout.optimizer_state_of(index).get(TensorRole.SECOND_MOMENT)
        fisher = None
        if second is not None and leaves[second].tensor.shape == leaf.tensor.shape:
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
        ~0.14): a search for fewer levels per tensor saved more bytes there but cost
        accuracy (docs/dynaquant.md), so it is an option.
        """
        if len(self.residual_bins) == 1:  # nothing to choose
            bins = self.residual_bins[0]
            inner = DynaQuantCodec(bins=bins, prune=0.0, protect=0.0, sigma=self.sigma)
            return bins, ResidualCodec(inner.with_hints(stats=stats))
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
            reference = _usable_reference(tensor, references[index])
            if reference is None:
                continue
            flat = tensor.float().reshape(-1)
            difference = flat - reference.detach().to(tensor.device).float().reshape(-1)
            # One temporary of the tensor's size (float64 copies would be two of twice it).
            energy, distance = float(torch.dot(flat, flat)), float(torch.dot(difference, difference))
            if distance <= bound * energy:
                unchanged.add(index)
        return unchanged

    def _plan_weights(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        eligible: list[bool],
        codecs: list[Codec],
    ) -> Optional["_WeightPlan"]:
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
            lambda i: self._trial(leaves, layout, i), indices, [_nbytes(leaves[i]) for i in indices]
        )))
        trials = {i: sketched[i] for i in indices}
        init = {i: self._memory.centroids[keys[i]] for i in indices if keys[i] in self._memory.centroids}
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
        movement = self._movement_budgets(leaves, references, trials, movable)
        moving = set(movement)
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
            residual = [i for i in hard if i in moving]
            allowed = {i: cube.own_budget(i) for i in residual}
            coded = parallel_map_sized(
                lambda i: self._residual_codec(
                    leaves, references, layout, i, trials[i], allowed[i], self._memory.entropy
                ),
                residual,
                [_nbytes(leaves[i]) for i in residual],
            )
            for index, (levels, codec) in zip(residual, coded):
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
        point, metric, kind = cube.search(self._memory.best, self.neighbourhood, not self.precision_only_grows)
        floors = {}
        if self.precision_only_grows:
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
            reference = _usable_reference(leaves[index].tensor, references[index])
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
        return _WeightPlan(indices, trials, cube, record, budget, self.evaluate, scales, moving, stats)

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
    ) -> dict[int, float]:
        """For each weight that moved since its reference: ``movement_share`` of its squared
        change relative to its energy, the most of its proxy error a restore may lose.

        After a restore the run continues from the stored values: an element that moved
        less than its cell since the last checkpoint is put back on its old level, and the
        training since is lost. Over the benchmark's 10 restores a fine-tune whose steps
        are far smaller than the cells (MiniLM: 1e-5..1e-4 of the weights' energy per
        checkpoint, below the 1.5e-4 error of 128 levels) lost half its accuracy.
        """
        budgets: dict[int, float] = {}
        for index in indices:
            tensor = leaves[index].tensor
            reference = _usable_reference(tensor, references[index])
            if reference is None:
                continue
            difference = tensor.detach().float() - reference.detach().to(tensor.device).float()
            moved = float(torch.dot(difference.reshape(-1), difference.reshape(-1)))
            if not moved > 0:  # unchanged (nothing to lose) or not finite
                continue
            budgets[index] = self.movement_share * moved / max(trials[index].total_plain, 1e-300)
        return budgets

    # ----------------------------------------------------------------- moments

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
        sketched = parallel_map_sized(
            lambda item: self._sketch_moment(
                leaves, references, layout, *item, first_keep, momentum_keep, joint_masks.get(item[0])
            ),
            items, [_nbytes(leaves[index]) for index, _ in items],
        )
        plans = [
            plan for entry in sketched
            for plan in (entry if isinstance(entry, tuple) else (entry,)) if isinstance(plan, _MomentPlan)
        ]
        zero_levels = [plan for plan in plans if plan.zero_levels is not None]
        for plan, extra in zip(zero_levels, _zero_level_hints_batch([p.zero_levels for p in zero_levels], self.sigma)):
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
        return choices

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
        keys = signed_keys(tensor)
        counts = torch.bincount(keys, minlength=SIGNED_KEYS).cpu()
        # The moment of a bias or a norm layer's scale (a weight under ``min_numel``) costs
        # mostly its record and level table: twice the levels and no pruning add few bytes.
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
            extra, zero_levels = self._first_moment_hints(tensor, keys, counts, role, partner, keep, bins, joint_mask)
        else:
            reference = _usable_reference(tensor, references[index])
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
        kept = torch.bincount(keys[~joint_mask], minlength=SIGNED_KEYS).cpu()
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
            [_nbytes(leaves[first]) for first, _ in joint],
        )
        return {index: mask for pair, mask in zip(joint, masks) for index in pair}

    def _factored(self, tensor: torch.Tensor) -> bool:
        if self.second_moment != "factored" or factored_shape(tuple(tensor.shape)) is None:
            return False
        low, high = torch.aminmax(tensor)
        return float(low) >= 0 and float(high) < float("inf")  # NaN fails both

    def _steps_since_last_checkpoint(
        self, leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]]
    ) -> Optional[int]:
        """Training steps since the checkpoint before this one (None when nothing tells).

        From the optimizer's ``step`` counters: since the reference at a delta; at a full
        checkpoint, since the last save this policy planned, or since the optimizer started
        when there was none (a run's first checkpoint, or the first after a restart) or it
        lies ahead. The counter is remembered unless an earlier save's was higher: retention
        re-plans an older step when it re-bases one, and that is no save of the run's.
        Without counters (SGD keeps none): the backward passes the watched model made since
        the last save this policy planned, or since it was watched.
        """
        counter = _optimizer_steps(leaves)
        steps = _steps_since_reference(leaves, references)
        previous = self._memory.optimizer_steps
        if steps is None and counter is not None:
            steps = _steps_since(counter, previous)
        if counter is not None and (previous is None or counter >= previous):
            self._memory.optimizer_steps = counter
        passes, before = self._memory.watch.gradient_steps(), self._memory.watched_steps
        self._memory.watched_steps = passes
        if counter is None and passes is not None:
            steps = _steps_since(passes, before)
        return steps

    def _keep_at(self, keep: float, steps: Optional[int]) -> float:
        """The fraction ``keep`` of a first moment or momentum buffer at a checkpoint ``steps``
        training steps after the one before it (None: unknown) when that is far enough, else 1."""
        if self.first_moment_keep_after == 0:
            return keep
        return keep if steps is not None and steps >= self.first_moment_keep_after else 1.0

    def _first_moment_hints(
        self,
        moment: torch.Tensor,
        keys: torch.Tensor,
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
        kept = torch.bincount(keys[~prune_mask], minlength=SIGNED_KEYS).cpu()
        # The kept entries get the same symmetric levels around an exact zero as a whole
        # moment: plain k-means rounded some small |m| (high score: small v) up to a far
        # larger level, and those restored steps blew up a digits run.
        return {"prune_mask": prune_mask}, (kept, bins)


def _first_moment_prune_mask(moment: torch.Tensor, second: torch.Tensor, keep: float) -> torch.Tensor:
    """The flat mask of the Adam first-moment entries stored as 0: all but the ``keep``
    fraction with the largest ``|m| / sqrt(v)`` (to the sketch's accuracy), and any whose
    score is not finite."""
    score = (moment.detach().abs().float() / (second.detach().float().sqrt() + 1e-8)).reshape(-1)
    score_keys = magnitude_keys(score)
    cut = quantile_key(torch.bincount(score_keys, minlength=MAGNITUDE_KEYS), 1.0 - keep)
    return (score_keys < cut) | ~torch.isfinite(score)


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
        return joint is None or _encoded_size(whole) - _encoded_size(joint) < REGROUP_MARGIN * _encoded_size(plain)

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
        first, first_size = self.first_plain, _encoded_size(plain)
        if grouped is not None and _encoded_size(grouped) < first_size:
            first, first_size = self.first_grouped, _encoded_size(grouped)  # type: ignore[assignment]
        if joint is not None and _encoded_size(joint) + _encoded_size(plain) < _encoded_size(whole) + first_size:
            return self.joint.adopt(memory), self.first_plain.adopt(memory)
        return self.whole.adopt(memory), first.adopt(memory)


#: A moving weight is also encoded as its change since the reference where its level ids
#: cost more than this many bits per element: a change on ``residual_bins`` = 10 levels
#: cost 2.3-3.3 bits per element on the benchmark's workloads, so below this it cannot win.
CHANGE_TRIAL_BITS = 1.5

#: The grouped first moment is only encoded where it could make the whole second moment's
#: pair the smaller one: the joint encoding's lead is under this share of the first
#: moment's plain bytes.
REGROUP_MARGIN = 0.5


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


def _nbytes(leaf: TensorLeaf) -> int:
    return leaf.tensor.numel() * leaf.tensor.element_size()


def _encoded_size(encoded: Encoded) -> int:
    return sum(len(stream) for stream in encoded.streams)


def _counter(leaf: TensorLeaf) -> Optional[float]:
    """The value of an optimizer ``step`` counter (None for any other leaf, or a counter that
    is not one finite real number)."""
    tensor = leaf.tensor
    if tensor.numel() != 1 or tensor.is_complex() or optimizer_entry_name(leaf.path) != "step":
        return None
    value = float(tensor)
    return value if math.isfinite(value) else None


def _optimizer_steps(leaves: Sequence[TensorLeaf]) -> Optional[int]:
    """The smallest ``step`` counter in the optimizer state (None without finite counters)."""
    counters = [value for value in map(_counter, leaves) if value is not None]
    return int(min(counters)) if counters else None


def _steps_since(count: int, previous: Optional[int]) -> int:
    """Steps from a count remembered at the last save to ``count``; ``count`` itself (steps
    since the count started) when there is none or it lies ahead (a restart)."""
    return count - previous if previous is not None and previous <= count else count


def _steps_since_reference(leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]]) -> Optional[int]:
    """Optimizer steps since the reference: the smallest change of a ``step`` counter in
    the optimizer state (None at a full checkpoint or without counters)."""
    gaps = []
    for leaf, reference in zip(leaves, references):
        value = _counter(leaf)
        if value is None or reference is None or reference.numel() != 1 or reference.is_complex():
            continue
        gap = value - float(reference)
        if math.isfinite(gap):
            gaps.append(gap)
    return int(min(gaps)) if gaps else None


def _zero_level_hints_for(counts: torch.Tensor, bins: int, sigma: float) -> dict[str, Any]:
    """Symmetric levels ``0, +-c_1, ..., +-c_k`` (``k = bins // 2``) for a first moment.

    Entries nearer 0 than ``c_1`` become 0; every other entry keeps its sign and is at
    most doubled. Plain k-means on the signed values had neither guarantee: an entry far
    smaller than the smallest level was rounded up to it, or to a level of the other
    sign when its own side had no small level, and with its small second moment the
    restored Adam step ``m / sqrt(v)`` of that parameter was then many times too large,
    or reversed, for ~10 steps (on the MiniLM fine-tune 4 levels made 0.8% of the steps
    3x larger than the largest true step, and the failure runs lost half the accuracy).
    Rounded to 0, such an entry's momentum only restarts.
    """
    return _zero_level_hints_batch([(counts, bins)], sigma)[0]


class _FoldedHistogram:
    """A first moment's histogram folded onto magnitudes: its occupied non-zero finite
    buckets in key order. Every fit of :func:`_zero_level_hints_batch` is on a suffix of
    them (what fit_centroids would select from the folded histogram, without its passes
    over the whole key space)."""

    def __init__(self, counts: torch.Tensor, bins: int, sigma: float) -> None:
        magnitude = counts[:MAGNITUDE_KEYS] + counts[MAGNITUDE_KEYS:]  # all mass on the + side
        keys = torch.nonzero(magnitude[:FIRST_NON_FINITE_KEY]).reshape(-1)
        keys = keys[keys != 0]
        centres = key_centres()[keys]
        finite = torch.isfinite(centres)
        self.keys, self.centres = keys[finite], centres[finite]
        self.occupied = magnitude[self.keys]
        self.half = max(bins // 2, 1)
        self.sigma = sigma

    def problem(self, start: int, init: Optional[torch.Tensor]) -> Optional[KMeansProblem]:
        """The fit on the buckets from magnitude key ``start`` up (None: none is occupied)."""
        kept = self.keys >= start
        if not bool(kept.any()):
            return None
        weights = histogram_sample_weights(self.centres[kept], self.occupied[kept], self.sigma)
        return KMeansProblem(self.centres[kept], weights, self.half, init)


def _fit_folded(requests: Sequence[tuple[_FoldedHistogram, int, Optional[torch.Tensor]]]) -> list[torch.Tensor]:
    """The levels of each ``(histogram, start, init)`` fit, all clustered side by side."""
    problems = [histogram.problem(start, init) for histogram, start, init in requests]
    fitted = iter(float32_levels_batch([problem for problem in problems if problem is not None]))
    return [next(fitted) if problem is not None else torch.empty(0, dtype=torch.float32) for problem in problems]


def _zero_level_hints_batch(histograms: Sequence[tuple[torch.Tensor, int]], sigma: float) -> list[dict[str, Any]]:
    """:func:`_zero_level_hints_for` of every ``(counts, bins)``, each exactly what it gives
    alone: each round's fits of all the moments run side by side."""
    folded = [_FoldedHistogram(counts, bins, sigma) for counts, bins in histograms]
    levels = _fit_folded([(histogram, 0, None) for histogram in folded])
    refitting = [i for i, fitted in enumerate(levels) if fitted.numel()]
    for _ in range(2):  # refit on what stays: the zero cell grows with the smallest level
        requests = []
        for i in refitting:
            smallest = float(levels[i].abs().min())
            prune_below = max(int(magnitude_keys(torch.tensor([smallest / 2]))[0]), 1)
            requests.append((folded[i], prune_below, levels[i] if levels[i].numel() == folded[i].half else None))
        refitted = _fit_folded(requests)
        for i, fitted in zip(refitting, refitted):
            if fitted.numel():
                levels[i] = fitted
        # A fit that found nothing left to cluster ends that moment's rounds.
        refitting = [i for i, fitted in zip(refitting, refitted) if fitted.numel()]
    hints: list[dict[str, Any]] = []
    for fitted in levels:
        if fitted.numel() == 0:
            hints.append({})
            continue
        fitted = fitted.abs().sort().values
        prune_below = max(int(magnitude_keys(torch.tensor([float(fitted[0]) / 2]))[0]), 1)
        hints.append({"prune_below": prune_below, "centroids": torch.cat([-fitted.flip(0), fitted])})
    return hints


def _reference_for(codec: Codec, leaf: TensorLeaf, reference: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return reference if codec.uses_reference else None


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
    #: the weights that moved since their reference (each has a movement budget)
    moving: set[int]
    #: each weight's entropy figures, of the encoding to be stored
    stats: dict[int, EntropyStats]

    def stored_quality(self, encoded: dict[int, Any]) -> float:
        """The quality measure of the weights as stored (the proxy, or ``evaluate``)."""
        if self.evaluate is not None:
            return self.cube.relative_loss({i: encoded[i].reconstruction for i in self.indices})
        return max((self._error(i, encoded[i]) / self.scales.get(i, 1.0) for i in self.indices), default=0.0)

    def within_own_budget(self, index: int, encoded: Encoded) -> bool:
        """Whether weight ``index`` as ``encoded`` stays within the error it may have alone."""
        return self._error(index, encoded) <= self.cube.own_budget(index)

    def _error(self, index: int, encoded: Encoded) -> float:
        """The proxy's relative error of weight ``index`` as ``encoded``: the larger of the
        plain and the Fisher-weighted one."""
        trial = self.trials[index]
        difference = encoded.reconstruction.reshape(-1).float() - trial.flat.float()
        plain = float(torch.dot(difference, difference))
        if not math.isfinite(plain):  # non-finite weights are stored exactly (protected)
            difference = torch.where(torch.isfinite(difference), difference, 0.0)
            plain = float(torch.dot(difference, difference))
        error = plain / max(trial.total_plain, 1e-300)
        if trial.weights is not None:
            weighted = float(torch.dot(difference * trial.weights, difference))
            error = max(error, weighted / max(trial.total, 1e-300))
        return error
