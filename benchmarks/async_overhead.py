"""How much of a training run does checkpointing with ``async_save=True`` block?

Target (issue 5): with ``async_save``, the time the training loop is blocked by the default
policy (DynaQuant) is at most 1 % of the training time.

Each workload of the yardstick trains its full schedule once, checkpointing every
``checkpoint_every`` steps through ``CheckpointManager(run, async_save=True)`` with the
default policy and a watched model (as the benchmark does). Measured:

- **blocked**: the time spent inside ``save`` (the snapshot; when the previous save is
  still running, also the wait for it) plus the final ``wait()`` for the last save;
- **setup**: constructing the manager and watching the model, before training starts (an
  async manager runs one full garbage collection in each, so that the objects setup left
  behind are not first walked inside a ``save``); reported, not counted as blocked;
- **training**: the time spent in training steps. Compression runs on the other core
  meanwhile and competes with training for the CPU, so the same schedule is also trained
  without any checkpointing and the slowdown is reported next to it.

Every run (each workload, with and without checkpoints) trains in a fresh process of
its own: the first snapshot then pays for fresh memory as a real run's first save does,
and neither run inherits the other's warm-up. Pauses of Python's cyclic garbage
collector are timed in both runs, and those that fall inside ``save`` are reported
apart: a save allocates objects, so it can make a full collection of the whole process
due, and that pause grows with the number of objects the *training process* holds.
``--gc-freeze`` calls ``gc.freeze()`` after the workload is built, in both runs (the
usual remedy: objects alive after setup are no longer walked by collections).

Run: ``python benchmarks/async_overhead.py [--workload digits-cnn ...] [--gc-freeze] [--out FILE]``
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.store import CheckpointManager

DEFAULT_WORKLOADS = ("digits-cnn", "stdlib-char-gpt", "minilm-docstrings")


class _CollectorClock:
    """Times the pauses of Python's cyclic garbage collector, and those inside a marked span."""

    def __init__(self) -> None:
        self.seconds = self.inside_seconds = 0.0
        self.full_collections = 0
        self.inside = False
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self.seconds += pause
        self.full_collections += info["generation"] == 2
        if self.inside:
            self.inside_seconds += pause


def train(name: str, seed: int, checkpoint: bool, freeze: bool = False) -> dict[str, Any]:
    """One uninterrupted run; with ``checkpoint``, async saves every interval."""
    workload = make_workload(name, seed)
    workload.build()
    if freeze:
        gc.freeze()
    size = workload.size
    train_seconds = blocked_seconds = wait_seconds = 0.0
    saves = 0
    per_save: list[float] = []
    clock = _CollectorClock()
    gc.callbacks.append(clock)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        manager = CheckpointManager(folder, async_save=True) if checkpoint else None
        if manager is not None:
            manager.watch(workload.model)
        setup_seconds = time.perf_counter() - started
        try:
            for step in range(size.total_steps):
                started = time.perf_counter()
                workload.train_step(step)
                train_seconds += time.perf_counter() - started
                if manager is not None and (step + 1) % size.checkpoint_every == 0:
                    state = {"step": step + 1, **workload.state()}
                    started = time.perf_counter()
                    clock.inside = True
                    manager.save(step + 1, state)
                    clock.inside = False
                    per_save.append(time.perf_counter() - started)
                    blocked_seconds += per_save[-1]
                    saves += 1
            if manager is not None:
                started = time.perf_counter()
                manager.wait()
                wait_seconds = time.perf_counter() - started
        finally:
            if manager is not None:
                manager.close()
            gc.callbacks.remove(clock)
    return {
        "train_seconds": train_seconds,
        "blocked_in_save_seconds": blocked_seconds,
        "blocked_in_each_save_seconds": [round(seconds, 4) for seconds in per_save],
        "final_wait_seconds": wait_seconds,
        "manager_setup_seconds": setup_seconds,
        "saves": saves,
        "gc_pause_seconds": clock.seconds,
        "gc_pause_in_save_seconds": clock.inside_seconds,
        "gc_full_collections": clock.full_collections,
        "gc_frozen": freeze,
        "metric": workload.evaluate().value,
    }


def _train_in_child(name: str, seed: int, checkpoint: bool, freeze: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", name, "--seed", str(seed)]
    if checkpoint:
        command.append("--checkpoint")
    if freeze:
        command.append("--gc-freeze")
    child = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def measure(name: str, seed: int, freeze: bool) -> dict[str, Any]:
    saving = _train_in_child(name, seed, checkpoint=True, freeze=freeze)
    plain = _train_in_child(name, seed, checkpoint=False, freeze=freeze)
    blocked = saving["blocked_in_save_seconds"] + saving["final_wait_seconds"]
    return {
        "workload": name,
        "seed": seed,
        "without_checkpoints": plain,
        "async_dynaquant": saving,
        "blocked_pct_of_training": 100.0 * blocked / saving["train_seconds"],
        "blocked_in_save_pct": 100.0 * saving["blocked_in_save_seconds"] / saving["train_seconds"],
        "training_slowdown_pct": 100.0 * (saving["train_seconds"] / plain["train_seconds"] - 1.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None,
        help="results/async_overhead.json (results/async_overhead_gc_frozen.json with --gc-freeze)",
    )
    parser.add_argument("--child", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after building the workload")
    parser.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one run in this fresh process; its figures go to stdout as JSON
        with torch_threads(1):
            print(json.dumps(train(args.child, args.seed, args.checkpoint, args.gc_freeze)))
        return
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for name in args.workload or DEFAULT_WORKLOADS:
        row = measure(name, args.seed, args.gc_freeze)
        rows.append(row)
        saving = row["async_dynaquant"]
        print(
            f"{name}: blocked {row['blocked_pct_of_training']:.2f} % of training "
            f"(in save {saving['blocked_in_save_seconds']:.2f} s + final wait "
            f"{saving['final_wait_seconds']:.2f} s over {saving['train_seconds']:.1f} s, "
            f"{saving['saves']} saves; garbage collector inside save {saving['gc_pause_in_save_seconds']:.3f} s; manager setup {saving['manager_setup_seconds']:.3f} s); "
            f"training slowdown {row['training_slowdown_pct']:+.1f} %",
            flush=True,
        )
    out = args.out or Path(__file__).parent / "results" / (
        "async_overhead_gc_frozen.json" if args.gc_freeze else "async_overhead.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"commit": commit, "gc_frozen": args.gc_freeze, "rows": rows}, indent=1), encoding="utf-8"
    )


if __name__ == "__main__":
    main()
