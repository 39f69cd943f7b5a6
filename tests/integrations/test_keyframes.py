"""The keyframe store: checkpoints a framework names and deletes, each restoring on its own."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inshrinkerator as ink
from inshrinkerator.integrations._keyframes import KEYFRAME_DIR, KeyframeStore
from tests.helpers import assert_same


def _state(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    weight = torch.randn(64, 32, generator=generator) * 0.02
    return {"model": {"w": weight, "b": torch.zeros(32)}, "step": step,
            "rng": torch.randint(0, 255, (40,), dtype=torch.uint8, generator=generator)}


def _keyframes(root: Path) -> list[str]:
    return sorted(p.stem for p in root.glob("*.ink"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    full_every=st.integers(1, 4),
    count=st.integers(1, 8),
    deletions=st.lists(st.integers(0, 7), max_size=8),
)
def test_any_deletion_order_leaves_every_kept_checkpoint_restorable(
    tmp_path_factory: pytest.TempPathFactory, full_every: int, count: int, deletions: list[int]
) -> None:
    folder = tmp_path_factory.mktemp("run")
    store = KeyframeStore(folder / KEYFRAME_DIR, "lossless", full_every=full_every)
    states = {i: _state(i) for i in range(count)}
    for i, state in states.items():
        store.save(state, folder / f"{i}.ckpt", step=i)
    kept = set(states)
    for i in deletions:
        if i in kept:
            store.remove(folder / f"{i}.ckpt")
            kept.discard(i)
    fresh = KeyframeStore(folder / KEYFRAME_DIR, "lossless")  # a new process
    for i in kept:
        assert_same(fresh.load(folder / f"{i}.ckpt"), states[i])
    # No keyframe outlives every checkpoint that needs it (the current one excepted).
    assert len(_keyframes(folder / KEYFRAME_DIR)) <= len(kept) + 1


def test_deltas_are_taken_against_a_copy_of_the_keyframe_not_the_live_tensors(tmp_path: Path) -> None:
    store = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=5)
    weight = torch.ones(128, 8)
    store.save({"w": weight}, tmp_path / "a.ckpt")
    weight.add_(0.5)  # training mutates the tensors in place after a save
    store.save({"w": weight}, tmp_path / "b.ckpt")
    fresh = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless")
    assert torch.equal(fresh.load(tmp_path / "a.ckpt")["w"], torch.ones(128, 8))
    assert torch.equal(fresh.load(tmp_path / "b.ckpt")["w"], torch.full((128, 8), 1.5))


def test_collect_after_the_framework_deletes_folders_itself(tmp_path: Path) -> None:
    store = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=2)
    for step in range(6):
        store.save(_state(step), tmp_path / f"checkpoint-{step}" / "state.ink")
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) == 3
    for step in range(4):  # like save_total_limit's shutil.rmtree
        shutil.rmtree(tmp_path / f"checkpoint-{step}")
    store.collect()
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) == 1
    for step in (4, 5):
        assert_same(KeyframeStore(tmp_path / KEYFRAME_DIR).load(tmp_path / f"checkpoint-{step}" / "state.ink"),
                    _state(step))


def test_overwriting_a_path_releases_its_old_keyframe(tmp_path: Path) -> None:
    store = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=1)
    for step in range(4):  # like last.ckpt, rewritten every time
        store.save(_state(step), tmp_path / "last.ckpt")
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) == 1
    assert_same(store.load(tmp_path / "last.ckpt"), _state(3))


def test_a_keyframe_deleted_by_hand_is_a_broken_chain_naming_it(tmp_path: Path) -> None:
    store = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=3)
    store.save(_state(0), tmp_path / "a.ckpt")
    store.save(_state(1), tmp_path / "b.ckpt")
    for keyframe in (tmp_path / KEYFRAME_DIR).glob("*.ink"):
        keyframe.unlink()
    with pytest.raises(ink.BrokenChainError, match="keyframe"):
        KeyframeStore(tmp_path / KEYFRAME_DIR).load(tmp_path / "b.ckpt")


def test_a_plain_ink_file_loads_too(tmp_path: Path) -> None:
    ink.save(_state(3), tmp_path / "plain.ink")
    assert_same(KeyframeStore(tmp_path / KEYFRAME_DIR).load(tmp_path / "plain.ink"), _state(3))


def test_missing_checkpoint_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ink.CheckpointNotFoundError):
        KeyframeStore(tmp_path / KEYFRAME_DIR).load(tmp_path / "nope.ckpt")


def test_full_every_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="full_every"):
        KeyframeStore(tmp_path, "lossless", full_every=0)
