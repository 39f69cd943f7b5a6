"""Lightning: InkCheckpointIO with ModelCheckpoint (top-k deletions), AsyncCheckpointIO, resume."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("sklearn")

import inshrinkerator as ink  # noqa: E402
from inshrinkerator.integrations._keyframes import KEYFRAME_DIR  # noqa: E402
from inshrinkerator.integrations.lightning import InkCheckpointIO, InkWatch  # noqa: E402
from tests.helpers import assert_same  # noqa: E402
from tests.integrations.conftest import (  # noqa: E402
    EXAMPLES,
    load_example,
    policies_under_test,
    run_torchrun,
    tolerance,
)
from tests.integrations.test_keyframes import _keyframe_named_by, _state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference run, with Lightning's own torch.save checkpoints (saving never changes
    the training, so one reference serves every policy)."""
    return load_example("lightning_digits").run(tmp_path_factory.mktemp("default"), epochs=4, default_io=True)


def _resume_in_new_process(out: Path, policy: str) -> dict:
    finished = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_digits.py"), "--out", str(out),
         "--epochs", "4", "--resume", "last", "--policy", policy],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("policy", policies_under_test())
def test_resume_ends_where_the_uninterrupted_run_ends(tmp_path: Path, policy: str, uninterrupted: dict) -> None:
    example = load_example("lightning_digits")
    # Saves on the plugin's own thread (lossless) or behind AsyncCheckpointIO (the lossy one).
    first = example.run(tmp_path, epochs=2, policy=policy, use_async=policy == "lossless",
                        wrap_async=policy != "lossless")
    assert first["global_step"] < uninterrupted["global_step"]
    assert len(first["checkpoints"]) == 2  # save_top_k deleted the older ones
    resumed_from = max(tmp_path.glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    keyframe = _keyframe_named_by(resumed_from)
    if policy == "lossless":  # a real restart; lossy policies resume in this process (time budget)
        resumed = _resume_in_new_process(tmp_path, policy)
    else:
        resumed = example.run(tmp_path, epochs=4, resume="last", policy=policy)
    assert resumed["global_step"] == uninterrupted["global_step"]
    assert abs(resumed["loss"] - uninterrupted["loss"]) <= tolerance(policy) * uninterrupted["loss"]
    # Every checkpoint Lightning kept restores, whatever top-k deleted.
    io = InkCheckpointIO()
    for name in resumed["checkpoints"]:
        restored = io.load_checkpoint(tmp_path / name)
        assert "state_dict" in restored and "optimizer_states" in restored
        # 2 + 2 saves under full_every=4: the resumed run went on with the loaded keyframe.
        assert _keyframe_named_by(tmp_path / name) == keyframe
    assert [p.stem for p in (tmp_path / KEYFRAME_DIR).glob("*.ink")] == [keyframe]
    print(f"lightning digits [{policy}]: {len(resumed['checkpoints'])} checkpoints + keyframes "
          f"{resumed['stored_bytes']} B; torch.save {uninterrupted['stored_bytes']} B")


def test_removed_checkpoints_never_orphan_the_kept_ones(tmp_path: Path) -> None:
    io = InkCheckpointIO(policy="lossless", full_every=3)
    states = {step: _state(step) for step in range(1, 8)}
    for step, state in states.items():
        io.save_checkpoint(state, tmp_path / f"step={step}.ckpt")
    for step in (1, 2, 4, 5):  # keyframes and deltas alike
        io.remove_checkpoint(tmp_path / f"step={step}.ckpt")
    fresh = InkCheckpointIO()
    for step in (3, 6, 7):
        assert_same(fresh.load_checkpoint(tmp_path / f"step={step}.ckpt"), states[step])
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["step=3.ckpt", "step=6.ckpt", "step=7.ckpt"]


def _on_another_thread(run) -> None:
    """As AsyncCheckpointIO runs a queued save: on its worker thread."""
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()


def test_a_checkpoint_removed_before_its_queued_save_ran_is_deleted_when_it_lands(tmp_path: Path) -> None:
    io = InkCheckpointIO(policy="lossless")
    io.remove_checkpoint(tmp_path / "late.ckpt")  # AsyncCheckpointIO: removal overtook the save
    _on_another_thread(lambda: io.save_checkpoint(_state(0), tmp_path / "late.ckpt"))
    assert not (tmp_path / "late.ckpt").exists()
    _on_another_thread(lambda: io.save_checkpoint(_state(0), tmp_path / "late.ckpt"))  # a later save is kept
    assert (tmp_path / "late.ckpt").exists()


def test_a_save_after_a_removal_on_the_same_thread_is_kept(tmp_path: Path) -> None:
    """Without a queue, a save that follows a removal of its (missing) path comes after it."""
    io = InkCheckpointIO(policy="lossless")
    io.remove_checkpoint(tmp_path / "last.ckpt")  # nothing there yet
    io.save_checkpoint(_state(1), tmp_path / "last.ckpt")
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "last.ckpt"), _state(1))
    io.save_checkpoint(_state(2), tmp_path / "last.ckpt")
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "last.ckpt"), _state(2))


