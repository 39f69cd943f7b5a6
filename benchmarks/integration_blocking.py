"""How long does a checkpoint block the training loop in the Lightning and Hugging Face
integrations, synchronous against ``async_save``?

- **lightning**: ``InkCheckpointIO`` called as ``ModelCheckpoint(save_top_k=1)`` calls it
  (save the new checkpoint, remove the one it replaces), on a small transformer's
  ``state_dict`` and Adam state, with ``--steps`` real training steps between checkpoints;
  timed: the two calls.
- **hf**: ``InkTrainer`` training a GPT-2 built from a config on standard-library source
  bytes, ``save_steps=--steps``, ``save_total_limit=1``; timed: each ``_save_checkpoint``
  (the Trainer's whole save: config, state file, ``trainer_state.json``, rotation).

The default policy; every case in a fresh process, training on one torch thread (the
yardstick's setting: on this 2-core machine the other core is the background save's, as
a GPU run leaves the CPU to it). Reported per case: the median and the largest time a
checkpoint blocked, the training time between checkpoints, and the run's wall time. With
``async_save`` a checkpoint blocks for the copy of the state, plus any wait for the
previous save when training between checkpoints is shorter than a save.

Run: ``python benchmarks/integration_blocking.py [--checkpoints 6] [--steps 20] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from inshrinkerator.bench.suite import source_commit  # noqa: E402


def _train_transformer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, width: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        loss = model(torch.randn(8, 32, width)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - started


def lightning_case(async_save: bool, checkpoints: int, steps: int, folder: Path) -> dict[str, Any]:
    from inshrinkerator.integrations.lightning import InkCheckpointIO

    width = 384
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(width, nhead=6, dim_feedforward=4 * width, batch_first=True), num_layers=4,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    io = InkCheckpointIO(async_save=async_save)
    blocked, training = [], []
    previous = None
    run_started = time.perf_counter()
    for index in range(checkpoints):
        training.append(_train_transformer(model, optimizer, steps, width))
        checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()],
                      "global_step": (index + 1) * steps, "epoch": 0}
        path = folder / f"step={(index + 1) * steps}.ckpt"
        started = time.perf_counter()
        io.save_checkpoint(checkpoint, path)
        if previous is not None:
            io.remove_checkpoint(previous)
        blocked.append(time.perf_counter() - started)
        previous = path
    io.teardown()
    raw = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return _summary("lightning", async_save, blocked, training, time.perf_counter() - run_started, raw)


def hf_case(async_save: bool, checkpoints: int, steps: int, folder: Path) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from inshrinkerator.integrations.transformers import InkTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hf_trainer_tiny import CONTEXT, SourceBytes

    blocked: list[float] = []
    training: list[float] = []

    class Timed(InkTrainer):
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            started = time.perf_counter()
            super()._save_checkpoint(model, trial)
            blocked.append(time.perf_counter() - started)

    class Between(TrainerCallback):
        def __init__(self) -> None:
            self.since = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % steps == 0:
                training.append(time.perf_counter() - self.since)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.since = time.perf_counter()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=256, n_layer=4, n_head=4))
    args = TrainingArguments(
        str(folder), max_steps=checkpoints * steps, per_device_train_batch_size=8, learning_rate=1e-3,
        save_strategy="steps", save_steps=steps, save_total_limit=1, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, logging_strategy="no",
    )
    trainer = Timed(model=model, args=args, train_dataset=SourceBytes(windows=256), callbacks=[Between()],
                    ink_async_save=async_save)
    run_started = time.perf_counter()
    trainer.train()
    raw = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    return _summary("hf", async_save, blocked, training, time.perf_counter() - run_started, raw)


def _summary(case: str, async_save: bool, blocked: list[float], training: list[float], wall: float,
             raw: int) -> dict[str, Any]:
    return {
        "case": case, "async_save": async_save, "checkpoints": len(blocked), "state_mb": raw / 1e6,
        "blocked_median_seconds": statistics.median(blocked), "blocked_max_seconds": max(blocked),
        "training_between_median_seconds": statistics.median(training) if training else None,
        "wall_seconds": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="training steps between checkpoints")
    parser.add_argument("--case", action="append", choices=["lightning", "hf"], default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(1)
        case, mode = args.child.split(":")
        with tempfile.TemporaryDirectory() as folder:
            run = lightning_case if case == "lightning" else hf_case
            print(json.dumps(run(mode == "async", args.checkpoints, args.steps, Path(folder))))
        return
    rows = []
    for case in args.case or ["lightning", "hf"]:
        for mode in ("sync", "async"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", f"{case}:{mode}", "--checkpoints", str(args.checkpoints),
                 "--steps", str(args.steps)], capture_output=True, text=True, check=True,
            )
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{case} ({mode}): {row['state_mb']:.1f} MB state; a checkpoint blocks "
                  f"{row['blocked_median_seconds']:.3f} s (median; at most {row['blocked_max_seconds']:.3f} s); "
                  f"{row['training_between_median_seconds']:.2f} s of training between; "
                  f"run {row['wall_seconds']:.1f} s", flush=True)
    if args.out:
        document = {"benchmark": "integration blocking", **source_commit(), "rows": rows}
        args.out.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
