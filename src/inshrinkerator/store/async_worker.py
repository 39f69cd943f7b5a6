"""One background worker, at most one job in flight, its failure re-raised later.

The manager submits a save and returns; the next ``save``, ``wait`` or ``close`` waits
for it and re-raises its failure as :class:`AsyncSaveError` chained to the original
exception (``raise ... from exc``), so the traceback shows where it really failed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Optional

from ..codecs._parallel import lower_priority
from ..errors import AsyncSaveError

__all__ = ["AsyncSaveError", "BackgroundWorker"]


class BackgroundWorker:
    """A single thread that runs one job at a time.

    ``submit`` must not be called while a job is in flight: call :meth:`result` first.
    Its thread is not a daemon: a job in flight when the interpreter exits still
    finishes, so the last save is not lost. It and the codec threads it shares work with
    run at a lower scheduling priority (``codecs._parallel.lower_priority``), so where
    they contend with the training loop for a core the training loop gets it.
    """

    def __init__(self, name: str = "inshrink-save") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=lower_priority)
        self._pending: Optional[Future[Any]] = None
        self._description = ""

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def submit(self, job: Callable[[], Any], description: str) -> None:
        """Run ``job`` in the background; ``description`` names it in a failure message."""
        if self._pending is not None:
            raise RuntimeError("a background job is still pending; call result() first")
        self._description = description
        self._pending = self._executor.submit(job)

    def settle(self) -> None:
        """Wait for the job in flight to end, keeping its outcome for :meth:`result`."""
        if self._pending is not None:
            wait([self._pending])

    def result(self) -> Any:
        """Wait for the job in flight and return its result (``None`` if there was none).

        Raises:
            AsyncSaveError: the job failed; chained to the original exception.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except Exception as exc:
            raise AsyncSaveError(f"{self._description} failed in the background: {exc}") from exc

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
