"""Where a synchronous save's time goes: the default policy's planning stages, save by save.

One workload's training run (seed 0, one torch thread, as ``benchmarks/save_speed.py``
trains it, without failures) saves every ``checkpoint_every`` steps through
``CheckpointManager`` with the default policy and a watched model. The policy's stages
are wrapped in wall-clock timers: the weights' plan and what it calls (the own-budget
trials, the search, the changes' codecs), the small weights, the moments (the first
moments' low-rank products among them), the weights stored as their change or on evenly
spaced levels. What ``plan_grouped`` spends beyond its stages is mostly the encoding of
every tensor, run in the codec threads. Printed: each save's kind, its time and its stages
over 5 ms, then each stage's mean per full save and per delta. A stage called inside
another counts in both.

``--check-floors`` also runs every own-budget trial that an error floor decided without
running it (``WeightTrial.error_floor``), and counts the tensors so decided, the decisions
that differ from the trials' and the floors above their trial's error (both should be 0).

Run: ``python benchmarks/save_stages.py [--workload minilm-docstrings] [--check-floors]``
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inshrinkerator.bench.workloads import WORKLOADS, make_workload
from inshrinkerator.policies.carried_error import CarriedErrors
from inshrinkerator.policies.dynaquant import DynaQuant
from inshrinkerator.policies.dynaquant_search import ConfigurationCube
from inshrinkerator.store import CheckpointManager

#: (class, method) pairs timed, by the name printed.
STAGES: dict[str, tuple[type, str]] = {
    "plan (all)": (DynaQuant, "plan_grouped"),
    "weights": (DynaQuant, "_plan_weights"),
    "  own-budget trials": (ConfigurationCube, "within_own_budgets"),
    "  search": (ConfigurationCube, "search"),
    "  changes' codecs": (DynaQuant, "_change_codecs"),
    "small weights": (DynaQuant, "_plan_small_weights"),
    "moments": (DynaQuant, "_plan_moments"),
    "  first-moment products": (DynaQuant, "_factor_first_moments"),
    "weights as their change": (DynaQuant, "_store_changes_where_smaller"),
    "evenly spaced weights": (DynaQuant, "_store_whole_on_even_levels_where_smaller"),
    "carried errors": (CarriedErrors, "shifted_leaves"),
}


def _timed(method: Callable[..., Any], name: str, seconds: dict[str, float]) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - started

    return timed


def _checking_floors(method: Callable[..., Any], counts: dict[str, int]) -> Callable[..., Any]:
    """``within_own_budgets`` that also runs every trial and compares it with the floors."""

    @functools.wraps(method)
    def checked(cube: ConfigurationCube, indices: Any, point: Any, metric: str) -> list[bool]:
        answers = method(cube, indices, point, metric)
        protect = cube.axes[3][point[3]]
        for index, result, answer in zip(indices, cube.results(list(indices), point, metric), answers):
            floor = cube.trials[index].error_floor(protect)
            if cube.evaluate is None:
                decided = floor / cube.scales.get(index, 1.0) > cube.budget
                by_trial = not result.error / cube.scales.get(index, 1.0) > cube.budget
            else:
                decided = index in cube.caps and floor > cube.caps[index]
                by_trial = index not in cube.caps or result.error <= cube.caps[index]
            counts["trials"] += 1
            counts["decided by the floor"] += int(decided)
            counts["answers that differ"] += int(answer != by_trial)
            counts["floors above the error"] += int(floor > result.error)
        return answers

    return checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="minilm-docstrings")
    parser.add_argument("--check-floors", action="store_true", help="run every own-budget trial beside its floor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds: dict[str, float] = defaultdict(float)
    for name, (owner, method) in STAGES.items():
        setattr(owner, method, _timed(getattr(owner, method), name, seconds))
    counts: dict[str, int] = defaultdict(int)
    if args.check_floors:
        ConfigurationCube.within_own_budgets = _checking_floors(ConfigurationCube.within_own_budgets, counts)  # type: ignore[method-assign]

    workload = make_workload(args.workload, 0)
    workload.build()
    size = workload.size
    totals: dict[tuple[str, str], float] = defaultdict(float)
    saves: dict[str, int] = defaultdict(int)
    with tempfile.TemporaryDirectory() as folder:
        manager = CheckpointManager(Path(folder) / "run")
        manager.watch(workload.model)
        for step in range(size.total_steps):
            workload.train_step(step)
            if (step + 1) % size.checkpoint_every:
                continue
            state = {"step": step + 1, **workload.state()}
            seconds.clear()
            started = time.perf_counter()
            info = manager.save(step + 1, state)
            took = time.perf_counter() - started
            saves[info.kind] += 1
            totals[info.kind, "save"] += took
            for name, spent in seconds.items():
                totals[info.kind, name] += spent
            stages = ", ".join(f"{name.strip()} {spent:.3f}" for name, spent in seconds.items() if spent > 0.005)
            print(f"step {step + 1} {info.kind}: {took:.3f} s ({stages})")
        manager.close()
    print(f"\n{args.workload}, mean seconds per save:")
    print(f"{'stage':<28}" + "".join(f"{kind:>10}" for kind in saves))
    for name in ["save", *STAGES]:
        print(f"{name:<28}" + "".join(f"{totals[kind, name] / saves[kind]:>10.3f}" for kind in saves))
    if args.check_floors:
        print("\nown-budget trials: " + ", ".join(f"{name} {count}" for name, count in counts.items()))


if __name__ == "__main__":
    main()
