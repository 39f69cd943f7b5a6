"""The Check-N-Run baseline: adaptive asymmetric uniform quantization, no delta.

Every weight tensor is quantized with
:class:`~inshrinkerator.codecs.UniformQuantizeCodec`: per row for 2-D tensors
(per tensor otherwise), ``2**bits`` levels over a clip range found by a greedy
search that shrinks ``[min, max]`` to minimise the squared error.

Paper vs this policy (Check-N-Run, NSDI 2022; research/algorithms.md §4):

- Only the quantizer, as in Inshrinkerator's CNR+ re-implementation: Check-N-Run's
  differential checkpointing tracks modified rows of recommendation-model
  embedding tables, which has no counterpart in dense training, so every
  checkpoint is stored on its own (references are ignored).
- 4 bits by default; the search's step count and range fraction are knobs (see
  the codec for the defaults and their source).
- Optimizer state is stored losslessly (Check-N-Run checkpoints it but does not
  say it is quantized) unless ``include_optimizer_state``. Beware that uniform
  quantization of Adam's second moment can round small entries to 0.
- Tensors with fewer than ``min_numel`` values, and everything that is not a
  finite float tensor, are stored exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ..codecs import Codec, UniformQuantizeCodec
from ..tree import TensorLeaf
from .base import Policy
from .lossless import Lossless
from .lossy_eligibility import check_common_knobs, lossy_roles, quantizable
from .state_layout import layout_of

__all__ = ["CheckNRun"]

@dataclass(frozen=True)
class CheckNRun(Policy):
    """Check-N-Run: per-row asymmetric uniform quantization with a greedy clip search.

    Args:
        bits: code width (1-8).
        search_steps: step count of the clip search.
        search_range: largest fraction of the span the search may clip.
        per_row: one grid per row of 2-D tensors.
        include_optimizer_state: quantize optimizer moments too.
        min_numel: smaller tensors are stored exactly.
    """

    bits: int = 4
    search_steps: int = 50
    search_range: float = 0.25
    per_row: bool = True
    include_optimizer_state: bool = False
    min_numel: int = 1024
    name: str = "cnr"

    def __post_init__(self) -> None:
        self._codec()
        check_common_knobs(self.min_numel, self.include_optimizer_state)

    def _codec(self) -> UniformQuantizeCodec:
        return UniformQuantizeCodec(self.bits, self.per_row, self.search_steps, self.search_range)

    def plan(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        codecs = Lossless().plan(leaves, [None] * len(leaves))
        roles = lossy_roles(self.include_optimizer_state)
        quantizer = self._codec()
        for index, (leaf, role) in enumerate(zip(leaves, layout_of(leaves).roles)):
            if role in roles and quantizable(leaf.tensor, self.min_numel):
                codecs[index] = quantizer
        return codecs
