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
lossy policy's error never accumulates. A store that has not saved yet and loads a
checkpoint of its own folder goes on with that checkpoint's keyframe (which the load has
just decoded): a resumed run's first save is a delta, not a new full keyframe.

Checkpoints and keyframes live in a local folder or behind an fsspec URL (``s3://``,
``memory://``, ...). Each file is written as ``ink.save`` writes one: under a temporary
name beside it, moved or copied into place once complete, so a failed save leaves the
earlier file as it was.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import fsspec
import torch

from ..errors import BrokenChainError, CheckpointNotFoundError
from ..info import SaveInfo
from ..policies import Policy
from ..serialize import ProgressCallback, read_state, reference_map, write_state
from ..single_file import _write_whole, open_container
from ..store import policy_or_default
from ..store.remote_errors import translated

__all__ = ["KeyframeStore", "KEYFRAME_DIR", "TRAINER_STATE_FILE", "keyframe_of", "keyframe_path", "read_with_keyframe"]

#: The hidden folder, beside the checkpoints, that holds the keyframes.
KEYFRAME_DIR = ".ink-keyframes"
#: The file in which a Hugging Face ``checkpoint-N`` folder of ``InkTrainer`` keeps its state.
TRAINER_STATE_FILE = "inshrinkerator.ink"
_META_KEY = "keyframe"
#: How many saves, this one included, a checkpoint's keyframe had taken when it was written.
_SAVES_KEY = "keyframe_saves"


Where = Union[str, "os.PathLike[str]"]


def location(where: Where) -> str:
    """A checkpoint's or folder's place as one string: an fsspec URL as given (no trailing
    ``/``), a local path made absolute."""
    text = os.fspath(where)
    if "://" in text:
        return text.rstrip("/")
    return str(Path(text).absolute())


def _is_url(where: str) -> bool:
    return "://" in where


def _fs_path(where: str) -> tuple[fsspec.AbstractFileSystem, str]:
    with translated(where):
        return fsspec.core.url_to_fs(where)


def join(folder: str, *names: str) -> str:
    """``folder / names``, with ``..`` resolved (in the path part of a URL too)."""
    if not _is_url(folder):
        return os.path.normpath(os.path.join(folder, *names))
    protocol, rest = folder.split("://", 1)
    return f"{protocol}://{posixpath.normpath(posixpath.join(rest, *names))}"


def parent(where: str) -> str:
    if not _is_url(where):
        return os.path.dirname(where)
    protocol, rest = where.split("://", 1)
    return f"{protocol}://{posixpath.dirname(rest)}"


def relative(folder: str, start: str) -> str:
    """``folder`` relative to ``start`` (both local, or both URLs of one store)."""
    if not _is_url(folder):
        return os.path.relpath(folder, start)
    return posixpath.relpath(folder.split("://", 1)[1], start.split("://", 1)[1])


def exists(where: str) -> bool:
    if not _is_url(where):
        return os.path.exists(where)
    fs, path = _fs_path(where)
    with translated(where):
        fs.invalidate_cache(posixpath.dirname(path))  # another process may have written
        return bool(fs.exists(path))


def remove_file(where: str) -> None:
    if not _is_url(where):
        Path(where).unlink(missing_ok=True)
        return
    fs, path = _fs_path(where)
    with translated(where):
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass


def names_in(folder: str) -> list[str]:
    """The names of the files and folders in ``folder`` ([] if there is none)."""
    if not _is_url(folder):
        try:
            return sorted(os.listdir(folder))
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, path = _fs_path(folder)
    with translated(folder):
        fs.invalidate_cache(path)
        try:
            entries = fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
    paths = [str(entry).rstrip("/") for entry in entries]
    return sorted(posixpath.basename(entry) for entry in paths if entry != path.rstrip("/"))


def remove_folder(folder: str) -> None:
    if not _is_url(folder):
        shutil.rmtree(folder, ignore_errors=True)
        return
    fs, path = _fs_path(folder)
    with translated(folder):
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:  # object stores: gone with its last file
            pass


def write_text(where: str, text: str) -> None:
    if not _is_url(where):
        Path(where).parent.mkdir(parents=True, exist_ok=True)
        Path(where).write_text(text, encoding="utf-8")
        return
    fs, path = _fs_path(where)
    with translated(where):
        fs.pipe_file(path, text.encode("utf-8"))


def read_text(where: str) -> str:
    if not _is_url(where):
        return Path(where).read_text(encoding="utf-8")
    fs, path = _fs_path(where)
    with translated(where):
        return bytes(fs.cat_file(path)).decode("utf-8")


def checked_full_every(full_every: Any) -> int:
    """``full_every`` if it is a positive int.

    Raises:
        ValueError: it is not.
    """
    if not isinstance(full_every, int) or isinstance(full_every, bool) or full_every < 1:
        raise ValueError(f"full_every must be a positive int, got {full_every!r}")
    return full_every


def _same_place(one: str, other: str) -> bool:
    """Whether two locations name one file (local paths through their links)."""
    if _is_url(one) or _is_url(other):
        return one == other
    return os.path.realpath(one) == os.path.realpath(other)


def _ref_name(target: str) -> str:
    return hashlib.sha1(target.encode("utf-8")).hexdigest()[:20]


def keyframe_of(reader: Any) -> Optional[str]:
    """The keyframe an open ``.ink`` file names (written here), or None (any other file)."""
    keyframe = reader.meta.get(_META_KEY)
    return keyframe if isinstance(keyframe, str) else None


def keyframe_path(reader: Any, source: Where) -> Optional[str]:
    """Where the keyframe an open ``.ink`` file at ``source`` names lies, or None if it names none.

    Raises:
        BrokenChainError: the file's keyframe reference is malformed.
    """
    source = location(source)
    keyframe = reader.meta.get(_META_KEY)
    if keyframe is None:
        return None
    folder = reader.meta.get("keyframe_dir", KEYFRAME_DIR)
    if not isinstance(keyframe, str) or not isinstance(folder, str) or "/" in keyframe:
        raise BrokenChainError(f"{source}: bad keyframe reference {keyframe!r}")
    # A local checkpoint may be a link (Lightning's save_last="link"): its keyframe is
    # beside the file it points to.
    real = source if _is_url(source) else os.path.realpath(source)
    return join(parent(real), folder, f"{keyframe}.ink")


def _read_keyframe(path: str, source: str) -> dict[str, torch.Tensor]:
    try:
        with open_container(path) as reader:
            return reference_map(read_state(reader))
    except CheckpointNotFoundError:
        raise BrokenChainError(
            f"{source} is stored as a delta against keyframe {path}, which is missing; "
            "keyframes are deleted only when no checkpoint needs them, so it was removed by hand"
        ) from None


def read_with_keyframe(
    reader: Any, source: Where,
    references_of: Optional[Callable[[str, str, str], dict[str, torch.Tensor]]] = None,
    progress: Optional[ProgressCallback] = None,
) -> Any:
    """The state in an open ``.ink`` file at ``source``, decoded against the keyframe it
    names, found beside it (a file that names none is read as it is).

    ``references_of(keyframe, keyframe_path, source)`` supplies the keyframe's reference
    tensors (default: read from its file).

    Raises:
        BrokenChainError: the keyframe is missing or is not the one the file was saved against.
    """
    source = location(source)
    path = keyframe_path(reader, source)
    if path is None:  # a plain .ink file (e.g. made with ink.save) loads as is
        return read_state(reader, progress=progress)
    keyframe = str(keyframe_of(reader))
    references = (references_of or (lambda _, where, checkpoint: _read_keyframe(where, checkpoint)))(keyframe, path, source)
    hint = f"keyframe {path} does not match; was it replaced by hand?"
    try:
        return read_state(reader, references, reference_hint=hint, progress=progress)
    except BrokenChainError as error:
        if hint in str(error):
            raise
        raise BrokenChainError(f"{error} ({hint})") from None


class KeyframeStore:
    """Checkpoint files that each restore from themselves plus one shared keyframe.

    Args:
        root: the keyframe folder (created on first save): a local path or an fsspec URL,
            on the same store as the checkpoints.
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
        self.full_every = checked_full_every(full_every)
        self.root = location(root)
        self.policy = policy_or_default(policy)
        self._lock = threading.RLock()
        self._keyframe: Optional[str] = None
        self._reference: Optional[dict[str, torch.Tensor]] = None
        self._saves_since_keyframe = 0
        self._cached: tuple[Optional[str], Optional[dict[str, torch.Tensor]]] = (None, None)
        # Keyframes an earlier process left unneeded go at this store's first keyframe; a
        # store that took over a loaded keyframe deletes them at its first save instead.
        self._collected = False
        # A checkpoint was loaded since the last save: the next state may hold restored values.
        self._loaded = False
        # (keyframe, target) of the saves being written: a remove of that target meanwhile
        # (Lightning's AsyncCheckpointIO saves on its own thread) must not drop that save's
        # reference, nor a collection delete the keyframe it is a delta against.
        self._writing: Counter[tuple[str, str]] = Counter()

    # -- saving ---------------------------------------------------------------------------

    def save(
        self, state: Any, target: Union[str, "os.PathLike[str]"], step: Optional[int] = None,
        meta: Optional[dict[str, Any]] = None,
    ) -> SaveInfo:
        """Store ``state`` at ``target`` (replacing it) and return what was written.

        ``meta``: more JSON entries for the file's header (the keyframe's own keys win).

        Raises:
            UnsupportedStateError: the state holds a value that cannot be stored.
        """
        started = time.perf_counter()
        target = location(target)
        with self._lock:
            previous = self._keyframe_of(target) if exists(target) else None
            stored = 0
            if self._keyframe is None or self._saves_since_keyframe >= self.full_every:
                if self._keyframe is not None and not self._loaded:
                    self.policy.new_chain()  # a training state starts the next keyframe
                stored += self._new_keyframe(state)
            elif not self._collected:
                self.collect()
            keyframe, reference = str(self._keyframe), self._reference
            self._loaded = False
            self._saves_since_keyframe += 1
            self._add_ref(keyframe, target)
            self._writing[keyframe, target] += 1
            meta = {**(meta or {}), _META_KEY: keyframe, "keyframe_dir": relative(self.root, parent(target)),
                    _SAVES_KEY: self._saves_since_keyframe}
        try:
            written = _write_whole(
                target,
                lambda out: write_state(out, state, self.policy, reference, reference_name=keyframe, meta=meta),
            )
        finally:
            with self._lock:
                self._writing[keyframe, target] -= 1
                if not self._writing[keyframe, target]:
                    del self._writing[keyframe, target]
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
        written = _write_whole(
            join(self.root, f"{keyframe}.ink"),
            lambda out: write_state(out, state, self.policy, keep_reconstruction=True),
        )
        old = self._keyframe
        # A lossless reconstruction is the caller's live tensor (training goes on mutating
        # it): keep a copy, or later deltas would be taken against a moving reference.
        reference = {key: tensor.detach().clone() for key, tensor in written.reconstruction.items()}
        self._keyframe, self._reference = keyframe, reference
        self._saves_since_keyframe = 0
        if old is not None and self._collected:
            self._collect_one(old)
        else:  # this store's first keyframe: one left unneeded by an earlier process goes
            self.collect()
        return written.stored_bytes

    # -- loading --------------------------------------------------------------------------

    def load(self, target: Union[str, "os.PathLike[str]"]) -> Any:
        """The state stored at ``target``.

        A store that has no keyframe of its own yet (a new process) takes over the keyframe
        of a checkpoint it loads from its own folder: the next saves are deltas against it,
        counted from where that checkpoint left its keyframe towards ``full_every``.

        Raises:
            CheckpointNotFoundError: no file at ``target``.
            BrokenChainError: its keyframe is missing (deleted by hand).
            FormatError / CorruptCheckpointError: not a valid or an intact file.
        """
        return self.read(target)[0]

    def read(self, target: Union[str, "os.PathLike[str]"]) -> tuple[Any, dict[str, Any]]:
        """:meth:`load`, and the file's header entries (``meta``) beside the state."""
        source = location(target)
        with open_container(source) as reader:
            state = read_with_keyframe(reader, source, self._keyframe_reference)
            self._adopt(reader, source)
            self._loaded = True
            return state, dict(reader.meta)

    def _adopt(self, reader: Any, source: str) -> None:
        """Go on with the keyframe of the checkpoint just loaded from ``source``, if this store
        has none and it is one of this store's: its decoded tensors are in the cache, taken
        by no one else (the loaded state's tensors are decoded afresh), and they are the
        keyframe as any reader decodes it, so deltas against them stay closed-loop."""
        keyframe = keyframe_of(reader)
        with self._lock:
            if keyframe is None or self._keyframe is not None:
                return
            name, references = self._cached
            if name != keyframe or references is None:
                return
            path = keyframe_path(reader, source)
            if path is None or not _same_place(path, join(self.root, f"{keyframe}.ink")):
                return
            saves = reader.meta.get(_SAVES_KEY)
            if isinstance(saves, bool) or not isinstance(saves, int) or saves < 1:
                # Written before the count was recorded: at least its checkpoints still here.
                saves = max(1, len(names_in(join(self.root, f"{keyframe}.refs"))))
            self._keyframe, self._reference = keyframe, references
            self._saves_since_keyframe = saves
            self._cached = (None, None)

    def _keyframe_reference(self, keyframe: str, path: str, source: str) -> dict[str, torch.Tensor]:
        with self._lock:
            if keyframe == self._keyframe and self._reference is not None:
                return self._reference
            if self._cached[0] == keyframe and self._cached[1] is not None:
                return self._cached[1]
        references = _read_keyframe(path, source)
        with self._lock:
            self._cached = (keyframe, references)
        return references

    # -- deleting -------------------------------------------------------------------------

    def remove(self, target: Union[str, "os.PathLike[str]"]) -> None:
        """Delete the checkpoint at ``target`` and every keyframe no checkpoint needs any more."""
        target = location(target)
        with self._lock:
            keyframe = self._keyframe_of(target) if exists(target) else None
            remove_file(target)
            # A save of this path against the same keyframe, still being written, holds the
            # same reference: it lands after this remove and needs it.
            if keyframe is not None and (keyframe, target) not in self._writing:
                self._drop_ref(keyframe, target)

    def collect(self) -> None:
        """Delete keyframes that no existing checkpoint refers to (after the framework deleted
        checkpoints itself, e.g. with ``shutil.rmtree``)."""
        with self._lock:
            self._collected = True
            for name in names_in(self.root):
                if name.endswith(".ink"):
                    self._collect_one(name[: -len(".ink")])

    def close(self) -> None:
        """Stop saving here: the next save starts a new keyframe, and keyframes no existing
        checkpoint needs, the current one included, are deleted."""
        with self._lock:
            self._keyframe, self._reference = None, None
            self._saves_since_keyframe = 0
            self.collect()

    def _keyframe_of(self, target: str) -> Optional[str]:
        try:
            with open_container(target) as reader:
                return keyframe_of(reader)
        except (OSError, ValueError):  # not ours or damaged: it holds no reference
            return None

    def _add_ref(self, keyframe: str, target: str) -> None:
        write_text(join(self.root, f"{keyframe}.refs", _ref_name(target)), target)

    def _drop_ref(self, keyframe: str, target: str) -> None:
        remove_file(join(self.root, f"{keyframe}.refs", _ref_name(target)))
        self._collect_one(keyframe)

    def _collect_one(self, keyframe: str) -> None:
        if keyframe == self._keyframe or any(written == keyframe for written, _ in self._writing):
            return
        refs = join(self.root, f"{keyframe}.refs")
        for name in names_in(refs):
            ref = join(refs, name)
            target = read_text(ref)
            if exists(target) and self._keyframe_of(target) == keyframe:
                return
            remove_file(ref)
        remove_file(join(self.root, f"{keyframe}.ink"))
        remove_folder(refs)
        if self._cached[0] == keyframe:
            self._cached = (None, None)
