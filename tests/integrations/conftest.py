"""Shared by the integration tests: which policies to run, how close a resume must land."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from inshrinkerator.policies import POLICY_NAMES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: Relative change of the final loss allowed between a resumed and an uninterrupted run:
#: lossless restores bit for bit; a lossy policy may cost what DynaQuant's default
#: per-checkpoint tolerance allows (5%).
TOLERANCE = {"lossless": 1e-6}
LOSSY_TOLERANCE = 0.05

#: The lossy policy the integration tests run, first registered wins: the default policy
#: (DynaQuant; ~3 s on the Trainer workload, under 1 s on the Lightning one), then the
#: others.
LOSSY_PREFERENCE = ("dynaquant", "lc-checkpoint", "qd", "cnr", "excp")


def policies_under_test() -> list[str]:
    """Lossless, plus one lossy policy when one is registered."""
    lossy = [name for name in (*LOSSY_PREFERENCE, *POLICY_NAMES) if name in POLICY_NAMES and name != "lossless"]
    return ["lossless", *lossy[:1]]


def tolerance(policy: str) -> float:
    return TOLERANCE.get(policy, LOSSY_TOLERANCE)


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (the tests drive the examples)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
