"""``keep_last`` retention that never orphans a delta.

Plan: keep the ``keep_last`` newest steps. A kept step whose base is not kept is
re-based first (rewritten as a full checkpoint that decodes to the same tensors, see
:mod:`.rebase`); only then are the other steps deleted, newest first (see
:func:`.commit.delete_steps`). At every moment each listed step restores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..errors import InkError
from ..policies import Policy
from .commit import delete_steps, list_steps, read_manifest
from .rebase import rebase_step
from .storage import RunStorage

__all__ = ["RetentionPlan", "plan_retention", "apply_retention"]


@dataclass(frozen=True)
class RetentionPlan:
    """What retention does: re-base these kept steps (ascending), then delete these steps."""

    rebase: tuple[int, ...]
    delete: tuple[int, ...]


def plan_retention(
    steps: Sequence[int],
    base_of: Mapping[int, Optional[int]],
    keep_last: Optional[int],
) -> RetentionPlan:
    """Decide which steps to re-base and which to delete.

    Args:
        steps: the committed steps, ascending.
        base_of: ``step -> base step`` (``None`` for a full step), at least for the kept steps.
        keep_last: how many of the newest steps to keep; ``None`` keeps everything.
    """
    if keep_last is None or len(steps) <= keep_last:
        return RetentionPlan((), ())
    kept = list(steps[-keep_last:])
    kept_set = set(kept)
    rebase = tuple(s for s in kept if base_of[s] is not None and base_of[s] not in kept_set)
    return RetentionPlan(rebase, tuple(steps[: len(steps) - keep_last]))


def apply_retention(storage: RunStorage, keep_last: Optional[int], policy: Policy) -> RetentionPlan:
    """Carry out :func:`plan_retention` on the run; returns the plan it carried out."""
    if keep_last is None:
        return RetentionPlan((), ())
    steps = list_steps(storage)
    if len(steps) <= keep_last:
        return RetentionPlan((), ())
    kept = {step: read_manifest(storage, step) for step in steps[-keep_last:]}
    plan = plan_retention(steps, {step: m.base_step for step, m in kept.items()}, keep_last)
    for step in plan.rebase:
        kept[step] = rebase_step(storage, kept[step], policy)
    doomed: list[tuple[int, Optional[str]]] = []
    for step in plan.delete:
        try:
            doomed.append((step, read_manifest(storage, step).data_file))
        except InkError:
            # A damaged manifest of a step being dropped anyway: drop the manifest; its
            # data file becomes an orphan that the next writer's cleanup removes.
            doomed.append((step, None))
    delete_steps(storage, doomed)
    return plan