def test_no_keyframe_outlives_the_checkpoints_that_need_it(tmp_path: Path) -> None:
    keyframes = tmp_path / KEYFRAME_DIR
    io = InkCheckpointIO(policy="lossless")
    io.save_checkpoint(_state(1), tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert len(list(keyframes.glob("*.ink"))) == 1  # the current keyframe, for the next save
    io.teardown()  # the end of fit(): nothing needs it any more
    assert list(keyframes.glob("*.ink")) == []
    # A plugin that was never torn down (AsyncCheckpointIO does not tear down what it wraps,
    # or the process died) leaves its keyframe; the next plugin's first save deletes it.
    left = InkCheckpointIO(policy="lossless")
    left.save_checkpoint(_state(1), tmp_path / "a.ckpt")
    left.remove_checkpoint(tmp_path / "a.ckpt")
    (orphan,) = keyframes.glob("*.ink")
    kept = InkCheckpointIO(policy="lossless", full_every=1)
    kept.save_checkpoint(_state(2), tmp_path / "b.ckpt")
    assert not orphan.exists() and len(list(keyframes.glob("*.ink"))) == 1
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "b.ckpt"), _state(2))


class _HeldSaves:
    """Holds every keyframe store's save until ``release``: a save stays in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from inshrinkerator.integrations._keyframes import KeyframeStore

        self.started = threading.Event()
        self.go = threading.Event()
        self.fail: Optional[BaseException] = None
        original = KeyframeStore.save

        def held(store, *args, **kwargs):
            self.started.set()
            assert self.go.wait(30), "the test never released the save"
            if self.fail is not None:
                raise self.fail
            return original(store, *args, **kwargs)

        monkeypatch.setattr(KeyframeStore, "save", held)

    def release(self) -> None:
        self.go.set()


def test_async_save_stores_the_checkpoint_as_it_was_when_save_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = _HeldSaves(monkeypatch)
    io = InkCheckpointIO(policy="lossless", async_save=True)
    checkpoint = _state(1)
    expected = {"model": {k: v.clone() for k, v in checkpoint["model"].items()}, "step": 1,
                "rng": checkpoint["rng"].clone()}
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")  # returns with the save held
    assert held.started.wait(30) and not (tmp_path / "a.ckpt").exists()
    checkpoint["model"]["w"].add_(1.0)  # training goes on in place
    checkpoint["rng"].zero_()
    held.release()
    io.teardown()  # waits for it
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "a.ckpt"), expected)


def test_async_save_removing_the_save_in_flight_deletes_it_once_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = _HeldSaves(monkeypatch)
    io = InkCheckpointIO(policy="lossless", async_save=True)
    io.save_checkpoint(_state(1), tmp_path / "a.ckpt")
    assert held.started.wait(30)
    io.remove_checkpoint(tmp_path / "a.ckpt")  # returns at once: the save is still held
    held.release()
    io.wait()
    assert not (tmp_path / "a.ckpt").exists()
    io.save_checkpoint(_state(2), tmp_path / "a.ckpt")  # a later save to the same path is kept
    io.teardown()
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "a.ckpt"), _state(2))


def test_async_save_a_checkpoint_replaced_by_the_save_in_flight_goes_only_once_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ModelCheckpoint(save_top_k=1) asks for the new checkpoint, then removes the old one: a
    crash before the new one lands must leave the old one."""
    io = InkCheckpointIO(policy="lossless", async_save=True)
    io.save_checkpoint(_state(1), tmp_path / "old.ckpt")
    io.wait()
    held = _HeldSaves(monkeypatch)
    io.save_checkpoint(_state(2), tmp_path / "new.ckpt")
    assert held.started.wait(30)
    io.remove_checkpoint(tmp_path / "old.ckpt")
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "old.ckpt"), _state(1))  # still there
    held.release()
    io.wait()
    assert not (tmp_path / "old.ckpt").exists()
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "new.ckpt"), _state(2))
    # If the new one fails, the old one stays.
    held.go.clear()
    held.started.clear()
    held.fail = OSError("disk full")
    io.save_checkpoint(_state(3), tmp_path / "newer.ckpt")
    assert held.started.wait(30)
    io.remove_checkpoint(tmp_path / "new.ckpt")
    held.release()
    with pytest.raises(ink.AsyncSaveError, match="newer.ckpt"):
        io.wait()
    assert_same(InkCheckpointIO().load_checkpoint(tmp_path / "new.ckpt"), _state(2))
    assert not (tmp_path / "newer.ckpt").exists()
    io.teardown()


