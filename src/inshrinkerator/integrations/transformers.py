"""Hugging Face ``Trainer``: every ``checkpoint-N`` folder stored compressed.

::

    from inshrinkerator.integrations.transformers import InkTrainer
    trainer = InkTrainer(model=model, args=TrainingArguments(..., save_total_limit=2), ...)
    trainer.train()
    trainer.train(resume_from_checkpoint=True)   # or a checkpoint-N path

Use :class:`InkTrainerMixin` in front of your own ``Trainer`` subclass
(``class MyTrainer(InkTrainerMixin, Seq2SeqTrainer)``). A checkpoint folder keeps
``trainer_state.json`` and ``config.json``; the model weights, optimizer, scheduler,
gradient scaler and RNG states go into one ``inshrinkerator.ink`` file instead of
``model.safetensors`` / ``optimizer.pt`` / ``scheduler.pt`` / ``rng_state.pth``, so
resuming unpickles nothing. Each file is a delta against a keyframe in
``output_dir/.ink-keyframes``; ``save_total_limit`` may delete any folder and every kept
one still restores. ``trainer.save_model()`` (the final export) is unchanged.

``ink_async_save=True`` compresses and writes the file on a background thread: a
checkpoint's tensors are copied, training goes on, and ``save_total_limit``'s rotation
runs once the file has landed, so a crash never leaves fewer complete checkpoints than
before. A folder whose file is still being written holds ``inshrinkerator.pending``;
``train(resume_from_checkpoint=True)`` passes over such folders (a crash's leftovers).

Single-process and DDP training are supported; DeepSpeed, FSDP, XLA and SageMaker
model parallelism keep their own checkpoint formats and are refused.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

try:
    from transformers import Trainer
except ImportError as error:
    raise ImportError(
        "inshrinkerator.integrations.transformers needs transformers: "
        "pip install 'inshrinkerator[transformers]'"
    ) from error

from ..errors import CheckpointNotFoundError, FormatError
from ..policies import Policy
from ..store import policy_or_default, watch_with
from ..store.async_worker import BackgroundWorker
from ..store.snapshot import snapshot_state
from ._keyframes import KEYFRAME_DIR, TRAINER_STATE_FILE, KeyframeStore

try:  # transformers >= 5: a function; before, the Trainer's own method
    from transformers.trainer_utils import rotate_checkpoints
except ImportError:  # pragma: no cover - older transformers
    rotate_checkpoints = None

__all__ = ["InkTrainerMixin", "InkTrainer", "STATE_FILE", "PENDING_FILE"]

#: The file inside each ``checkpoint-N`` folder.
STATE_FILE = TRAINER_STATE_FILE
#: Present in a ``checkpoint-N`` folder while its file is written in the background.
PENDING_FILE = "inshrinkerator.pending"
_CHECKPOINT_FOLDER = re.compile(r"^checkpoint-(\d+)$")


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(position),
                  int(has_gauss), float(cached)],
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any], source: str) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, position, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
        torch.random.set_rng_state(state["cpu"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise FormatError(f"{source}: bad RNG state ({error})") from error
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


class InkTrainerMixin:
    """Put in front of a ``transformers.Trainer`` (sub)class to compress its checkpoints.

    Keyword args (besides the Trainer's own):
        ink_policy: a policy name, spec (``"dynaquant:tolerance=0.01"``) or object (default:
            the manager's default policy).
        ink_full_every: a new keyframe every this many checkpoints.
        ink_watch: let the policy watch the model (what ``CheckpointManager.watch`` does):
            DynaQuant then ranks weights by gradient sensitivity and keeps layers the model
            does not train on their stored levels instead of re-coding them in every
            checkpoint. Costs one elementwise pass per trained parameter per step. A
            policy without ``watch`` ignores it.
        ink_async_save: compress and write each checkpoint's file on a background thread
            (one in flight; the next checkpoint, a resume and the end of ``train`` wait for
            it). A failure is raised at the next of those as ``AsyncSaveError``. Callbacks'
            ``on_save`` may run before the file has landed. With ``push_to_hub`` the file
            is written before the push, as without this option.
    """

    def __init__(
        self, *args: Any, ink_policy: Union[str, Policy, None] = None, ink_full_every: int = 10,
        ink_watch: bool = True, ink_async_save: bool = False, **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(ink_watch, bool):
            raise TypeError(f"ink_watch must be a bool, got {ink_watch!r}")
        if not isinstance(ink_async_save, bool):
            raise TypeError(f"ink_async_save must be a bool, got {ink_async_save!r}")
        self._ink_async = ink_async_save
        self._ink_worker: Optional[BackgroundWorker] = None
        # async: whether the checkpoint being saved is written in the background, and its
        # copied state and folder, until the Trainer's own part of the save is done.
        self._ink_deferring = False
        self._ink_stash: Optional[tuple[Any, Path]] = None
        # One policy object for every store of this trainer: it carries what it watched.
        self._ink_policy: Policy = policy_or_default(ink_policy)
        model = getattr(self, "model", None)
        if ink_watch and isinstance(model, torch.nn.Module):  # not with model_init
            watch_with(self._ink_policy, model)
        self._ink_full_every = ink_full_every
        self._ink_stores: dict[Path, KeyframeStore] = {}
        self._ink_parts: Optional[dict[str, Any]] = None
        self._ink_loaded: tuple[Optional[Path], Any] = (None, None)

    # -- saving ---------------------------------------------------------------------------

    def _ink_store(self, run_dir: Path) -> KeyframeStore:
        store = self._ink_stores.get(run_dir)
        if store is None:
            store = KeyframeStore(run_dir / KEYFRAME_DIR, self._ink_policy, self._ink_full_every)
            self._ink_stores[run_dir] = store
        return store

    def _ink_check_supported(self) -> None:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # type: ignore[attr-defined]
            raise ValueError(
                "InkTrainer compresses single-process and DDP checkpoints; DeepSpeed and FSDP "
                "write their own sharded format (use the DCP integration for sharded states)"
            )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._ink_check_supported()
        self._ink_wait()  # the previous checkpoint's file has landed
        args = self.args  # type: ignore[attr-defined]
        # A push to the Hub uploads the folder inside the Trainer's save: it needs the file.
        deferring = self._ink_async and args.should_save and not args.push_to_hub
        self._ink_deferring = deferring
        limit = args.save_total_limit
        self._ink_parts = {}
        if deferring:  # rotation once this checkpoint's file has landed, not before
            args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            self._ink_parts = None
            self._ink_deferring = False
            if deferring:
                args.save_total_limit = limit
            # (If the Trainer's part failed, the folder stays pending: a resume passes it over.)
            stash, self._ink_stash = self._ink_stash, None
        if deferring and stash is not None:
            self._ink_submit(*stash, limit)
        elif args.should_save:
            # save_total_limit may just have deleted folders: drop keyframes nothing needs.
            for store in self._ink_stores.values():
                store.collect()

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        if self._ink_parts is None:  # an export (save_model), not a checkpoint
            return super()._save(output_dir, state_dict)  # type: ignore[misc]
        if not self.args.should_save:  # type: ignore[attr-defined]
            return None
        folder = Path(output_dir if output_dir is not None else self.args.output_dir)  # type: ignore[attr-defined]
        folder.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)  # type: ignore[attr-defined]
        if hasattr(model, "config") and hasattr(model.config, "save_pretrained"):
            model.config.save_pretrained(folder)
        if self.processing_class is not None:  # type: ignore[attr-defined]
            self.processing_class.save_pretrained(folder)  # type: ignore[attr-defined]
        self._ink_parts["model"] = state_dict if state_dict is not None else model.state_dict()
        if self.args.save_only_model:  # type: ignore[attr-defined]
            self._ink_write(folder)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._ink_parts is None:
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        if self.args.should_save:  # type: ignore[attr-defined]
            self._ink_parts["optimizer"] = self.optimizer.state_dict()  # type: ignore[attr-defined]
            self._ink_parts["scheduler"] = self.lr_scheduler.state_dict()  # type: ignore[attr-defined]
        return None

    def _save_scaler(self, output_dir: str) -> None:
        if self._ink_parts is None:
            return super()._save_scaler(output_dir)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None and self.args.should_save:  # type: ignore[attr-defined]
            self._ink_parts["scaler"] = scaler.state_dict()
        return None

    def _save_rng_state(self, output_dir: str) -> None:
        # The last piece _save_checkpoint saves before trainer_state.json: write the file here.
        if self._ink_parts is None or not self.args.should_save:  # type: ignore[attr-defined]
            return super()._save_rng_state(output_dir)  # type: ignore[misc]
        if self.args.world_size > 1:  # every rank keeps its own rng_state_{i}.pth (weights-only)
            super()._save_rng_state(output_dir)  # type: ignore[misc]
        else:
            self._ink_parts["rng"] = _rng_state()
        self._ink_write(Path(output_dir))
        return None

    def _ink_write(self, folder: Path) -> None:
        parts = self._ink_parts or {}
        self._ink_policy.before_save()  # the training thread: a watching policy hooks unfrozen layers
        if self._ink_deferring:
            # Copied now (training goes on mutating the tensors), written once the Trainer's
            # own part of the save is done; until then the folder says it is not complete.
            (folder / PENDING_FILE).write_bytes(b"")
            self._ink_stash = (snapshot_state(parts).state, folder)
            return
        self._ink_store(folder.parent.absolute()).save(
            parts, folder / STATE_FILE, step=self.state.global_step  # type: ignore[attr-defined]
        )

    def _ink_submit(self, state: Any, folder: Path, limit: Optional[int]) -> None:
        """Write ``folder``'s file in the background; then rotate and drop unneeded keyframes."""
        store = self._ink_store(folder.parent.absolute())
        step = self.state.global_step  # type: ignore[attr-defined]
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        held = [state]

        def job() -> None:
            store.save(held.pop(), folder / STATE_FILE, step=step)
            (folder / PENDING_FILE).unlink(missing_ok=True)
            if limit:
                if rotate_checkpoints is not None:
                    rotate_checkpoints(output_dir=str(folder.parent), save_total_limit=limit,
                                       best_model_checkpoint=best, use_mtime=True)
                else:  # pragma: no cover - older transformers
                    self._rotate_checkpoints(use_mtime=True, output_dir=str(folder.parent))  # type: ignore[attr-defined]
            store.collect()

        if self._ink_worker is None:
            self._ink_worker = BackgroundWorker("inshrink-hf")
        self._ink_worker.submit(job, f"saving checkpoint {folder}")

    def _ink_wait(self) -> None:
        """Wait for the checkpoint file being written in the background, if any.

        Raises:
            AsyncSaveError: its save failed; chained to the original exception.
        """
        if self._ink_worker is not None:
            self._ink_worker.result()

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest *complete*
        ``checkpoint-N`` folder (one an asynchronous save finished), and training ends once
        the last checkpoint's file has landed.

        Raises:
            ValueError: ``resume_from_checkpoint=True`` and there is no complete checkpoint.
            AsyncSaveError: a background save failed.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._ink_last_checkpoint()
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        except BaseException:
            if self._ink_worker is not None:
                self._ink_worker.settle()  # the training's own error is the one raised
            raise
        worker, self._ink_worker = self._ink_worker, None
        if worker is not None:
            try:
                worker.result()
            finally:
                worker.shutdown()
        return result

    def _ink_last_checkpoint(self) -> str:
        """The newest ``checkpoint-N`` folder of ``output_dir`` that is not pending."""
        output = Path(self.args.output_dir)  # type: ignore[attr-defined]
        found = []
        if output.is_dir():
            for entry in output.iterdir():
                match = _CHECKPOINT_FOLDER.match(entry.name)
                if match and entry.is_dir() and not (entry / PENDING_FILE).exists():
                    found.append((int(match.group(1)), entry))
        if not found:
            raise ValueError(f"No valid checkpoint found in output directory ({output})")
        return str(max(found)[1])

    # -- loading --------------------------------------------------------------------------

    def _ink_state(self, checkpoint: Optional[str]) -> Any:
        """The decoded ``inshrinkerator.ink`` of a checkpoint folder, or None if it has none."""
        if checkpoint is None:
            return None
        self._ink_wait()
        path = Path(checkpoint).absolute() / STATE_FILE
        if (path.parent / PENDING_FILE).exists():
            raise CheckpointNotFoundError(
                f"{path.parent}: its checkpoint file was still being written in the background "
                "when the process stopped; resume from an earlier checkpoint-N folder"
            )
        if not path.is_file():
            return None
        if self._ink_loaded[0] != path:
            self._ink_loaded = (path, self._ink_store(path.parent.parent).load(path))
        state = self._ink_loaded[1]
        if not isinstance(state, dict) or "model" not in state:
            raise FormatError(f"{path}: not a Trainer checkpoint (no 'model' entry)")
        return state

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        state = self._ink_state(resume_from_checkpoint)
        if state is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        self._ink_check_supported()
        target = model if model is not None else self.model  # type: ignore[attr-defined]
        result = target.load_state_dict(state["model"], strict=False)
        self._issue_warnings_after_load(result)  # type: ignore[attr-defined]
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        state = self._ink_state(best)
        if state is None:
            return super()._load_best_model()  # type: ignore[misc]
        result = self.model.load_state_dict(state["model"], strict=False)  # type: ignore[attr-defined]
        self._issue_warnings_after_load(result)  # type: ignore[attr-defined]
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        state = self._ink_state(checkpoint)
        if state is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[attr-defined]
        if "scheduler" in state:
            self.lr_scheduler.load_state_dict(state["scheduler"])  # type: ignore[attr-defined]
        return None

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        state = self._ink_state(checkpoint)
        if state is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])
        return None

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        state = self._ink_state(checkpoint)
        if state is None or "rng" not in state:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        _set_rng_state(state["rng"], str(Path(checkpoint or "") / STATE_FILE))
        return None


class InkTrainer(InkTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are compressed (see :class:`InkTrainerMixin`)."""
