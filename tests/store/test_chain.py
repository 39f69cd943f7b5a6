"""Restoring a step reads its own chain and nothing else; damage is reported precisely."""

from __future__ import annotations

import pytest

from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError
from inshrinkerator.container import ContainerReader
from inshrinkerator.serialize import referenced_keys, tensor_keys
from inshrinkerator.store import CheckpointManager, describe_run, verify_run
from inshrinkerator.store.manifest import manifest_name

from ..helpers import assert_same
from .support import state_for


@pytest.fixture
def run_of_two_chains(tmp_path):
    """Steps 0..5 with full_every=3: chains [0, 1, 2] and [3, 4, 5]."""
    run = tmp_path / "run"
    with CheckpointManager(run, full_every=3, policy="lossless") as mgr:
        for step in range(6):
            mgr.save(step, state_for(step))
    return run


def test_loading_a_step_reads_only_its_chain(run_of_two_chains, monkeypatch) -> None:
    run = run_of_two_chains
    entries = {e.step: e for e in describe_run(str(run))}
    opened: list[str] = []
    import builtins

    real_open = builtins.open

    def spying_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spying_open)
    state = CheckpointManager(run).load(4)
    monkeypatch.undo()
    assert_same(state, state_for(4))
    touched = {path.rsplit("/", 1)[-1] for path in opened if str(run) in path}
    assert touched == {
        manifest_name(3), manifest_name(4), entries[3].data_file, entries[4].data_file,
    }


def test_other_chains_can_vanish_without_harm(run_of_two_chains) -> None:
    run = run_of_two_chains
    for path in run.iterdir():
        if path.name.startswith(("step-0000000000", "step-0000000001", "step-0000000002")):
            path.unlink()
    assert_same(CheckpointManager(run).load(5), state_for(5))


def test_missing_base_data_is_a_broken_chain(run_of_two_chains) -> None:
    run = run_of_two_chains
    next(run.glob("step-0000000003-*.ink")).unlink()
    with pytest.raises(BrokenChainError, match="step 5 is stored against it"):
        CheckpointManager(run).load(5)
    with pytest.raises(CorruptCheckpointError, match="step 3 is missing"):
        CheckpointManager(run).load(3)


def _flip_in_tensor(path, referenced: bool) -> str:
    """Flip one byte inside the first tensor of ``path`` that the next step is (or is not)
    stored against; its key."""
    with open(path, "rb") as handle, ContainerReader(handle, str(path)) as reader:
        keys = tensor_keys(reader)
        data_start = reader.data_start
        records = list(zip(keys, reader.header.tensors))
    next_step = int(path.name.split("-")[1]) + 1
    above = next(path.parent.glob(f"step-{next_step:010d}-*.ink"))
    with open(above, "rb") as handle, ContainerReader(handle, str(above)) as reader:
        stored_against = referenced_keys(reader)
    key, record = next((k, r) for k, r in records if (k in stored_against) == referenced and r.stored_bytes)
    data = bytearray(path.read_bytes())
    data[data_start + record.sections[0].offset] ^= 0x40
    path.write_bytes(bytes(data))
    return key


def test_flipped_byte_in_a_base_is_caught(run_of_two_chains) -> None:
    run = run_of_two_chains
    _flip_in_tensor(next(run.glob("step-0000000004-*.ink")), referenced=True)
    with pytest.raises(CorruptCheckpointError, match="step-0000000004-.*damaged"):
        CheckpointManager(run).load(5)
    assert_same(CheckpointManager(run).load(3), state_for(3))


def test_restore_decodes_of_a_base_only_what_the_step_above_needs(run_of_two_chains) -> None:
    # Damage in a base tensor that the next step stores afresh does not stop that step
    # from restoring exactly; loading the base itself and verifying the run both report it.
    run = run_of_two_chains
    key = _flip_in_tensor(next(run.glob("step-0000000004-*.ink")), referenced=False)
    assert_same(CheckpointManager(run).load(5), state_for(5))
    with pytest.raises(CorruptCheckpointError, match="step-0000000004-.*damaged"):
        CheckpointManager(run).load(4)
    problems = verify_run(str(run))
    assert len(problems) == 1 and problems[0].startswith("step 4:"), (key, problems)


def test_data_file_swapped_between_steps_is_caught(run_of_two_chains) -> None:
    run = run_of_two_chains
    one = next(run.glob("step-0000000001-*.ink"))
    four = next(run.glob("step-0000000004-*.ink"))
    one.write_bytes(four.read_bytes())
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest of step 1"):
        CheckpointManager(run).load(1)
