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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Workload", "WorkloadSize", "Evaluation", "step_generator", "training_loss_evaluator"]


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

    def batch_loss(self, step: int) -> torch.Tensor:
        """The training loss of the current model on the batch of ``step`` (what
        :meth:`train_step` minimises), without an update.

        Raises:
            NotImplementedError: the workload does not define it.
        """
        raise NotImplementedError(f"{type(self).__name__} gives no training loss without an update")

    @torch.no_grad()
    def loss_on(self, steps: Sequence[int]) -> float:
        """Mean training loss of the current model on the batches of ``steps``, in eval
        mode, changing nothing (a quality measure from training data: never the test data)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return float(torch.stack([self.batch_loss(step) for step in steps]).mean())
        finally:
            self.model.train(was_training)

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


def training_loss_evaluator(
    workload: Callable[[], Workload], batches: int = 4
) -> Callable[[dict[str, torch.Tensor]], float]:
    """An ``evaluate`` for :class:`~inshrinkerator.policies.DynaQuant`: the mean training loss
    of a model holding the given state_dict, on ``batches`` fixed batches of training data
    that the run itself never draws (steps from 10**9 on).

    ``workload`` makes a fresh workload of the run's kind, built on first use: the state is
    loaded into that scratch model, never into the one being trained.
    """
    scratch: list[Workload] = []
    steps = range(10**9, 10**9 + batches)

    def evaluate(model_state: dict[str, torch.Tensor]) -> float:
        if not scratch:
            made = workload()
            made.build()
            scratch.append(made)
        scratch[0].model.load_state_dict(model_state)
        return scratch[0].loss_on(steps)

    return evaluate
