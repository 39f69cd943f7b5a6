"""What do cell means save over evenly spaced levels, at what error?

A delta stores a weight's change since the previous checkpoint on evenly spaced levels
(``residual_error``), a matrix's perhaps as a low-rank product plus what it leaves. With
``cell_means`` each cell is reconstructed at the mean of its values instead of its middle,
and the cells widen until they lose what the plain levels lose. An Adam first moment kept
whole goes to such levels too (``first_moment_error``), where the policy keeps them evenly
spaced (wider cells round more entries to 0, which cost MiniLM's accuracy); this script
shows what cell means would take off them all the same. It trains one yardstick workload
without checkpoints and, at every ``--every``-th checkpoint step, codes with the real
codecs, summed over the tensors the policy would code so (weights of at least 64 values;
first moments of at least 1,024):

- each weight's exact change since the previous checkpoint step, as the policy plans it
  (``change_plan``: a product where it pays), on evenly spaced levels, on cell means at
  no more error, and on cell means at the whole ``residual_error``;
- each whole first moment (``exp_avg``), a matrix's perhaps as a product (where it saves
  15 %, as the policy's), on evenly spaced levels and on cell means at the whole
  ``first_moment_error`` (ids not grouped by the second moment's octaves, which the
  policy does: the levels alone differ).

Printed per step: bytes and error (the summed squared error over the summed squared
change, or moment) of each. Exact consecutive changes: in a run each delta is taken
against the previous reconstruction, so its change also holds the previous delta's
error, which no product takes out; more error per delta costs the next delta bytes (why
a change's cell means spend no more than the plain levels lose; what that did in failure
runs: docs/dynaquant-measurements.md, *Cell means for stored changes*).

Run: ``python benchmarks/cell_means.py --workload stdlib-char-gpt [--every 2]``
"""

from __future__ import annotations

import argparse

import torch

from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.codecs import DynaQuantCodec, LowRankResidualCodec, ResidualCodec
from inshrinkerator.policies.dynaquant_moments import FIRST_MOMENT_LOW_RANK_MARGIN
from inshrinkerator.policies.even_levels import change_plan, step_levels

RESIDUAL_ERROR = 0.03
FIRST_MOMENT_ERROR = 0.08
#: (label, cell means, within what evenly spaced levels lose)
CHOICES = (("even", False, True), ("means", True, True), ("means, whole share", True, False))


def coded(tensor: torch.Tensor, reference, error: float, means: bool, within_even: bool, margin: float) -> tuple[int, float]:
    """(bytes, squared error) of ``tensor`` against ``reference`` (a first moment: against
    zeros) on the levels asked for, a matrix perhaps as a product (``margin``)."""
    histogram, rms, largest, factors = change_plan(tensor, reference, error, margin)
    centroids, prune_below = step_levels(histogram, rms, largest, error, means, within_even)
    inner = DynaQuantCodec(bins=10, prune=0.0, protect=0.0).with_hints(
        counts=histogram, centroids=centroids, prune_below=prune_below
    )
    if factors is None:
        codec = ResidualCodec(inner)
    else:
        codec = LowRankResidualCodec(inner, factors.rank).with_factors(factors)
    encoded = codec.encode(tensor, reference)
    squared = float((encoded.reconstruction.double() - tensor.double()).pow(2).sum())
    return sum(len(stream) for stream in encoded.streams), squared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="stdlib-char-gpt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=2, help="measure at every N-th checkpoint step")
    args = parser.parse_args()
    with torch_threads(2):
        workload = make_workload(args.workload, args.seed)
        workload.build()
        size = workload.size
        weights = [(name, p) for name, p in workload.model.named_parameters() if p.requires_grad and p.numel() >= 64]
        print(f"{args.workload} (seed {args.seed}): a checkpoint every {size.checkpoint_every} steps; "
              f"{len(weights)} trained weights; bytes (error share) per step")
        previous = None
        for step in range(size.total_steps):
            workload.train_step(step)
            if (step + 1) % size.checkpoint_every:
                continue
            now = {name: p.detach().float().clone() for name, p in weights}
            if previous is not None and (step + 1) % (args.every * size.checkpoint_every) == 0:
                line = [f"{step + 1:>4}  changes:"]
                energy = sum(float((now[name] - previous[name]).double().pow(2).sum()) for name, _ in weights)
                for label, means, within_even in CHOICES:
                    results = [coded(now[name], previous[name], RESIDUAL_ERROR, means, within_even, 0.05)
                               for name, _ in weights]
                    line.append(f"{label} {sum(r[0] for r in results):,} B ({sum(r[1] for r in results) / energy:.4f})")
                moments = [
                    state["exp_avg"].detach().float() for p in (p for _, p in weights)
                    if (state := workload.optimizer.state.get(p)) and "exp_avg" in state and state["exp_avg"].numel() >= 1024
                ]
                if moments:
                    energy = sum(float(m.double().pow(2).sum()) for m in moments)
                    line.append(" | whole first moments:")
                    for label, means, _ in CHOICES[:2]:
                        results = [coded(m, torch.zeros_like(m), FIRST_MOMENT_ERROR, means, False, FIRST_MOMENT_LOW_RANK_MARGIN)
                                   for m in moments]
                        line.append(f"{label} {sum(r[0] for r in results):,} B ({sum(r[1] for r in results) / energy:.4f})")
                print("  ".join(line), flush=True)
            previous = now


if __name__ == "__main__":
    main()
