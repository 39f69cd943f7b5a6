"""A delta keeps the error a weight was last stored with (DynaQuant ``carry_error``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.policies import DynaQuant
from inshrinkerator.policies.carried_error import CarriedErrors
from inshrinkerator.tree import TensorLeaf

from .dynaquant_states import codecs_and_bytes, one_thread, small_model, train_steps  # noqa: F401

KEY = "3.weight"  # the small model's one weight large enough to be quantized


def _chain(folder, carry: float, restore: bool = False, deltas: int = 3, refine: float | None = 1.0):
    """A full checkpoint after 40 steps and ``deltas`` deltas 4 steps apart (a weight that
    moves less between checkpoints than its levels' spacing: stored as its change); with
    ``restore``, training goes on from the full checkpoint as loaded (in the same process).
    Returns the exact weights, the loaded ones and each step's stored bytes of the weight."""
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    exact, loaded, stored = {}, {}, {}
    with ink.CheckpointManager(folder, policy=DynaQuant(carry_error=carry, refine_error=refine)) as manager:
        for step in range(deltas + 1):
            train_steps(model, optimizer, 4 if step else 40, start=40 + 4 * step if step else 0)
            state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            exact[step] = state["model"][KEY]
            info = manager.save(step, state)
            assert info.kind == ("full" if step == 0 else "delta")
            if restore and step == 0:
                back = manager.load(0)
                model.load_state_dict(back["model"])
                optimizer.load_state_dict(back["optimizer"])
                exact[step] = back["model"][KEY]
        for step in range(deltas + 1):
            loaded[step] = manager.load(step)["model"][KEY]
    for path in sorted(folder.glob("step-*.ink")):
        step = int(path.name.split("-")[1])
        stored[step] = codecs_and_bytes(path)[f"model/{KEY}"][1]
    return exact, loaded, stored


def _squared(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).square().sum())


def test_a_chain_keeps_the_full_checkpoints_error_in_fewer_bytes(tmp_path) -> None:
    exact, carried, with_carry = _chain(tmp_path / "carry", carry=math.inf)
    _, closed, without = _chain(tmp_path / "closed", carry=0.0)
    full_error = _squared(carried[0], exact[0])
    assert full_error > 0 and _squared(closed[0], exact[0]) == full_error  # the same full checkpoint
    # The deltas do not pay to remove the full checkpoint's error...
    assert sum(with_carry[s] for s in (1, 2, 3)) < sum(without[s] for s in (1, 2, 3))
    for step in (1, 2, 3):
        change = _squared(exact[step], exact[step - 1])
        # ... and keep it, plus a small share of the change: nothing builds up along the chain.
        assert _squared(carried[step], exact[step]) <= 1.2 * full_error + 0.1 * change, step
        # Without carrying, a delta removes most of it.
        assert _squared(closed[step], exact[step]) < 0.5 * full_error


def test_an_error_large_against_the_change_is_coded_away_and_the_smaller_one_kept(tmp_path) -> None:
    exact, gated, with_gate = _chain(tmp_path / "gated", carry=4.0, deltas=5, refine=None)
    _, closed, without = _chain(tmp_path / "closed", carry=0.0, deltas=5, refine=None)
    full_error = _squared(gated[0], exact[0])
    # The full checkpoint's error is several times the first interval's change: without
    # ``refine_error`` the first delta codes it away as without carrying (the same bytes,
    # the same weights).
    assert full_error > 4.0 * _squared(exact[1], exact[0])
    assert with_gate[1] == without[1] and torch.equal(gated[1], closed[1])
    refined = _squared(gated[1], exact[1])
    assert refined < 0.1 * full_error
    # The later deltas keep that delta's smaller error instead of refining it further...
    assert sum(with_gate[s] for s in range(2, 6)) < sum(without[s] for s in range(2, 6))
    for step in range(2, 6):
        change = _squared(exact[step], exact[step - 1])
        error = _squared(gated[step], exact[step])
        assert error <= 1.2 * refined + 0.1 * change, step
        # ... which stays small against the change, unlike the full checkpoint's error.
        assert error < 0.5 * change, step


