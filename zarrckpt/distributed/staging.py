"""Host staging buffers: device -> host copies into memory that is reused.

``Arena`` is one flat uint8 host tensor (page-locked when CUDA is present, so
device copies run at full PCIe/NVLink-C2C speed and asynchronously) carved into
aligned typed views. Async saves keep one arena per process and reuse it for
every save, so host memory stays flat across saves; it only grows when the
state grows. Sync saves and loads use a bounded arena and stream through it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import numpy as np
import torch

from ..format import dtypes

__all__ = ["Arena", "release_arenas", "shared_arena", "staged_nbytes", "streaming_arena", "sync_devices"]

_ALIGN = 64


def _pin() -> bool:
    return torch.cuda.is_available()


class Arena:
    def __init__(self, capacity: int = 0) -> None:
        self.pinned = _pin()
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._offset = 0
        self.reserve(capacity)

    @property
    def capacity(self) -> int:
        return self._buf.numel()

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` (reallocates only when growing; resets the arena)."""
        if nbytes > self.capacity:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._offset = 0

    def reset(self) -> None:
        self._offset = 0

    def identity(self) -> tuple[int, int]:
        """Changes when the buffer is reallocated (views taken before are then stale)."""
        return self._buf.data_ptr(), self.capacity

    def used(self) -> int:
        return self._offset

    def base_ptr(self) -> int:
        return self._buf.data_ptr()

    def raw(self) -> torch.Tensor:
        """The whole buffer, as uint8."""
        return self._buf

    def skip(self, nbytes: int) -> None:
        """Mark ``nbytes`` from the start as taken (views kept from an earlier fill)."""
        if nbytes > self.capacity:
            raise MemoryError(f"arena of {self.capacity} bytes cannot take {nbytes}")
        self._offset = nbytes

    def split(self, n: int) -> list[Arena]:
        """``n`` arenas over disjoint, equal parts of this one's buffer (double buffering)."""
        size = self.capacity // n // _ALIGN * _ALIGN
        parts = []
        for i in range(n):
            part = Arena.__new__(Arena)
            part.pinned, part._buf, part._offset = self.pinned, self._buf[i * size:(i + 1) * size], 0
            parts.append(part)
        return parts

    def fits(self, nbytes: int) -> bool:
        return _aligned(self._offset) + nbytes <= self.capacity

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor view of the next free bytes."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = self.take_bytes(nbytes)
        return self._buf[start:start + nbytes].view(dtype).view(shape)

    def take_bytes(self, nbytes: int) -> int:
        """Where the next free (aligned) ``nbytes`` start in :meth:`raw`; no torch call."""
        start = _aligned(self._offset)
        if start + nbytes > self.capacity:
            raise MemoryError(f"arena of {self.capacity} bytes cannot take {nbytes} more")
        self._offset = start + nbytes
        return start

    def stage(self, src: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """Copy ``src`` (any device) into the arena without waiting; returns the host tensor
        and its NumPy view. Call :func:`sync` before reading the data."""
        dst = self.take(tuple(src.shape), src.dtype)
        dst.copy_(src.detach(), non_blocking=self.pinned and src.device.type == "cuda")
        return dst, dtypes.to_numpy(dst)


def staged_nbytes(t: torch.Tensor) -> int:
    return _aligned(t.numel() * t.element_size())


def sync_devices(tensors) -> None:
    """Wait for asynchronous device->host copies issued by :meth:`Arena.stage`."""
    if any(t.device.type == "cuda" for t in tensors):
        torch.cuda.synchronize()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


_SHARED: Arena | None = None
_SHARED_LOCK = threading.Lock()


def shared_arena() -> Arena:
    """The process's arena for async saves (at most one async save stages at a time)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Arena()
        return _SHARED


_STREAM: Arena | None = None  # loads and sync saves stream through this one, reused
_STREAM_BUSY = False


@contextlib.contextmanager
def streaming_arena(nbytes: int) -> Iterator[Arena]:
    """An arena of ``nbytes`` for one load or sync save to stream device data through.
    The process keeps one (page-locking costs ~0.6 s per GiB) and lends it to one caller
    at a time; a concurrent caller gets a temporary one. ``release_staging()`` frees it."""
    global _STREAM, _STREAM_BUSY
    with _SHARED_LOCK:
        mine = not _STREAM_BUSY
        if mine:
            _STREAM_BUSY = True
            if _STREAM is None or _STREAM.capacity < nbytes:
                _STREAM = None  # free the smaller one before allocating
                try:
                    _STREAM = Arena(nbytes)
                except BaseException:
                    _STREAM_BUSY = False
                    raise
            arena = _STREAM
    if not mine:
        arena = Arena(nbytes)
    try:
        arena.reset()
        yield arena
    finally:
        if mine:
            with _SHARED_LOCK:
                _STREAM_BUSY = False


def release_arenas() -> None:
    """Drop the async-save arena and the streaming one (unless a load or save is streaming
    through it now). The caller waits first for async saves still reading the async one."""
    global _SHARED, _STREAM
    with _SHARED_LOCK:
        _SHARED = None
        if not _STREAM_BUSY:
            _STREAM = None
