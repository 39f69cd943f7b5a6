"""A workload small enough for unit tests of the runner: a 2-layer MLP, Adam, 22 steps."""

from __future__ import annotations

import torch
from torch import nn

from inshrinkerator.bench.workloads import Evaluation, Workload, WorkloadSize, step_generator


class TinyWorkload(Workload):
    name = "tiny"
    optimizer_kind = "Adam"
    description = "2-layer MLP on fixed random data"

    @property
    def size(self) -> WorkloadSize:
        return WorkloadSize(22, 2)

    def _build(self) -> None:
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=10, gamma=0.5)
        data = torch.Generator().manual_seed(99)
        self.inputs = torch.randn(256, 16, generator=data)
        self.targets = (self.inputs[:, :4].argmax(dim=1))

    def train_step(self, step: int) -> float:
        index = torch.randint(256, (32,), generator=step_generator(self.seed, step))
        loss = nn.functional.cross_entropy(self.model(self.inputs[index]), self.targets[index])
        return self._optimizer_step(loss)

    @torch.no_grad()
    def evaluate(self) -> Evaluation:
        loss = nn.functional.cross_entropy(self.model(self.inputs), self.targets)
        return Evaluation("loss", float(loss), higher_is_better=False)
