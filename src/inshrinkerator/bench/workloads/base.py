"""The workload contract: a deterministic training job the recovery runner can crash and resume.

A workload owns a model, an optimizer and a learning-rate scheduler. Everything that
changes the trajectory is a function of ``(seed, step)``: the initial weights come from
the seed, the batch of step ``s`` (and any dropout in it) from ``(seed, s)``. So a run
restored from an exact checkpoint at step ``s`` and redone from there reproduces the
uninterrupted run bit for bit, and any difference a lossy checkpoint makes shows up in
the final metric.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Workload", "WorkloadSize", "Evaluation", "step_generator"]


@dataclass(frozen=True)
class WorkloadSize:
    """How long a workload trains and how often it checkpoints."""

    total_steps: int
    checkpoint_every: int


@dataclass(frozen=True)
class Evaluation:
    """A final quality measurement: ``higher_is_better`` decides the degradation's sign."""

    metric: str
    value: float
    higher_is_better: bool


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator whose state depends only on ``(seed, step, stream)``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7 + stream)


class Workload(ABC):
    """A training job: ``build()``, then ``train_step(0)``, ``train_step(1)``, ...

    Subclasses set ``name``, ``optimizer_kind`` and ``description`` and implement
    :meth:`_build`, :meth:`train_step` and :meth:`evaluate`.

    Args:
        seed: decides the initial weights and the data order.
        quick: a seconds-long version (smaller model and fewer steps) for smoke runs.
    """

    name: str = ""
    optimizer_kind: str = ""
    description: str = ""
    #: seeds a full benchmark runs by default (the expensive workloads run fewer)
    default_seeds: int = 3

    def __init__(self, seed: int = 0, quick: bool = False) -> None:
        self.seed = seed
        self.quick = quick
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.scheduler: torch.optim.lr_scheduler.LRScheduler

    @property
    @abstractmethod
    def size(self) -> WorkloadSize:
        """Total steps and checkpoint interval for this mode."""

    def build(self) -> None:
        """(Re)create model, optimizer and scheduler exactly as at step 0 for this seed."""
        torch.manual_seed(self.seed)
        self._build()

    @abstractmethod
    def _build(self) -> None:
        """Create ``self.model``, ``self.optimizer`` and ``self.scheduler``."""

    @abstractmethod
    def train_step(self, step: int) -> float:
        """One optimizer step on the batch of ``step``; returns the training loss."""

    @abstractmethod
    def evaluate(self) -> Evaluation:
        """The final quality metric on held-out data (no state change)."""

    def state(self) -> dict[str, Any]:
        """What a training loop checkpoints: model, optimizer, scheduler and step."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Load a state written by :meth:`state` into the current model and optimizer."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def _optimizer_step(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return float(loss.detach())
