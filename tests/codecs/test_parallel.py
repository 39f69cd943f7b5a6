"""The codec thread pool: results in order, errors re-raised, nesting never deadlocks."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from inshrinkerator.codecs import _parallel
from inshrinkerator.codecs._parallel import (
    BACKGROUND_NICE,
    in_background,
    parallel_map,
    worker_count,
)
from inshrinkerator.store.async_worker import BackgroundWorker


def test_results_come_back_in_order():
    assert parallel_map(lambda x: x * x, range(100)) == [x * x for x in range(100)]
    assert parallel_map(str, []) == []
    assert parallel_map(str, [7]) == ["7"]


def test_the_first_error_is_re_raised_after_running_items_finish():
    finished = []

    def work(x: int) -> int:
        if x == 3:
            raise KeyError("boom")
        time.sleep(0.001)
        finished.append(x)
        return x

    with pytest.raises(KeyError, match="boom"):
        parallel_map(work, range(50))
    assert 3 not in finished


def test_nested_maps_finish_even_when_every_worker_is_busy(monkeypatch):
    monkeypatch.setattr(_parallel, "worker_count", lambda: 3)
    monkeypatch.setattr(_parallel, "_pools", {})
    threads = set()

    def inner(x: int) -> int:
        threads.add(threading.current_thread().name)
        time.sleep(0.0005)
        return x + 1

    def outer(n: int) -> int:
        return sum(parallel_map(inner, range(n)))

    done = []
    runner = threading.Thread(target=lambda: done.append(parallel_map(outer, [40, 1, 2, 30, 0, 5])))
    runner.start()
    runner.join(timeout=30)
    assert not runner.is_alive(), "nested parallel_map deadlocked"
    assert done == [[sum(range(1, n + 1)) for n in [40, 1, 2, 30, 0, 5]]]
    assert len(threads) >= 2  # the work was shared


def test_worker_count_is_positive():
    assert worker_count() >= 1


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _who_ran(items: int) -> list[tuple[str, bool, int]]:
    """(thread name, marked as background, nice value) of each thread that ran an item."""

    def item(_: int) -> tuple[str, bool, int]:
        time.sleep(0.002)  # long enough for the helpers to take items too
        return threading.current_thread().name, in_background(), _nice()

    return sorted(set(parallel_map(item, range(items))))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_background_work_runs_at_lower_priority_and_foreground_work_does_not(monkeypatch):
    monkeypatch.setattr(_parallel, "worker_count", lambda: 2)
    monkeypatch.setattr(_parallel, "_pools", {})
    foreground_nice = _nice()
    if foreground_nice >= BACKGROUND_NICE:
        pytest.skip("this process already runs at background priority")
    worker = BackgroundWorker()
    try:
        worker.submit(lambda: _who_ran(64), "probe")
        background = worker.result()
    finally:
        worker.shutdown()
    foreground = _who_ran(64)
    # The async worker's thread and the helpers it shared items with: all lowered.
    assert len(background) >= 2 and all(marked and nice >= BACKGROUND_NICE for _, marked, nice in background)
    assert any(name.startswith("inshrink-background") for name, _, _ in background)
    # A synchronous save's threads (the caller and the codec pool) keep their priority.
    assert len(foreground) >= 2 and all(not marked and nice == foreground_nice for _, marked, nice in foreground)
    assert _nice() == foreground_nice


def test_sized_maps_share_out_only_large_items_and_keep_the_order(monkeypatch):
    from inshrinkerator.codecs._parallel import PARALLEL_MIN_BYTES, parallel_map_sized

    monkeypatch.setattr(_parallel, "worker_count", lambda: 2)
    caller = threading.get_ident()
    ran: list[tuple[int, bool]] = []

    def work(x: int) -> int:
        time.sleep(0.002)  # long enough for a helper to claim some of the large items
        ran.append((x, threading.get_ident() == caller))
        return -x

    sizes = [PARALLEL_MIN_BYTES * 4 if x % 3 == 0 else PARALLEL_MIN_BYTES - 1 for x in range(30)]
    assert parallel_map_sized(work, range(30), sizes) == [-x for x in range(30)]
    small = [x for x in range(30) if x % 3]
    # The small items run on the calling thread, after every large one, largest first.
    assert [x for x, _ in ran[-len(small):]] == small and all(on_caller for _, on_caller in ran[-len(small):])
    assert {x for x, _ in ran[: 30 - len(small)]} == {x for x in range(30) if x % 3 == 0}
    assert parallel_map_sized(str, [], []) == []
    with pytest.raises(ValueError, match="one size per item"):
        parallel_map_sized(str, [1, 2], [1])


def test_a_background_sized_map_shares_out_every_item(monkeypatch):
    from inshrinkerator.codecs._parallel import PARALLEL_MIN_BYTES, parallel_map_sized

    shared: list[list] = []
    real = _parallel.parallel_map

    def recording(fn, items):
        items = list(items)
        shared.append(items)
        return real(fn, items)

    monkeypatch.setattr(_parallel, "parallel_map", recording)
    sizes = [PARALLEL_MIN_BYTES, 1, PARALLEL_MIN_BYTES - 1, 2 * PARALLEL_MIN_BYTES]
    results: dict[str, list] = {}

    def run(name: str, background: bool) -> None:
        if background:
            _parallel._thread.background = True  # as lower_priority marks it, without the nice value
        results[name] = parallel_map_sized(lambda x: x * 10, range(4), sizes)

    for name, background in (("foreground", False), ("background", True)):
        thread = threading.Thread(target=run, args=(name, background))
        thread.start()
        thread.join()
    assert results == {"foreground": [0, 10, 20, 30], "background": [0, 10, 20, 30]}
    # shared out, largest first: the two large items in the foreground, all four in the background
    assert shared == [[3, 0], [3, 0, 2, 1]]


_OPENMP = _parallel._omp() is not None


@pytest.mark.skipif(not _OPENMP, reason="torch's intra-op threads are not OpenMP's here")
def test_codec_work_runs_torch_ops_on_its_own_thread_and_leaves_other_threads_alone():
    import torch

    outer = torch.get_num_threads()
    if outer < 2:
        torch.set_num_threads(2)
    try:
        seen_elsewhere: list[int] = []
        ready = threading.Event()
        inside = threading.Event()
        release = threading.Event()

        def other_thread() -> None:
            torch.get_num_threads()  # torch sets a thread up at its first call
            ready.set()
            inside.wait(5)
            seen_elsewhere.append(torch.get_num_threads())  # while the block below is open
            release.set()

        watcher = threading.Thread(target=other_thread)
        watcher.start()
        assert ready.wait(5)
        with _parallel.single_threaded_ops():
            assert torch.get_num_threads() == 1
            inside.set()
            assert release.wait(5)
        watcher.join()
        assert torch.get_num_threads() == max(outer, 2)  # restored on leaving
        assert seen_elsewhere == [max(outer, 2)]
        # Pool workers, and the caller while it shares a batch, run torch ops on one thread.
        threads = parallel_map(lambda _: (time.sleep(0.01), torch.get_num_threads())[1], range(8))
        assert set(threads) == {1}
        assert torch.get_num_threads() == max(outer, 2)
    finally:
        torch.set_num_threads(outer)


def _mkl_threads() -> "int | None":
    # MKL's thread count for the calling thread, as torch reports it (None without MKL).
    import re

    import torch

    found = re.search(r"mkl_get_max_threads\(\) : (\d+)", torch.__config__.parallel_info())
    return int(found.group(1)) if found else None


@pytest.mark.skipif(not _OPENMP or _mkl_threads() is None, reason="no OpenMP intra-op threads or no MKL here")
def test_codec_work_keeps_mkl_on_its_own_thread_after_a_user_sets_the_thread_count():
    # torch.set_num_threads gives MKL a per-thread count of its own, which MKL then takes
    # over OpenMP's: codec threads must set it too, or their matrix products use every core.
    # A thread set up by torch while a block is open keeps torch's default.
    import torch

    outer = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fresh: list[int] = []
        with _parallel.single_threaded_ops():
            assert _mkl_threads() == 1
            newcomer = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
            newcomer.start()
            newcomer.join()
        assert fresh == [2]
        assert _mkl_threads() == 2
        threads = parallel_map(lambda _: (time.sleep(0.01), _mkl_threads())[1], range(8))
        assert set(threads) == {1}
        assert _mkl_threads() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(outer)


def test_single_threaded_ops_change_nothing_where_the_setting_is_not_per_thread(monkeypatch):
    import torch

    monkeypatch.setattr(_parallel, "_omp", lambda: None)
    before = torch.get_num_threads()
    with _parallel.single_threaded_ops():
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


@pytest.mark.skipif(not _OPENMP, reason="torch's intra-op threads are not OpenMP's here")
def test_a_save_and_a_load_code_on_one_torch_thread_and_give_the_caller_its_own_back(tmp_path, monkeypatch):
    import dataclasses

    import torch

    import inshrinkerator as ink
    from inshrinkerator.codecs import registry
    from inshrinkerator.policies import Lossless

    seen: list[int] = []

    @dataclasses.dataclass(frozen=True)
    class Watching(Lossless):
        def plan_state(self, state, leaves, references):  # type: ignore[override]
            seen.append(torch.get_num_threads())
            return super().plan_state(state, leaves, references)

    outer = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        state = {"w": torch.randn(64, 64)}
        ink.save(state, tmp_path / "a.ink", policy=Watching())
        decoding: list[int] = []
        real_get_codec = registry.get_codec

        def watching_get_codec(config):
            decoding.append(torch.get_num_threads())
            return real_get_codec(config)

        monkeypatch.setattr("inshrinkerator.container.reader.get_codec", watching_get_codec)
        loaded = ink.load(tmp_path / "a.ink")
        assert torch.equal(loaded["w"], state["w"])
        assert seen == [1] and decoding and set(decoding) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(outer)
