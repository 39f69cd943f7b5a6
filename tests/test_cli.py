"""The inshrink command line, driven as a user would."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import inshrinkerator as ink
from inshrinkerator.cli import human_bytes, main

from .helpers import assert_same, training_state


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(300, 64) * 0.02,
        "layer.weight": torch.randn(64, 64) * 0.05,
        "layer.bias": torch.zeros(64),
        "half": torch.randn(40, 8).to(torch.bfloat16),
        "position_ids": torch.arange(512).unsqueeze(0),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return path


def test_safetensors_round_trip_through_ink(capsys, tmp_path: Path, weights: Path) -> None:
    code, out, _ = run(capsys, "compress", str(weights), str(tmp_path / "m.ink"))
    assert code == 0 and "m.ink" in out
    code, _, _ = run(capsys, "decompress", str(tmp_path / "m.ink"), str(tmp_path / "back.safetensors"))
    assert code == 0
    original, back = load_file(weights), load_file(tmp_path / "back.safetensors")
    assert list(original) == list(back)
    for name in original:
        assert_same(original[name], back[name], name)


def test_info_shows_a_tensor_stored_as_its_reference_without_a_ratio(capsys, tmp_path: Path) -> None:
    base = {"frozen": torch.randn(128, 64), "tuned": torch.randn(128, 64)}
    tuned = {"frozen": base["frozen"].clone(), "tuned": base["tuned"] + 0.01}
    ink.save(tuned, tmp_path / "t.ink", policy="dynaquant", base=base)
    code, out, _ = run(capsys, "info", str(tmp_path / "t.ink"))
    assert code == 0
    (row,) = [line for line in out.splitlines() if "frozen" in line]
    assert "unchanged (delta)" in row and "inf" not in row and row.rstrip(" │|").endswith("-")


def test_info_shows_per_tensor_sizes_and_ratio(capsys, tmp_path: Path, weights: Path) -> None:
    main(["compress", str(weights), str(tmp_path / "m.ink")])
    capsys.readouterr()
    code, out, _ = run(capsys, "info", str(tmp_path / "m.ink"))
    assert code == 0
    for expected in ("embed.weight", "position_ids", "byte_grouping", "total", "lossless"):
        assert expected in out
    code, out, _ = run(capsys, "info", "--json", str(tmp_path / "m.ink"))
    summary = json.loads(out)
    assert summary["stored_bytes"] == (tmp_path / "m.ink").stat().st_size
    assert summary["ratio"] == pytest.approx(summary["raw_bytes"] / summary["stored_bytes"])
    by_key = {t["key"]: t for t in summary["tensors"]}
    assert by_key["embed.weight"]["raw_bytes"] == 300 * 64 * 4
    assert by_key["position_ids"]["stored_bytes"] < by_key["position_ids"]["raw_bytes"] / 4


def test_info_splits_a_training_state_by_tensor_class(capsys, tmp_path: Path) -> None:
    state = training_state(steps=2)
    ink.save(state, tmp_path / "s.ink", policy="dynaquant")
    code, out, _ = run(capsys, "info", "--json", str(tmp_path / "s.ink"))
    assert code == 0
    summary = json.loads(out)
    classes = summary["classes"]
    assert list(classes) == ["weights", "first_moment", "second_moment", "other"]
    # Every tensor is in exactly one class: the classes add up to the tensors' own sizes.
    for size in ("raw_bytes", "stored_bytes"):
        assert sum(c[size] for c in classes.values()) == sum(t[size] for t in summary["tensors"])
    # One float32 per trained parameter in each of the weights and Adam's two moments; the
    # BatchNorm running statistics, step counters and the rest are "other".
    parameters = 4 * sum(entry["exp_avg"].numel() for entry in state["optimizer"]["state"].values())
    for name in ("weights", "first_moment", "second_moment"):
        assert classes[name]["raw_bytes"] == parameters
    code, out, _ = run(capsys, "info", str(tmp_path / "s.ink"))
    assert "by tensor class" in out and "second moment" in out


def test_info_splits_a_run_by_tensor_class_when_asked(capsys, tmp_path: Path) -> None:
    with ink.CheckpointManager(tmp_path / "run") as mgr:
        for step in (1, 2):
            mgr.save(step, training_state(steps=step))
    code, out, _ = run(capsys, "info", "--json", str(tmp_path / "run"))
    assert code == 0 and all("classes" not in entry for entry in json.loads(out))  # no header read
    code, out, _ = run(capsys, "info", "--json", "--classes", str(tmp_path / "run"))
    entries = json.loads(out)
    assert [list(entry["classes"]) for entry in entries] == [["weights", "first_moment", "second_moment", "other"]] * 2
    for entry in entries:
        assert sum(c["raw_bytes"] for c in entry["classes"].values()) == entry["raw_bytes"]
        assert sum(c["stored_bytes"] for c in entry["classes"].values()) < entry["stored_bytes"]
    code, out, _ = run(capsys, "info", "--classes", str(tmp_path / "run"))
    assert code == 0 and "all steps" in out and "first moment" in out


def test_pt_nested_state_round_trip(capsys, tmp_path: Path) -> None:
    state = training_state(steps=2)
    torch.save(state, tmp_path / "ckpt.pt")
    assert run(capsys, "compress", str(tmp_path / "ckpt.pt"), str(tmp_path / "c.ink"))[0] == 0
    assert run(capsys, "decompress", str(tmp_path / "c.ink"), str(tmp_path / "back.pt"))[0] == 0
    assert_same(state, torch.load(tmp_path / "back.pt", weights_only=True))
    code, _, err = run(capsys, "decompress", str(tmp_path / "c.ink"), str(tmp_path / "back.safetensors"))
    assert code == 1 and "flat" in err


def test_verify_detects_a_damaged_file(capsys, tmp_path: Path, weights: Path) -> None:
    main(["compress", str(weights), str(tmp_path / "m.ink")])
    assert run(capsys, "verify", str(tmp_path / "m.ink"))[0] == 0
    data = bytearray((tmp_path / "m.ink").read_bytes())
    data[len(data) // 2] ^= 0x10
    (tmp_path / "bad.ink").write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", "--json", str(tmp_path / "bad.ink"))
    report = json.loads(out)
    assert code == 1 and not report["ok"] and "checksum" in report["problems"][0]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_payload_is_refused_and_never_run(capsys, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"w": Payload()}))
    code, _, err = run(capsys, "compress", str(tmp_path / "evil.pt"), str(tmp_path / "e.ink"))
    assert code == 1 and "weights-only" in err
    assert not marker.exists() and not (tmp_path / "e.ink").exists()


def test_base_option_stores_a_delta(capsys, tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = {"w": torch.randn(128, 128) * 0.05}
    tuned = {"w": base["w"] + torch.randn(128, 128) * 1e-5}
    save_file(base, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    code, out, _ = run(capsys, "compress", "--json", "--base", str(tmp_path / "base.safetensors"),
                       str(tmp_path / "tuned.safetensors"), str(tmp_path / "t.ink"))
    assert code == 0 and json.loads(out)["kind"] == "delta"
    assert run(capsys, "decompress", str(tmp_path / "t.ink"), str(tmp_path / "x.pt"))[0] == 1
    assert run(capsys, "verify", "--base", str(tmp_path / "base.safetensors"), str(tmp_path / "t.ink"))[0] == 0
    code = main(["decompress", "--base", str(tmp_path / "base.safetensors"), str(tmp_path / "t.ink"),
                 str(tmp_path / "x.pt")])
    assert code == 0 and torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["w"], tuned["w"])


def test_bad_inputs_exit_1_with_a_message(capsys, tmp_path: Path) -> None:
    (tmp_path / "junk.ink").write_bytes(b"not a checkpoint at all")
    code, _, err = run(capsys, "info", str(tmp_path / "junk.ink"))
    assert code == 1 and "not an inshrinkerator file" in err
    code, _, err = run(capsys, "compress", str(tmp_path / "junk.ink"), str(tmp_path / "x.txt"))
    assert code == 1
    ink.save({"w": torch.ones(3)}, tmp_path / "ok.ink")
    code, _, err = run(capsys, "compress", "--policy", "nope", str(tmp_path / "ok.ink"), str(tmp_path / "y.ink"))
    assert code == 1 and "unknown policy" in err


def test_console_script_runs(tmp_path: Path, weights: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inshrinkerator", "compress", "--json", str(weights), str(tmp_path / "m.ink")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ratio"] > 1.0


def test_human_bytes() -> None:
    assert human_bytes(12) == "12 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"


def test_compress_takes_a_policy_with_options(capsys, tmp_path: Path, weights: Path) -> None:
    sizes = {}
    for bits in (2, 8):
        code, _, err = run(capsys, "compress", "--policy", f"cnr:bits={bits}", str(weights), str(tmp_path / f"{bits}.ink"))
        assert code == 0, err
        sizes[bits] = (tmp_path / f"{bits}.ink").stat().st_size
    assert sizes[2] < sizes[8]
    code, _, err = run(capsys, "compress", "--policy", "cnr:colour=red", str(weights), str(tmp_path / "x.ink"))
    assert code == 1 and "has no option 'colour'" in err and not (tmp_path / "x.ink").exists()


def test_a_keyframed_checkpoint_finds_its_keyframe(capsys, tmp_path: Path) -> None:
    """A checkpoint from the Lightning / Hugging Face integrations (a delta against a keyframe
    beside it) loads, verifies and decompresses without --base; a .ckpt suffix is no obstacle."""
    from inshrinkerator.integrations._keyframes import KEYFRAME_DIR, KeyframeStore

    store = KeyframeStore(tmp_path / KEYFRAME_DIR, policy="lossless")
    states = {step: training_state(seed=step) for step in (1, 2)}
    for step, state in states.items():
        store.save(state, tmp_path / f"step={step}.ckpt")
    assert_same(ink.load(tmp_path / "step=2.ckpt"), states[2])  # a delta: no base given
    code, out, _ = run(capsys, "info", "--json", str(tmp_path / "step=2.ckpt"))
    (keyframe_file,) = (tmp_path / KEYFRAME_DIR).glob("*.ink")
    assert code == 0 and json.loads(out)["keyframe"] == str(keyframe_file)
    ink.save({"w": torch.ones(3)}, tmp_path / "plain.ink")
    assert json.loads(run(capsys, "info", "--json", str(tmp_path / "plain.ink"))[1])["keyframe"] is None
    assert run(capsys, "verify", str(tmp_path / "step=2.ckpt"))[0] == 0
    code, _, _ = run(capsys, "decompress", str(tmp_path / "step=2.ckpt"), str(tmp_path / "step2.pt"))
    assert code == 0
    assert_same(torch.load(tmp_path / "step2.pt", weights_only=True), states[2])
    code, out, _ = run(capsys, "compress", "--json", str(tmp_path / "step=2.ckpt"), str(tmp_path / "again.ink"))
    assert code == 0 and json.loads(out)["kind"] == "full"
    # The keyframe replaced by hand (another run's): the delta refuses to restore against it.
    (keyframe,) = (tmp_path / KEYFRAME_DIR).glob("*.ink")
    other = KeyframeStore(tmp_path / "elsewhere" / KEYFRAME_DIR, policy="lossless")
    other.save(training_state(seed=9), tmp_path / "elsewhere" / "x.ckpt")
    (other_keyframe,) = (tmp_path / "elsewhere" / KEYFRAME_DIR).glob("*.ink")
    keyframe.write_bytes(other_keyframe.read_bytes())
    code, out, _ = run(capsys, "verify", "--json", str(tmp_path / "step=2.ckpt"))
    assert code == 1 and "does not match" in json.loads(out)["problems"][0]
    keyframe.unlink()
    with pytest.raises(ink.BrokenChainError, match="missing"):
        ink.load(tmp_path / "step=2.ckpt")
    assert run(capsys, "decompress", str(tmp_path / "step=2.ckpt"), str(tmp_path / "y.pt"))[0] == 1


def test_a_torch_ckpt_is_read_weights_only(capsys, tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.ones(4)}, "epoch": 3}, tmp_path / "plain.ckpt")
    code, _, _ = run(capsys, "compress", str(tmp_path / "plain.ckpt"), str(tmp_path / "plain.ink"))
    assert code == 0 and ink.load(tmp_path / "plain.ink")["epoch"] == 3


def test_a_trainer_checkpoint_folder_stands_for_its_state_file(capsys, tmp_path: Path) -> None:
    """``inshrink info / verify / decompress out/checkpoint-6`` read the folder's
    ``inshrinkerator.ink`` (InkTrainer's), keyframe and all."""
    from inshrinkerator.integrations._keyframes import KEYFRAME_DIR, KeyframeStore

    store = KeyframeStore(tmp_path / KEYFRAME_DIR, policy="lossless")
    for step in (3, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        store.save(training_state(seed=step), tmp_path / f"checkpoint-{step}" / "inshrinkerator.ink")
    folder = str(tmp_path / "checkpoint-6")
    code, out, _ = run(capsys, "info", "--json", folder)
    assert code == 0 and json.loads(out)["kind"] == "delta"
    assert run(capsys, "verify", folder)[0] == 0
    assert run(capsys, "decompress", folder, str(tmp_path / "six.pt"))[0] == 0
    assert_same(torch.load(tmp_path / "six.pt", weights_only=True), training_state(seed=6))
    code, _, err = run(capsys, "info", str(tmp_path))  # a folder that holds no state file
    assert code == 1 and "directory, not an .ink file" in " ".join(err.split())
