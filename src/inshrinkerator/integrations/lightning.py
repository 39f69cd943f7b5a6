"""PyTorch Lightning: compressed checkpoints through a ``CheckpointIO`` plugin.

::

    from inshrinkerator.integrations.lightning import InkCheckpointIO
    trainer = Trainer(plugins=[InkCheckpointIO()], callbacks=[ModelCheckpoint(save_top_k=2, ...)])
    trainer.fit(model)                                # every .ckpt is compressed
    trainer.fit(model, ckpt_path="path/to/x.ckpt")    # resumes from one

Add the ``InkWatch()`` callback to let the policy watch the module (what
``CheckpointManager.watch`` does: DynaQuant's gradient sensitivity, and frozen layers kept
on their stored levels); a ``CheckpointIO`` alone never sees the model.

``InkCheckpointIO(async_save=True)`` compresses and writes off the training thread: a
save copies the checkpoint's tensors and returns, the next one waits for it. (Lightning's
``AsyncCheckpointIO`` wrapper works too, but its queue is out of the plugin's sight; see
the class.) Each ``.ckpt`` is a delta against a keyframe kept in ``.ink-keyframes/`` beside
it (see :mod:`inshrinkerator.integrations._keyframes`), so ``ModelCheckpoint`` may delete
any checkpoint (``save_top_k``) and every checkpoint it keeps still restores.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone packages
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as error:
        raise ImportError(
            "inshrinkerator.integrations.lightning needs PyTorch Lightning: "
            "pip install 'inshrinkerator[lightning]'"
        ) from error

from ..errors import AsyncSaveError, CheckpointNotFoundError
from ..policies import Policy
from ..store import policy_or_default, watch_with
from ..store.async_worker import BackgroundWorker
from ..store.snapshot import SpareBuffers, snapshot_state
from ._keyframes import KEYFRAME_DIR, KeyframeStore, exists, join, location, parent

__all__ = ["InkCheckpointIO", "InkWatch"]

# Plugins with a background thread: a save that failed after the last wait() is reported
# when the interpreter exits (Fabric has no end of fit to call teardown at).
_ASYNC_PLUGINS: "weakref.WeakSet[InkCheckpointIO]" = weakref.WeakSet()


@atexit.register
def _report_unwaited_failures() -> None:
    for plugin in list(_ASYNC_PLUGINS):
        worker = plugin._worker
        if worker is None:
            continue
        try:
            worker.result()  # its thread has ended by now: the outcome is there
        except AsyncSaveError as error:
            print(f"inshrinkerator: {error} (nothing waited for this save before exit)", file=sys.stderr)


def _plain(value: Any) -> Any:
    """Mapping subclasses (Lightning's ``AttributeDict`` hyper-parameters) as plain dicts."""
    if isinstance(value, Mapping) and type(value) is not dict and not hasattr(value, "move_to_end"):
        return {key: _plain(item) for key, item in value.items()}
    if type(value) is dict:
        return {key: _plain(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(item) for item in value)
    return value


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((key, _move(item, device)) for key, item in value.items())
    if type(value) in (list, tuple):
        return type(value)(_move(item, device) for item in value)
    return value


class InkCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints compressed; loads them back; deletes them safely.

    Args:
        policy: a policy name, spec (``"dynaquant:tolerance=0.01"``) or object (default:
            the manager's default policy).
        full_every: a new keyframe every this many saves in a folder; the others are
            deltas against it.
        async_save: compress and write on a background thread. ``save_checkpoint`` copies
            the checkpoint's tensors to the CPU and returns; the next save (and a load, and
            ``teardown``) first waits for the one in flight, and raises
            :class:`~inshrinkerator.AsyncSaveError` if it failed. A removal asked for while a
            save is in flight is done once that save lands (not if it fails), so a crash
            never leaves fewer checkpoints than before the save, and a later save to a
            removed path is always kept.

    Paths are local files or fsspec URLs (``ModelCheckpoint(dirpath="s3://bucket/ckpt")``;
    the keyframes go to the same store). Loading also accepts a plain ``.ink`` file.

    Behind Lightning's ``AsyncCheckpointIO`` instead, saves wait in a queue this plugin
    cannot see while removals run on the training thread: removing a path that has no file
    yet marks it, and the next save to it that runs on another thread (the queued one the
    removal overtook) is deleted when it lands. A path removed with neither a file nor a
    queued save therefore loses its next queued save, and a removal may run before the save
    it makes way for has landed (a crash in between leaves neither); ``async_save=True`` has
    neither case. ``teardown`` deletes keyframes no checkpoint needs.
    """

    def __init__(
        self, policy: Union[str, Policy, None] = None, full_every: int = 10, async_save: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be a bool, got {async_save!r}")
        # One policy object for every folder: it carries what it watched.
        self.policy: Policy = policy_or_default(policy)
        self.full_every = full_every
        self.async_save = async_save
        self._stores: dict[str, KeyframeStore] = {}
        self._lock = threading.Lock()
        # Paths Lightning removed before their save ran (AsyncCheckpointIO queues saves
        # but removes on the caller's thread): deleted as soon as their save lands, if it
        # was asked for on another thread than the removal (a save asked for on the
        # removing thread came after it).
        self._removed_early: dict[str, int] = {}
        # async_save: the background thread (made at the first save); whether a save is in
        # flight, and the removals asked for meanwhile (path, remover's thread), done once it
        # lands; fresh buffers laid out like the last checkpoint for the next copy.
        self._worker: Optional[BackgroundWorker] = None
        self._landing = False
        self._deferred: list[tuple[str, int]] = []
        self._spare: Optional[SpareBuffers] = None

    def _store(self, path: str) -> KeyframeStore:
        folder = parent(path)
        with self._lock:
            store = self._stores.get(folder)
            if store is None:
                store = KeyframeStore(join(folder, KEYFRAME_DIR), self.policy, self.full_every)
                self._stores[folder] = store
            return store

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Union[str, "os.PathLike[str]"],
        storage_options: Optional[Any] = None,
    ) -> None:
        """Compress ``checkpoint`` into ``path`` (with ``async_save``: a copy of it, in the
        background).

        Raises:
            TypeError: ``storage_options`` was given (there are none).
            UnsupportedStateError: the checkpoint holds a value that cannot be stored.
            AsyncSaveError: the previous background save failed (this one is not started).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        target = location(path)
        plain = _plain(checkpoint)
        step = plain.get("global_step") if isinstance(plain, dict) else None
        asker = threading.get_ident()
        if not self.async_save:
            self._write(plain, target, step, asker)
            return
        self.wait()
        snapshot = snapshot_state(plain, self._spare)  # on this thread: training goes on mutating
        self._spare = None
        held = [snapshot]

        def job() -> None:
            taken = held.pop()
            try:
                self._write(taken.state, target, step, asker)
            except BaseException:
                with self._lock:  # the checkpoints it was to replace stay
                    self._landing, self._deferred = False, []
                raise
            with self._lock:
                self._landing = False
                removals, self._deferred = self._deferred, []
            for removed, remover in removals:
                self._remove(removed, remover)
            layout = SpareBuffers.layout_of(taken.tensors)
            del taken
            self._spare = SpareBuffers(layout)

        if self._worker is None:
            self._worker = BackgroundWorker("inshrink-lightning")
            _ASYNC_PLUGINS.add(self)
        with self._lock:
            self._landing = True
        self._worker.submit(job, f"saving checkpoint {target}")

    def _write(self, checkpoint: Any, target: str, step: Any, asker: int) -> None:
        self._store(target).save(checkpoint, target, step=step)
        with self._lock:
            remover = self._removed_early.pop(target, None)
        if remover is not None and remover != asker:
            self._store(target).remove(target)

    def wait(self) -> None:
        """Wait for the background save in flight, if any (``async_save``).

        Raises:
            AsyncSaveError: it failed; chained to the original exception.
        """
        if self._worker is not None:
            self._worker.result()

    def load_checkpoint(
        self, path: Union[str, "os.PathLike[str]"], map_location: Optional[Any] = None,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """The checkpoint at ``path``; tensors moved to ``map_location`` if it names a device.

        No pickle is involved, so ``weights_only`` changes nothing. With ``async_save``,
        the save in flight lands first.

        Raises:
            FileNotFoundError (CheckpointNotFoundError): no checkpoint at ``path``.
            BrokenChainError: its keyframe was deleted by hand.
            AsyncSaveError: the background save in flight failed.
        """
        target = location(path)
        self.wait()
        if not exists(target):
            raise CheckpointNotFoundError(f"Checkpoint file not found: {target}")
        checkpoint = self._store(target).load(target)
        if isinstance(map_location, (str, torch.device)):
            checkpoint = _move(checkpoint, torch.device(map_location))
        return checkpoint

    def remove_checkpoint(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Delete the checkpoint at ``path``; keyframes go once no kept checkpoint needs them.

        With ``async_save``, while a save is in flight the removal waits for it to land
        (without blocking the caller): ``ModelCheckpoint`` removes the checkpoint a new one
        replaces right after asking for the new one, and a crash before the new one lands
        must leave the old one. If that save fails, the removals asked for meanwhile are not
        done.
        """
        target, remover = location(path), threading.get_ident()
        with self._lock:
            if self._landing:
                self._deferred.append((target, remover))
                return
        self._remove(target, remover)

    def _remove(self, target: str, remover: int) -> None:
        if not exists(target):
            with self._lock:
                self._removed_early[target] = remover
            return
        self._store(target).remove(target)

    def watch(self, model: torch.nn.Module) -> None:
        """Let a policy that wants gradients see ``model`` (a no-op for other policies);
        the :class:`InkWatch` callback calls it with the ``LightningModule``."""
        watch_with(self.policy, model)

    def teardown(self) -> None:
        """Let the save in flight land; forget the folders' current keyframes and delete those
        no checkpoint needs.

        Raises:
            AsyncSaveError: the background save in flight failed (the keyframes are
                cleaned up all the same).
        """
        try:
            self.wait()
        finally:
            worker, self._worker = self._worker, None
            self._spare = None
            if worker is not None:
                worker.shutdown()
            with self._lock:
                stores = list(self._stores.values())
                self._stores.clear()
            for store in stores:
                store.close()


def _ink_checkpoint_io(io: Any) -> Optional[InkCheckpointIO]:
    """The InkCheckpointIO in ``io``, looking through wrappers such as ``AsyncCheckpointIO``."""
    seen = 0
    while io is not None and not isinstance(io, InkCheckpointIO) and seen < 8:
        io = getattr(io, "checkpoint_io", None)
        seen += 1
    return io if isinstance(io, InkCheckpointIO) else None


class InkWatch(Callback):
    """Lets the trainer's :class:`InkCheckpointIO` watch the ``LightningModule`` at setup.

    ::

        Trainer(plugins=[InkCheckpointIO()], callbacks=[InkWatch(), ModelCheckpoint(...)])

    The Lightning counterpart of ``CheckpointManager.watch(model)`` and of ``InkTrainer``'s
    ``ink_watch=True``. It finds the plugin through ``AsyncCheckpointIO``. When the set of
    parameters that require grad has changed at the start of an epoch (a fine-tuning
    callback unfroze a layer), it watches the module again, so the newly trained
    parameters get gradient averages too.

    Raises:
        ValueError: at setup, when the trainer's checkpoint IO is not an ``InkCheckpointIO``
            (the callback would otherwise do nothing, silently).
    """

    def __init__(self) -> None:
        super().__init__()
        self._io: Optional[InkCheckpointIO] = None
        self._trained: frozenset[str] = frozenset()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = _ink_checkpoint_io(trainer.strategy.checkpoint_io)
        if io is None:
            raise ValueError(
                f"InkWatch needs an InkCheckpointIO among the Trainer's plugins; its checkpoint IO "
                f"is {type(trainer.strategy.checkpoint_io).__name__}"
            )
        self._io = io
        io.watch(pl_module)
        self._trained = _trained_names(pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        trained = _trained_names(pl_module)
        if self._io is not None and trained != self._trained:
            self._io.watch(pl_module)
            self._trained = trained


def _trained_names(module: torch.nn.Module) -> frozenset[str]:
    return frozenset(name for name, parameter in module.named_parameters() if parameter.requires_grad)
