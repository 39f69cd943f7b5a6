"""The failure-recovery protocol (DESIGN.md §5).

:func:`run_reference` trains a workload without interruption (and, optionally, measures
the lossless reference rows on the states it would checkpoint). :func:`run_with_failures`
trains the same workload and seed with a :class:`~inshrinkerator.store.CheckpointManager`
saving every ``checkpoint_every`` steps; at each of the evenly spaced failures the manager
and the model are thrown away, a *fresh* model, optimizer and scheduler are built, the
latest checkpoint is loaded into them by a new manager, and the steps since it are trained
again (the data of a step is a function of the step, so they see the same batches).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..policies import Policy
from ..store import CheckpointManager
from ..tree import flatten
from .lossless_rows import LosslessRow, LosslessTotals, measure_state
from .measures import ClassBytes, directory_bytes, run_class_bytes
from .workloads import Evaluation, Workload, make_workload

__all__ = [
    "CheckpointRecord",
    "RestoreRecord",
    "ReferenceResult",
    "PolicyRunResult",
    "failure_steps",
    "run_reference",
    "run_with_failures",
    "torch_threads",
]

#: Called with the number of training steps just done (for progress bars).
Advance = Callable[[int], None]


def failure_steps(total_steps: int, failures: int) -> list[int]:
    """``failures`` evenly spaced steps strictly inside ``(0, total_steps)``, ascending, distinct."""
    if failures <= 0:
        return []
    steps = {round(total_steps * k / (failures + 1)) for k in range(1, failures + 1)}
    return sorted(s for s in steps if 0 < s < total_steps)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch threads (one keeps timings stable when other jobs
    share the cores), then restore the previous setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _checkpoint_state(workload: Workload, step: int) -> dict[str, Any]:
    return {"step": step, **workload.state()}


def _state_bytes(state: Any) -> int:
    return sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flatten(state).tensors)


def _torch_load_seconds(state: Any, repeats: int = 2) -> float:
    """Best-of-``repeats`` time of ``torch.load(weights_only=True)`` of ``state`` from a file."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        torch.save(state, path)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            torch.load(path, weights_only=True)
            best = min(best, time.perf_counter() - started)
    return best


@dataclass
class CheckpointRecord:
    step: int
    kind: str
    raw_bytes: int
    stored_bytes: int
    seconds: float


@dataclass
class RestoreRecord:
    failure_step: int
    restored_step: Optional[int]  # None: no checkpoint yet, restarted from step 0
    raw_bytes: int
    seconds: float
    torch_load_seconds: float


@dataclass
class ReferenceResult:
    """The uninterrupted run."""

    workload: str
    seed: int
    evaluation: Evaluation
    train_seconds: float
    total_steps: int
    checkpoint_every: int
    lossless: dict[str, LosslessTotals] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PolicyRunResult:
    """A run with failures, restored from one policy's checkpoints."""

    workload: str
    policy: str
    seed: int
    evaluation: Evaluation
    train_seconds: float
    blocked_seconds: float
    checkpoints: list[CheckpointRecord]
    restores: list[RestoreRecord]
    stored_bytes_on_disk: int
    class_bytes: ClassBytes

    @property
    def raw_bytes(self) -> int:
        return sum(c.raw_bytes for c in self.checkpoints)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_reference(
    name: str,
    seed: int,
    quick: bool,
    lossless_rows: Sequence[LosslessRow] = (),
    advance: Optional[Advance] = None,
    on_finish: Optional[Callable[[Workload], None]] = None,
) -> ReferenceResult:
    """Train ``name`` uninterrupted; measure ``lossless_rows`` on every checkpoint state.

    ``on_finish`` is called with the trained workload after its final evaluation (it may
    change the workload's model: nothing uses it afterwards).
    """
    workload = make_workload(name, seed, quick)
    size = workload.size
    totals = {row.name: LosslessTotals(row.name) for row in lossless_rows}
    train_seconds = 0.0
    for step in range(size.total_steps):
        started = time.perf_counter()
        workload.train_step(step)
        train_seconds += time.perf_counter() - started
        if advance is not None:
            advance(1)
        done = step + 1
        if done % size.checkpoint_every == 0 and lossless_rows:
            state = _checkpoint_state(workload, done)
            for row in lossless_rows:
                measure_state(row, state, totals[row.name])
    evaluation = workload.evaluate()
    if on_finish is not None:
        on_finish(workload)
    return ReferenceResult(
        workload=name,
        seed=seed,
        evaluation=evaluation,
        train_seconds=train_seconds,
        total_steps=size.total_steps,
        checkpoint_every=size.checkpoint_every,
        lossless=totals,
    )


