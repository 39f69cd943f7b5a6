"""Policies decide how each tensor is stored. Pass a name or a policy object."""

from __future__ import annotations

from typing import Union

from .base import Policy
from .cnr import CheckNRun
from .dynaquant import DynaQuant
from .excp import ExCP
from .lc_checkpoint import LCCheckpoint
from .lossless import Lossless
from .qd import QDCompressor

__all__ = [
    "Policy", "Lossless", "LCCheckpoint", "ExCP", "CheckNRun", "QDCompressor", "DynaQuant",
    "resolve_policy", "POLICY_NAMES",
]

_FACTORIES = {
    "lossless": Lossless,
    "lc-checkpoint": LCCheckpoint,
    "excp": ExCP,
    "cnr": CheckNRun,
    "qd": QDCompressor,
    "dynaquant": DynaQuant,
}

#: The policy names ``save`` and ``CheckpointManager`` accept.
POLICY_NAMES = tuple(_FACTORIES)


def resolve_policy(policy: Union[str, Policy]) -> Policy:
    """The policy object for a name or object; ``ValueError`` for an unknown name."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in _FACTORIES:
        return _FACTORIES[policy]()
    raise ValueError(
        f"unknown policy {policy!r}; use one of {', '.join(POLICY_NAMES)} or a Policy object"
    )
