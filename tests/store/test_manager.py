"""CheckpointManager: save/load, chains, closed loop, step rules, async, errors."""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator import policies
from inshrinkerator.errors import BrokenChainError, CheckpointNotFoundError, UnsupportedStateError
from inshrinkerator.store import AsyncSaveError, CheckpointManager, describe_run, verify_run
from inshrinkerator.store import manager as manager_module
from inshrinkerator.store.manifest import manifest_name

from ..helpers import assert_same, training_state
from .support import RoundingPolicy, state_for


def test_save_and_load_every_step_exactly(run_url: str) -> None:
    with CheckpointManager(run_url, policy="lossless", full_every=3) as mgr:
        infos = [mgr.save(step, state_for(step)) for step in range(0, 70, 10)]
        assert mgr.steps() == list(range(0, 70, 10))
        assert mgr.latest_step() == 60
        for step in mgr.steps():
            assert_same(mgr.load(step), state_for(step))
        assert_same(mgr.load(), state_for(60))
    assert [i.kind for i in infos] == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    assert all(i.raw_bytes > 0 and i.stored_bytes > 0 for i in infos)
    for info, entry in zip(infos, describe_run(run_url)):
        assert (info.step, info.kind, info.stored_bytes, info.raw_bytes) == (
            entry.step, entry.kind, entry.stored_bytes, entry.raw_bytes)
        assert info.ratio == pytest.approx(info.raw_bytes / info.stored_bytes)
    assert [e.base_step for e in describe_run(run_url)] == [None, 0, 10, None, 30, 40, None]


def test_a_realistic_training_state_round_trips(tmp_path) -> None:
    state = training_state(steps=2)
    with CheckpointManager(tmp_path / "run", policy="lossless") as mgr:
        mgr.save(1, state)
        assert_same(mgr.load(1), state)


def test_the_default_policy_works_end_to_end(tmp_path) -> None:
    state = training_state(steps=2)
    with CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.policy.name == manager_module.default_policy_name()
        mgr.save(1, state)
        mgr.save(2, state)
        loaded = mgr.load(2)
    # Whatever the default policy keeps lossy, the structure and everything that is not a
    # floating tensor come back exactly.
    assert_same(loaded["step"], state["step"])
    assert_same(loaded["rng"], state["rng"])
    assert_same(loaded["config"], state["config"])
    for key, tensor in state["model"].items():
        assert loaded["model"][key].dtype == tensor.dtype and loaded["model"][key].shape == tensor.shape
        if not tensor.is_floating_point():
            assert torch.equal(loaded["model"][key], tensor)
    assert verify_run(str(tmp_path / "run")) == []


def test_stored_bytes_count_data_file_and_manifest(tmp_path) -> None:
    run = tmp_path / "run"
    with CheckpointManager(run, policy="lossless") as mgr:
        info = mgr.save(5, state_for(5))
    files = [p for p in run.iterdir() if p.name.startswith("step-")]
    assert info.stored_bytes == sum(p.stat().st_size for p in files)


def test_full_every_one_writes_only_full_checkpoints(tmp_path) -> None:
    with CheckpointManager(tmp_path / "run", full_every=1, policy="lossless") as mgr:
        kinds = [mgr.save(step, state_for(step)).kind for step in range(4)]
    assert kinds == ["full"] * 4


def test_deltas_are_smaller_than_fulls_for_slowly_changing_states(tmp_path) -> None:
    with CheckpointManager(tmp_path / "run", policy="lossless", full_every=4) as mgr:
        infos = [mgr.save(step, state_for(step, numel=1 << 14)) for step in range(4)]
    assert infos[0].kind == "full" and all(i.kind == "delta" for i in infos[1:])
    assert max(i.stored_bytes for i in infos[1:]) < infos[0].stored_bytes


def test_default_policy_prefers_dynaquant_once_registered(monkeypatch) -> None:
    monkeypatch.delitem(policies._FACTORIES, "dynaquant", raising=False)
    assert manager_module.default_policy_name() == "lossless"
    monkeypatch.setitem(policies._FACTORIES, "dynaquant", policies.Lossless)
    assert manager_module.default_policy_name() == "dynaquant"


