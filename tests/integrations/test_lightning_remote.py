"""Lightning checkpoints on an fsspec store: ``ModelCheckpoint(dirpath="s3://...")`` with
``InkCheckpointIO``, against a real S3-compatible server (moto) on loopback, and ``memory://``."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("sklearn")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from inshrinkerator.integrations._keyframes import (  # noqa: E402
    KEYFRAME_DIR,
    exists,
    join,
    names_in,
    remove_folder,
)
from inshrinkerator.integrations.lightning import InkCheckpointIO, InkWatch  # noqa: E402
from inshrinkerator.single_file import open_container  # noqa: E402
from tests.helpers import assert_same  # noqa: E402
from tests.integrations.conftest import load_example  # noqa: E402
from tests.integrations.test_keyframes import _state  # noqa: E402

_folders = itertools.count()


@pytest.fixture(params=["s3", "memory"])
def remote_folder(request: pytest.FixtureRequest) -> Any:
    if request.param == "s3":
        pytest.importorskip("s3fs", reason="s3fs is not installed")
        bucket = request.getfixturevalue("s3_bucket")
        yield f"{bucket}/lightning-{next(_folders)}"
        return
    folder = f"memory://lightning-remote-{next(_folders)}"
    yield folder
    remove_folder(folder)


def _fit(dirpath: str, epochs: int, io: InkCheckpointIO, resume: Optional[str] = None) -> torch.nn.Module:
    example = load_example("lightning_digits")
    torch.manual_seed(0)
    train, _ = example.digits()
    model = example.DigitsClassifier()
    trainer = L.Trainer(
        max_epochs=epochs, plugins=[io], accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
        callbacks=[ModelCheckpoint(dirpath=dirpath, filename="{epoch}-{step}", save_top_k=2,
                                   monitor="step", mode="max"), InkWatch()],
    )
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=100), ckpt_path=resume)
    return model


def _checkpoints(folder: str) -> list[str]:
    return sorted(name for name in names_in(folder) if name.endswith(".ckpt"))


def test_a_run_on_a_remote_store_resumes_where_a_local_one_ends(remote_folder: str, tmp_path: Any) -> None:
    local = _fit(str(tmp_path), 4, InkCheckpointIO(policy="lossless"))
    _fit(remote_folder, 2, InkCheckpointIO(policy="lossless", full_every=2, async_save=True))
    first = _checkpoints(remote_folder)
    assert len(first) == 2  # save_top_k deleted the older one on the store
    resumed = _fit(remote_folder, 4, InkCheckpointIO(policy="lossless", full_every=2, async_save=True),
                   resume=join(remote_folder, first[-1]))
    assert_same(resumed.state_dict(), local.state_dict())  # lossless: the same run
    # Every kept checkpoint restores from a fresh plugin; no keyframe is left that none needs.
    needed = set()
    for name in _checkpoints(remote_folder):
        restored = InkCheckpointIO().load_checkpoint(join(remote_folder, name))
        assert restored["global_step"] > 0 and "optimizer_states" in restored
        with open_container(join(remote_folder, name)) as reader:
            needed.add(reader.meta["keyframe"])
    keyframes = {name[: -len(".ink")] for name in names_in(join(remote_folder, KEYFRAME_DIR)) if name.endswith(".ink")}
    assert keyframes and keyframes <= needed


def test_removal_load_and_a_missing_file_on_a_remote_store(remote_folder: str) -> None:
    io = InkCheckpointIO(policy="lossless", full_every=2)
    for step in range(1, 5):
        io.save_checkpoint(_state(step), join(remote_folder, f"step={step}.ckpt"))
    for step in (1, 2, 3):  # the first keyframe's checkpoints, and one on the second
        io.remove_checkpoint(join(remote_folder, f"step={step}.ckpt"))
    io.teardown()
    assert _checkpoints(remote_folder) == ["step=4.ckpt"]
    assert len([n for n in names_in(join(remote_folder, KEYFRAME_DIR)) if n.endswith(".ink")]) == 1
    restored = InkCheckpointIO().load_checkpoint(join(remote_folder, "step=4.ckpt"))
    assert_same(restored, _state(4))
    assert not exists(join(remote_folder, "step=1.ckpt"))
    with pytest.raises(FileNotFoundError):
        InkCheckpointIO().load_checkpoint(join(remote_folder, "step=1.ckpt"))


def test_a_failed_upload_leaves_the_earlier_checkpoint(remote_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from inshrinkerator.integrations import _keyframes

    io = InkCheckpointIO(policy="lossless")
    target = join(remote_folder, "last.ckpt")
    io.save_checkpoint(_state(1), target)

    def fails_after_writing(out: Any, *args: Any, **kwargs: Any) -> None:
        out.write(b"x" * (6 << 20))  # past s3fs's 5 MiB block: a multipart upload has begun
        raise OSError("connection lost")

    monkeypatch.setattr(_keyframes, "write_state", fails_after_writing)
    with pytest.raises(OSError, match="connection lost"):
        io.save_checkpoint(_state(2), target)
    monkeypatch.undo()
    assert_same(InkCheckpointIO().load_checkpoint(target), _state(1))
    assert _checkpoints(remote_folder) == ["last.ckpt"]
