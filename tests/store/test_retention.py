"""keep_last retention: the plan (property-tested) and the run after it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from inshrinkerator.store import CheckpointManager, describe_run, verify_run
from inshrinkerator.store.retention import plan_retention

from ..helpers import assert_same
from .support import RoundingPolicy, state_for


@st.composite
def _runs(draw):
    """Steps ascending, each full or a delta against the step before it."""
    count = draw(st.integers(0, 12))
    steps = sorted(draw(st.sets(st.integers(0, 100), min_size=count, max_size=count)))
    base_of = {}
    for i, step in enumerate(steps):
        is_delta = i > 0 and draw(st.booleans())
        base_of[step] = steps[i - 1] if is_delta else None
    return steps, base_of


@given(_runs(), st.one_of(st.none(), st.integers(1, 14)))
def test_plan_keeps_the_newest_and_rebases_exactly_the_orphans(run, keep_last) -> None:
    steps, base_of = run
    plan = plan_retention(steps, base_of, keep_last)
    kept = [s for s in steps if s not in plan.delete]
    expected_kept = steps if keep_last is None else steps[-keep_last:]
    assert kept == expected_kept
    assert set(plan.delete).isdisjoint(plan.rebase) and set(plan.rebase) <= set(kept)
    for step in kept:
        if step in plan.rebase:
            assert base_of[step] in plan.delete
        else:
            # Every kept step's chain stays inside the kept steps (a re-based step ends it).
            current = step
            while base_of[current] is not None and current not in plan.rebase:
                current = base_of[current]
                assert current in kept


def test_retention_rebases_then_deletes_and_every_kept_step_restores(run_url: str) -> None:
    with CheckpointManager(run_url, full_every=4, keep_last=3, policy="lossless") as mgr:
        for step in range(10):
            mgr.save(step, state_for(step))
            kept = list(range(max(0, step - 2), step + 1))
            assert mgr.steps() == kept
            for s in kept:
                assert_same(mgr.load(s), state_for(s))
    entries = describe_run(run_url)
    assert entries[0].kind == "full" and all(e.base_step in (None, e.step - 1) for e in entries)
    assert verify_run(run_url) == []


def test_keep_last_one_writes_fulls_directly(tmp_path) -> None:
    with CheckpointManager(tmp_path / "run", keep_last=1, policy="lossless") as mgr:
        kinds = [mgr.save(step, state_for(step)).kind for step in range(4)]
        assert mgr.steps() == [3]
    assert kinds == ["full"] * 4
    assert not any(e.rebased for e in describe_run(str(tmp_path / "run")))


def test_rebase_keeps_lossy_reconstructions_bit_exact(tmp_path) -> None:
    run = str(tmp_path / "run")
    policy = RoundingPolicy(1e-2)
    weights = torch.randn(2048) * 0.1
    with CheckpointManager(run, policy=policy, full_every=100) as mgr:
        seen = {}
        for step in range(6):
            weights = weights + torch.randn(2048) * 1e-3
            mgr.save(step, {"w": weights})
            seen[step] = mgr.load(step)["w"]
    # A later manager with a smaller window re-bases step 3 (a lossy delta) and drops 0..2.
    with CheckpointManager(run, policy=policy, full_every=100, keep_last=4) as mgr:
        mgr.save(6, {"w": weights})
        assert mgr.steps() == [3, 4, 5, 6]
        for step in (3, 4, 5):
            assert torch.equal(mgr.load(step)["w"], seen[step]), f"step {step} changed on re-base"
    entries = {e.step: e for e in describe_run(run)}
    assert entries[3].kind == "full" and entries[3].rebased
    assert entries[4].base_step == 3
    assert verify_run(run) == []


def test_a_crash_between_rebase_and_deletion_loses_nothing(tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    with CheckpointManager(run, full_every=10, policy="lossless") as mgr:
        for step in range(5):
            mgr.save(step, state_for(step))
    from inshrinkerator.store import retention

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed during retention")

    monkeypatch.setattr(retention, "delete_steps", crash)
    mgr = CheckpointManager(run, full_every=10, keep_last=2, policy="lossless")
    with pytest.raises(KeyboardInterrupt):
        mgr.save(5, state_for(5))
    monkeypatch.undo()
    assert CheckpointManager(run).steps() == [0, 1, 2, 3, 4, 5]
    assert verify_run(str(run)) == []
    with CheckpointManager(run, full_every=10, keep_last=2, policy="lossless") as again:
        again.save(6, state_for(6))
        assert again.steps() == [5, 6]
        assert_same(again.load(5), state_for(5))
    assert verify_run(str(run)) == []


def _data_files(run_url: str) -> set[str]:
    from inshrinkerator.store.manifest import step_of_data_name
    from inshrinkerator.store.storage import open_storage

    return {name for name in open_storage(run_url).list_names() if step_of_data_name(name) is not None}


@pytest.mark.parametrize("cleanup", ["works", "fails too"])
def test_a_failed_manifest_write_while_rebasing_leaves_no_orphan_for_long(run_url: str, monkeypatch, cleanup) -> None:
    """The re-based step's new data file is removed on the failure path; if even that fails,
    readers and verify_run ignore it and the manager's next save removes it."""
    from inshrinkerator.store import rebase

    mgr = CheckpointManager(run_url, full_every=10, keep_last=2, policy="lossless")
    mgr.save(0, state_for(0))
    mgr.save(1, state_for(1))  # a delta against 0; saving 2 drops 0 and re-bases 1
    real_publish = rebase.publish_manifest

    def publish_fails(*args, **kwargs):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(rebase, "publish_manifest", publish_fails)
    if cleanup == "fails too":
        monkeypatch.setattr(rebase, "_discard_unpublished", lambda *args: None)
    with pytest.raises(OSError, match="injected") as caught:
        mgr.save(2, state_for(2))
    assert any("step 2 was committed" in note for note in caught.value.__notes__)
    monkeypatch.setattr(rebase, "publish_manifest", real_publish)

    named = {entry.data_file for entry in describe_run(run_url)}
    assert [entry.step for entry in describe_run(run_url)] == [0, 1, 2]
    orphans = _data_files(run_url) - named
    assert len(orphans) == (0 if cleanup == "works" else 1)
    assert verify_run(run_url) == []  # an orphan is a harmless leftover, not damage
    for step in (0, 1, 2):
        assert_same(CheckpointManager(run_url).load(step), state_for(step))

    mgr.save(3, state_for(3))  # retention again, and the leftover swept
    assert mgr.steps() == [2, 3]
    mgr.close()
    assert _data_files(run_url) == {entry.data_file for entry in describe_run(run_url)}
    assert verify_run(run_url) == []


