"""Subprocess entry point of the RSS memory probe (see ``memory.probe_in_subprocess``).

``python -m inshrinkerator.activations.bench.probe WORKLOAD METHOD SEED BATCH STEPS`` trains
STEPS steps at batch BATCH and prints one JSON line: the RSS before training, the median
RSS growth over a forward pass (steps after the first two), and the peak RSS.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys

import torch


def main(argv: list[str]) -> None:
    from .memory import measure_forward_rss, rss_bytes
    from .training import Trainer
    from .workloads import WORKLOADS

    workload_name, method, seed, batch_size, steps = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    workload = WORKLOADS[workload_name]
    trainer = Trainer.create(workload, method, seed)
    workload.batch(seed, 0, batch_size)  # load the data before the baseline reading
    baseline = rss_bytes()
    growth = []
    for step in range(steps):
        grown = measure_forward_rss(trainer, step, batch_size)
        if step >= 2:  # the first steps settle codec choices and allocator state
            growth.append(grown)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rss_before": baseline, "forward_rss_growth": statistics.median(growth),
                      "peak_rss": peak}))


if __name__ == "__main__":
    main(sys.argv[1:])
