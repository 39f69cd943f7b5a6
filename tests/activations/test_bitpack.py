import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.activations.bitpack import (
    GROUP,
    pack_codes,
    pack_mask,
    packed_size,
    unpack_codes,
    unpack_mask,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), max_size=300))
def test_mask_roundtrip(bits: list[bool]) -> None:
    mask = torch.tensor(bits, dtype=torch.bool)
    packed = pack_mask(mask)
    assert packed.numel() == (len(bits) + 7) // 8
    assert torch.equal(unpack_mask(packed, len(bits)), mask)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=400), st.integers(0, 32))
def test_codes_roundtrip_any_width(values: list[int], clip_bits: int) -> None:
    codes = torch.tensor(values, dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)
    codes = codes % (1 << clip_bits)
    packed = pack_codes(codes)
    assert packed.nbytes == packed_size(codes)
    assert torch.equal(unpack_codes(packed), codes)


def test_width_follows_each_group() -> None:
    small = torch.randint(0, 4, (GROUP * 10,))  # 2 bits per value
    large = torch.randint(0, 1 << 12, (GROUP,))
    packed = pack_codes(torch.cat([small, large]))
    assert packed.widths.tolist() == [2] * 10 + [12]
    assert packed.data.numel() == (10 * 2 + 12) * GROUP // 8


def test_negative_or_huge_codes_refused() -> None:
    import pytest
    with pytest.raises(ValueError, match="codes must lie"):
        pack_codes(torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="codes must lie"):
        pack_codes(torch.tensor([1 << 33]))
