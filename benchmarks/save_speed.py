"""How fast does a synchronous ``CheckpointManager.save`` code a training state?

Target (issue 5): synchronous compression at >= 100 MB/s of raw state per process.

Each yardstick workload trains its full schedule once (seed 0, one torch thread), saving
every ``checkpoint_every`` steps through ``CheckpointManager(run)`` with the default policy
and a watched model, as a training script would. Measured: the raw bytes of the saved
states over the time spent inside ``save`` (all saves; the first, full one, and the
median of the deltas apart). ``--layers N`` adds a model of ``N`` ``Linear(64, 64)``
layers with Adam (three saves, five steps apart): the case of many small tensors.
Every case runs in a fresh process of its own, and then once more with the ``lossless``
policy (byte grouping, zstd, XOR deltas) on the same states (training is deterministic):
what storing the state costs at all on this machine, without any quantization.

Run: ``python benchmarks/save_speed.py [--workload digits-cnn ...] [--layers 400] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from inshrinkerator.bench.suite import source_commit
from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.store import CheckpointManager

DEFAULT_WORKLOADS = ("digits-cnn", "digits-cnn-sgd", "stdlib-char-gpt", "minilm-docstrings")


def _summary(name: str, raw_bytes: list[int], seconds: list[float]) -> dict[str, Any]:
    deltas = seconds[1:] or seconds
    return {
        "case": name,
        "saves": len(seconds),
        "raw_mb_per_save": raw_bytes[0] / 1e6,
        "save_seconds": sum(seconds),
        "mb_per_second": sum(raw_bytes) / 1e6 / sum(seconds),
        "first_save_seconds": seconds[0],
        "median_delta_seconds": statistics.median(deltas),
        "delta_mb_per_second": raw_bytes[-1] / 1e6 / statistics.median(deltas),
    }


def workload_run(name: str, folder: Path, policy: Optional[str] = None) -> dict[str, Any]:
    """One workload's full schedule, every save timed."""
    workload = make_workload(name, 0)
    workload.build()
    size = workload.size
    manager = CheckpointManager(folder / "run", policy=policy)
    manager.watch(workload.model)
    raw_bytes: list[int] = []
    seconds: list[float] = []
    for step in range(size.total_steps):
        workload.train_step(step)
        if (step + 1) % size.checkpoint_every == 0:
            state = {"step": step + 1, **workload.state()}
            started = time.perf_counter()
            info = manager.save(step + 1, state)
            seconds.append(time.perf_counter() - started)
            raw_bytes.append(info.raw_bytes)
    manager.close()
    return _summary(name, raw_bytes, seconds)


def layers_run(count: int, folder: Path, policy: Optional[str] = None) -> dict[str, Any]:
    """``count`` layers of ``Linear(64, 64)`` with Adam: three saves, five steps apart."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(count)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    manager = CheckpointManager(folder / "run", policy=policy)
    manager.watch(model)
    raw_bytes: list[int] = []
    seconds: list[float] = []
    for step in range(3):
        for _ in range(5):
            loss = model(torch.randn(32, 64)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        started = time.perf_counter()
        info = manager.save(step, state)
        seconds.append(time.perf_counter() - started)
        raw_bytes.append(info.raw_bytes)
    manager.close()
    return _summary(f"{count} x Linear(64, 64)", raw_bytes, seconds)


def _child(case: str, policy: Optional[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        if case.startswith("layers:"):
            return layers_run(int(case.split(":", 1)[1]), Path(folder), policy)
        return workload_run(case, Path(folder), policy)


def _run_child(case: str, policy: Optional[str] = None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", case] + (["--policy", policy] if policy else [])
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--layers", type=int, action="append", default=None, help="add N Linear(64, 64) layers")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.policy)))
        return
    cases = list(args.workload or DEFAULT_WORKLOADS) + [f"layers:{n}" for n in args.layers or []]
    rows = []
    for case in cases:
        row = _run_child(case)
        floor = _run_child(case, "lossless")
        row["lossless_mb_per_second"] = floor["mb_per_second"]
        row["lossless_median_delta_seconds"] = floor["median_delta_seconds"]
        rows.append(row)
        print(
            f"{row['case']}: {row['mb_per_second']:.1f} MB/s over {row['saves']} saves of "
            f"{row['raw_mb_per_save']:.1f} MB (first {row['first_save_seconds']:.2f} s, median delta "
            f"{row['median_delta_seconds']:.2f} s = {row['delta_mb_per_second']:.1f} MB/s); the lossless policy "
            f"{row['lossless_mb_per_second']:.1f} MB/s",
            flush=True,
        )
    if args.out:
        document = {"benchmark": "synchronous save speed", **source_commit(), "target_mb_per_second": 100, "rows": rows}
        args.out.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
