"""Random runs of ``InkTrainer``: save schedules, rotation, interruption and resume.

A tiny GPT-2 (the ``hf_trainer_tiny`` example's) trains under a random policy, keyframe
interval, ``save_steps`` and ``save_total_limit``, perhaps with ``ink_async_save``; it stops early, as a crash would, and a
new trainer resumes it from a random kept checkpoint folder (perhaps an older one, whose
later folders the resumed run then saves over) to the end. Then:

- every ``checkpoint-N`` folder Hugging Face kept restores what was last saved into it
  (lossless: exactly; DynaQuant: within the bounds of ``test_random_states.py``; the
  baselines: the structural checks);
- the keyframe folder holds no keyframe that no kept checkpoint needs, beyond the
  resumed trainer's current one;
- no folder is left pending (an asynchronous save that never landed);
- the resumed run reaches ``max_steps`` (one step more from a checkpoint at ``max_steps``,
  as with Hugging Face's own checkpoints).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from inshrinkerator.integrations._keyframes import KEYFRAME_DIR, KeyframeStore  # noqa: E402
from inshrinkerator.integrations.transformers import PENDING_FILE, STATE_FILE, InkTrainer  # noqa: E402
from inshrinkerator.single_file import open_container  # noqa: E402
from tests.integrations.conftest import load_example  # noqa: E402
from tests.policies.dynaquant_states import one_thread  # noqa: E402,F401  (autouse fixture)
from tests.policies.random_states import LONG, POLICIES, clone, fuzz_settings, identical, problems  # noqa: E402

pytestmark = [pytest.mark.timeout(0)] if LONG else []


@dataclass(frozen=True)
class HfRun:
    policy: str
    full_every: int
    save_steps: int
    save_total_limit: Optional[int]
    max_steps: int
    stop_at: int
    resume: int  # which kept checkpoint to resume from (modulo their count)
    async_save: bool = False


def hf_runs() -> st.SearchStrategy[HfRun]:
    return st.builds(
        HfRun,
        policy=st.sampled_from(POLICIES),
        full_every=st.sampled_from([1, 2, 3, 10]),
        save_steps=st.integers(1, 3),
        save_total_limit=st.sampled_from([None, 1, 2, 3]),
        max_steps=st.integers(3, 9),
        stop_at=st.integers(1, 8),
        resume=st.integers(0, 5),
        async_save=st.booleans(),
    )


def train(run: HfRun, out: Path, stop_at: Optional[int], resume: Optional[str]) -> InkTrainer:
    example = load_example("hf_trainer_tiny")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=example.CONTEXT, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(
        str(out), max_steps=run.max_steps, per_device_train_batch_size=4, learning_rate=3e-3,
        save_strategy="steps", save_steps=run.save_steps, save_total_limit=run.save_total_limit,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    callbacks = [example.StopAt(stop_at)] if stop_at is not None else []
    trainer = InkTrainer(model=model, args=args, train_dataset=example.SourceBytes(windows=16), callbacks=callbacks,
                         ink_policy=run.policy, ink_full_every=run.full_every, ink_async_save=run.async_save)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@fuzz_settings(4, share=20)
@given(run=hf_runs())
def test_random_hf_runs_keep_restorable_checkpoints(run: HfRun, tmp_path_factory: Any) -> None:
    out: Path = tmp_path_factory.mktemp("hf")
    saved: dict[Path, Any] = {}
    original = KeyframeStore.save

    def recording(store: KeyframeStore, state: Any, target: Any, step: Optional[int] = None) -> Any:
        saved[Path(target).absolute()] = clone(state)
        return original(store, state, target, step)

    with mock.patch.object(KeyframeStore, "save", recording):
        train(run, out, stop_at=min(run.stop_at, run.max_steps), resume=None)
        kept = sorted(out.glob("checkpoint-*"), key=lambda folder: int(folder.name.split("-")[1]))
        resume = str(kept[run.resume % len(kept)]) if kept else None
        trainer = train(run, out, stop_at=None, resume=resume)
    # Resumed from a checkpoint at max_steps, Hugging Face's own Trainer trains one step more.
    assert trainer.state.global_step in (run.max_steps, run.max_steps + 1)
    assert not list(out.rglob(PENDING_FILE))
    store = KeyframeStore(out / KEYFRAME_DIR)
    needed = set()
    for folder in out.glob("checkpoint-*"):
        path = (folder / STATE_FILE).absolute()
        restored = store.load(path)
        if run.policy == "lossless":
            assert identical(saved[path], restored), folder.name
        else:
            found = problems(saved[path], restored, bounded=run.policy == "dynaquant")
            assert found == [], f"{folder.name}: {found}"
        with open_container(path) as container:
            needed.add(container.meta.get("keyframe"))
    current = {live._keyframe for live in trainer._ink_stores.values()}
    left = {path.stem for path in (out / KEYFRAME_DIR).glob("*.ink")}
    assert left <= needed | current, f"keyframes {sorted(left - needed - current)} are needed by no checkpoint"
