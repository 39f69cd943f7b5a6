"""One shared thread pool for codec work (zstd, numpy copies and torch release the GIL).

:func:`parallel_map` shares out a batch of items between the calling thread and idle
pool workers. The caller always works on its own batch, and a thread only ever waits
for items that another thread is already running, so nested calls (tensors in
parallel, each coding its chunks in parallel) keep every worker busy and can never
deadlock: a helper that starts after the batch is drained just finds nothing to do.

Work that runs beside training (an async save) runs on threads of lower scheduling
priority (:func:`lower_priority`): where they contend with the training loop for a core,
the kernel gives the core to the training loop; where a core is idle, they run at full
speed. A batch started on such a thread is shared out to a pool of such threads.

Codec work runs torch operations on its own thread alone (:func:`single_threaded_ops`:
pool workers always, a caller while it shares a batch, and a whole save or decode in
``serialize``), where torch's intra-op threads are OpenMP's, whose setting is per thread:
the pool already keeps the cores busy, and intra-op threads on top of it only contend for
them. With torch's default of two threads on two cores, MiniLM's synchronous saves ran at
119-150 MB/s this way against 103-110 MB/s before, and its 10-deep chain restored in
0.80-0.82 s against 0.92-0.97 s; the same files. MKL's per-thread count is set too:
once a program has called ``torch.set_num_threads``, MKL no longer follows OpenMP's (a
codec thread's matrix products ran on both cores beside the pool's other thread).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, Optional, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

#: The nice value of threads that work beside the training loop (Linux only: elsewhere
#: a thread's priority cannot be set apart from its process's).
BACKGROUND_NICE = 10

#: :func:`parallel_map_sized` shares out only items of at least this many bytes of tensor
#: data. The work on a smaller tensor is mostly interpreter overhead, which holds the GIL:
#: two threads only contend for it. On two cores, restoring a 10-deep char GPT chain
#: (tensors up to 256 KiB) took 0.90 s instead of 1.14 s with them all shared out, and a
#: MiniLM chain (384 x 384 matrices of 576 KiB and up shared out) 3.45 s instead of 3.79 s.
PARALLEL_MIN_BYTES = 1 << 19

_lock = threading.Lock()
_pools: dict[bool, ThreadPoolExecutor] = {}
_thread = threading.local()


def worker_count() -> int:
    """Threads used for codec work: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def lower_priority() -> None:
    """Mark the calling thread as background work and, on Linux, raise its nice value to
    :data:`BACKGROUND_NICE` (for good: an unprivileged thread cannot lower it again).

    Used as the initializer of threads that only ever do background work."""
    _thread.background = True
    if sys.platform.startswith("linux"):
        try:
            thread_id = threading.get_native_id()
            current = os.getpriority(os.PRIO_PROCESS, thread_id)
            os.setpriority(os.PRIO_PROCESS, thread_id, max(current, BACKGROUND_NICE))
        except OSError:  # a sandbox may refuse; the work still runs, at normal priority
            pass


_omp_set_threads: Any = None
_omp_resolved = False
_mkl_set_local: Any = None
_mkl_resolved = False


def _omp() -> Any:
    """``omp_set_num_threads`` of the OpenMP runtime behind torch's intra-op threads, or None
    where they are not OpenMP's (the setting is then process-wide, and is left alone).
    Under OpenMP, ``torch.get_num_threads()`` reads the calling thread's own setting."""
    global _omp_set_threads, _omp_resolved
    if not _omp_resolved:
        try:
            if "parallel backend: OpenMP" in torch.__config__.parallel_info():
                set_threads = ctypes.CDLL(None).omp_set_num_threads
                if _follows(set_threads):
                    _omp_set_threads = set_threads
        except (AttributeError, OSError, TypeError):  # no such runtime, or no process-wide symbols
            _omp_set_threads = None
        _omp_resolved = True
    return _omp_set_threads


def _mkl() -> Any:
    """``mkl_set_num_threads_local`` of the MKL inside torch, or None where torch has none
    (or does not export it). It sets the calling thread's MKL count and returns the one
    before (0: none of its own)."""
    global _mkl_set_local, _mkl_resolved
    if not _mkl_resolved:
        try:
            if torch.backends.mkl.is_available():
                library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
                _mkl_set_local = ctypes.CDLL(str(library)).MKL_Set_Num_Threads_Local
                _mkl_set_local.restype = ctypes.c_int
        except (AttributeError, OSError):  # another platform's library, or no such symbol
            _mkl_set_local = None
        _mkl_resolved = True
    return _mkl_set_local


def _one_thread(set_threads: Any) -> tuple[int, Optional[int]]:
    """Set the calling thread's torch operations to one thread: OpenMP's count and, where
    torch holds MKL, MKL's own. Returns both settings before (MKL's: None without it)."""
    previous = torch.get_num_threads()  # also torch's set-up of the thread, which would undo ours later
    set_threads(1)
    set_mkl = _mkl()
    return previous, set_mkl(1) if set_mkl is not None else None