def test_async_save_keeps_a_save_after_a_removal_of_a_missing_path(tmp_path: Path) -> None:
    """The case behind AsyncCheckpointIO loses (its queue is out of sight): here the plugin
    knows no save was in flight, so the removal concerned nothing."""
    io = InkCheckpointIO(policy="lossless", async_save=True)
    io.save_checkpoint(_state(1), tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")  # nothing there, nothing queued
    io.save_checkpoint(_state(2), tmp_path / "b.ckpt")
    assert_same(io.load_checkpoint(tmp_path / "b.ckpt"), _state(2))  # a load waits for the save
    io.teardown()
    for step, name in ((1, "a.ckpt"), (2, "b.ckpt")):
        assert_same(InkCheckpointIO().load_checkpoint(tmp_path / name), _state(step))


def test_async_save_a_failed_save_is_raised_at_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = _HeldSaves(monkeypatch)
    held.fail = OSError("disk full")
    held.release()
    io = InkCheckpointIO(policy="lossless", async_save=True)
    io.save_checkpoint(_state(1), tmp_path / "a.ckpt")
    with pytest.raises(ink.AsyncSaveError, match="a.ckpt") as raised:
        io.save_checkpoint(_state(2), tmp_path / "b.ckpt")
    assert isinstance(raised.value.__cause__, OSError)
    assert not (tmp_path / "b.ckpt").exists()  # the save that raised was not started
    held.fail = None
    io.save_checkpoint(_state(3), tmp_path / "c.ckpt")  # the failure was reported once
    io.wait()
    held.fail = OSError("disk full again")
    io.save_checkpoint(_state(4), tmp_path / "d.ckpt")
    with pytest.raises(ink.AsyncSaveError, match="d.ckpt"):
        io.teardown()  # the end of fit() reports it too
    held.fail = None
    io.save_checkpoint(_state(5), tmp_path / "e.ckpt")  # a torn-down plugin saves again (fit again)
    io.teardown()
    for step, name in ((3, "c.ckpt"), (5, "e.ckpt")):
        assert_same(InkCheckpointIO().load_checkpoint(tmp_path / name), _state(step))
    assert not (tmp_path / "d.ckpt").exists()
    with pytest.raises(TypeError, match="async_save"):
        InkCheckpointIO(async_save="yes")  # type: ignore[arg-type]


def test_load_moves_to_map_location_and_refuses_missing_files(tmp_path: Path) -> None:
    io = InkCheckpointIO(policy="lossless")
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 4}, tmp_path / "a.ckpt")
    loaded = io.load_checkpoint(tmp_path / "a.ckpt", map_location="cpu")
    assert loaded["global_step"] == 4 and loaded["state_dict"]["w"].device.type == "cpu"
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError):
        io.save_checkpoint({}, tmp_path / "b.ckpt", storage_options={"x": 1})


