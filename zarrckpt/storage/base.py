"""The storage interface: what zarrckpt needs from a checkpoint location.

:class:`Storage` is one checkpoint location (a directory, or a key prefix of an object
store); :class:`Array` is one Zarr v3 array in it, opened for region writes or reads.
Nothing outside :mod:`zarrckpt.storage` sees more than these two classes: no TensorStore
handle, no kvstore spec. Implementations:

* ``_tensorstore.TensorStoreStorage``: every URL zarrckpt takes (file, memory, S3, GCS);
  :func:`zarrckpt.storage.open_storage` makes one;
* :class:`zarrckpt.storage.FaultStorage` (``memory.py``): a test double around one of
  those that can be told to be slow, to fail, to truncate writes or to die mid-save.

Who calls what, and when (one save; spec §7)::

    rank 0   exists / read_bytes / is_empty ..... the location's state (begin)
             write_atomic("zarr.json", if_equal=)  the claim (pending root)
             sibling / make_dir / parent_lock ..... file systems: the save's own directory
    every    put / write_plain_chunk / open_for_write + Array.write ... documents, chunks
    rank     close, then flush ................... writes done, then durable
    rank 0   write_atomic("zarr.json") ........... the commit; move_to on file systems
             remove / clear ...................... a failed save's leftovers, retention

A load: read_bytes / read_json (root), get (array documents, many at once),
open_for_read + Array.read_into (chunks), read_if_changed (the root again, at the end).

Errors: every method raises :class:`~zarrckpt.errors.StorageError` (or a subclass) for a
failure of the store, keeping ``errno`` where the store gave one; futures returned by
:meth:`Storage.put`, :meth:`Storage.get` and :class:`Array` methods may instead fail with
the backend's own error, which :func:`zarrckpt.storage.translate_error` maps by key (the
callers wait through :mod:`zarrckpt.storage.inflight`, which does that).
"""

from __future__ import annotations

import abc
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from ..errors import FormatError
from ..format.documents import chunk_key

if TYPE_CHECKING:
    import concurrent.futures as cf

    from ._tensorstore import StorageOptions

__all__ = ["Array", "Box", "Storage", "plain_body", "tile_grid"]

Box = tuple[tuple[int, int], ...]


