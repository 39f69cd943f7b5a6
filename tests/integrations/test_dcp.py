"""torch.distributed.checkpoint: compressed shards per rank, JSON metadata, resume on torchrun."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import inshrinkerator as ink
from inshrinkerator.integrations._keyframes import KEYFRAME_DIR, keyframe_of
from inshrinkerator.integrations.dcp import (
    METADATA_FILE,
    InkKeyframes,
    InkLoadPlanner,
    InkSavePlanner,
    InkStorageReader,
    InkStorageWriter,
    read_dcp,
)
from inshrinkerator.single_file import open_container
from tests.helpers import assert_same
from tests.integrations.conftest import policies_under_test, run_torchrun, tolerance


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(),
            "meta": {"step": 7, "name": "run", "ratio": 0.5, "tags": ["a", "b"], "none": None}}


def _blank(state: dict) -> dict:
    """The same structure with zeroed tensors and changed plain values (what dcp.load fills)."""
    if isinstance(state, dict):
        return type(state)((key, _blank(value)) for key, value in state.items())
    if isinstance(state, list):
        return [_blank(value) for value in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None if not isinstance(state, (int, float)) or isinstance(state, bool) else -1


@pytest.mark.parametrize("policy", policies_under_test())
def test_single_process_round_trip(tmp_path: Path, policy: str) -> None:
    state = _state()
    dcp.save(state, storage_writer=InkStorageWriter(tmp_path, policy=policy), planner=InkSavePlanner(),
             no_dist=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [METADATA_FILE, "__0.ink"]
    json.loads((tmp_path / METADATA_FILE).read_text())  # plain JSON, no pickle
    restored = _blank(state)
    reader = InkStorageReader(tmp_path)
    dcp.load(restored, storage_reader=reader, planner=InkLoadPlanner(), no_dist=True)
    assert reader.shards_read == ["__0.ink"]
    assert restored["meta"] == state["meta"]
    assert restored["optim"]["param_groups"] == state["optim"]["param_groups"]
    if policy == "lossless":
        assert_same(restored["model"], state["model"])
    # Lossy: the shape of the data survives (a quantizer's error, not garbage).
    bound = tolerance(policy) if policy == "lossless" else 0.5
    for key, tensor in state["model"].items():
        error = (restored["model"][key] - tensor).norm() / tensor.norm().clamp_min(1e-12)
        assert error <= bound, key


def test_the_pickling_default_planner_is_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as caught:  # DCP collects each rank's error
        dcp.save(_state(), storage_writer=InkStorageWriter(tmp_path, policy="lossless"), no_dist=True)
    (failure,) = caught.value.failures.values()
    error = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(error, TypeError) and "InkSavePlanner" in str(error)
    assert not (tmp_path / METADATA_FILE).exists()  # nothing committed


def test_an_unfinished_or_foreign_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ink.CheckpointNotFoundError, match="no finished"):
        InkStorageReader(tmp_path).read_metadata()
    (tmp_path / METADATA_FILE).write_bytes(b"\x80\x04K\x01.")  # a pickle is not metadata
    with pytest.raises(ink.FormatError, match="JSON"):
        InkStorageReader(tmp_path).read_metadata()
    (tmp_path / METADATA_FILE).write_text(json.dumps(
        {"format": "inshrinkerator-dcp", "version": 1, "items": {}, "planner_data": {},
         "storage": {"w@": {"file": "../../etc/passwd", "key": "w@"}}}))
    with pytest.raises(ink.FormatError, match="storage entry"):
        InkStorageReader(tmp_path).read_metadata()


@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo")
def test_torchrun_two_ranks_each_write_and_restore_their_own_shard(tmp_path: Path) -> None:
    """DDP (replicated) and FSDP2 (sharded, saved with dcp.async_save), 2 ranks on gloo,
    checkpoints at steps 3 and 6 through InkKeyframes (step 6 a delta against each rank's
    keyframe); the resume runs in new processes and must end where the uninterrupted run ended."""
    for phase in ("save", "resume"):
        done = run_torchrun("dcp_torchrun.py", "--out", str(tmp_path), "--policy", "lossless", "--phase", phase,
                            "--keyframes")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    print(done.stdout.strip())
    for rank in (0, 1):
        saved = json.loads((tmp_path / f"save-rank{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resume-rank{rank}.json").read_text())
        for mode in ("ddp", "fsdp"):
            assert saved[mode]["shard"] == f"__{rank}.ink"
            shard = tmp_path / mode / "step-6" / f"__{rank}.ink"
            with open_container(str(shard)) as reader:  # a delta against this rank's keyframe
                (keyframe,) = (tmp_path / mode / KEYFRAME_DIR / f"__{rank}").glob("*.ink")
                assert keyframe_of(reader) == keyframe.stem
            first, second = saved[mode]["stored_per_save"]
            assert second < first  # the first save paid for the keyframe
            assert resumed[mode]["step"] == 6
            # The resumed processes loaded through InkKeyframes and went on with the keyframe.
            with open_container(str(tmp_path / mode / "step-12" / f"__{rank}.ink")) as reader:
                assert keyframe_of(reader) == keyframe.stem
            assert resumed[mode]["stored_at_end"] < first
            loss, reference = resumed[mode]["final_loss"], saved[mode]["final_loss"]
            assert abs(loss - reference) <= tolerance("lossless") * reference
        for mode in ("ddp", "fsdp"):
            assert f"__{rank}.ink" in resumed[mode]["shards_read"]
    # FSDP2: each weight's row-shard lives in the file of the rank that owned it.
    storage = json.loads((tmp_path / "fsdp" / "step-6" / METADATA_FILE).read_text())["storage"]
    weights = {key: place["file"] for key, place in storage.items() if key.startswith("model.")}
    assert weights and set(weights.values()) == {"__0.ink", "__1.ink"}
    for key, file in weights.items():
        first_offset = int(key.split("@")[1].split(",")[0])
        assert file == ("__0.ink" if first_offset == 0 else "__1.ink"), key
    for mode in ("ddp", "fsdp"):
        names = sorted(p.name for p in (tmp_path / mode / "step-6").iterdir())
        assert names == [METADATA_FILE, "__0.ink", "__1.ink"]
        # Assembled from both ranks' chunks (FSDP2: row shards), as DCP's own format of the
        # same state gives it (lossless here).
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(tmp_path / f"{mode}-default"), str(tmp_path / f"{mode}-default.pt"))
        theirs = torch.load(tmp_path / f"{mode}-default.pt", weights_only=True)
        ours = read_dcp(tmp_path / mode / "step-6")
        assert ours["step"] == theirs["step"] == 6
        assert_same(ours["model"], theirs["model"])
        assert_same(ours["optim"]["state"], theirs["optim"]["state"])


_remote_folders = itertools.count()


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_round_trip_on_an_fsspec_store(store: str, request: pytest.FixtureRequest) -> None:
    """``InkStorageWriter`` / ``InkStorageReader`` on a URL: ``memory://`` and a moto S3 server."""
    if store == "s3":
        pytest.importorskip("s3fs", reason="s3fs is not installed")
        folder = f"{request.getfixturevalue('s3_bucket')}/dcp-{next(_remote_folders)}"
    else:
        folder = f"memory://dcp-{next(_remote_folders)}"
    import fsspec

    fs, root = fsspec.core.url_to_fs(folder)
    try:
        state = _state()
        dcp.save(state, storage_writer=InkStorageWriter(folder, policy="lossless"), planner=InkSavePlanner(),
                 no_dist=True)
        assert sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [METADATA_FILE, "__0.ink"]
        restored = _blank(state)
        dcp.load(restored, storage_reader=InkStorageReader(folder), planner=InkLoadPlanner(), no_dist=True)
        assert_same(restored, state)
        # Deltas across checkpoints on the same store: keyframes beside them, found by readers.
        states = _trained_states(3)
        keyframes = InkKeyframes(f"{folder}/run", policy="lossless", full_every=2)
        for step, each in enumerate(states):
            dcp.save(each, storage_writer=InkStorageWriter(f"{folder}/run/step-{step}", keyframes=keyframes),
                     planner=InkSavePlanner(), no_dist=True)
        assert len(fs.ls(f"{root}/run/{KEYFRAME_DIR}/__0", detail=False)) >= 2  # keyframes and their refs
        for step, each in enumerate(states):
            assert_same(_load(f"{folder}/run/step-{step}", each), each)
        fs.rm(f"{root}/run/step-0", recursive=True)
        keyframes.collect()
        assert_same(_load(f"{folder}/run/step-2", states[2]), states[2])
    finally:
        fs.rm(root, recursive=True)