def test_a_value_that_cannot_be_stored_names_its_key(tmp_path: Path) -> None:
    with pytest.raises(ink.UnsupportedStateError, match="hyper_parameters/fn"):
        InkCheckpointIO(policy="lossless").save_checkpoint(
            {"hyper_parameters": {"fn": object()}}, tmp_path / "bad.ckpt"
        )


def _frozen_layer_run(out: Path, watch: bool, mode: str = "sync") -> dict[str, int]:
    """Three epochs of the digits classifier with its first layer frozen, a checkpoint after
    each; the stored bytes of each tensor in the last one's file (a delta)."""
    import lightning as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from inshrinkerator.single_file import open_container
    from inshrinkerator.tree import format_key_path, tensor_paths

    example = load_example("lightning_digits")
    torch.manual_seed(0)
    train, _ = example.digits()
    model = example.DigitsClassifier()
    model.net[0].weight.requires_grad_(False)
    io = InkCheckpointIO(policy="dynaquant", full_every=4, async_save=mode == "async_save")
    trainer = L.Trainer(
        max_epochs=3, plugins=[AsyncCheckpointIO(io) if mode == "wrapped" else io],
        callbacks=[InkWatch()] if watch else [], default_root_dir=out, accelerator="cpu",
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=100))
    (last,) = out.rglob("*.ckpt")  # ModelCheckpoint keeps the newest only
    with open_container(str(last)) as reader:
        paths = tensor_paths(reader.header.skeleton)
        return {format_key_path(paths[i]): record.stored_bytes for i, record in enumerate(reader.header.tensors)}


@pytest.mark.parametrize("mode", ["sync", "async_save", "wrapped"])
def test_inkwatch_keeps_a_frozen_layer_out_of_every_checkpoint(tmp_path: Path, mode: str) -> None:
    watched = _frozen_layer_run(tmp_path / "watched", watch=True, mode=mode)
    unwatched = _frozen_layer_run(tmp_path / "unwatched", watch=False, mode=mode)
    key = "state_dict/net.0.weight"
    # Unwatched, the frozen layer's distance from its stored levels looks like movement and
    # is coded again; watched (found through AsyncCheckpointIO too), it stays on its levels.
    assert watched[key] < unwatched[key] / 4
    assert watched["state_dict/net.2.weight"] > 0


def test_inkwatch_without_an_ink_plugin_is_an_error(tmp_path: Path) -> None:
    import lightning as L

    example = load_example("lightning_digits")
    train, _ = example.digits()
    trainer = L.Trainer(max_epochs=1, callbacks=[InkWatch()], default_root_dir=tmp_path, accelerator="cpu",
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="InkWatch needs an InkCheckpointIO"):
        trainer.fit(example.DigitsClassifier(), torch.utils.data.DataLoader(train, batch_size=100))


