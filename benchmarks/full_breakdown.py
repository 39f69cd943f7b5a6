"""Where a full checkpoint's bytes go, by tensor role, size class and codec.

Trains one yardstick workload without checkpoints for ``--step`` steps (the model
watched, as the benchmark's runs watch it, so frozen layers are known), saves the state
whole with the default DynaQuant policy into a temporary file, and prints the stored
bytes of its records grouped by the role of each tensor (weight, frozen or trained,
first moment, ...),
whether it has ``min_numel`` values or more, and the codec the policy chose, with bits
per value. The first checkpoint of a yardstick run is such a full checkpoint.

Run: ``python benchmarks/full_breakdown.py --workload minilm-docstrings --step 10``
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import inshrinkerator as ink
from inshrinkerator.bench.recovery import torch_threads
from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.container.reader import ContainerReader
from inshrinkerator.policies import DynaQuant
from inshrinkerator.policies.state_layout import layout_of, param_group_ids
from inshrinkerator.tree import flatten, format_key_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="minilm-docstrings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=10, help="training steps before the save")
    args = parser.parse_args()
    policy = DynaQuant()
    with torch_threads(2):
        workload = make_workload(args.workload, args.seed)
        workload.build()
        policy.watch(workload.model)
        for step in range(args.step):
            workload.train_step(step)
        state = workload.state()
        leaves = flatten(state).tensors
        trained = {("model", name) for name, parameter in workload.model.named_parameters() if parameter.requires_grad}
        frozen = [i for i, leaf in enumerate(leaves) if leaf.path[0] == "model" and tuple(leaf.path) not in trained]
        roles = layout_of(leaves, param_group_ids(state, leaves), frozen).roles
        role_of = {
            format_key_path(leaf.path): role.name.lower() + (" (frozen)" if index in frozen else "")
            for index, (leaf, role) in enumerate(zip(leaves, roles))
        }
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "full.ink"
            info = ink.save(state, path, policy=policy)
            with open(path, "rb") as handle:
                header = ContainerReader(handle, str(path)).header
    groups: dict[tuple[str, str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for index, record in enumerate(header.tensors):
        key = format_key_path(header.tensor_paths[index])
        large = "large" if record.spec.numel >= policy.min_numel else "small"
        group = groups[(role_of.get(key, "other"), large, str(record.codec.get("id")))]
        group[0] += 1
        group[1] += record.stored_bytes
        group[2] += record.spec.numel
    print(f"{args.workload} seed {args.seed}, a full checkpoint after {args.step} steps: {info.stored_bytes:,} B "
          f"for {info.raw_bytes:,} B raw ({info.raw_bytes / info.stored_bytes:.1f}x)")
    print(f"{'role':<22} {'size':<6} {'codec':<28} {'tensors':>7} {'bytes':>12} {'values':>12} {'bits/value':>10}")
    for (role, large, codec), (count, stored, values) in sorted(groups.items(), key=lambda item: -item[1][1]):
        print(f"{role:<22} {large:<6} {codec:<28} {count:>7} {stored:>12,} {values:>12,} {8 * stored / max(values, 1):>10.2f}")


if __name__ == "__main__":
    main()
