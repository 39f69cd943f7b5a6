"""Probe DynaQuant on the yardstick's failure-recovery protocol, next to chosen baselines.

Runs the uninterrupted reference once per workload and seed, then one failure-recovery
run per policy spec (``name`` or ``name:key=value,...``, as ``inshrink bench`` takes
them), and prints degradation, full-state and weights-only ratios, compression MB/s and
the restore time against ``torch.load``; for DynaQuant also the search cost and how
close the entropy stage came to the order-0 entropy of its symbols.

    python benchmarks/dynaquant_probe.py --workload digits-cnn --policy dynaquant --policy excp

Probe-only spec options (prefixed ``@``; any base policy) measure the noise floor and
ablate DynaQuant: ``@weights=``, ``@first=``, ``@second=`` replace what the base policy
plans for that tensor class (``@weights_full=``: the weights of checkpoints stored with
no reference only) with ``exact`` (lossless), ``bf16``, ``fp16`` or ``trunc<n>``
(float32 with its lowest ``n`` mantissa bits rounded away), so
``lossless:@weights=bf16`` perturbs only the weights, by bf16 rounding, and
``dynaquant:@first=exact,@second=exact`` shows what the weights alone cost. A
grid option takes ``|``-separated values (``bins=64|48|32``), as every policy spec does;
``@evaluate=train`` gives DynaQuant an ``evaluate`` (the training loss on four fixed training
batches the run never draws) in failure runs.
``@second_protect=``, ``@prune_penalty=`` and ``@proxy_scale=`` set those module
constants for one run (the policy options ``residual_bins=16|12|8`` and
``movement_share=0.5`` replace the former ``@residual_bins=`` and ``@movement_share=``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from inshrinkerator.bench.aggregate import run_metrics
from inshrinkerator.bench.policy_specs import build_policy
from inshrinkerator.bench.recovery import run_reference, run_with_failures
from inshrinkerator.bench.workloads import WORKLOADS, training_loss_evaluator
from inshrinkerator.codecs import Codec
from inshrinkerator.codecs.base import Encoded, TensorSpec
from inshrinkerator.codecs.bucket_delta import EntropyStats
from inshrinkerator.codecs.raw import tensor_bytes, tensor_from_bytes
from inshrinkerator.codecs.registry import register_codec
from inshrinkerator.policies import (
    DynaQuant,
    Lossless,
    Policy,
    dynaquant_moments,
    dynaquant_weights,
    quantization_trials,
)
from inshrinkerator.policies.state_layout import TensorRole, layout_of
from inshrinkerator.tree import TensorLeaf

_CLASS_ROLES = {
    "weights": (TensorRole.WEIGHT,),
    "first": (TensorRole.FIRST_MOMENT, TensorRole.MOMENTUM_BUFFER),
    "second": (TensorRole.SECOND_MOMENT, TensorRole.ACCUMULATOR),
    "weights_full": (TensorRole.WEIGHT,),  # weights, at checkpoints with no reference only
}


def _rounded(tensor: torch.Tensor, mode: str) -> torch.Tensor:
    if mode in ("bf16", "fp16"):
        return tensor.to(torch.bfloat16 if mode == "bf16" else torch.float16).to(tensor.dtype)
    if mode.startswith("trunc") and tensor.dtype == torch.float32:
        bits = int(mode[5:])
        as_int = tensor.contiguous().view(torch.int32)
        half = 1 << (bits - 1)
        rounded = (as_int + half) & ~((1 << bits) - 1)  # round half up on the magnitude
        return rounded.view(torch.float32)
    raise ValueError(f"unknown perturbation {mode!r}")


@register_codec
class ProbeRoundCodec(Codec):
    """Probe only: the tensor rounded (bf16, fp16, truncated mantissa), stored raw."""

    codec_id = "probe_round"
    lossless = False

    def __init__(self, mode: str = "bf16") -> None:
        self.mode = mode

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        rounded = _rounded(tensor.detach(), self.mode)
        return Encoded(streams=[tensor_bytes(rounded)], reconstruction=rounded)

    def decode(self, streams: Sequence[Any], params: dict, spec: TensorSpec, reference=None) -> torch.Tensor:
        return tensor_from_bytes(streams[0], spec)


class ProbePolicy(Policy):
    """Probe only: a base policy whose plan is overridden per tensor class."""

    def __init__(self, inner: Policy, overrides: dict[str, str]) -> None:
        self.inner = inner
        self.overrides = overrides
        self.name = inner.name

    def fresh(self) -> "ProbePolicy":
        """The same overrides around a policy with no memory of saves (a new process)."""
        return ProbePolicy(dataclasses.replace(self.inner), self.overrides)

    def watch(self, model: torch.nn.Module) -> None:
        hook = getattr(self.inner, "watch", None)
        if hook is not None:
            hook(model)

    def plan(self, leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]]) -> list[Codec]:
        return self._override(leaves, references, self.inner.plan(leaves, references))

    def plan_state(self, state: Any, leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]]) -> list[Codec]:
        """The inner policy's plan from the state (param groups and their options, as the
        writers give it), then the overrides."""
        return self._override(leaves, references, self.inner.plan_state(state, leaves, references))

    def _override(
        self, leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]], codecs: list[Codec]
    ) -> list[Codec]:
        exact = Lossless().plan(leaves, references)
        roles = layout_of(leaves).roles
        full = all(reference is None for reference in references)
        for cls, mode in self.overrides.items():
            if cls == "weights_full" and not full:
                continue
            for i, (leaf, role) in enumerate(zip(leaves, roles)):
                if role not in _CLASS_ROLES[cls] or not leaf.tensor.dtype.is_floating_point:
                    continue
                codecs[i] = exact[i] if mode == "exact" else ProbeRoundCodec(mode)
        return codecs


_CONSTANTS = {
    "second_protect": (dynaquant_moments, "SECOND_MOMENT_PROTECT"),
    "prune_penalty": (quantization_trials, "PRUNE_PENALTY"),
    "proxy_scale": (dynaquant_weights, "PROXY_SCALE"),
}
_DEFAULT_CONSTANTS = {name: getattr(module, attr) for name, (module, attr) in _CONSTANTS.items()}


def build_probe_policy(spec: str, workload: Optional[str] = None, seed: int = 0, quick: bool = False) -> Policy:
    """A policy for ``spec``, with the probe-only ``@`` options applied.

    ``@evaluate=train`` gives DynaQuant an ``evaluate``: the training loss on four fixed
    training batches the run never draws (``training_loss_evaluator``), of ``workload``
    built with ``seed``.
    """
    for name, (module, attr) in _CONSTANTS.items():
        setattr(module, attr, _DEFAULT_CONSTANTS[name])
    name, _, options = spec.partition(":")
    plain, overrides = [], {}
    evaluate = None
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key.startswith("@"):
            key = key[1:]
            if key == "evaluate":
                if value != "train" or workload is None:
                    raise ValueError("@evaluate takes 'train', in failure runs only")
                evaluate = training_loss_evaluator(lambda: WORKLOADS[workload](seed=seed, quick=quick))
            elif key in _CONSTANTS:
                module, attr = _CONSTANTS[key]
                setattr(module, attr, type(_DEFAULT_CONSTANTS[key])(float(value)))
            elif key in _CLASS_ROLES:
                overrides[key] = value
            else:
                raise ValueError(f"unknown probe option @{key}")
        else:
            plain.append(item)
    policy = build_policy(name + (":" + ",".join(plain) if plain else ""))
    if evaluate is not None:
        policy = dataclasses.replace(policy, evaluate=evaluate)
    return ProbePolicy(policy, overrides) if overrides else policy


def _dynaquant_extras(used: list) -> dict:
    """Search cost and entropy-stage figures summed over the policies of a run's processes."""
    used = [getattr(policy, "inner", policy) for policy in used]
    used = [policy for policy in used if isinstance(policy, DynaQuant)]
    if not used:
        return {}
    log = [record for policy in used for record in policy.search_log]
    stats = EntropyStats()
    for policy in used:
        part = policy.entropy_stats
        stats.symbols += part.symbols
        stats.payload_bytes += part.payload_bytes
        stats.table_bytes += part.table_bytes
        stats.entropy_bits += part.entropy_bits
        stats.parts += part.parts
    return {
        "search_evaluations": sum(r.evaluations for r in log),
        "search_seconds": sum(r.seconds for r in log),
        "searches": [r.kind for r in log],
        "configs": [r.config for r in log],
        "qualities": [r.quality for r in log],
        "entropy_symbols": stats.symbols,
        "entropy_payload_over_order0": stats.payload_overhead,
        "entropy_table_bytes": stats.table_bytes,
        "entropy_payload_bytes": stats.payload_bytes,
    }


