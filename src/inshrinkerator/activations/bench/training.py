"""One training step and one training run of a workload under a method."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .methods import METHODS, MethodRun
from .workloads import ActivationWorkload, Segmented

__all__ = ["Trainer", "train_run"]


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
        return float(loss)

    def timed_step(self, step: int) -> float:
        """Seconds one :meth:`step` takes."""
        start = time.perf_counter()
        self.step(step)
        return time.perf_counter() - start


def train_run(workload: ActivationWorkload, method: str, seed: int, steps: int,
              on_step: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Train ``steps`` steps from the seed's initialization; the final evaluation metrics."""
    trainer = Trainer.create(workload, method, seed)
    for step in range(steps):
        trainer.step(step)
        on_step()
    metrics = workload.evaluate(trainer.model)
    if trainer.run.compressor is not None:
        metrics["codec_ratio"] = trainer.run.compressor.statistics.ratio
    return metrics