def _follows(set_threads: Any) -> bool:
    # Whether torch's thread count follows this runtime (a process may hold more than one
    # OpenMP runtime): tried on a short-lived thread of its own.
    seen: list[int] = []

    def probe() -> None:
        _one_thread(set_threads)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return seen == [1]


@contextmanager
def single_threaded_ops() -> Iterator[None]:
    """Torch operations on the calling thread run without intra-op threads inside the block
    (OpenMP's and MKL's settings are the calling thread's own; elsewhere nothing changes).

    MKL follows OpenMP's count only until a program calls ``torch.set_num_threads`` (a
    training script often does), which gives the calling thread an MKL count of its own and
    turns MKL's dynamic adjustment off: from then on, with OpenMP's count alone set here, a
    codec thread's matrix products and factorizations ran on every core beside the pool
    (a 2.06 GiB model + Adam delta save took 26-32 s instead of 17-22 s)."""
    set_threads = _omp()
    if set_threads is None:
        yield
        return
    previous, previous_mkl = _one_thread(set_threads)
    try:
        yield
    finally:
        set_threads(previous)
        if previous_mkl is not None:
            _mkl()(previous_mkl)


def _pool_thread_setup(background: bool) -> None:
    # A pool thread only ever runs batches: its torch operations stay on itself.
    if background:
        lower_priority()
    set_threads = _omp()
    if set_threads is not None:
        _one_thread(set_threads)


def in_background() -> bool:
    """Whether the calling thread was marked by :func:`lower_priority`."""
    return getattr(_thread, "background", False)


def _shared_pool(background: bool) -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.get(background)
        if pool is None:
            pool = ThreadPoolExecutor(
                worker_count(), thread_name_prefix="inshrink-background" if background else "inshrink-codec",
                initializer=_pool_thread_setup, initargs=(background,),
            )
            _pools[background] = pool
        return pool


class _Batch(Generic[T, R]):
    """Items handed out one at a time to whichever thread asks next."""

    def __init__(self, fn: Callable[[T], R], items: list[T]) -> None:
        self.fn = fn
        self.items = items
        self.results: list[Optional[R]] = [None] * len(items)
        self.error: Optional[BaseException] = None
        self._next = 0
        self._running = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def _claim(self) -> int:
        with self._lock:
            if self._next >= len(self.items) or self.error is not None:
                return -1
            index = self._next
            self._next += 1
            self._running += 1
            return index

    def work(self) -> None:
        """Run items until none are left (or one has failed)."""
        while (index := self._claim()) >= 0:
            try:
                self.results[index] = self.fn(self.items[index])
            except BaseException as exc:  # handed to the caller, which re-raises it
                with self._lock:
                    if self.error is None:
                        self.error = exc
            finally:
                with self._lock:
                    self._running -= 1
                    self._idle.notify_all()

    def wait(self) -> None:
        """Block until every claimed item has finished (all of them are being run)."""
        with self._lock:
            while self._running:
                self._idle.wait()


def parallel_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, shared between the caller and idle pool workers.

    The first exception raised by ``fn`` is re-raised here once running items finish.
    """
    batch = _Batch(fn, list(items))
    helpers = min(worker_count(), len(batch.items)) - 1
    if helpers > 0:
        pool = _shared_pool(in_background())
        for _ in range(helpers):
            pool.submit(batch.work)
        with single_threaded_ops():
            batch.work()
    else:
        batch.work()
    batch.wait()
    if batch.error is not None:
        raise batch.error
    return batch.results  # type: ignore[return-value]


def parallel_map_sized(fn: Callable[[T], R], items: Iterable[T], sizes: Iterable[int]) -> list[R]:
    """``[fn(x) for x in items]``: the items of at least :data:`PARALLEL_MIN_BYTES` (their
    ``sizes``, bytes of tensor data) shared out by :func:`parallel_map`, largest first, then
    the others on the calling thread, largest first.

    On a background thread (an async save) every item is shared out: beside the training
    loop, what counts is how soon the save is done, so that the next one does not wait for
    it (MiniLM's async saves blocked 0.13 s in four runs of ``benchmarks/async_overhead.py``
    this way, 0.13-0.91 s with the small tensors on one background thread)."""
    items, sizes = list(items), list(sizes)
    if len(items) != len(sizes):
        raise ValueError("parallel_map_sized needs one size per item")
    order = sorted(range(len(items)), key=lambda i: -sizes[i])
    least = 0 if in_background() else PARALLEL_MIN_BYTES
    large = [i for i in order if sizes[i] >= least]
    small = order[len(large):]
    results: list[Optional[R]] = [None] * len(items)
    for index, result in zip(large, parallel_map(lambda i: fn(items[i]), large)):
        results[index] = result
    for index in small:
        results[index] = fn(items[index])
    return results  # type: ignore[return-value]