def paired_restores(workload_name: str, seed: int, quick: bool, specs: list[str], steps_after: int,
                    last: int, full_every: int) -> list[dict]:
    """Chaos-free quality of each policy's restores, checkpoint by checkpoint.

    One uninterrupted run saves every checkpoint through one manager per policy (the
    chains, searches and deltas are those of a real run). At each of the ``last``
    checkpoints a second model is restored from the exact state and from each policy's
    checkpoint, trained ``steps_after`` steps on the same batches, and evaluated:
    ``deg_pct`` is the relative metric change (positive = worse). With
    ``steps_after = 0`` it is the restored weights' immediate cost, free of the
    divergence that any perturbation causes over many steps.
    """
    import copy

    from inshrinkerator.bench.measures import degradation_percent
    from inshrinkerator.bench.workloads import make_workload
    from inshrinkerator.store import CheckpointManager
    from inshrinkerator.tree import flatten

    workload = make_workload(workload_name, seed, quick)
    probe = make_workload(workload_name, seed, quick)
    size = workload.size
    checkpoints = list(range(size.checkpoint_every, size.total_steps + 1, size.checkpoint_every))
    judged = set(checkpoints[-last:])
    folder = tempfile.TemporaryDirectory()
    policies = {spec: build_probe_policy(spec) for spec in specs}
    managers = {}
    for index, (spec, policy) in enumerate(policies.items()):
        managers[spec] = CheckpointManager(str(Path(folder.name) / str(index)), policy=policy, full_every=full_every)
        managers[spec].watch(workload.model)

    def quality(state: dict) -> Any:
        probe.restore(copy.deepcopy(state))
        for offset in range(steps_after):
            probe.train_step(start + offset)
        return probe.evaluate()

    rows = {spec: [] for spec in specs}
    step = raw_bytes = 0
    while step < size.total_steps:
        workload.train_step(step)
        step += 1
        if step % size.checkpoint_every:
            continue
        state = {"step": step, **workload.state()}
        raw_bytes += sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flatten(state).tensors)
        for spec, manager in managers.items():
            manager.save(step, state)
        if step not in judged:
            continue
        start = step
        exact = quality(copy.deepcopy(workload.state()))
        for spec, manager in managers.items():
            restored = manager.load(step)
            restored.pop("step", None)
            got = quality(restored)
            rows[spec].append(degradation_percent(exact.value, got.value, exact.higher_is_better))
    from inshrinkerator.bench.measures import directory_bytes, run_class_bytes

    stored = {}
    for index, (spec, manager) in enumerate(managers.items()):
        manager.close()
        on_disk, files = directory_bytes(Path(folder.name) / str(index))
        stored[spec] = (on_disk, run_class_bytes(files).stored)
    folder.cleanup()
    return [{"workload": workload_name, "seed": seed, "policy": spec, "steps_after": steps_after,
             "deg_pct_by_checkpoint": values, "deg_pct_mean": sum(values) / len(values),
             "deg_pct_max": max(values), "raw_bytes": raw_bytes, "stored_bytes": stored[spec][0],
             "cr_full": raw_bytes / stored[spec][0], "class_bytes": stored[spec][1],
             **_dynaquant_extras([policies[spec]])}
            for spec, values in rows.items()]


