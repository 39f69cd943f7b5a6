"""The keyframe store: checkpoints a framework names and deletes, each restoring on its own."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inshrinkerator as ink
from inshrinkerator.integrations import _keyframes as keyframes_module
from inshrinkerator.integrations._keyframes import KEYFRAME_DIR, KeyframeStore, keyframe_of
from inshrinkerator.single_file import open_container
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


def _keyframe_named_by(path: Path) -> str:
    with open_container(str(path)) as reader:
        return str(keyframe_of(reader))


@pytest.mark.parametrize("policy", ["lossless", "dynaquant"])
def test_a_new_store_goes_on_with_the_keyframe_of_a_checkpoint_it_loads(tmp_path: Path, policy: str) -> None:
    first = KeyframeStore(tmp_path / KEYFRAME_DIR, policy, full_every=10)
    for step in range(3):
        first.save(_state(step), tmp_path / f"{step}.ckpt")
    (keyframe,) = _keyframes(tmp_path / KEYFRAME_DIR)
    resumed = KeyframeStore(tmp_path / KEYFRAME_DIR, policy, full_every=10)  # a restarted process
    loaded = resumed.load(tmp_path / "2.ckpt")
    infos = [resumed.save(_state(step), tmp_path / f"{step}.ckpt") for step in (3, 4)]
    assert _keyframes(tmp_path / KEYFRAME_DIR) == [keyframe]  # no second full checkpoint
    assert all(_keyframe_named_by(tmp_path / f"{step}.ckpt") == keyframe for step in (3, 4))
    fresh = KeyframeStore(tmp_path / KEYFRAME_DIR)
    for step in range(5):
        restored = fresh.load(tmp_path / f"{step}.ckpt")
        if policy == "lossless":
            assert_same(restored, _state(step))
        else:  # the deltas stay against the keyframe as decoded: no error adds up
            error = (restored["model"]["w"] - _state(step)["model"]["w"]).norm() / _state(step)["model"]["w"].norm()
            assert error < 0.05
            assert restored["step"] == step and torch.equal(restored["rng"], _state(step)["rng"])
    # Against a new keyframe the first save would have stored a full checkpoint too.
    fresh_keyframe = KeyframeStore(tmp_path / "elsewhere" / KEYFRAME_DIR, policy).save(
        _state(3), tmp_path / "elsewhere" / "3.ckpt")
    assert infos[0].stored_bytes < fresh_keyframe.stored_bytes
    assert_same(loaded, fresh.load(tmp_path / "2.ckpt"))


def test_a_taken_over_keyframe_is_not_changed_by_training_the_loaded_state(tmp_path: Path) -> None:
    KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless").save(_state(0), tmp_path / "a.ckpt")
    resumed = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless")
    state = resumed.load(tmp_path / "a.ckpt")
    state["model"]["w"].add_(1.0)  # an optimizer updates what it loaded in place
    state["model"]["b"].mul_(3.0).add_(2.0)
    resumed.save(state, tmp_path / "b.ckpt")
    state["model"]["w"].add_(1.0)
    resumed.save(state, tmp_path / "c.ckpt")
    fresh = KeyframeStore(tmp_path / KEYFRAME_DIR)
    assert_same(fresh.load(tmp_path / "a.ckpt"), _state(0))
    expected = _state(0)
    expected["model"]["w"].add_(1.0)
    expected["model"]["b"].mul_(3.0).add_(2.0)
    assert_same(fresh.load(tmp_path / "b.ckpt"), expected)
    expected["model"]["w"].add_(1.0)
    assert_same(fresh.load(tmp_path / "c.ckpt"), expected)


def test_a_taken_over_keyframe_counts_the_saves_it_had_towards_full_every(tmp_path: Path) -> None:
    KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=3).save(_state(0), tmp_path / "0.ckpt")
    store = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=3)
    store.save(_state(1), tmp_path / "1.ckpt")  # a store that saves first makes its own keyframe
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) == 2
    resumed = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=3)
    resumed.load(tmp_path / "1.ckpt")
    (tmp_path / "0.ckpt").unlink()  # its keyframe is no longer needed
    resumed.save(_state(2), tmp_path / "2.ckpt")  # 2nd against 1.ckpt's keyframe; the other is collected
    assert _keyframes(tmp_path / KEYFRAME_DIR) == [_keyframe_named_by(tmp_path / "1.ckpt")]
    resumed.save(_state(3), tmp_path / "3.ckpt")  # 3rd
    resumed.save(_state(4), tmp_path / "4.ckpt")  # the 4th would exceed full_every: a new keyframe
    assert _keyframe_named_by(tmp_path / "3.ckpt") == _keyframe_named_by(tmp_path / "1.ckpt")
    assert _keyframe_named_by(tmp_path / "4.ckpt") != _keyframe_named_by(tmp_path / "1.ckpt")


def test_a_checkpoint_without_a_recorded_count_counts_the_checkpoints_of_its_keyframe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyframes_module, "_SAVES_KEY", "unrecorded")  # as files written before the count
    old = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=3)
    for step in range(2):
        old.save(_state(step), tmp_path / f"{step}.ckpt")
    monkeypatch.undo()
    resumed = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=3)
    resumed.load(tmp_path / "1.ckpt")
    resumed.save(_state(2), tmp_path / "2.ckpt")  # the 3rd against it
    resumed.save(_state(3), tmp_path / "3.ckpt")
    assert _keyframe_named_by(tmp_path / "2.ckpt") == _keyframe_named_by(tmp_path / "0.ckpt")
    assert _keyframe_named_by(tmp_path / "3.ckpt") != _keyframe_named_by(tmp_path / "0.ckpt")


def test_a_store_keeps_its_own_keyframe_and_never_takes_one_from_another_folder(tmp_path: Path) -> None:
    other = tmp_path / "other"
    KeyframeStore(other / KEYFRAME_DIR, "lossless").save(_state(0), other / "a.ckpt")
    here = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless")
    assert_same(here.load(other / "a.ckpt"), _state(0))  # loadable, but another run's keyframe
    here.save(_state(1), tmp_path / "b.ckpt")
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) == 1
    assert _keyframe_named_by(tmp_path / "b.ckpt") != _keyframe_named_by(other / "a.ckpt")
    # A store that already has a keyframe goes on with it after loading an older checkpoint.
    KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless").save(_state(2), tmp_path / "c.ckpt")
    here.load(tmp_path / "c.ckpt")
    here.save(_state(3), tmp_path / "d.ckpt")
    assert _keyframe_named_by(tmp_path / "d.ckpt") == _keyframe_named_by(tmp_path / "b.ckpt")
    assert_same(KeyframeStore(tmp_path / KEYFRAME_DIR).load(tmp_path / "d.ckpt"), _state(3))


def test_a_next_keyframe_starts_a_new_chain_unless_a_checkpoint_was_just_loaded(tmp_path: Path) -> None:
    from tests.store.test_manager import _ChainCounting

    policy = _ChainCounting()
    store = KeyframeStore(tmp_path / KEYFRAME_DIR, policy, full_every=2)
    for step in range(3):  # keyframes at the first and third saves
        store.save(_state(step), tmp_path / f"{step}.ckpt")
    assert policy.new_chains == 1  # the third; not the store's first
    store.save(_state(3), tmp_path / "3.ckpt")
    store.load(tmp_path / "3.ckpt")  # restored values: the next keyframe keeps what it chose
    store.save(_state(4), tmp_path / "4.ckpt")
    assert policy.new_chains == 1
    store.save(_state(5), tmp_path / "5.ckpt")
    store.save(_state(6), tmp_path / "6.ckpt")
    assert policy.new_chains == 2
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) >= 2


def test_a_remove_during_a_save_of_the_same_path_keeps_the_keyframe_that_save_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # AsyncCheckpointIO saves on its own thread while the framework removes on the main one:
    # a remove of a path whose next save is being written must leave that save's keyframe.
    import threading

    store = KeyframeStore(tmp_path / KEYFRAME_DIR, "lossless", full_every=3)
    store.save(_state(0), tmp_path / "last.ckpt")
    store.save(_state(1), tmp_path / "last.ckpt")
    writing, removed = threading.Event(), threading.Event()
    real_write = keyframes_module._write_whole

    def slow_write(target, write):  # the save's file lands only after the remove
        if Path(str(target)).name == "last.ckpt":
            writing.set()
            assert removed.wait(10)
        return real_write(target, write)

    monkeypatch.setattr(keyframes_module, "_write_whole", slow_write)
    saving = threading.Thread(target=store.save, args=(_state(2), tmp_path / "last.ckpt"))
    saving.start()
    assert writing.wait(10)
    store.remove(tmp_path / "last.ckpt")
    removed.set()
    saving.join(10)
    monkeypatch.setattr(keyframes_module, "_write_whole", real_write)
    store.save(_state(3), tmp_path / "epoch=0.ckpt")  # a new keyframe: the old one is collected if unneeded
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) == 2
    assert_same(KeyframeStore(tmp_path / KEYFRAME_DIR).load(tmp_path / "last.ckpt"), _state(2))
    store.remove(tmp_path / "last.ckpt")
    assert len(_keyframes(tmp_path / KEYFRAME_DIR)) == 1
