"""Restoring a step reads its own chain and nothing else; damage is reported precisely."""

from __future__ import annotations

import pytest

from inshrinkerator.container import ContainerReader
from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError
from inshrinkerator.store import CheckpointManager, describe_run
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


def test_flipped_byte_in_a_base_is_caught(run_of_two_chains) -> None:
    run = run_of_two_chains
    path = next(run.glob("step-0000000004-*.ink"))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="step-0000000004-.*damaged"):
        CheckpointManager(run).load(5)
    assert_same(CheckpointManager(run).load(3), state_for(3))


def test_a_base_step_decodes_only_what_the_step_above_is_stored_against(run_of_two_chains, monkeypatch) -> None:
    run = run_of_two_chains
    entries = {e.step: e for e in describe_run(str(run))}
    referenced = {}
    for step in (4, 5):
        with open(run / entries[step].data_file, "rb") as handle, ContainerReader(handle, "x") as reader:
            referenced[step] = sum(record.reference is not None for record in reader.header.tensors)
            records = len(reader.header.tensors)
    assert referenced[5] < records  # some tensors are stored afresh at every step
    decoded: list[int] = []
    real_decode_many = ContainerReader.decode_many

    def counting_decode_many(self, records, *args, **kwargs):
        decoded.append(len(records))
        return real_decode_many(self, records, *args, **kwargs)

    monkeypatch.setattr(ContainerReader, "decode_many", counting_decode_many)
    state = CheckpointManager(run).load(5)
    monkeypatch.undo()
    assert_same(state, state_for(5))
    # Step 5 decodes whole; steps 4 and 3 only the tensors the step above is stored against.
    assert sum(decoded) == referenced[4] + referenced[5] + records


def test_a_chain_restore_parses_each_header_once(run_of_two_chains, monkeypatch) -> None:
    # Every file of the chain is opened twice (headers first, then data), but a header read
    # back byte for byte the same is not parsed again; a file rewritten in between would be.
    import inshrinkerator.container.reader as reader_module

    parsed: list[str] = []
    real_parse = reader_module.parse_header

    def counting_parse(raw, source, *args, **kwargs):
        parsed.append(source.rsplit("/", 1)[-1])
        return real_parse(raw, source, *args, **kwargs)

    monkeypatch.setattr(reader_module, "parse_header", counting_parse)
    state = CheckpointManager(run_of_two_chains).load(5)
    assert_same(state, state_for(5))
    entries = {e.step: e for e in describe_run(str(run_of_two_chains))}
    assert sorted(parsed) == sorted(entries[step].data_file for step in (3, 4, 5))
    headers: dict = {}
    opened = []
    for step in (3, 4, 4):
        with open(run_of_two_chains / entries[step].data_file, "rb") as handle:
            with ContainerReader(handle, entries[step].data_file, headers) as reader:
                opened.append(reader.header)
    assert opened[0] is not opened[1] and opened[1] is opened[2] and len(headers) == 2


def test_data_file_swapped_between_steps_is_caught(run_of_two_chains) -> None:
    run = run_of_two_chains
    one = next(run.glob("step-0000000001-*.ink"))
    four = next(run.glob("step-0000000004-*.ink"))
    one.write_bytes(four.read_bytes())
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest of step 1"):
        CheckpointManager(run).load(1)
