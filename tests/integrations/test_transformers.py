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
from inshrinkerator.integrations.transformers import STATE_FILE  # noqa: E402
from tests.integrations.conftest import EXAMPLES, load_example, policies_under_test, tolerance  # noqa: E402

PICKLED = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference run with the plain Trainer (its own checkpoint files)."""
    return load_example("hf_trainer_tiny").run(tmp_path_factory.mktemp("default"), default_trainer=True)


@pytest.mark.parametrize("policy", policies_under_test())
def test_resume_ends_where_the_uninterrupted_run_ends(tmp_path: Path, policy: str, uninterrupted: dict) -> None:
    example = load_example("hf_trainer_tiny")
    first = example.run(tmp_path, stop_at=7, policy=policy)
    assert first["global_step"] == 7
    assert first["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
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
    # Both kept folders decode on their own, against the one keyframe that survived rotation.
    assert len(list((tmp_path / ".ink-keyframes").glob("*.ink"))) == 1
    for name in resumed["checkpoints"]:
        state = KeyframeStore(tmp_path / ".ink-keyframes").load(tmp_path / name / STATE_FILE)
        assert {"model", "optimizer", "scheduler", "rng"} <= set(state)
    print(f"hf tiny gpt2 [{policy}]: 2 checkpoints + keyframes {resumed['stored_bytes']} B; "
          f"Trainer default {uninterrupted['stored_bytes']} B")
