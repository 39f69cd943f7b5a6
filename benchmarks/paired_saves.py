"""Save speed of this tree against another commit's, paired in one process.

Timings on a shared machine drift by 10-20 % between runs, more than most changes to a
codec move them. Here one training run (seed 0, one torch thread, as
``benchmarks/save_speed.py`` trains) hands every checkpoint's state to two managers with
the default policy: one of the package as it is in this tree, one of the package at
``--base`` (extracted with ``git archive`` into a temporary folder and imported under
another name). They save in alternating order, so both see the same states, the same
caches and the same moments of the machine's load. Printed per workload: each side's
time over all saves (first save and median delta apart), and whether the files they
wrote are the same byte for byte.

Run: ``python benchmarks/paired_saves.py --base HEAD~1 [--workload minilm-docstrings ...] [--rounds 1]``
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.store import CheckpointManager

REPOSITORY = Path(__file__).resolve().parent.parent
BASE_PACKAGE = "inshrinkerator_base"


def import_base(revision: str, folder: Path) -> Any:
    """The ``inshrinkerator`` package of ``revision``, imported as :data:`BASE_PACKAGE`."""
    archive = subprocess.run(
        ["git", "archive", revision, "src/inshrinkerator"], cwd=REPOSITORY, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "src" / "inshrinkerator").rename(folder / BASE_PACKAGE)
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"{BASE_PACKAGE}.store")


def paired_run(name: str, base_manager: Any, folder: Path, base_first: bool = False) -> dict[str, Any]:
    """One workload's schedule, every state saved by both packages (``base_first``: the
    base package saves first at the first checkpoint, which pays the process's one-time costs)."""
    workload = make_workload(name, 0)
    workload.build()
    size = workload.size
    managers = {"this tree": CheckpointManager(folder / "new"), "base": base_manager(folder / "base")}
    for manager in managers.values():
        manager.watch(workload.model)
    seconds: dict[str, list[float]] = {side: [] for side in managers}
    saves = 0
    for step in range(size.total_steps):
        workload.train_step(step)
        if (step + 1) % size.checkpoint_every == 0:
            state = {"step": step + 1, **workload.state()}
            order = list(managers) if (saves + base_first) % 2 == 0 else list(reversed(managers))
            for side in order:
                started = time.perf_counter()
                managers[side].save(step + 1, state)
                seconds[side].append(time.perf_counter() - started)
            saves += 1
    for manager in managers.values():
        manager.close()
    files = {side: sorted((folder / path).rglob("*.ink")) for side, path in (("this tree", "new"), ("base", "base"))}
    same = len(files["this tree"]) == len(files["base"]) and all(
        a.read_bytes() == b.read_bytes() for a, b in zip(files["this tree"], files["base"])
    )
    return {"workload": name, "seconds": seconds, "same_files": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~1)")
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--rounds", type=int, default=1, help="training runs per workload")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.base, Path(folder))
        for name in args.workload or ["minilm-docstrings", "stdlib-char-gpt", "digits-cnn"]:
            for round_ in range(args.rounds):
                with tempfile.TemporaryDirectory() as run_folder:
                    row = paired_run(name, base.CheckpointManager, Path(run_folder), base_first=round_ % 2 == 1)
                parts = []
                for side, times in row["seconds"].items():
                    parts.append(
                        f"{side} {sum(times):.2f} s (first {times[0]:.2f}, median delta {statistics.median(times[1:] or times):.3f})"
                    )
                print(f"{name} round {round_ + 1}: " + "; ".join(parts) + f"; files the same: {row['same_files']}", flush=True)


if __name__ == "__main__":
    main()
