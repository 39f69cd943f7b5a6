"""The policy contract: decide, per tensor, which codec stores it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import torch

from ..codecs.base import Codec, Encoded
from ..tree import KeyPath, TensorLeaf
from .state_layout import param_group_ids, param_group_option

__all__ = ["Policy", "ParamGroupPolicy"]


class Policy(ABC):
    """Chooses a codec for every tensor of a state.

    ``plan`` sees the tensors of the state being saved and, per tensor, the
    *reference* it may be coded against: the reconstructed previous checkpoint
    of a run, a base model, or ``None``. A codec with ``uses_reference`` is given
    that reference to encode and to decode; one with ``uses_context`` names (its
    ``context_key``) another tensor of the state, stored before it without a context
    of its own, whose reconstruction it is given. Lossy policies may search here.
    """

    #: The name written into files and shown by ``inshrink info``.
    name: str

    @abstractmethod
    def plan(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        """One codec per leaf, in order."""

    def plan_state(
        self,
        state: Any,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        """:meth:`plan` for ``leaves`` flattened from ``state``; what the writers call.

        A policy that reads the state's plain values (an optimizer's param groups)
        overrides this; the default ignores ``state``.
        """
        return self.plan(leaves, references)

    def before_save(self) -> None:
        """Called on the training thread at every save, before the state is copied or
        planned (``plan`` may run on a background thread later). A policy that watches a
        model updates its hooks here; the default does nothing."""

    def new_chain(self) -> None:
        """Called before a full checkpoint that goes on from this policy's own saves in the
        same process (a manager's ``full_every``, a keyframe store's next keyframe): the
        state is a training state, not values just restored from a checkpoint. A policy
        that carries what it chose along a chain may start afresh here; not called for a
        run's first save, after a load into the same manager or store, or when a kept step
        is re-based. The default does nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ParamGroupPolicy(Policy):
    """A policy that pairs optimizer entries with weights by the saved param groups.

    Given the state (:meth:`plan_state`, what the writers call), it reads each
    optimizer's ``param_groups`` (:func:`~.state_layout.param_group_ids`); given only
    the leaves (:meth:`plan`), it matches the ids in parameter order.
    """

    def plan(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        return self.plan_grouped(leaves, references, None)

    #: param group options (e.g. ``"betas"``) that :meth:`plan_state` reads for each
    #: optimizer entry and hands to :meth:`plan_grouped` as ``group_options``
    group_options: ClassVar[tuple[str, ...]] = ()

    def plan_state(
        self,
        state: Any,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        groups = param_group_ids(state, leaves)
        if not self.group_options:
            return self.plan_grouped(leaves, references, groups)
        options = {name: param_group_option(state, leaves, name) for name in self.group_options}
        return self.plan_grouped(leaves, references, groups, group_options=options)

    @abstractmethod
    def plan_grouped(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
        param_groups: Optional[dict[KeyPath, list[list[int]]]],
    ) -> list[Codec]:
        """One codec per leaf; ``param_groups`` as :func:`~.state_layout.layout_of` takes them."""


def usable_reference(tensor: torch.Tensor, reference: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``reference`` when a codec can encode ``tensor`` against it (same dtype and shape), else None."""
    if reference is None or reference.dtype != tensor.dtype or reference.shape != tensor.shape:
        return None
    return reference


def leaf_nbytes(leaf: TensorLeaf) -> int:
    """The bytes of a leaf's tensor as it is held (what a planner shares out work by)."""
    return leaf.tensor.numel() * leaf.tensor.element_size()


def encoded_size(encoded: Encoded) -> int:
    """The bytes of an encoding's streams."""
    return sum(len(stream) for stream in encoded.streams)
