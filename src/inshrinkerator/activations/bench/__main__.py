"""``python -m inshrinkerator.activations.bench [--quick] [--out DIR]``: run the activation benchmark."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .methods import METHODS
from .runner import run_activation_bench
from .workloads import WORKLOADS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inshrinkerator.activations.bench",
                                     description="Activation memory, step time and accuracy of activation "
                                                 "compression against checkpointing and save_on_cpu.")
    parser.add_argument("--quick", action="store_true", help="short training and timing (a few minutes)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/activations"),
                        help="output directory (default: benchmarks/results/activations)")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="repeat to pick several")
    parser.add_argument("--method", action="append", choices=list(METHODS), help="repeat to pick several")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--parallel", action="store_true",
                        help="run each workload in its own process (one core each)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    results = run_activation_bench(args.out, args.quick, workloads=args.workload, methods=args.method,
                                   show_progress=not args.no_progress, threads=args.threads,
                                   parallel=args.parallel)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
