"""Checkpoints at paths a training framework chooses and deletes, stored as deltas.

Lightning's ``ModelCheckpoint`` and the Hugging Face ``Trainer`` name every checkpoint
themselves and delete old ones on their own schedule (``save_top_k``,
``save_total_limit``). A chain of deltas would break the first time they delete a
checkpoint another one was coded against. So the chains here are one link long: every
checkpoint is a delta against a *keyframe*, a full checkpoint kept in a hidden folder
next to them (``.ink-keyframes``), and a keyframe is deleted only once no remaining
checkpoint refers to it. Whatever the framework deletes, every checkpoint it keeps
restores from its own file plus one keyframe.

Deltas are taken against the keyframe as a reader will decode it (closed loop), so a
lossy policy's error never accumulates.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Optional, Union

import torch

from ..errors import BrokenChainError, CheckpointNotFoundError
from ..info import SaveInfo
from ..policies import Policy
from ..serialize import read_state, reference_map, write_state
from ..single_file import open_container
from ..store import policy_or_default

__all__ = ["KeyframeStore", "KEYFRAME_DIR"]

#: The hidden folder, beside the checkpoints, that holds the keyframes.
KEYFRAME_DIR = ".ink-keyframes"
_META_KEY = "keyframe"


def _write_atomically(path: Path, write: Callable[[IO[bytes]], Any]) -> Any:
    """Write ``path`` under a temporary name, fsync, rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            result = write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return result


def _ref_name(target: Path) -> str:
    return hashlib.sha1(str(target).encode("utf-8")).hexdigest()[:20]


