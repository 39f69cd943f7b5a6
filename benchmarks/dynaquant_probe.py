"""Probe DynaQuant on the yardstick's failure-recovery protocol, next to chosen baselines.

Runs the uninterrupted reference once per workload and seed, then one failure-recovery
run per policy spec (``name`` or ``name:key=value,...``, as ``inshrink bench`` takes
them), and prints degradation, full-state and weights-only ratios, compression MB/s and
the restore time against ``torch.load``; for DynaQuant also the search cost and how
close the entropy stage came to the order-0 entropy of its symbols.

    python benchmarks/dynaquant_probe.py --workload digits-cnn --policy dynaquant --policy excp
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from inshrinkerator.bench.aggregate import run_metrics
from inshrinkerator.bench.policy_specs import build_policy
from inshrinkerator.bench.recovery import run_reference, run_with_failures
from inshrinkerator.policies import DynaQuant


def _dynaquant_extras(policy: object) -> dict:
    if not isinstance(policy, DynaQuant):
        return {}
    log = policy.search_log
    stats = policy.entropy_stats
    return {
        "search_evaluations": sum(r.evaluations for r in log),
        "search_seconds": sum(r.seconds for r in log),
        "searches": [r.kind for r in log],
        "configs": [r.config for r in log],
        "qualities": [r.quality for r in log],
        "entropy_symbols": stats.symbols,
        "entropy_payload_over_order0": stats.payload_overhead,
        "entropy_table_bytes": stats.table_bytes,
        "entropy_payload_bytes": stats.payload_bytes,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", default=None)
    parser.add_argument("--policy", action="append", default=None)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--failures", type=int, default=10)
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workloads = args.workload or ["digits-cnn"]
    specs = args.policy or ["dynaquant"]
    results = []
    for workload in workloads:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            started = time.perf_counter()
            reference = run_reference(workload, seed, args.quick).to_dict()
            print(f"# {workload} seed {seed}: reference {reference['evaluation']['metric']} = "
                  f"{reference['evaluation']['value']:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
            for spec in specs:
                policy = build_policy(spec)
                started = time.perf_counter()
                with tempfile.TemporaryDirectory() as folder:
                    run = run_with_failures(
                        workload, seed, args.quick, policy, Path(folder) / "run",
                        failures=args.failures, full_every=args.full_every,
                    ).to_dict()
                metrics = run_metrics(run, reference)
                row = {"workload": workload, "seed": seed, "policy": spec, **metrics,
                       "metric": run["evaluation"]["value"], "class_bytes": run["class_bytes"],
                       "seconds": time.perf_counter() - started, **_dynaquant_extras(policy)}
                results.append(row)
                print(
                    f"{workload:>18} s{seed} {spec:<40} deg {metrics['deg_pct']:+6.2f}%  "
                    f"CR full {metrics['cr_full']:6.1f}  CR w {metrics['cr_weights']:6.1f}  "
                    f"{metrics['compress_mbps']:6.1f} MB/s  restore x{metrics['restore_ratio']:.1f} torch.load  "
                    f"({row['seconds']:.0f} s)",
                    flush=True,
                )
                if "search_evaluations" in row:
                    print(
                        f"{'':>22} search: {row['search_evaluations']} evaluations, {row['search_seconds']:.1f} s; "
                        f"entropy stage {100 * row['entropy_payload_over_order0']:+.2f}% vs order-0 "
                        f"({row['entropy_symbols']} symbols, tables {row['entropy_table_bytes']} B)",
                        flush=True,
                    )
                stored = run["class_bytes"]["stored"]
                print(f"{'':>22} stored bytes by class: {stored}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