@pytest.mark.parametrize("refine", [0.5, 1.0])
def test_an_error_coded_away_leaves_refine_error_of_the_change(tmp_path, refine) -> None:
    exact, gated, with_gate = _chain(tmp_path / "gated", carry=2.0, deltas=5, refine=refine)
    _, finest, without = _chain(tmp_path / "finest", carry=2.0, deltas=5, refine=None)
    change = _squared(exact[1], exact[0])
    assert _squared(gated[0], exact[0]) > 2.0 * change  # too large to keep: coded away
    # The first delta leaves about ``refine`` times the training change as error, not a
    # share of the whole change it codes, in fewer bytes...
    error = _squared(gated[1], exact[1])
    assert 0.5 * refine * change <= error <= 1.5 * refine * change
    assert _squared(finest[1], exact[1]) < 0.5 * error
    assert with_gate[1] < without[1]
    # ... and the later deltas keep it, plus a share of their own change.
    for step in range(2, 6):
        later = _squared(exact[step], exact[step - 1])
        assert _squared(gated[step], exact[step]) <= 1.2 * max(error, 2.0 * later) + 0.1 * later, step


def test_after_a_restore_the_change_is_coded_as_it_is(tmp_path) -> None:
    # Training goes on from the full checkpoint as loaded: the weights carry no error of it,
    # so subtracting it would move them further from the reference.
    exact, loaded, _ = _chain(tmp_path / "run", carry=math.inf, restore=True, deltas=1)
    change = _squared(exact[1], exact[0])
    assert _squared(loaded[1], exact[1]) <= 0.1 * change


def test_shifted_only_where_nearer_the_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=generator)
    stored = weight + 0.01 * torch.randn(64, 64, generator=generator)  # the full checkpoint
    carried = CarriedErrors()
    carried._errors["w"] = (weight - stored).to(torch.bfloat16)
    moved = weight + 0.001 * torch.randn(64, 64, generator=generator)
    leaves = [TensorLeaf(("w",), moved)]
    shifted, refining = carried.shifted_leaves(leaves, [stored], [0])
    assert list(shifted) == [0] and refining == {}
    assert _squared(shifted[0].tensor, stored) < 0.1 * _squared(moved, stored)
    # The process restarted from the stored weights: no shift.
    restarted = [TensorLeaf(("w",), stored + 0.001 * torch.randn(64, 64, generator=generator))]
    assert carried.shifted_leaves(restarted, [stored], [0]) == ({}, {})
    # No reference, another shape, or an unknown key: none either.
    assert carried.shifted_leaves(leaves, [None], [0]) == ({}, {})
    assert carried.shifted_leaves([TensorLeaf(("w",), torch.zeros(64, 63))], [torch.zeros(64, 63)], [0]) == ({}, {})
    assert carried.shifted_leaves([TensorLeaf(("v",), moved)], [stored], [0]) == ({}, {})
    # An error large against the change since the reference is not kept: here its squared
    # size is about 100 times the change's. The weight is then one to refine, with the
    # squared size of its change minus the error.
    assert list(carried.shifted_leaves(leaves, [stored], [0], ratio=200.0).leaves) == [0]
    gated, refining = carried.shifted_leaves(leaves, [stored], [0], ratio=50.0)
    assert gated == {} and list(refining) == [0]
    expected = _squared(moved - carried._errors["w"].float(), stored)
    assert refining[0] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("value", [-1.0, math.nan, True, "4"])
