"""Compressing a pretrained model one-shot: ratio against quality, knob by knob.

The yardstick's transfer table compresses the whole shipped all-MiniLM-L6-v2 state once
with each policy's defaults. A bare model has no optimizer state, so DynaQuant treats
every weight as frozen and holds it to ``frozen_tolerance`` (2e-4 of its squared size),
the budget a fine-tune's frozen layers need because training never removes their error.
A model stored once for inference or as a fine-tuning base may take more: this script
saves the same state under each policy spec given and reports the ratio and the accuracy
of the yardstick's ridge probe on the restored encoder (the transfer table's quality
measure), against the probe on the exact weights.

Run: ``python benchmarks/one_shot.py [--policy SPEC ...] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from inshrinkerator.bench.measures import degradation_percent
from inshrinkerator.bench.policy_specs import build_policy
from inshrinkerator.bench.suite import source_commit
from inshrinkerator.bench.workloads import make_workload
from inshrinkerator.bench.workloads.minilm import cut_pretrained, pretrained_full_state
from inshrinkerator.single_file import load, save

DEFAULT_SPECS = (
    "dynaquant",
    "dynaquant:frozen_tolerance=0.001",
    "dynaquant:frozen_tolerance=0.003",
    "dynaquant:tolerance=0.01,frozen_tolerance=0.01",
    "dynaquant:tolerance=0.03,frozen_tolerance=0.03",
    "dynaquant:tolerance=0.1,frozen_tolerance=0.1",
    "cnr",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", action="append", default=None, help="a policy spec (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    torch.set_num_threads(2)
    workload = make_workload("minilm-docstrings", 0)
    workload.build()
    exact = workload.probe_accuracy(workload.pretrained_state())
    state = pretrained_full_state()
    print(f"exact weights: probe accuracy {exact:.4f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pretrained.ink"
        for spec in args.policy or DEFAULT_SPECS:
            started = time.perf_counter()
            info = save(state, path, policy=build_policy(spec))
            seconds = time.perf_counter() - started
            accuracy = workload.probe_accuracy(cut_pretrained(load(path), workload.max_length, workload.layers))
            row = {
                "policy": spec,
                "ratio": info.ratio,
                "stored_bytes": info.stored_bytes,
                "probe_accuracy": accuracy,
                "deg_pct": degradation_percent(exact, accuracy, True),
                "save_seconds": seconds,
            }
            rows.append(row)
            print(
                f"{spec:48s} {row['ratio']:6.2f}x  probe {accuracy:.4f}  deg {row['deg_pct']:+.2f} %  "
                f"save {seconds:.1f} s",
                flush=True,
            )
    if args.out:
        document = {
            "benchmark": "one-shot compression of the pretrained MiniLM",
            **source_commit(),
            "raw_bytes": info.raw_bytes,
            "exact_probe_accuracy": exact,
            "rows": rows,
        }
        args.out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
