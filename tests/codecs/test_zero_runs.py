"""Zero-run tokens: exact round trips, token counts, and refusal of inconsistent streams."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs.zero_runs import from_run_tokens, to_run_tokens, token_alphabet
from inshrinkerator.errors import CorruptCheckpointError


def _sparse(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.nonzero(values).reshape(-1)
    return positions, values[positions]


@settings(max_examples=60, deadline=None)
@given(
    levels=st.integers(2, 40),
    density=st.floats(0.0, 1.0),
    count=st.integers(0, 3000),
    seed=st.integers(0, 100),
)
def test_round_trip(levels: int, density: float, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(1, levels, (count,), generator=generator)
    values[torch.rand(count, generator=generator) >= density] = 0
    positions, nonzero = _sparse(values)
    runs = to_run_tokens(positions, nonzero, count, levels)
    assert runs.tokens.numel() == 0 or int(runs.tokens.max()) < token_alphabet(levels)
    back_positions, back_values = from_run_tokens(runs.tokens, runs.extra_bits, runs.extra_bit_count, levels, count)
    assert torch.equal(back_positions.long(), positions) and torch.equal(back_values, nonzero)
    # At most one run token per non-zero value, plus a trailing one.
    assert runs.tokens.numel() <= 2 * nonzero.numel() + 1


def test_long_runs_cost_few_tokens() -> None:
    runs = to_run_tokens(torch.tensor([1_000_000]), torch.tensor([3]), 2_000_000, 5)
    assert runs.tokens.numel() == 3
    assert runs.extra_bit_count == 2 * 19  # two long runs, 2**19 <= r < 2**20


def test_inconsistent_streams_are_refused() -> None:
    runs = to_run_tokens(torch.tensor([5, 90]), torch.tensor([1, 2]), 200, 4)
    assert runs.extra_bit_count > 0  # two long runs
    with pytest.raises(CorruptCheckpointError):
        from_run_tokens(runs.tokens, runs.extra_bits, runs.extra_bit_count, 4, 201)
    with pytest.raises(CorruptCheckpointError):
        from_run_tokens(runs.tokens, runs.extra_bits[:-1], runs.extra_bit_count, 4, 200)
    with pytest.raises(CorruptCheckpointError):
        from_run_tokens(runs.tokens + 100, runs.extra_bits, runs.extra_bit_count, 4, 200)
    with pytest.raises(CorruptCheckpointError):
        from_run_tokens(torch.full((30,), 3), b"", 0, 4, 20)