def test_the_option_is_a_non_negative_number(value) -> None:
    with pytest.raises(ValueError, match="carry_error"):
        DynaQuant(carry_error=value)


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, True, "4"])
def test_refine_error_is_a_non_negative_number_or_none(value) -> None:
    with pytest.raises(ValueError, match="refine_error"):
        DynaQuant(refine_error=value)
    assert DynaQuant(refine_error=None).refine_error is None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_carrying_chain_restores_through_retention_and_new_full_checkpoints(tmp_path, async_save) -> None:
    # Retention re-plans a kept step whose base it drops as a full checkpoint (with this
    # policy), and the run starts a second chain: every kept step still decodes, as close
    # to the exact weights as its chain's full checkpoint plus a share of its last change.
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    train_steps(model, optimizer, 40)
    exact, full_error = {}, {}
    policy = DynaQuant(carry_error=math.inf)
    with ink.CheckpointManager(
        tmp_path / "run", policy=policy, full_every=3, keep_last=2, async_save=async_save
    ) as manager:
        for step in range(6):
            train_steps(model, optimizer, 4, start=40 + 4 * step)
            state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            exact[step] = state["model"][KEY]
            info = manager.save(step, state)
            if step % 3 == 0:
                manager.wait()
                full_error[step] = _squared(manager.load(step)["model"][KEY], exact[step])
        manager.wait()
        assert manager.steps() == [4, 5]
    assert len(policy._memory.carried) == 1 and info.kind == "delta"
    with ink.CheckpointManager(tmp_path / "run") as reopened:
        for step in (4, 5):
            error = _squared(reopened.load(step)["model"][KEY], exact[step])
            assert error <= 1.2 * full_error[3] + 0.1 * _squared(exact[step], exact[step - 1]), step


def test_settle_hands_the_shifted_change_to_the_writer_and_keeps_what_each_weight_carries() -> None:
    from inshrinkerator.codecs.dynaquant import DynaQuantCodec
    from inshrinkerator.codecs.residual import ResidualCodec

    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 64, generator=generator)
    reference = weight + 0.01 * torch.randn(64, 64, generator=generator)
    leaf = TensorLeaf(("w",), weight)
    shifted = {0: TensorLeaf(("w",), weight - 0.005 * torch.randn(64, 64, generator=generator))}

    def change_codec() -> ResidualCodec:
        return ResidualCodec(DynaQuantCodec(bins=10, prune=0.0, protect=0.0))

    # Planned and encoded on the shifted weight: the writer's encode of the original gets
    # that encoding, and the weight keeps its carried error.
    carried = CarriedErrors()
    carried._errors["w"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    codec = change_codec()
    planned = codec.prepare(shifted[0].tensor, reference)
    codecs = [codec]
    carried.settle([shifted[0]], [leaf], [reference], [0], codecs, shifted)
    assert codecs[0] is codec and "w" in carried
    assert codec.encode(weight, reference) is planned
    # Not encoded from the shifted weight (no path of the policy does that): a codec of the
    # same configuration without its hints takes its place, and the weight carries nothing.
    stale = change_codec()
    stale.prepare(weight + 1.0, reference)
    codecs = [stale]
    carried.settle([shifted[0]], [leaf], [reference], [0], codecs, shifted)
    assert codecs[0] is not stale and codecs[0].get_config() == stale.get_config()
    assert "w" not in carried
    # A change coded from the weight itself (not shifted) carries its own error from now on.
    own = change_codec()
    codecs = [own]
    rebuilt = own.prepare(weight, reference).reconstruction
    carried.settle([leaf], [leaf], [reference], [0], codecs, {})
    assert codecs[0] is own
    assert torch.allclose(carried._errors["w"].float(), (weight - rebuilt).to(torch.bfloat16).float())
    # A weight stored whole carries the error of its levels from now on.
    whole = DynaQuantCodec(bins=16, prune=0.0, protect=0.0)
    codecs = [whole]
    carried.settle([leaf], [leaf], [None], [0], codecs, {})
    rebuilt = whole.prepared_result.reconstruction
    assert torch.allclose(carried._errors["w"].float(), (weight - rebuilt).to(torch.bfloat16).float())
