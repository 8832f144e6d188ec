"""Waiting on storage futures: errors named by key, and a bound on bytes in flight."""

from __future__ import annotations

from collections import deque
from typing import Any

from .storage._tensorstore import translate_error

__all__ = ["InFlight", "wait_all"]


def wait_all(futures: list[tuple[str, Any]]) -> None:
    """Wait for (key, future) pairs; the first failure becomes a zarrckpt error naming its key."""
    first = None
    for key, f in futures:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001
            first = first or translate_error(e, key)
    if first is not None:
        raise first


class InFlight:
    """Futures in issue order with their sizes. TensorStore holds a whole encoded shard
    (write) or fetched shard (read) in memory while an operation runs, so issuing
    everything at once costs host memory up to the checkpoint's size; ``add`` waits for
    the oldest operations whenever more than ``limit`` bytes are in flight."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._q: deque[tuple[str, Any, int]] = deque()
        self._bytes = 0

    def add(self, key: str, future: Any, nbytes: int) -> None:
        self._q.append((key, future, nbytes))
        self._bytes += nbytes
        while self._bytes > self.limit and len(self._q) > 1:
            k, f, n = self._q.popleft()
            self._bytes -= n
            wait_all([(k, f)])

    def wait(self) -> None:
        items = list(self._q)
        self._q.clear()
        self._bytes = 0
        wait_all([(k, f) for k, f, _ in items])
