"""Policies decide how each tensor is stored. Pass a name, a spec (``"dynaquant:tolerance=0.01"``)
or a policy object."""

from __future__ import annotations

from typing import Union

from .base import Policy
from .cnr import CheckNRun
from .dynaquant import DynaQuant
from .excp import ExCP
from .lc_checkpoint import LCCheckpoint
from .lossless import Lossless
from .qd import QDCompressor
from .spec import parse_policy_spec

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
    """The policy object for a name, a spec with options (``"dynaquant:tolerance=0.01,
    bins=64|32"``: :mod:`.spec`) or an object.

    Raises:
        ValueError: an unknown name or option, or a value the policy refuses.
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return parse_policy_spec(policy, _FACTORIES)
    raise ValueError(
        f"unknown policy {policy!r}; use one of {', '.join(POLICY_NAMES)}, a spec such as "
        "'dynaquant:tolerance=0.01', or a Policy object"
    )