def step_errors(workload_name: str, seed: int, quick: bool, specs: list[str], steps: int) -> list[dict]:
    """How far each policy's stored moments move Adam's step ``m / (sqrt(v) + eps)``.

    Trains ``steps`` steps, saves and loads the state with each policy, and compares the
    step of every Adam entry of at least 1024 values before and after.
    """
    import inshrinkerator as ink

    workload = make_workload_for_probe(workload_name, seed, quick)
    for step in range(steps):
        workload.train_step(step)
    state = workload.state()
    groups = state["optimizer"]["param_groups"]
    eps = groups[0].get("eps", 1e-8) if groups else 1e-8
    rows = []
    for spec in specs:
        with tempfile.TemporaryDirectory() as folder:
            ink.save(state, Path(folder) / "state.ink", policy=build_probe_policy(spec))
            restored = ink.load(Path(folder) / "state.ink")["optimizer"]["state"]
        relative, largest_error, largest_step, blown = [], 0.0, 0.0, 0.0
        for key, entry in state["optimizer"]["state"].items():
            if "exp_avg_sq" not in entry or entry["exp_avg"].numel() < 1024:
                continue
            true = entry["exp_avg"] / (entry["exp_avg_sq"].sqrt() + eps)
            got = restored[key]["exp_avg"] / (restored[key]["exp_avg_sq"].sqrt() + eps)
            error = got - true
            relative.append(float(error.norm() / true.norm()))
            largest_error = max(largest_error, float(error.abs().max()))
            largest_step = max(largest_step, float(true.abs().max()))
            blown = max(blown, float((got.abs() > 3 * true.abs().max()).float().mean()))
        rows.append({"workload": workload_name, "seed": seed, "policy": spec, "steps": steps,
                     "relative_step_error_mean": sum(relative) / max(len(relative), 1),
                     "relative_step_error_max": max(relative, default=0.0),
                     "largest_step_error": largest_error, "largest_true_step": largest_step,
                     "fraction_over_3x_largest": blown})
    return rows


