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

Single-process and DDP training are supported; DeepSpeed, FSDP, XLA and SageMaker
model parallelism keep their own checkpoint formats and are refused.
"""

from __future__ import annotations

import random
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

from ..errors import FormatError
from ..policies import Policy
from ..store import policy_or_default, watch_with
from ._keyframes import KEYFRAME_DIR, KeyframeStore

__all__ = ["InkTrainerMixin", "InkTrainer", "STATE_FILE"]

#: The file inside each ``checkpoint-N`` folder.
STATE_FILE = "inshrinkerator.ink"


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
    """

    def __init__(
        self, *args: Any, ink_policy: Union[str, Policy, None] = None, ink_full_every: int = 10,
        ink_watch: bool = True, **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(ink_watch, bool):
            raise TypeError(f"ink_watch must be a bool, got {ink_watch!r}")
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
        self._ink_parts = {}
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            self._ink_parts = None
        if self.args.should_save:  # type: ignore[attr-defined]
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
        if self.args.world_size > 1:  # other ranks keep their own rng_state_{i}.pth
            super()._save_rng_state(output_dir)  # type: ignore[misc]
        else:
            self._ink_parts["rng"] = _rng_state()
        self._ink_write(Path(output_dir))
        return None

    def _ink_write(self, folder: Path) -> None:
        parts = self._ink_parts or {}
        self._ink_policy.before_save()  # the training thread: a watching policy hooks unfrozen layers
        self._ink_store(folder.parent.absolute()).save(
            parts, folder / STATE_FILE, step=self.state.global_step  # type: ignore[attr-defined]
        )

    # -- loading --------------------------------------------------------------------------

    def _ink_state(self, checkpoint: Optional[str]) -> Any:
        """The decoded ``inshrinkerator.ink`` of a checkpoint folder, or None if it has none."""
        if checkpoint is None:
            return None
        path = Path(checkpoint).absolute() / STATE_FILE
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
