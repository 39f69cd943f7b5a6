"""Degradation of two policies on the yardstick, seed by seed: is the gap more than noise?

Each failure run is judged against the uninterrupted run of its workload and seed, so two
policies' runs of one seed share their reference and much of their noise. Printed per
workload: the mean of the per-seed differences (first policy minus second, in points of
degradation), their standard deviation, the paired t statistic, and on how many seeds the
first policy ended worse, better or the same.

Run: ``python benchmarks/paired_degradation.py [--results benchmarks/results/results.json]
[--first dynaquant] [--second excp]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def degradation(run: dict[str, Any], reference: dict[str, Any]) -> float:
    """How much worse ``run`` ended than its uninterrupted reference, in percent of it."""
    value, base = run["value"], reference["value"]
    worse = base - value if run["higher_is_better"] else value - base
    return 100.0 * worse / abs(base)


def paired(results: dict[str, Any], first: str, second: str) -> list[dict[str, Any]]:
    """One row per workload: the per-seed differences of ``first`` against ``second``."""
    references = {(r["workload"], r["seed"]): r["evaluation"] for r in results["references"]}
    by_run = {
        (run["workload"], run["label"], run["seed"]): degradation(run["evaluation"], references[(run["workload"], run["seed"])])
        for run in results["runs"]
        if (run["workload"], run["seed"]) in references
    }
    rows = []
    for workload in dict.fromkeys(run["workload"] for run in results["runs"]):
        seeds = sorted(s for (w, label, s) in by_run if w == workload and label == first and (w, second, s) in by_run)
        differences = [by_run[(workload, first, s)] - by_run[(workload, second, s)] for s in seeds]
        if len(differences) < 2:
            continue
        spread = statistics.stdev(differences)
        mean = statistics.mean(differences)
        rows.append({
            "workload": workload,
            "seeds": len(differences),
            "mean": mean,
            "sd": spread,
            "t": mean / (spread / math.sqrt(len(differences))) if spread > 0 else (
                0.0 if mean == 0 else math.copysign(math.inf, mean)),
            "worse": sum(d > 0 for d in differences),
            "better": sum(d < 0 for d in differences),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/results.json"))
    parser.add_argument("--first", default="dynaquant")
    parser.add_argument("--second", default="excp")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    print(f"{args.first} against {args.second}: degradation, per-seed differences (points)")
    for row in paired(results, args.first, args.second):
        same = row["seeds"] - row["worse"] - row["better"]
        print(f"  {row['workload']:<20} {row['seeds']} seeds  mean {row['mean']:+.2f}  sd {row['sd']:.2f}  "
              f"t {row['t']:+.2f}  {args.first} worse on {row['worse']}, better on {row['better']}, same on {same}")


if __name__ == "__main__":
    main()
