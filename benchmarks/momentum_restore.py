"""How far does a restore with a compressed momentum take a run from the exact one?

Trains a digits workload without checkpoints and, at a few checkpoint steps, restores its
exact state into a fresh copy of the workload with only the momenta of 1,024 values or
more replaced: SGD's momentum buffers (``digits-cnn-sgd``), or Adam's first moments
(``digits-cnn``; their steps ``m / sqrt(v)`` with ``v`` exact), by

- ``exact``: the momentum itself (the reference run);
- ``pruned``: its ``--keep`` (5 %) largest entries (by magnitude; Adam's by
  ``|m| / sqrt(v)``), the rest 0 (what ``DynaQuant(low_rank_momentum=False,
  low_rank_steps=False)`` keeps at such a checkpoint, before rounding);
- ``low_rank``: the integer-factor product :func:`~inshrinkerator.codecs.low_rank.low_rank_within`
  picks for what the pruning loses (of Adam's steps, then times ``sqrt(v) + 1e-8``), as
  ``DynaQuant()`` stores it (the pruned momentum where it picks none or the matrix is too
  small);
- ``zero``: no momentum at all.

The weights (and Adam's second moments) are restored exactly, so only the momentum differs. Each copy trains
``--after`` (30) steps on the same batches; printed: the squared distance of its weights
from the exact copy's, over the squared distance the exact copy moved in those steps, and
its mean training loss on the next 20 batches. The digits test accuracy moves in steps of
one image (0.22 %), too coarse to tell these apart (docs/dynaquant-measurements.md,
*Momentum buffers as a low-rank product*).

Run: ``python benchmarks/momentum_restore.py --seeds 4 [--workload digits-cnn]``
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Optional

import torch

from inshrinkerator.bench.workloads import make_workload
from inshrinkerator.codecs.low_rank import MIN_SIDE, low_rank_within, matrix_shape, step_scale

VARIANTS = ("exact", "pruned", "low_rank", "zero")


def replaced(buffer: torch.Tensor, variant: str, keep: float, second: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``buffer`` as ``variant`` restores it; with Adam's ``second`` moment, its steps
    ``buffer / (sqrt(second) + 1e-8)`` are pruned or factored, then scaled back."""
    if variant == "exact":
        return buffer
    if variant == "zero":
        return torch.zeros_like(buffer)
    if second is not None:
        scale = step_scale(second, torch.float32).reshape(buffer.shape)
        return replaced(buffer / scale, variant, keep) * scale
    flat = buffer.reshape(-1)
    largest = flat.abs().topk(max(1, int(round(keep * flat.numel()))))
    pruned = torch.zeros_like(flat)
    pruned[largest.indices] = flat[largest.indices]
    shape = matrix_shape(tuple(buffer.shape))
    if variant == "pruned" or shape is None or min(shape) < MIN_SIDE:
        return pruned.reshape(buffer.shape)
    loss = float(torch.dot(flat, flat) - torch.dot(largest.values, largest.values))
    factors = low_rank_within(buffer.reshape(shape), loss)
    if factors is None:
        return pruned.reshape(buffer.shape)
    return factors.product(torch.float32).reshape(buffer.shape)


def with_momentum(state: dict[str, Any], variant: str, keep: float) -> dict[str, Any]:
    state = copy.deepcopy(state)
    for entry in state["optimizer"]["state"].values():
        name = "momentum_buffer" if "momentum_buffer" in entry else "exp_avg"
        buffer = entry.get(name)
        if buffer is not None and buffer.numel() >= 1024:
            entry[name] = replaced(buffer, variant, keep, entry.get("exp_avg_sq"))
    return state


def squared(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a if a[k].is_floating_point())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("digits-cnn-sgd", "digits-cnn"), default="digits-cnn-sgd")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, nargs="+", default=[150, 300, 450], help="restore at these steps")
    parser.add_argument("--after", type=int, default=30, help="steps trained after each restore")
    parser.add_argument("--keep", type=float, default=0.05, help="the pruned buffer's kept share")
    args = parser.parse_args()
    torch.set_num_threads(1)
    distances: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for seed in range(args.seeds):
        workload = make_workload(args.workload, seed)
        workload.build()
        states = {}
        for step in range(max(args.steps)):
            workload.train_step(step)
            if step + 1 in args.steps:
                states[step + 1] = copy.deepcopy(workload.state())
        for at, state in states.items():
            ends = {}
            for variant in VARIANTS:
                copy_ = make_workload(args.workload, seed)
                copy_.build()
                copy_.restore(with_momentum(state, variant, args.keep))
                for step in range(at, at + args.after):
                    copy_.train_step(step)
                weights = {k: t.clone() for k, t in copy_.model.state_dict().items()}
                ends[variant] = (weights, copy_.loss_on(range(at + args.after, at + args.after + 20)))
            exact = ends["exact"][0]
            moved = squared(exact, state["model"])
            cells = []
            for variant, (weights, loss) in ends.items():
                distances[variant].append(squared(weights, exact) / moved)
                cells.append(f"{variant} {distances[variant][-1]:.4f} (loss {loss:.5f})")
            print(f"seed {seed} step {at}: " + " | ".join(cells), flush=True)
    print("mean distance from the exact run, over its movement: " + ", ".join(
        f"{variant} {sum(values) / len(values):.4f}" for variant, values in distances.items()
    ))


if __name__ == "__main__":
    main()
