"""DynaQuant: the Inshrinkerator system plus compressed optimizer state (the default policy).

Per checkpoint (the weights planned in :mod:`.dynaquant_weights`, the moments in
:mod:`.dynaquant_moments`; this module holds the knobs and one save's plan):

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
   docs/dynaquant-measurements.md). ``momentum_keep`` prunes a momentum buffer to its
   largest 5 % by magnitude at the same checkpoints (for SGD, which keeps no step counters, the watched
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
4. **Small weights** (under ``min_numel``: biases, norm layers) with optimizer state: at a
   delta, their change since the reference on evenly spaced levels where that is smaller
   than storing them exactly (those of at least ``small_min_numel`` values); else exact.
5. Everything else — step counters, ``param_groups``, integer tensors, buffers, other
   tensors smaller than ``min_numel`` — is stored losslessly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..codecs import Codec
from ..codecs._parallel import parallel_map_sized
from ..codecs.base import Encoded, same_bits
from ..codecs.bucket_delta import EntropyStats
from ..codecs.lossy_input import below_normal
from ..codecs.prepared import PreparedEncoding
from ..codecs.unchanged import UnchangedCodec
from ..tree import KeyPath, TensorLeaf, format_key_path
from .base import ParamGroupPolicy, leaf_nbytes, usable_reference
from .carried_error import CarriedErrors
from .dynaquant_moments import MAX_MOMENT_BINS, MOMENT_ROLES, MomentPlanning
from .dynaquant_search import Point, SearchRecord
from .dynaquant_weights import PROXY_SCALE, WeightPlanning
from .gradient_watch import GradientWatch
from .lossless import Lossless
from .state_layout import TensorRole, layout_of, optimizer_entry_name

__all__ = ["DynaQuant", "PROXY_SCALE", "SearchRecord"]


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
    #: weight key -> the error its stored weights carry, which later deltas keep (carry_error)
    carried: CarriedErrors = field(default_factory=CarriedErrors)
    #: the next plan is a full checkpoint of a continuing run (``new_chain``): searched afresh
    chain_starts: bool = False


def _check_grid(name: str, values: Any, kind: type, low: float, high: float) -> None:
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty tuple, got {values!r}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (kind, int)) or not low <= value <= high:
            raise ValueError(f"{name}: {value!r} is not a {kind.__name__} in [{low}, {high}]")


def _check_number(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def _equal_to_reference(
    leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]], eligible: list[bool]
) -> list[int]:
    """The eligible leaves whose bytes equal their reference's (one comparison pass each)."""
    equal = []
    for index, leaf in enumerate(leaves):
        reference = usable_reference(leaf.tensor, references[index]) if eligible[index] else None
        if reference is not None and same_bits(leaf.tensor, reference):
            equal.append(index)
    return equal


