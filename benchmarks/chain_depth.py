"""What a shorter chain costs in bytes, and what it saves at restore.

A delta checkpoint restores through every step back to the last full one, so the restore
time grows with ``full_every`` (the longest chain) while the stored bytes fall. This script
trains one yardstick workload once (seed 0, one torch thread, the model watched) and saves
every checkpoint into one ``CheckpointManager`` per ``full_every`` value at once (each with
its own default policy). Then, for each manager and each saved step, a fresh manager loads
that step (best of ``--loads``) next to ``torch.load(weights_only=True)`` of the same state
from a file (both from the page cache).

Reported per ``full_every``: the full-state ratio (raw bytes handed to ``save`` over the
bytes of every file the run left), and the restore time over ``torch.load``'s, averaged over
the steps and at the deepest step. The same states also go through managers with the
``lossless`` policy (``--lossless-every``, default 1 and 10): what a chain of exact XOR
deltas, and a single exact file, take to restore on this machine.

Run: ``python benchmarks/chain_depth.py [--workload minilm-docstrings ...] [--every 1 2 5 10]
[--lossless-every 1 10]``
Writes ``benchmarks/results/chain_depth.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.suite import source_commit
from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.store import CheckpointManager

RESULTS = Path(__file__).resolve().parent / "results" / "chain_depth.json"


def _flat_copy(state: Any, prefix: str = "") -> dict[str, Any]:
    # The state as one flat mapping of copies, for torch.save / torch.load(weights_only=True).
    if isinstance(state, torch.Tensor):
        return {prefix: state.detach().clone()}
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for key, value in state.items():
            out.update(_flat_copy(value, f"{prefix}/{key}"))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for index, value in enumerate(state):
            out.update(_flat_copy(value, f"{prefix}/{index}"))
        return out
    return {prefix: state}


def _best(action: Any, times: int) -> float:
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
    return best


def _run_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def measure(name: str, every: list[int], loads: int, folder: Path, lossless_every: Sequence[int] = ()) -> dict[str, Any]:
    """Train ``name`` once, saving into one manager per policy and ``full_every``; time every
    restore."""
    workload = make_workload(name, 0)
    workload.build()
    size = workload.size
    configurations = [("dynaquant", n) for n in every] + [("lossless", n) for n in lossless_every]
    managers = {
        (policy, n): CheckpointManager(folder / f"{policy}-every-{n}", policy=policy, full_every=n)
        for policy, n in configurations
    }
    for manager in managers.values():
        manager.watch(workload.model)  # the lossless policy ignores it
    raw_files: dict[int, Path] = {}
    raw_bytes = 0
    for step in range(size.total_steps):
        workload.train_step(step)
        if (step + 1) % size.checkpoint_every:
            continue
        state = {"step": step + 1, **workload.state()}
        for manager in managers.values():
            info = manager.save(step + 1, state)
        raw_bytes += info.raw_bytes
        raw_files[step + 1] = folder / f"raw-{step + 1}.pt"
        torch.save(_flat_copy(state), raw_files[step + 1])
    for manager in managers.values():
        manager.close()
    torch_load = {
        step: _best(lambda path=path: torch.load(path, weights_only=True), loads) for step, path in raw_files.items()
    }
    rows = []
    for policy, n in configurations:
        run = folder / f"{policy}-every-{n}"
        seconds = {}
        for step in raw_files:
            reader = CheckpointManager(run, full_every=n)
            seconds[step] = _best(lambda: reader.load(step), loads)
            reader.close()
        ratios = {step: seconds[step] / torch_load[step] for step in seconds}
        # The deepest step: the most saves since the last full one (the steps are saved in order).
        depth = {step: index % n for index, step in enumerate(sorted(seconds))}
        deepest = max(seconds, key=lambda step: (depth[step], step))
        rows.append({
            "policy": policy,
            "full_every": n,
            "ratio_full_state": raw_bytes / _run_bytes(run),
            "stored_mb": _run_bytes(run) / 1e6,
            "restore_seconds_mean": statistics.mean(seconds.values()),
            "restore_over_torch_load_mean": statistics.mean(ratios.values()),
            "deepest_step": deepest,
            "deepest_restore_seconds": seconds[deepest],
            "deepest_over_torch_load": ratios[deepest],
        })
    return {
        "workload": name,
        "saves": len(raw_files),
        "raw_mb_per_save": raw_bytes / len(raw_files) / 1e6,
        "torch_load_seconds_mean": statistics.mean(torch_load.values()),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 2, 5, 10], help="full_every values")
    parser.add_argument(
        "--lossless-every", type=int, nargs="*", default=[1, 10], help="full_every values for the lossless policy"
    )
    parser.add_argument("--loads", type=int, default=3, help="timed loads per step (best of)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = []
    with torch_threads(1):
        for name in args.workload or ["stdlib-char-gpt", "minilm-docstrings"]:
            with tempfile.TemporaryDirectory() as folder:
                result = measure(name, args.every, args.loads, Path(folder), args.lossless_every)
            results.append(result)
            print(f"{name}: {result['saves']} saves of {result['raw_mb_per_save']:.1f} MB, "
                  f"torch.load {result['torch_load_seconds_mean'] * 1e3:.1f} ms")
            for row in result["rows"]:
                print(f"  {row['policy']:>9} full_every={row['full_every']:>3}: {row['ratio_full_state']:6.2f}x  restore "
                      f"{row['restore_seconds_mean']:.3f} s mean ({row['restore_over_torch_load_mean']:.1f}x torch.load), "
                      f"deepest step {row['deepest_step']} {row['deepest_restore_seconds']:.3f} s "
                      f"({row['deepest_over_torch_load']:.1f}x)", flush=True)
    args.out.write_text(json.dumps({"benchmark": "chain depth", **source_commit(), "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
