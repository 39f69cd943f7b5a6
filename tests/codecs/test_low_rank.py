"""LowRankResidualCodec: a change as a low-rank product of integer factors plus what it
leaves; GroupedLowRankCodec: a first moment so; LowRankCodec: a tensor as the product alone
or plus what it leaves; ScaledLowRankCodec: the product times the square root of a context."""

from __future__ import annotations

import json
import math
from typing import Optional

import numpy as np
import pytest
import torch

from inshrinkerator.codecs import (
    DynaQuantCodec,
    DynaQuantGroupedCodec,
    GroupedLowRankCodec,
    LowRankCodec,
    LowRankResidualCodec,
    ResidualCodec,
    ScaledLowRankCodec,
    TensorSpec,
    get_codec,
)
from inshrinkerator.codecs.entropy import encode_symbols
from inshrinkerator.codecs.low_rank import (
    FACTOR_LEVELS,
    MAX_RANK,
    LowRankFactors,
    choose_low_rank,
    low_rank_factors,
    low_rank_within,
    matrix_shape,
    rounded_sqrt,
    settled_sqrt,
    step_scale,
)
from inshrinkerator.errors import BrokenChainError, CorruptCheckpointError, FormatError
from inshrinkerator.policies.even_levels import even_levels, spread

from .lossy_codec_checks import (
    chain_errors,
    check_damaged_streams,
    check_golden,
    encode_decode,
    golden_cases,
    same_bits,
)

#: How far a re-encode of a golden case may land from it, in units in the last place of each
#: value (test_golden).
ENCODE_ULPS = 64


def _moved(shape: tuple[int, ...], rank: int, seed: int, noise: float = 2e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, reference)``: a change of about this rank plus some noise, as training makes."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = matrix_shape(shape)  # type: ignore[misc]
    reference = torch.randn(shape, generator=generator) * 0.05
    product = torch.randn(rows, rank, generator=generator) @ torch.randn(rank, cols, generator=generator) * 1e-3
    change = product.reshape(shape) + torch.randn(shape, generator=generator) * noise
    return reference + change, reference


def _even_inner(change: torch.Tensor, leftover: Optional[torch.Tensor] = None, error: float = 0.03) -> DynaQuantCodec:
    """The inner codec the policy gives a change: evenly spaced levels losing ``error`` of
    it, reaching as far as ``leftover`` (what a product leaves of it) where given."""
    rms, largest = spread(change.reshape(-1))
    if leftover is not None:
        largest = spread(leftover.reshape(-1))[1]
    centroids, prune_below = even_levels(rms, largest, error)
    return DynaQuantCodec(bins=10, prune=0.0, protect=0.0).with_hints(centroids=centroids, prune_below=prune_below)


@pytest.mark.parametrize(
    "dtype,shape",
    [(torch.float32, (48, 80)), (torch.float64, (40, 64)), (torch.bfloat16, (32, 48)), (torch.float16, (32, 48)),
     (torch.float32, (32, 16, 3, 3))],
    ids=str,
)
def test_decodes_to_the_encoders_reconstruction_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor, reference = _moved(shape, 3, seed=1)
    codec = LowRankResidualCodec(DynaQuantCodec(bins=10), rank=4)
    decoded = encode_decode(codec, tensor.to(dtype), reference.to(dtype))
    change = (tensor.to(dtype).double() - reference.to(dtype).double())
    error = (decoded.double() - tensor.to(dtype).double()).pow(2).sum() / change.pow(2).sum()
    assert float(error) < 0.05


def test_the_product_is_exact_integer_arithmetic_on_any_path() -> None:
    tensor, reference = _moved((64, 96), 5, seed=2)
    factors = low_rank_factors((tensor - reference).double(), 5)
    assert factors.left.dtype == torch.int8 and int(factors.left.abs().max()) <= FACTOR_LEVELS
    integers = factors.left.double() @ factors.right.double().T  # float64: exact for these sizes
    scale = torch.tensor(factors.left_scale, dtype=torch.float32) * torch.tensor(factors.right_scale, dtype=torch.float32)
    assert same_bits(factors.product(torch.float32), integers.float() * scale)
    # Summed in any order the float32 product is the same: every partial sum is an integer.
    reversed_order = factors.left.flip(1).float() @ factors.right.flip(1).float().T
    assert same_bits(reversed_order * scale, factors.product(torch.float32))


