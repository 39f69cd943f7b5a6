"""pack_codes / unpack_codes: fixed-width integer codes in bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.bit_packing import pack_codes, packed_size, unpack_codes
from inshrinkerator.errors import CorruptCheckpointError


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), data=st.data())
def test_round_trip(bits: int, data) -> None:
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=100))
    tensor = torch.tensor(codes, dtype=torch.int64)
    packed = pack_codes(tensor, bits)
    assert len(packed) == packed_size(len(codes), bits)
    assert torch.equal(unpack_codes(packed, bits, len(codes)), tensor)


def test_layout_is_lsb_first() -> None:
    assert pack_codes(torch.tensor([1, 2, 3]), 4) == bytes([0x21, 0x03])
    assert pack_codes(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1) == bytes([0b1101, 1])


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="fit"):
        pack_codes(torch.tensor([16]), 4)
    with pytest.raises(ValueError, match="fit"):
        pack_codes(torch.tensor([-1]), 4)
    with pytest.raises(ValueError, match="width"):
        pack_codes(torch.tensor([1]), 9)
    with pytest.raises(CorruptCheckpointError):
        unpack_codes(b"\x00\x00", 4, 5)
