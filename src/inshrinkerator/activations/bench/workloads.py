"""The two training workloads of the activation benchmark.

- ``digits-cnn``: a CNN with BatchNorm, in-place-free ReLUs, max-pooling and dropout on
  scikit-learn's digits (the shared fixed split); metric: test accuracy (%).
- ``char-transformer``: a character GPT (pre-norm blocks, causal attention, GELU MLP) on
  the Python standard library's source text; metrics: validation loss and next-character
  accuracy (%).

Each model is a :class:`Segmented` module: a sequence of segments run one after another,
so ``torch.utils.checkpoint`` can wrap each segment and the compressor sees one root
forward per step. Batches are a function of (seed, step), so every method trains on the
same data in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ...bench.workloads.char_gpt import GPT, GPTConfig
from ...bench.workloads.digits import digits_split
from ...bench.workloads.stdlib_text import source_corpus

__all__ = ["Segmented", "ActivationWorkload", "WORKLOADS", "make_digits_cnn", "make_char_transformer"]


class Segmented(nn.Module):
    """Runs ``segments`` in order; with ``checkpointed`` each is recomputed in backward."""

    def __init__(self, segments: list[nn.Module]) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self.checkpointed = False
        self.checkpoint_inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.checkpoint_inputs = []
        for segment in self.segments:
            if self.checkpointed and torch.is_grad_enabled():
                self.checkpoint_inputs.append(x)
                x = checkpoint(segment, x, use_reentrant=False, preserve_rng_state=True)
            else:
                x = segment(x)
        return x


@dataclass(frozen=True)
class ActivationWorkload:
    """A model factory, a deterministic batch source, a loss and an evaluation."""

    name: str
    description: str
    build: Callable[[int], Segmented]
    batch: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]  # (seed, step, size)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch_size: int
    memory_batch_size: int  # larger, so activations dominate the process's memory
    steps: int
    quick_steps: int
    primary_metric: str


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# -- digits CNN ----------------------------------------------------------------------------
def make_digits_cnn(seed: int) -> Segmented:
    """conv-BN-ReLU x2, pool, conv-BN-ReLU, pool, dropout, linear: 8x8 digits -> 10 classes."""
    torch.manual_seed(seed)
    return Segmented([
        nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(128 * 4, 10)),
    ])


def _digits_batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    train_x, train_y, _, _ = digits_split()
    index = torch.randint(len(train_y), (size,), generator=_generator(seed, step))
    return train_x[index], train_y[index]


@torch.no_grad()
def _digits_evaluate(model: nn.Module) -> dict[str, float]:
    _, _, test_x, test_y = digits_split()
    model.eval()
    predictions = model(test_x).argmax(dim=1)
    model.train()
    return {"accuracy": 100.0 * float((predictions == test_y).double().mean())}


# -- character transformer -----------------------------------------------------------------
_CONFIG = GPTConfig(layers=2, width=128, heads=4, context=64)
_CORPUS_CHARS = 1_000_000


class _Embed(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.token, self.position = gpt.token, gpt.position

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))


class _Head(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.norm, self.head = gpt.norm, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def make_char_transformer(seed: int) -> Segmented:
    """A 2-layer, 128-wide character GPT (4 heads, context 64, tied embeddings)."""
    torch.manual_seed(seed)
    gpt = GPT(_CONFIG)
    return Segmented([_Embed(gpt), *gpt.blocks, _Head(gpt)])


def _text_split() -> tuple[torch.Tensor, torch.Tensor]:
    corpus = source_corpus(_CORPUS_CHARS)
    cut = int(len(corpus) * 0.9)
    return corpus[:cut], corpus[cut:]


def _windows(text: torch.Tensor, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    context = _CONFIG.context
    starts = torch.randint(len(text) - context - 1, (size,), generator=generator)
    windows = torch.stack([text[s:s + context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def _text_batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _windows(_text_split()[0], size, _generator(seed, step))


def _text_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def _text_evaluate(model: nn.Module) -> dict[str, float]:
    validation = _text_split()[1]
    generator = torch.Generator().manual_seed(12345)  # the same held-out windows for every run
    model.eval()
    losses, correct, total = [], 0, 0
    for _ in range(8):
        inputs, targets = _windows(validation, 64, generator)
        logits = model(inputs)
        losses.append(float(_text_loss(logits, targets)))
        correct += int((logits.argmax(dim=-1) == targets).sum())
        total += targets.numel()
    model.train()
    return {"val_loss": sum(losses) / len(losses), "accuracy": 100.0 * correct / total}


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))


WORKLOADS: dict[str, ActivationWorkload] = {
    "digits-cnn": ActivationWorkload(
        "digits-cnn", "CNN (3 conv + BN + ReLU, max-pool, dropout) on sklearn digits, Adam",
        make_digits_cnn, _digits_batch, F.cross_entropy, _digits_evaluate,
        lambda model: torch.optim.Adam(model.parameters(), lr=2e-3),
        batch_size=64, memory_batch_size=1024, steps=300, quick_steps=120, primary_metric="accuracy"),
    "char-transformer": ActivationWorkload(
        "char-transformer", "2-layer character GPT (width 128, context 64) on stdlib source, AdamW",
        make_char_transformer, _text_batch, _text_loss, _text_evaluate, _adamw,
        batch_size=32, memory_batch_size=128, steps=200, quick_steps=60, primary_metric="val_loss"),
}