def _trained_states(count: int) -> list[dict]:
    """A small model and its Adam state after 1, 2, ... ``count`` steps (copies)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    states = []
    for step in range(count):
        model(torch.randn(8, 32)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "meta": {"step": step}}
        states.append(copy.deepcopy(state))
    return states


def _load(folder: Path | str, like: dict) -> dict:
    restored = _blank(like)
    dcp.load(restored, storage_reader=InkStorageReader(folder), planner=InkLoadPlanner(), no_dist=True)
    return restored


@pytest.mark.parametrize("policy", policies_under_test())
def test_checkpoints_with_keyframes_are_deltas_and_restore_on_their_own(tmp_path: Path, policy: str) -> None:
    states = _trained_states(5)
    keyframes = InkKeyframes(tmp_path, policy=policy, full_every=3)
    stored, alone = [], []
    for step, state in enumerate(states):
        writer = InkStorageWriter(tmp_path / f"step-{step}", keyframes=keyframes)
        dcp.save(state, storage_writer=writer, planner=InkSavePlanner(), no_dist=True)
        stored.append(writer.last_info["stored_bytes"])
        writer = InkStorageWriter(tmp_path / "alone" / f"step-{step}", policy=policy)
        dcp.save(state, storage_writer=writer, planner=InkSavePlanner(), no_dist=True)
        alone.append(writer.last_info["stored_bytes"])
    folder = tmp_path / KEYFRAME_DIR / "__0"
    assert len(list(folder.glob("*.ink"))) == 2  # steps 0-2 on one keyframe, 3-4 on the next
    # A save that writes a keyframe pays for it; the ones after it store less than the
    # same state stored on its own.
    assert stored[0] > alone[0] and stored[3] > alone[3]
    assert all(stored[step] < alone[step] for step in (1, 2, 4)), (stored, alone)
    for step, state in enumerate(states):  # a reader needs nothing but the folder
        restored = _load(tmp_path / f"step-{step}", state)
        assert restored["meta"] == state["meta"]
        assert restored["optim"]["param_groups"] == state["optim"]["param_groups"]
        if policy == "lossless":
            assert_same(restored, state)
        else:  # against the keyframe as decoded: the error stays a quantizer's
            for key, tensor in state["model"].items():
                error = (restored["model"][key] - tensor).norm() / tensor.norm().clamp_min(1e-12)
                assert error <= 0.5, key


def test_keyframes_go_once_no_checkpoint_needs_them(tmp_path: Path) -> None:
    states = _trained_states(4)
    keyframes = InkKeyframes(tmp_path, policy="lossless", full_every=2)
    for step, state in enumerate(states):
        dcp.save(state, storage_writer=InkStorageWriter(tmp_path / f"step-{step}", keyframes=keyframes),
                 planner=InkSavePlanner(), no_dist=True)
    folder = tmp_path / KEYFRAME_DIR / "__0"
    assert len(list(folder.glob("*.ink"))) == 2
    for step in (0, 1):  # the run deletes its old checkpoints itself
        shutil.rmtree(tmp_path / f"step-{step}")
    keyframes.collect()
    assert len(list(folder.glob("*.ink"))) == 1
    assert_same(_load(tmp_path / "step-3", states[3]), states[3])
    (keyframe,) = folder.glob("*.ink")
    keyframe.unlink()
    with pytest.raises(CheckpointException) as caught:  # DCP collects each rank's error
        _load(tmp_path / "step-3", states[3])
    (failure,) = caught.value.failures.values()
    error = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(error, ink.BrokenChainError) and keyframe.name in str(error)


def test_keyframe_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="full_every"):
        InkKeyframes(tmp_path, full_every=0)
    with pytest.raises(ValueError, match="policy to InkKeyframes"):
        InkStorageWriter(tmp_path / "a", policy="lossless", keyframes=InkKeyframes(tmp_path))
    with pytest.raises(TypeError, match="InkKeyframes"):
        InkStorageWriter(tmp_path / "a", keyframes=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(CheckpointException):  # a checkpoint and its keyframes on two stores
        dcp.save(_state(), storage_writer=InkStorageWriter("memory://elsewhere", keyframes=InkKeyframes(tmp_path)),
                 planner=InkSavePlanner(), no_dist=True)


def test_a_shard_keeps_optimizer_moments_where_a_policy_sees_them(tmp_path: Path) -> None:
    """get_state_dict keys the optimizer state by parameter names; the shard keeps each
    value at its place, so DynaQuant stores second moments as second moments (positive)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 32)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.save(state, storage_writer=InkStorageWriter(tmp_path, policy="dynaquant"), planner=InkSavePlanner(),
             no_dist=True)
    shard = ink.load(tmp_path / "__0.ink")
    assert set(shard["optim"]["state"]["0.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
    restored = _load(tmp_path, state)
    for name, entry in state["optim"]["state"].items():
        second, back = entry["exp_avg_sq"], restored["optim"]["state"][name]["exp_avg_sq"]
        assert bool(((back > 0) | (second == 0)).all()), name  # Adam divides by its root
        assert torch.equal(restored["optim"]["state"][name]["step"], entry["step"])
    assert restored["optim"]["param_groups"] == state["optim"]["param_groups"]


def test_a_shard_written_flat_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from inshrinkerator.integrations import dcp as dcp_module

    monkeypatch.setattr(dcp_module, "_shard_state", lambda entries, paths: (dict(entries), None))
    state = _state()
    dcp.save(state, storage_writer=InkStorageWriter(tmp_path, policy="lossless"), planner=InkSavePlanner(),
             no_dist=True)
    monkeypatch.undo()
    assert "model.0.weight@0,0" in ink.load(tmp_path / "__0.ink")  # as shards were written before
    assert_same(_load(tmp_path, state), state)


@pytest.mark.parametrize("take_over", [True, False])
def test_a_resumed_run_goes_on_with_the_keyframe_it_loaded(tmp_path: Path, take_over: bool) -> None:
    states = _trained_states(4)
    first = InkKeyframes(tmp_path, policy="lossless", full_every=10)
    for step in range(3):
        dcp.save(states[step], storage_writer=InkStorageWriter(tmp_path / f"step-{step}", keyframes=first),
                 planner=InkSavePlanner(), no_dist=True)
    folder = tmp_path / KEYFRAME_DIR / "__0"
    (keyframe,) = folder.glob("*.ink")
    resumed = InkKeyframes(tmp_path, policy="lossless", full_every=10)  # a new process
    restored = _blank(states[2])
    reader = InkStorageReader(tmp_path / "step-2", keyframes=resumed if take_over else None)
    dcp.load(restored, storage_reader=reader, planner=InkLoadPlanner(), no_dist=True)
    assert_same(restored, states[2])
    writer = InkStorageWriter(tmp_path / "step-3", keyframes=resumed)
    dcp.save(states[3], storage_writer=writer, planner=InkSavePlanner(), no_dist=True)
    with open_container(str(tmp_path / "step-3" / "__0.ink")) as shard:
        assert (keyframe_of(shard) == keyframe.stem) is take_over
    assert len(list(folder.glob("*.ink"))) == (1 if take_over else 2)
    assert_same(_load(tmp_path / "step-3", states[3]), states[3])


def test_inshrink_info_and_verify_read_a_dcp_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from inshrinkerator.cli import main

    states = _trained_states(2)
    keyframes = InkKeyframes(tmp_path, policy="dynaquant")
    for step, state in enumerate(states):
        dcp.save(state, storage_writer=InkStorageWriter(tmp_path / f"step-{step}", keyframes=keyframes),
                 planner=InkSavePlanner(), no_dist=True)
    folder = str(tmp_path / "step-1")
    capsys.readouterr()
    assert main(["info", "--json", folder]) == 0
    summary = json.loads(capsys.readouterr().out)
    (shard,) = summary["shards"]
    assert summary["format"] == "dcp" and shard["path"].endswith("__0.ink") and shard["kind"] == "delta"
    assert shard["keyframe"] is not None and {"weights", "first_moment", "second_moment"} <= set(summary["classes"])
    assert summary["stored_bytes"] == (tmp_path / "step-1" / "__0.ink").stat().st_size
    assert main(["verify", folder]) == 0
    # A damaged keyframe, a missing keyframe, a missing shard: each a failure that says where.
    (keyframe,) = (tmp_path / KEYFRAME_DIR / "__0").glob("*.ink")
    intact = keyframe.read_bytes()
    damaged = bytearray(intact)
    damaged[len(damaged) // 2] ^= 0x40
    keyframe.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert main(["verify", "--json", folder]) == 1
    assert keyframe.name in " ".join(json.loads(capsys.readouterr().out)["problems"])
    keyframe.unlink()
    assert main(["verify", "--json", folder]) == 1
    assert "keyframe" in " ".join(json.loads(capsys.readouterr().out)["problems"])
    keyframe.write_bytes(intact)
    assert main(["verify", folder]) == 0
    (tmp_path / "step-1" / "__0.ink").unlink()
    capsys.readouterr()
    assert main(["verify", "--json", folder]) == 1
    assert "__0.ink" in " ".join(json.loads(capsys.readouterr().out)["problems"])


def test_inshrink_decompress_writes_a_dcp_checkpoint_as_one_plain_file(tmp_path: Path) -> None:
    from inshrinkerator.cli import main

    states = _trained_states(2)
    keyframes = InkKeyframes(tmp_path, policy="lossless")
    for step, state in enumerate(states):
        dcp.save(state, storage_writer=InkStorageWriter(tmp_path / f"step-{step}", keyframes=keyframes),
                 planner=InkSavePlanner(), no_dist=True)
    assert main(["decompress", str(tmp_path / "step-1"), str(tmp_path / "out.pt")]) == 0
    restored = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(restored["model"], dict(states[1]["model"]))  # a dict, not the OrderedDict it was
    # DCP's planner records an optimizer's integer ids as strings (its own dcp_to_torch_save too).
    assert_same(restored["optim"]["state"], {str(k): v for k, v in states[1]["optim"]["state"].items()})
    assert restored["optim"]["param_groups"] == states[1]["optim"]["param_groups"]
    assert restored["meta"] == states[1]["meta"]
    assert main(["decompress", "--step", "3", str(tmp_path / "step-1"), str(tmp_path / "x.pt")]) == 1
    (tmp_path / "step-1" / "__0.ink").unlink()
    assert main(["decompress", str(tmp_path / "step-1"), str(tmp_path / "y.pt")]) == 1
    assert not (tmp_path / "y.pt").exists()


def test_a_forged_tensor_size_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, storage_writer=InkStorageWriter(tmp_path, policy="lossless"), planner=InkSavePlanner(),
             no_dist=True)
    document = json.loads((tmp_path / METADATA_FILE).read_text())
    document["items"]["model.0.weight"]["size"] = [10**12, 10**6]  # terabytes, were it believed
    (tmp_path / METADATA_FILE).write_text(json.dumps(document))
    with pytest.raises(ink.FormatError, match="model.0.weight"):
        read_dcp(tmp_path)
