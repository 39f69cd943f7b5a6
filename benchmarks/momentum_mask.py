"""How much of a pruned momentum buffer's mask does the weight's change predict?

DynaQuant keeps the largest ``momentum_keep`` = 10 % of an SGD momentum buffer by
magnitude at checkpoints 30+ steps apart (Adam's first moment: the largest 5 % of
``|m| / sqrt(v)``); which entries are kept costs about the binary entropy of that share
per value. A reader decodes the weights before the moments, and so knows each weight's
change since the previous checkpoint. This script trains one yardstick workload without
checkpoints and, at every checkpoint step after the first, prints for its weights of
``min_numel`` values or more the order-0 bytes of the exact mask, and the conditional
entropy of the mask, as a share of it, given: the rank of ``|change|`` (or of
``|weight|``) in 16 equal groups; 4 classes of rows by their share of kept entries (about
what the coder's ids by class of rows use already); and both (4 x 16 groups). What a mask
coded per group could save, before its per-group stream costs.

Run: ``python benchmarks/momentum_mask.py --workload digits-cnn-sgd``
"""

from __future__ import annotations

import argparse

import torch

from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.workloads import WORKLOADS, make_workload

GROUPS = 16


def binary_entropy(share: torch.Tensor) -> torch.Tensor:
    share = share.clamp(1e-12, 1 - 1e-12)
    return -(share * torch.log2(share) + (1 - share) * torch.log2(1 - share))


def rank_of(values: torch.Tensor) -> torch.Tensor:
    """Each value's rank (0 for the smallest; ties in index order)."""
    ranks = torch.empty_like(values, dtype=torch.int64)
    ranks[values.argsort(stable=True)] = torch.arange(values.numel())
    return ranks


def conditional_bits(mask: torch.Tensor, context: torch.Tensor, groups: int = GROUPS) -> float:
    """Bits of ``mask`` coded per group of equal size by rank of ``context``."""
    group = rank_of(context) * groups // context.numel()
    bits = 0.0
    for g in range(groups):
        chosen = mask[group == g]
        if chosen.numel():
            bits += chosen.numel() * float(binary_entropy(chosen.double().mean()))
    return bits


def row_classes(mask: torch.Tensor, rows: int) -> torch.Tensor:
    """Each entry's class of rows: 4 equal groups of rows by their share of kept entries."""
    shares = mask.reshape(rows, -1).double().mean(dim=1)
    ranks = torch.empty(rows, dtype=torch.int64)
    ranks[shares.argsort()] = torch.arange(rows)
    return (ranks * 4 // rows).repeat_interleave(mask.numel() // rows)


def kept_mask(workload, parameter: torch.Tensor, keep: float) -> torch.Tensor:
    """The entries DynaQuant's rule would keep of ``parameter``'s first-order state."""
    state = workload.optimizer.state[parameter]
    if "momentum_buffer" in state:
        score = state["momentum_buffer"].abs()
    else:
        score = state["exp_avg"].abs() / state["exp_avg_sq"].sqrt().clamp_min(1e-30)
    flat = score.reshape(-1)
    count = max(1, int(round(keep * flat.numel())))
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[flat.topk(count).indices] = True
    return mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="digits-cnn-sgd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=float, default=None, help="the kept share (default: 0.1 for momentum, 0.05 for Adam)")
    parser.add_argument("--min-numel", type=int, default=1024)
    args = parser.parse_args()
    with torch_threads(2):
        workload = make_workload(args.workload, args.seed)
        workload.build()
        weights = [p for p in workload.model.parameters() if p.requires_grad and p.numel() >= args.min_numel]
        adam = isinstance(workload.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        keep = args.keep if args.keep is not None else (0.05 if adam else 0.1)
        every = workload.size.checkpoint_every
        print(f"{args.workload} (seed {args.seed}): {len(weights)} weights, {sum(p.numel() for p in weights):,} values, "
              f"keeping {keep:.0%}; a checkpoint every {every} steps")
        print("step   mask B   given |change|   given |weight|   given rows   given rows and |change|")
        previous = None
        for step in range(workload.size.total_steps):
            workload.train_step(step)
            if (step + 1) % every:
                continue
            now = [p.detach().clone().reshape(-1) for p in weights]
            if previous is not None:
                plain = by_change = by_weight = by_rows = by_both = 0.0
                for parameter, weight, before in zip(weights, now, previous):
                    mask = kept_mask(workload, parameter, keep)
                    change = (weight - before).abs()
                    plain += mask.numel() * float(binary_entropy(mask.double().mean()))
                    by_change += conditional_bits(mask, change)
                    by_weight += conditional_bits(mask, weight.abs())
                    classes = row_classes(mask, parameter.shape[0])
                    by_rows += conditional_bits(mask, classes.double(), groups=4)
                    # rows first, then |change| within the same 16 groups
                    by_both += conditional_bits(mask, classes.double() * change.numel() + rank_of(change).double(), groups=4 * GROUPS)
                print(f"{step + 1:>4} {plain / 8:>8,.0f}   {by_change / plain:>13.3f}   {by_weight / plain:>13.3f}"
                      f"   {by_rows / plain:>10.3f}   {by_both / plain:>22.3f}", flush=True)
            previous = now


if __name__ == "__main__":
    main()
