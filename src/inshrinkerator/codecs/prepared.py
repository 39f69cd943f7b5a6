"""Encoding ahead of the writer: a policy encodes while planning, the writer's call is free.

A policy that plans lossy codecs can encode their tensors at once, in parallel and,
for the weights, to measure the real stored error; the container writer's later
``encode`` of the very same inputs then returns the kept result. Inputs are matched by
object identity, storage, offset, shape, dtype and version counter, so a tensor changed
in place in between is encoded again: the result is always what ``encode`` computes.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import Encoded

__all__ = ["PreparedEncoding"]


def _one(tensor: Optional[torch.Tensor]) -> tuple:
    if tensor is None:
        return ()
    pointer = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
    return (id(tensor), pointer, tensor.storage_offset(), tuple(tensor.shape), tensor.dtype, tensor._version)


def _identity(tensor: torch.Tensor, reference: Optional[torch.Tensor], context: Optional[torch.Tensor] = None) -> tuple:
    return (_one(tensor), _one(reference), _one(context))


class PreparedEncoding:
    """Mixin for a codec: :meth:`prepare` encodes now; ``encode`` starts with :meth:`_take_prepared`."""

    _prepared: Optional[tuple[tuple, Encoded]] = None

    def prepare(
        self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None, context: Optional[torch.Tensor] = None
    ) -> Encoded:
        """Encode now and keep the result for the next ``encode`` of the very same inputs
        (``context``: for a codec that ``uses_context``)."""
        if context is None:
            encoded = self.encode(tensor, reference)  # type: ignore[attr-defined]
        else:
            encoded = self.encode(tensor, reference, context=context)  # type: ignore[attr-defined]
        self._prepared = (_identity(tensor, reference, context), encoded)
        return encoded

    @property
    def prepared_result(self) -> Optional[Encoded]:
        """The result the last :meth:`prepare` kept, until an ``encode`` takes it (else None)."""
        return self._prepared[1] if self._prepared is not None else None

    def answer_for(self, made_from: torch.Tensor, stands_for: torch.Tensor) -> bool:
        """Let the kept result, made from ``made_from``, answer the next ``encode`` of
        ``stands_for`` (with the same reference and context) instead: a policy that encodes
        another tensor in a tensor's place (``policies.carried_error``). False, and nothing
        changed, when the kept result was not made from ``made_from`` as it is now."""
        if self._prepared is None or self._prepared[0][0] != _one(made_from) or made_from.shape != stands_for.shape:
            return False
        identity, encoded = self._prepared
        self._prepared = ((_one(stands_for),) + identity[1:], encoded)
        return True

    def drop_prepared(self) -> None:
        """Forget the kept result (a policy that stores the tensor with another codec: the
        result, a whole reconstruction among it, is not held while the plan goes on)."""
        self._prepared = None

    def _take_prepared(
        self, tensor: torch.Tensor, reference: Optional[torch.Tensor], context: Optional[torch.Tensor] = None
    ) -> Optional[Encoded]:
        """The kept result if it was made from these inputs (kept once: taken, it is dropped)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == _identity(tensor, reference, context):
            return prepared[1]
        return None
