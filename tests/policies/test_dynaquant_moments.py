"""How DynaQuant stores the optimizer state: first moments and their pruning, the joint\nmask, second moments, and the statistics of other torch optimizers."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.codecs import DynaQuantCodec, DynaQuantDeltaCodec, DynaQuantGroupedCodec
from inshrinkerator.policies import DynaQuant
from inshrinkerator.policies.dynaquant_moments import SMALL_MOMENT_ERROR
from inshrinkerator.tree import flatten, format_key_path

from ..helpers import assert_same
from .dynaquant_states import (  # noqa: F401 - one_thread: autouse
    by_key,
    codecs_and_bytes,
    level_count,
    one_thread,
    small_model,
    train_steps,
    trained_states,
)


def test_the_moments_of_small_weights_are_quantized() -> None:
    _, (state,) = trained_states(1)
    flat = flatten(state)
    paths = [format_key_path(leaf.path) for leaf in flat.tensors]
    by_path = dict(zip(paths, DynaQuant(small_weight_error=None).plan(flat.tensors, [None] * len(flat.tensors))))
    # the last layer's weight has 320 values: under min_numel, over moment_min_numel
    assert by_path["model/5.weight"].lossless
    assert isinstance(by_path["optimizer/state/4/exp_avg"], DynaQuantCodec)
    assert by_path["optimizer/state/4/exp_avg_sq"].domain == "log"
    # its bias's 10 values are under both
    assert by_path["optimizer/state/5/exp_avg"].lossless and by_path["optimizer/state/5/exp_avg_sq"].lossless
    exact = dict(zip(paths, DynaQuant(moment_min_numel=1024).plan(flat.tensors, [None] * len(flat.tensors))))
    assert exact["optimizer/state/4/exp_avg"].lossless and exact["optimizer/state/4/exp_avg_sq"].lossless
    # their bytes are mostly the record and the level table: twice the levels cost little
    # (the first moment's levels are evenly spaced, stored as their step)
    assert by_path["optimizer/state/4/exp_avg_sq"].bins == 2 * by_path["optimizer/state/2/exp_avg_sq"].bins
    unspaced = dict(zip(paths, DynaQuant(first_moment_error=None).plan(flat.tensors, [None] * len(flat.tensors))))
    assert unspaced["optimizer/state/4/exp_avg"].bins == 2 * level_count(unspaced["optimizer/state/2/exp_avg"])


def test_the_first_moments_of_small_weights_are_not_pruned(tmp_path) -> None:
    _, (state,) = trained_states(1)
    ink.save(state, tmp_path / "m.ink", policy=DynaQuant(first_moment_keep=0.1, first_moment_keep_after=0, low_rank_steps=False))
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"]
    m = state["optimizer"]["state"][4]["exp_avg"]
    assert float((loaded[2]["exp_avg"] != 0).float().mean()) < 0.13  # the large weight's: pruned
    # the small weight's: only entries nearer 0 than the smallest level become 0
    assert float(m.abs()[loaded[4]["exp_avg"] != 0].sum() / m.abs().sum()) > 0.9


def test_sgd_momentum_is_quantized_too(tmp_path) -> None:
    _, (state,) = trained_states(1, optimizer="sgd")
    flat = flatten(state)
    codecs = DynaQuant().plan(flat.tensors, [None] * len(flat.tensors))
    by_path = {format_key_path(leaf.path): codec for leaf, codec in zip(flat.tensors, codecs)}
    assert isinstance(by_path["optimizer/state/2/momentum_buffer"], DynaQuantCodec)
    ink.save(state, tmp_path / "sgd.ink", policy="dynaquant")
    assert ink.load(tmp_path / "sgd.ink")["optimizer"]["state"][2]["momentum_buffer"].shape == (32, 512)


def test_first_moments_keep_the_steadiest_entries(tmp_path) -> None:
    _, (state,) = trained_states(1)
    ink.save(state, tmp_path / "m.ink", policy=DynaQuant(first_moment_keep=0.1, first_moment_keep_after=0, low_rank_steps=False))
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"][2]
    m, v = state["optimizer"]["state"][2]["exp_avg"], state["optimizer"]["state"][2]["exp_avg_sq"]
    kept = loaded["exp_avg"] != 0
    assert 0.07 < float(kept.float().mean()) < 0.13
    score = m.abs() / (v.sqrt() + 1e-8)
    cut = float(torch.quantile(score.flatten(), 0.9))
    assert float(score[kept].min()) >= 0.95 * cut  # nothing below the score cut survives
    # ... and above it only the entries nearer 0 than the smallest level become 0
    assert float(kept[score >= cut].float().mean()) > 0.75
    ink.save(state, tmp_path / "all.ink", policy=DynaQuant())
    restored = ink.load(tmp_path / "all.ink")["optimizer"]["state"][2]["exp_avg"]
    # A full checkpoint prunes nothing by default: only entries nearer 0 than the smallest
    # level become 0.
    assert float(m.abs()[restored != 0].sum() / m.abs().sum()) > 0.8
    sgd = trained_states(1, optimizer="sgd")[1][0]
    pruned = DynaQuant(momentum_keep=0.3, first_moment_keep_after=0, low_rank_momentum=False)
    ink.save(sgd, tmp_path / "s.ink", policy=pruned)
    buffer = ink.load(tmp_path / "s.ink")["optimizer"]["state"][2]["momentum_buffer"]
    assert 0.25 < float((buffer != 0).float().mean()) < 0.35


@pytest.mark.parametrize("joint", [False, True])
def test_bfloat16_moments_are_pruned_and_masked_too(tmp_path, joint) -> None:
    # The kept entries' histograms are made from the kept values themselves: a dtype NumPy
    # lacks must take the same path as float32.
    _, (state,) = trained_states(1, optimizer="adam95" if joint else "adam")
    for entry in state["optimizer"]["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            entry[name] = entry[name].to(torch.bfloat16)
    policy = DynaQuant(first_moment_keep=0.1, first_moment_keep_after=0, joint_moment_mask=joint, low_rank_steps=False)
    ink.save(state, tmp_path / "m.ink", policy=policy)
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"]
    large = [key for key, entry in state["optimizer"]["state"].items() if entry["exp_avg"].numel() >= 1024]
    assert large
    for key in large:
        m, restored = state["optimizer"]["state"][key]["exp_avg"], loaded[key]["exp_avg"]
        assert restored.dtype == torch.bfloat16
        kept = float((restored != 0).float().mean())
        assert 0.03 < kept < 0.13
        assert bool((restored.float() * m.float() >= 0).all())
        if joint:  # the second moment takes the first moment's zeros
            assert bool((loaded[key]["exp_avg_sq"][restored == 0] == 0).all())


@pytest.mark.parametrize("bins, keep", [(4, 1.0), (16, 1.0), (4, 0.15)])
def test_first_moments_are_never_rounded_to_more_than_twice_their_size(tmp_path, bins, keep) -> None:
    # 0 is one of the levels: a tiny entry becomes 0 rather than the smallest level, so a
    # restored Adam step m / sqrt(v) is never blown up by the first moment (also among the
    # entries first_moment_keep keeps, whose |m| can be small where v is small).
    _, states = trained_states(2)
    state = states[1]
    ink.save(state, tmp_path / "m.ink", policy=DynaQuant(moment_bins=bins, first_moment_keep=keep, first_moment_keep_after=0, low_rank_steps=False))
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"]
    for key, entry in state["optimizer"]["state"].items():
        m, restored = entry["exp_avg"], loaded[key]["exp_avg"]
        if m.numel() < 1024:
            continue
        assert bool((restored * m >= 0).all())
        # 2x, plus the sketch's bucket width (1.6%) on both sides of a cell boundary
        assert bool((restored.abs() <= 2.1 * m.abs()).all())
        zeros = float((restored == 0).float().mean())
        assert 0 < zeros < 0.9 if keep == 1.0 else 1.0 - keep - 0.02 < zeros < 1.0


@pytest.mark.parametrize("joint, beta2", [(True, 0.95), (False, 0.95), (True, 0.999)])
def test_a_pruned_first_moment_entry_restarts_with_a_zero_second_moment(tmp_path, joint, beta2) -> None:
    # With beta2 = 0.999 a restart would grow the steps up to 14x: the moment stays whole.
    _, (state,) = trained_states(1, optimizer="adam95" if beta2 == 0.95 else "adam")
    joint = joint and beta2 == 0.95
    policy = DynaQuant(first_moment_keep=0.1, first_moment_keep_after=0, joint_moment_mask=joint, low_rank_steps=False)
    info = ink.save(state, tmp_path / "m.ink", policy=policy)
    loaded = ink.load(tmp_path / "m.ink")["optimizer"]["state"]
    large = [key for key, entry in state["optimizer"]["state"].items() if entry["exp_avg"].numel() >= 1024]
    assert large
    for key in large:
        v = state["optimizer"]["state"][key]["exp_avg_sq"]
        m_restored, v_restored = loaded[key]["exp_avg"], loaded[key]["exp_avg_sq"]
        assert float((m_restored != 0).float().mean()) < 0.13
        # no restored step divides a kept momentum by a zero second moment
        assert bool((v_restored[m_restored != 0] > 0).all())
        zeros = v_restored == 0
        if joint:
            assert 0.85 < float(zeros.float().mean()) < 0.95
            assert bool((m_restored[zeros] == 0).all())
            # the levels are fitted on the kept entries alone: each stays near its value
            octaves = (v_restored[~zeros] / v[~zeros]).log2().abs()
            assert float(octaves.max()) < 2.0 and float(octaves.mean()) < 0.4  # 0.49 if fitted on all
        else:
            assert bool((zeros == (v == 0)).all())
    whole = ink.save(state, tmp_path / "whole.ink", policy=dataclasses.replace(policy, joint_moment_mask=False))
    assert (info.stored_bytes < whole.stored_bytes) if joint else (info.stored_bytes == whole.stored_bytes)
    with pytest.raises(ValueError, match="joint_moment_mask"):
        DynaQuant(joint_moment_mask=1)


def _adam_entry(step: int, m: torch.Tensor, v: torch.Tensor) -> dict:
    weight = torch.linspace(-1, 1, m.numel()).reshape(m.shape)
    return {
        "model": {"w": weight},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]},
    }


@pytest.mark.parametrize("v_moves", [False, True])
def test_the_second_moment_keeps_the_smaller_of_whole_and_joint(tmp_path, v_moves) -> None:
    # Between two checkpoints 40 steps apart the first moment changes (so does its pruning
    # mask). The joint encoding stores only the kept entries (the mask is read from the
    # first moment): where the second moment moved everywhere it is far smaller; where it
    # barely moved both are cheap deltas, and the smaller is stored.
    generator = torch.Generator().manual_seed(7)
    shape = (256, 64)
    v0 = torch.rand(shape, generator=generator).pow(4) * 1e-4 + 1e-8
    v1 = torch.rand(shape, generator=generator).pow(4) * 1e-4 + 1e-8 if v_moves else v0 * 1.0001
    states = [
        _adam_entry(0, torch.randn(shape, generator=generator) * 1e-3, v0),
        _adam_entry(40, torch.randn(shape, generator=generator) * 1e-3, v1),
    ]
    stored, kinds = {}, {}
    for joint in (True, False):
        folder = tmp_path / str(joint)
        with ink.CheckpointManager(folder, policy=DynaQuant(joint_moment_mask=joint)) as manager:
            for step, state in zip((0, 40), states):
                manager.save(step, state)
        with ink.CheckpointManager(folder) as reader:
            restored = reader.load(40)["optimizer"]["state"][0]
        stored[joint] = sum(f.stat().st_size for f in folder.rglob("*.ink"))
        m_zeros = restored["exp_avg"] == 0
        v_zeros = restored["exp_avg_sq"] == 0
        assert float(m_zeros.float().mean()) > 0.85  # pruned either way
        kinds[joint] = "joint" if bool(v_zeros.any()) else "whole"
        if kinds[joint] == "joint":
            assert torch.equal(v_zeros, m_zeros)
    assert kinds[False] == "whole"
    assert stored[True] <= stored[False]
    if v_moves:
        assert kinds[True] == "joint" and stored[True] < 0.9 * stored[False]


def test_a_chain_of_jointly_masked_moments_restores_at_every_step(tmp_path) -> None:
    # Each masked second moment is a delta against the previous one and reads its zeros from
    # its own checkpoint's first moment: restoring the end of the chain decodes, of every
    # base step, the second moment and the first moment it takes its zeros from.
    generator = torch.Generator().manual_seed(11)
    shape = (128, 64)
    states = [
        _adam_entry(40 * k, torch.randn(shape, generator=generator) * 1e-3,
                    torch.rand(shape, generator=generator).pow(4) * 1e-4 + 1e-8)
        for k in range(4)
    ]
    with ink.CheckpointManager(tmp_path / "run", policy=DynaQuant()) as manager:
        for state in states:
            manager.save(int(state["optimizer"]["state"][0]["step"]), state)
    from inshrinkerator.container import ContainerReader

    masked = 0
    for path in (tmp_path / "run").rglob("*.ink"):
        with ContainerReader(open(path, "rb"), str(path)) as container:
            masked += sum(record.codec["id"] == "dynaquant_masked_delta" for record in container.header.tensors)
    assert masked == 3  # the second moment of every delta
    with ink.CheckpointManager(tmp_path / "run") as reader:
        for step in (120, 80, 40, 0):  # the longest chain first
            entry = reader.load(step)["optimizer"]["state"][0]
            m_zeros, v_zeros = entry["exp_avg"] == 0, entry["exp_avg_sq"] == 0
            if step:
                assert float(m_zeros.float().mean()) > 0.85 and torch.equal(v_zeros, m_zeros)
            else:  # a full checkpoint: nothing pruned
                assert not bool(v_zeros.any())


def test_the_second_moment_choice_settles_on_the_smaller_encoding() -> None:
    from inshrinkerator.codecs.base import Encoded
    from inshrinkerator.codecs.bucket_delta import EntropyStats
    from inshrinkerator.policies.dynaquant import _Memory
    from inshrinkerator.policies.dynaquant_moments import _Candidate, _SecondMomentChoice

    def candidate(codec):
        return _Candidate(codec, EntropyStats(), {})

    whole, joint = DynaQuantDeltaCodec(bins=8), DynaQuantDeltaCodec(bins=4)
    plain, grouped = DynaQuantCodec(bins=8), DynaQuantGroupedCodec(bins=8)

    def size(n):
        return Encoded([b"x" * n])

    choice = _SecondMomentChoice(candidate(whole), candidate(joint), 0, candidate(plain), candidate(grouped))
    alone = _SecondMomentChoice(candidate(whole), candidate(joint), 0, candidate(plain))
    assert choice.settle(size(20), size(10), size(30), None, _Memory()) == (joint, plain)
    assert choice.settle(size(10), size(20), size(30), None, _Memory()) == (whole, plain)
    assert choice.settle(size(10), size(10), size(30), None, _Memory()) == (whole, plain)  # a tie keeps it whole
    assert choice.settle(size(10), None, size(30), None, _Memory()) == (whole, plain)  # no joint encoding
    # The pair decides: the joint second moment is smaller alone, the grouped first moment
    # (which needs the whole second moment) more than makes up for it.
    assert choice.settle(size(20), size(10), size(30), size(15), _Memory()) == (whole, grouped)
    assert choice.settle(size(20), size(10), size(30), size(25), _Memory()) == (joint, plain)
    assert choice.settle(size(20), size(30), size(30), size(35), _Memory()) == (whole, plain)
    assert alone.settle(size(20), size(10), size(30), None, _Memory()) == (joint, plain)


def test_the_joint_mask_needs_betas_that_keep_a_restart_s_steps_within_twice() -> None:
    from inshrinkerator.policies.dynaquant_moments import RESTART_STEP_GROWTH, restart_step_growth

    assert 1.9 < restart_step_growth((0.9, 0.95)) <= RESTART_STEP_GROWTH == 2.0
    assert 13.0 < restart_step_growth([0.9, 0.999]) < 14.0
    assert restart_step_growth((0.9, 0.5)) == pytest.approx(1.0)  # a short memory: no growth
    for unknown in (None, (0.9,), (0.9, 1.0), ("a", "b"), 0.9):
        assert restart_step_growth(unknown) == float("inf")
    # Without the state (plan() alone) the betas are unknown: the moment stays whole.
    generator = torch.Generator().manual_seed(5)
    state = _adam_entry(0, torch.randn(256, 64, generator=generator), torch.rand(256, 64, generator=generator) + 0.1)
    leaves = flatten(state).tensors
    codecs = DynaQuant(first_moment_keep_after=0).plan(leaves, [None] * len(leaves))
    paths = [format_key_path(leaf.path) for leaf in leaves]
    second = paths.index("optimizer/state/0/exp_avg_sq")
    restored = codecs[second].encode(leaves[second].tensor).reconstruction
    assert bool((restored > 0).all())
    planned = DynaQuant(first_moment_keep_after=0).plan_state(state, leaves, [None] * len(leaves))
    first = paths.index("optimizer/state/0/exp_avg")
    assert planned[second].uses_context and planned[second].context_key == paths[first]
    context = planned[first].encode(leaves[first].tensor).reconstruction
    restored = planned[second].encode(leaves[second].tensor, context=context).reconstruction
    assert float((restored == 0).float().mean()) > 0.85 and torch.equal(restored == 0, context == 0)


def _kept_first_moment(run, step) -> float:
    reader = ink.CheckpointManager(run)
    moment = reader.load(step)["optimizer"]["state"][2]["exp_avg"]
    reader.close()
    return float((moment != 0).float().mean())


@pytest.mark.parametrize("after, pruned", [(5, True), (6, False)])
def test_first_moments_are_pruned_only_far_enough_from_the_checkpoint_before(tmp_path, after, pruned) -> None:
    # The states are 5 Adam steps apart, the first 5 steps after the optimizer's start: the
    # full checkpoint and the delta both prune when first_moment_keep_after <= 5.
    _, states = trained_states(2)
    manager = ink.CheckpointManager(tmp_path / "run", policy=DynaQuant(first_moment_keep=0.1, first_moment_keep_after=after, low_rank_steps=False))
    for step, state in enumerate(states):
        manager.save(step, state)
    manager.close()
    for step in (0, 1):
        kept = _kept_first_moment(tmp_path / "run", step)
        assert kept <= 0.11 if pruned else kept > 0.5


def test_a_full_checkpoint_counts_its_steps_from_the_save_before_it(tmp_path) -> None:
    # Every checkpoint full, 5 Adam steps apart: the policy remembers its previous save (5
    # steps: every entry kept); a fresh policy counts from the optimizer's start (15: pruned).
    # (k-means levels: evenly spaced ones round more of a whole moment's entries to 0.)
    _, states = trained_states(3)
    options = {"first_moment_keep": 0.1, "first_moment_keep_after": 6, "first_moment_error": None, "low_rank_steps": False}
    manager = ink.CheckpointManager(tmp_path / "run", policy=DynaQuant(**options), full_every=1)
    for step, state in enumerate(states):
        manager.save(step, state)
    manager.close()
    assert all(_kept_first_moment(tmp_path / "run", step) > 0.5 for step in range(3))
    fresh = ink.CheckpointManager(tmp_path / "fresh", policy=DynaQuant(**options))
    fresh.save(2, states[2])
    fresh.close()
    assert _kept_first_moment(tmp_path / "fresh", 2) <= 0.11


def test_an_older_state_planned_again_does_not_move_the_remembered_counter_back() -> None:
    # Full checkpoints (no references) of states 5 optimizer steps apart (counters 5 ... 20).
    _, states = trained_states(4)
    leaves = [flatten(state).tensors for state in states]
    policy = DynaQuant()

    def steps(index: int) -> int:
        return policy._steps_since_last_checkpoint(leaves[index], [None] * len(leaves[index]))

    assert steps(0) == 5  # the first: since the optimizer started
    assert steps(1) == 5
    assert steps(0) == 5  # an older step re-planned (a re-base): counted from the start
    assert steps(3) == 10  # still from the last save (counter 10), not from the re-based 5


def _kept_momentum(run, step) -> float:
    reader = ink.CheckpointManager(run)
    buffer = reader.load(step)["optimizer"]["state"][2]["momentum_buffer"]
    reader.close()
    return float((buffer != 0).float().mean())


@pytest.mark.parametrize("watched, steps, pruned", [(True, 6, True), (True, 5, False), (False, 6, False)])
def test_sgd_momentum_is_pruned_only_when_the_watch_counts_the_steps(tmp_path, watched, steps, pruned) -> None:
    # SGD keeps no step counters: the watched model's backward passes since it was watched
    # (first save) and since the previous save (the delta) are the steps.
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    # (Pruned, not stored as a product: test_a_pruned_momentum_buffer_of_few_directions_is_a_product.)
    policy = DynaQuant(first_moment_keep_after=6, low_rank_momentum=False)
    manager = ink.CheckpointManager(tmp_path / "run", policy=policy)
    if watched:
        manager.watch(model)
    for save in range(2):
        train_steps(model, optimizer, steps, start=steps * save)
        manager.save(save, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    manager.close()
    for save in range(2):
        kept = _kept_momentum(tmp_path / "run", save)
        assert kept <= 0.11 if pruned else kept > 0.5


def test_steps_since_reference_come_from_the_optimizer_step_counters() -> None:
    from inshrinkerator.policies.dynaquant import _optimizer_steps, _steps_since_reference

    _, states = trained_states(3)
    leaves = flatten(states[2]).tensors
    earlier = by_key(states[0])
    references = [earlier.get(format_key_path(leaf.path)) for leaf in leaves]
    assert _steps_since_reference(leaves, references) == 10
    assert _steps_since_reference(leaves, [None] * len(leaves)) is None
    assert _optimizer_steps(leaves) == 15
    # a model buffer that happens to be called "step" is not an optimizer counter
    counter = {"model": {"step": torch.tensor(100.0)}, "optimizer": {"state": {}}}
    earlier_counter = {"model/step": torch.tensor(0.0)}
    buffer_leaves = flatten(counter).tensors
    assert _steps_since_reference(buffer_leaves, [earlier_counter.get(format_key_path(leaf.path)) for leaf in buffer_leaves]) is None
    assert _optimizer_steps(buffer_leaves) is None
    with pytest.raises(ValueError, match="first_moment_keep_after"):
        DynaQuant(first_moment_keep_after=-1)


def test_a_step_counter_that_is_no_real_number_is_no_counter(tmp_path) -> None:
    from inshrinkerator.policies.dynaquant import _optimizer_steps, _steps_since_reference

    _, states = trained_states(2)
    for state in states:  # a complex "step" (nothing torch writes, but a state may hold it)
        state["optimizer"]["state"][0]["step"] = torch.tensor(3 + 1j)
    leaves = flatten(states[1]).tensors
    references = [by_key(states[0]).get(format_key_path(leaf.path)) for leaf in leaves]
    assert _optimizer_steps(leaves) == 10  # the other entries' counters
    assert _steps_since_reference(leaves, references) == 5
    manager = ink.CheckpointManager(tmp_path / "run")
    for step, state in enumerate(states):
        manager.save(step, state)
    manager.close()
    restored = ink.CheckpointManager(tmp_path / "run").load(1)["optimizer"]["state"][0]["step"]
    assert torch.equal(restored, torch.tensor(3 + 1j))


def test_a_first_moment_kept_whole_is_rounded_to_evenly_spaced_levels(tmp_path) -> None:
    # Kept whole, a first moment goes to the levels +-step, +-2 step, ... that lose about
    # first_moment_error of its squared size; None keeps the k-means levels.
    _, states = trained_states(2)
    state = states[1]
    sizes = {}
    for error in (0.02, 0.08, None):
        policy = DynaQuant(first_moment_keep=1.0, first_moment_error=error)
        sizes[error] = ink.save(state, tmp_path / f"{error}.ink", policy=policy).stored_bytes
        loaded = ink.load(tmp_path / f"{error}.ink")["optimizer"]["state"]
        checked = 0
        for key, entry in state["optimizer"]["state"].items():
            m, restored = entry["exp_avg"], loaded[key]["exp_avg"]
            if m.numel() < 1024:
                continue
            checked += 1
            positive = torch.unique(restored[restored > 0]).double()
            multiples = positive / positive.min()
            evenly = bool(torch.allclose(multiples, multiples.round(), atol=1e-4))
            assert evenly == (error is not None)
            if error is not None:
                relative = float((restored - m).pow(2).sum() / m.pow(2).sum())
                assert 0.8 * error <= relative <= 1.2 * error
        assert checked
    assert sizes[0.02] > sizes[0.08]


def test_a_small_first_moment_is_rounded_to_fine_evenly_spaced_levels(tmp_path) -> None:
    # A weight under min_numel: its first moment is never pruned, and its evenly spaced
    # levels (stored as one step, not a table) lose SMALL_MOMENT_ERROR of its squared size,
    # in fewer bytes than twice the k-means levels (first_moment_error=None), which lose more.
    _, (state,) = trained_states(1)
    m = state["optimizer"]["state"][4]["exp_avg"]
    assert 64 <= m.numel() < DynaQuant().min_numel
    errors, sizes = {}, {}
    for error in (0.08, None):
        ink.save(state, tmp_path / f"{error}.ink", policy=DynaQuant(first_moment_keep=1.0, first_moment_error=error))
        restored = ink.load(tmp_path / f"{error}.ink")["optimizer"]["state"][4]["exp_avg"]
        errors[error] = float((restored - m).pow(2).sum() / m.pow(2).sum())
        sizes[error] = codecs_and_bytes(tmp_path / f"{error}.ink")["optimizer/state/4/exp_avg"][1]
        positive = torch.unique(restored[restored > 0]).double()
        multiples = positive / positive.min()
        assert bool(torch.allclose(multiples, multiples.round(), atol=1e-4)) == (error is not None)
    assert 0.5 * SMALL_MOMENT_ERROR <= errors[0.08] <= 1.5 * SMALL_MOMENT_ERROR < errors[None]
    assert sizes[0.08] < sizes[None]
    # A tighter first_moment_error binds the small moments too.
    ink.save(state, tmp_path / "tight.ink", policy=DynaQuant(first_moment_keep=1.0, first_moment_error=0.0005))
    restored = ink.load(tmp_path / "tight.ink")["optimizer"]["state"][4]["exp_avg"]
    assert float((restored - m).pow(2).sum() / m.pow(2).sum()) <= 1.5 * 0.0005


def test_small_momentum_buffers_keep_their_k_means_levels() -> None:
    _, (state,) = trained_states(1, optimizer="sgd")
    leaves = flatten(state).tensors
    codecs = dict(zip((format_key_path(leaf.path) for leaf in leaves), DynaQuant().plan(leaves, [None] * len(leaves))))
    small = codecs["optimizer/state/4/momentum_buffer"]
    assert isinstance(small, DynaQuantCodec)
    assert small.bins == 2 * level_count(codecs["optimizer/state/2/momentum_buffer"])


def test_adam_first_moments_and_sgd_momentum_get_their_own_level_counts() -> None:
    for optimizer, key, knob in (("adam", "exp_avg", "moment_bins"), ("sgd", "momentum_buffer", "momentum_bins")):
        _, (state,) = trained_states(1, optimizer=optimizer)
        leaves = flatten(state).tensors
        for bins in (4, 8):
            codecs = DynaQuant(**{knob: bins}).plan(leaves, [None] * len(leaves))
            planned = dict(zip((format_key_path(leaf.path) for leaf in leaves), codecs))
            assert level_count(planned[f"optimizer/state/2/{key}"]) == bins
    defaults = DynaQuant()
    assert (defaults.moment_bins, defaults.momentum_bins) == (8, 4)
    with pytest.raises(ValueError, match="momentum_bins"):
        DynaQuant(momentum_bins=0)


#: torch.optim optimizers beside Adam and SGD, with the statistics DynaQuant codes in the
#: log domain (non-negative) and those it codes as signed first-order state.
_OTHER_OPTIMIZERS = {
    "rmsprop": (lambda p: torch.optim.RMSprop(p, lr=1e-3), {"square_avg"}, set()),
    "rmsprop-momentum": (lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9), {"square_avg"}, {"momentum_buffer"}),
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.02), {"sum"}, set()),
    "amsgrad": (lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True), {"exp_avg_sq", "max_exp_avg_sq"}, {"exp_avg"}),
    "adamax": (lambda p: torch.optim.Adamax(p, lr=2e-3), {"exp_inf"}, {"exp_avg"}),
    "adadelta": (lambda p: torch.optim.Adadelta(p), {"square_avg", "acc_delta"}, set()),
}


def _resume_loss(model_state: dict, optimizer_state: dict, make, steps: int = 8) -> float:
    model = small_model()
    model.load_state_dict(model_state)
    optimizer = make(model.parameters())
    optimizer.load_state_dict(optimizer_state)
    train_steps(model, optimizer, steps, start=100)
    generator = torch.Generator().manual_seed(999)
    x, y = torch.randn(64, 1, 8, 8, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


@pytest.mark.parametrize("name", sorted(_OTHER_OPTIMIZERS))
def test_the_statistics_of_other_torch_optimizers_are_quantized_and_training_resumes(tmp_path, name) -> None:
    make, positive, signed = _OTHER_OPTIMIZERS[name]
    model = small_model()
    optimizer = make(model.parameters())
    train_steps(model, optimizer, 12)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    exact = ink.save(state, tmp_path / "exact.ink", policy="lossless")
    info = ink.save(state, tmp_path / "dq.ink", policy="dynaquant")
    loaded = ink.load(tmp_path / "dq.ink")
    entry, restored = state["optimizer"]["state"][2], loaded["optimizer"]["state"][2]  # the (32, 512) weight's
    assert set(entry) == positive | signed | {"step"}
    assert_same(restored["step"], entry["step"])
    for key in positive | signed:
        assert not torch.equal(restored[key], entry[key]), f"{key} was stored exactly"
    for key in positive:
        value, got = entry[key], restored[key]
        assert torch.all(got >= 0) and torch.equal(got == 0, value == 0), key
        # Log-domain levels (8 over ~10 decades): nearly every entry within a factor of 4;
        # the largest 0.5 % (the most active parameters) kept in bf16.
        octaves = (got[value > 0] / value[value > 0]).log2().abs()
        assert float((octaves < 2).float().mean()) > 0.98, key
        top = torch.topk(value.reshape(-1), value.numel() // 400).indices  # inside the 0.5 %
        assert torch.allclose(got.reshape(-1)[top], value.reshape(-1)[top], rtol=2**-8, atol=0), key
    # Nothing large is left whole: every class is a fraction of its float32 bytes.
    assert info.stored_bytes * 4 < exact.stored_bytes
    # Training resumes from the restored state as it does from the exact one.
    resumed = _resume_loss(loaded["model"], loaded["optimizer"], make)
    reference = _resume_loss(state["model"], state["optimizer"], make)
    assert abs(resumed - reference) < 0.05 * reference


def test_centered_rmsprop_keeps_its_square_average_exact(tmp_path) -> None:
    model = small_model()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
    train_steps(model, optimizer, 12)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    ink.save(state, tmp_path / "dq.ink", policy="dynaquant")
    entry, restored = state["optimizer"]["state"][2], ink.load(tmp_path / "dq.ink")["optimizer"]["state"][2]
    assert_same(restored["square_avg"], entry["square_avg"])
    assert_same(restored["grad_avg"], entry["grad_avg"])
    assert not torch.equal(restored["momentum_buffer"], entry["momentum_buffer"])  # a step: rounded
    denominator = restored["square_avg"] - restored["grad_avg"] ** 2
    assert torch.equal(denominator, entry["square_avg"] - entry["grad_avg"] ** 2)


@pytest.mark.parametrize("name", ["adagrad", "amsgrad"])
def test_other_optimizers_statistics_are_delta_coded_along_a_chain(tmp_path, name) -> None:
    make, positive, _ = _OTHER_OPTIMIZERS[name]
    model = small_model()
    optimizer = make(model.parameters())
    states = []
    with ink.CheckpointManager(tmp_path / "run") as manager:
        manager.watch(model)
        for step in range(3):
            train_steps(model, optimizer, 5, start=5 * step)
            state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
            states.append(state)
            manager.save(step, state)
        restored = manager.load(2)
    (last,) = (tmp_path / "run").glob("step-0000000002-*.ink")
    stored = codecs_and_bytes(last)
    for key in positive:
        assert stored[f"optimizer/state/2/{key}"][0] == "dynaquant_delta", key
        value, got = states[2]["optimizer"]["state"][2][key], restored["optimizer"]["state"][2][key]
        assert not torch.equal(got, value)
        assert torch.all(got >= 0) and torch.equal(got == 0, value == 0)
        octaves = (got[value > 0] / value[value > 0]).log2().abs()
        assert float((octaves < 2).float().mean()) > 0.98, key
    assert_same(restored["optimizer"]["state"][2]["step"], states[2]["optimizer"]["state"][2]["step"])


def test_a_statistic_named_non_negative_that_is_not_stays_exact(tmp_path) -> None:
    # Another optimizer may keep a signed tensor under Adagrad's entry name "sum".
    generator = torch.Generator().manual_seed(0)
    signed, positive = torch.randn(64, 64, generator=generator), torch.rand(64, 64, generator=generator)
    state = {
        "model": {"a.weight": torch.randn(64, 64, generator=generator), "b.weight": torch.randn(64, 64, generator=generator)},
        "optimizer": {"state": {0: {"sum": signed}, 1: {"sum": positive}}, "param_groups": []},
    }
    ink.save(state, tmp_path / "s.ink", policy="dynaquant")
    loaded = ink.load(tmp_path / "s.ink")["optimizer"]["state"]
    assert_same(loaded[0]["sum"], signed)
    assert not torch.equal(loaded[1]["sum"], positive)  # a real accumulator is coded
    assert torch.all(loaded[1]["sum"] >= 0)


def test_by_default_a_pruned_first_moment_keeps_five_per_cent(tmp_path) -> None:
    # 0.05 stored the char GPT benchmark 8 % smaller than 0.1 at the same paired-restore
    # degradation (docs/dynaquant-measurements.md, *Keeping 5 % of the first moment*).
    _, (state,) = trained_states(1)
    ink.save(state, tmp_path / "m.ink", policy=DynaQuant(first_moment_keep_after=0, low_rank_steps=False))
    kept = ink.load(tmp_path / "m.ink")["optimizer"]["state"][2]["exp_avg"] != 0
    assert 0.03 < float(kept.float().mean()) < 0.065


def test_a_whole_first_moment_of_few_directions_is_stored_as_a_product(tmp_path) -> None:
    # Saves 5 steps apart keep the first moment whole, coded per octave of the second
    # moment. One whose matrix holds few directions (as a fine-tune's do) is stored as a
    # low-rank product plus what it leaves, on the same levels: fewer bytes, about the same
    # error, and a fresh manager restores it.
    from inshrinkerator.codecs import GroupedLowRankCodec
    from inshrinkerator.store import CheckpointManager

    _, states = trained_states(3)
    key = "optimizer/state/2/exp_avg"
    moment = states[2]["optimizer"]["state"][2]["exp_avg"]
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(moment.shape[0], 3, generator=generator) @ torch.randn(3, moment.shape[1], generator=generator)
    states[2]["optimizer"]["state"][2]["exp_avg"] = directions * float(moment.std()) + moment * 0.05
    truth = by_key(states[2])[key]

    def run(folder, policy: DynaQuant) -> tuple[dict, dict[str, tuple[str, int]]]:
        manager = CheckpointManager(folder, policy=policy)
        for step, state in enumerate(states):
            manager.save(step, state)
        manager.close()
        return by_key(CheckpointManager(folder).load(2)), codecs_and_bytes(next(folder.glob("step-0000000002-*.ink")))

    factored, files = run(tmp_path / "factored", DynaQuant())
    plain, plain_files = run(tmp_path / "plain", DynaQuant(low_rank_first_moments=False))
    assert files[key][0] == GroupedLowRankCodec.codec_id
    assert plain_files[key][0] == DynaQuantGroupedCodec.codec_id
    assert files[key][1] < 0.5 * plain_files[key][1]
    error = float((factored[key] - truth).pow(2).sum() / truth.pow(2).sum())
    plain_error = float((plain[key] - truth).pow(2).sum() / truth.pow(2).sum())
    assert error < 0.12 and error < 1.5 * plain_error
    # The other first moments (no such structure) stay as they were.
    assert all(
        codec != GroupedLowRankCodec.codec_id for name, (codec, _) in files.items() if name != key
    )


def test_low_rank_first_moments_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="low_rank_first_moments"):
        DynaQuant(low_rank_first_moments="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low_rank_momentum"):
        DynaQuant(low_rank_momentum=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low_rank_steps"):
        DynaQuant(low_rank_steps=None)  # type: ignore[arg-type]


def _momentum_of(state: dict, path: str) -> tuple[torch.Tensor, tuple[str, int]]:
    ink.save(state, path, policy=DynaQuant(first_moment_keep_after=0))
    key = "optimizer/state/2/momentum_buffer"
    return by_key(ink.load(path))[key], codecs_and_bytes(path)[key]


def _relative_error(restored: torch.Tensor, truth: torch.Tensor) -> float:
    return float((restored - truth).double().pow(2).sum() / truth.double().pow(2).sum())


def test_a_pruned_momentum_buffer_of_few_directions_is_a_product(tmp_path) -> None:
    # Where the buffer is pruned, a matrix whose energy lies in a few directions (recent
    # gradients, sums of outer products) is stored as a low-rank product alone: fewer bytes
    # than its mask and kept entries, and no more error than pruning to 5 % leaves.
    from inshrinkerator.codecs import LowRankCodec

    _, (state,) = trained_states(1, optimizer="sgd")
    buffer = state["optimizer"]["state"][2]["momentum_buffer"]
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(buffer.shape[0], 2, generator=generator) @ torch.randn(2, buffer.shape[1], generator=generator)
    truth = directions * float(buffer.std()) + buffer * 0.3
    state["optimizer"]["state"][2]["momentum_buffer"] = truth
    restored, (codec, stored) = _momentum_of(state, tmp_path / "product.ink")
    plain = DynaQuant(first_moment_keep_after=0, low_rank_momentum=False)
    ink.save(state, tmp_path / "pruned.ink", policy=plain)
    key = "optimizer/state/2/momentum_buffer"
    pruned, (pruned_codec, pruned_stored) = by_key(ink.load(tmp_path / "pruned.ink"))[key], codecs_and_bytes(tmp_path / "pruned.ink")[key]
    assert codec == LowRankCodec.codec_id and pruned_codec == DynaQuantCodec.codec_id
    assert stored < pruned_stored
    largest = truth.reshape(-1).abs().topk(int(0.05 * truth.numel())).values
    dropped = 1 - float(largest.double().pow(2).sum() / truth.double().pow(2).sum())
    assert _relative_error(restored, truth) <= dropped
    assert _relative_error(restored, truth) < _relative_error(pruned, truth)
    assert float((restored != 0).float().mean()) > 0.5  # not pruned (a factor row may round to 0)


def test_a_momentum_buffer_without_few_directions_stays_pruned(tmp_path) -> None:
    _, (state,) = trained_states(1, optimizer="sgd")
    buffer = state["optimizer"]["state"][2]["momentum_buffer"]
    noise = torch.randn(buffer.shape, generator=torch.Generator().manual_seed(1)) * float(buffer.std())
    state["optimizer"]["state"][2]["momentum_buffer"] = noise
    restored, (codec, _) = _momentum_of(state, tmp_path / "noise.ink")
    assert codec == DynaQuantCodec.codec_id
    assert 0.03 < float((restored != 0).float().mean()) < 0.07


def test_a_small_second_moment_is_stored_on_a_log_lattice(monkeypatch) -> None:
    # 2 ** (k / 4): the table is two numbers, and the same levels at every checkpoint.
    import math

    from inshrinkerator.codecs import TensorSpec
    from inshrinkerator.policies import dynaquant_moments

    _, (before, after) = trained_states(2)
    flat, earlier = flatten(after), flatten(before)
    paths = [format_key_path(leaf.path) for leaf in flat.tensors]
    key = "optimizer/state/4/exp_avg_sq"  # the 320-value weight's: under min_numel
    index = paths.index(key)
    v = flat.tensors[index].tensor
    sizes = {}
    for lattice in (True, False):
        if not lattice:
            monkeypatch.setattr(dynaquant_moments, "MAX_LATTICE_LEVELS", 0)
        for references in ([None] * len(paths), [leaf.tensor for leaf in earlier.tensors]):
            codec = DynaQuant().plan(flat.tensors, references)[index]
            reference = references[index] if codec.uses_reference else None
            assert (reference is None) == (references[index] is None)
            encoded = codec.encode(v, reference)
            stream = bytes(encoded.streams[0])
            assert bool(stream[1] & 4) == lattice and stream[1] & 1
            decoded = codec.decode(encoded.streams, encoded.params, TensorSpec.of(v), reference)
            assert torch.equal(decoded, encoded.reconstruction)
            sizes[lattice, reference is None] = len(stream)
            if lattice:
                off = torch.log2(decoded[v > 0] / v[v > 0]).abs()
                protected = math.ceil(0.005 * v.numel())
                assert int((off > 0.125 + math.log2(1 + 2**-6)).sum()) <= protected
    for whole in (True, False):
        assert sizes[True, whole] < sizes[False, whole]


def _steps_of_few_directions(state: dict, index: int = 2) -> dict:
    """``state`` with entry ``index``'s first moment replaced by one whose steps ``m / sqrt(v)``
    lie mostly along two directions (as a layer's Adam steps do), its second moment kept."""
    entry = state["optimizer"]["state"][index]
    v = entry["exp_avg_sq"]
    generator = torch.Generator().manual_seed(0)
    directions = torch.randn(v.shape[0], 2, generator=generator) @ torch.randn(2, v.shape[1], generator=generator)
    noise = torch.randn(v.shape, generator=generator) * 0.3
    entry["exp_avg"] = (directions + noise) * 0.01 * (v.sqrt() + 1e-8)
    return state


def _steps(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return m.double() / (v.double().sqrt() + 1e-8)


@pytest.mark.parametrize("optimizer, product", [("adam", True), ("adam95", False)])
def test_a_pruned_first_moment_of_few_step_directions_is_a_scaled_product(tmp_path, optimizer, product) -> None:
    # Where the first moment is pruned and its second moment takes no joint mask (beta2 =
    # 0.999 restarts would grow too much), a first moment whose steps m / sqrt(v) lie in a
    # few directions is stored as a product of those steps times sqrt(v) as stored: fewer
    # bytes, its steps no further off than the pruning's, none larger than the exact
    # ones allow. With beta2 = 0.95 the joint mask is kept instead.
    from inshrinkerator.codecs import ScaledLowRankCodec

    _, (state,) = trained_states(1, optimizer=optimizer)
    state = _steps_of_few_directions(state)
    key, second = "optimizer/state/2/exp_avg", "optimizer/state/2/exp_avg_sq"
    truth = _steps(state["optimizer"]["state"][2]["exp_avg"], state["optimizer"]["state"][2]["exp_avg_sq"])

    def stored(name: str, **options) -> tuple[torch.Tensor, dict]:
        path = tmp_path / f"{name}.ink"
        ink.save(state, path, policy=DynaQuant(first_moment_keep_after=0, **options))
        restored = by_key(ink.load(path))
        return _steps(restored[key], restored[second]), codecs_and_bytes(path)

    steps, files = stored("default")
    pruned, pruned_files = stored("pruned", low_rank_steps=False)
    if not product:
        assert files[key][0] != ScaledLowRankCodec.codec_id and files == pruned_files
        return
    assert files[key][0] == ScaledLowRankCodec.codec_id and pruned_files[key][0] != ScaledLowRankCodec.codec_id
    assert files[key][1] < 0.5 * pruned_files[key][1]
    error = float((steps - truth).pow(2).sum() / truth.pow(2).sum())
    pruned_error = float((pruned - truth).pow(2).sum() / truth.pow(2).sum())
    assert error < pruned_error
    assert float(steps.abs().max()) <= 1.25 * float(truth.abs().max())
    # A fresh process restores it (the second moment decoded first, as its context).
    with ink.CheckpointManager(tmp_path / "run", policy=DynaQuant(first_moment_keep_after=0)) as manager:
        manager.save(0, state)
    again = by_key(ink.CheckpointManager(tmp_path / "run").load(0))
    assert float((_steps(again[key], again[second]) - truth).pow(2).sum() / truth.pow(2).sum()) < pruned_error


@pytest.mark.parametrize("damage", ["inf", "underflow"])
def test_a_first_moment_is_no_product_of_steps_over_a_second_moment_that_cannot_scale_it(tmp_path, damage) -> None:
    # The product's steps m / (sqrt(v) + eps) are scaled back by the stored second moment.
    # An inf there (stored exact) made a finite first moment's entry inf; entries of v that
    # underflowed to 0 while m did not (fp16 states) made steps of ~1e5 that took over the
    # product, and the restored moment came back with 1,640x its own norm as error (22,000x
    # here).
    from inshrinkerator.codecs import ScaledLowRankCodec
    from inshrinkerator.policies.dynaquant_moments import MAX_PRODUCT_STEP

    _, (state,) = trained_states(1)
    state = _steps_of_few_directions(state)
    entry = state["optimizer"]["state"][2]
    key = "optimizer/state/2/exp_avg"
    path = tmp_path / "healthy.ink"
    ink.save(state, path, policy=DynaQuant(first_moment_keep_after=0))
    assert codecs_and_bytes(path)[key][0] == ScaledLowRankCodec.codec_id  # the control
    if damage == "inf":
        entry["exp_avg_sq"][0, 0] = float("inf")
    else:
        v = entry["exp_avg_sq"]
        v[v <= torch.quantile(v.flatten(), 0.9)] = 0.0  # m stays: steps of |m| / 1e-8
        assert float(_steps(entry["exp_avg"], entry["exp_avg_sq"]).abs().max()) > MAX_PRODUCT_STEP
    path = tmp_path / f"{damage}.ink"
    ink.save(state, path, policy=DynaQuant(first_moment_keep_after=0))
    assert codecs_and_bytes(path)[key][0] != ScaledLowRankCodec.codec_id
    m, restored = entry["exp_avg"], by_key(ink.load(path))[key]
    assert bool(torch.isfinite(restored).all())
    assert float((restored - m).norm()) <= float(m.norm())


def test_a_first_moment_budget_finer_than_even_levels_can_span_is_met_exactly(tmp_path) -> None:
    # Levels `step` apart stop at MAX_EVEN_LEVELS steps: a budget of 1e-9 put the last one
    # far below the largest entries, which were clipped to it (the moments came back with
    # 82-87 % of their norm as error, against 5-28 % at the default budget).
    _, (state,) = trained_states(1)
    path = tmp_path / "fine.ink"
    ink.save(state, path, policy=DynaQuant(first_moment_error=1e-9, first_moment_keep=1.0))
    restored = ink.load(path)["optimizer"]["state"]
    for index, entry in state["optimizer"]["state"].items():
        m = entry["exp_avg"]
        assert float((restored[index]["exp_avg"] - m).pow(2).sum()) <= 1e-9 * float(m.pow(2).sum())