def test_steps_only_grow(run_url: str) -> None:
    with CheckpointManager(run_url, policy="lossless") as mgr:
        mgr.save(10, state_for(10))
        with pytest.raises(ValueError, match="latest step is 10"):
            mgr.save(10, state_for(10))
        with pytest.raises(ValueError, match="steps only grow"):
            mgr.save(3, state_for(3))
        for bad in (-1, 1.5, True, "7"):
            with pytest.raises((TypeError, ValueError)):
                mgr.save(bad, state_for(0))
        assert mgr.steps() == [10]
    with CheckpointManager(run_url, policy="lossless") as reopened:
        with pytest.raises(ValueError):
            reopened.save(10, state_for(10))
        reopened.save(11, state_for(11))
        assert reopened.steps() == [10, 11]


def test_empty_and_missing_runs(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path / "nothing-here", policy="lossless")
    assert mgr.steps() == [] and mgr.latest_step() is None
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint yet"):
        mgr.load()
    assert not (tmp_path / "nothing-here").exists(), "opening a run must not create it"
    mgr.save(1, state_for(1))
    with pytest.raises(CheckpointNotFoundError, match="no step 2"):
        mgr.load(2)
    mgr.close()


def test_a_file_is_not_a_run(tmp_path) -> None:
    path = tmp_path / "ckpt.ink"
    ink.save(state_for(0), path)
    with pytest.raises(ink.FormatError, match="not a run"):
        CheckpointManager(path).steps()


def test_bad_options_are_refused(tmp_path) -> None:
    for kwargs in ({"full_every": 0}, {"keep_last": 0}, {"full_every": 2.5}, {"policy": "nope"}):
        with pytest.raises(ValueError):
            CheckpointManager(tmp_path / "run", **kwargs)


def test_unsupported_state_is_refused_before_anything_is_written(tmp_path) -> None:
    with CheckpointManager(tmp_path / "run", policy="lossless") as mgr:
        with pytest.raises(UnsupportedStateError, match="lambda|function"):
            mgr.save(1, {"f": lambda: 0})
        assert mgr.steps() == []
        mgr.save(1, state_for(1))
    assert verify_run(str(tmp_path / "run")) == []


def test_missing_base_is_a_broken_chain(tmp_path) -> None:
    run = tmp_path / "run"
    with CheckpointManager(run, full_every=5, policy="lossless") as mgr:
        for step in range(3):
            mgr.save(step, state_for(step))
    (run / manifest_name(1)).unlink()
    mgr = CheckpointManager(run, policy="lossless")
    assert_same(mgr.load(0), state_for(0))
    with pytest.raises(BrokenChainError, match="step 2 is a delta against step 1"):
        mgr.load(2)
    # A new save after a broken latest chain does not build on it.
    assert mgr.save(3, state_for(3)).kind == "full"
    assert_same(mgr.load(3), state_for(3))


def test_reopened_run_continues_its_chain(run_url: str) -> None:
    with CheckpointManager(run_url, full_every=4, policy="lossless") as mgr:
        mgr.save(0, state_for(0))
        mgr.save(1, state_for(1))
    with CheckpointManager(run_url, full_every=4, policy="lossless") as mgr:
        kinds = [mgr.save(step, state_for(step)).kind for step in (2, 3, 4)]
        assert kinds == ["delta", "delta", "full"]
        for step in range(5):
            assert_same(mgr.load(step), state_for(step))


def test_reference_is_private_when_training_mutates_tensors_after_save(run_url: str) -> None:
    model = torch.nn.Linear(64, 64)
    with CheckpointManager(run_url, policy="lossless", full_every=10) as mgr:
        expected = {}
        for step in range(4):
            mgr.save(step, {"model": model.state_dict()})
            live = model.state_dict()
            expected[step] = type(live)((k, v.clone()) for k, v in live.items())
            with torch.no_grad():  # an optimizer step mutates the parameters in place
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        for step, state in expected.items():
            assert_same(mgr.load(step)["model"], state)


