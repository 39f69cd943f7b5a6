"""Which policies a benchmark runs: every registered name, plus option sweeps.

A *spec* is a policy name, optionally with options: ``"lc-checkpoint:bits=2"`` builds
``LCCheckpoint(bits=2)`` from the registered factory. Its label (the spec itself) names
the row in the report.
"""

from __future__ import annotations

from .. import policies
from ..policies import Policy

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


def _parse_value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def build_policy(spec: str) -> Policy:
    """The policy object for a spec; ``ValueError`` for an unknown name or a bad option."""
    name, _, options = spec.partition(":")
    if name not in policies._FACTORIES:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(policies._FACTORIES)}")
    kwargs = {}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"policy option {item!r} in {spec!r} is not key=value")
        kwargs[key.strip()] = _parse_value(value.strip())
    try:
        return policies._FACTORIES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"policy {spec!r}: {exc}") from None
