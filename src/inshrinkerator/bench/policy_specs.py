"""Which policies a benchmark runs: every registered name, plus option sweeps.

A *spec* is a policy name, optionally with options: ``"lc-checkpoint:bits=2"`` builds
``LCCheckpoint(bits=2)`` from the registered factory. Its label (the spec itself) names
the row in the report.
"""

from __future__ import annotations

from .. import policies
from ..policies import Policy
from ..policies.spec import parse_policy_spec

__all__ = ["registered_policies", "build_policy", "base_name", "sweep_specs", "SWEEP_WORKLOADS"]

#: Extra rows: LC-Checkpoint's bit width swept around its default (3), to show the ratio
#: rising as bits fall; run only on the cheap workloads named in :data:`SWEEP_WORKLOADS`.
_SWEEPS = {"lc-checkpoint": ("bits", (2, 4, 6))}
SWEEP_WORKLOADS = ("digits-cnn", "digits-cnn-sgd")


def registered_policies() -> list[str]:
    """The policy names registered right now (``policies._FACTORIES``), in table order."""
    return list(policies._FACTORIES)


def base_name(spec: str) -> str:
    """``"lc-checkpoint:bits=2"`` -> ``"lc-checkpoint"``."""
    return spec.split(":", 1)[0]


def sweep_specs(names: list[str]) -> list[str]:
    """The option-sweep specs for the registered policies among ``names``."""
    specs = []
    for name in names:
        if name in _SWEEPS and name in policies._FACTORIES:
            option, values = _SWEEPS[name]
            specs.extend(f"{name}:{option}={value}" for value in values)
    return specs


def build_policy(spec: str) -> Policy:
    """The policy object for a spec; ``ValueError`` for an unknown name or a bad option."""
    return parse_policy_spec(spec, policies._FACTORIES)
