"""The NumPy fast paths return exactly what the torch operations they replace return."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs._numpy_paths import (
    nonzero_positions,
    positions_differing,
    positions_of,
    select,
    stable_argsort,
)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.bfloat16, torch.float16])
def test_select_matches_boolean_indexing(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    values = (torch.randn(5000, generator=generator) * 50).to(dtype)
    mask = torch.rand(5000, generator=generator) < 0.3
    picked = select(values, mask)
    assert picked.dtype == dtype
    assert torch.equal(picked, values[mask])
    assert select(values, torch.zeros_like(mask)).numel() == 0


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("count", [0, 1, 5000])
def test_position_finders_match_torch_nonzero(dtype: torch.dtype, count: int) -> None:
    generator = torch.Generator().manual_seed(count)
    high = 2 if dtype == torch.bool else 6
    values = torch.randint(0, high, (count,), generator=generator).to(dtype)
    other = torch.randint(0, high, (count,), generator=generator).to(dtype)
    found = [
        (nonzero_positions(values), torch.nonzero(values)),
        (positions_differing(values, other), torch.nonzero(values != other)),
    ]
    if dtype != torch.bool:
        # ids as the codecs hold them: a value present, one absent, one beyond the dtype
        for value in (3, 9, 300):
            found.append((positions_of(values, value), torch.nonzero(values == value)))
            found.append((positions_differing(values, value), torch.nonzero(values != value)))
    for got, expected in found:
        assert got.dtype == torch.int64
        assert torch.equal(got, expected.reshape(-1))
    # a strided view is searched along the view
    view = values[::3]
    assert torch.equal(nonzero_positions(view), torch.nonzero(view).reshape(-1))