def tile_grid(box: Box, tile: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Tiles per dimension of ``box`` where it starts on tile boundaries and ends on them or
    at the array's end (it is then made of whole stored inner chunks, what
    :meth:`Array.read_tiles` reads); else None."""
    if len(tile) != len(box):
        return None
    grid = []
    for (a, b), t, n in zip(box, tile, shape):
        if a % t or (b % t and b != n):
            return None
        grid.append(-(-b // t) - a // t)
    return tuple(grid)


class Array(abc.ABC):
    """One Zarr v3 array of a location, opened by :meth:`Storage.open_for_write` or
    :meth:`Storage.open_for_read` with its ``zarr.json`` already known (no I/O to open).

    Boxes are global ``((start, stop), ...)`` per dimension. Every method returns a future
    (``.result()``, ``.done()``, ``.cancel()``, ``.add_done_callback()``) and does its I/O
    in the background. ``write``/``read_into``/``read`` are the interface; implementations
    provide ``_write``/``_read_into``/``_read``, so that one wrapper on this class (a test's
    spy) sees the operations of every implementation."""

    key: str  # the array's key below its location, for error messages
    # on file systems: it checks that each chunk file it opens is a regular file (spec §3.2),
    # so readers need not check the array's files before reading it
    checks_files: bool = False
    links_chunks: bool = False  # write(content=...) supported: incremental saves (storage/content.py, readers/previous.py)

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""

    def write(self, box: Box, data: np.ndarray, *, stable: bool = True, crcs: np.ndarray | None = None,
              content: Any = None) -> Any:
        """Write ``data`` (the box's shape, the array's dtype, any strides) into ``box``.
        The engine writes whole chunks (or shards), each once per save. ``stable``: the
        caller keeps ``data`` unchanged until the future completes, so the store may read it
        in place instead of copying it. Completion means written, not yet durable: that is
        :meth:`Storage.flush`. ``crcs`` (whole chunks only): a ``uint32`` array of the
        chunk's units that overlap the array (spec §6.6: its inner chunks, or the chunk),
        which receives, before the future completes, the CRC-32C of each unit's decoded
        bytes (padding included): what the root records for their positions. ``content``
        (only where :attr:`links_chunks`): an incremental save's record (``hashes``: chunk
        index -> content hash, filled in; ``previous``: a ``storage.content.PreviousArray`` or None)."""
        if content is not None:
            return self._write(box, data, stable, crcs, record=content)
        return self._write(box, data, stable, crcs)

    def read_into(self, box: Box, out: np.ndarray) -> Any:
        """Read ``box`` into ``out`` (its shape, possibly a strided view), without a
        temporary copy where the store allows. A missing or damaged chunk fails the future
        (:class:`~zarrckpt.errors.CorruptChunkError` once translated): never fill values."""
        return self._read_into(box, out)

    def read(self, box: Box | None = None) -> Any:
        """A future of a new array holding ``box`` (default: the whole array)."""
        return self._read(box)

    def tile_shape(self) -> tuple[int, ...] | None:
        """The shape of the tiles :meth:`read_tiles` reads (the stored inner chunk shape),
        or None where this array cannot read tiles."""
        return None

    def read_tiles(self, box: Box, out: np.ndarray) -> Any:
        """Read the stored inner chunks that meet ``box`` whole, padding included, into
        ``out`` of shape ``(n, *tile_shape())`` and the array's dtype, contiguous, in C order
        of their grid positions; ``box`` starts on tile boundaries and ends on them or at
        the array's end. No rearranging copy: the caller moves tiles into place (a load does
        it on the device). A missing or damaged chunk fails the future, as ``read_into``."""
        raise NotImplementedError(f"{type(self).__name__} does not read tiles")

    @abc.abstractmethod
    def _write(self, box: Box, data: np.ndarray, stable: bool, crcs: np.ndarray | None = None) -> Any: ...

    @abc.abstractmethod
    def _read_into(self, box: Box, out: np.ndarray) -> Any: ...

    @abc.abstractmethod
    def _read(self, box: Box | None) -> Any: ...


def plain_body(data: np.ndarray) -> memoryview:
    """The bytes of one whole chunk under the ``bytes(little)`` codec (spec §5.5), without
    a copy where ``data`` is contiguous and little-endian already: a view, so ``data`` must
    not change until they are written."""
    raw = np.ascontiguousarray(data)
    if sys.byteorder != "little" and raw.dtype.itemsize > 1:  # pragma: no cover
        raw = raw.byteswap()
    return memoryview(raw.reshape(-1).view(np.uint8))


class Storage(abc.ABC):
    """One checkpoint location: a directory on a file system, or a key prefix of an
    object store. Keys are ``/``-separated paths below it (``zarr.json``,
    ``model/w/zarr.json``, ``model/w/c/0/0``).

    Make one with :func:`zarrckpt.storage.open_storage` (a URL or path, or a Storage that
    is used as it is).

    Guarantees every implementation gives (and tests/test_fault_store.py checks):

    * :meth:`write_atomic` is seen whole or not at all by readers, and its ``if_equal``
      condition is checked atomically with the write (the commit and the claim rely on it);
    * :meth:`put` is not atomic: nothing is read before the commit, whose root is written
      with :meth:`write_atomic` after every put completed;
    * after :meth:`flush` returns, every write that completed before it survives a crash;
    * missing keys read as ``None``, never as an error.
    """

    # ---- what and where -------------------------------------------------------

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The location as the user named it (for messages)."""

    @property
    @abc.abstractmethod
    def options(self) -> StorageOptions:
        """The :class:`~zarrckpt.StorageOptions` this location was opened with; the
        manager passes them on to the loads it makes."""

    @property
    def name(self) -> str:
        """The last component of the location (the checkpoint's directory name)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """A JSON-able description of *where* the location is, without credentials or
        anything else that may differ between processes that reach the same place (ranks
        compare it to agree that they save to one location)."""

    @property
    def local_path(self) -> str | None:
        """The directory on a local file system (absolute, trailing ``/``), or None. Only
        file-system rules use it (regular-file checks, lock files beside the location)."""
        return None

    @property
    def is_object_store(self) -> bool:
        """A remote store (S3, GCS) whose failing requests are retried before they fail:
        a save stops its other writes at the first failure instead of waiting for each."""
        return False

    @property
    def can_rename(self) -> bool:
        """Whole locations can be moved atomically (:meth:`sibling`, :meth:`move_to`,
        :meth:`parent_lock`): a save writes beside the location and moves its directory
        into place (file systems). Else saves write in place (object stores, spec §7.3)."""
        return False

    # ---- documents by key ---------------------------------------------------------

    @abc.abstractmethod
    def read_bytes(self, key: str) -> tuple[bytes | None, bytes]:
        """(the bytes at ``key`` or None if absent, their generation): the generation is
        an opaque token for :meth:`write_atomic`'s ``if_equal`` and
        :meth:`read_if_changed`."""

    @abc.abstractmethod
    def read_if_changed(self, key: str, generation: bytes) -> tuple[bytes | None, bytes] | None:
        """None if ``key`` still has ``generation`` (no bytes move), else (its bytes or
        None, its new generation). A reader calls it on the root after its reads, to
        learn whether the checkpoint was replaced meanwhile (spec §7.3)."""

    @abc.abstractmethod
    def get(self, key: str) -> cf.Future:
        """Start reading ``key``: a future of its bytes, or None if absent. Readers issue
        many at once (every array's ``zarr.json``)."""

    def read_json(self, key: str) -> dict[str, Any] | None:
        """The JSON object at ``key``, or None if absent; :class:`FormatError` if it is
        not a JSON object."""
        data, _ = self.read_bytes(key)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise FormatError(f"{self.url}/{key} is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise FormatError(f"{self.url}/{key}: expected a JSON object")
        return doc

    @abc.abstractmethod
    def write_atomic(self, key: str, data: bytes, *, if_equal: bytes | None = None) -> bool:
        """Write one document so that readers see the old or the new bytes, never a mix.
        ``if_equal``: only if ``key`` still has this generation (from :meth:`read_bytes`;
        an absent key's generation means "only if still absent"). Returns False, writing
        nothing, when that condition failed. Rank 0 claims and commits with it."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> cf.Future:
        """Start writing one object (an array ``zarr.json``, a small chunk); a future. Not
        atomic (see the class docstring); every rank issues many at once."""

    def write_plain_chunk(self, array_key: str, index: tuple[int, ...], data: np.ndarray,
                          crc: int | None = None) -> cf.Future:
        """Encode one whole chunk with the codec chain ``[bytes(little), crc32c]`` (spec
        §5.5) and :meth:`put` it at its key (spec §5.1): the small-chunk path of saves,
        which skips opening an array. ``crc``: the bytes' CRC-32C where the caller has it
        already. A future."""
        body = bytes(plain_body(data))
        crc = crc32c.crc32c(body) if crc is None else crc
        return self.put(f"{array_key}/{chunk_key(index)}", body + crc.to_bytes(4, "little"))

    def copy_or_write_plain_chunk(self, array_key: str, index: tuple[int, ...], data: np.ndarray, crc: int,
                                  source: str, bucket: str, linked: list[int], tried: list[int]) -> cf.Future:
        """An incremental save's unchanged small chunk on an object store: a server-side copy
        of ``source`` (its key in ``bucket``, the previous checkpoint's chunk, which the caller
        found equal: spec §7.9) where this storage can copy (its size then appended to
        ``linked``; every attempt's to ``tried``), else :meth:`write_plain_chunk`."""
        return self.write_plain_chunk(array_key, index, data, crc)

    # ---- listing ------------------------------------------------------------------

    @abc.abstractmethod
    def list_children(self) -> list[str]:
        """Names directly below the location, sorted (the manager's step directories)."""

    @abc.abstractmethod
    def list_keys(self) -> list[str]:
        """Every key below the location, sorted (verify's one listing of all chunks)."""

    @abc.abstractmethod
    def is_empty(self) -> bool:
        """Nothing is stored at the location (a file there is not empty)."""

    @abc.abstractmethod
    def exists(self) -> bool:
        """Something (possibly an empty directory) is at the location."""

    # ---- the location as a whole ----------------------------------------------------

    @abc.abstractmethod
    def make_dir(self) -> None:
        """Create the location's directory where directories exist (a no-op elsewhere)."""

    @abc.abstractmethod
    def clear(self, keep: tuple[str, ...] = ()) -> None:
        """Delete every key below the location except the top-level names ``keep`` (an
        in-place overwrite clears all but the root, after un-committing it)."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Delete the whole location (retention, a failed save's own directory)."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Make every write that completed so far durable. Every rank calls it once, after
        its writes and before the commit; rank 0 again after the commit."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for and release what :meth:`put` started (threads); the location stays
        usable. Called when a rank's writes are done or abandoned."""

    @abc.abstractmethod
    def child(self, name: str) -> Storage:
        """The location ``name`` below this one, with the same options (the manager's
        step directories)."""

    def sibling(self, name: str) -> Storage:
        """The location ``name`` beside this one (same parent, same options): a save's
        own directory. Only where :attr:`can_rename`."""
        raise NotImplementedError(f"{type(self).__name__} has no siblings (can_rename is False)")

    @contextlib.contextmanager
    def parent_lock(self) -> Iterator[None]:
        """Held around a few check-then-move steps so that two savers of one location do
        not interleave them (an exclusive lock where :attr:`can_rename`; else nothing)."""
        yield

    def move_to(self, dst: Storage) -> Storage | None:
        """Atomically put this location at ``dst`` (the commit where :attr:`can_rename`).
        If ``dst`` held something, it is returned as a location to delete."""
        raise NotImplementedError(f"{type(self).__name__} cannot move locations (can_rename is False)")

    # ---- arrays ---------------------------------------------------------------------

    @abc.abstractmethod
    def open_for_write(self, key: str, metadata: dict[str, Any]) -> cf.Future:
        """A future of the :class:`Array` at ``key`` whose ``zarr.json`` is (or will be,
        by a :meth:`put`) exactly ``metadata``; no I/O."""

    @abc.abstractmethod
    def open_for_read(self, key: str, metadata: dict[str, Any], positions: np.ndarray | None = None) -> cf.Future:
        """A future of the :class:`Array` at ``key``; ``metadata`` is its ``zarr.json``,
        already read and validated by the caller; no I/O. ``positions`` (format 1.3, spec
        §6.6): the flat ``uint32`` table of the CRC-32C each unit must carry, in C order of
        the unit grid; reads then fail (:class:`~zarrckpt.errors.CorruptChunkError`) on a
        unit whose bytes are not the ones recorded for its position."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url!r}>"
