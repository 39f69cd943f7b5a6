"""A small CNN on scikit-learn's handwritten digits (8x8 images, 10 classes).

Two workloads share the model and data: ``digits-cnn`` trains it with Adam, and
``digits-cnn-sgd`` with SGD + momentum 0.9 (LC-Checkpoint's setting), so the two
optimizers can be compared on the same network.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from .base import Evaluation, Workload, WorkloadSize, step_generator

__all__ = ["DigitsCNN", "DigitsCNNSGD", "digits_split"]

_TEST_FRACTION = 0.25


@lru_cache(maxsize=1)
def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_x, train_y, test_x, test_y)``: a fixed split of sklearn's digits.

    Pixels are scaled to [0, 1], images shaped ``[N, 1, 8, 8]``. The split does not
    depend on the run's seed, so every seed is measured on the same test set.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().div(16.0).unsqueeze(1)
    labels = torch.from_numpy(digits.target).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(len(labels) * (1 - _TEST_FRACTION))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def _cnn(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 16, 4 * width),
        nn.ReLU(),
        nn.Linear(4 * width, 10),
    )


class DigitsCNN(Workload):
    """Conv-conv-pool-MLP on 8x8 digits; Adam with a cosine schedule; metric: test accuracy."""

    name = "digits-cnn"
    optimizer_kind = "Adam"
    description = "CNN on scikit-learn digits (1,347 train / 450 test images), Adam"
    #: one test image is 0.22 % of accuracy, and restores move a run by a few images
    #: either way: 8 seeds make the mean's standard error about one image's worth
    default_seeds = 8

    batch_size = 64

    @property
    def size(self) -> WorkloadSize:
        return WorkloadSize(60, 5) if self.quick else WorkloadSize(600, 30)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=2e-3)

    def _build(self) -> None:
        self.model = _cnn(16 if self.quick else 32)
        self.optimizer = self._make_optimizer()
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.optimizer, T_max=self.size.total_steps
        )

    def batch_loss(self, step: int) -> torch.Tensor:
        train_x, train_y, _, _ = digits_split()
        index = torch.randint(
            len(train_y), (self.batch_size,), generator=step_generator(self.seed, step)
        )
        return nn.functional.cross_entropy(self.model(train_x[index]), train_y[index])

    def train_step(self, step: int) -> float:
        self.model.train()
        return self._optimizer_step(self.batch_loss(step))

    @torch.no_grad()
    def evaluate(self) -> Evaluation:
        _, _, test_x, test_y = digits_split()
        self.model.eval()
        accuracy = (self.model(test_x).argmax(dim=1) == test_y).float().mean()
        return Evaluation("accuracy", float(accuracy), higher_is_better=True)


class DigitsCNNSGD(DigitsCNN):
    """The same CNN and data with SGD, momentum 0.9 and weight decay (LC-Checkpoint's setting)."""

    name = "digits-cnn-sgd"
    optimizer_kind = "SGD-momentum"
    description = "the same CNN on digits, SGD with momentum 0.9"

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
