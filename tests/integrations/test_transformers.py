"""Hugging Face Trainer: compressed checkpoint-N folders, save_total_limit rotation, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from inshrinkerator.integrations._keyframes import KeyframeStore  # noqa: E402
from inshrinkerator.integrations.transformers import PENDING_FILE, STATE_FILE  # noqa: E402
from tests.integrations.conftest import (  # noqa: E402
    EXAMPLES,
    load_example,
    policies_under_test,
    run_torchrun,
    tolerance,
)
from tests.integrations.test_keyframes import _keyframe_named_by  # noqa: E402

PICKLED = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference run with the plain Trainer (its own checkpoint files)."""
    return load_example("hf_trainer_tiny").run(tmp_path_factory.mktemp("default"), default_trainer=True)


@pytest.mark.parametrize("policy", policies_under_test())
def test_resume_ends_where_the_uninterrupted_run_ends(tmp_path: Path, policy: str, uninterrupted: dict) -> None:
    example = load_example("hf_trainer_tiny")
    # The lossy policy's first part writes its files on a background thread (ink_async_save).
    first = example.run(tmp_path, stop_at=7, policy=policy, async_save=policy != "lossless")
    assert not list(tmp_path.rglob(PENDING_FILE))
    assert first["global_step"] == 7
    assert first["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
    keyframe = _keyframe_named_by(tmp_path / "checkpoint-6" / STATE_FILE)
    if policy == "lossless":  # a real restart; lossy policies resume in this process (time budget)
        finished = subprocess.run(
            [sys.executable, str(EXAMPLES / "hf_trainer_tiny.py"), "--out", str(tmp_path),
             "--resume", str(tmp_path / "checkpoint-6"), "--policy", policy],
            capture_output=True, text=True, timeout=180, check=False,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert finished.returncode == 0, finished.stderr[-3000:]
        resumed = json.loads(finished.stdout.strip().splitlines()[-1])
    else:
        resumed = example.run(tmp_path, resume=str(tmp_path / "checkpoint-6"), policy=policy)
    assert resumed["global_step"] == uninterrupted["global_step"]
    assert abs(resumed["loss"] - uninterrupted["loss"]) <= tolerance(policy) * uninterrupted["loss"]
    # save_total_limit=2 rotated the folders; the kept ones hold no pickles and restore.
    assert resumed["checkpoints"] == ["checkpoint-12", "checkpoint-9"]
    for name in resumed["checkpoints"]:
        folder = tmp_path / name
        assert (folder / STATE_FILE).is_file() and (folder / "trainer_state.json").is_file()
        assert not any((folder / pickled).exists() for pickled in PICKLED)
    # Both kept folders decode on their own, against the one keyframe that survived rotation:
    # the resumed run went on with the keyframe of the checkpoint it resumed from.
    assert [p.stem for p in (tmp_path / ".ink-keyframes").glob("*.ink")] == [keyframe]
    assert all(_keyframe_named_by(tmp_path / name / STATE_FILE) == keyframe for name in resumed["checkpoints"])
    for name in resumed["checkpoints"]:
        state = KeyframeStore(tmp_path / ".ink-keyframes").load(tmp_path / name / STATE_FILE)
        assert {"model", "optimizer", "scheduler", "rng"} <= set(state)
    print(f"hf tiny gpt2 [{policy}]: 2 checkpoints + keyframes {resumed['stored_bytes']} B; "
          f"Trainer default {uninterrupted['stored_bytes']} B")


def _frozen_embedding_run(out: Path, watch: bool) -> dict[str, int]:
    """Six steps of the tiny GPT-2 with its token embedding (tied to the head) frozen;
    the stored bytes of each tensor in the last checkpoint's file."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from inshrinkerator.integrations.transformers import InkTrainer
    from inshrinkerator.single_file import open_container
    from inshrinkerator.tree import format_key_path, tensor_paths

    example = load_example("hf_trainer_tiny")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=example.CONTEXT, n_embd=32, n_layer=2, n_head=2))
    model.transformer.wte.weight.requires_grad_(False)
    args = TrainingArguments(
        str(out), max_steps=6, per_device_train_batch_size=8, learning_rate=3e-3, save_strategy="steps",
        save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = InkTrainer(model=model, args=args, train_dataset=example.SourceBytes(), ink_policy="dynaquant",
                         ink_watch=watch)
    trainer.train()
    with open_container(str(out / "checkpoint-6" / STATE_FILE)) as reader:
        paths = tensor_paths(reader.header.skeleton)
        return {format_key_path(paths[i]): record.stored_bytes for i, record in enumerate(reader.header.tensors)}


def test_a_watched_model_keeps_its_frozen_layers_out_of_every_checkpoint(tmp_path: Path, monkeypatch) -> None:
    import threading

    from inshrinkerator.policies import DynaQuant

    # The policy hears of each save on the training thread (where it hooks unfrozen layers).
    threads: list[int] = []
    original = DynaQuant.before_save
    monkeypatch.setattr(DynaQuant, "before_save", lambda self: (threads.append(threading.get_ident()), original(self)))
    watched = _frozen_embedding_run(tmp_path / "watched", watch=True)
    assert threads == [threading.get_ident()] * 2
    unwatched = _frozen_embedding_run(tmp_path / "unwatched", watch=False)
    key = "model/transformer.wte.weight"
    # Unwatched, the frozen embedding's distance from its stored levels looks like
    # movement, and every checkpoint codes it again; watched, it stays on its levels.
    assert watched[key] < unwatched[key] / 4
    trained = "model/transformer.h.0.mlp.c_fc.weight"
    assert watched[trained] > 0 and unwatched[trained] > 0


def test_async_save_rotates_only_after_the_file_landed_and_resume_passes_over_a_pending_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict,
) -> None:
    """checkpoint-9's background save fails: save_total_limit=2 must not have deleted
    checkpoint-3 for it, the next checkpoint raises AsyncSaveError, and a resume takes the
    newest complete folder (checkpoint-6), never the pending one."""
    import inshrinkerator as ink
    from inshrinkerator.integrations._keyframes import KeyframeStore as Store

    example = load_example("hf_trainer_tiny")
    original = Store.save

    def fails_at_nine(store, state, target, step=None):
        if Path(target).parent.name == "checkpoint-9":
            raise OSError("disk full")
        return original(store, state, target, step=step)

    monkeypatch.setattr(Store, "save", fails_at_nine)
    with pytest.raises(ink.AsyncSaveError, match="checkpoint-9") as raised:
        example.run(tmp_path, policy="lossless", async_save=True)
    assert isinstance(raised.value.__cause__, OSError)
    monkeypatch.undo()
    # checkpoint-12's save waited for checkpoint-9's and raised before making its folder.
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    for name in ("checkpoint-3", "checkpoint-6"):
        assert (tmp_path / name / STATE_FILE).is_file() and not (tmp_path / name / PENDING_FILE).exists()
    assert (tmp_path / "checkpoint-9" / PENDING_FILE).exists() and not (tmp_path / "checkpoint-9" / STATE_FILE).exists()
    # Named explicitly, the pending folder is refused with a clear error.
    with pytest.raises(FileNotFoundError, match="still being written"):
        example.run(tmp_path / "other", resume=str(tmp_path / "checkpoint-9"), policy="lossless")
    # resume_from_checkpoint=True passes over it, resumes from checkpoint-6 and ends where
    # the uninterrupted run ends; checkpoint-9 is saved again, whole this time.
    resumed = example.run(tmp_path, resume="last", policy="lossless", async_save=True)
    assert resumed["global_step"] == uninterrupted["global_step"]
    assert abs(resumed["loss"] - uninterrupted["loss"]) <= tolerance("lossless") * uninterrupted["loss"]
    assert resumed["checkpoints"] == ["checkpoint-12", "checkpoint-9"]
    assert not list(tmp_path.rglob(PENDING_FILE))


def test_async_save_writes_the_file_before_a_push_to_the_hub(tmp_path: Path) -> None:
    """push_to_hub uploads the folder inside the Trainer's save: the file must be there."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from inshrinkerator.integrations.transformers import InkTrainer

    example = load_example("hf_trainer_tiny")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=example.CONTEXT, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(
        str(tmp_path), max_steps=4, per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = InkTrainer(model=model, args=args, train_dataset=example.SourceBytes(windows=16),
                         ink_policy="lossless", ink_async_save=True)
    pushed: list[tuple[bool, bool]] = []
    trainer.args.push_to_hub = True  # after __init__, which would reach the Hub
    trainer._push_from_checkpoint = lambda folder: pushed.append(  # type: ignore[method-assign]
        ((Path(folder) / STATE_FILE).is_file(), (Path(folder) / PENDING_FILE).exists()))
    trainer._finish_current_push = lambda: None  # type: ignore[method-assign]
    trainer.train()
    assert pushed == [(True, False), (True, False)]


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")
def test_ddp_on_torchrun_resumes_where_the_uninterrupted_run_ends(tmp_path: Path) -> None:
    """Two DDP ranks (gloo): rank 0 writes each folder's file (here in the background), every
    rank its own RNG state; a run stopped at step 7 and resumed in new processes from its
    newest complete folder ends where the uninterrupted run ends."""
    def launch(out: Path, *arguments: str) -> dict:
        done = run_torchrun("hf_trainer_tiny.py", "--out", str(out), "--policy", "lossless", *arguments)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    uninterrupted = launch(tmp_path / "whole")
    first = launch(tmp_path / "run", "--stop-at", "7", "--async")
    assert first["global_step"] == 7 and first["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
    resumed = launch(tmp_path / "run", "--resume", "--async")
    assert resumed["global_step"] == uninterrupted["global_step"]
    assert abs(resumed["loss"] - uninterrupted["loss"]) <= tolerance("lossless") * uninterrupted["loss"]
    for name in resumed["checkpoints"]:
        files = sorted(p.name for p in (tmp_path / "run" / name).iterdir())
        assert files == ["config.json", STATE_FILE, "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]


def _best_model_run(out: Path, async_save: bool) -> dict:
    """12 steps, evaluated and saved every 3, ``save_total_limit=1``, the best (the first:
    greater loss is "better" here) loaded at the end."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from inshrinkerator.integrations.transformers import InkTrainer

    example = load_example("hf_trainer_tiny")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=example.CONTEXT, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(
        str(out), max_steps=12, per_device_train_batch_size=4, learning_rate=3e-3, save_strategy="steps",
        save_steps=3, eval_strategy="steps", eval_steps=3, save_total_limit=1, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    data = example.SourceBytes(windows=16)
    trainer = InkTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, ink_policy="lossless",
                         ink_async_save=async_save)
    trainer.train()
    return {"best": Path(trainer.state.best_model_checkpoint).name,
            "folders": sorted(p.name for p in out.glob("checkpoint-*")),
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def test_async_save_keeps_and_loads_the_best_model_as_a_synchronous_run_does(tmp_path: Path) -> None:
    import torch

    synchronous = _best_model_run(tmp_path / "sync", async_save=False)
    asynchronous = _best_model_run(tmp_path / "async", async_save=True)
    assert synchronous["best"] == asynchronous["best"] == "checkpoint-3"  # not the newest: rotation kept it
    assert asynchronous["folders"] == synchronous["folders"]
    assert asynchronous["weights"].keys() == synchronous["weights"].keys()
    for key, value in synchronous["weights"].items():
        assert torch.equal(asynchronous["weights"][key], value), key
