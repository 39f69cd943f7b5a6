"""``CheckpointManager``: a training run as a chain of full and delta checkpoints."""

from __future__ import annotations

import gc
import operator
import sys
import time
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from .. import policies
from ..errors import BrokenChainError, CheckpointNotFoundError, CorruptCheckpointError
from ..info import SaveInfo
from ..policies import Policy, resolve_policy
from ..serialize import WrittenState, reference_map, write_state
from ..tree import flatten
from .async_worker import BackgroundWorker
from .chain import load_chain, load_step, resolve_chain
from .commit import (
    ensure_run_marker,
    list_steps,
    publish_manifest,
    read_manifest,
    remove_stale,
    write_data,
)
from .manifest import MAX_STEP, StepManifest, manifest_name, utc_now
from .retention import apply_retention
from .snapshot import Snapshot, SpareBuffers, snapshot_state
from .storage import RunLocation, RunStorage, open_storage

__all__ = ["CheckpointManager", "DEFAULT_POLICY_PREFERENCE", "default_policy_name", "policy_or_default"]

#: The manager's default policy is the first of these that is registered: the design's
#: default (dynaquant) as soon as it exists, lossless until then.
DEFAULT_POLICY_PREFERENCE = ("dynaquant", "lossless")


def default_policy_name() -> str:
    """The policy name a :class:`CheckpointManager` uses when none is given."""
    for name in DEFAULT_POLICY_PREFERENCE:
        if name in policies._FACTORIES:
            return name
    return "lossless"


def policy_or_default(policy: Union[str, Policy, None]) -> Policy:
    """The policy object for a name or object; ``None`` means :func:`default_policy_name`."""
    return resolve_policy(default_policy_name() if policy is None else policy)


