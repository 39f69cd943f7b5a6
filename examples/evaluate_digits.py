"""Plain PyTorch with DynaQuant judging checkpoints by your own metric: ``evaluate``.

::

    python examples/evaluate_digits.py --out /tmp/evaluate-run --steps 300 --tolerance 0.02

Trains a small CNN on scikit-learn's digits with Adam and checkpoints every 30 steps
through ``CheckpointManager``. The policy's search quantizes the weights as far as
``evaluate`` allows: the validation loss of a model holding the quantized weights may rise
by at most ``tolerance`` (relative) at each checkpoint. ``evaluate`` loads the weights
into a model of its own (never the one being trained) and must not change them. Then a
fresh model and optimizer are restored from the last checkpoint, as after a crash, and
trained further. Prints a JSON summary: sizes, the search's choices and the accuracies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn

import inshrinkerator as ink


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (a new one)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=30, help="checkpoint interval in steps")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative validation-loss rise allowed")
    args = parser.parse_args(argv)

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, valid, test = order[:1200], order[1200:1500], order[1500:]

    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    judge = make_model()  # evaluate's own model: the trained one is never touched

    @torch.no_grad()
    def validation_loss(model_state: dict[str, torch.Tensor]) -> float:
        judge.load_state_dict(model_state)  # strict: every key of model.state_dict() is there
        return float(nn.functional.cross_entropy(judge(x[valid]), y[valid]))

    @torch.no_grad()
    def accuracy(net: nn.Module) -> float:
        return float((net(x[test]).argmax(1) == y[test]).float().mean())

    def step(index: int) -> None:
        batch = train[torch.randint(len(train), (64,), generator=torch.Generator().manual_seed(index))]
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    policy = ink.policies.DynaQuant(evaluate=validation_loss, tolerance=args.tolerance)
    with ink.CheckpointManager(args.out, policy=policy) as manager:
        manager.watch(model)
        saves = []
        for index in range(1, args.steps + 1):
            step(index)
            if index % args.every == 0:
                info = manager.save(index, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": index})
                saves.append(info.to_dict())
        trained_accuracy = accuracy(model)
        # A crash: a fresh process builds a new model and optimizer and restores them.
        state = manager.load()
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    restored_accuracy = accuracy(model)
    for index in range(state["step"] + 1, state["step"] + 1 + args.every):
        step(index)
    summary = {
        "raw_bytes": sum(s["raw_bytes"] for s in saves),
        "stored_bytes": sum(s["stored_bytes"] for s in saves),
        "ratio": sum(s["raw_bytes"] for s in saves) / sum(s["stored_bytes"] for s in saves),
        "search": [
            {"kind": record.kind, "evaluations": record.evaluations, "quality": record.quality,
             "bins": record.config.get("bins"), "prune": record.config.get("prune")}
            for record in policy.search_log
        ],
        "accuracy_trained": trained_accuracy,
        "accuracy_restored": restored_accuracy,
        "accuracy_after_more_steps": accuracy(model),
    }
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