@dataclass(frozen=True)
class DynaQuant(ParamGroupPolicy, WeightPlanning, MomentPlanning):
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
            with more (docs/dynaquant-measurements.md, *Trading degradation for bytes*).
        evaluate: ``evaluate(model_state_dict) -> float``, lower is better; called on
            quantized models during the search. It decides instead of the proxy, within
            the bounds it cannot see: frozen weights stay within ``frozen_tolerance`` and
            moved ones within ``movement_share`` (in the proxy's units). It must return a
            number (or a one-element tensor), else the save raises ``TypeError``; one that
            is not finite for the model as it is (a diverged run) fails the save with
            ``ValueError``, while a quantized model judged not finite is only rejected.
        bins, embedding_bins, prune, protect: the search grid, each from the least to the
            most aggressive setting (the paper's grid, extended to finer bins: the benchmark's
            frequent restores need them).
        sigma: k-means sample-weight balance between counts and magnitudes.
        stickiness: how far (in half-cells) an element may drift past its bucket before its
            id changes in a delta; more means smaller deltas and a little more error.
        neighbourhood: search radius around the previous best, in cube steps.
        precision_only_grows: a later checkpoint never stores a weight with fewer bins
            than the one before, nor searches more aggressive neighbours (Inshrinkerator's
            rule). A restore bakes a checkpoint's error into the run; the next save quantizes the
            restored (already quantized) values, which look easy, and going coarser then
            adds new error on top: over the benchmark's 10 restores that compounded. A full
            checkpoint of a continuing run (:meth:`new_chain`) is searched afresh, as a new
            process's policy would search it.
        moment_bins: non-zero levels of Adam's first moments (symmetric pairs around 0),
            k-means fitted, where ``first_moment_keep`` prunes them or with
            ``first_moment_error=None``.
        first_moment_error: an Adam first moment kept whole (checkpoints closer than
            ``first_moment_keep_after`` steps) is rounded to evenly spaced levels that lose
            about this share of its squared size (0 below half a step, so no entry changes
            sign or more than doubles). 0.08 is about what 8 k-means levels lost on
            MiniLM, whose first moments it stores 26 % smaller (docs/dynaquant-measurements.md,
            *Evenly spaced levels for stored changes*). The first moment of a weight under
            ``min_numel`` (never pruned) loses 0.002 at most, on levels stored as one step.
            None: ``moment_bins`` k-means levels (twice as many under ``min_numel``).
        momentum_bins: the same for SGD momentum buffers (the step itself: 4 kept the
            digits SGD run within one test image; 8 cost 12% of its full-state ratio).
        first_moment_keep: fraction of Adam's first moment kept (largest ``|m| / sqrt(v)``;
            1 keeps all) at checkpoints ``first_moment_keep_after`` or more optimizer
            steps after the checkpoint before them (Adam's ``step`` counters tell: the
            reference's at a delta; at a full checkpoint, the last save this policy object
            planned, or the optimizer's start for its first); every entry is kept at the
            others (0: prune at every checkpoint). 0.05 instead of 0.1 stored the char GPT
            benchmark 8 % smaller at +0.02 points of paired-restore degradation
            (docs/dynaquant-measurements.md, *Keeping 5 % of the first moment*).
        momentum_keep: fraction of an SGD or RMSprop momentum buffer kept (largest
            magnitude), at the checkpoints where ``first_moment_keep`` applies (0.05
            since bcf2a5b: the digits SGD run 11-12 % smaller than at
            0.1 at the same mean degradation over 8 seeds; at 1ade14c it had cost a test
            image on 6 of 8 seeds; docs/dynaquant-measurements.md, *Keeping 5 % of the
            momentum buffer*). SGD keeps no
            ``step`` counters: the steps are the backward passes of the watched model (with
            gradient accumulation, several per step: scale ``first_moment_keep_after`` by
            them), and without one every entry is kept (on the digits SGD benchmark, 0.1
            stored 1.28x fewer bytes at the same accuracy; docs/dynaquant-measurements.md).
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
            (docs/dynaquant-measurements.md, *Joint moment mask*).
        first_moment_octaves: code an Adam first moment's ids in one stream per octave of
            its second moment as stored (``dynaquant_grouped``), where that second moment
            is not itself stored with the first moment's zeros: the same values in fewer
            first-moment bytes (on the benchmark 8-13 % on the digits CNN, 9 % on MiniLM,
            1-5 % on the char GPT), for ~25 % more time in MiniLM's saves
            (docs/dynaquant-measurements.md, *First moment by octave*).
        sign_grouped_changes: code the ids of a weight stored as its change in one stream
            per sign of its first moment (or momentum buffer) in the same checkpoint, where
            that moment is kept whole (``residual_sign_grouped``): Adam moves a weight against
            its first moment's sign, so the same values take fewer bytes (MiniLM's fine-tune:
            its changes 13.5 % smaller, its failure runs 22.45x instead of 21.15x, the same
            accuracy seed by seed). Off by default: a restore then decodes the first moment
            of every step of its chain (MiniLM's 10-deep restore took 1.60 s instead of
            1.03 s) and its saves ran at 98 instead of 141 MB/s
            (docs/dynaquant-measurements.md, *The weights' changes by the first moment's
            sign*). A change stored as a low-rank product (``low_rank_changes``) is not
            grouped: with both on, MiniLM's changes are nearly all products and the option
            saves almost nothing (337 bytes of a 38.2 MB run).
        low_rank_changes: store a weight matrix's change (where it is stored as its change,
            on ``residual_error``'s levels) as a product of two small-integer factors of rank 1-32
            plus what the product leaves, where that is estimated to take fewer bytes
            (``residual_low_rank``): between close checkpoints such a change is close to low
            rank, so the same levels code what is left in fewer bits at the same error
            (docs/dynaquant-measurements.md, *Changes as a low-rank product*).
        low_rank_first_moments: store an Adam first moment kept whole and coded per octave
            of its second moment as a low-rank product of small-integer factors plus what the
            product leaves, on the same evenly spaced levels (``first_moment_error``) and
            still per octave, where that is estimated to take 15 % fewer bits
            (``dynaquant_grouped_low_rank``): a matrix's first moment is an average of its
            recent gradients, lower in rank than its change (docs/dynaquant-measurements.md,
            *First moments as a low-rank product*).
        low_rank_momentum: where ``momentum_keep`` prunes a momentum buffer (a matrix, both
            sides at least 16), store it instead as a low-rank product of small-integer
            factors alone (``low_rank``), of the least rank up to a quarter of its smaller
            side that loses no more of its squared size than the pruning would, where the
            factors are estimated to take fewer bits than the pruned buffer's mask and
            entries: a buffer averages recent gradients, sums of outer products, so its top
            few directions hold more of it than its largest entries do
            (docs/dynaquant-measurements.md, *Momentum buffers as a low-rank product*).
        low_rank_steps: where ``first_moment_keep`` prunes an Adam first moment (a matrix,
            both sides at least 16), store it instead as a low-rank product of small-integer
            factors of its steps ``m / sqrt(v)``, times ``sqrt(v)`` as stored
            (``low_rank_scaled``, reading the second moment of the same checkpoint), of the
            least rank that loses no more of the steps' squared size than the pruning would,
            where the factors are estimated to take fewer bits. Not where the second moment
            may be stored with the first moment's zeros (``joint_moment_mask``; a product has
            none): only Adam entries whose ``betas`` keep the joint mask off (such as the
            default ``(0.9, 0.999)``) (docs/dynaquant-measurements.md, *Adam's steps as a
            low-rank product*).
        carry_error: a delta keeps the error a weight was last stored with (a full
            checkpoint's levels, or the last change coded against the weight itself)
            instead of coding it away, while that error's squared size is at most this many
            times the weight's change since: its change is then taken from the weight minus
            that error, remembered in bfloat16 (two bytes per lossy weight element, in host
            memory). Each checkpoint is then as close to the exact weights as the one that
            last refined them, plus its own delta's error; an error grown large against
            the changes (which shrink as the learning rate decays) is coded away, and the
            next one kept. 2.0 stored MiniLM's paired restores 2.2-2.4 % smaller with every
            restore's accuracy the same (4.0: 3 % smaller, 2 of 16 restores one example
            worse). 0: never kept; ``math.inf``: a full checkpoint's error is kept along its
            whole chain, which stores runs without failures smaller still (the digits CNN
            38.8x instead of 35.8x) and cost MiniLM 0.3 points of accuracy in paired
            restores (docs/dynaquant-measurements.md, *Carrying the stored error*).
        refine_error: where a delta codes a carried error away (it grew larger than
            ``carry_error`` times the weight's training change since the reference), the
            change from the weight itself loses at least this many times that training
            change's squared size (within ``movement_share`` of the whole change and the
            weight's own budget), instead of only the pooled share of it: the weight is
            left with an error of the size a delta carries, not refined far below what any
            other checkpoint of the chain keeps. It carries that error on. 0.5 stored runs
            without failures 1-6 % smaller on the digits runs and MiniLM (seeds 0-1; the
            char GPT refines nothing), and MiniLM's paired restores (16, seeds 0-3) ended
            where they did without it but one, one test example worse (1.0: as small, and
            one more restore one better); the yardstick's failure runs, whose restores
            leave few errors to carry, 0.2 % smaller on average (at most 1.3 %; the char
            GPT's and MiniLM's the same files) (docs/dynaquant-measurements.md, *Refining
            a carried error only as far as it must*). ``None``: only the pooled share, as
            before.
        residual_error: a weight stored as its change since the reference (one that
            moved less than its own levels' spacing, or crossed many of them) is rounded
            to evenly spaced levels ``sqrt(12 * residual_error)`` times the change's RMS
            apart, which lose about this share of its squared size. 0.03 is what 10
            k-means levels lost on average, and stores MiniLM's changes ~14 % smaller at
            the same error per tensor (docs/dynaquant-measurements.md, *Evenly spaced
            levels for stored changes*). None: k-means levels, ``residual_bins``.
        cell_means: a weight's change on ``residual_error``'s levels keeps their evenly
            spaced cells, a value below half a cell rounding to 0, but each cell is
            reconstructed at the mean of the values in it (a table of levels in the
            stream), where the histogram's entropy says the table pays for itself. Where
            most of a change rounds to 0 (what a low-rank product leaves) a cell's values
            crowd towards zero and its middle loses less than the levels are spaced for;
            with the means, wider cells lose no more than the evenly spaced ones do, in
            fewer bits (not the whole ``residual_error``: a delta's error is in the next
            delta's change, where no product takes it out). Off by default: on the
            yardstick it stored the char GPT 3 % smaller and the others 0.2-0.8 %, but
            the wider zero cells drop more small changes, and 7 of the 8 runs of the
            digits CNNs and MiniLM whose accuracy moved lost a test example (first
            moments on cell means cost MiniLM more; docs/dynaquant-measurements.md,
            *Cell means for stored changes*).
        pooled_error: ``residual_error`` is a share of the summed squared size of all the
            changes stored at a save (biases and norm layers pooled apart), and they are
            rounded at one spacing: a change that moved less than their mean square loses
            a larger share of itself (at most ``movement_share``, and within its own
            budget), one that moved more a smaller share. The same total error in fewer
            bits (the equal-slope rule): on the yardstick the char GPT's runs 14 % smaller,
            the digits SGD run's 3 %, the others 0.2-0.3 %, at the same accuracy
            (docs/dynaquant-measurements.md, *One spacing for all the changes*). False:
            each change at ``residual_error`` of its own squared size.
        fisher_pooling: with ``pooled_error``, each change's squared size is weighed by
            its weight's mean Fisher diagonal (the Adam second moment, or the watched
            squared gradients) before the pooling: the spacing is finer where the loss is
            more sensitive to the weight, coarser where it is less, at the Fisher-weighted
            error that each change at ``residual_error`` would lose (the quality proxy's
            measure). Where some change has no Fisher diagonal the pool is unweighted.
            False: one spacing for all (docs/dynaquant-measurements.md, *Weighing the
            pooled changes by their Fisher diagonal*).
        residual_bins: with ``residual_error=None``, the k-means levels tried, most first,
            for a weight stored as its change: it takes the fewest whose error stays within
            its budget (the first when none does). 10 alone ended MiniLM's 8 yardstick seeds
            where 12 levels did, for ~3 % fewer bytes (12 stored 5.5 % fewer than 16 at
            +0.06 points of mean degradation; 8 levels cost +0.26 points;
            docs/dynaquant-measurements.md, *Residual levels*).
        min_numel: smaller tensors are stored losslessly (moments: ``moment_min_numel``),
            but for the weights ``small_min_numel`` and ``small_weight_error`` take.
        small_min_numel: a weight under ``min_numel`` with at least this many values (a
            bias, a norm layer's scale) that has optimizer state is stored at a delta as
            its change since the reference on evenly spaced levels (``residual_error``, or
            ``residual_bins[0]`` k-means levels) where that is smaller than storing it
            exactly: 3-4 % of the char GPT benchmark's bytes (docs/dynaquant-measurements.md,
            *Small weights stored as their change*). ``min_numel`` or more: always exact.
        small_weight_error: such a weight stored without a usable reference (at a full
            checkpoint) is rounded to evenly spaced levels that lose this share of its
            squared size, where that is smaller than storing it exactly: the char GPT's
            34 biases and norm scales in 6.7 kB instead of 24.2 kB, about 1 % of each
            of its values (``benchmarks/small_tensors.py``; docs/dynaquant-measurements.md,
            *Small tensors at full checkpoints and on a log lattice*). Not where every larger weight stays exact (nothing was
            feasible, or ``evaluate`` accepted no quantized point). None: exact.
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
    first_moment_error: Optional[float] = 0.08
    momentum_bins: int = 4
    first_moment_keep: float = 0.05
    first_moment_keep_after: int = 30
    momentum_keep: float = 0.05
    second_moment_bins: int = 8
    second_moment: str = "quantized"
    joint_moment_mask: bool = True
    first_moment_octaves: bool = True
    sign_grouped_changes: bool = False
    low_rank_changes: bool = True
    low_rank_first_moments: bool = True
    low_rank_momentum: bool = True
    low_rank_steps: bool = True
    carry_error: float = 2.0
    refine_error: Optional[float] = 0.5
    residual_bins: tuple[int, ...] = (10,)
    residual_error: Optional[float] = 0.03
    cell_means: bool = False
    pooled_error: bool = True
    fisher_pooling: bool = True
    min_numel: int = 1024
    moment_min_numel: int = 64
    small_min_numel: int = 64
    small_weight_error: Optional[float] = 1e-4
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
        if self.residual_error is not None:
            _check_number("residual_error", self.residual_error, 1e-9, 1.0)
        if self.first_moment_error is not None:
            _check_number("first_moment_error", self.first_moment_error, 1e-9, 1.0)
        if self.small_weight_error is not None:
            _check_number("small_weight_error", self.small_weight_error, 1e-12, 1.0)
        if self.refine_error is not None:
            _check_number("refine_error", self.refine_error, 0.0, 1e6)
        _check_number("sigma", self.sigma, 0.0, 1.0)
        _check_number("stickiness", self.stickiness, 0.0, 4.0)
        for knob in ("precision_only_grows", "joint_moment_mask", "first_moment_octaves", "sign_grouped_changes", "low_rank_changes",
                     "low_rank_first_moments", "low_rank_momentum", "low_rank_steps", "cell_means", "pooled_error", "fisher_pooling"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"{knob} must be a bool, got {getattr(self, knob)!r}")
        _check_number("first_moment_keep", self.first_moment_keep, 0.0, 1.0)
        _check_number("momentum_keep", self.momentum_keep, 0.0, 1.0)
        _check_number("carry_error", self.carry_error, 0.0, math.inf)
        after = self.first_moment_keep_after
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"first_moment_keep_after must be an int >= 0, got {after!r}")
        if self.second_moment not in ("factored", "quantized"):
            raise ValueError(f"second_moment must be 'factored' or 'quantized', got {self.second_moment!r}")
        for knob in (
            "neighbourhood", "moment_bins", "momentum_bins", "second_moment_bins", "min_numel", "moment_min_numel",
            "small_min_numel",
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

    def new_chain(self) -> None:
        """The next save is a full checkpoint of a continuing run: its weights are searched
        as a run's first are (no floors from ``precision_only_grows``, no warm start)."""
        self._memory.chain_starts = True

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
        afresh, self._memory.chain_starts = self._memory.chain_starts, False
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
            and leaf.tensor.numel() >= (self.moment_min_numel if role in MOMENT_ROLES else self.min_numel)
            for leaf, role in zip(leaves, layout.roles)
        ]
        # A tensor bit for bit equal to its reference (a fine-tune's frozen layer saved against
        # its pretrained base) is stored as the reference: exact, and no bytes.
        for index in _equal_to_reference(leaves, references, eligible):
            codecs[index] = UnchangedCodec()
            eligible[index] = False
        # A weight of zeros (a layer zeroed by hand) or of subnormal values is stored
        # exactly, for a few bytes: coded as its change from the reference it would come
        # back as that change's rounding error, and levels fitted to it round to zero.
        for index in layout.indices(TensorRole.WEIGHT):
            if eligible[index] and below_normal(leaves[index].tensor):
                eligible[index] = False
        # Deltas are planned on the weights minus the error they were last stored with,
        # where that is nearer the reference and small against the change
        # (policies.carried_error).
        originals = leaves
        carried_indices = [i for i in layout.indices(TensorRole.WEIGHT) if eligible[i]] if self.carry_error > 0 else []
        shifted, refining = self._memory.carried.shifted_leaves(leaves, references, carried_indices, self.carry_error)
        if shifted:
            leaves = [shifted.get(i, leaf) for i, leaf in enumerate(leaves)]
        change_stats: dict[int, EntropyStats] = {}
        weights = self._plan_weights(leaves, references, layout, eligible, codecs, change_stats, refining, afresh)
        # Small weights are rounded at a full checkpoint unless the large ones all stay exact
        # (nothing was feasible, or ``evaluate`` accepted no quantized point).
        large = [
            i for i in layout.indices(TensorRole.WEIGHT)
            if leaves[i].tensor.is_floating_point() and leaves[i].tensor.numel() >= self.min_numel
        ]
        round_whole = not large or any(not codecs[i].lossless for i in large)
        small_stats = self._plan_small_weights(leaves, references, layout, codecs, set(frozen), round_whole)
        steps = self._steps_since_last_checkpoint(leaves, references)
        first_keep = self._keep_at(self.first_moment_keep, steps)
        momentum_keep = self._keep_at(self.momentum_keep, steps)
        choices = self._plan_moments(leaves, references, layout, eligible, codecs, first_keep, momentum_keep, betas)
        # The weights stored as their change, coded per sign of a moment kept whole at this
        # save, are encoded after their moments (their context).
        kept = ((TensorRole.FIRST_MOMENT, first_keep), (TensorRole.MOMENTUM_BUFFER, momentum_keep))
        whole = {role for role, keep in kept if keep >= 1.0} if self.sign_grouped_changes else set()
        grouped = self._changes_to_group(leaves, layout, codecs, whole)
        # Encode now (the large tensors in parallel): the writer's encode calls then return at
        # once, and the stored weights' real error (stickiness included) can be checked
        # against the budget.
        prepared = [
            (i, codecs[i]) for i in range(len(leaves))
            if isinstance(codecs[i], PreparedEncoding) and not codecs[i].uses_context and i not in grouped
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
            prepare, prepared, [leaf_nbytes(leaves[i]) + sum(leaf_nbytes(leaves[r]) for r in readers.get(i, ())) for i, _ in prepared]
        )):
            encoded[index] = done.pop(index)
            with_context.update(done)

        def prepare_all(items: list[tuple[int, Codec, int]]) -> dict[int, Encoded]:
            # (index, codec, the index of its context) for contexts encoded above
            items = [item for item in items if item[2] in encoded]
            return dict(zip((i for i, _, _ in items), parallel_map_sized(
                lambda item: prepare_with_context(item[0], item[1], encoded[item[2]]), items,
                [leaf_nbytes(leaves[i]) for i, _, _ in items],
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
            self._store_whole_on_even_levels_where_smaller(leaves, layout, codecs, weights, encoded)
            self._check_stored_weights(leaves, references, codecs, weights, encoded)
            change_stats.update(weights.stats)
        # A weight that became its change above (it crossed many cells) may be grouped too.
        grouped.update(self._changes_to_group(leaves, layout, codecs, whole))
        self._group_changes_by_first_moment(leaves, references, codecs, encoded, change_stats, grouped)
        if self.carry_error > 0:
            self._memory.carried.settle(leaves, originals, references, carried_indices, codecs, shifted)
        for stats in [*change_stats.values(), *small_stats.values()]:
            self._memory.entropy.merge(stats)
        return codecs

    # ------------------------------------------ steps between checkpoints (first-moment pruning)

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


def _reference_for(codec: Codec, leaf: TensorLeaf, reference: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return reference if codec.uses_reference else None


