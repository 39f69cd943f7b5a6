"""Random saves, overwrites, removals and restarts through Lightning's ``InkCheckpointIO``.

What ``ModelCheckpoint`` does to a folder, in random order: save checkpoints of the
random training states of ``tests/policies/random_states.py`` under a few names
(``last.ckpt`` is saved over again and again), remove some (``save_top_k``), load some,
and restart (a new plugin, as a resumed run has), perhaps with ``async_save=True`` or
behind ``AsyncCheckpointIO``, in a local folder or a ``memory://`` one (an fsspec store),
and in a few runs on a moto S3 server.
After every restart and at the end:

- every checkpoint on disk restores, by a fresh plugin, what was last saved under its
  name (lossless: exactly; DynaQuant: within the bounds of ``test_random_states.py``;
  the baselines: the structural checks), and a removed one is ``FileNotFoundError``;
- the keyframe folder holds no keyframe that no checkpoint needs, beyond the current
  keyframe of the plugin that wrote last (``AsyncCheckpointIO.teardown`` does not tear
  down the plugin it wraps).

With ``async_save=True`` everything is exact: a removal of the save in flight waits for
it, any other removal (of a name with no file too) leaves later saves alone, and a load
waits for the save in flight. Behind ``AsyncCheckpointIO`` a removal runs on the training thread while saves wait in
its queue, so removing a name whose save is still queued may leave that save's file
(Lightning's order, whatever the plugin); the test then accepts either. Removing a name
that has neither a file nor a queued save marks its next save as removed there (the plugin
cannot see AsyncCheckpointIO's queue): those stories remove nothing then.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from lightning_utilities.core.apply_func import apply_to_collection  # noqa: E402

from inshrinkerator.integrations._keyframes import (  # noqa: E402
    KEYFRAME_DIR,
    exists,
    join,
    location,
    names_in,
    remove_folder,
)
from inshrinkerator.integrations.lightning import InkCheckpointIO  # noqa: E402
from inshrinkerator.single_file import open_container  # noqa: E402
from tests.policies.dynaquant_states import one_thread  # noqa: E402,F401  (autouse fixture)
from tests.policies.random_states import (  # noqa: E402
    DAMAGES,
    LONG,
    POLICIES,
    Damage,
    Save,
    Scenario,
    Trainer,
    clone,
    fuzz_settings,
    identical,
    policy_named,
    problems,
    scenarios,
    variant_lists,
)

pytestmark = [pytest.mark.timeout(0)] if LONG else []

NAMES = ("last.ckpt", "last.ckpt", "epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt")
_folders = itertools.count()


@dataclass(frozen=True)
class Op:
    kind: str  # "save", "remove", "load" or "restart"
    name: str
    plan: Save


@dataclass(frozen=True)
class Story:
    scenario: Scenario
    policy: str
    variants: tuple[str, ...]
    full_every: int
    mode: str  # "sync", "async_save" (the plugin's own thread) or "wrapped" (AsyncCheckpointIO)
    in_memory: bool  # a memory:// folder instead of a local one
    ops: tuple[Op, ...]

    @property
    def queued(self) -> bool:
        """Saves wait in AsyncCheckpointIO's queue, out of the plugin's sight."""
        return self.mode == "wrapped"


def stories() -> st.SearchStrategy[Story]:
    damage = st.builds(Damage, st.sampled_from(["weight", "moment"]), st.sampled_from(DAMAGES), st.integers(0, 20))
    plan = st.builds(Save, st.integers(1, 6), st.one_of(st.none(), st.none(), st.none(), damage))
    op = st.builds(Op, st.sampled_from(["save", "save", "save", "remove", "load", "restart"]), st.sampled_from(NAMES), plan)
    return st.builds(
        Story,
        scenario=scenarios(),
        policy=st.sampled_from(POLICIES),
        variants=variant_lists(),
        full_every=st.sampled_from([1, 2, 3, 10]),
        mode=st.sampled_from(["sync", "async_save", "wrapped"]),
        in_memory=st.booleans(),
        ops=st.lists(op, min_size=2, max_size=12).map(tuple),
    )


def check_folder(story: Story, folder: str, saved: dict[str, Any], maybe: dict[str, Any], current_keyframe: Any) -> None:
    """Every checkpoint restores what its name last held (``maybe``: a removal raced that
    save; the file may be there or not); no keyframe is left unneeded. Settles ``maybe``."""
    reader = InkCheckpointIO()
    needed = set()
    for name in sorted(set(NAMES)):
        path = join(folder, name)
        if name in maybe and exists(path):
            saved[name] = maybe[name]
        if name not in saved:
            assert not exists(path), name
            with pytest.raises(FileNotFoundError):
                reader.load_checkpoint(path)
            continue
        restored = reader.load_checkpoint(path)
        if story.policy == "lossless":
            assert identical(saved[name], restored), name
        else:
            bounded = story.policy == "dynaquant" and "evaluate" not in story.variants
            found = problems(saved[name], restored, bounded=bounded)
            assert found == [], f"{name}: {found}"
        with open_container(path) as container:
            needed.add(container.meta.get("keyframe"))
    maybe.clear()
    kept = {name[: -len(".ink")] for name in names_in(join(folder, KEYFRAME_DIR)) if name.endswith(".ink")}
    assert kept <= needed | {current_keyframe}, f"keyframes {sorted(kept - needed)} are needed by no checkpoint"


@fuzz_settings(25)
@given(story=stories())
def test_random_checkpoints_through_lightnings_checkpoint_io(story: Story, tmp_path_factory: Any) -> None:
    if story.in_memory:
        folder = f"memory://lightning-io-{next(_folders)}"
    else:
        folder = location(tmp_path_factory.mktemp("lightning"))
    try:
        run_story(story, folder)
    finally:
        if story.in_memory:
            remove_folder(folder)


@(pytest.mark.timeout(0) if LONG else pytest.mark.usefixtures())
@fuzz_settings(3, share=10)
@given(story=stories())
def test_random_checkpoints_on_s3(s3_bucket: str, story: Story) -> None:
    """The same stories in folders on the moto S3 server (listings cached by s3fs, uploads
    instead of renames)."""
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    folder = f"{s3_bucket}/lightning-io-{next(_folders)}"
    try:
        run_story(story, folder)
    finally:
        remove_folder(folder)


def run_story(story: Story, folder: str) -> None:
    trainer = Trainer(story.scenario)

    def new_io() -> tuple[InkCheckpointIO, Any]:
        ink_io = InkCheckpointIO(policy_named(story.policy, story.variants), full_every=story.full_every,
                                 async_save=story.mode == "async_save")
        if story.scenario.watch:
            ink_io.watch(trainer.model)
        return ink_io, AsyncCheckpointIO(ink_io) if story.queued else ink_io

    def current_keyframe(ink_io: InkCheckpointIO) -> Any:
        store = ink_io._stores.get(folder)
        return store._keyframe if store is not None else None

    ink_io, io = new_io()
    saved: dict[str, Any] = {}
    maybe: dict[str, Any] = {}  # removed while their save may have been queued
    queued: set[str] = set()  # saved since the queue last drained
    writer = ink_io

    def drain() -> Any:
        """Tear the plugin down as Lightning does; the current keyframe it leaves (behind
        AsyncCheckpointIO, once the queued saves landed; the plugin's own teardown leaves none)."""
        keyframe = current_keyframe(writer) if story.mode == "sync" else None
        io.teardown()
        queued.clear()
        return current_keyframe(writer) if story.mode != "sync" else keyframe

    for op in story.ops:
        path = join(folder, op.name)
        if op.kind == "save":
            state = trainer.train(op.plan)
            checkpoint = {"state_dict": state["model"], "optimizer_states": [state["optimizer"]],
                          "global_step": state["step"], "epoch": 0}
            io.save_checkpoint(checkpoint, path)
            # What is stored is what was copied before save_checkpoint returned (training
            # goes on mutating the tensors): by the plugin, tied tensors staying one; by
            # AsyncCheckpointIO, one tensor at a time.
            if story.mode == "async_save":
                saved[op.name] = clone(checkpoint)
            elif story.mode == "wrapped":
                saved[op.name] = apply_to_collection(checkpoint, torch.Tensor, torch.clone)
            else:
                saved[op.name] = checkpoint
            maybe.pop(op.name, None)
            queued.add(op.name)
            writer = ink_io
        elif op.kind == "remove":
            if story.queued and op.name not in queued and not exists(path):
                continue  # would mark the name's next save as removed: see InkCheckpointIO
            io.remove_checkpoint(path)
            if story.queued and op.name in queued and op.name in saved:
                maybe[op.name] = saved[op.name]
            saved.pop(op.name, None)
        elif op.kind == "load" and not story.queued:
            if op.name in saved:
                assert problems(saved[op.name], io.load_checkpoint(path), bounded=False) == []
            else:
                with pytest.raises(FileNotFoundError):
                    io.load_checkpoint(path)
        elif op.kind == "restart":
            check_folder(story, folder, saved, maybe, drain())
            ink_io, io = new_io()
    check_folder(story, folder, saved, maybe, drain())