def fresh_policy(policy: Union[str, Policy]) -> Union[str, Policy]:
    """A policy as a new process would build it: the same options, no memory of saves.

    Dataclass policies are rebuilt from their options (their memory fields are not init
    arguments); another object may offer ``fresh()``; anything else is assumed stateless.
    """
    if isinstance(policy, str):
        return policy
    if dataclasses.is_dataclass(policy):
        return dataclasses.replace(policy)
    fresh = getattr(policy, "fresh", None)
    return fresh() if callable(fresh) else policy


def run_with_failures(
    name: str,
    seed: int,
    quick: bool,
    policy: Union[str, Policy],
    run_dir: Path,
    failures: int = 10,
    full_every: int = 10,
    advance: Optional[Advance] = None,
    on_new_policy: Optional[Callable[[Union[str, Policy]], None]] = None,
) -> PolicyRunResult:
    """Train ``name`` checkpointing with ``policy`` into ``run_dir`` (must be empty or absent),
    crash ``failures`` times and resume each time from the latest checkpoint.

    Each simulated process gets its own copy of ``policy`` as it was before the run (a crash
    loses the policy's memory too); ``on_new_policy`` sees every copy, e.g. to sum search
    logs."""
    workload = make_workload(name, seed, quick)
    size = workload.size
    pending = failure_steps(size.total_steps, failures)
    # A crash loses everything in memory, the policy's too (a stateful policy such as
    # DynaQuant remembers its last configuration): every new "process" starts from a copy
    # of the policy as it was before the run.
    def open_manager() -> CheckpointManager:
        fresh = fresh_policy(policy)
        if on_new_policy is not None:
            on_new_policy(fresh)
        manager = CheckpointManager(str(run_dir), policy=fresh, full_every=full_every)
        manager.watch(workload.model)
        return manager

    manager = open_manager()
    policy_name = manager.policy.name
    checkpoints: list[CheckpointRecord] = []
    restores: list[RestoreRecord] = []
    train_seconds = blocked_seconds = 0.0
    step = 0
    try:
        while step < size.total_steps:
            started = time.perf_counter()
            workload.train_step(step)
            train_seconds += time.perf_counter() - started
            if advance is not None:
                advance(1)
            step += 1
            if step % size.checkpoint_every == 0:
                started = time.perf_counter()
                info = manager.save(step, _checkpoint_state(workload, step))
                seconds = time.perf_counter() - started
                blocked_seconds += seconds
                checkpoints.append(CheckpointRecord(step, info.kind, info.raw_bytes, info.stored_bytes, seconds))
            if pending and step == pending[0]:
                pending.pop(0)
                manager.close()  # the process dies; everything in memory is lost
                workload.build()
                manager = open_manager()
                latest = manager.latest_step()
                if latest is None:
                    restores.append(RestoreRecord(step, None, 0, 0.0, 0.0))
                    step = 0
                    continue
                started = time.perf_counter()
                state = manager.load(latest)
                seconds = time.perf_counter() - started
                workload.restore(state)
                restores.append(
                    RestoreRecord(step, latest, _state_bytes(state), seconds, _torch_load_seconds(state))
                )
                step = latest
    finally:
        manager.close()
    on_disk, files = directory_bytes(Path(run_dir))
    return PolicyRunResult(
        workload=name,
        policy=policy_name,
        seed=seed,
        evaluation=workload.evaluate(),
        train_seconds=train_seconds,
        blocked_seconds=blocked_seconds,
        checkpoints=checkpoints,
        restores=restores,
        stored_bytes_on_disk=on_disk,
        class_bytes=run_class_bytes(files),
    )
