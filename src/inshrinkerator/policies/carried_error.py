"""A delta keeps the error a weight was last stored with, instead of paying to remove it.

A full checkpoint stores each weight on levels that lose up to its tolerance budget: the
reconstruction ``W_F - e_F``. The training process goes on from the exact ``W_F``, so at
the next delta the weight's change since its reference is ``dW + e_F``: the training
change plus the full checkpoint's whole error, which a change coded within a share of
its size then mostly removes. That error can be far larger than a few steps' change (the
digits CNN's largest weight 30 steps after a full checkpoint: 0.244 of squared change,
0.022 of it training), and removing it took the delta twice the bytes.

The policy remembers the error ``e`` each weight was last stored with (in bfloat16, in
host memory) and plans the next delta on ``W - e``: the change it codes is then the
training change (plus what the previous delta's rounding left), and the checkpoint
reconstructs the weight within ``e`` plus that delta's own error. Nothing accumulates,
since each delta still codes against the reconstruction before it. Kept along a whole
chain, ``e`` would stay a full checkpoint's error while the changes shrink with the
learning rate, and restores from late in such a chain cost accuracy; so a weight is
planned on ``W - e`` only while ``|e|^2`` is at most ``ratio`` times its change's, and
only where that change is the smaller one (after a restore the process trains on from
the reconstruction, and ``W - e`` would be further from the reference, not nearer).
Otherwise its change is coded from ``W`` itself, which removes most of ``e``, and that
change's own, smaller error is what the weight carries on. A weight stored on levels of
its own starts a new error to carry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch

from ..codecs import Codec
from ..codecs._parallel import parallel_map_sized
from ..codecs.base import Encoded
from ..codecs.lossy_input import all_finite
from ..codecs.prepared import PreparedEncoding
from ..codecs.residual import ResidualCodec
from ..codecs.unchanged import UnchangedCodec
from ..tree import TensorLeaf, format_key_path
from .base import leaf_nbytes
from .even_levels import change_energy

__all__ = ["CarriedErrors", "Shifted"]

#: The dtype the remembered errors are held in: half a weight's size, and float32's range
#: (an error is a small share of its weight; a relative precision of 2^-8 of it is plenty).
#: They are held in host memory, whatever device the weights are on: an accelerator's
#: memory goes to training, and each save copies them over once.
CARRIED_DTYPE = torch.bfloat16


def _without_sketch(codec: Codec) -> Codec:
    """``codec`` without the hints that describe the tensor it was planned on (its sketch
    keys, their histogram, the entropy figures it would add to)."""
    rehinted = getattr(codec, "rehinted", None)
    if rehinted is not None:
        return rehinted(keys=None, counts=None, stats=None)  # type: ignore[no-any-return]
    return type(codec).from_config(codec.get_config())


class Shifted(NamedTuple):
    """What :meth:`CarriedErrors.shifted_leaves` finds for one save."""

    #: leaf index -> the weight minus the error it carries, planned instead of the weight
    leaves: dict[int, TensorLeaf]
    #: leaf index -> the squared size of the training change of a weight whose carried
    #: error is too large against it to keep: its delta codes the error away
    refining: dict[int, float]


class CarriedErrors:
    """Weight key -> the error of the whole weights its chain started from (``W - W_stored``)."""

    def __init__(self) -> None:
        self._errors: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._errors)

    def __contains__(self, key: str) -> bool:
        return key in self._errors

    def shifted_leaves(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        indices: Sequence[int],
        ratio: float = math.inf,
    ) -> Shifted:
        """Leaf index -> the weight minus its carried error, for the weights in ``indices``
        with a reference whose change that makes smaller (see the module docstring), and
        whose carried error's squared size is at most ``ratio`` times that change's; and
        leaf index -> that change's squared size for the weights it makes smaller whose
        error is too large to keep (their delta codes the error away)."""
        candidates = []
        for index in indices:
            error = self._errors.get(format_key_path(leaves[index].path))
            tensor, reference = leaves[index].tensor, references[index]
            if (
                error is not None and reference is not None and tensor.is_floating_point()
                and error.shape == tensor.shape == reference.shape
            ):
                candidates.append((index, error))

        def shifted(item: tuple[int, torch.Tensor]) -> tuple[Optional[TensorLeaf], Optional[float]]:
            index, error = item
            tensor, reference = leaves[index].tensor.detach(), references[index]
            moved = (tensor.float() - error.to(tensor.device).float()).to(tensor.dtype)
            change = change_energy(moved, reference)
            if not change < change_energy(tensor, reference):
                return None, None
            if math.isinf(ratio) or change_energy(error, None) <= ratio * change:
                return TensorLeaf(leaves[index].path, moved), None
            return None, change

        results = parallel_map_sized(shifted, candidates, [leaf_nbytes(leaves[i]) for i, _ in candidates])
        return Shifted(
            {index: leaf for (index, _), (leaf, _) in zip(candidates, results) if leaf is not None},
            {index: change for (index, _), (_, change) in zip(candidates, results) if change is not None},
        )

    def settle(
        self,
        leaves: Sequence[TensorLeaf],
        originals: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        indices: Sequence[int],
        codecs: list[Codec],
        shifted: dict[int, TensorLeaf],
    ) -> None:
        """After planning on ``leaves`` (``originals`` with the ``shifted`` ones in their
        place): hand each shifted weight stored as its change to the writer's ``encode`` of
        the original tensor, and remember what each weight of ``indices`` carries on.

        A shifted weight stored as its change (or as its reference) keeps its carried
        error; one whose change was coded from the weight itself carries that change's
        error from now on, and one stored whole on lossy levels those levels' (a shifted
        one is encoded afresh from the original tensor first: its codec in ``codecs`` is
        replaced); any other forgets it.
        """
        for index in indices:
            key = format_key_path(originals[index].path)
            codec, original = codecs[index], originals[index].tensor
            if index in shifted:
                if isinstance(codec, UnchangedCodec):
                    continue
                if isinstance(codec, ResidualCodec):
                    if codec.answer_for(shifted[index].tensor, original):
                        continue
                    # Not encoded from the shifted weight as planned (no path of the policy
                    # leaves one so): its hints describe that weight's change, not this
                    # one's, so the writer encodes the original with a codec of the same
                    # configuration and no hints, against the reference alone.
                    codecs[index] = type(codec).from_config(codec.get_config())
            if isinstance(codec, ResidualCodec) and index not in shifted:
                # Stored as its change from the weight itself: the change's own error is
                # what the weight carries on from here.
                self._keep(key, original, codec.prepared_result)
                continue
            if (
                isinstance(codec, ResidualCodec) or not isinstance(codec, PreparedEncoding) or codec.lossless
                or codec.uses_context
            ):
                self._errors.pop(key, None)
                continue
            result = codec.prepared_result
            if index in shifted:
                # Planned on the shifted weight: encoded afresh from the original, without
                # the shifted weight's own sketch (its levels, thresholds and masks hold).
                codec = codecs[index] = _without_sketch(codec)
                result = None
            if result is None:
                reference = references[index] if codec.uses_reference else None
                result = codec.prepare(original, reference)  # type: ignore[attr-defined]
            self._keep(key, original, result)

    def _keep(self, key: str, original: torch.Tensor, result: Optional[Encoded]) -> None:
        """Remember ``original`` minus the reconstruction of ``result`` as the error of
        ``key``; forget it where there is no such reconstruction or it is not finite."""
        rebuilt = result.reconstruction if result is not None else None
        if rebuilt is None or rebuilt.shape != original.shape:
            self._errors.pop(key, None)
            return
        error = (original.detach().float() - rebuilt.float()).to("cpu", CARRIED_DTYPE)
        if all_finite(error):
            self._errors[key] = error
        else:
            self._errors.pop(key, None)
