"""Partial reads of a container: what a chain restore decodes of a base step."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from inshrinkerator.container import ContainerReader
from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError
from inshrinkerator.policies import resolve_policy
from inshrinkerator.serialize import (
    read_state,
    read_tensors,
    reference_map,
    referenced_keys,
    tensor_keys,
    write_state,
)

from .helpers import assert_same


def _state(shift: float) -> dict[str, Any]:
    weight = torch.linspace(-1, 1, 512) + shift
    return {
        "model": {"weight": weight, "bias": torch.full((8,), shift)},
        "optimizer": {"exp_avg": torch.linspace(0, 1, 256) * shift, "step": torch.tensor(3)},
        "name": "run",
    }


def _written(state: Any, references: Any = None) -> bytes:
    out = io.BytesIO()
    write_state(out, state, resolve_policy("lossless"), references=references)
    return out.getvalue()


def _reader(data: bytes) -> ContainerReader:
    return ContainerReader(io.BytesIO(data), "mem.ink")


def test_tensor_keys_follow_the_records() -> None:
    with _reader(_written(_state(0.0))) as reader:
        keys = tensor_keys(reader)
    assert sorted(keys) == sorted(reference_map(_state(0.0)))
    assert len(keys) == len(set(keys))


def test_a_subset_decodes_alone_and_matches_the_whole_read() -> None:
    base = _state(0.0)
    delta = _written(_state(0.5), reference_map(base))
    with _reader(delta) as reader:
        stored_against = referenced_keys(reader)
        assert stored_against and stored_against < set(tensor_keys(reader))
        part = read_tensors(reader, stored_against, reference_map(base))
        whole = reference_map(read_state(reader, reference_map(base)))
    assert set(part) == stored_against
    for key, tensor in part.items():
        assert_same(tensor, whole[key])
    # Keys the file does not hold are skipped; None reads everything.
    with _reader(delta) as reader:
        assert read_tensors(reader, {"no/such/key"}, reference_map(base)) == {}
        assert set(read_tensors(reader, None, reference_map(base))) == set(whole)
        assert referenced_keys(reader, among={"model/bias"}) <= {"model/bias"}


def test_a_subset_still_needs_its_references() -> None:
    base = _state(0.0)
    delta = _written(_state(0.5), reference_map(base))
    with _reader(delta) as reader:
        wanted = referenced_keys(reader)
        with pytest.raises(BrokenChainError, match="not given"):
            read_tensors(reader, wanted, {})


def test_damage_outside_the_subset_is_still_caught() -> None:
    data = bytearray(_written(_state(0.0)))
    with _reader(bytes(data)) as reader:
        keys = tensor_keys(reader)
        records = reader.header.tensors
        start = reader.data_start
    skipped = next(i for i, record in enumerate(records) if record.stored_bytes and keys[i] != keys[0])
    data[start + records[skipped].sections[0].offset] ^= 0x01
    with _reader(bytes(data)) as reader:
        with pytest.raises(CorruptCheckpointError, match="damaged"):
            read_tensors(reader, {keys[0]})


def test_a_full_checkpoint_references_nothing() -> None:
    with _reader(_written(_state(0.0))) as reader:
        assert referenced_keys(reader) == set()
        assert torch.equal(read_tensors(reader, {"model/weight"})["model/weight"], _state(0.0)["model"]["weight"])


def test_write_state_plans_with_the_state_it_flattened() -> None:
    from inshrinkerator.policies import Lossless

    class Recording(Lossless):
        seen: list = []

        def plan_state(self, state, leaves, references):
            Recording.seen.append((state, [leaf.path for leaf in leaves]))
            return super().plan_state(state, leaves, references)

    state = _state(0.5)
    write_state(io.BytesIO(), state, Recording())
    (seen_state, paths), = Recording.seen
    assert seen_state is state
    assert ("model", "weight") in paths and ("optimizer", "exp_avg") in paths
