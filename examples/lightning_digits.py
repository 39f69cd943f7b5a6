"""PyTorch Lightning with compressed checkpoints: train on scikit-learn's digits, stop, resume.

::

    python examples/lightning_digits.py --out /tmp/digits --epochs 3             # first part
    python examples/lightning_digits.py --out /tmp/digits --epochs 6 --resume last  # the rest

``InkCheckpointIO`` (and the ``InkWatch`` callback, which lets its policy watch the model)
are the only changes to an ordinary Lightning script; ``ModelCheckpoint`` keeps the two
most recent checkpoints and deletes the others. ``--async`` compresses and writes on a
background thread (``InkCheckpointIO(async_save=True)``); ``--async-wrapper`` wraps the
plugin in Lightning's ``AsyncCheckpointIO`` instead. Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from sklearn.datasets import load_digits

from inshrinkerator.integrations.lightning import InkCheckpointIO, InkWatch


class DigitsClassifier(L.LightningModule):
    def __init__(self, hidden: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def digits() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """Train / held-out split of the 8x8 digits, pixels scaled to [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, held = order[:1400], order[1400:]
    return (torch.utils.data.TensorDataset(x[train], y[train]),
            torch.utils.data.TensorDataset(x[held], y[held]))


def evaluate(model: DigitsClassifier, held: torch.utils.data.TensorDataset) -> dict[str, float]:
    x, y = held.tensors
    with torch.no_grad():
        logits = model(x)
    return {
        "loss": torch.nn.functional.cross_entropy(logits, y).item(),
        "accuracy": (logits.argmax(1) == y).float().mean().item(),
    }


def run(out: Path, epochs: int, resume: Optional[str] = None, policy: Optional[str] = None,
        use_async: bool = False, default_io: bool = False, wrap_async: bool = False,
        devices: int = 1) -> dict[str, Any]:
    """Train to ``epochs`` (from ``resume``, a .ckpt path or ``"last"``); return a summary.

    ``default_io=True`` uses Lightning's own ``TorchCheckpointIO`` (for size comparisons).
    ``use_async`` saves on the plugin's background thread, ``wrap_async`` behind
    ``AsyncCheckpointIO``. ``devices`` > 1: DDP on the CPU (gloo), e.g. under ``torchrun``.
    """
    torch.manual_seed(0)
    train, held = digits()
    loader = torch.utils.data.DataLoader(train, batch_size=100, shuffle=False)
    plugins: list[Any] = []
    callbacks: list[Any] = [ModelCheckpoint(dirpath=out, filename="{epoch}-{step}", every_n_epochs=1,
                                            save_top_k=2, monitor="step", mode="max")]
    if not default_io:
        io = InkCheckpointIO(policy=policy, full_every=4, async_save=use_async)
        plugins.append(AsyncCheckpointIO(io) if wrap_async else io)
        callbacks.append(InkWatch())
    trainer = L.Trainer(
        max_epochs=epochs, plugins=plugins, callbacks=callbacks, accelerator="cpu", devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True,
    )
    model = DigitsClassifier()
    if resume == "last":
        resume = str(max(out.glob("*.ckpt"), key=lambda p: p.stat().st_mtime))
    trainer.fit(model, loader, ckpt_path=resume)
    files = sorted(p for p in out.glob("*.ckpt"))
    keyframes = out / ".ink-keyframes"
    stored = sum(p.stat().st_size for p in files) + sum(
        p.stat().st_size for p in keyframes.rglob("*") if p.is_file()
    ) if keyframes.exists() else sum(p.stat().st_size for p in files)
    return {
        "epochs": trainer.current_epoch, "global_step": trainer.global_step,
        "checkpoints": [p.name for p in files], "stored_bytes": stored,
        **evaluate(model, held),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--resume", default=None, help="a .ckpt path, or 'last'")
    parser.add_argument("--policy", default=None)
    parser.add_argument("--async", dest="use_async", action="store_true",
                        help="compress and write on a background thread")
    parser.add_argument("--async-wrapper", dest="wrap_async", action="store_true",
                        help="behind Lightning's AsyncCheckpointIO instead")
    parser.add_argument("--devices", type=int, default=1, help="> 1: DDP on the CPU (e.g. under torchrun)")
    args = parser.parse_args()
    summary = run(args.out, args.epochs, args.resume, args.policy, args.use_async, wrap_async=args.wrap_async,
                  devices=args.devices)
    if int(os.environ.get("RANK", "0")) == 0:  # one line: DDP ranks share stdout, their writes may interleave
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
