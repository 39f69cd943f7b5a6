"""Random sequences of save / load / retention / reopen / failed saves never lose a kept step."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Optional
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inshrinkerator.store import AsyncSaveError, CheckpointManager, verify_run
from inshrinkerator.store import manager as manager_module
from inshrinkerator.store.manifest import data_name
from inshrinkerator.store.storage import open_storage

from ..helpers import assert_same

KEEP_LAST = st.one_of(st.none(), st.integers(1, 4))
FULL_EVERY = st.integers(1, 5)


def small_state(seed: int) -> dict[str, Any]:
    drift = torch.Generator().manual_seed(seed)
    base = torch.linspace(-1, 1, 512)
    return {
        "w": base + torch.randn(512, generator=drift) * 1e-3,
        "b": (base[:64] * seed).to(torch.bfloat16),
        "counter": torch.tensor(seed),
        "seed": seed,
    }


class RunMachine(RuleBasedStateMachine):
    """The model: ``expected`` holds exactly the steps the run must still restore."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.mkdtemp(prefix="ink-run-machine-")
        self.url = f"{self.folder}/run"
        self.expected: dict[int, Any] = {}
        self.next_step = 0
        self.keep_last: Optional[int] = None
        self.mgr: Optional[CheckpointManager] = None

    def _open(self, keep_last: Optional[int], full_every: int, async_save: bool) -> None:
        self.keep_last = keep_last
        self.mgr = CheckpointManager(self.url, full_every=full_every, keep_last=keep_last, async_save=async_save, policy="lossless")

    @initialize(keep_last=KEEP_LAST, full_every=FULL_EVERY, async_save=st.booleans())
    def start(self, keep_last: Optional[int], full_every: int, async_save: bool) -> None:
        self._open(keep_last, full_every, async_save)

    @rule(gap=st.integers(1, 3), seed=st.integers(0, 1000))
    def save(self, gap: int, seed: int) -> None:
        assert self.mgr is not None
        step = self.next_step + gap - 1
        state = small_state(seed)
        self.mgr.save(step, state)
        self.expected[step] = state
        self.next_step = step + 1
        if self.keep_last is not None:
            for old in sorted(self.expected)[: -self.keep_last]:
                del self.expected[old]

    @rule(seed=st.integers(0, 1000))
    def save_that_fails_before_commit(self, seed: int) -> None:
        assert self.mgr is not None
        injected = OSError("injected failure before the manifest")
        with mock.patch.object(manager_module, "publish_manifest", side_effect=injected):
            if self.mgr.async_save:
                self.mgr.save(self.next_step, small_state(seed))
                with pytest.raises(AsyncSaveError):
                    self.mgr.wait()
            else:
                with pytest.raises(OSError, match="injected"):
                    self.mgr.save(self.next_step, small_state(seed))

    @precondition(lambda self: self.expected)
    @rule(back=st.integers(0, 3))
    def save_into_the_past_is_refused(self, back: int) -> None:
        assert self.mgr is not None
        with pytest.raises(ValueError):
            self.mgr.save(max(max(self.expected) - back, 0), small_state(0))

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        assert self.mgr is not None
        step = data.draw(st.sampled_from(sorted(self.expected)))
        assert_same(self.mgr.load(step), self.expected[step])

    @precondition(lambda self: self.expected)
    @rule()
    def load_latest(self) -> None:
        assert self.mgr is not None
        assert_same(self.mgr.load(), self.expected[max(self.expected)])

    @rule(keep_last=KEEP_LAST, full_every=FULL_EVERY, async_save=st.booleans())
    def reopen(self, keep_last: Optional[int], full_every: int, async_save: bool) -> None:
        assert self.mgr is not None
        self.mgr.close()
        self._open(keep_last, full_every, async_save)

    @rule(token=st.sampled_from(["0badc0de", "feedface"]))
    def leftovers_of_a_killed_writer(self, token: str) -> None:
        storage = open_storage(self.url)
        storage.prepare()
        storage.write_bytes(data_name(self.next_step, token), b"half a checkpoint")
        storage.write_bytes(f".tmp-{data_name(self.next_step, token)}.x", b"half")

    @invariant()
    def exactly_the_kept_steps_are_listed_and_every_chain_restores(self) -> None:
        if self.mgr is None:
            return
        assert self.mgr.steps() == sorted(self.expected)  # also waits for a save in flight
        if self.expected:
            assert verify_run(self.url) == []

    def teardown(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


RunMachine.TestCase.settings = settings(
    max_examples=20,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRunMachine = RunMachine.TestCase
