"""One shared thread pool for codec work (zstd and torch release the GIL)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_local = threading.local()


def worker_count() -> int:
    """Threads used for codec work: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def parallel_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, spread over the pool when there is more than one item.

    Calls made from inside a pool worker run inline, so nested use never deadlocks.
    """
    items = list(items)
    if len(items) <= 1 or getattr(_local, "in_pool", False) or worker_count() == 1:
        return [fn(x) for x in items]
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(worker_count(), thread_name_prefix="inshrink-codec")
    return list(_pool.map(lambda x: _run_marked(fn, x), items))


def _run_marked(fn: Callable[[T], R], item: T) -> R:
    _local.in_pool = True
    try:
        return fn(item)
    finally:
        _local.in_pool = False
