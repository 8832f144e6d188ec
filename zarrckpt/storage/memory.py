"""A store that can be told to fail: the fake that fault tests run against.

:class:`FaultStorage` wraps a real :class:`~zarrckpt.storage.base.Storage`, by default a
fresh ``memory://`` location of TensorStore, so arrays, sharding codecs and checksums
behave exactly as on disk, and injects faults by operation and key::

    store = FaultStorage()
    store.fail(ops="put", keys="*/w3/c/*", error=OSError(errno.ENOSPC, "No space left"))
    with pytest.raises(zarrckpt.StorageError):
        zarrckpt.save(state, store)
    store.heal()
    zarrckpt.save(state, store)          # a retry succeeds
    store.counts["put"]                  # requests, by operation

Faults (each rule applies to the operations ``ops`` on keys matching ``keys``, a
:mod:`fnmatch` pattern in which ``*`` also matches ``/``):

* :meth:`~FaultStorage.slow`: every matching operation first waits ``seconds``;
* :meth:`~FaultStorage.fail`: matching operations raise ``error`` (``times`` of them, or
  all) at once, without the delay of ``slow``, as the real backend would: synchronous
  methods raise it as a :class:`~zarrckpt.errors.StorageError` (``errno`` kept), futures
  fail with it as it is (the caller's :func:`~zarrckpt.storage.translate_error` names
  the key);
* :meth:`~FaultStorage.truncate`: matching writes store only their first ``to`` bytes
  and report success (a torn write); for array writes, the chunks the box covers are cut
  after the write completed;
* :meth:`~FaultStorage.die_after`: after ``n`` more writes, every operation fails with an
  unreachable-endpoint error (a server that died mid-save), until :meth:`~FaultStorage.heal`.

Operations (the names ``ops`` and :attr:`~FaultStorage.counts` use): the document
methods ``read_bytes``, ``read_if_changed``, ``get``, ``write_atomic``, ``put``; the
listings ``list_children``, ``list_keys``, ``is_empty``, ``exists``; ``make_dir``,
``clear``, ``remove``, ``flush``, ``move_to``; ``delete`` (one key, as ``clear`` and
``remove`` delete key by key, like S3); ``open`` (an array); ``write`` and ``read``
(array regions). Groups: ``"writes"`` (put, write_atomic, write, delete), ``"reads"``
(read_bytes, read_if_changed, get, read), ``"all"``. :attr:`~FaultStorage.counts` also
has ``plain_chunk`` (small-chunk writes, each also a ``put``); :attr:`~FaultStorage.events`
lists every completed operation with its times, error and (arrays) box.

Keys are matched with the path from the store the test made: ``child("step_1")``'s
``zarr.json`` is ``step_1/zarr.json``, a save's own directory beside the store (file
systems) is ``../.<name>.zarrckpt-<id>/``; whole-location operations match the
location's path (``""`` for the store itself, ``step_1`` for that child). Children and
siblings share the store's rules, counters and events.

It behaves as what it wraps: ``memory://`` is a store without directories
(``can_rename`` False: saves write in place and commit by a conditional root write, as
on S3). Wrapping a local directory (``FaultStorage(tmp_path / "c")``) keeps the file
system's rules (a save writes beside the path and renames its directory into place),
which the overwrite tests of file systems need; file-system steps that are not storage
operations (lock files, renames aside) are not faulted. ``object_store=True`` makes saves
stop at the first failed write, as they do on S3 and GCS.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import errno
import fnmatch
import math
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._tensorstore import StorageOptions, TensorStoreStorage, storage_error
from .base import Array, Box, Storage
from ..format.documents import chunk_key

__all__ = ["Event", "FaultStorage", "unavailable"]

WRITES = frozenset({"put", "write_atomic", "write", "delete"})
READS = frozenset({"read_bytes", "read_if_changed", "get", "read"})
OPS = WRITES | READS | frozenset({"list_children", "list_keys", "is_empty", "exists", "make_dir", "clear",
                                  "remove", "flush", "move_to", "open"})
_GROUPS = {"writes": WRITES, "reads": READS, "all": OPS}


def unavailable(message: str = "injected: the endpoint does not answer") -> ValueError:
    """An error shaped as TensorStore reports an unreachable endpoint (its status code
    first), which zarrckpt translates to "storage unreachable or failing"."""
    return ValueError(f"UNAVAILABLE: {message}")


@dataclass(frozen=True)
class Event:
    """One operation, as the store saw it: ``key`` as rules match it (an array's first
    chunk for ``write``/``read``, whose region is ``box``), ``time.monotonic`` seconds."""

    op: str
    key: str
    start: float
    end: float
    error: BaseException | None
    box: Box | None = None


@dataclass
class _Rule:
    kind: str  # "slow" | "fail" | "truncate"
    ops: frozenset[str]
    keys: str
    seconds: float = 0.0
    times: int | None = None  # fail: how many more, None for all
    error: BaseException | None = None
    to: int = 0

    def matches(self, op: str, keys: Iterable[str]) -> bool:
        return op in self.ops and any(fnmatch.fnmatchcase(k, self.keys) for k in keys)


class _Faults:
    """The rules, counters and worker threads that a store and every location derived
    from it (child, sibling) share."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rules: list[_Rule] = []
        self.counts: Counter[str] = Counter()
        self.events: list[Event] = []
        self.writes = 0  # writes issued
        self.die_at: int | None = None  # writes after which every operation fails
        self._pool: cf.ThreadPoolExecutor | None = None

    def pool(self) -> cf.ThreadPoolExecutor:
        with self.lock:
            if self._pool is None:
                # as many requests at once as the file backend's put threads
                self._pool = cf.ThreadPoolExecutor(4, thread_name_prefix="zarrckpt-fault")
            return self._pool

    def issue(self, op: str) -> BaseException | None:
        """Count an operation as it is issued; the error it must fail with if the store is
        dead by then (a write is counted first: the ``n``-th write still succeeds)."""
        with self.lock:
            self.counts[op] += 1
            if op in WRITES:
                self.writes += 1
                if self.die_at is not None and self.writes > self.die_at:
                    return unavailable(f"injected: the store died after {self.die_at} writes")
            elif self.die_at is not None and self.writes >= self.die_at:
                return unavailable(f"injected: the store died after {self.die_at} writes")
        return None

    def delay(self, op: str, keys: list[str]) -> float:
        with self.lock:
            return sum(r.seconds for r in self.rules if r.kind == "slow" and r.matches(op, keys))

    def failure(self, op: str, keys: list[str]) -> BaseException | None:
        with self.lock:
            for r in self.rules:
                if r.kind == "fail" and r.matches(op, keys):
                    if r.times is not None:
                        r.times -= 1
                        if r.times <= 0:
                            self.rules.remove(r)
                    return copy.copy(r.error)
        return None

    def cut(self, op: str, key: str) -> int | None:
        """The length a write of ``key`` is truncated to, or None."""
        with self.lock:
            lengths = [r.to for r in self.rules if r.kind == "truncate" and r.matches(op, [key])]
        return min(lengths) if lengths else None

    def record(self, event: Event) -> None:
        with self.lock:
            self.events.append(event)