def test_a_low_rank_change_takes_fewer_bytes_at_the_same_error() -> None:
    tensor, reference = _moved((96, 160), 6, seed=3)
    change = tensor - reference
    inner = _even_inner(change)
    plain = ResidualCodec(inner).encode(tensor, reference)
    factors = choose_low_rank(change, float(torch.tensor(float(change.pow(2).mean().sqrt()) * math.sqrt(0.36))))
    assert factors is not None and factors.rank >= 4
    leftover = change - factors.product(torch.float32)
    # The levels keep the change's spacing; they reach as far as what the product leaves.
    low = LowRankResidualCodec(_even_inner(change, leftover), factors.rank).with_factors(factors)
    encoded = low.encode(tensor, reference)
    size = sum(len(bytes(s)) for s in encoded.streams)
    plain_size = sum(len(bytes(s)) for s in plain.streams)
    assert size < 0.8 * plain_size
    error = float((encoded.reconstruction - tensor).pow(2).sum() / change.pow(2).sum())
    plain_error = float((plain.reconstruction - tensor).pow(2).sum() / change.pow(2).sum())
    assert 0.02 < plain_error < 0.04 and error < 1.2 * plain_error


def test_no_rank_is_chosen_for_a_change_without_structure() -> None:
    generator = torch.Generator().manual_seed(4)
    noise = torch.randn(128, 256, generator=generator) * 1e-3
    assert choose_low_rank(noise, 0.6e-3) is None
    assert choose_low_rank(torch.zeros(64, 64), 1e-3) is None
    assert choose_low_rank(noise[:8], 0.6e-3) is None  # too few rows for any rank
    assert choose_low_rank(noise, float("nan")) is None


def test_encoding_leaves_the_callers_random_state_alone() -> None:
    tensor, reference = _moved((64, 64), 4, seed=5)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    LowRankResidualCodec(DynaQuantCodec(bins=10), rank=4).encode(tensor, reference)
    choose_low_rank(tensor - reference, 1e-4)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_closed_loop_chain_does_not_drift() -> None:
    generator = torch.Generator().manual_seed(6)
    state = torch.randn(64, 96, generator=generator) * 0.05
    direction = torch.randn(64, 2, generator=generator) @ torch.randn(2, 96, generator=generator)
    states = [state]
    for _ in range(10):
        state = state + direction * 1e-3 + torch.randn(64, 96, generator=generator) * 1e-4
        states.append(state)
    codec = LowRankResidualCodec(DynaQuantCodec(bins=10), rank=2)
    closed = chain_errors(codec, states)
    # Each step's error is its own rounding only: the tenth is no worse than the first few.
    assert max(closed[5:]) < 2 * max(closed[:5])


def test_config_round_trip_and_refusals() -> None:
    codec = LowRankResidualCodec(DynaQuantCodec(bins=10).get_config(), rank=8)
    assert get_codec(json.loads(json.dumps(codec.get_config()))) == codec
    assert codec.get_config()["rank"] == 8
    for rank in (0, MAX_RANK + 1, True, 2.0):
        with pytest.raises(ValueError, match="rank"):
            LowRankResidualCodec(DynaQuantCodec(bins=10), rank=rank)  # type: ignore[arg-type]
    with pytest.raises(FormatError):
        get_codec({"id": "residual_low_rank", "inner": {"id": "dynaquant"}, "rank": -1})
    tensor, reference = _moved((8, 8), 1, seed=7)
    with pytest.raises(ValueError, match="rank-16"):
        LowRankResidualCodec(DynaQuantCodec(bins=10), rank=16).encode(tensor, reference)
    with pytest.raises(ValueError, match="shape"):
        LowRankResidualCodec(DynaQuantCodec(bins=10), rank=1).encode(tensor[0], reference[0])
    with pytest.raises(ValueError, match="rank"):
        LowRankResidualCodec(DynaQuantCodec(bins=10), rank=2).with_factors(low_rank_factors(tensor - reference, 1))


