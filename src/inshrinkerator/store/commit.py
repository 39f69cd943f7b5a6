"""The commit protocol of a run: data first, manifest last; delete in the reverse order.

Saving a step:
  1. write the data file under a fresh name (atomically, see :mod:`.storage`);
  2. write the step's manifest (atomically): **this is the commit** — before it the step
     does not exist for any reader, after it the step is complete.

Deleting a step: remove its manifest first (the step is gone), then its data file.
Whatever a crash or a failed save leaves behind (temporaries, data files no manifest
names) is invisible to readers and to ``verify_run``, and is removed by :func:`remove_stale`
when a writer starts and on the save after a failed one.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from typing import IO, Optional, TypeVar

from ..errors import CheckpointNotFoundError, InkError
from .manifest import (
    MAX_MANIFEST_BYTES,
    RUN_MARKER,
    StepManifest,
    data_name,
    encode_manifest,
    manifest_name,
    parse_manifest,
    run_marker_bytes,
    step_of_data_name,
    step_of_manifest_name,
)
from .storage import RunStorage, is_temporary

__all__ = [
    "list_steps",
    "read_manifest",
    "write_data",
    "publish_manifest",
    "delete_steps",
    "remove_stale",
    "ensure_run_marker",
    "holds_run",
]

T = TypeVar("T")


def list_steps(storage: RunStorage, names: Iterable[str] | None = None) -> list[int]:
    """The committed steps, ascending (those whose manifest exists)."""
    listed = storage.list_names() if names is None else names
    return sorted(step for step in map(step_of_manifest_name, listed) if step is not None)


def holds_run(names: Iterable[str]) -> bool:
    """True when a folder listing is that of a run (its marker or any step manifest)."""
    return any(name == RUN_MARKER or step_of_manifest_name(name) is not None for name in names)


def read_manifest(storage: RunStorage, step: int) -> StepManifest:
    """The manifest of ``step``.

    Raises:
        CheckpointNotFoundError: the step was never committed (or was deleted).
        CorruptCheckpointError / FormatError: the manifest is damaged or not one.
    """
    name = manifest_name(step)
    try:
        blob = storage.read_bytes(name, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{storage.location}: the run has no step {step}") from None
    return parse_manifest(blob, storage.describe(name), step)


def write_data(storage: RunStorage, step: int, produce: Callable[[IO[bytes]], T]) -> tuple[str, T]:
    """Write a new data file for ``step``; return its name and what ``produce`` returned.

    The name is new for every write, so rewriting a step never touches the file its
    current manifest names (a reader may be reading it).
    """
    name = data_name(step, secrets.token_hex(4))
    return name, storage.write_file(name, produce)


def publish_manifest(storage: RunStorage, manifest: StepManifest) -> StepManifest:
    """Commit a step: write its manifest (with ``stored_bytes`` filled in) and return it."""
    final, blob = encode_manifest(manifest)
    storage.write_bytes(manifest_name(manifest.step), blob)
    return final


def delete_steps(storage: RunStorage, steps: Iterable[tuple[int, Optional[str]]]) -> None:
    """Delete ``(step, data file or None)`` pairs, newest first, each manifest before its data.

    Newest first keeps an invariant through any crash: every step still listed has
    every step its chain needs still listed.
    """
    for step, data_file in sorted(steps, reverse=True, key=lambda pair: pair[0]):
        storage.remove(manifest_name(step))
        if data_file is not None:
            storage.remove(data_file)


def ensure_run_marker(storage: RunStorage, names: Iterable[str]) -> None:
    """Create the folder and its run marker if this is the run's first write."""
    if RUN_MARKER not in set(names):
        storage.prepare()
        storage.write_bytes(RUN_MARKER, run_marker_bytes())


def remove_stale(storage: RunStorage, names: list[str]) -> list[str]:
    """Remove what interrupted writes left: temporaries and data files no manifest names.

    Call only from the run's single writer before it writes (a concurrent writer's
    unfinished files look stale too). If any manifest cannot be read, data files are
    left alone: deleting data on the word of a damaged index could lose a step.
    Returns the names removed.
    """
    removed = [name for name in names if is_temporary(name)]
    data_files = [name for name in names if step_of_data_name(name) is not None]
    if data_files:
        try:
            referenced = {read_manifest(storage, step).data_file for step in list_steps(storage, names)}
        except InkError:
            referenced = None
        if referenced is not None:
            removed += [name for name in data_files if name not in referenced]
    done = []
    for name in removed:
        try:
            storage.remove(name)
        except IsADirectoryError:
            continue  # not a leftover of ours (writers never make directories): left alone
        done.append(name)
    return done
