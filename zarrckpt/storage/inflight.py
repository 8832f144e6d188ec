"""Waiting on storage futures: errors named by key, a bound on bytes in flight, and
no operation left running behind an error."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from . import translate_error

__all__ = ["InFlight", "wait_all"]


def wait_all(futures: list[tuple[str, Any]], op: str = "read") -> None:
    """Wait for *every* (key, future) pair, then raise the first failure as a zarrckpt
    error naming its key (or the ``zarrckpt_key`` the error carries: a future of several
    objects names the one that failed). Nothing is left running when this returns or raises."""
    first = None
    for key, f in futures:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001
            first = first or translate_error(e, getattr(e, "zarrckpt_key", key), op)
    if first is not None:
        raise first


class InFlight:
    """Futures in issue order with their sizes. TensorStore holds a whole encoded shard
    (write) or fetched shard (read) in memory while an operation runs, so issuing
    everything at once costs host memory up to the checkpoint's size; ``add`` waits for
    the oldest operations whenever more than ``limit`` bytes are in flight.

    ``abort`` (object stores): the first operation that fails stops the whole batch:
    ``add`` raises its error as soon as it is known (no new operation is issued), and
    the operations still queued are cancelled rather than waited for (each would
    otherwise exhaust its own retries, one after the other).

    Use it as a context manager: leaving the block by an exception waits for every
    operation still in flight (ignoring their errors), so a failed save or load never
    goes on writing or reading after it raised.
    """

    def __init__(self, limit: int, op: str = "read", *, abort: bool = False) -> None:
        self.limit = limit
        self.op = op
        self.abort = abort
        self._q: deque[tuple[str, Any, int]] = deque()
        self._bytes = 0
        # abort: operations not completed yet, and the first failure (completion callbacks)
        self._cond = threading.Condition()
        self._running = 0
        self._failed: tuple[str, BaseException] | None = None
        self.waited = 0.0  # seconds ``add`` and ``wait`` spent waiting (a load's report)

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.drain()

    def add(self, key: str, future: Any, nbytes: int) -> None:
        self._raise_if_failed()
        self._q.append((key, future, nbytes))
        self._bytes += nbytes
        if self.abort:
            with self._cond:
                self._running += 1
            future.add_done_callback(lambda f, key=key: self._completed(key, f))
        if self._bytes > self.limit and len(self._q) > 1:
            t0 = time.perf_counter()
            self._wait_under_limit()
            self.waited += time.perf_counter() - t0

    def _wait_under_limit(self) -> None:
        while self._bytes > self.limit and len(self._q) > 1:
            k, f, n = self._q[0]
            self._until(f.done)
            self._raise_if_failed()
            self._q.popleft()
            self._bytes -= n
            wait_all([(k, f)], self.op)

    def wait(self) -> None:
        """Wait for everything in flight; raise the first error (after all completed)."""
        t0 = time.perf_counter()
        try:
            self._wait_all()
        finally:
            self.waited += time.perf_counter() - t0

    def _wait_all(self) -> None:
        self._until(lambda: self._running == 0)
        self._raise_if_failed()
        items = list(self._q)
        self._q.clear()
        self._bytes = 0
        wait_all([(k, f) for k, f, _ in items], self.op)

    def drain(self) -> None:
        """Wait for everything in flight, ignoring errors (the caller is failing already);
        with ``abort``, what has not completed is cancelled first."""
        if self.abort:
            for _, f, _ in self._q:
                f.cancel()
        items = list(self._q)
        self._q.clear()
        self._bytes = 0
        for _, f, _ in items:
            try:
                f.result()
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - TensorStore's cancel
                pass

    # ---- abort ------------------------------------------------------------------

    def _completed(self, key: str, future: Any) -> None:
        """Completion callback (``abort``): count it, remember the first failure."""
        with self._cond:
            self._running -= 1
            if self._failed is None and not future.cancelled() and future.exception() is not None:
                self._failed = (key, future.exception())
            self._cond.notify_all()

    def _until(self, done: Callable[[], bool]) -> None:
        """``abort``: block until ``done()`` or until some operation has failed."""
        if self.abort:
            with self._cond:
                self._cond.wait_for(lambda: self._failed is not None or done())

    def _raise_if_failed(self) -> None:
        """``abort``: the first failure, as a zarrckpt error naming its key (the caller's
        ``with`` block then cancels and waits for the rest)."""
        if self._failed is not None:
            key, error = self._failed
            raise translate_error(error, getattr(error, "zarrckpt_key", key), self.op)