def test_wrong_or_missing_reference() -> None:
    tensor, reference = _moved((32, 40), 2, seed=8)
    codec = LowRankResidualCodec(DynaQuantCodec(bins=10), rank=2)
    encoded = codec.encode(tensor, reference)
    spec = TensorSpec.of(tensor)
    with pytest.raises(BrokenChainError, match="checksum"):
        codec.decode(encoded.streams, encoded.params, spec, reference * 2)
    with pytest.raises(BrokenChainError, match="missing"):
        codec.decode(encoded.streams, encoded.params, spec, None)
    with pytest.raises(FormatError, match="rank-2"):
        codec.decode(encoded.streams, encoded.params, TensorSpec(torch.float32, (1, 1280)), reference.reshape(1, 1280))


def test_bad_input_and_damaged_streams() -> None:
    tensor, reference = _moved((32, 40), 2, seed=9)
    codec = LowRankResidualCodec(DynaQuantCodec(bins=10), rank=2)
    check_damaged_streams(codec, tensor, reference, mutate_params=lambda p: p.pop("inner"))
    encoded = codec.encode(tensor, reference)
    spec = TensorSpec.of(tensor)
    rest = list(encoded.streams[1:])

    def factor_stream(scales: tuple[float, float], symbols: torch.Tensor, alphabet: int) -> bytes:
        return np.array(scales, dtype="<f4").tobytes() + encode_symbols(symbols, alphabet)

    # Factor streams of one count table, as files written before the column coding hold.
    legacy = LowRankResidualCodec(DynaQuantCodec(bins=10), rank=2, factor_coding="counts")
    good = torch.full((2 * (32 + 40),), FACTOR_LEVELS)
    for scales in ((float("nan"), 1.0), (1.0, 0.0), (-1.0, 1.0), (float("inf"), 1.0)):
        for reader in (codec, legacy):
            with pytest.raises(FormatError, match="scale"):
                reader.decode([factor_stream(scales, good, 31), *rest], encoded.params, spec, reference)
    wide = good.clone()
    wide[3] = 40  # an entry beyond +-15, in a stream whose alphabet allows it
    with pytest.raises(FormatError, match="outside"):
        legacy.decode([factor_stream((1.0, 1.0), wide, 64), *rest], encoded.params, spec, reference)
    with pytest.raises(FormatError):  # factors of another rank
        legacy.decode([factor_stream((1.0, 1.0), good[:-1], 31), *rest], encoded.params, spec, reference)
    # The same factors in one count table decode to what the column coding does.
    factors = LowRankFactors.from_bytes(encoded.streams[0], 32, 40, 2)
    legacy_streams = [factors.to_bytes("counts"), *rest]
    assert same_bits(legacy.decode(legacy_streams, encoded.params, spec, reference), encoded.reconstruction)
    with pytest.raises(FormatError):
        codec.decode([], encoded.params, spec, reference)
    with pytest.raises(FormatError, match="scales"):
        codec.decode([b"\x00" * 4, *rest], encoded.params, spec, reference)


def test_factors_survive_their_byte_form() -> None:
    tensor, reference = _moved((40, 24), 3, seed=10)
    factors = low_rank_factors(tensor - reference, 3)
    again = LowRankFactors.from_bytes(factors.to_bytes(), 40, 24, 3)
    assert torch.equal(again.left, factors.left) and torch.equal(again.right, factors.right)
    assert (again.left_scale, again.right_scale) == (factors.left_scale, factors.right_scale)
    assert same_bits(again.product(torch.float32), factors.product(torch.float32))


def test_matrix_shape() -> None:
    assert matrix_shape((5,)) is None
    assert matrix_shape(()) is None
    assert matrix_shape((4, 6)) == (4, 6)
    assert matrix_shape((8, 3, 3, 3)) == (8, 27)


@pytest.mark.parametrize("case", golden_cases("residual_low_rank"), ids=lambda p: p.name)
def test_golden(case) -> None:
    # The factors come from QR, SVD and matrix products, whose last bits vary with the CPU's
    # instruction set (the decoder, integer factors times stored scales, does not): a
    # re-encode may land some units in the last place of the largest value away (the
    # products of integer factors sum hundreds of their scales' units), far below any
    # level spacing (1e-2 of it and more).
    check_golden(case, encode_ulps=ENCODE_ULPS)


