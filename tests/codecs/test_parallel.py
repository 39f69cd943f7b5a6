"""The codec thread pool: results in order, errors re-raised, nesting never deadlocks."""

from __future__ import annotations

import threading
import time

import pytest

from inshrinkerator.codecs import _parallel
from inshrinkerator.codecs._parallel import parallel_map, worker_count


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
    monkeypatch.setattr(_parallel, "_pool", None)
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
