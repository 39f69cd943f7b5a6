"""Snapshots: private CPU copies of a state, into spare buffers when they fit."""

from __future__ import annotations

import torch

from inshrinkerator.store.snapshot import SpareBuffers, snapshot_state


def _state() -> dict:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=generator)
    return {
        "model": {"weight": weight, "tied": weight, "t": torch.randn(32, 48, generator=generator).t()},
        "step": torch.tensor(3),
        "note": "x",
    }


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_a_snapshot_copies_into_spare_buffers_laid_out_like_it() -> None:
    state = _state()
    first = snapshot_state(state)
    spare = SpareBuffers(SpareBuffers.layout_of(first.tensors))
    spare = SpareBuffers(SpareBuffers.layout_of(first.tensors))
    addresses = {_storage(buffer) for buffer in spare._buffers}  # noqa: SLF001 - what it will hand out
    state["model"]["weight"].add_(1.0)
    second = snapshot_state(state, spare)
    model = second.state["model"]
    assert torch.equal(model["weight"], state["model"]["weight"]) and model["tied"] is model["weight"]
    assert torch.equal(model["t"], state["model"]["t"]) and model["t"].stride() == state["model"]["t"].stride()
    assert {_storage(t) for t in second.tensors} == addresses
    assert not {_storage(t) for t in first.tensors} & addresses  # spare memory is fresh
    assert second.state["note"] == "x" and second.raw_bytes == first.raw_bytes
    # The caller goes on training: the snapshot keeps the values it copied.
    state["model"]["weight"].add_(1.0)
    assert not torch.equal(model["weight"], state["model"]["weight"])


def test_tensors_that_no_longer_fit_their_buffer_get_fresh_memory_and_a_spare_is_used_once() -> None:
    state = _state()
    spare = SpareBuffers(SpareBuffers.layout_of(snapshot_state(state).tensors))
    held = list(spare._buffers)  # noqa: SLF001 - kept alive: freed memory may be handed out again
    addresses = {_storage(buffer) for buffer in held}
    state["model"]["t"] = torch.zeros(48, 32)  # contiguous now: other strides
    state["step"] = torch.tensor(4.0)  # another dtype
    snap = snapshot_state(state, spare)
    used = [_storage(t) in addresses for t in snap.tensors]
    assert used == [True, False, False]
    assert torch.equal(snap.state["model"]["t"], torch.zeros(48, 32)) and snap.state["step"].dtype == torch.float32
    again = snapshot_state(state, spare)
    assert not any(_storage(t) in addresses for t in again.tensors)
    other = SpareBuffers(SpareBuffers.layout_of(snap.tensors[:1]))  # another number of tensors
    assert other.matching(snap.tensors) == [None, None, None]
