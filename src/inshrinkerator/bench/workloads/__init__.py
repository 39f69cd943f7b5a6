"""The benchmark's training workloads, by name (see :class:`~.base.Workload`)."""

from __future__ import annotations

from .base import Evaluation, Workload, WorkloadSize, step_generator, training_loss_evaluator
from .char_gpt import CharGPT
from .digits import DigitsCNN, DigitsCNNSGD
from .minilm import MiniLMDocstrings

__all__ = [
    "Workload", "WorkloadSize", "Evaluation", "step_generator", "training_loss_evaluator", "WORKLOADS", "make_workload",
    "DigitsCNN", "DigitsCNNSGD", "CharGPT", "MiniLMDocstrings",
]

#: Workload name -> class, in report order.
WORKLOADS: dict[str, type[Workload]] = {
    cls.name: cls for cls in (DigitsCNN, DigitsCNNSGD, CharGPT, MiniLMDocstrings)
}


def make_workload(name: str, seed: int = 0, quick: bool = False) -> Workload:
    """A built workload; ``ValueError`` naming the choices for an unknown name."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    workload = WORKLOADS[name](seed=seed, quick=quick)
    workload.build()
    return workload