def test_rebase_stores_a_tensor_planned_with_a_context_on_its_own() -> None:
    from inshrinkerator.codecs import (
        ByteGroupingCodec,
        DynaQuantCodec,
        DynaQuantGroupedCodec,
        DynaQuantMaskedCodec,
    )
    from inshrinkerator.store.rebase import ExactRebasePolicy
    from inshrinkerator.tree import flatten

    class WithContexts:
        name = "contexts"

        def plan(self, leaves, references):
            levels = leaves[0].tensor.unique()  # the levels it was stored with (a policy's hint)
            return [
                DynaQuantGroupedCodec(bins=8).with_hints(centroids=levels[levels != 0]).against("v"),
                DynaQuantMaskedCodec(bins=8, domain="log").against("m"),
                DynaQuantCodec(bins=8, domain="log"),
            ]

    generator = torch.Generator().manual_seed(0)
    v = torch.exp2(torch.randn(4096, generator=generator) * 3 - 20)
    m = torch.randn(4096, generator=generator) * v.sqrt()
    # Tensors as a restore holds them: already on their levels, so re-encoding is exact.
    m = DynaQuantCodec(bins=8).encode(m).reconstruction
    leaves = flatten({"m": m, "v2": DynaQuantCodec(bins=8, domain="log").encode(v).reconstruction, "v": v}).tensors
    codecs = ExactRebasePolicy(WithContexts()).plan(leaves, [None] * 3)
    assert not any(codec.uses_context or codec.uses_reference for codec in codecs)
    assert type(codecs[0]) is DynaQuantCodec and codecs[0].get_config() == {"id": "dynaquant", "bins": 8}
    assert torch.equal(codecs[0].encode(m).reconstruction, m)
    assert isinstance(codecs[2], ByteGroupingCodec)  # v itself is not on 8 levels: kept exact