def test_inkwatch_watches_again_when_a_callback_unfreezes_a_layer(tmp_path: Path) -> None:
    import lightning as L

    from inshrinkerator.tree import TensorLeaf

    example = load_example("lightning_digits")
    torch.manual_seed(0)
    train, _ = example.digits()
    model = example.DigitsClassifier()
    model.net[0].requires_grad_(False)

    class UnfreezeAtEpoch1(L.Callback):  # what a fine-tuning callback does
        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.current_epoch == 1:
                pl_module.net[0].requires_grad_(True)  # its optimizer already holds it

    io = InkCheckpointIO(policy="dynaquant")
    trainer = L.Trainer(
        max_epochs=2, plugins=[io], callbacks=[UnfreezeAtEpoch1(), InkWatch()], default_root_dir=tmp_path,
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=100))
    watch = io.policy._memory.watch
    leaf = TensorLeaf(("net.0.weight",), model.net[0].weight)
    assert watch.trains(leaf) and watch.gradient_average(leaf) is not None


@pytest.mark.parametrize("async_save", [False, True])
def test_lightning_fabric_saves_and_loads_through_the_plugin(tmp_path: Path, async_save: bool) -> None:
    import lightning as L

    def setup(io: InkCheckpointIO) -> tuple:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        return (fabric, *fabric.setup(model, optimizer))

    torch.manual_seed(0)
    io = InkCheckpointIO(policy="lossless", full_every=2, async_save=async_save)
    fabric, model, optimizer = setup(io)
    for step in range(1, 10):
        loss = torch.nn.functional.cross_entropy(model(torch.randn(16, 64)), torch.randint(0, 10, (16,)))
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        if step % 3 == 0:
            fabric.save(tmp_path / f"step={step}.ckpt", {"model": model, "optimizer": optimizer, "step": step})
    io.teardown()  # Fabric has no end of fit: the script lets the last save land
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optimizer = optimizer.state_dict()
    fabric, model, optimizer = setup(InkCheckpointIO())
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(tmp_path / "step=9.ckpt", state) == {}
    assert state["step"] == 9
    restored = model.state_dict()
    assert restored.keys() == expected_model.keys()
    assert all(torch.equal(restored[key], expected_model[key]) for key in expected_model)
    assert_same(optimizer.state_dict()["state"], expected_optimizer["state"])
    assert len(list((tmp_path / KEYFRAME_DIR).glob("*.ink"))) == 2  # steps 3 and 6 on one, 9 on the next


def test_async_save_a_failure_nothing_waited_for_is_reported_at_exit(tmp_path: Path) -> None:
    script = f"""
import sys
from inshrinkerator.integrations._keyframes import KeyframeStore
from inshrinkerator.integrations.lightning import InkCheckpointIO
import torch

def fails(store, state, target, step=None):
    raise OSError("disk full")

KeyframeStore.save = fails
io = InkCheckpointIO(policy="lossless", async_save=True)
io.save_checkpoint({{"w": torch.ones(3)}}, {str(tmp_path / "a.ckpt")!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "disk full" in done.stderr and "a.ckpt" in done.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")
def test_ddp_on_torchrun_resumes_where_the_uninterrupted_run_ends(tmp_path: Path) -> None:
    """Two DDP ranks (gloo): rank 0 saves through the plugin (here in the background); a run
    stopped after 2 epochs and resumed in new processes ends where the uninterrupted run ends."""
    def launch(out: Path, *arguments: str) -> dict:
        done = run_torchrun("lightning_digits.py", "--out", str(out), "--policy", "lossless", "--devices", "2",
                            *arguments)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    uninterrupted = launch(tmp_path / "whole", "--epochs", "4")
    launch(tmp_path / "run", "--epochs", "2", "--async")
    resumed = launch(tmp_path / "run", "--epochs", "4", "--resume", "last", "--async")
    assert resumed["global_step"] == uninterrupted["global_step"]
    assert abs(resumed["loss"] - uninterrupted["loss"]) <= tolerance("lossless") * uninterrupted["loss"]
    for path in (tmp_path / "run").glob("*.ckpt"):
        assert "optimizer_states" in InkCheckpointIO().load_checkpoint(path)
