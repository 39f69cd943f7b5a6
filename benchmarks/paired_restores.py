"""Restore speed of this tree against another commit's, paired in one process.

Timings on a shared machine drift by 10-20 % between runs, more than most changes to a
decoder move them. Here the same step of the same run (a folder a ``CheckpointManager``
wrote, e.g. by ``benchmarks/chain_depth.py`` or a training script) is loaded by two
packages: the package as it is in this tree, and the package at ``--base`` (extracted
with ``git archive`` into a temporary folder and imported under another name, as
``benchmarks/paired_saves.py`` does). Each load is ``CheckpointManager(folder).load(step)``
with a fresh manager, the two sides in alternating order, so both see the same files,
the same page cache and the same moments of the machine's load. One torch thread, as
the other benchmarks run; pin the process (``taskset -c 0``) to measure one core.

Printed per folder: each side's best and median time over ``--loads`` loads, and whether
the two restored states are the same: every tensor of the same dtype and shape, bit for
bit (floats compared by their bits, so NaNs of the same payload are equal), and every
other value equal.

Run: ``python benchmarks/paired_restores.py --base HEAD~1 --folder RUN [--folder RUN2 ...]
[--step STEP] [--loads 8]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

from inshrinkerator.store import CheckpointManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_saves import import_base  # noqa: E402  (a sibling script, not a package)


def first_difference(a: Any, b: Any, where: str = "state") -> Optional[str]:
    """Where two restored states first differ (None if they are the same): tensors must
    match in type, dtype, shape and bits; containers in type, keys and length; other
    values by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: a tensor on one side only"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype} {list(a.shape)} against {b.dtype} {list(b.shape)}"
        if a.is_floating_point() or a.is_complex():
            a, b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        return None if torch.equal(a, b) else f"{where}: values differ"
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} against {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys differ"
        for key in a:
            found = first_difference(a[key], b[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: lengths {len(a)} and {len(b)}"
        for index, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{index}]")
            if found:
                return found
        return None
    return None if a == b else f"{where}: {a!r} against {b!r}"


def paired_loads(folder: Path, step: Optional[int], loads: int, base_manager: Any) -> dict[str, Any]:
    """``loads`` restores of ``step`` (the latest when None) by each package, alternating
    (this tree first in even rounds); the times and the first difference of the states."""
    sides = {"this tree": CheckpointManager, "base": base_manager}
    if step is None:
        step = CheckpointManager(folder).latest_step()
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    restored: dict[str, Any] = {}
    for round_ in range(loads):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            manager = sides[side](folder)
            restored.pop(side, None)  # the previous state is freed before the next load
            started = time.perf_counter()
            restored[side] = manager.load(step)
            seconds[side].append(time.perf_counter() - started)
    return {"step": step, "seconds": seconds, "difference": first_difference(restored["this tree"], restored["base"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~1)")
    parser.add_argument("--folder", action="append", required=True, type=Path, help="a run folder")
    parser.add_argument("--step", type=int, default=None, help="the step to load (default: each run's latest)")
    parser.add_argument("--loads", type=int, default=8, help="loads per side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.base, Path(folder))
        for run in args.folder:
            row = paired_loads(run, args.step, args.loads, base.CheckpointManager)
            parts = [
                f"{side} best {min(times):.3f} s, median {statistics.median(times):.3f} s"
                for side, times in row["seconds"].items()
            ]
            new, old = (min(row["seconds"][side]) for side in ("this tree", "base"))
            same = "yes" if row["difference"] is None else f"NO ({row['difference']})"
            print(
                f"{run} step {row['step']}: " + "; ".join(parts)
                + f"; best {100 * (new / old - 1):+.1f} %; restored states the same: {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
