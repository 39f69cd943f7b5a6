"""Look at a run without writing to it: is it a run, what does it hold, does it all restore."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from ..errors import CheckpointNotFoundError, InkError
from ..serialize import reference_map
from ..tensor_classes import ClassBytes, container_class_bytes
from .chain import load_step, open_step, read_step_state
from .commit import holds_run, list_steps, read_manifest
from .manifest import MAX_MANIFEST_BYTES, RUN_MARKER, StepManifest, parse_run_marker
from .storage import RunLocation, open_storage

__all__ = ["RunEntry", "describe_run", "run_class_bytes", "verify_run", "is_run"]


@dataclass(frozen=True)
class RunEntry:
    """One committed step of a run, as ``inshrink info`` shows it.

    ``stored_bytes`` is the step's data file plus its manifest; ``ratio`` is
    ``raw_bytes / stored_bytes``; ``created`` is ISO-8601 UTC.
    """

    step: int
    kind: Literal["full", "delta"]
    base_step: Optional[int]
    raw_bytes: int
    stored_bytes: int
    ratio: float
    policy: str
    created: str
    rebased: bool
    data_file: str

    @classmethod
    def of(cls, manifest: StepManifest) -> "RunEntry":
        return cls(
            step=manifest.step,
            kind=manifest.kind,
            base_step=manifest.base_step,
            raw_bytes=manifest.raw_bytes,
            stored_bytes=manifest.stored_bytes,
            ratio=manifest.raw_bytes / max(manifest.stored_bytes, 1),
            policy=manifest.policy,
            created=manifest.created,
            rebased=manifest.rebased,
            data_file=manifest.data_file,
        )


def is_run(url: RunLocation) -> bool:
    """True when ``url`` is a folder holding a run (its marker or a step manifest); never raises
    for a path that is missing, a file, or a URL that cannot be opened."""
    try:
        return holds_run(open_storage(url).list_names())
    except (InkError, OSError, ValueError):
        return False


def _open_run(url: RunLocation) -> tuple[Any, list[str]]:
    storage = open_storage(url)
    names = storage.list_names()
    if not holds_run(names):
        raise CheckpointNotFoundError(f"{storage.location}: no run here (no run marker and no step manifest)")
    return storage, names


def describe_run(url: RunLocation) -> list[RunEntry]:
    """One entry per committed step, ascending.

    Raises:
        CheckpointNotFoundError: ``url`` holds no run.
        CorruptCheckpointError: a manifest is damaged (``inshrink verify`` lists them all).
    """
    storage, names = _open_run(url)
    return [RunEntry.of(read_manifest(storage, step)) for step in list_steps(storage, names)]


def run_class_bytes(url: RunLocation) -> dict[int, ClassBytes]:
    """Each committed step's raw and stored bytes by tensor class (weights, first and second
    moments, other), read from its data file's header: no tensor is decoded.

    Raises:
        CheckpointNotFoundError: ``url`` holds no run.
        CorruptCheckpointError: a manifest or a data file's header is damaged, or a data
            file is missing.
    """
    storage, names = _open_run(url)
    classes = {}
    for step in list_steps(storage, names):
        with open_step(storage, read_manifest(storage, step)) as reader:
            classes[step] = container_class_bytes(reader)
    return classes


def _marker_problems(storage: Any, names: list[str]) -> list[str]:
    """The run marker must be there (a writer creates it before any step) and intact."""
    if RUN_MARKER not in names:
        return [f"run marker: {storage.describe(RUN_MARKER)} is missing; the run was damaged"]
    try:
        blob = storage.read_bytes(RUN_MARKER, MAX_MANIFEST_BYTES)
        parse_run_marker(blob, storage.describe(RUN_MARKER))
    except ConnectionError:
        raise
    except (InkError, OSError) as exc:
        return [f"run marker: {type(exc).__name__}: {exc}"]
    return []


def verify_run(url: RunLocation) -> list[str]:
    """Check the run marker, every manifest, every checksum and that every step restores
    through its chain.

    Returns one human-readable problem per line (``step N: ...`` or ``run marker: ...``);
    an empty list means the run is sound. Each step is decoded once: a delta reuses the
    decoded state of the step before it. Files that no manifest names (what an interrupted
    or failed save leaves, removed by the run's next writer) are not problems.

    Raises:
        ConnectionError: the storage cannot be reached (nothing could be checked).
    """
    try:
        storage, names = _open_run(url)
    except ConnectionError:
        raise  # the storage cannot be reached: nothing was checked, and nothing is known damaged
    except (InkError, OSError) as exc:
        return [str(exc)]
    problems: list[str] = _marker_problems(storage, names)
    previous_step: Optional[int] = None
    previous: Optional[dict[str, torch.Tensor]] = None
    for step in list_steps(storage, names):
        try:
            manifest = read_manifest(storage, step)
            references = None
            if manifest.base_step is not None:
                if manifest.base_step == previous_step and previous is not None:
                    references = previous
                else:
                    references = reference_map(load_step(storage, manifest.base_step))
            state = read_step_state(storage, manifest, references)
            previous_step, previous = step, reference_map(state)
        except ConnectionError:
            raise
        except (InkError, OSError) as exc:
            problems.append(f"step {step}: {type(exc).__name__}: {exc}")
            previous_step, previous = None, None
    return problems
