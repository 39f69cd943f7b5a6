"""Subprocess entry point of the RSS memory probe (see ``memory.probe_in_subprocess``).

``python -m inshrinkerator.activations.bench.probe WORKLOAD METHOD SEED BATCH STEPS [THREADS]`` trains
STEPS steps at batch BATCH and prints one JSON line: the RSS before training, the median
RSS growth over a forward pass (steps after the first two), and the peak RSS.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch


def main(argv: list[str]) -> None:
    from .memory import measure_forward_rss, rss_bytes
    from .training import Trainer
    from .workloads import WORKLOADS

    workload_name, method = argv[0], argv[1]
    seed, batch_size, steps = int(argv[2]), int(argv[3]), int(argv[4])
    torch.set_num_threads(int(argv[5]) if len(argv) > 5 else 1)
    workload = WORKLOADS[workload_name]
    trainer = Trainer.create(workload, method, seed)
    workload.batch(seed, 0, batch_size)  # load the data before the baseline reading
    baseline = rss_bytes()
    growth = []
    for step in range(steps):
        grown = measure_forward_rss(trainer, step, batch_size)
        if step >= 2:  # the first steps settle codec choices and allocator state
            growth.append(grown)
    peak = _peak_rss()
    print(json.dumps({"rss_before": baseline, "forward_rss_growth": statistics.median(growth),
                      "peak_rss": peak}))


def _peak_rss() -> int:
    # VmHWM belongs to this process image; ru_maxrss would include the forked parent's pages
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


if __name__ == "__main__":
    main(sys.argv[1:])
