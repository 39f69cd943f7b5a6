"""How much of the weights' movement between checkpoints could a delta coder predict?

A delta of the weights codes their movement since the previous checkpoint. Adam moves a
weight by about ``-lr * m / (sqrt(v) + eps)`` per step, and the same checkpoint stores
``m`` and ``v``, so a decoder that has already read them could predict part of the
movement and the coder would only have to code the rest. This script trains one
yardstick workload without checkpoints and, at every checkpoint step, fits per weight
tensor ``movement ~ c * u`` by least squares, for three directions ``u``:

- ``adam``: ``m / (sqrt(v) + eps)`` of the optimizer state at the checkpoint;
- ``previous``: the movement between the two checkpoints before (the same tensor only);
- ``both``: the two together (two coefficients per tensor).

It prints the share of the movement's energy each explains (R^2, summed over the
weight tensors of at least 1,024 values). The exact moments give an upper bound: the
stored ones are quantized.

Run: ``python benchmarks/movement_prediction.py --workload minilm-docstrings``
"""

from __future__ import annotations

import argparse

import torch

from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.workloads import WORKLOADS, make_workload


def unexplained(movement: torch.Tensor, directions: list[torch.Tensor]) -> float:
    """The energy of ``movement`` that its least-squares fit on ``directions`` leaves."""
    basis = torch.stack(directions, 1)
    coefficients = torch.linalg.lstsq(basis, movement.unsqueeze(1)).solution
    rest = movement - (basis @ coefficients).squeeze(1)
    return float(rest @ rest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="minilm-docstrings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with torch_threads(2):
        workload = make_workload(args.workload, args.seed)
        workload.build()
        size = workload.size
        optimizer = workload.optimizer
        weights = [
            p for group in optimizer.param_groups for p in group["params"]
            if p.requires_grad and p.dim() >= 2 and p.numel() >= 1024
        ]
        eps = optimizer.param_groups[0].get("eps", 1e-8)
        previous: list[torch.Tensor] = []
        moved_before: list[torch.Tensor] = []
        print(f"{args.workload} (seed {args.seed}): a checkpoint every {size.checkpoint_every} steps; "
              f"{len(weights)} weight tensors")
        print("step    R^2 adam  R^2 previous  R^2 both")
        for step in range(size.total_steps):
            workload.train_step(step)
            if (step + 1) % size.checkpoint_every:
                continue
            current = [p.detach().double().reshape(-1).clone() for p in weights]
            if previous:
                energy = left_adam = left_previous = left_both = 0.0
                moved_now = []
                for index, parameter in enumerate(weights):
                    moved = current[index] - previous[index]
                    state = optimizer.state[parameter]
                    adam = (state["exp_avg"] / (state["exp_avg_sq"].sqrt() + eps)).double().reshape(-1)
                    energy += float(moved @ moved)
                    left_adam += unexplained(moved, [adam])
                    if moved_before:
                        left_previous += unexplained(moved, [moved_before[index]])
                        left_both += unexplained(moved, [adam, moved_before[index]])
                    moved_now.append(moved)
                line = f"{step + 1:>4}    {1 - left_adam / energy:8.3f}"
                if moved_before:
                    line += f"  {1 - left_previous / energy:12.3f}  {1 - left_both / energy:8.3f}"
                print(line, flush=True)
                moved_before = moved_now
            previous = current


if __name__ == "__main__":
    main()
