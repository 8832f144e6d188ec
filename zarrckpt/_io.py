"""Waiting on storage futures: errors named by key, a bound on bytes in flight, and
no operation left running behind an error."""

from __future__ import annotations

from collections import deque
from typing import Any

from .storage import translate_error

__all__ = ["InFlight", "wait_all"]


def wait_all(futures: list[tuple[str, Any]], op: str = "read") -> None:
    """Wait for *every* (key, future) pair, then raise the first failure as a zarrckpt
    error naming its key. Nothing is left running when this returns or raises."""
    first = None
    for key, f in futures:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001
            first = first or translate_error(e, key, op)
    if first is not None:
        raise first


class InFlight:
    """Futures in issue order with their sizes. TensorStore holds a whole encoded shard
    (write) or fetched shard (read) in memory while an operation runs, so issuing
    everything at once costs host memory up to the checkpoint's size; ``add`` waits for
    the oldest operations whenever more than ``limit`` bytes are in flight.

    Use it as a context manager: leaving the block by an exception waits for every
    operation still in flight (ignoring their errors), so a failed save or load never
    goes on writing or reading after it raised.
    """

    def __init__(self, limit: int, op: str = "read") -> None:
        self.limit = limit
        self.op = op
        self._q: deque[tuple[str, Any, int]] = deque()
        self._bytes = 0

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.drain()

    def add(self, key: str, future: Any, nbytes: int) -> None:
        self._q.append((key, future, nbytes))
        self._bytes += nbytes
        while self._bytes > self.limit and len(self._q) > 1:
            k, f, n = self._q.popleft()
            self._bytes -= n
            wait_all([(k, f)], self.op)

    def wait(self) -> None:
        """Wait for everything in flight; raise the first error (after all completed)."""
        items = list(self._q)
        self._q.clear()
        self._bytes = 0
        wait_all([(k, f) for k, f, _ in items], self.op)

    def drain(self) -> None:
        """Wait for everything in flight, ignoring errors (the caller is failing already)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001
            pass
