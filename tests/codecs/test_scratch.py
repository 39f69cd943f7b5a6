"""Scratch buffers: reused per thread and slot inside a block, fresh outside, dropped after it."""

from __future__ import annotations

import threading

import torch

from inshrinkerator.codecs import scratch as scratch_module
from inshrinkerator.codecs.scratch import reusing_scratch, scratch

CPU = torch.device("cpu")
LARGE = 1 << 17


def _pointer(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_outside_a_block_every_call_is_a_fresh_tensor() -> None:
    first = scratch("a", LARGE, torch.int32, CPU)
    second = scratch("a", LARGE, torch.int32, CPU)
    assert first.shape == (LARGE,) and first.dtype == torch.int32
    assert _pointer(first) != _pointer(second)


def test_inside_a_block_a_slot_is_reused_and_slots_are_distinct() -> None:
    with reusing_scratch():
        first = scratch("a", LARGE, torch.int32, CPU)
        again = scratch("a", LARGE // 2, torch.uint8, CPU)
        other = scratch("b", LARGE, torch.int32, CPU)
        assert _pointer(first) == _pointer(again) != _pointer(other)
        assert again.dtype == torch.uint8 and again.numel() == LARGE // 2
        grown = scratch("a", 4 * LARGE, torch.int32, CPU)
        assert grown.numel() == 4 * LARGE
        small = scratch("a", 10, torch.int32, CPU)
        assert _pointer(small) != _pointer(grown)  # small temporaries are not kept
    assert not scratch_module._buffers  # nothing is held after the block


def test_threads_get_their_own_buffers() -> None:
    pointers = []
    with reusing_scratch():
        pointers.append(_pointer(scratch("a", LARGE, torch.int32, CPU)))
        worker = threading.Thread(target=lambda: pointers.append(_pointer(scratch("a", LARGE, torch.int32, CPU))))
        worker.start()
        worker.join()
    assert len(set(pointers)) == 2
