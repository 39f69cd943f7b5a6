"""Restore a step: follow its chain of base steps down to a full checkpoint, decode upwards.

Only the files of the step's own chain are read: its manifest, its bases' manifests
(found by name, no listing) and their data files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..container import ContainerReader, Header
from ..errors import BrokenChainError, CheckpointNotFoundError, CorruptCheckpointError
from ..serialize import read_state, read_tensors, referenced_keys
from .commit import read_manifest
from .manifest import StepManifest
from .storage import RunStorage

__all__ = ["resolve_chain", "open_step", "read_step_state", "load_chain", "load_step"]


def resolve_chain(storage: RunStorage, step: int) -> list[StepManifest]:
    """The manifests needed to restore ``step``: its full checkpoint first, ``step`` last.

    Raises:
        CheckpointNotFoundError: ``step`` is not committed.
        BrokenChainError: a base step it needs is missing.
        CorruptCheckpointError: a manifest is damaged or the chain is inconsistent.
    """
    chain = [read_manifest(storage, step)]
    while chain[-1].kind == "delta":
        current = chain[-1]
        base_step = current.base_step if current.base_step is not None else -1
        try:
            base = read_manifest(storage, base_step)
        except CheckpointNotFoundError:
            raise BrokenChainError(
                f"{storage.location}: step {current.step} is a delta against step "
                f"{current.base_step}, which is missing, so step {step} cannot be restored; "
                "steps saved before it may still load"
            ) from None
        chain.append(base)
    chain.reverse()
    return chain


def open_step(
    storage: RunStorage,
    manifest: StepManifest,
    needed_by: Optional[int] = None,
    parsed: Optional[dict[tuple[int, bytes], Header]] = None,
) -> ContainerReader:
    """Open one step's data file, checked against its manifest.

    ``needed_by`` is the step being restored when this one is only its base, for messages;
    ``parsed``: headers parsed before (see :class:`ContainerReader`).
    """
    where = storage.describe(manifest.data_file)
    try:
        handle = storage.open_read(manifest.data_file)
    except FileNotFoundError:
        message = f"{where}: the data file of step {manifest.step} is missing"
        if needed_by is not None and needed_by != manifest.step:
            raise BrokenChainError(f"{message}, and step {needed_by} is stored against it") from None
        raise CorruptCheckpointError(f"{message}; the run was damaged") from None
    reader = ContainerReader(handle, where, parsed)
    size = reader.data_start + reader.header.data_bytes
    if size != manifest.data_bytes or reader.meta.get("step", manifest.step) != manifest.step:
        reader.close()
        raise CorruptCheckpointError(
            f"{where}: file does not match the manifest of step {manifest.step} "
            f"({size} bytes, manifest says {manifest.data_bytes})"
        )
    return reader


def read_step_state(
    storage: RunStorage,
    manifest: StepManifest,
    references: Optional[Mapping[str, torch.Tensor]],
    needed_by: Optional[int] = None,
) -> Any:
    """Decode one step's data file against the reconstruction of its base (if a delta)."""
    with open_step(storage, manifest, needed_by) as reader:
        return read_state(reader, references, reference_hint=_base_hint(manifest))


def load_chain(storage: RunStorage, chain: list[StepManifest]) -> Any:
    """Decode a chain from :func:`resolve_chain`; the state of its last step.

    A base step decodes only the tensors that the step above it is stored against (an
    optimizer moment coded afresh at every step is decoded once, at the end), found from
    the headers first, top down; its other sections are checksummed, not decoded, so
    damage anywhere in a base still fails the restore.
    """
    target = chain[-1].step
    wanted: list[Optional[set[str]]] = [None] * len(chain)
    # Each file is opened twice (its header here, its data below) rather than kept open:
    # a remote handle holds a read buffer, and chains can be long. Its header is read
    # twice but parsed once.
    parsed: dict[tuple[int, bytes], Header] = {}
    for index in range(len(chain) - 1, 0, -1):
        with open_step(storage, chain[index], needed_by=target, parsed=parsed) as reader:
            wanted[index - 1] = referenced_keys(reader, wanted[index])
    references: Optional[dict[str, torch.Tensor]] = None
    for manifest, keys in zip(chain[:-1], wanted):
        with open_step(storage, manifest, needed_by=target, parsed=parsed) as reader:
            references = read_tensors(reader, keys, references, reference_hint=_base_hint(manifest))
    with open_step(storage, chain[-1], needed_by=target, parsed=parsed) as reader:
        return read_state(reader, references, reference_hint=_base_hint(chain[-1]))


def _base_hint(manifest: StepManifest) -> str:
    return f"step {manifest.base_step} of the run must decode first"


def load_step(storage: RunStorage, step: int) -> Any:
    """The state saved at ``step`` (see :func:`resolve_chain` for the errors)."""
    return load_chain(storage, resolve_chain(storage, step))