def make_workload_for_probe(name: str, seed: int, quick: bool):
    from inshrinkerator.bench.workloads import make_workload

    return make_workload(name, seed, quick)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", default=None)
    parser.add_argument("--policy", action="append", default=None)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--failures", type=int, default=10)
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paired", type=int, default=None, metavar="STEPS",
                        help="paired restores instead of failure runs: train STEPS steps after each restore")
    parser.add_argument("--step-error", type=int, default=None, metavar="STEPS",
                        help="train STEPS steps, then compare Adam's step before and after each policy's save/load")
    parser.add_argument("--last", type=int, default=3, help="paired restores at the last N checkpoints")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep each failure run's checkpoints under DIR/<workload>-s<seed>-<n>")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    workloads = args.workload or ["digits-cnn"]
    specs = args.policy or ["dynaquant"]
    results = []
    if args.step_error is not None:
        for workload in workloads:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                for row in step_errors(workload, seed, args.quick, specs, args.step_error):
                    results.append(row)
                    print(f"{workload:>18} s{seed} {row['policy']:<40} step error: relative mean "
                          f"{row['relative_step_error_mean']:.3f} max {row['relative_step_error_max']:.3f}, largest "
                          f"{row['largest_step_error']:.2f} (true steps up to {row['largest_true_step']:.2f}), "
                          f"steps > 3x the largest: {row['fraction_over_3x_largest']:.2e}", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=1, default=str))
        return 0
    if args.paired is not None:
        for workload in workloads:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                for row in paired_restores(workload, seed, args.quick, specs, args.paired, args.last, args.full_every):
                    results.append(row)
                    values = " ".join(f"{v:+.2f}" for v in row["deg_pct_by_checkpoint"])
                    print(f"{workload:>18} s{seed} {row['policy']:<40} paired +{args.paired} steps: "
                          f"deg % {values} (mean {row['deg_pct_mean']:+.3f})  CR full {row['cr_full']:.1f}  "
                          f"stored {row['class_bytes']}", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=1, default=str))
        return 0
    for workload in workloads:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            started = time.perf_counter()
            reference = run_reference(workload, seed, args.quick).to_dict()
            print(f"# {workload} seed {seed}: reference {reference['evaluation']['metric']} = "
                  f"{reference['evaluation']['value']:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
            for spec in specs:
                policy = build_probe_policy(spec, workload, seed, args.quick)
                started = time.perf_counter()
                used: list = []
                with tempfile.TemporaryDirectory() as folder:
                    run_dir = Path(folder) / "run"
                    if args.keep is not None:
                        run_dir = args.keep / f"{workload}-s{seed}-{specs.index(spec)}"
                    run = run_with_failures(
                        workload, seed, args.quick, policy, run_dir,
                        failures=args.failures, full_every=args.full_every, on_new_policy=used.append,
                    ).to_dict()
                metrics = run_metrics(run, reference)
                row = {"workload": workload, "seed": seed, "policy": spec, **metrics,
                       "metric": run["evaluation"]["value"], "class_bytes": run["class_bytes"],
                       "seconds": time.perf_counter() - started, **_dynaquant_extras(used)}
                results.append(row)
                print(
                    f"{workload:>18} s{seed} {spec:<40} deg {metrics['deg_pct']:+6.2f}%  "
                    f"CR full {metrics['cr_full']:6.1f}  CR w {metrics['cr_weights']:6.1f}  "
                    f"{metrics['compress_mbps']:6.1f} MB/s  restore x{metrics['restore_ratio']:.1f} torch.load  "
                    f"({row['seconds']:.0f} s)",
                    flush=True,
                )
                if "search_evaluations" in row:
                    print(
                        f"{'':>22} search: {row['search_evaluations']} evaluations, {row['search_seconds']:.1f} s; "
                        f"entropy stage {100 * row['entropy_payload_over_order0']:+.2f}% vs order-0 "
                        f"({row['entropy_symbols']} symbols, tables {row['entropy_table_bytes']} B)",
                        flush=True,
                    )
                stored = run["class_bytes"]["stored"]
                print(f"{'':>22} stored bytes by class: {stored}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
