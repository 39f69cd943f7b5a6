"""The QD-Compressor baseline (as Inshrinkerator re-implemented it): entropy-driven bit width,
cyclic integer-code deltas, entropy coding.

Every weight tensor is quantized on one uniform grid whose number of levels is
set by the entropy of its values (between ``min_bins`` and ``max_bins``). With a
reference (the previous reconstructed checkpoint, or a base) the codes are stored
as ``(code - previous code) mod B``
(:class:`~inshrinkerator.codecs.CyclicCodeDeltaCodec`); without one, the codes
themselves (:class:`~inshrinkerator.codecs.EntropyWidthQuantizeCodec`). Both are
entropy coded.

Paper vs this policy (QD-Compressor, TPDS 2023; research/algorithms.md §1.5, §5):

- Inshrinkerator's QD+ searched ``min_bins`` / ``max_bins`` in {8, ..., 256}; we use
  the bounds of that space, 8 and 256, as defaults (knobs).
- The per-layer entropy rule and the recomputation of the previous codes from the
  reference are our readings; the codecs' docstrings give the details.
- No error feedback: QD's correction changes the training loop.
- Optimizer state is stored losslessly (QD compresses model snapshots) unless
  ``include_optimizer_state``; uniform grids may round small second moments to 0.
- Tensors with fewer than ``min_numel`` values, and everything that is not a
  finite float tensor, are stored exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ..codecs import Codec, CyclicCodeDeltaCodec, EntropyWidthQuantizeCodec
from ..tree import TensorLeaf
from .base import Policy
from .lossless import Lossless
from .lossy_eligibility import check_common_knobs, lossy_roles, quantizable, usable_reference
from .state_layout import layout_of

__all__ = ["QDCompressor"]

@dataclass(frozen=True)
class QDCompressor(Policy):
    """QD-Compressor: entropy-width uniform codes, cyclic code deltas against the previous checkpoint.

    Args:
        min_bins: fewest grid levels a tensor gets.
        max_bins: most grid levels.
        include_optimizer_state: quantize optimizer moments too.
        min_numel: smaller tensors are stored exactly.
    """

    min_bins: int = 8
    max_bins: int = 256
    include_optimizer_state: bool = False
    min_numel: int = 1024
    name: str = "qd"

    def __post_init__(self) -> None:
        CyclicCodeDeltaCodec(self.min_bins, self.max_bins)
        check_common_knobs(self.min_numel, self.include_optimizer_state)

    def plan(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        codecs = Lossless().plan(leaves, references)
        roles = lossy_roles(self.include_optimizer_state)
        delta = CyclicCodeDeltaCodec(self.min_bins, self.max_bins)
        standalone = EntropyWidthQuantizeCodec(self.min_bins, self.max_bins)
        for index, (leaf, role) in enumerate(zip(leaves, layout_of(leaves).roles)):
            if role not in roles or not quantizable(leaf.tensor, self.min_numel):
                continue
            has_reference = usable_reference(leaf.tensor, references[index]) is not None
            codecs[index] = delta if has_reference else standalone
        return codecs