def test_goldens_exist() -> None:
    assert len(golden_cases("residual_low_rank")) >= 1


@pytest.mark.parametrize("codec_id", ["residual_low_rank", "dynaquant_grouped_low_rank"])
def test_goldens_hold_both_factor_codings(codec_id: str) -> None:
    # counts_* cases: written before the column coding, without factor_coding in their config.
    configs = {case.name: json.loads((case / "case.json").read_text())["config"] for case in golden_cases(codec_id)}
    legacy = [name for name in configs if name.startswith("counts_")]
    assert legacy and all("factor_coding" not in configs[name] for name in legacy)
    assert any(config.get("factor_coding") == "columns" for config in configs.values())


def _moments_of_few_directions(seed: int, shape: tuple[int, int] = (64, 96)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, second)``: a first moment mostly along three directions, scaled per entry
    like ``sqrt`` of its second moment (as Adam's are), and that second moment."""
    generator = torch.Generator().manual_seed(seed)
    second = torch.exp2(torch.randn(shape, generator=generator) * 2 - 20)
    first = torch.randn(shape[0], 3, generator=generator) @ torch.randn(3, shape[1], generator=generator) * 1e-4
    first = first + torch.randn(shape, generator=generator) * second.sqrt() * 0.03
    return first, second


def _grouped_even(values: torch.Tensor, leftover: Optional[torch.Tensor] = None, error: float = 0.08) -> DynaQuantGroupedCodec:
    rms, largest = spread(values.reshape(-1))
    if leftover is not None:
        largest = spread(leftover.reshape(-1))[1]
    centroids, prune_below = even_levels(rms, largest, error)
    return DynaQuantGroupedCodec(bins=8, prune=0.0, protect=0.0).with_hints(centroids=centroids, prune_below=prune_below)


def test_a_grouped_low_rank_codec_round_trips_with_its_context_in_fewer_bytes() -> None:
    first, second = _moments_of_few_directions(11)
    factors = choose_low_rank(first, float(torch.tensor(float(first.pow(2).mean().sqrt()) * math.sqrt(12 * 0.08))))
    assert factors is not None
    leftover = first - factors.product(torch.float32)
    codec = GroupedLowRankCodec(_grouped_even(first, leftover), factors.rank).with_factors(factors).against("m/v")
    assert codec.uses_context and codec.context_key == "m/v" and not codec.uses_reference
    encoded = codec.encode(first, context=second)
    spec = TensorSpec.of(first)
    decoded = codec.decode(encoded.streams, json.loads(json.dumps(encoded.params)), spec, context=second)
    assert same_bits(decoded, encoded.reconstruction)
    again = get_codec(json.loads(json.dumps(codec.get_config())))
    assert same_bits(again.decode(encoded.streams, encoded.params, spec, context=second), decoded)
    plain = _grouped_even(first).encode(first, context=second)
    assert sum(len(bytes(s)) for s in encoded.streams) < 0.8 * sum(len(bytes(s)) for s in plain.streams)
    error = float((decoded - first).pow(2).sum() / first.pow(2).sum())
    plain_error = float((plain.reconstruction - first).pow(2).sum() / first.pow(2).sum())
    assert 0.05 < plain_error < 0.11 and error < 1.2 * plain_error


def test_a_grouped_low_rank_codec_refuses_bad_inner_context_and_streams() -> None:
    first, second = _moments_of_few_directions(12, (40, 48))
    with pytest.raises(ValueError, match="dynaquant_grouped"):
        GroupedLowRankCodec(DynaQuantCodec(bins=8), rank=2)
    with pytest.raises(FormatError):
        get_codec({"id": "dynaquant_grouped_low_rank", "inner": {"id": "dynaquant", "bins": 8}, "rank": 2})
    codec = GroupedLowRankCodec(_grouped_even(first), rank=2)
    encoded = codec.encode(first, context=second)
    spec = TensorSpec.of(first)
    with pytest.raises(FormatError, match="not given"):
        codec.decode(encoded.streams, encoded.params, spec)
    with pytest.raises(FormatError, match="elements"):
        codec.decode(encoded.streams, encoded.params, spec, context=second[:10])
    with pytest.raises(ValueError, match="shape"):
        codec.encode(first[0], context=second[0])
    check_damaged_streams(codec, first, context=second, mutate_params=lambda p: p.pop("inner"))


@pytest.mark.parametrize("case", golden_cases("dynaquant_grouped_low_rank"), ids=lambda p: p.name)
def test_grouped_golden(case) -> None:
    check_golden(case, encode_ulps=ENCODE_ULPS)


def test_grouped_goldens_exist() -> None:
    assert len(golden_cases("dynaquant_grouped_low_rank")) >= 1


def _few_directions(shape: tuple[int, int], rank: int, seed: int, noise: float = 0.1) -> torch.Tensor:
    """A matrix mostly along ``rank`` directions, as a momentum buffer of recent gradients is."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = shape
    product = torch.randn(rows, rank, generator=generator) @ torch.randn(rank, cols, generator=generator)
    return product + noise * torch.randn(shape, generator=generator)


def _squared(tensor: torch.Tensor) -> float:
    return float(tensor.double().pow(2).sum())


@pytest.mark.parametrize("inner", [None, DynaQuantCodec(bins=8, prune=0.5)], ids=["product", "with_inner"])
@pytest.mark.parametrize("shape", [(48, 64), (32, 4, 3, 3)])
def test_a_low_rank_codec_decodes_to_its_reconstruction_bit_for_bit(inner, shape) -> None:
    tensor = _few_directions(matrix_shape(shape), 3, seed=1).reshape(shape)  # type: ignore[arg-type]
    codec = LowRankCodec(3, inner)
    encoded = codec.encode(tensor)
    decoded = get_codec(json.loads(json.dumps(codec.get_config()))).decode(encoded.streams, encoded.params, TensorSpec.of(tensor))
    assert decoded.shape == tensor.shape and same_bits(decoded, encoded.reconstruction)
    # The product holds all but the noise; what it leaves, coded, takes part of that too.
    error = _squared(decoded - tensor) / _squared(tensor)
    assert error < (0.01 if inner is None else 0.006)


def test_the_product_alone_loses_what_its_directions_miss() -> None:
    # Rank 3 of a matrix of three directions and noise loses the noise and the rounding of
    # its factors to +-15 (under 1 % here); rank 1 two of the directions.
    tensor = _few_directions((64, 96), 3, seed=2, noise=0.05)
    three = _squared(encode_decode(LowRankCodec(3), tensor) - tensor) / _squared(tensor)
    one = _squared(encode_decode(LowRankCodec(1), tensor) - tensor) / _squared(tensor)
    assert three < 0.01
    assert one > 0.2


def test_low_rank_within_picks_the_least_rank_that_keeps_the_error_allowed() -> None:
    tensor = _few_directions((64, 128), 4, seed=3, noise=0.05)
    total = _squared(tensor)
    factors = low_rank_within(tensor, 0.02 * total)
    assert factors is not None and factors.rank == 4
    rebuilt = factors.product(torch.float32)
    assert _squared(rebuilt - tensor) <= 0.02 * total
    looser = low_rank_within(tensor, 0.6 * total)
    assert looser is not None and looser.rank < 4
    assert _squared(looser.product(torch.float32) - tensor) <= 0.6 * total
    # No rank up to a quarter of the smaller side gets noise that small, nor structureless noise.
    assert low_rank_within(tensor, 1e-6 * total) is None
    noise = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    assert low_rank_within(noise, 0.5 * _squared(noise)) is None
    # Nothing for a product to hold, or nothing to go on.
    assert low_rank_within(tensor, 2 * total) is None
    assert low_rank_within(torch.zeros(64, 128), 1.0) is None
    assert low_rank_within(torch.full((64, 128), float("nan")), 1.0) is None
    assert low_rank_within(tensor[:, :3], 0.5 * total) is None  # a side under 4: no rank


class _TightLowRank(LowRankCodec):
    """A low-rank codec held to a low expansion limit, so its product pads."""

    max_expansion = 64


def test_a_product_far_smaller_than_its_matrix_is_padded_to_the_expansion_limit() -> None:
    tensor = _few_directions((256, 256), 1, seed=5, noise=0.0)
    encoded = _TightLowRank(1).encode(tensor)
    assert len(encoded.streams) == 2
    assert sum(len(bytes(s)) for s in encoded.streams) >= tensor.numel() * 4 // 64
    spec = TensorSpec.of(tensor)
    assert same_bits(_TightLowRank(1).decode(encoded.streams, encoded.params, spec), encoded.reconstruction)
    damaged = [encoded.streams[0], b"\x01" + bytes(encoded.streams[1])[1:]]
    with pytest.raises(CorruptCheckpointError, match="padding"):
        _TightLowRank(1).decode(damaged, encoded.params, spec)
    # The default limit needs no padding here.
    assert len(LowRankCodec(1).encode(tensor).streams) == 1


def test_a_low_rank_codec_refuses_bad_config_input_and_streams() -> None:
    with pytest.raises(ValueError, match="rank"):
        LowRankCodec(0)
    with pytest.raises(ValueError, match="reference nor a context"):
        LowRankCodec(2, ResidualCodec(DynaQuantCodec(bins=8)))
    with pytest.raises(ValueError, match="factor_coding"):
        LowRankCodec(2, factor_coding="rows")
    with pytest.raises(FormatError):
        get_codec({"id": "low_rank", "rank": "two"})
    with pytest.raises(ValueError):
        LowRankCodec(2).encode(torch.randn(100))  # a vector is no matrix
    with pytest.raises(ValueError):
        LowRankCodec(8).encode(torch.randn(4, 100))  # a rank above the smaller side
    tensor = _few_directions((48, 64), 2, seed=6)
    spec = TensorSpec.of(tensor)
    encoded = LowRankCodec(2).encode(tensor)
    with pytest.raises(FormatError, match="streams"):
        LowRankCodec(2).decode([*encoded.streams, b"", b""], encoded.params, spec)
    with pytest.raises(FormatError, match="streams"):
        LowRankCodec(2).decode([], encoded.params, spec)
    with pytest.raises(FormatError):
        LowRankCodec(2).decode([bytes(encoded.streams[0])[:5]], encoded.params, spec)
    with pytest.raises(FormatError):
        LowRankCodec(2).decode(encoded.streams, encoded.params, TensorSpec(torch.float32, (100,)))
    with pytest.raises(FormatError):
        LowRankCodec(2).decode(encoded.streams, encoded.params, TensorSpec(torch.int64, (48, 64)))
    inner = LowRankCodec(2, DynaQuantCodec(bins=8))
    with_inner = inner.encode(tensor)
    with pytest.raises(FormatError, match="inner"):
        inner.decode(with_inner.streams, {}, spec)
    check_damaged_streams(inner, tensor)
    check_damaged_streams(LowRankCodec(2), tensor)


@pytest.mark.parametrize("case", golden_cases("low_rank"), ids=lambda p: p.name)
def test_low_rank_golden(case) -> None:
    check_golden(case, encode_ulps=ENCODE_ULPS)


def test_low_rank_goldens_exist() -> None:
    configs = [json.loads((case / "case.json").read_text())["config"] for case in golden_cases("low_rank")]
    assert {config["inner"] is None for config in configs} == {True, False}


def _adam_moments(seed: int, shape: tuple[int, int] = (48, 80)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, v)``: a second moment spread over octaves, and a first moment whose steps
    ``m / sqrt(v)`` lie mostly along two directions (as a layer's Adam steps do)."""
    generator = torch.Generator().manual_seed(seed)
    v = torch.exp2(torch.randn(shape, generator=generator) * 2 - 20)
    steps = _few_directions(shape, 2, seed + 1, noise=0.05) * 0.1
    return steps * v.sqrt(), v


def test_a_scaled_product_decodes_to_its_reconstruction_with_its_context() -> None:
    m, v = _adam_moments(7)
    codec = ScaledLowRankCodec(2).against("v")
    encoded = codec.encode(m, None, context=v)
    decoded = get_codec(codec.get_config()).decode(encoded.streams, encoded.params, TensorSpec.of(m), None, context=v)
    assert same_bits(decoded, encoded.reconstruction)
    # The steps m / sqrt(v) are what the product holds: their error is small although m
    # spans many octaves, and m itself is never larger than its steps allow.
    steps, restored = m / step_scale(v, torch.float32), decoded / step_scale(v, torch.float32)
    assert _squared(restored - steps) / _squared(steps) < 0.01
    plain = encode_decode(LowRankCodec(2), m)  # the same rank on m itself misses the steps
    assert _squared(plain / step_scale(v, torch.float32) - steps) / _squared(steps) > 0.1
    # A restored step is the product's value: no larger than the steps it was fitted to
    # (up to the factors' rounding), wherever v is small.
    assert float(restored.abs().max()) <= 1.2 * float(steps.abs().max())


def test_a_scaled_product_refuses_a_missing_or_wrong_context_and_bad_streams() -> None:
    m, v = _adam_moments(8)
    codec = ScaledLowRankCodec(2)
    spec = TensorSpec.of(m)
    with pytest.raises(ValueError, match="another tensor"):
        codec.encode(m)
    encoded = codec.encode(m, None, context=v)
    with pytest.raises(FormatError, match="another tensor"):
        codec.decode(encoded.streams, encoded.params, spec)
    with pytest.raises(FormatError, match="elements"):
        codec.decode(encoded.streams, encoded.params, spec, None, context=v[:, :10])
    with pytest.raises(FormatError, match="streams"):
        codec.decode([*encoded.streams, b"", b""], encoded.params, spec, None, context=v)
    with pytest.raises(FormatError):
        codec.decode([bytes(encoded.streams[0])[:3]], encoded.params, spec, None, context=v)
    with pytest.raises(ValueError, match="rank"):
        ScaledLowRankCodec(65)
    check_damaged_streams(codec, m, context=v)
    # A negative context value (no second moment has one) counts as 0: finite values.
    negative = -v
    encoded = codec.encode(m, None, context=negative)
    decoded = codec.decode(encoded.streams, encoded.params, spec, None, context=negative)
    assert bool(torch.isfinite(decoded).all()) and same_bits(decoded, encoded.reconstruction)


@pytest.mark.parametrize("case", golden_cases("low_rank_scaled"), ids=lambda p: p.name)
def test_scaled_golden(case) -> None:
    check_golden(case, encode_ulps=ENCODE_ULPS)


def test_scaled_goldens_exist() -> None:
    assert len(golden_cases("low_rank_scaled")) >= 1


def test_square_roots_are_correctly_rounded_on_every_instruction_set() -> None:
    # The hardware's float32 square root is correctly rounded (IEEE 754); torch.sqrt on
    # the CPU may go through a vector math library that is not. The scaled codec's decode
    # must give the same bits everywhere, so it settles each root itself.
    generator = np.random.default_rng(0)
    bits = generator.integers(0, 0x7F800000, size=200_000, dtype=np.uint32)  # finite, >= 0
    edges = np.array([0.0, 1.0, 2.0, 4.0, 0.25, 1e-45, np.finfo(np.float32).tiny, np.finfo(np.float32).max], dtype=np.float32)
    values = np.concatenate([bits.view(np.float32), edges])
    # The CPU path is NumPy's (the processor's instruction); the torch-only path other
    # devices take must land on the same bits.
    for root in (rounded_sqrt, settled_sqrt):
        roots = root(torch.from_numpy(values)).numpy()
        assert np.array_equal(roots.view(np.uint32), np.sqrt(values).view(np.uint32)), root.__name__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_products_alone_round_trip_in_other_float_dtypes(dtype) -> None:
    m, v = _adam_moments(9)
    m, v = m.to(dtype), v.to(dtype)
    for codec, context in ((LowRankCodec(2), None), (ScaledLowRankCodec(2), v)):
        extra = {} if context is None else {"context": context}
        encoded = codec.encode(m, None, **extra)
        decoded = codec.decode(encoded.streams, encoded.params, TensorSpec.of(m), None, **extra)
        assert decoded.dtype == dtype and same_bits(decoded, encoded.reconstruction)
        assert bool(torch.isfinite(decoded).all())
