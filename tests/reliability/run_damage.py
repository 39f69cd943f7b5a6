"""A small run to damage, the damage itself, and what a reader must make of it.

The template run holds steps 0..5 with ``full_every=3``: steps 0 and 3 are full, the
others deltas against the step before (chains 0<-1<-2 and 3<-4<-5). Tests copy it,
damage the copy, and compare what readers say with :func:`expected_damage`, a model of
which steps a damage must break.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from inshrinkerator.errors import BrokenChainError, CheckpointNotFoundError, FormatError
from inshrinkerator.store import CheckpointManager, describe_run
from inshrinkerator.store.manifest import RUN_MARKER, manifest_name, step_of_manifest_name

__all__ = [
    "READER_ERRORS",
    "TEMPLATE_STEPS",
    "RunFiles",
    "step_state",
    "build_run",
    "copy_run",
    "snapshot_files",
    "Damage",
    "expected_damage",
    "chain_of",
]

#: The errors a reader may raise for a damaged run (CorruptCheckpointError is a FormatError).
READER_ERRORS = (FormatError, BrokenChainError, CheckpointNotFoundError)
TEMPLATE_STEPS = tuple(range(6))
FULL_EVERY = 3


def step_state(step: int) -> dict[str, Any]:
    """The state saved at ``step``: weights that drift a little, a bf16 copy, counters, plain values."""
    base = torch.Generator().manual_seed(7)
    drift = torch.Generator().manual_seed(100 + step)
    weight = torch.randn(384, generator=base) * 0.05 + torch.randn(384, generator=drift) * 1e-3
    return {
        "model": {"weight": weight, "half": weight[:96].to(torch.bfloat16), "tiny": torch.tensor([0.5, -0.0])},
        "optimizer": {"step": torch.tensor(step), "exp_avg": torch.randn(64, generator=drift) * 1e-4},
        "step": step,
        "note": f"step {step}",
    }


@dataclass(frozen=True)
class RunFiles:
    """Which file of a run belongs to which step, and each step's base (``None`` for a full step)."""

    data_file: dict[int, str]
    base: dict[int, Optional[int]]

    def owner(self, name: str) -> Optional[int]:
        """The step whose manifest or data file ``name`` is, else ``None``."""
        step = step_of_manifest_name(name)
        if step is not None:
            return step
        for owner, data in self.data_file.items():
            if data == name:
                return owner
        return None


def build_run(folder: Path, steps: tuple[int, ...] = TEMPLATE_STEPS, policy: str = "lossless") -> RunFiles:
    """Save ``step_state(s)`` for every step into a new run at ``folder``."""
    with CheckpointManager(folder, policy=policy, full_every=FULL_EVERY) as manager:
        for step in steps:
            manager.save(step, step_state(step))
    entries = describe_run(str(folder))
    return RunFiles({e.step: e.data_file for e in entries}, {e.step: e.base_step for e in entries})


def copy_run(source: Path, destination: Path) -> None:
    shutil.copytree(source, destination)


def snapshot_files(folder: Path) -> dict[str, bytes]:
    """Every regular file of a run folder and its bytes."""
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def chain_of(files: RunFiles, step: int) -> list[int]:
    """The steps ``step`` decodes through: itself, then its bases down to a full step."""
    chain = [step]
    while files.base[chain[-1]] is not None:
        chain.append(files.base[chain[-1]])  # type: ignore[arg-type]
    return chain


@dataclass(frozen=True)
class Damage:
    """One change to one file of a run folder.

    ``how``: ``flip`` (XOR ``value`` into the byte at ``position``), ``truncate`` (keep
    ``position`` bytes), ``extend`` (append ``payload``), ``overwrite`` (replace the whole
    file with ``payload``), ``splice`` (replace the bytes from ``position`` with
    ``payload``), ``delete``, ``directory`` (replace the file by an empty directory).
    Positions are taken modulo the file size, so any drawn position lands in the file.
    """

    how: str
    target: str
    position: int = 0
    value: int = 1
    payload: bytes = b""

    def apply(self, folder: Path) -> None:
        path = folder / self.target
        if not path.is_file():
            return  # an earlier damage already removed it
        data = path.read_bytes()
        at = self.position % len(data) if data else 0
        if self.how == "flip":
            if data:
                changed = bytearray(data)
                changed[at] ^= self.value or 1
                path.write_bytes(bytes(changed))
        elif self.how == "truncate":
            path.write_bytes(data[:at])
        elif self.how == "extend":
            path.write_bytes(data + (self.payload or b"\0"))
        elif self.how == "overwrite":
            path.write_bytes(self.payload)
        elif self.how == "splice":
            path.write_bytes(data[:at] + self.payload + data[at + len(self.payload):])
        elif self.how == "delete":
            path.unlink()
        elif self.how == "directory":
            path.unlink()
            path.mkdir()
        else:
            raise ValueError(f"unknown damage {self.how!r}")


@dataclass(frozen=True)
class ExpectedDamage:
    """What a damaged copy of the template must look like to readers."""

    listed: set[int]  # the steps whose manifest is still a file of that name
    broken: set[int]  # listed steps that must fail to load (every other listed step loads exactly)
    marker_damaged: bool  # the run marker changed or is gone while steps remain


def expected_damage(files: RunFiles, before: dict[str, bytes], folder: Path) -> ExpectedDamage:
    """Compare the folder with its bytes ``before`` damage: which steps are gone, which broken.

    A step whose manifest was deleted is simply no longer in the run (deleting a manifest
    is how a step is deleted); a step is broken when a file of its chain changed, is gone
    or is no longer a regular file.
    """
    after = snapshot_files(folder)
    changed = {name for name, data in before.items() if after.get(name) != data}
    present = {path.name for path in folder.iterdir()}
    listed = {step for step in files.base if manifest_name(step) in present}
    hit = {files.owner(name) for name in changed} - {None}
    broken = {step for step in listed if any(link in hit for link in chain_of(files, step))}
    marker_damaged = RUN_MARKER in changed and bool(listed)
    return ExpectedDamage(listed, broken, marker_damaged)  # type: ignore[arg-type]


def manifest_document(folder: Path, step: int) -> dict[str, Any]:
    return json.loads((folder / manifest_name(step)).read_bytes())