class KeyframeStore:
    """Checkpoint files that each restore from themselves plus one shared keyframe.

    Args:
        root: the keyframe folder (created on first save).
        policy: a policy name, spec (``"dynaquant:tolerance=0.01"``) or object; the default
            is the manager's default policy.
        full_every: a new keyframe every this many saves (1: every save is a keyframe).

    Thread-safe: a save may run on a background thread (e.g. Lightning's
    ``AsyncCheckpointIO``) while the framework deletes older checkpoints.
    """

    def __init__(
        self, root: Union[str, "os.PathLike[str]"], policy: Union[str, Policy, None] = None,
        full_every: int = 10,
    ) -> None:
        if not isinstance(full_every, int) or isinstance(full_every, bool) or full_every < 1:
            raise ValueError(f"full_every must be a positive int, got {full_every!r}")
        self.root = Path(root).absolute()
        self.policy = policy_or_default(policy)
        self.full_every = full_every
        self._lock = threading.RLock()
        self._keyframe: Optional[str] = None
        self._reference: Optional[dict[str, torch.Tensor]] = None
        self._saves_since_keyframe = 0
        self._cached: tuple[Optional[str], Optional[dict[str, torch.Tensor]]] = (None, None)

    # -- saving ---------------------------------------------------------------------------

    def save(self, state: Any, target: Union[str, "os.PathLike[str]"], step: Optional[int] = None) -> SaveInfo:
        """Store ``state`` at ``target`` (replacing it) and return what was written.

        Raises:
            UnsupportedStateError: the state holds a value that cannot be stored.
        """
        started = time.perf_counter()
        target = Path(target).absolute()
        with self._lock:
            previous = self._keyframe_of(target) if target.exists() else None
            stored = 0
            if self._keyframe is None or self._saves_since_keyframe >= self.full_every:
                stored += self._new_keyframe(state)
            keyframe, reference = str(self._keyframe), self._reference
            self._saves_since_keyframe += 1
            self._add_ref(keyframe, target)
        meta = {_META_KEY: keyframe, "keyframe_dir": os.path.relpath(self.root, target.parent)}
        written = _write_atomically(
            target,
            lambda out: write_state(out, state, self.policy, reference, reference_name=keyframe, meta=meta),
        )
        stored += written.stored_bytes
        with self._lock:
            if previous is not None and previous != keyframe:
                self._drop_ref(previous, target)
        return SaveInfo(
            step=step,
            kind="delta" if written.used_reference else "full",
            raw_bytes=written.raw_bytes,
            stored_bytes=stored,
            ratio=written.raw_bytes / max(stored, 1),
            seconds=time.perf_counter() - started,
            policy=self.policy.name,
        )

    def _new_keyframe(self, state: Any) -> int:
        keyframe = f"kf-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        written = _write_atomically(
            self.root / f"{keyframe}.ink",
            lambda out: write_state(out, state, self.policy, keep_reconstruction=True),
        )
        (self.root / f"{keyframe}.refs").mkdir(exist_ok=True)
        old = self._keyframe
        # A lossless reconstruction is the caller's live tensor (training goes on mutating
        # it): keep a copy, or later deltas would be taken against a moving reference.
        reference = {key: tensor.detach().clone() for key, tensor in written.reconstruction.items()}
        self._keyframe, self._reference = keyframe, reference
        self._saves_since_keyframe = 0
        if old is not None:
            self._collect_one(old)
        else:  # this store's first keyframe: one left unneeded by an earlier process goes
            self.collect()
        return written.stored_bytes

    # -- loading --------------------------------------------------------------------------

    def load(self, target: Union[str, "os.PathLike[str]"]) -> Any:
        """The state stored at ``target``.

        Raises:
            CheckpointNotFoundError: no file at ``target``.
            BrokenChainError: its keyframe is missing (deleted by hand).
            FormatError / CorruptCheckpointError: not a valid or an intact file.
        """
        source = Path(target)
        with open_container(source) as reader:
            keyframe = reader.meta.get(_META_KEY)
            if keyframe is None:  # a plain .ink file (e.g. made with ink.save) loads as is
                return read_state(reader)
            folder = reader.meta.get("keyframe_dir", KEYFRAME_DIR)
            if not isinstance(keyframe, str) or not isinstance(folder, str) or "/" in keyframe:
                raise BrokenChainError(f"{source}: bad keyframe reference {keyframe!r}")
            keyframe_path = Path(os.path.realpath(source)).parent / folder / f"{keyframe}.ink"
            references = self._keyframe_reference(keyframe, keyframe_path, source)
            return read_state(
                reader, references,
                reference_hint=f"keyframe {keyframe_path} does not match; was it replaced by hand?",
            )

    def _keyframe_reference(self, keyframe: str, path: Path, source: Path) -> dict[str, torch.Tensor]:
        with self._lock:
            if keyframe == self._keyframe and self._reference is not None:
                return self._reference
            if self._cached[0] == keyframe and self._cached[1] is not None:
                return self._cached[1]
        try:
            with open_container(path) as reader:
                references = reference_map(read_state(reader))
        except CheckpointNotFoundError:
            raise BrokenChainError(
                f"{source} is stored as a delta against keyframe {path}, which is missing; "
                "keyframes are deleted only when no checkpoint needs them, so it was removed by hand"
            ) from None
        with self._lock:
            self._cached = (keyframe, references)
        return references

    # -- deleting -------------------------------------------------------------------------

    def remove(self, target: Union[str, "os.PathLike[str]"]) -> None:
        """Delete the checkpoint at ``target`` and every keyframe no checkpoint needs any more."""
        target = Path(target).absolute()
        with self._lock:
            keyframe = self._keyframe_of(target) if target.exists() else None
            target.unlink(missing_ok=True)
            if keyframe is not None:
                self._drop_ref(keyframe, target)

    def collect(self) -> None:
        """Delete keyframes that no existing checkpoint refers to (after the framework deleted
        checkpoints itself, e.g. with ``shutil.rmtree``)."""
        with self._lock:
            if not self.root.is_dir():
                return
            for path in self.root.glob("*.ink"):
                self._collect_one(path.stem)

    def close(self) -> None:
        """Stop saving here: the next save starts a new keyframe, and keyframes no existing
        checkpoint needs, the current one included, are deleted."""
        with self._lock:
            self._keyframe, self._reference = None, None
            self._saves_since_keyframe = 0
            self.collect()

    def _keyframe_of(self, target: Path) -> Optional[str]:
        try:
            with open_container(target) as reader:
                keyframe = reader.meta.get(_META_KEY)
        except (OSError, ValueError):  # not ours or damaged: it holds no reference
            return None
        return keyframe if isinstance(keyframe, str) else None

    def _add_ref(self, keyframe: str, target: Path) -> None:
        refs = self.root / f"{keyframe}.refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / _ref_name(target)).write_text(str(target), encoding="utf-8")

    def _drop_ref(self, keyframe: str, target: Path) -> None:
        (self.root / f"{keyframe}.refs" / _ref_name(target)).unlink(missing_ok=True)
        self._collect_one(keyframe)

    def _collect_one(self, keyframe: str) -> None:
        if keyframe == self._keyframe:
            return
        refs = self.root / f"{keyframe}.refs"
        if refs.is_dir():
            for ref in refs.iterdir():
                target = Path(ref.read_text(encoding="utf-8"))
                if target.exists() and self._keyframe_of(target) == keyframe:
                    return
                ref.unlink(missing_ok=True)
        (self.root / f"{keyframe}.ink").unlink(missing_ok=True)
        shutil.rmtree(refs, ignore_errors=True)
        if self._cached[0] == keyframe:
            self._cached = (None, None)
