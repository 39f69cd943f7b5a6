"""Hugging Face Trainer with compressed checkpoints: a tiny GPT-2 on Python source text.

::

    python examples/hf_trainer_tiny.py --out /tmp/tiny --stop-at 6        # interrupted
    python examples/hf_trainer_tiny.py --out /tmp/tiny --resume             # resumes from the last

The model is built from a config (nothing is downloaded); the text is a file of the
Python standard library, read as bytes. ``InkTrainer`` replaces ``Trainer``; nothing
else changes. ``save_total_limit=2`` keeps the two newest ``checkpoint-N`` folders.
``--async`` writes each checkpoint's file on a background thread (``ink_async_save``).
Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from inshrinkerator.integrations.transformers import InkTrainer  # noqa: E402

CONTEXT = 32


class SourceBytes(torch.utils.data.Dataset):
    """Fixed windows of a standard-library source file, as byte tokens."""

    def __init__(self, windows: int = 48) -> None:
        text = Path(json.__file__).with_name("decoder.py").read_bytes()
        ids = torch.tensor(list(text[: windows * CONTEXT]), dtype=torch.int64)
        self.windows = ids.reshape(windows, CONTEXT)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


class StopAt(TrainerCallback):
    """Ends training after ``step`` steps, as a crash would (the checkpoint is already saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def run(out: Path, steps: int = 12, stop_at: Optional[int] = None, resume: Optional[str] = None,
        policy: Optional[str] = None, default_trainer: bool = False, async_save: bool = False) -> dict[str, Any]:
    """Train to ``steps`` (stopping early at ``stop_at``; resuming from ``resume``, a
    checkpoint folder or ``"last"``); return a summary. ``default_trainer=True`` uses the
    plain ``Trainer`` (for size comparisons)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=32,
                                       n_layer=2, n_head=2))
    args = TrainingArguments(
        str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        save_strategy="steps", save_steps=3, save_total_limit=2, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    callbacks = [StopAt(stop_at)] if stop_at is not None else []
    data = SourceBytes()
    if default_trainer:
        trainer: Trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    else:
        trainer = InkTrainer(model=model, args=args, train_dataset=data, callbacks=callbacks,
                             ink_policy=policy, ink_full_every=4, ink_async_save=async_save)
    trainer.train(resume_from_checkpoint=True if resume == "last" else resume)
    batch = data.windows[:16]
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss.item()
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    stored = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()
                 and (p.parent.name.startswith("checkpoint-") or ".ink-keyframes" in p.parts))
    return {"global_step": trainer.state.global_step, "loss": loss, "checkpoints": checkpoints,
            "stored_bytes": stored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", nargs="?", const="last", default=None,
                        help="a checkpoint-N folder; alone: the last one")
    parser.add_argument("--policy", default=None)
    parser.add_argument("--async", dest="async_save", action="store_true",
                        help="write checkpoint files on a background thread")
    args = parser.parse_args()
    summary = run(args.out, args.steps, args.stop_at, args.resume, args.policy, async_save=args.async_save)
    if int(os.environ.get("RANK", "0")) == 0:  # one line: DDP ranks share stdout, their writes may interleave
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
