"""The ExCP baseline: closed-loop weight residuals, joint weight-momentum pruning, 4-bit k-means.

Per checkpoint (ExCP, ICML 2024; research/algorithms.md §3):

1. Weights with a reference: the residual ``dW = W - W_hat_prev`` against the
   previous *reconstructed* weights, pruned where ``|dW| <= r_w`` with
   ``r_w = median(|dW|) * min(2.5, alpha / sqrt(mean(exp_avg_sq)))``,
   ``alpha = 5e-5`` (the official code's rule; the paper writes a per-element
   ``alpha / sqrt(m_t) * median(W)``), then 4-bit k-means.
2. First moments (``exp_avg``, and SGD ``momentum_buffer``): kept where
   ``|exp_avg| > beta * mean(|exp_avg|)`` (``beta = 2``) AND the paired weight's
   residual was kept; the *same* mask prunes ``exp_avg_sq``. Moments get no
   residual (they are weakly related to the previous ones) and are quantized
   directly with 4-bit k-means.
3. :class:`~inshrinkerator.codecs.KMeansQuantizeCodec`: 15 centres + a zero code,
   fp16 codebook, LZMA preset 9 | EXTREME (the paper: 7-Zip LZMA2 "ultra").

Choices where the paper leaves a detail open:

- The first checkpoint of a chain (no reference): ExCP's chain starts from the
  seeded initialisation, which a checkpoint library does not have. Quantizing
  whole weights is ExCP's worst ablation row ("quantize only"), so such weights
  are stored losslessly; the moments are still pruned and quantized, with the
  weight condition dropped from their mask.
- Pairing moments with weights: by the saved ``param_groups``, each group in order
  (a decay / no-decay split is not the state dict's order), skipping weights equal to
  their reference (frozen). Without the state (``plan``), in parameter order.
- Weights with no paired ``exp_avg_sq`` (SGD, or pairing failed): the pruning
  threshold is defined by the second moment, so their residual is not pruned
  (only quantized). Moments with no paired weight use the momentum condition alone.
- Other optimizers: their squared-gradient averages (RMSprop's and Adadelta's
  ``square_avg``, Adagrad's ``sum``: second moments in ``state_layout``) take the place of
  ``exp_avg_sq``; without a first moment in their entry they are quantized, not pruned.
- ``step`` counters, ``max_exp_avg_sq`` (AMSGrad) and the other accumulators (Adamax's
  ``exp_inf``, Adadelta's ``acc_delta``), ``param_groups``, BatchNorm
  statistics, tensors with fewer than ``min_numel`` values, and everything that
  is not a finite float tensor are stored exactly. (ExCP's own reconstruction
  copied step counters from the previous checkpoint; ours keeps the current ones.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ..codecs import Codec, KMeansQuantizeCodec, ResidualCodec
from ..codecs.base import same_bits
from ..codecs.lossy_input import working_dtype
from ..tree import KeyPath, TensorLeaf
from .base import ParamGroupPolicy
from .lossless import Lossless
from .lossy_eligibility import check_common_knobs, quantizable, usable_reference
from .state_layout import StateLayout, TensorRole, layout_of

__all__ = ["ExCP", "weight_prune_multiplier"]

_FIRST_ORDER = (TensorRole.FIRST_MOMENT, TensorRole.MOMENTUM_BUFFER)


def weight_prune_multiplier(second_moment: Optional[torch.Tensor], alpha: float, cap: float) -> float:
    """``min(cap, alpha / sqrt(mean(second_moment)))``; 0 (no pruning) without a second moment."""
    if second_moment is None:
        return 0.0
    mean = float(second_moment.detach().to(torch.float64).mean())
    return cap if mean <= 0 else min(cap, alpha / math.sqrt(mean))


@dataclass(frozen=True)
class ExCP(ParamGroupPolicy):
    """ExCP: residual + joint weight-momentum pruning + k-means with a zero code + LZMA.

    Args:
        bits: code width of weights and moments (15 centres + zero at 4).
        alpha: weight pruning strength (moment-to-weight).
        beta: momentum pruning strength (weight-to-momentum), in units of ``mean(|exp_avg|)``.
        prune_cap: upper bound of the weight pruning multiplier.
        kmeans_iterations: Lloyd iterations at most.
        lzma_preset: LZMA level of the back end (PRESET_EXTREME is always added).
        min_numel: smaller tensors are stored exactly.
    """

    bits: int = 4
    alpha: float = 5e-5
    beta: float = 2.0
    prune_cap: float = 2.5
    kmeans_iterations: int = 25
    lzma_preset: int = 9
    min_numel: int = 1024
    name: str = "excp"

    def __post_init__(self) -> None:
        self._quantizer()
        for knob in ("alpha", "beta", "prune_cap"):
            value = getattr(self, knob)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ValueError(f"{knob} must be a finite number >= 0, got {value!r}")
        check_common_knobs(self.min_numel, False)

    def _quantizer(self) -> KMeansQuantizeCodec:
        return KMeansQuantizeCodec(self.bits, self.kmeans_iterations, self.lzma_preset, lzma_extreme=True)

    def _weight_keep_masks(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        layout: StateLayout,
        eligible: list[bool],
    ) -> dict[int, torch.Tensor]:
        """Weight leaf -> mask of the residual entries kept, for weights coded as residuals."""
        masks: dict[int, torch.Tensor] = {}
        for index in layout.indices(TensorRole.WEIGHT):
            tensor = leaves[index].tensor
            reference = usable_reference(tensor, references[index]) if eligible[index] else None
            if reference is None:
                continue
            compute = working_dtype(tensor.dtype)
            residual = (tensor.detach().to(compute) - reference.detach().to(tensor.device, compute)).abs()
            second = layout.optimizer_state_of(index).get(TensorRole.SECOND_MOMENT)
            multiplier = weight_prune_multiplier(
                leaves[second].tensor if second is not None else None, self.alpha, self.prune_cap
            )
            threshold = residual.median() * multiplier
            masks[index] = residual > threshold
        return masks

    def plan_grouped(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        param_groups: Optional[dict[KeyPath, list[list[int]]]],
    ) -> list[Codec]:
        codecs = Lossless().plan(leaves, references)
        layout = layout_of(leaves)
        if param_groups:
            # A weight bit for bit equal to its reference did not train since: it is no
            # entry's weight (a fine-tune's frozen layers share their shapes with trained ones).
            frozen = []
            for index in layout.indices(TensorRole.WEIGHT):
                reference = usable_reference(leaves[index].tensor, references[index])
                if reference is not None and same_bits(leaves[index].tensor, reference):
                    frozen.append(index)
            layout = layout_of(leaves, param_groups, frozen)
        eligible = [quantizable(leaf.tensor, self.min_numel) for leaf in leaves]
        quantizer = self._quantizer()
        weight_masks = self._weight_keep_masks(leaves, references, layout, eligible)
        for index, mask in weight_masks.items():
            codecs[index] = ResidualCodec(quantizer.keeping(mask))
        for index, role in enumerate(layout.roles):
            if role not in _FIRST_ORDER or not eligible[index]:
                continue
            moment = leaves[index].tensor.detach()
            magnitude = moment.abs().to(working_dtype(moment.dtype))
            mask = magnitude > self.beta * magnitude.mean()
            weight = layout.parameter_of[index]
            if weight is not None and weight in weight_masks:
                mask &= weight_masks[weight].to(mask.device)
            codecs[index] = quantizer.keeping(mask)
            second = layout.entry_moments(index).get(TensorRole.SECOND_MOMENT)
            if second is not None and eligible[second]:
                codecs[second] = quantizer.keeping(mask)
        for index in layout.indices(TensorRole.SECOND_MOMENT):
            first_order = [r for r in _FIRST_ORDER if r in layout.entry_moments(index)]
            if eligible[index] and not first_order:
                codecs[index] = quantizer  # no first moment to take a mask from: quantize only
        return codecs
