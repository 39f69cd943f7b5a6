"""The NumPy fast paths return exactly what the torch operations they replace return."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs._numpy_paths import select, stable_argsort


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("count", [0, 1, 7, 8192, 70_000])
def test_stable_argsort_matches_torchs_stable_argsort(dtype: torch.dtype, count: int) -> None:
    generator = torch.Generator().manual_seed(count)
    low, high = (-100, 100) if dtype.is_signed else (0, 200)
    # Few distinct keys: most positions tie, so only a stable sort gives this order.
    keys = torch.randint(low, high, (count,), generator=generator).to(dtype)
    order = stable_argsort(keys)
    expected = torch.argsort(keys, stable=True)
    assert order.dtype == expected.dtype == torch.int64
    assert torch.equal(order, expected)


def test_stable_argsort_of_a_strided_view() -> None:
    keys = torch.randint(0, 5, (4000,), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    view = keys[::3]
    assert torch.equal(stable_argsort(view), torch.argsort(view.contiguous(), stable=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_select_matches_boolean_indexing(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    values = (torch.randn(5000, generator=generator) * 50).to(dtype)
    mask = torch.rand(5000, generator=generator) < 0.3
    picked = select(values, mask)
    assert picked.dtype == dtype
    assert torch.equal(picked, values[mask])
    assert select(values, torch.zeros_like(mask)).numel() == 0
