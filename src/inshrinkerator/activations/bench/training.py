"""Training steps of a workload under a method."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from .methods import METHODS, MethodRun
from .workloads import ActivationWorkload, Segmented

__all__ = ["Trainer"]


@dataclass
class Trainer:
    """A model, its optimizer and a method, stepping through the workload's batches."""

    workload: ActivationWorkload
    model: Segmented
    run: MethodRun
    optimizer: torch.optim.Optimizer
    seed: int

    @classmethod
    def create(cls, workload: ActivationWorkload, method: str, seed: int) -> "Trainer":
        model = workload.build(seed)
        run = METHODS[method].bind(model)
        return cls(workload, model, run, workload.optimizer(model), seed)

    def step(self, step: int, batch_size: Optional[int] = None) -> float:
        """One forward/backward/update on batch ``step``; returns the loss."""
        inputs, targets = self.workload.batch(self.seed, step, batch_size or self.workload.batch_size)
        torch.manual_seed(self.seed * 7919 + step)  # the same dropout masks under every method
        self.optimizer.zero_grad(set_to_none=True)
        with self.run.context():
            loss = self.workload.loss(self.model(inputs), targets)
            loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def timed_step(self, step: int) -> float:
        """Seconds one :meth:`step` takes."""
        start = time.perf_counter()
        self.step(step)
        return time.perf_counter() - start
