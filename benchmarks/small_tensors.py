"""What a checkpoint's small tensors (biases, norm layers: weights under ``min_numel``) cost.

Trains one yardstick workload without checkpoints to two consecutive checkpoint steps and
plans the later exact state with DynaQuant, whole (a full checkpoint) and against the
earlier one (a delta), then prints, summed over the weights from ``small_min_numel`` up
to ``min_numel`` and over their second moments:

- the weights of a full checkpoint: stored losslessly (``small_weight_error=None``) and
  on evenly spaced levels at each ``--shares`` (the share of its squared size a weight
  loses), with the error each actually lost;
- the second moments: on 16 k-means levels in log2 (as before the log lattice) and on the
  lattice ``2 ** (k / 4)`` (the default), whole and as a delta, with the root mean square
  of ``log2`` of each restored ``sqrt(v)`` against the exact one (what Adam divides by).

Bytes are the codecs' own streams (a file adds each record's header entry).
docs/dynaquant-measurements.md, *Small tensors at full checkpoints and on a log lattice*.

Run: ``python benchmarks/small_tensors.py --workload stdlib-char-gpt --step 360``
"""

from __future__ import annotations

import argparse
import copy

import torch

from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.codecs.base import TensorSpec
from inshrinkerator.policies import DynaQuant, dynaquant_moments
from inshrinkerator.policies.base import encoded_size
from inshrinkerator.policies.state_layout import TensorRole, layout_of, param_group_ids
from inshrinkerator.tree import flatten


def states_at(name: str, seed: int, step: int) -> tuple[dict, dict]:
    """The exact states one checkpoint interval before ``step`` and at it."""
    workload = make_workload(name, seed)
    workload.build()
    every = workload.size.checkpoint_every
    if step % every or step <= every or step > workload.size.total_steps:
        raise SystemExit(f"--step must be a checkpoint step after the first ({every}, {2 * every}, ...)")
    states = {}
    for done in range(step):
        workload.train_step(done)
        if done + 1 in (step - every, step):
            states[done + 1] = copy.deepcopy(workload.state())
    return states[step - every], states[step]


def planned(policy: DynaQuant, state: dict, leaves, references, indices) -> tuple[int, list[torch.Tensor]]:
    """Bytes and restored tensors of the leaves at ``indices`` of ``state`` as ``policy``
    plans them (as a writer does: with the optimizer's param groups)."""
    codecs = policy.plan_state(state, leaves, references)
    total, restored = 0, []
    for index in indices:
        codec, tensor = codecs[index], leaves[index].tensor
        reference = references[index] if codec.uses_reference else None
        encoded = codec.encode(tensor, reference)
        total += encoded_size(encoded)
        restored.append(codec.decode(encoded.streams, encoded.params, TensorSpec.of(tensor), reference))
    return total, restored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="stdlib-char-gpt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=360, help="a checkpoint step (the delta's; the one before is its reference)")
    parser.add_argument("--shares", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3])
    args = parser.parse_args()
    with torch_threads(2):
        before, after = states_at(args.workload, args.seed, args.step)
    leaves = flatten(after).tensors
    earlier = [leaf.tensor for leaf in flatten(before).tensors]
    whole = [None] * len(leaves)
    policy = DynaQuant()
    layout = layout_of(leaves, param_group_ids(after, leaves), [])
    small = [
        i for i in layout.indices(TensorRole.WEIGHT)
        if leaves[i].tensor.is_floating_point() and policy.small_min_numel <= leaves[i].tensor.numel() < policy.min_numel
    ]
    values = sum(leaves[i].tensor.numel() for i in small)
    print(f"{args.workload} seed {args.seed}, step {args.step}: {len(small)} small weights, {values:,} values")
    exact, _ = planned(DynaQuant(small_weight_error=None), after, leaves, whole, small)
    print(f"  weights at a full checkpoint: lossless {exact:,} B")
    for share in args.shares:
        stored, restored = planned(DynaQuant(small_weight_error=share), after, leaves, whole, small)
        lost = sum(float((r - leaves[i].tensor).pow(2).sum()) for r, i in zip(restored, small))
        size = sum(float(leaves[i].tensor.pow(2).sum()) for i in small)
        print(f"  small_weight_error={share:g}: {stored:,} B ({stored / exact - 1:+.1%}), lost {lost / size:.2e} of their squared size")
    moments = [
        i for i in layout.indices(TensorRole.SECOND_MOMENT)
        if policy.moment_min_numel <= leaves[i].tensor.numel() < policy.min_numel
    ]
    print(f"  {len(moments)} small second moments, {sum(leaves[i].tensor.numel() for i in moments):,} values")
    lattice_levels = dynaquant_moments.MAX_LATTICE_LEVELS
    for label, limit in (("16 k-means levels in log2", 0), ("log lattice 2**(k/4)", lattice_levels)):
        dynaquant_moments.MAX_LATTICE_LEVELS = limit
        try:
            for kind, references in (("whole", whole), ("delta", earlier)):
                stored, restored = planned(policy, after, leaves, references, moments)
                errors = []
                for r, i in zip(restored, moments):
                    v = leaves[i].tensor
                    kept = v > 0
                    errors.append(torch.log2(r[kept].sqrt() / v[kept].sqrt()).pow(2).mean())
                rms = float(torch.stack(errors).mean().sqrt())
                print(f"  second moments, {label}, {kind}: {stored:,} B, rms log2 error of sqrt(v) {rms:.4f}")
        finally:
            dynaquant_moments.MAX_LATTICE_LEVELS = lattice_levels


if __name__ == "__main__":
    main()
