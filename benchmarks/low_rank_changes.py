"""How low-rank are the weights' changes between checkpoints, and what does a product save?

A delta stores a weight matrix's change since the previous checkpoint, rounded to evenly
spaced levels (``residual_error``: ``sqrt(12 * 0.03)`` times the change's RMS apart).
``residual_low_rank`` stores a low-rank product of integer factors first and rounds only
what it leaves, to the same levels. This script trains one yardstick workload without
checkpoints and, at every checkpoint step, takes the exact change of each weight matrix
(both sides at least 16; a convolution as ``out x (in * kh * kw)``) since the previous
checkpoint step, and prints, summed over those matrices:

- the share of the changes' energy held by their top 1, 4, 16 and 64 singular directions;
- the order-0 entropy of the change rounded to its levels (bits per value), against the
  same for what a rank-r product leaves plus the product's factor symbols, at each rank
  (``r4`` ... as a change in total bits) and at the rank :func:`choose_low_rank` picks
  per tensor (``chosen``; a tensor it picks none for counts as plain).

Exact consecutive states: a run's deltas are taken against the previous reconstruction,
and the first delta after a full checkpoint mostly codes that checkpoint's own error,
which no product holds. The real coder lands near these order-0 figures
(docs/dynaquant-measurements.md, *Changes as a low-rank product*).

Run: ``python benchmarks/low_rank_changes.py --workload stdlib-char-gpt``
"""

from __future__ import annotations

import argparse
import math

import torch

from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.codecs.low_rank import (
    MIN_SIDE,
    LowRankFactors,
    choose_low_rank,
    low_rank_factors,
    matrix_shape,
)

RANKS = (1, 4, 16, 64)
CODED_RANKS = (2, 4, 8, 16, 32)


def order0_bits(values: torch.Tensor) -> float:
    """Order-0 entropy, in bits, of ``values`` rounded to integers."""
    _, counts = torch.unique(torch.round(values.reshape(-1)), return_counts=True)
    counts = counts.to(torch.float64)
    return float(-(counts * torch.log2(counts / counts.sum())).sum())


def coded_bits(change: torch.Tensor, step: float, factors: LowRankFactors) -> float:
    """What the product of ``factors`` leaves of ``change``, rounded, plus their symbols."""
    return order0_bits((change - factors.product(torch.float32)) / step) + order0_bits(factors.symbols().float())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="stdlib-char-gpt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--residual-error", type=float, default=0.03)
    args = parser.parse_args()
    with torch_threads(2):
        workload = make_workload(args.workload, args.seed)
        workload.build()
        size = workload.size
        matrices = [
            (name, p) for name, p in workload.model.named_parameters()
            if p.requires_grad and matrix_shape(p.shape) is not None and min(matrix_shape(p.shape)) >= MIN_SIDE  # type: ignore[arg-type]
        ]
        print(f"{args.workload} (seed {args.seed}): a checkpoint every {size.checkpoint_every} steps; "
              f"{len(matrices)} weight matrices, {sum(p.numel() for _, p in matrices):,} values")
        print("step  energy " + " ".join(f"r{r:<5}" for r in RANKS) + "  plain b/v  " +
              " ".join(f"r{r:<6}" for r in CODED_RANKS) + "  chosen")
        previous = None
        for step in range(size.total_steps):
            workload.train_step(step)
            if (step + 1) % size.checkpoint_every:
                continue
            now = {name: p.detach().float().clone() for name, p in matrices}
            if previous is not None:
                energy, held = 0.0, {r: 0.0 for r in RANKS}
                values, plain, chosen = 0, 0.0, 0.0
                by_rank = {r: 0.0 for r in CODED_RANKS}
                for name, tensor in now.items():
                    change = (tensor - previous[name]).reshape(matrix_shape(tensor.shape))  # type: ignore[arg-type]
                    squared = torch.linalg.svdvals(change.double()).pow(2)
                    energy += float(squared.sum())
                    for r in RANKS:
                        held[r] += float(squared[:r].sum())
                    rms = float(change.pow(2).mean().sqrt())
                    if rms == 0:
                        continue
                    step_size = rms * math.sqrt(12 * args.residual_error)
                    bits = order0_bits(change / step_size)
                    values += change.numel()
                    plain += bits
                    for r in CODED_RANKS:
                        by_rank[r] += coded_bits(change, step_size, low_rank_factors(change, r)) if r <= min(change.shape) // 4 else bits
                    factors = choose_low_rank(change, step_size)
                    chosen += bits if factors is None else coded_bits(change, step_size, factors)
                print(f"{step + 1:>4}         " + " ".join(f"{held[r] / energy:.3f} " for r in RANKS) +
                      f"  {plain / values:.3f}      " + " ".join(f"{by_rank[r] / plain - 1:+.1%} " for r in CODED_RANKS) +
                      f"  {chosen / plain - 1:+.1%}", flush=True)
            previous = now


if __name__ == "__main__":
    main()