_VERBS = {"read_bytes": "reading", "read_if_changed": "reading", "write_atomic": "writing",
          "list_children": "listing", "list_keys": "listing", "is_empty": "listing", "exists": "listing",
          "make_dir": "creating", "clear": "clearing", "remove": "deleting", "delete": "deleting",
          "flush": "making durable", "move_to": "moving", "open": "opening"}


def _ops(ops: str | Iterable[str]) -> frozenset[str]:
    names = [ops] if isinstance(ops, str) else list(ops)
    out: set[str] = set()
    for n in names:
        if n in _GROUPS:
            out |= _GROUPS[n]
        elif n in OPS:
            out.add(n)
        else:
            raise ValueError(f"unknown operation {n!r}; one of {sorted(OPS)} or {sorted(_GROUPS)}")
    return frozenset(out)


class FaultStorage(Storage):
    """A :class:`~zarrckpt.storage.base.Storage` with injected faults (module docstring).

    ``location``: what to wrap: None for a fresh ``memory://`` location, else a path, URL
    or Storage (``options`` as for :func:`~zarrckpt.storage.open_storage`).
    ``object_store``: what :attr:`is_object_store` says (default: the wrapped store's).
    """

    def __init__(self, location: str | os.PathLike | Storage | None = None, options: StorageOptions | None = None,
                 *, object_store: bool | None = None) -> None:
        if location is None:
            location = f"memory://zarrckpt-fault-{uuid.uuid4().hex}"
        self._inner = location if isinstance(location, Storage) else TensorStoreStorage(location, options)
        self._faults = _Faults()
        self._path = ""
        self._object_store = object_store
        self._running: set[cf.Future] = set()  # this location's operations not done yet
        self._running_lock = threading.Lock()

    def _derived(self, inner: Storage, path: str) -> FaultStorage:
        """A location derived from this one (child, sibling), sharing its faults."""
        out = object.__new__(FaultStorage)
        out._inner, out._faults, out._path, out._object_store = inner, self._faults, path, self._object_store
        out._running, out._running_lock = set(), threading.Lock()
        return out

    # ---- the faults ---------------------------------------------------------------------

    def slow(self, seconds: float, *, ops: str | Iterable[str] = "all", keys: str = "*") -> FaultStorage:
        """Matching operations first wait ``seconds`` (in the background for futures)."""
        with self._faults.lock:
            self._faults.rules.append(_Rule("slow", _ops(ops), keys, seconds=seconds))
        return self

    def fail(self, *, ops: str | Iterable[str] = "writes", keys: str = "*", times: int | None = None,
             error: BaseException | None = None) -> FaultStorage:
        """Matching operations raise ``error`` (default ``OSError(EIO)``; see
        :func:`unavailable` for an unreachable endpoint): the next ``times`` of them, or
        every one until :meth:`heal`."""
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, not {times!r}")
        error = error if error is not None else OSError(errno.EIO, "injected I/O error")
        with self._faults.lock:
            self._faults.rules.append(_Rule("fail", _ops(ops), keys, times=times, error=error))
        return self

    def truncate(self, *, keys: str = "*", to: int = 0, ops: str | Iterable[str] = "writes") -> FaultStorage:
        """Matching writes store only their first ``to`` bytes and succeed (torn writes)."""
        with self._faults.lock:
            self._faults.rules.append(_Rule("truncate", _ops(ops) & WRITES, keys, to=to))
        return self

    def die_after(self, n_writes: int) -> FaultStorage:
        """After ``n_writes`` more writes (from now), every operation fails as an
        unreachable endpoint does, until :meth:`heal`."""
        with self._faults.lock:
            self._faults.die_at = self._faults.writes + n_writes
        return self

    def heal(self) -> FaultStorage:
        """Remove every fault (the counters and events stay)."""
        with self._faults.lock:
            self._faults.rules.clear()
            self._faults.die_at = None
        return self

    @property
    def counts(self) -> Counter[str]:
        """Operations issued so far, by name (shared with derived locations)."""
        return self._faults.counts

    @property
    def events(self) -> list[Event]:
        """Every completed operation, in completion order (shared with derived locations)."""
        return self._faults.events

    # ---- running an operation -----------------------------------------------------------

    def _key(self, key: str = "") -> str:
        return self._path + key if key else self._path.rstrip("/")

    def _run(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        """A synchronous operation: faults first, then ``fn``; errors as the backend's."""
        where = [self._key(key)]
        start = time.monotonic()
        error = self._faults.issue(op)
        try:
            error = error or self._faults.failure(op, where)
            if error is not None:
                raise error
            time.sleep(self._faults.delay(op, where))
            result = fn()
        except BaseException as e:
            self._faults.record(Event(op, where[0], start, time.monotonic(), e))
            if isinstance(e, (OSError, ValueError)) and e is error:
                verb = _VERBS.get(op, op)
                raise storage_error(f"{verb} {self.url}/{key}" if key else f"{verb} {self.url!r}", e) from e
            raise
        self._faults.record(Event(op, where[0], start, time.monotonic(), None))
        return result

    def _submit(self, op: str, keys: list[str], fn: Callable[[], Any], box: Box | None = None) -> cf.Future:
        """An operation that returns a future: faults and ``fn`` run in a worker thread, and
        the future fails with the injected error as it is."""
        error = self._faults.issue(op)
        start = time.monotonic()

        def task() -> Any:
            try:
                failure = error or self._faults.failure(op, keys)
                if failure is not None:
                    raise failure
                time.sleep(self._faults.delay(op, keys))
                result = fn()
            except BaseException as e:
                self._faults.record(Event(op, keys[0], start, time.monotonic(), e, box))
                raise
            self._faults.record(Event(op, keys[0], start, time.monotonic(), None, box))
            return result

        future = self._faults.pool().submit(task)
        with self._running_lock:
            self._running.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: cf.Future) -> None:
        with self._running_lock:
            self._running.discard(future)

    def _cut(self, op: str, key: str, data: bytes) -> bytes:
        n = self._faults.cut(op, self._key(key))
        return data if n is None else bytes(data[:n])

    # ---- what and where -------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._inner.url

    @property
    def options(self) -> StorageOptions:
        return self._inner.options

    @property
    def name(self) -> str:
        return self._inner.name

    def identity(self) -> dict[str, Any]:
        return self._inner.identity()

    @property
    def local_path(self) -> str | None:
        return self._inner.local_path

    @property
    def is_object_store(self) -> bool:
        return self._inner.is_object_store if self._object_store is None else self._object_store

    @property
    def can_rename(self) -> bool:
        return self._inner.can_rename

    # ---- documents ----------------------------------------------------------------------

    def read_bytes(self, key: str) -> tuple[bytes | None, bytes]:
        return self._run("read_bytes", key, lambda: self._inner.read_bytes(key))

    def read_if_changed(self, key: str, generation: bytes) -> tuple[bytes | None, bytes] | None:
        return self._run("read_if_changed", key, lambda: self._inner.read_if_changed(key, generation))

    def get(self, key: str) -> cf.Future:
        return self._submit("get", [self._key(key)], lambda: self._inner.get(key).result())

    def write_atomic(self, key: str, data: bytes, *, if_equal: bytes | None = None) -> bool:
        return self._run("write_atomic", key, lambda: self._inner.write_atomic(
            key, self._cut("write_atomic", key, data), if_equal=if_equal))

    def put(self, key: str, data: bytes) -> cf.Future:
        return self._submit("put", [self._key(key)],
                            lambda: self._inner.put(key, self._cut("put", key, data)).result())

    def write_plain_chunk(self, array_key: str, index: tuple[int, ...], data: np.ndarray,
                          crc: int | None = None) -> cf.Future:
        with self._faults.lock:
            self._faults.counts["plain_chunk"] += 1
        return super().write_plain_chunk(array_key, index, data, crc)

    # ---- listing ------------------------------------------------------------------------

    def list_children(self) -> list[str]:
        return self._run("list_children", "", self._inner.list_children)

    def list_keys(self) -> list[str]:
        return self._run("list_keys", "", self._inner.list_keys)

    def is_empty(self) -> bool:
        return self._run("is_empty", "", self._inner.is_empty)

    def exists(self) -> bool:
        return self._run("exists", "", self._inner.exists)

    # ---- the location as a whole --------------------------------------------------------

    def make_dir(self) -> None:
        self._run("make_dir", "", self._inner.make_dir)

    def _delete_keys(self, keys: list[str]) -> None:
        """Delete ``keys`` one by one (as S3 does), each a ``delete`` operation."""
        inner = self._inner
        for key in keys:
            if isinstance(inner, TensorStoreStorage):
                self._run("delete", key, lambda key=key: inner._delete(key))
            else:  # pragma: no cover - a Storage without per-key deletes: all at once
                self._run("delete", key, lambda: None)

    def clear(self, keep: tuple[str, ...] = ()) -> None:
        def run() -> None:
            self._delete_keys([k for k in self._inner.list_keys() if k.split("/", 1)[0] not in keep])
            self._inner.clear(keep=keep)  # what is left: empty directories
        self._run("clear", "", run)

    def remove(self) -> None:
        def run() -> None:
            self._delete_keys(self._inner.list_keys() if self._inner.exists() else [])
            self._inner.remove()
        self._run("remove", "", run)

    def flush(self) -> None:
        self._run("flush", "", self._inner.flush)

    def close(self) -> None:
        """As the wrapped store: a local directory's close waits for the writes still
        queued (its writer threads); elsewhere nothing is waited for (the caller cancels
        or waits for its own futures)."""
        if self._inner.local_path is not None:
            with self._running_lock:
                running = list(self._running)
            cf.wait(running)
        self._inner.close()

    def child(self, name: str) -> FaultStorage:
        return self._derived(self._inner.child(name), f"{self._path}{name}/")

    def sibling(self, name: str) -> FaultStorage:
        parent = self._path.rstrip("/").rpartition("/")[0] if self._path else ".."
        return self._derived(self._inner.sibling(name), f"{parent}/{name}/" if parent else f"{name}/")

    @contextlib.contextmanager
    def parent_lock(self) -> Iterator[None]:
        with self._inner.parent_lock():
            yield

    def move_to(self, dst: Storage) -> Storage | None:
        target = dst._inner if isinstance(dst, FaultStorage) else dst
        old = self._run("move_to", "", lambda: self._inner.move_to(target))
        return None if old is None else self._derived(old, self._path)

    # ---- arrays -------------------------------------------------------------------------

    def _open(self, key: str, metadata: dict[str, Any], opener: Callable[[], Any]) -> cf.Future:
        chunks = tuple(metadata.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", ()))
        return self._submit("open", [self._key(key)],
                            lambda: _FaultArray(self, opener().result(), key, chunks))

    def open_for_write(self, key: str, metadata: dict[str, Any]) -> cf.Future:
        return self._open(key, metadata, lambda: self._inner.open_for_write(key, metadata))

    def open_for_read(self, key: str, metadata: dict[str, Any], positions: np.ndarray | None = None) -> cf.Future:
        return self._open(key, metadata, lambda: self._inner.open_for_read(key, metadata, positions))

    def open_tensorstore(self, key: str, metadata: dict[str, Any]) -> Any:
        """The wrapped store's TensorStore handle, without faults: for the readers that
        still slice TensorStore handles (being moved onto one read primitive)."""
        return self._inner.open_tensorstore(key, metadata)  # type: ignore[attr-defined]


class _FaultArray(Array):
    """An array of a :class:`FaultStorage`: its region writes and reads are operations
    ``write`` and ``read`` on the keys of the chunks the box covers."""

    def __init__(self, store: FaultStorage, inner: Array, key: str, chunk_shape: tuple[int, ...]) -> None:
        self._store, self._inner, self.key, self._chunks = store, inner, key, chunk_shape

    @property
    def shape(self) -> tuple[int, ...]:
        return self._inner.shape

    def _chunk_keys(self, box: Box | None) -> list[str]:
        """The keys of the chunks ``box`` covers (below the array)."""
        box = box or tuple((0, n) for n in self.shape)
        if len(self._chunks) != len(box) or any(b <= a for a, b in box):
            return []
        ranges = [range(a // c, math.ceil(b / c)) for (a, b), c in zip(box, self._chunks)]
        return [f"{self.key}/{chunk_key(index)}" for index in np.ndindex(*[len(r) for r in ranges])
                for index in [tuple(r[i] for r, i in zip(ranges, index))]]

    def _keys(self, box: Box | None) -> list[str]:
        store = self._store
        return [store._key(k) for k in self._chunk_keys(box)] or [store._key(self.key)]

    def _write(self, box: Box, data: np.ndarray, stable: bool, crcs: np.ndarray | None = None) -> cf.Future:
        def run() -> None:
            self._inner.write(box, data, stable=stable, crcs=crcs).result()
            for key in self._chunk_keys(box):  # torn writes: cut the chunks once written
                n = self._store._faults.cut("write", self._store._key(key))
                if n is not None:
                    stored, _ = self._store._inner.read_bytes(key)
                    if stored is not None:
                        self._store._inner.put(key, stored[:n]).result()
        return self._store._submit("write", self._keys(box), run, box)

    def _read_into(self, box: Box, out: np.ndarray) -> cf.Future:
        return self._store._submit("read", self._keys(box), lambda: self._inner.read_into(box, out).result(), box)

    def _read(self, box: Box | None) -> cf.Future:
        return self._store._submit("read", self._keys(box), lambda: self._inner.read(box).result(), box)