@pytest.mark.parametrize("policy", ["dynaquant", "lossless"])
def test_a_resumed_runs_first_save_builds_on_the_loaded_state_without_reading_the_chain(
    tmp_path, monkeypatch, policy: str
) -> None:
    # A resume: a new manager loads the latest step, training updates the loaded tensors
    # in place (an optimizer adopts loaded moments), and the next save is a delta against
    # that step. It is the file a manager that reads the chain at save time writes.
    model, optimizer = torch.nn.Linear(64, 48), None
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(steps: int) -> dict:
        for _ in range(steps):
            loss = model(torch.randn(16, 64)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    torch.manual_seed(0)
    first, second = tmp_path / "resumed", tmp_path / "reread"
    with CheckpointManager(first, policy=policy, full_every=10) as one, CheckpointManager(
        second, policy=policy, full_every=10
    ) as two:
        for step in range(1, 4):
            state = train(3)
            one.save(step, state)
            two.save(step, state)
    reads = []
    real_load_chain, real_load_step = manager_module.load_chain, manager_module.load_step
    monkeypatch.setattr(manager_module, "load_chain", lambda *a: reads.append(a[1][-1].step) or real_load_chain(*a))
    monkeypatch.setattr(manager_module, "load_step", lambda *a: reads.append(a[1]) or real_load_step(*a))
    with CheckpointManager(first, policy=policy, full_every=10) as resumed:
        loaded = resumed.load()
        assert reads == [3]
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        state = train(3)  # updates the loaded moments in place
        assert resumed.save(4, state).kind == "delta"
        assert reads == [3], "the save read the chain again"
    with CheckpointManager(second, policy=policy, full_every=10) as reread:
        assert reread.save(4, state).kind == "delta"
        assert reads == [3, 3], "a manager that loaded nothing reads its reference at save time"
    data = lambda run: next(p.read_bytes() for p in run.iterdir() if p.name.startswith("step-0000000004") and p.suffix == ".ink")  # noqa: E731
    assert data(first) == data(second)


@pytest.mark.parametrize("full_every, step, copied", [(10, 3, True), (10, 2, False), (4, 3, False)])
def test_only_a_step_the_next_save_builds_on_is_kept_after_a_load(
    tmp_path, full_every: int, step: int, copied: bool
) -> None:
    with CheckpointManager(tmp_path, policy="lossless", full_every=full_every) as mgr:
        for s in range(4):
            mgr.save(s, state_for(s))
    with CheckpointManager(tmp_path, policy="lossless", full_every=full_every) as mgr:
        assert_same(mgr.load(step), state_for(step))
        # Steps 0-3 in one chain: step 3 is the latest, a fourth delta only below full_every=4.
        assert (mgr._reference_step == step) is copied
    assert mgr._reference is None, "a closed manager still holds a state's worth of reference"


def test_closed_loop_deltas_never_accumulate_lossy_error(run_url: str) -> None:
    scale = 1e-2
    truth = torch.randn(4096) * 0.1
    states = []
    with CheckpointManager(run_url, policy=RoundingPolicy(scale), full_every=50) as mgr:
        for step in range(25):
            truth = truth + torch.randn(4096) * 3e-3
            states.append(truth.clone())
            assert mgr.save(step, {"w": truth}).kind == ("full" if step == 0 else "delta")
        for step, true in enumerate(states):
            error = (mgr.load(step)["w"] - true).abs().max().item()
            assert error <= scale / 2 * 1.001, f"step {step}: error {error} grew along the chain"


def test_watch_reaches_policies_that_want_it(tmp_path) -> None:
    policy = RoundingPolicy()
    model = torch.nn.Linear(2, 2)
    CheckpointManager(tmp_path / "a", policy=policy).watch(model)
    assert policy.watched == [model]
    CheckpointManager(tmp_path / "b", policy="lossless").watch(model)  # no hook: no-op


@pytest.mark.parametrize("async_save", [False, True])
def test_policies_hear_of_every_save_on_the_callers_thread(tmp_path, async_save: bool) -> None:
    # A watching policy adds gradient hooks there, which must happen on the training thread.
    policy = RoundingPolicy()
    with CheckpointManager(tmp_path / "run", policy=policy, async_save=async_save) as mgr:
        for step in range(3):
            mgr.save(step, state_for(step))
    assert policy.before_save_threads == [threading.get_ident()] * 3


def test_closed_manager_refuses_work(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path / "run", policy="lossless")
    mgr.close()
    mgr.close()
    with pytest.raises(ValueError, match="closed"):
        mgr.save(1, state_for(1))


# ------------------------------------------------------------------------------ async


def test_async_save_returns_after_snapshot_and_commits_in_background(run_url: str) -> None:
    with CheckpointManager(run_url, async_save=True, full_every=3, policy="lossless") as mgr:
        for step in range(5):
            info = mgr.save(step, state_for(step))
            assert info.stored_bytes == 0 and info.raw_bytes > 0
        final = mgr.wait()
        assert final is not None and final.step == 4 and final.stored_bytes > 0
        assert mgr.wait() is None
        for step in range(5):
            assert_same(mgr.load(step), state_for(step))
    assert [e.kind for e in describe_run(run_url)] == ["full", "delta", "delta", "full", "delta"]


def test_async_snapshot_is_taken_before_save_returns(tmp_path) -> None:
    tensor = torch.zeros(1 << 16)
    with CheckpointManager(tmp_path / "run", async_save=True, policy="lossless") as mgr:
        mgr.save(1, {"t": tensor})
        tensor.fill_(7.0)  # the training loop moves on immediately
        assert torch.equal(mgr.load(1)["t"], torch.zeros(1 << 16))


def _full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def test_an_async_manager_collects_setup_garbage_before_training_not_inside_save(tmp_path, monkeypatch) -> None:
    # With the collector paused, only an explicit collection counts. An async manager runs
    # one at setup when the process has grown since the last (construction or watch()), so
    # a save does not start the first full pass over everything setup created; a
    # synchronous manager leaves the collector alone.
    monkeypatch.setattr(manager_module, "_blocks_after_collection", 0)
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = _full_collections()
        with CheckpointManager(tmp_path / "sync", policy="lossless") as mgr:
            mgr.watch(torch.nn.Linear(2, 2))
            assert _full_collections() == before
        with CheckpointManager(tmp_path / "async", policy="lossless", async_save=True) as mgr:
            assert _full_collections() == before + 1
            mgr.watch(torch.nn.Linear(2, 2))  # nothing much created since: no second pass
            assert _full_collections() == before + 1
            setup = [[index] for index in range(sys.getallocatedblocks() // 4)]  # a corpus, say
            mgr.watch(torch.nn.Linear(2, 2))
            assert _full_collections() == before + 2
            mgr.save(1, state_for(1))
            mgr.wait()
            assert _full_collections() == before + 2
            assert len(setup) > 0
    finally:
        if enabled:
            gc.enable()


class _Boom(RuntimeError):
    pass


def test_async_failure_is_reraised_chained_by_the_next_call(tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(run, async_save=True, policy="lossless")
    mgr.save(1, state_for(1))
    mgr.wait()
    gate = threading.Event()
    original = manager_module.write_state

    def failing_write_state(*args, **kwargs):
        gate.wait(5)
        raise _Boom("disk on fire")

    monkeypatch.setattr(manager_module, "write_state", failing_write_state)
    mgr.save(2, state_for(2))  # returns before the failure happens
    gate.set()
    with pytest.raises(AsyncSaveError, match="step 2.*disk on fire") as caught:
        mgr.save(3, state_for(3))
    assert isinstance(caught.value.__cause__, _Boom)
    monkeypatch.setattr(manager_module, "write_state", original)
    assert mgr.steps() == [1], "neither the failed step nor the refused one is in the run"
    mgr.save(3, state_for(3))
    mgr.close()
    assert CheckpointManager(run).steps() == [1, 3]
    assert verify_run(str(run)) == []


def test_async_failure_is_reraised_by_wait_and_close(tmp_path, monkeypatch) -> None:
    def failing_write_state(*args, **kwargs):
        raise _Boom("no space")

    monkeypatch.setattr(manager_module, "write_state", failing_write_state)
    mgr = CheckpointManager(tmp_path / "run", async_save=True, policy="lossless")
    mgr.save(1, state_for(1))
    with pytest.raises(AsyncSaveError) as caught:
        mgr.wait()
    assert isinstance(caught.value.__cause__, _Boom)
    mgr.save(2, state_for(2))
    with pytest.raises(AsyncSaveError):
        mgr.close()
    assert not any(p.name.endswith(".ink") for p in (tmp_path / "run").iterdir())


def test_sync_failure_leaves_no_step_and_no_file(tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    mgr = CheckpointManager(run, policy="lossless")
    mgr.save(1, state_for(1))
    before = sorted(p.name for p in run.iterdir())

    def failing_publish(*args, **kwargs):
        raise _Boom("crash before commit")

    monkeypatch.setattr(manager_module, "publish_manifest", failing_publish)
    with pytest.raises(_Boom):
        mgr.save(2, state_for(2))
    assert sorted(p.name for p in run.iterdir()) == before
    monkeypatch.undo()
    mgr.save(2, state_for(2))
    assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("policy", ["lossless", "dynaquant"])
def test_async_saves_of_a_state_trained_in_place_restore_every_step(tmp_path, policy: str) -> None:
    # Later snapshots copy into buffers made after the previous save; a lossless tensor's
    # snapshot is also the closed-loop reference of the next delta, so the two must never
    # share memory: every step restores what was saved, deltas and full steps alike.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 64, generator=generator)
    moment = torch.zeros(128, 64)
    saved = {}
    with CheckpointManager(tmp_path / "run", async_save=True, full_every=3, policy=policy) as mgr:
        for step in range(7):
            update = torch.randn(128, 64, generator=generator) * 1e-3
            weight.add_(update)
            moment.mul_(0.9).add_(update)
            mgr.save(step, {"weight": weight, "moment": moment, "step": step})
            saved[step] = {"weight": weight.clone(), "moment": moment.clone()}
        mgr.wait()
        for step, expected in saved.items():
            restored = mgr.load(step)
            assert restored["step"] == step
            for key, tensor in expected.items():
                if policy == "lossless":
                    assert torch.equal(restored[key], tensor)
                else:
                    assert float((restored[key] - tensor).norm()) <= 0.1 * float(tensor.norm()) + 1e-6


class _ChainCounting(policies.Lossless):
    """Lossless, counting the calls of ``new_chain``."""

    def __init__(self) -> None:
        super().__init__()
        self.new_chains = 0

    def new_chain(self) -> None:
        self.new_chains += 1


@pytest.mark.parametrize("async_save", [False, True])
def test_a_continuing_run_starts_each_new_chain_afresh_but_not_after_a_load(tmp_path, async_save: bool) -> None:
    policy = _ChainCounting()
    states = [{"w": torch.full((64,), float(step))} for step in range(7)]
    with CheckpointManager(tmp_path / "run", policy=policy, full_every=2, async_save=async_save) as manager:
        kinds = [manager.save(step, states[step]).kind for step in range(4)]
        assert kinds == ["full", "delta", "full", "delta"]
        assert policy.new_chains == 1  # step 2; not the run's first save
        manager.load(3)  # restored values in this process: the full checkpoint next keeps what it chose
        assert manager.save(4, states[4]).kind == "full"
        assert policy.new_chains == 1
        manager.save(5, states[5])
        assert manager.save(6, states[6]).kind == "full"  # of a training state again
        assert policy.new_chains == 2
