"""The DynaQuant codecs with a context: masked (the context's zeros for free), grouped
(ids coded per octave of the context), the residual grouped by the context's sign, and
the groups themselves."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs import (
    DynaQuantCodec,
    DynaQuantDeltaCodec,
    DynaQuantGroupedCodec,
    DynaQuantMaskedCodec,
    DynaQuantMaskedDeltaCodec,
    ResidualCodec,
    SignGroupedResidualCodec,
    TensorSpec,
    get_codec,
)
from inshrinkerator.codecs.entropy import order0_entropy_bits
from inshrinkerator.codecs.octave_groups import GROUP_MIN_ELEMENTS, octave_groups, sign_groups
from inshrinkerator.errors import BrokenChainError, FormatError

from .lossy_codec_checks import check_damaged_streams, same_bits


def _masked_moment(seed: int = 0, shape: tuple[int, int] = (96, 80)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # A second moment, the same moment a few steps earlier (the reference) and a first
    # moment pruned to about a tenth of its entries (the context).
    generator = torch.Generator().manual_seed(seed)
    previous = torch.exp2(torch.randn(shape, generator=generator) * 3 - 20)
    moment = previous * torch.exp2(torch.randn(shape, generator=generator) * 0.5)
    first = torch.randn(shape, generator=generator) * 1e-3
    first = torch.where(torch.rand(shape, generator=generator) < 0.1, first, 0.0)
    return moment, previous, first


def _stored_refusing_a_missing_or_short_context(codec, tensor, reference, context):
    """``codec``'s encoding of ``tensor`` with ``context``, after checking that encoding or
    decoding without the context, or decoding with one element short, is a FormatError."""
    spec = TensorSpec.of(tensor)
    with pytest.raises(FormatError, match="not given"):
        codec.encode(tensor, reference)
    stored = codec.encode(tensor, reference, context=context)
    with pytest.raises(FormatError, match="not given"):
        codec.decode(stored.streams, stored.params, spec, reference)
    with pytest.raises(FormatError, match="elements"):
        codec.decode(stored.streams, stored.params, spec, reference, context=context.reshape(-1)[:-1])
    return stored


@pytest.mark.parametrize("delta", [False, True])
def test_a_masked_codec_stores_the_context_s_zeros_for_free(delta: bool) -> None:
    moment, previous, first = _masked_moment()
    zeros = first.reshape(-1) == 0
    reference = DynaQuantCodec(bins=8, domain="log").encode(previous).reconstruction if delta else None
    plain_type, masked_type = (DynaQuantDeltaCodec, DynaQuantMaskedDeltaCodec) if delta else (DynaQuantCodec, DynaQuantMaskedCodec)
    levels = DynaQuantCodec(bins=8, domain="log").encode(moment[first != 0]).reconstruction.unique()
    hints = {"centroids": levels[levels > 0]}
    masked = masked_type(bins=8, domain="log").with_hints(**hints)
    plain = plain_type(bins=8, domain="log").with_hints(prune_mask=zeros, **hints)
    stored = masked.encode(moment, reference, context=first)
    same_mask = plain.encode(moment, reference)
    # The same ids where the context is non-zero, 0 elsewhere: the same reconstruction ...
    assert same_bits(stored.reconstruction, same_mask.reconstruction)
    assert torch.equal(stored.reconstruction == 0, first == 0)
    decoded = masked.decode(stored.streams, stored.params, TensorSpec.of(moment), reference, context=first)
    assert same_bits(decoded, stored.reconstruction)
    # ... in fewer bytes by about the mask's own entropy, which the plain codec stores.
    mask_bytes = order0_entropy_bits(zeros.to(torch.uint8), 2) / 8
    saved = sum(map(len, same_mask.streams)) - sum(map(len, stored.streams))
    assert 0.8 * mask_bytes < saved
    # The kept entries alone are coded: a context with fewer zeros costs more.
    denser = torch.where(torch.rand(moment.shape, generator=torch.Generator().manual_seed(1)) < 0.5, 1.0, first)
    assert sum(map(len, masked.encode(moment, reference, context=denser).streams)) > sum(map(len, stored.streams))


def test_a_masked_codec_refuses_a_missing_or_mismatched_context() -> None:
    moment, previous, first = _masked_moment(2, (40, 30))
    for codec, reference in ((DynaQuantMaskedCodec(bins=8, domain="log"), None),
                             (DynaQuantMaskedDeltaCodec(bins=8, domain="log"), previous)):
        spec = TensorSpec.of(moment)
        stored = _stored_refusing_a_missing_or_short_context(codec, moment, reference, first)
        # Another context with other zeros holds another number of coded ids: refused.
        other = torch.where(first == 0, 1.0, 0.0)
        with pytest.raises(FormatError):
            codec.decode(stored.streams, stored.params, spec, reference, context=other)
        check_damaged_streams(codec, moment, reference, context=first)
        assert get_codec(codec.get_config()) == codec and codec.uses_context
    delta = DynaQuantMaskedDeltaCodec(bins=8, domain="log")
    stored = delta.encode(moment, previous, context=first)
    with pytest.raises(BrokenChainError):
        delta.decode(stored.streams, stored.params, TensorSpec.of(moment), None, context=first)
    with pytest.raises(BrokenChainError):
        delta.decode(stored.streams, stored.params, TensorSpec.of(moment), previous * 2, context=first)
    assert delta.against("optimizer/state/0/exp_avg").context_key == "optimizer/state/0/exp_avg"


def _moments_by_octave(seed: int = 0, shape: tuple[int, int] = (200, 160)) -> tuple[torch.Tensor, torch.Tensor]:
    # A second moment over ~20 octaves (with some zeros) and a first moment whose magnitude
    # follows its square root, as Adam's do.
    generator = torch.Generator().manual_seed(seed)
    second = torch.exp2(torch.randn(shape, generator=generator) * 4 - 24)
    second.view(-1)[::50] = 0.0
    first = torch.randn(shape, generator=generator) * second.sqrt()
    return first, second


def test_octave_groups_sort_by_octave_and_hold_enough_elements() -> None:
    _, second = _moments_by_octave()
    values = second.reshape(-1).clone()
    values[:4] = torch.tensor([float("inf"), float("nan"), -2.0 ** -30, 1e-40])  # 1e-40: subnormal
    groups = octave_groups(values)
    order, sizes = groups.order(), groups.sizes
    assert sorted(order.tolist()) == list(range(values.numel())) and sum(sizes) == values.numel()
    assert len(sizes) > 5 and min(sizes) >= GROUP_MIN_ELEMENTS
    octave = torch.frexp(values[order]).exponent
    zero, finite = values[order].abs() < 2.0 ** -126, torch.isfinite(values[order])
    # Zeros (and subnormals) first, non-finite values last, the octaves ascending in
    # between (a negative value by its magnitude); within one octave the positions keep
    # their order (stable).
    assert bool(zero[: int(zero.sum())].all()) and not bool(finite[-2:].any())
    middle = octave[int(zero.sum()) : -2]
    assert bool((middle[1:] >= middle[:-1]).all())
    same = torch.nonzero(torch.frexp(values).exponent == -12).reshape(-1)
    assert torch.equal(order[torch.isin(order, same)], same)
    # A group holds whole octaves: each boundary lies between two of them.
    key = torch.where(zero, -1000, torch.where(finite, octave, 1000))
    for boundary in torch.cumsum(torch.tensor(sizes), 0)[:-1].tolist():
        assert int(key[boundary - 1]) != int(key[boundary])
    few = octave_groups(torch.ones(10))
    assert torch.equal(few.order(), torch.arange(10)) and few.sizes == [10]  # one short group
    assert octave_groups(torch.empty(0)).sizes == []
    # The same values on another device or dtype give the same groups (exact exponents).
    double = octave_groups(values.double())
    assert torch.equal(double.order(), order) and double.sizes == sizes


@pytest.mark.parametrize("dominant", [0.0, 2.0 ** -20])
def test_octave_groups_where_one_octave_holds_most_entries_keep_the_stable_order(dominant: float) -> None:
    # A sparse layer's second moment is mostly zeros; the dominant octave may also lie
    # between others. Gathering and scattering match the full stable sort either way.
    generator = torch.Generator().manual_seed(3)
    values = torch.full((20_000,), dominant)
    spots = torch.randperm(values.numel(), generator=generator)[:3_000]
    values[spots] = torch.exp2(torch.randn(spots.numel(), generator=generator) * 6 - 20)
    groups = octave_groups(values)
    expected = torch.argsort(torch.frexp(values).exponent.masked_fill(values == 0, -1000), stable=True)
    assert torch.equal(groups.order(), expected)
    payload = torch.randint(0, 200, (values.numel(),), generator=generator, dtype=torch.int16)
    gathered = groups.gather(payload)
    assert torch.equal(gathered, payload[expected])
    assert torch.equal(groups.scatter(gathered, torch.empty_like(payload)), payload)
    assert sum(groups.sizes) == values.numel() and min(groups.sizes) >= GROUP_MIN_ELEMENTS


def test_a_grouped_codec_stores_the_plain_values_in_fewer_bytes() -> None:
    first, second = _moments_by_octave()
    plain = DynaQuantCodec(bins=8, protect=0.005)
    grouped = DynaQuantGroupedCodec(bins=8, protect=0.005).against("optimizer/state/0/exp_avg_sq")
    assert grouped.context_key == "optimizer/state/0/exp_avg_sq" and grouped.uses_context
    alone = plain.encode(first)
    stored = grouped.encode(first, context=second)
    assert same_bits(stored.reconstruction, alone.reconstruction)  # the same levels and ids
    decoded = grouped.decode(stored.streams, stored.params, TensorSpec.of(first), context=second)
    assert same_bits(decoded, stored.reconstruction)
    assert sum(map(len, stored.streams)) < 0.8 * sum(map(len, alone.streams))
    # A context unrelated to the tensor groups nothing useful: about the plain size.
    unrelated = grouped.encode(first, context=torch.rand(first.shape, generator=torch.Generator().manual_seed(1)))
    assert sum(map(len, unrelated.streams)) > 0.95 * sum(map(len, alone.streams))
    assert get_codec(grouped.get_config()) == grouped


def test_a_grouped_codec_refuses_a_missing_or_mismatched_context() -> None:
    first, second = _moments_by_octave(3, (60, 50))
    codec = DynaQuantGroupedCodec(bins=8)
    spec = TensorSpec.of(first)
    stored = _stored_refusing_a_missing_or_short_context(codec, first, None, second)
    # Another context puts other numbers of ids in the groups: refused.
    with pytest.raises(FormatError):
        codec.decode(stored.streams, stored.params, spec, context=torch.ones(spec.shape))
    check_damaged_streams(codec, first, context=second)
    # Bytes after the last group are refused too.
    with pytest.raises(FormatError, match="follow the last"):
        codec.decode([bytes(stored.streams[0]) + b"\0"], stored.params, spec, context=second)
    empty = torch.empty(0)
    nothing = codec.encode(empty, context=empty)
    assert codec.decode(nothing.streams, nothing.params, TensorSpec.of(empty), context=empty).numel() == 0


def _change_against_first_moment(seed: int = 0, shape: tuple[int, int] = (96, 80)) -> tuple[torch.Tensor, ...]:
    # A weight, the weight a few Adam steps later (moved mostly against its first moment's
    # sign, with noise), and that first moment.
    generator = torch.Generator().manual_seed(seed)
    reference = torch.randn(shape, generator=generator) * 0.05
    first = torch.randn(shape, generator=generator) * 1e-3
    steps = torch.rand(shape, generator=generator) * 2e-4
    weight = reference - first.sign() * steps + torch.randn(shape, generator=generator) * 5e-5
    return weight, reference, first


def _sign_key(values: torch.Tensor) -> torch.Tensor:
    # 0 negative, 1 zero (-0.0 too), 2 positive, by the float32 sign bit (a NaN by its own).
    bits = values.float().view(torch.int32)
    zero = (bits & 0x7FFFFFFF) == 0
    return torch.where(zero, 1, torch.where(bits < 0, 0, 2))


def test_sign_groups_split_by_sign_and_merge_small_groups() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([-torch.rand(3000) - 0.1, torch.zeros(499), torch.tensor([-0.0, float("nan"), -float("nan")]),
                        torch.rand(2000) + 0.1])
    values = values[torch.randperm(values.numel(), generator=generator)]
    groups = sign_groups(values)
    order = groups.order()
    assert sorted(order.tolist()) == list(range(values.numel()))
    # -NaN with the negatives; the 500 zeros (under GROUP_MIN_ELEMENTS) join NaN and the positives.
    assert groups.sizes == [3001, 2501]
    key = _sign_key(values[order])
    assert bool((key.diff() >= 0).all()) and int((key == 0).sum()) == 3001
    assert sign_groups(torch.ones(10)).sizes == [10] and sign_groups(torch.empty(0)).sizes == []


def test_a_sign_grouped_residual_stores_the_residual_s_values_in_fewer_bytes() -> None:
    weight, reference, first = _change_against_first_moment()
    plain = ResidualCodec(DynaQuantCodec(bins=10))
    grouped = SignGroupedResidualCodec(DynaQuantCodec(bins=10)).against("optimizer/state/0/exp_avg")
    assert grouped.context_key == "optimizer/state/0/exp_avg" and grouped.uses_context and grouped.uses_reference
    alone = plain.encode(weight, reference)
    stored = grouped.encode(weight, reference, context=first)
    assert same_bits(stored.reconstruction, alone.reconstruction)  # the same levels and ids
    decoded = grouped.decode(stored.streams, stored.params, TensorSpec.of(weight), reference, context=first)
    assert same_bits(decoded, stored.reconstruction)
    assert sum(map(len, stored.streams)) < 0.9 * sum(map(len, alone.streams))
    # Signs unrelated to the change group nothing useful: about the plain size.
    unrelated = grouped.encode(weight, reference, context=torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    assert sum(map(len, unrelated.streams)) > 0.95 * sum(map(len, alone.streams))
    assert get_codec(grouped.get_config()) == grouped
    assert type(grouped.standalone()) is ResidualCodec and grouped.standalone().inner == grouped.inner


def test_a_sign_grouped_residual_refuses_a_bad_context_reference_or_inner_codec() -> None:
    weight, reference, first = _change_against_first_moment(3, (60, 50))
    codec = SignGroupedResidualCodec({"id": "dynaquant", "bins": 8})
    spec = TensorSpec.of(weight)
    stored = _stored_refusing_a_missing_or_short_context(codec, weight, reference, first)
    # A context with zeros for half the entries makes two groups where one was stored: refused.
    halved = torch.where(torch.arange(first.numel()).reshape(first.shape) % 2 == 0, 0.0, first)
    with pytest.raises(FormatError):
        codec.decode(stored.streams, stored.params, spec, reference, context=halved)
    with pytest.raises(BrokenChainError):
        codec.decode(stored.streams, stored.params, spec, None, context=first)
    with pytest.raises(BrokenChainError):
        codec.decode(stored.streams, stored.params, spec, reference * 2, context=first)
    check_damaged_streams(codec, weight, reference, context=first)
    for inner in ({"id": "dynaquant_delta", "bins": 8}, {"id": "kmeans_quantize", "bins": 8}, DynaQuantGroupedCodec(bins=8)):
        with pytest.raises(ValueError):
            SignGroupedResidualCodec(inner)


def test_sign_groups_gather_and_scatter_are_inverse_and_match_a_stable_sort() -> None:
    generator = torch.Generator().manual_seed(4)
    for values in (torch.randn(5000, generator=generator), torch.zeros(3000), torch.empty(0),
                   torch.where(torch.rand(4000, generator=generator) < 0.7, 0.0, torch.randn(4000, generator=generator))):
        groups = sign_groups(values)
        expected = torch.argsort(_sign_key(values), stable=True)
        assert torch.equal(groups.order(), expected)
        payload = torch.randint(0, 200, (values.numel(),), generator=generator, dtype=torch.int16)
        gathered = groups.gather(payload)
        assert torch.equal(gathered, payload[expected]) and sum(groups.sizes) == values.numel()
        assert torch.equal(groups.scatter(gathered, torch.empty_like(payload)), payload)
    weight = torch.empty(0)
    codec = SignGroupedResidualCodec(DynaQuantCodec(bins=8))
    nothing = codec.encode(weight, weight, context=weight)
    assert codec.decode(nothing.streams, nothing.params, TensorSpec.of(weight), weight, context=weight).numel() == 0
