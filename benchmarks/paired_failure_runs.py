"""The yardstick's failure run, with this tree's package and with another commit's, in turn.

A failure run (``inshrink bench``'s protocol: 10 failures, each followed by a restore of
the latest checkpoint in a fresh "process") of one workload and seed with the default
policy, once with the package at ``--base`` (imported under another name, as
``benchmarks/paired_saves.py`` does) and once with this tree's, in one process; the order
alternates between ``--rounds``. Printed per side: the seconds of every save and restore,
the bytes stored, the final metric. Unlike ``paired_saves.py`` this covers what a restart
costs: the first save of each new process and the restore before it. Two runs of the same
workload store the same bytes and end at the same metric unless the policy's decisions
changed; the times come from a shared machine, so compare the sides, not the runs.

Run: ``python benchmarks/paired_failure_runs.py --base HEAD~1 [--workload minilm-docstrings] [--seed 0] [--rounds 1]``
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from paired_saves import BASE_PACKAGE, import_base

from inshrinkerator.bench import recovery
from inshrinkerator.bench.workloads import WORKLOADS


def failure_run(module: Any, name: str, seed: int, folder: Path) -> dict[str, Any]:
    """One failure run through ``module`` (a package's ``bench.recovery``)."""
    started = time.perf_counter()
    record = module.run_with_failures(name, seed, False, "dynaquant", folder / "run").to_dict()
    return {
        "seconds": time.perf_counter() - started,
        "saves": [checkpoint["seconds"] for checkpoint in record["checkpoints"]],
        "restores": [restore["seconds"] for restore in record["restores"] if restore["restored_step"] is not None],
        "stored_bytes": record["stored_bytes_on_disk"],
        "metric": record["evaluation"]["value"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~1)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="minilm-docstrings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="runs per side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        import_base(args.base, Path(folder))
        sides = {"base": importlib.import_module(f"{BASE_PACKAGE}.bench.recovery"), "this tree": recovery}
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for side in order:
                with tempfile.TemporaryDirectory() as run_folder:
                    row = failure_run(sides[side], args.workload, args.seed, Path(run_folder))
                saves, restores = row["saves"], row["restores"]
                print(
                    f"{args.workload} seed {args.seed}, {side}: saves {sum(saves):.2f} s "
                    f"({', '.join(f'{s:.2f}' for s in saves)}); restores {sum(restores):.2f} s "
                    f"({', '.join(f'{s:.2f}' for s in restores)}); stored {row['stored_bytes']:,} B; "
                    f"metric {row['metric']:.4f}; the run {row['seconds']:.0f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