def watch_with(policy: Policy, model: torch.nn.Module) -> None:
    """Let ``policy`` watch ``model`` if it wants gradients (DynaQuant); others ignore it."""
    hook = getattr(policy, "watch", None)
    if callable(hook):
        hook(model)


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError(f"a step is a non-negative int, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"a step is a non-negative int, got {step!r}") from None
    if not 0 <= value <= MAX_STEP:
        raise ValueError(f"a step is an int in [0, {MAX_STEP}], got {value}")
    return value


def _summarize(steps: list[int]) -> str:
    if not steps:
        return "no steps"
    shown = [str(s) for s in steps] if len(steps) <= 6 else [*map(str, steps[:3]), "...", *map(str, steps[-3:])]
    return f"{len(steps)} steps: {', '.join(shown)}"


def _private_cpu_copy(reconstruction: dict[str, torch.Tensor], inputs: Optional[Any]) -> dict[str, torch.Tensor]:
    """The closed-loop reference, on the CPU, sharing no memory with the caller's tensors.

    A lossless codec's reconstruction *is* the input tensor, which training mutates as
    soon as ``save`` returns; ``inputs`` is that state (``None`` when it is already a
    private snapshot).
    """
    shared: set[int] = set()
    if inputs is not None:
        shared = {leaf.tensor.untyped_storage().data_ptr() for leaf in flatten(inputs).tensors}
    private = {}
    for key, tensor in reconstruction.items():
        if tensor.device.type != "cpu":
            tensor = tensor.detach().to("cpu")
        elif tensor.untyped_storage().data_ptr() in shared:
            tensor = tensor.detach().clone()
        private[key] = tensor
    return private


def _discard_uncommitted(storage: RunStorage, step: int, data_file: str) -> None:
    """Remove the data file of a step whose manifest write failed, unless the manifest landed
    anyway (an object store may apply a write whose reply was lost: the step is then committed
    and needs its data). Any error here leaves the file to the next writer's cleanup, so the
    commit's own error is the one raised."""
    try:
        if manifest_name(step) not in storage.list_names():
            storage.remove(data_file)
    except Exception:  # noqa: BLE001 - cleanup after a failure must not mask it
        pass


#: Memory blocks Python had allocated right after this process's last
#: :func:`collect_setup_garbage` pass (``sys.getallocatedblocks``, a cheap proxy for its objects).
_blocks_after_collection = 0


def collect_setup_garbage() -> bool:
    """One full garbage collection now, before training, if setup has grown the process.

    Objects created during setup (loading a model, tokenizing a corpus) are not yet counted
    as long-lived by Python's collector, so a full pass over the whole process falls due
    soon after; the few allocations of an async save are then enough to start it inside
    ``save``, with the training loop blocked (MiniLM: ~0.1 s over ~290,000 objects,
    ``benchmarks/async_overhead.py``). Paid here, at setup, it is not paid there. The
    collector runs its next full pass once the objects it has not walked yet are a quarter
    of those it has, so this skips the pass (and returns ``False``) while Python holds no
    more than an eighth more memory blocks than right after the last one.
    """
    global _blocks_after_collection
    if sys.getallocatedblocks() - _blocks_after_collection <= _blocks_after_collection // 8:
        return False
    gc.collect()
    _blocks_after_collection = sys.getallocatedblocks()
    return True


class CheckpointManager:
    """A training run in a directory or fsspec URL: full and delta checkpoints, one per step.

    Args:
        path_or_url: local directory, or an fsspec URL (``memory://...``, ``s3://bucket/run``).
            Nothing is created until the first ``save``.
        policy: a policy name, spec (``"dynaquant:tolerance=0.01"``) or object; ``None``
            means :func:`default_policy_name`.
        full_every: a full checkpoint every this many saves (the first save is full); the
            others are deltas against the previous step's *reconstruction* (closed loop:
            lossy error never accumulates along a chain). Bounds every chain's length.
        keep_last: keep only the newest ``keep_last`` steps (``None``: keep all). A kept
            delta whose base would be deleted is first re-based (rewritten as a full
            checkpoint that decodes to the same tensors), so every kept step restores.
        async_save: ``save`` copies the state and returns; compression and writing run on
            one background thread, one save at a time. A background failure is raised
            (as :class:`AsyncSaveError`, chained to its cause) by the next ``save``,
            ``wait`` or ``close``. Construction and :meth:`watch` then run one full pass of
            Python's garbage collector when the process has grown since the last one
            (:func:`collect_setup_garbage`), so that the objects setup left behind (a loaded
            model, a tokenized corpus) are not first walked inside a training step's ``save``.

    Steps only grow: saving a step that exists or is lower than the latest raises
    ``ValueError`` (a run is a history; rewriting the past would orphan later deltas).
    A run has one writer; any number of readers may load it meanwhile and never see a
    partial step. Leftovers of an interrupted save are removed when a manager first
    saves to the run (not when it merely opens it, so a reader never disturbs a writer).

    Example::

        with ink.CheckpointManager("runs/exp1", keep_last=5) as mgr:
            for step in range(steps):
                train_one_step()
                if step % 100 == 0:
                    mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        state = ink.CheckpointManager("runs/exp1").load()
    """

    def __init__(
        self,
        path_or_url: RunLocation,
        policy: Union[str, Policy, None] = None,
        full_every: int = 10,
        keep_last: Optional[int] = None,
        async_save: bool = False,
    ) -> None:
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be an int >= 1, got {full_every!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        self._storage = open_storage(path_or_url)
        self._policy = policy_or_default(policy)
        self.full_every = full_every
        self.keep_last = keep_last
        self._worker = BackgroundWorker() if async_save else None
        self._latest: Optional[StepManifest] = None
        self._latest_known = False
        self._latest_depth = 0
        self._reference: Optional[dict[str, torch.Tensor]] = None
        self._reference_step: Optional[int] = None
        #: a step was loaded since the last save: the next one may hold restored values
        self._loaded = False
        #: fresh buffers for the next async snapshot, made by the worker after a save
        self._spare: Optional[SpareBuffers] = None
        self._writing = False
        self._closed = False
        self._collect_setup_garbage()

    @property
    def location(self) -> str:
        """The run's path or URL, as given."""
        return self._storage.location

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def async_save(self) -> bool:
        return self._worker is not None

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.location!r}, policy={self._policy.name!r}, full_every="
            f"{self.full_every}, keep_last={self.keep_last}, async_save={self.async_save})"
        )

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Any) -> SaveInfo:
        """Save ``state`` as ``step``; returns what was saved.

        With ``async_save`` the returned info is known at snapshot time: ``stored_bytes``
        and ``ratio`` are 0 (nothing is written yet; :meth:`wait` returns the final info)
        and ``seconds`` is the time the caller was blocked.

        Raises:
            ValueError: ``step`` is not above the run's latest step; the manager is closed.
            UnsupportedStateError: the state holds a value that cannot be stored.
            AsyncSaveError: the previous background save failed (this state is not saved).
        """
        started = time.perf_counter()
        self._check_open()
        step = _check_step(step)
        if self._worker is not None:
            self._worker.result()
        # On the caller's (training) thread, with no background save planning.
        self._policy.before_save()
        try:
            latest = self._latest_manifest()
        except Exception as exc:  # reading the run failed (unreachable, damaged): nothing written
            self._note_not_committed(exc, step)
            raise
        if latest is not None and step <= latest.step:
            raise ValueError(
                f"{self.location}: cannot save step {step}: the run's latest step is {latest.step} "
                "and steps only grow (use a new run, or a higher step)"
            )
        base = latest if latest is not None and not self._chain_full() else None
        if base is None and latest is not None and not self._loaded:
            self._policy.new_chain()  # a training state starts the next chain, not restored values
        self._loaded = False
        if self._worker is None:
            info = self._write_step(step, state, base, private=False)
            return SaveInfo(info.step, info.kind, info.raw_bytes, info.stored_bytes, info.ratio,
                            time.perf_counter() - started, info.policy)
        snapshot = snapshot_state(state, self._spare)
        self._spare = None
        raw_bytes = snapshot.raw_bytes
        self._worker.submit(self._background_save(step, snapshot, base), f"saving step {step} to {self.location}")
        kind = "full" if base is None else "delta"
        return SaveInfo(step, kind, raw_bytes, 0, 0.0, time.perf_counter() - started, self._policy.name)

    def _background_save(self, step: int, snapshot: Snapshot, base: Optional[StepManifest]) -> Callable[[], SaveInfo]:
        """The worker's job for one snapshot: write it, then lay out fresh buffers like it for
        the next snapshot to copy into (made after the snapshot is let go, so the two are
        never held at once beyond what the closed-loop reference keeps of it)."""
        held = [snapshot]

        def job() -> SaveInfo:
            taken = held.pop()
            info = self._write_step(step, taken.state, base, private=True)
            layout = SpareBuffers.layout_of(taken.tensors)
            del taken
            self._spare = SpareBuffers(layout)
            return info

        return job

    def _latest_manifest(self) -> Optional[StepManifest]:
        if not self._latest_known:
            steps = list_steps(self._storage)
            self._latest = read_manifest(self._storage, steps[-1]) if steps else None
            self._latest_depth = self._chain_depth(steps[-1]) if steps else 0
            self._latest_known = True
        return self._latest

    def _chain_full(self) -> bool:
        """Whether the next save starts a new chain (a full checkpoint) after the latest step."""
        return self._latest_depth + 1 >= self.full_every or self.keep_last == 1

    def _chain_depth(self, step: int) -> int:
        """Deltas between ``step`` and its full checkpoint; a broken chain counts as too long,
        so the next save is full rather than a delta against something that cannot be read."""
        try:
            return len(resolve_chain(self._storage, step)) - 1
        except BrokenChainError:
            return self.full_every

    def _reference_for(self, base: StepManifest) -> dict[str, torch.Tensor]:
        if self._reference is None or self._reference_step != base.step:
            # Reopened run: the reference is the base step exactly as a reader decodes it.
            self._reference = reference_map(load_step(self._storage, base.step))
            self._reference_step = base.step
        return self._reference

    def _write_step(self, step: int, state: Any, base: Optional[StepManifest], private: bool) -> SaveInfo:
        """Encode, write and commit one step, then apply retention (runs on the worker when async)."""
        started = time.perf_counter()
        try:
            manifest, written = self._commit_step(step, state, base)
        except Exception as exc:
            self._writing = False  # the next save sweeps what this one may have left
            self._note_not_committed(exc, step)
            raise
        storage = self._storage
        delta = manifest.kind == "delta"
        self._latest, self._latest_known = manifest, True
        self._latest_depth = self._latest_depth + 1 if delta else 0
        # The base's reference is done with: free it before copying this step's.
        self._reference = None
        self._reference = _private_cpu_copy(written.reconstruction, None if private else state)
        self._reference_step = step
        try:
            plan = apply_retention(storage, self.keep_last, self._policy)
            if plan.rebase:
                # Re-basing shortened the chain that ends at this step.
                self._latest = read_manifest(storage, step)
                self._latest_depth = self._chain_depth(step)
        except Exception as exc:
            self._writing = False  # e.g. a re-based data file whose manifest failed
            exc.add_note(
                f"step {step} was committed to {self.location}; applying "
                f"keep_last={self.keep_last} failed after the commit (older steps may remain; "
                "the next save applies it again)"
            )
            raise
        return SaveInfo(
            step=step,
            kind=manifest.kind,
            raw_bytes=manifest.raw_bytes,
            stored_bytes=manifest.stored_bytes,
            ratio=manifest.raw_bytes / max(manifest.stored_bytes, 1),
            seconds=time.perf_counter() - started,
            policy=manifest.policy,
        )

    def _note_not_committed(self, exc: BaseException, step: int) -> None:
        exc.add_note(
            f"saving step {step} to {self.location} failed before its commit: the step is not "
            "in the run, and every step committed before it is intact"
        )

    def _commit_step(
        self, step: int, state: Any, base: Optional[StepManifest]
    ) -> tuple[StepManifest, WrittenState]:
        """Write the step's data file, then its manifest (the commit); returns both."""
        storage = self._storage
        if not self._writing:
            names = storage.list_names()
            remove_stale(storage, names)
            ensure_run_marker(storage, names)
            self._writing = True
        references = self._reference_for(base) if base is not None else None
        data_file, written = write_data(
            storage,
            step,
            lambda handle: write_state(
                handle,
                state,
                self._policy,
                references=references,
                reference_name=f"step {base.step}" if base is not None else "base",
                meta={"step": step},
                keep_reconstruction=True,
            ),
        )
        delta = base is not None and written.used_reference
        try:
            manifest = publish_manifest(
                storage,
                StepManifest(
                    step=step,
                    kind="delta" if delta else "full",
                    base_step=base.step if delta and base is not None else None,
                    data_file=data_file,
                    data_bytes=written.stored_bytes,
                    raw_bytes=written.raw_bytes,
                    stored_bytes=0,
                    policy=self._policy.name,
                    created=utc_now(),
                ),
            )
        except BaseException:
            _discard_uncommitted(storage, step, data_file)
            raise
        return manifest, written

    # ----------------------------------------------------------------- reading

    def load(self, step: Optional[int] = None) -> Any:
        """The state saved at ``step`` (the latest step when ``None``), tensors on the CPU.

        Waits for a save in flight first. Reads only the files of that step's chain. A
        step the next save would be a delta against (the run's latest, its chain not
        full) is also kept, as a private copy, for that save (see :meth:`_keep_as_reference`),
        until then or until :meth:`close`.

        Raises:
            CheckpointNotFoundError: no such step, or the run has no step yet.
            BrokenChainError: a base step the step needs is missing.
            CorruptCheckpointError: a file of its chain is damaged.
        """
        self._check_open()
        self._settle()
        steps = list_steps(self._storage)
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"{self.location}: the run has no checkpoint yet")
            step = steps[-1]
        step = _check_step(step)
        try:
            chain, state = self._read_chain(step)
        except CheckpointNotFoundError:
            steps = list_steps(self._storage)
            raise CheckpointNotFoundError(
                f"{self.location}: the run has no step {step} (it holds {_summarize(steps)})"
            ) from None
        except (BrokenChainError, CorruptCheckpointError):
            # A writer's retention may have re-based or deleted the chain while it was
            # being read; the step's manifest then changed: read it once more.
            steps = list_steps(self._storage)
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"{self.location}: step {step} was deleted by retention while it was read"
                ) from None
            chain, state = self._read_chain(step)
        if steps and step == steps[-1]:
            self._keep_as_reference(chain, state)
        self._loaded = True
        return state

    def _read_chain(self, step: int) -> tuple[list[StepManifest], Any]:
        chain = resolve_chain(self._storage, step)
        return chain, load_chain(self._storage, chain)

    def _keep_as_reference(self, chain: list[StepManifest], state: Any) -> None:
        """Note the run's latest step, just loaded through ``chain``, and keep a private copy
        of ``state`` as the next save's closed-loop reference where that save is a delta
        against it (the chain is not full): a resumed run's first save then does not decode
        the whole chain again (on MiniLM's failure runs such a save read it again, about
        0.2 s a step of it). The copy is what a save keeps of its own step anyway; the
        loaded tensors are not it, since an optimizer adopts loaded moments and updates them
        in place. It holds what that read would return, bit for bit: the same files."""
        self._latest, self._latest_known, self._latest_depth = chain[-1], True, len(chain) - 1
        step = chain[-1].step
        if self._chain_full() or self._reference_step == step:
            return
        self._reference = None  # the earlier reference is done with: free it first
        self._reference = {key: tensor.detach().clone() for key, tensor in reference_map(state).items()}
        self._reference_step = step

    def steps(self) -> list[int]:
        """The committed steps, ascending (waits for a save in flight first)."""
        self._check_open()
        self._settle()
        return list_steps(self._storage)

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or ``None`` for an empty run."""
        steps = self.steps()
        return steps[-1] if steps else None

    # --------------------------------------------------------------- lifecycle

    def wait(self) -> Optional[SaveInfo]:
        """Wait for the save in flight; return its final info (``None`` if none was in flight).

        Raises:
            AsyncSaveError: it failed (chained to the original exception).
        """
        self._check_open()
        return self._worker.result() if self._worker is not None else None

    def close(self) -> None:
        """Finish the save in flight and stop the worker; idempotent.

        Raises:
            AsyncSaveError: the save in flight failed.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._worker is not None:
                try:
                    self._worker.result()
                finally:
                    self._worker.shutdown()
                    self._spare = None
        finally:
            # A closed manager saves nothing more: the reference (a state's worth of memory,
            # kept by the last save or a load of the latest step) is let go.
            self._reference, self._reference_step = None, None

    def watch(self, model: torch.nn.Module) -> None:
        """Let a policy that wants gradients see ``model`` (a no-op for other policies)."""
        watch_with(self._policy, model)
        self._collect_setup_garbage()

    def _collect_setup_garbage(self) -> None:
        if self._worker is not None:
            collect_setup_garbage()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _settle(self) -> None:
        if self._worker is not None:
            self._worker.settle()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.location}: the CheckpointManager is closed")
