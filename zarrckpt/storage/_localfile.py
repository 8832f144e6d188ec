"""Chunk files on a local file system, written and read without TensorStore's codec path.

For the codec chains zarrckpt writes uncompressed (spec §5.5):

* plain: ``[bytes(little), crc32c]`` — the file is the chunk's bytes, then their CRC-32C;
* sharded: ``sharding_indexed`` whose inner and index codecs are ``[bytes(little), crc32c]``
  and whose index is at the end — the file is the encoded inner chunks, then the index
  (``(offset, nbytes)`` as little-endian uint64 per inner chunk in C order, both
  ``2**64 - 1`` for an absent one), then the index's CRC-32C.

an encoded inner chunk has a fixed size (its bytes plus 4), so every inner chunk's offset
is known before anything is written. That lets one shard be written by several threads
at once with ``pwritev`` straight from the caller's memory (no encoded copy of the shard
is ever built), and a region be read with ``preadv`` straight into the target. Each
inner chunk passes through the CPU once: its CRC is computed over the bytes where they
lie (an inner chunk that is not contiguous in the caller's array goes through a
per-thread buffer of one inner chunk, which stays in cache).

TensorStore writes and reads the same bytes (tests/test_localfile.py compares them file
for file, and reads each one's files with the other and with zarr-python). Anything else
(compression, big-endian hosts, object stores) goes through TensorStore.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import functools
import itertools
import math
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from .base import Array, tile_grid
from .content import fsync_path
from ..format import dtypes
from ..errors import CorruptChunkError, FormatError


__all__ = ["ChunkCodec", "LocalArray", "ReadBatch", "check_index", "chunk_codec", "counters", "file_type", "fill_scalar",
           "inner_offset", "misplaced", "release_buffers", "unit_crcs", "unit_digest", "units_codec"]

Box = tuple[tuple[int, int], ...]

_ABSENT = 2**64 - 1
# bytes of inner chunks per task: a shard bigger than this is written (and a region read)
# by several threads at once
PIECE_BYTES = 32 << 20
# a chunk file up to this size whose every inner chunk is wanted is read in one call (on a
# cold disk, reading the index at the end and then the data costs two seeks per file)
WHOLE_FILE_BYTES = 4 << 20
# a whole chunk written in one call gathers its inner chunks that are not contiguous in the
# source (2-D inner chunks of a wider tensor) into a per-thread buffer of at most this size
GATHER_BYTES = 8 << 20


def _plain(codecs: Any) -> bool:
    """``[bytes(little), crc32c]`` exactly (an omitted endian only where it is allowed)."""
    if not isinstance(codecs, list) or len(codecs) != 2:
        return False
    b, c = codecs
    return (b.get("name") == "bytes" and b.get("configuration", {}).get("endian", "little") == "little"
            and c.get("name") == "crc32c" and not c.get("configuration"))


@dataclass(frozen=True)
class ChunkCodec:
    """What a chunk file of one array holds: ``inner`` is the inner chunk shape when
    sharded, else the chunk shape itself (one "inner chunk", no index)."""

    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    inner: tuple[int, ...]
    sharded: bool
    dtype: np.dtype
    fill: Any = None  # the fill value as a 0-d array of ``dtype`` (padding); None: zero bytes

    def fill_value(self) -> np.ndarray:
        return np.zeros((), self.dtype) if self.fill is None else self.fill

    @functools.cached_property
    def unit_grid(self) -> tuple[int, ...]:
        """Units (inner chunks, or chunks) per dimension that overlap the array (spec §6.6)."""
        return tuple(-(-n // i) for n, i in zip(self.shape, self.inner))

    def present_shape(self, chunk_index: tuple[int, ...]) -> tuple[int, ...]:
        """The box of a chunk's units that overlap the array (``present`` is its C order)."""
        return tuple(max(0, min(g, -(-(n - c * cs) // i))) for c, cs, g, i, n in
                     zip(chunk_index, self.chunk, self.grid, self.inner, self.shape))

    def unit_linear(self, chunk_index: tuple[int, ...], j: tuple[int, ...]) -> int:
        """The position of inner chunk ``j`` of a chunk in the table of positions (C order of
        the unit grid, spec §6.6)."""
        out = 0
        for c, g, k, u in zip(chunk_index, self.grid, j, self.unit_grid):
            out = out * u + c * g + k
        return out

    @functools.cached_property
    def grid(self) -> tuple[int, ...]:
        """Inner chunks per chunk, per dimension."""
        return tuple(c // i for c, i in zip(self.chunk, self.inner))

    @functools.cached_property
    def count(self) -> int:
        return math.prod(self.grid)

    @functools.cached_property
    def inner_nbytes(self) -> int:
        return math.prod(self.inner) * self.dtype.itemsize

    @functools.cached_property
    def index_nbytes(self) -> int:
        return 16 * self.count + 4 if self.sharded else 0

    def chunk_key(self, index: tuple[int, ...]) -> str:
        return "/".join(["c", *map(str, index)])

    def inner_box(self, chunk_index: tuple[int, ...], j: tuple[int, ...]) -> Box:
        """Global box of inner chunk ``j`` of chunk ``chunk_index``, clipped to the shape."""
        return tuple((c * cs + k * i, min(c * cs + (k + 1) * i, n))
                     for c, cs, k, i, n in zip(chunk_index, self.chunk, j, self.inner, self.shape))

    def present_count(self, chunk_index: tuple[int, ...]) -> int:
        """``len(self.present(chunk_index))``, by arithmetic: per dimension, the inner chunks
        that start inside the shape."""
        return math.prod(max(0, min(g, -(-(n - c * cs) // i))) for c, cs, g, i, n in
                         zip(chunk_index, self.chunk, self.grid, self.inner, self.shape))

    def present(self, chunk_index: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Inner chunks of a chunk not wholly in its padding, in C order (the ones written)."""
        return list(itertools.product(*[range(max(0, min(g, -(-(n - c * cs) // i)))) for c, cs, g, i, n in
                                        zip(chunk_index, self.chunk, self.grid, self.inner, self.shape)]))


def fill_scalar(value: Any, dtype: np.dtype) -> np.ndarray:
    """A (valid, spec §5.2) JSON fill value as a 0-d array of ``dtype``."""
    def one(v: Any, dt: np.dtype) -> np.ndarray:
        if isinstance(v, str) and v.startswith("0x"):
            return np.frombuffer(int(v, 16).to_bytes(dt.itemsize, "little"), dt).reshape(())
        if isinstance(v, str):
            v = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}[v]
        if isinstance(v, (bool, int)) and dt.kind in "biu":
            return np.array(v, dt)
        return np.array(v, np.float64).astype(dt)
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        part = np.dtype(f"<f{dtype.itemsize // 2}")
        out = np.zeros((), dtype)
        out.real, out.imag = one(value[0], part), one(value[1], part)
        return out
    return one(value, dtype)


def units_codec(metadata: dict[str, Any]) -> ChunkCodec:
    """The chunk and unit shapes of a valid array ``zarr.json`` whatever its codec chain
    (compressed too): what the table of positions (spec §6.6) is laid out by."""
    shape = tuple(metadata["shape"])
    chunk = tuple(metadata["chunk_grid"]["configuration"]["chunk_shape"])
    codecs = metadata["codecs"]
    sharded = len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed"
    inner = tuple(codecs[0]["configuration"]["chunk_shape"]) if sharded else chunk
    dtype = np.dtype(dtypes.by_zarr(metadata["data_type"]).numpy)
    return ChunkCodec(shape, chunk, inner, sharded, dtype, fill_scalar(metadata["fill_value"], dtype))


def unit_crcs(codec: ChunkCodec, index: tuple[int, ...], data: np.ndarray) -> np.ndarray:
    """The CRC-32C of the decoded bytes of each unit of chunk ``index`` that overlaps the
    array (spec §6.6: its elements in C order, little-endian, padding = the fill value),
    from ``data``, the chunk's part inside the array (any strides); ``uint32`` of
    :meth:`ChunkCodec.present_shape`. A unit that is contiguous in ``data`` is read in
    place; others go through a per-thread buffer of one unit."""
    out = np.empty(codec.present_shape(index), np.uint32)
    origin = tuple(i * c for i, c in zip(index, codec.chunk))
    for j in np.ndindex(*out.shape):
        out[j] = _unit_crc(codec, _sub(data, codec.inner_box(index, j), origin))
    return out


def unit_digest(codec: ChunkCodec, index: tuple[int, ...], data: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Chunk ``index``'s content hash (spec §6.6.2: the hash of its units' decoded bytes in
    C order, padding = the fill value) and :func:`unit_crcs`, in one pass over ``data`` (the
    chunk's part inside the array, any strides): what an incremental save compares with
    the previous checkpoint's records wherever its chunks are written through TensorStore."""
    from . import content

    crcs = np.empty(codec.present_shape(index), np.uint32)
    origin = tuple(i * c for i, c in zip(index, codec.chunk))

    def bodies():
        for j in np.ndindex(*crcs.shape):
            tile = _sub(data, codec.inner_box(index, j), origin)
            if tile.shape == codec.inner and tile.flags.c_contiguous and sys.byteorder == "little":
                body = _bytes_of(tile)
            else:
                buf = _scratch(codec.inner_nbytes).view(codec.dtype).reshape(codec.inner)
                if tile.shape != codec.inner:
                    buf[...] = codec.fill_value()
                np.copyto(buf[tuple(slice(0, s) for s in tile.shape)], tile, casting="no")
                body = _bytes_of(buf)
            crcs[j] = crc32c.crc32c(body)
            yield body

    return content.chunk_hash(bodies()), crcs


def _unit_crc(codec: ChunkCodec, tile: np.ndarray) -> int:
    """CRC-32C of one unit's decoded bytes from ``tile``, its part inside the array."""
    if tile.shape == codec.inner and tile.flags.c_contiguous and sys.byteorder == "little":
        return crc32c.crc32c(_bytes_of(tile))
    buf = _scratch(codec.inner_nbytes).view(codec.dtype).reshape(codec.inner)
    if tile.shape != codec.inner:
        buf[...] = codec.fill_value()
    np.copyto(buf[tuple(slice(0, s) for s in tile.shape)], tile, casting="no")
    return crc32c.crc32c(_bytes_of(buf))


def misplaced(where: str, got: int, want: int) -> CorruptChunkError:
    """The error of a unit whose bytes are intact but recorded for another position."""
    error = CorruptChunkError(
        f"{where} holds bytes that do not belong at its position: their CRC-32C is {got:08x}, the root "
        f"records {want:08x} for it (spec §6.6: chunk files swapped or copied, or a shard index entry "
        "that points at another inner chunk)")
    error.zarrckpt_misplaced = True  # verify reports it as kind "position"
    return error


def chunk_codec(metadata: dict[str, Any]) -> ChunkCodec | None:
    """The :class:`ChunkCodec` of an array ``zarr.json``, or None when its chunks are not
    of the two forms above (those go through TensorStore)."""
    if sys.byteorder != "little":  # pragma: no cover
        return None
    try:
        grid = metadata["chunk_grid"]
        cke = metadata["chunk_key_encoding"]
        if grid.get("name") != "regular" or cke.get("name") != "default" \
                or cke.get("configuration", {}).get("separator", "/") != "/":
            return None
        shape = tuple(metadata["shape"])
        chunk = tuple(grid["configuration"]["chunk_shape"])
        dtype = dtypes.by_zarr(metadata["data_type"]).numpy
        codecs = metadata["codecs"]
        fill = fill_scalar(metadata["fill_value"], np.dtype(dtype))
        if _plain(codecs):
            return ChunkCodec(shape, chunk, chunk, False, np.dtype(dtype), fill)
        if len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed":
            cfg = codecs[0]["configuration"]
            inner = tuple(cfg["chunk_shape"])
            if (_plain(cfg["codecs"]) and _plain(cfg["index_codecs"])
                    and cfg.get("index_location", "end") == "end"
                    and len(inner) == len(chunk) and all(i > 0 and c % i == 0 for c, i in zip(chunk, inner))):
                return ChunkCodec(shape, chunk, inner, True, np.dtype(dtype), fill)
    except Exception:  # noqa: BLE001 - anything unusual goes through TensorStore
        return None
    return None


# --------------------------------------------------------------------------- futures

class _Group:
    """One future over several pool tasks: done when all are, failing with the first error.
    ``finish`` runs in the last task's thread once every task succeeded."""

    def __init__(self, n: int, finish: Callable[[], None] | None = None) -> None:
        self.future: cf.Future = cf.Future()
        self._left = n
        self._error: BaseException | None = None
        self._finish = finish
        self._lock = threading.Lock()
        if n == 0:
            self._done()

    def run(self, fn: Callable[[], None]) -> None:
        error = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the future
            error = e
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if last:
            self._done()

    def _done(self) -> None:
        if self._error is None and self._finish is not None:
            try:
                self._finish()
            except BaseException as e:  # noqa: BLE001
                self._error = e
        if self._error is not None:
            self.future.set_exception(self._error)
        else:
            self.future.set_result(None)


def _failed(error: BaseException) -> cf.Future:
    """A future that has failed with ``error``."""
    future: cf.Future = cf.Future()
    future.set_exception(error)
    return future


_counts = {"bytes_read": 0, "bytes_written": 0}
_counts_lock = threading.Lock()


def _count(name: str, n: int) -> None:
    with _counts_lock:
        _counts[name] += n


def counters() -> dict[str, int]:
    """Bytes this process read from and wrote to chunk files directly (since start)."""
    with _counts_lock:
        return dict(_counts)


_pools: dict[int, cf.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> cf.ThreadPoolExecutor:
    # ThreadPoolExecutor: threads started as needed and joined at shutdown, in
    # multiprocessing children too (a queue-fed pool of daemon threads tried in issue 30
    # measured no faster on the 2-core VM and made processes abort at exit)
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = cf.ThreadPoolExecutor(threads, thread_name_prefix="zarrckpt-io")
        return pool


_local = threading.local()
_IOV_MAX = 1024  # buffers per pwritev/preadv call (Linux)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def file_type(mode: int) -> str:
    """What a ``st_mode`` that is not a regular file is, in words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _scratch(nbytes: int, slot: str = "buf") -> np.ndarray:
    """This thread's buffer ``slot`` of at least ``nbytes`` ("buf": one inner chunk;
    "whole": one small chunk file)."""
    buf = getattr(_local, slot, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        setattr(_local, slot, buf)
    return buf[:nbytes]


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _sub(a: np.ndarray, box: Box, origin: tuple[int, ...]) -> np.ndarray:
    """The view of ``a`` (whose element 0 is at global ``origin``) over global ``box``."""
    return a[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin))] if box else a


_HASH_SLICE = 1 << 20  # incremental saves: bytes checksummed and hashed at once (_digest)


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


def _split(items: list, size: int, piece: int) -> Iterator[list]:
    n = max(1, piece // max(size, 1))
    for s in range(0, len(items), n):
        yield items[s:s + n]


# --------------------------------------------------------------------------- arrays

class LocalArray(Array):
    """An array whose chunk files are written and read directly (see the module docstring):
    an :class:`~zarrckpt.storage.base.Array` whose futures are ``concurrent.futures``."""

    checks_files = True  # _open_chunk: each chunk file it opens
    links_chunks = True  # incremental saves: _link_or_write

    def __init__(self, directory: str, codec: ChunkCodec, key: str, *, threads: int, fsync: bool,
                 positions: np.ndarray | None = None) -> None:
        self.dir = directory
        self.codec = codec
        self.key = key
        self.fsync = fsync
        # the CRC-32C each unit must carry (spec §6.6, format 1.3): a unit's stored CRC is
        # that of its decoded bytes here (uncompressed), so the check is one comparison
        self.positions = positions
        self._pool = _pool(threads)
        self._dirs: set[str] = set()
        self._index: dict[tuple[int, ...], tuple[list, int]] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codec.shape

    def _path(self, index: tuple[int, ...]) -> str:
        return os.path.join(self.dir, *self.codec.chunk_key(index).split("/"))

    def _where(self, index: tuple[int, ...], j: tuple[int, ...] | None = None) -> str:
        w = f"array {self.key!r}: chunk {self.codec.chunk_key(index)}"
        return w + (f" inner chunk {list(j)}" if j is not None and self.codec.sharded else "")

    # ---- write --------------------------------------------------------------

    def _write(self, box: Box, data: np.ndarray, stable: bool, crcs: np.ndarray | None = None,
               record: Any = None) -> cf.Future:
        """Write the whole chunk ``box`` (clipped to the shape) from ``data`` (any strides);
        the caller keeps ``data`` unchanged until the future completes (always)."""
        c = self.codec
        index = tuple(a // cs for (a, _), cs in zip(box, c.chunk))
        if box != tuple((i * cs, min((i + 1) * cs, n)) for i, cs, n in zip(index, c.chunk, c.shape)) \
                or data.shape != tuple(b - a for a, b in box):
            raise ValueError(f"{self._where(index)}: direct writes take whole chunks, not {box}")
        path = self._path(index)
        origin = tuple(a for a, _ in box)
        enc = c.inner_nbytes + 4
        present = c.present(index)
        slot = {j: n for n, j in enumerate(present)}
        pieces = list(_split(present, enc, PIECE_BYTES))
        if len(pieces) == 1:  # a small chunk: one pool task creates, writes and closes it,
            # so the caller's thread (which issues thousands of these) makes no system call
            group = _Group(1)

            def whole() -> None:
                known = None
                if record is not None:
                    known = self._link_or_write(record, index, origin, data, present, crcs)
                    if known is None:
                        return  # linked
                self._write_whole(path, index, origin, data, present, slot, crcs, known)
            self._pool.submit(group.run, whole)
            return group.future
        if record is not None:
            # a big chunk of an incremental save: checked in a pool task (the checks of
            # several chunks run at once; in the caller's thread they ran one by one, ~100
            # ms per GiB on one core), then linked, or its pieces written in parallel
            outer: cf.Future = cf.Future()

            def check() -> None:
                try:
                    known = self._link_or_write(record, index, origin, data, present, crcs)
                    if known is None:
                        outer.set_result(None)
                        return
                    inner = self._write_pieces(path, index, origin, data, present, slot, pieces, crcs, known)
                except BaseException as e:  # noqa: BLE001 - handed to the future
                    outer.set_exception(e)
                    return
                inner.add_done_callback(
                    lambda f: outer.set_result(None) if f.exception() is None else outer.set_exception(f.exception()))
            self._pool.submit(check)
            return outer
        return self._write_pieces(path, index, origin, data, present, slot, pieces, crcs, None)

    def _write_pieces(self, path: str, index: tuple[int, ...], origin: tuple[int, ...], data: np.ndarray,
                      present: list, slot: dict, pieces: list, crcs: np.ndarray | None,
                      known: np.ndarray | None) -> cf.Future:
        """Create a big chunk's file and write its ``pieces`` (of inner chunks) in parallel
        pool tasks, then its shard index; fsynced when asked."""
        c = self.codec
        enc = c.inner_nbytes + 4
        try:
            self._create(path, len(present) * enc + c.index_nbytes)
        except OSError as e:  # reported through the future, like the writes' own errors
            return _failed(e)

        def finish() -> None:
            if self.fsync:
                fsync_path(path)

        group = _Group(len(pieces) + (1 if c.sharded else 0), finish)
        for piece in pieces:
            self._pool.submit(group.run, lambda piece=piece: self._write_inner(path, index, origin, data, piece,
                                                                               slot, crcs, known))
        if c.sharded:
            index_bytes = self._index_bytes(slot)
            self._pool.submit(group.run, lambda: self._pwrite(path, [index_bytes], len(present) * enc))
        return group.future

    def _index_bytes(self, slot: dict) -> bytes:
        """The shard index of a chunk whose inner chunk ``j`` is the ``slot[j]``-th in the file."""
        c = self.codec
        enc = c.inner_nbytes + 4
        table = np.full((c.count, 2), _ABSENT, dtype="<u8")
        for j, n in slot.items():
            table[np.ravel_multi_index(j, c.grid)] = (n * enc, enc)
        raw = table.tobytes()
        return raw + crc32c.crc32c(raw).to_bytes(4, "little")

    def _write_whole(self, path: str, index: tuple[int, ...], origin: tuple[int, ...], data: np.ndarray,
                     present: list, slot: dict, crcs: np.ndarray | None, known: np.ndarray | None = None) -> None:
        """A whole chunk in one task, by one file descriptor and one vectored write: every
        inner chunk and its CRC-32C in file order, then the shard index, fsynced when asked.
        Inner chunks that do not lie contiguous in ``data`` (or reach into the padding) are
        copied into this thread's buffer first. Each call that releases the GIL makes the
        other writer threads of a rank take it in turn (futex calls): a chunk of four inner
        chunks cost 16 such calls written piece by piece (create, open per piece, the index
        on its own) and costs 7 so."""
        c = self.codec
        enc = c.inner_nbytes + 4
        tiles = [_sub(data, c.inner_box(index, j), origin) for j in present]
        copied = sum(1 for t in tiles if t.shape != c.inner or not t.flags.c_contiguous)
        if copied * c.inner_nbytes > GATHER_BYTES:  # piece by piece through one inner chunk's buffer
            self._create(path, len(present) * enc + c.index_nbytes)
            self._write_inner(path, index, origin, data, present, slot, crcs, known)
            if c.sharded:
                self._pwrite(path, [self._index_bytes(slot)], len(present) * enc)
            if self.fsync:
                fsync_path(path)
            return
        bufs: list = [None] * (2 * len(present))
        staged = _scratch(copied * c.inner_nbytes, "gather") if copied else None
        used = 0
        for j, tile in zip(present, tiles):
            n = slot[j]
            if tile.shape == c.inner and tile.flags.c_contiguous:
                body = _bytes_of(tile)
            else:  # strided, or partly in the padding (filled with the fill value)
                buf = staged[used:used + c.inner_nbytes].view(c.dtype).reshape(c.inner)
                used += c.inner_nbytes
                if tile.shape != c.inner:
                    buf[...] = c.fill_value()
                np.copyto(buf[tuple(slice(0, s) for s in tile.shape)], tile, casting="no")
                body = _bytes_of(buf)
            value = crc32c.crc32c(body) if known is None else int(known[j])
            if crcs is not None:
                crcs[j] = value
            bufs[2 * n], bufs[2 * n + 1] = body, value.to_bytes(4, "little")
        if c.sharded:
            bufs.append(self._index_bytes(slot))
        fd = self._create(path, None)
        try:
            for at in range(0, len(bufs), _IOV_MAX):  # IOV_MAX buffers per call on Linux
                part = bufs[at:at + _IOV_MAX]
                _pwritev_all(fd, part, (at // 2) * enc)
            _count("bytes_written", sum(memoryview(b).nbytes for b in bufs))
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _create(self, path: str, size: int | None) -> int | None:
        """A fresh chunk file: of its final ``size`` (every task then writes its own byte
        range; closed), or, ``size`` None, left open for writing (its descriptor returned)."""
        parent = os.path.dirname(path)
        if parent not in self._dirs:
            os.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
        except FileExistsError:  # never truncate it: it may be a hard link into another step
            os.unlink(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
        if size is None:
            return fd
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return None

    def _write_inner(self, path: str, index: tuple[int, ...], origin: tuple[int, ...], data: np.ndarray,
                     piece: list[tuple[int, ...]], slot: dict, crcs: np.ndarray | None = None,
                     known: np.ndarray | None = None) -> None:
        """Write inner chunks ``piece``; ``known``: their CRC-32Cs, computed already (an
        incremental save's check), so the data is not checksummed twice."""
        c = self.codec
        enc = c.inner_nbytes + 4
        fd = os.open(path, os.O_WRONLY)
        try:
            for j, body in self._bodies(index, origin, data, piece):
                value = crc32c.crc32c(body) if known is None else int(known[j])
                if crcs is not None:
                    crcs[j] = value
                _pwritev_all(fd, [body, value.to_bytes(4, "little")], slot[j] * enc)
                _count("bytes_written", enc)
        finally:
            os.close(fd)

    def _bodies(self, index: tuple[int, ...], origin: tuple[int, ...], data: np.ndarray,
                piece: list[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...], memoryview]]:
        """The decoded bytes of inner chunks ``piece`` of chunk ``index`` (padding filled),
        each valid until the next is taken (one scratch buffer per thread)."""
        c = self.codec
        for j in piece:
            tile = _sub(data, c.inner_box(index, j), origin)
            if tile.shape == c.inner and tile.flags.c_contiguous:
                yield j, _bytes_of(tile)
                continue
            # strided, or partly in the padding (filled with the fill value)
            buf = _scratch(c.inner_nbytes).view(c.dtype).reshape(c.inner)
            if tile.shape != c.inner:
                buf[...] = c.fill_value()
            np.copyto(buf[tuple(slice(0, s) for s in tile.shape)], tile, casting="no")
            yield j, _bytes_of(buf)

    def _digest(self, index: tuple[int, ...], origin: tuple[int, ...], data: np.ndarray,
                present: list[tuple[int, ...]]) -> tuple[bytes, np.ndarray]:
        """Chunk ``index``'s content hash (spec §6.6.2) and the CRC-32C of each of its units."""
        shape = tuple(len({j[d] for j in present}) for d in range(len(self.codec.inner)))
        unit_crcs = np.zeros(shape, np.uint32)

        def each():  # CRC and hash over each MiB while it is in cache: ~25 % less time (2 cores)
            for j, body in self._bodies(index, origin, data, present):
                body = memoryview(body).cast("B")
                value = 0
                for at in range(0, len(body), _HASH_SLICE):
                    part = body[at:at + _HASH_SLICE]
                    value = crc32c.crc32c(part, value)
                    yield part
                unit_crcs[j] = value
        from . import content
        digest = content.chunk_hash(each())
        return digest, unit_crcs

    def _link_or_write(self, record: Any, index: tuple[int, ...], origin: tuple[int, ...], data: np.ndarray,
                       present: list, crcs: np.ndarray | None) -> np.ndarray | None:
        """An incremental save's check of one chunk: record its hash; link the previous
        checkpoint's file when hash and unit CRCs match (None: done), else return the unit
        CRC-32Cs just computed, for the write."""
        from . import content as _content
        digest, unit_crcs = self._digest(index, origin, data, present)
        record.hashes[index] = digest
        prev = record.previous
        if prev is None or not prev.matches(index, digest, unit_crcs):
            return unit_crcs
        path = self._path(index)
        if not _content.link(prev.path(index), path, self._dirs):
            return unit_crcs
        if crcs is not None:
            crcs[...] = unit_crcs
        if self.fsync:
            fsync_path(path)
        _content.count(chunks_linked=1, bytes_linked=data.nbytes)
        record.linked.append(data.nbytes)
        return None

    def _pwrite(self, path: str, bufs: list, offset: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            _pwritev_all(fd, bufs, offset)
            _count("bytes_written", sum(len(b) for b in bufs))
        finally:
            os.close(fd)

    # ---- read ---------------------------------------------------------------

    def _read_into(self, box: Box, out: np.ndarray) -> cf.Future:
        """Read the global ``box`` into ``out`` (a possibly strided view of its shape)."""
        units = self._box_units(box)
        if not units:
            return _Group(0).future
        origin = tuple(a for a, _ in box)
        pieces = list(_split(units, self.codec.inner_nbytes + 4, PIECE_BYTES))
        group = _Group(len(pieces), self._bool_check(box, out))
        for piece in pieces:
            whole = self._whole_chunks(piece) if self._small else frozenset()
            self._pool.submit(group.run, lambda piece=piece, whole=whole:
                              self._read_units(box, origin, out, piece, whole))
        return group.future

    def read_now(self, box: Box, out: np.ndarray, tiles: bool) -> None:
        """:meth:`read_tiles` (``tiles``) or :meth:`read_into` of ``box`` done in the calling
        thread, a reader thread running a :class:`ReadBatch`."""
        if tiles:
            units = self._tile_units(box, out)
            if units:
                self._read_tiles(units)
        else:
            units = self._box_units(box)
            if units:
                self._read_units(box, tuple(a for a, _ in box), out, units,
                                 self._whole_chunks(units) if self._small else frozenset())
        check = self._bool_check(box, out)
        if check is not None:
            check()

    @functools.cached_property
    def _small(self) -> bool:
        """Chunk files small enough to read whole when every inner chunk is wanted."""
        c = self.codec
        return c.sharded and c.count * c.inner_nbytes <= WHOLE_FILE_BYTES

    def _box_units(self, box: Box) -> list:
        """(chunk index, inner chunk) pairs that meet ``box``, in file order."""
        c = self.codec
        if any(b <= a for a, b in box):
            return []
        units = []
        first = [a // cs for (a, _), cs in zip(box, c.chunk)]
        last = [(b - 1) // cs for (_, b), cs in zip(box, c.chunk)]
        for index in itertools.product(*[range(f, l + 1) for f, l in zip(first, last)]):
            ranges = [range((max(a, i * cs) - i * cs) // n, (min(b, (i + 1) * cs) - 1 - i * cs) // n + 1)
                      for (a, b), i, cs, n in zip(box, index, c.chunk, c.inner)]
            units.extend((index, j) for j in itertools.product(*ranges))
        return units

    def tile_shape(self) -> tuple[int, ...] | None:
        return self.codec.inner if self.codec.sharded else None

    def read_tiles(self, box: Box, out: np.ndarray) -> cf.Future:
        units = self._tile_units(box, out)
        if not units:
            return _Group(0).future
        pieces = list(_split(units, self.codec.inner_nbytes + 4, PIECE_BYTES))
        group = _Group(len(pieces), self._bool_check(box, out))
        for piece in pieces:
            self._pool.submit(group.run, lambda piece=piece: self._read_tiles(piece))
        return group.future

    def _tile_units(self, box: Box, out: np.ndarray) -> list:
        """(chunk index, inner chunk, its tile in ``out``) for every tile of ``box``, in C
        order of the global inner chunk grid; ValueError for a box or output that does not
        fit :meth:`read_tiles`."""
        c = self.codec
        counts = tile_grid(box, c.inner, c.shape) if c.sharded else None
        if counts is None or out.shape != (math.prod(counts), *c.inner) or out.dtype != c.dtype \
                or not out.flags.c_contiguous:
            raise ValueError(f"{self.key}: read_tiles({box}) needs a box on tile boundaries and an output of "
                             f"{math.prod(counts or ())} tiles of {c.inner}, {c.dtype}, contiguous; "
                             f"got {out.shape}, {out.dtype}")
        if not out.size:
            return []
        lo = [a // n for (a, _), n in zip(box, c.inner)]
        units = []
        for k, g in enumerate(np.ndindex(*counts)):
            g = [x + l for x, l in zip(g, lo)]
            units.append((tuple(x * n // cs for x, n, cs in zip(g, c.inner, c.chunk)),
                          tuple(x * n % cs // n for x, n, cs in zip(g, c.inner, c.chunk)), out[k]))
        return units

    def _read_tiles(self, units: list) -> None:
        """Read ``units`` ((chunk index, inner chunk, its tile in the output)) whole."""
        fd, at = -1, None
        run = _Run(self, None, ())
        try:
            for index, j, tile in units:
                if index != at:
                    run.flush(fd)
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    (fd, size), at = self._open_chunk(index), index
                    table, end = self._table(fd, index, size)
                off = self._offset(table, index, j, end)
                run.add(fd, off, index, j, None, tile)
            run.flush(fd)
        finally:
            if fd >= 0:
                os.close(fd)

    def _bool_check(self, box: Box, out: np.ndarray) -> Callable[[], None] | None:
        """For a ``bool`` array: a check, run once the read is done, that every byte read is
        0 or 1 (spec §5.2: another byte is damage, even when its CRC-32C holds; tiles are
        whole inner chunks, their padding holds the fill value, false). None for other types."""
        if self.codec.dtype != np.bool_:
            return None

        def check() -> None:
            bad = np.asarray(out).view(np.uint8) > 1
            if bad.any():
                at = tuple(int(x) for x in np.argwhere(bad)[0])
                raise CorruptChunkError(
                    f"array {self.key!r}: a bool element read from box {list(box)} (at {list(at)} of the read) is "
                    f"stored as the byte {int(np.asarray(out).view(np.uint8)[at])}, not 0 or 1 (spec §5.2)")
        return check

    def _whole_chunks(self, piece: list) -> set:
        """Chunks of which ``piece`` wants every stored inner chunk: read in one call each
        (a chunk split between two pieces is read by inner chunks, never twice whole)."""
        per: dict = {}
        for index, _ in piece:
            per[index] = per.get(index, 0) + 1
        return {index for index, n in per.items() if n == self.codec.present_count(index)}

    def _read(self, box: Box | None) -> cf.Future:
        """A new array holding ``box`` (default: everything); a future of it."""
        box = box or tuple((0, n) for n in self.shape)
        out = np.empty([b - a for a, b in box], self.codec.dtype)
        result: cf.Future = cf.Future()

        def done(f: cf.Future) -> None:
            if f.exception() is not None:
                result.set_exception(f.exception())
            else:
                result.set_result(out)
        self.read_into(box, out).add_done_callback(done)
        return result

    def _open_chunk(self, index: tuple[int, ...]) -> tuple[int, int]:
        """(a chunk file opened for reading, its size), after checking that it is a regular
        file (spec §3.2: a FIFO or a device would block or never end a read). Opened without
        blocking (a FIFO's open would wait for a writer) and checked by ``fstat`` on the
        descriptor: one path lookup and one metadata call per file, in the reader thread, so
        a load makes no metadata call for chunks it does not read."""
        path = self._path(index)
        try:
            fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptChunkError(f"{self._where(index)} is missing from storage") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{self._where(index)} ({path}) is {file_type(st.st_mode)}, not a regular file; "
                                  "a chunk must be a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def _check_position(self, index: tuple[int, ...], j: tuple[int, ...], stored: int) -> None:
        """Spec §6.6: the (verified) CRC-32C of inner chunk ``j`` of chunk ``index`` is the
        one the root records for that position."""
        want = int(self.positions[self.codec.unit_linear(index, j)])
        if stored != want:
            raise misplaced(self._where(index, j), stored, want)

    def _table(self, fd: int, index: tuple[int, ...], size: int) -> tuple[list, int]:
        """(the shard index as :meth:`_parse_index`'s list, where the inner chunks end), checked; kept
        for later reads of the chunk (a file that shrinks later fails those as truncated)."""
        c = self.codec
        known = self._index.get(index)
        if known is not None:
            return known
        n = c.index_nbytes
        if size < n:
            raise CorruptChunkError(f"{self._where(index)} is truncated: {size} bytes, the index alone is {n}")
        raw = os.pread(fd, n, size - n)
        _count("bytes_read", len(raw))
        if len(raw) != n:
            raise CorruptChunkError(f"{self._where(index)}: short read of its index")
        known = self._index[index] = (self._parse_index(raw, index, size - n), size - n)
        return known

    def _parse_index(self, raw: Any, index: tuple[int, ...], end: int) -> list:
        """The shard index (its bytes and CRC-32C) as a list of ``[offset, nbytes]`` per inner
        chunk in C order, checked: its CRC, and every present entry inside the shard
        (:func:`check_index`; a short loop where the shard holds few inner chunks)."""
        if crc32c.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise CorruptChunkError(f"{self._where(index)}: its shard index fails its crc32c checksum")
        table = np.frombuffer(raw[:-4], dtype="<u8").reshape(self.codec.count, 2)
        entries = table.tolist()
        if self.codec.count > 64 or any((off > end or n > end - off) and not (off == _ABSENT and n == _ABSENT)
                                        for off, n in entries):
            check_index(table, self.codec, end, lambda j: self._where(index, j))  # raises where one is outside
        return entries

    def _offset(self, entries: list, index: tuple[int, ...], j: tuple[int, ...], end: int) -> int:
        """:func:`inner_offset` from the list :meth:`_parse_index` returns."""
        k = 0
        for x, g in zip(j, self.codec.grid):
            k = k * g + x
        off, nbytes = entries[k]
        if nbytes == self.codec.inner_nbytes + 4 and off + nbytes <= end:
            return off
        return inner_offset(np.array(entries, dtype=np.uint64), self.codec, j, end, lambda: self._where(index, j))

    def _whole(self, fd: int, index: tuple[int, ...], size: int) -> tuple[memoryview, list, int]:
        """(the whole chunk file, its checked index, where the inner chunks end), one read."""
        c = self.codec
        n = c.index_nbytes
        if size < n:
            raise CorruptChunkError(f"{self._where(index)} is truncated: {size} bytes, the index alone is {n}")
        data = memoryview(_scratch(size, "whole"))
        _preadv_all(fd, [data], 0, self._where(index))
        _count("bytes_read", size)
        return data, self._parse_index(data[size - n:], index, size - n), size - n

    def _read_units(self, box: Box, origin: tuple[int, ...], out: np.ndarray, units: list,
                    whole: set = frozenset()) -> None:
        """Read ``units`` ((chunk index, inner chunk) pairs, in order) of ``box`` into ``out``.

        Whole inner chunks that follow each other in a file are read by one ``preadv`` (a
        :class:`_Run`): straight into the target where each lies contiguous there, else
        into a per-thread buffer and moved into the target by one copy per row of inner
        chunks. With dozens of reader threads every call that releases the GIL waits to
        take it back, and on a 32-core GPU host those waits, one per inner chunk and step,
        cost more than the reads themselves."""
        c = self.codec
        enc = c.inner_nbytes + 4
        fd, at, data = -1, None, None
        run = _Run(self, out, origin)
        try:
            for index, j in units:
                if index != at:
                    run.flush(fd)
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    fd, size = self._open_chunk(index)
                    at = index
                    data = None
                    if index in whole:
                        data, table, end = self._whole(fd, index, size)
                    elif c.sharded:
                        table, end = self._table(fd, index, size)
                    else:
                        end = size - 4
                        if end != c.inner_nbytes:
                            raise CorruptChunkError(f"{self._where(index)}: {end + 4} bytes, expected "
                                                    f"{c.inner_nbytes + 4}")
                off = self._offset(table, index, j, end) if c.sharded else 0
                ibox = c.inner_box(index, j)
                if data is None and all(a <= ia and ib <= b and ib - ia == n
                                        for (a, b), (ia, ib), n in zip(box, ibox, c.inner)):
                    run.add(fd, off, index, j, ibox)  # a whole inner chunk inside the box
                    continue
                run.flush(fd)
                part = tuple((max(a, ia), min(b, ib)) for (a, b), (ia, ib) in zip(box, ibox))
                dst = _sub(out, part, origin)
                if data is not None:  # the file is in memory already
                    body, crc = data[off:off + c.inner_nbytes], data[off + c.inner_nbytes:off + enc]
                else:
                    body, crc = memoryview(_scratch(c.inner_nbytes)), bytearray(4)
                    _preadv_all(fd, [body, crc], off, self._where(index, j))
                    _count("bytes_read", enc)
                _check(body, crc, lambda: self._where(index, j))
                if self.positions is not None:
                    self._check_position(index, j, int.from_bytes(crc, "little"))
                tile = np.frombuffer(body, np.uint8).view(c.dtype).reshape(c.inner)
                np.copyto(dst, _sub(tile, part, tuple(a for a, _ in ibox)), casting="no")
            run.flush(fd)
        finally:
            if fd >= 0:
                os.close(fd)


class _Run:
    """Whole inner chunks that follow each other in one chunk file, read by one ``preadv``
    (their CRC-32Cs into one small buffer) and then checked: by one CRC over the buffer
    against the combination of theirs (:func:`combined_crc`), each on its own where that
    differs (to name the damaged one) or where they went straight into the target.

    Where every inner chunk's place in the target is contiguous, the call reads straight
    into the target. Otherwise (a 2-D inner chunk inside a wider target, the usual case)
    it reads into this thread's buffer of at most ``SCRATCH`` bytes, and each row of inner
    chunks (consecutive along the last dimension) is moved by one ``np.copyto``."""

    MAX = 256  # inner chunks per call (two buffers each; IOV_MAX is 1024 on Linux)
    SCRATCH = 16 << 20

    def __init__(self, array: LocalArray, out: np.ndarray, origin: tuple[int, ...]) -> None:
        self.array, self.out, self.origin = array, out, origin
        self.codec = array.codec
        self.enc = self.codec.inner_nbytes + 4
        self.start = self.next = -1
        self.direct = False
        self.items: list = []  # (chunk index, inner chunk, its global box, its target view)

    def add(self, fd: int, off: int, index: tuple[int, ...], j: tuple[int, ...], ibox: Box | None,
            dst: np.ndarray | None = None) -> None:
        """Inner chunk ``j`` of chunk ``index``, at ``off`` in its file: into the target's
        part ``ibox``, or into ``dst`` (a whole tile, contiguous)."""
        if dst is None:
            dst = _sub(self.out, ibox, self.origin)
        direct = dst.flags.c_contiguous
        if self.items and (off != self.next or direct != self.direct or len(self.items) >= self.MAX
                           or (not direct and (len(self.items) + 1) * self.codec.inner_nbytes > self.SCRATCH)):
            self.flush(fd)
        if not self.items:
            self.start, self.direct = off, direct
        self.items.append((index, j, ibox, dst))
        self.next = off + self.enc

    def flush(self, fd: int) -> None:
        items = self.items
        if not items:
            return
        self.items = []
        n, size = len(items), self.codec.inner_nbytes
        crcs = memoryview(bytearray(4 * n))
        if self.direct:
            bodies = [_bytes_of(dst) for *_, dst in items]
            self._read_and_check(fd, items, bodies, crcs, _adjacent([dst for *_, dst in items], size))
            return
        held = _RUN_BUFFERS.take(n * size)
        try:
            buf = memoryview(held)[:n * size]
            self._read_and_check(fd, items, [buf[k * size:(k + 1) * size] for k in range(n)], crcs, buf)
            self._scatter(items, buf)
        finally:
            _RUN_BUFFERS.give(held)

    def _read_and_check(self, fd: int, items: list, bodies: list, crcs: memoryview, buf: memoryview | None) -> None:
        n, size = len(items), self.codec.inner_nbytes
        bufs = []
        for k, body in enumerate(bodies):
            bufs += [body, crcs[4 * k:4 * k + 4]]
        _preadv_all(fd, bufs, self.start, self.array._where(*items[0][:2]))
        _count("bytes_read", n * self.enc)
        stored = [int.from_bytes(crcs[4 * k:4 * k + 4], "little") for k in range(n)]
        if buf is None or n == 1 or crc32c.crc32c(buf) != combined_crc(stored, size):
            for k, (body, (index, j, _, _)) in enumerate(zip(bodies, items)):  # names the damaged one
                _check(body, crcs[4 * k:4 * k + 4], lambda: self.array._where(index, j))
        if self.array.positions is not None:  # each intact one is the one of its place
            for got, (index, j, _, _) in zip(stored, items):
                self.array._check_position(index, j, got)

    def _scatter(self, items: list, buf: memoryview) -> None:
        """Move the inner chunks from ``buf`` into the target, one copy per row of them."""
        c, n = self.codec, len(items)
        tiles = np.frombuffer(buf, np.uint8).view(c.dtype).reshape((n, *c.inner))
        s = 0
        while s < n:  # a row: inner chunks consecutive along the last dimension
            e = s + 1
            while e < n and items[e][1][:-1] == items[s][1][:-1] and items[e][1][-1] == items[e - 1][1][-1] + 1:
                e += 1
            first, last = items[s][2], items[e - 1][2]
            dst = _sub(self.out, first[:-1] + ((first[-1][0], last[-1][1]),), self.origin)
            k, w = e - s, c.inner[-1]
            dst = dtypes.as_strided(dst, (*c.inner[:-1], k, w),
                                    (*dst.strides[:-1], w * dst.strides[-1], dst.strides[-1]))
            np.copyto(dst, np.moveaxis(tiles[s:e], 0, -2), casting="no")
            s = e


def _adjacent(dsts: list[np.ndarray], size: int) -> memoryview | None:
    """The bytes of ``dsts`` (contiguous, ``size`` bytes each) as one buffer where each
    follows the one before in memory (tiles; 1-D targets), else None. Every byte of that
    buffer belongs to one of them."""
    if len(dsts) < 2 or not size:
        return None
    first = dsts[0].ctypes.data
    if any(d.ctypes.data != first + k * size for k, d in enumerate(dsts)):
        return None
    start = dsts[0].reshape(-1).view(np.uint8)
    return memoryview(np.lib.stride_tricks.as_strided(start, (len(dsts) * size,), (1,)))


class _Buffers:
    """Host buffers for runs read through a buffer, lent to one reader thread at a time and
    kept for the next run up to ``keep`` bytes in all (more reader threads at once
    allocate and drop theirs). :func:`release_buffers` frees them."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.nbytes >= nbytes:
                    return self._free.pop(i)
        return np.empty(max(nbytes, _Run.SCRATCH), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if sum(b.nbytes for b in self._free) + buf.nbytes <= self.keep:
                self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_RUN_BUFFERS = _Buffers(256 << 20)


class ReadBatch:
    """Small reads of many arrays as one pool task: a load of thousands of small tensors
    otherwise makes a task, a future and a hand-off between the calling thread and a reader
    thread per tensor, and on a many-core host each hand-off waits for the GIL. ``add`` a
    read (:meth:`LocalArray.read_now`); when ``full``, ``submit`` it: one future, failing
    with the first error, which names its array (``zarrckpt_key``)."""

    MAX_BYTES = 8 << 20  # bytes per task
    MAX_ITEMS = 64  # reads per task
    SMALL = 4 << 20  # a read bigger than this goes on its own (split among threads)

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.items: list = []
        self.nbytes = 0
        self.max_bytes = max_bytes  # a load's smaller in-flight bound lowers it (progress, memory)

    def add(self, array: LocalArray, key: str, box: Box, out: np.ndarray, tiles: bool, nbytes: int) -> None:
        self.items.append((array, key, box, out, tiles))
        self.nbytes += nbytes

    @property
    def full(self) -> bool:
        return self.nbytes >= self.max_bytes or len(self.items) >= self.MAX_ITEMS

    def submit(self) -> tuple[str, cf.Future, int] | None:
        """(the first read's key, the future of them all, their bytes), or None when empty."""
        items, nbytes = self.items, self.nbytes
        if not items:
            return None
        self.items, self.nbytes = [], 0
        group = _Group(1)
        items[0][0]._pool.submit(group.run, lambda: _run_reads(items))
        return items[0][1], group.future, nbytes


def _run_reads(items: list) -> None:
    for array, key, box, out, tiles in items:
        try:
            array.read_now(box, out, tiles)
        except BaseException as e:  # noqa: BLE001 - named, then handed to the future
            if getattr(e, "zarrckpt_key", None) is None:
                try:
                    e.zarrckpt_key = key
                except AttributeError:  # pragma: no cover - an exception without a __dict__
                    pass
            raise


def release_buffers() -> None:
    """Free the read buffers kept between loads (``zarrckpt.release_staging`` calls this)."""
    _RUN_BUFFERS.clear()


def _check(body: Any, crc: Any, where: Callable[[], str]) -> None:
    """CorruptChunkError unless ``crc`` (4 bytes, little-endian) is ``body``'s CRC-32C."""
    if crc32c.crc32c(body) != int.from_bytes(crc, "little"):
        raise CorruptChunkError(f"{where()} fails its crc32c checksum")


# ---- CRC-32C of a concatenation from its parts' CRCs (zlib's crc32_combine, for the
# Castagnoli polynomial): a run of inner chunks is checked by one CRC over all their bytes
# (one call, one release of the GIL) against the combination of their stored CRCs. Where
# they differ, each inner chunk is checked on its own to name the damaged one. A damaged
# inner chunk always changes the combined CRC (the shift by the later bytes is invertible),
# so this finds exactly what checking each one finds, except damage to several inner
# chunks that cancels out, as likely as one CRC-32C missing damage (2**-32).

_POLY = 0x82F63B78  # CRC-32C, reflected


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix (32 columns) that moves a CRC register past ``nbytes`` zero bytes."""
    step = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    for _ in range(3):  # 8 zero bits: one zero byte
        step = [_times(step, c) for c in step]
    op = [1 << n for n in range(32)]  # identity
    while nbytes:
        if nbytes & 1:
            op = [_times(step, c) for c in op]
        nbytes >>= 1
        if nbytes:
            step = [_times(step, c) for c in step]
    return tuple(op)


def combined_crc(crcs: list[int], nbytes: int) -> int:
    """The CRC-32C of the concatenation of parts of ``nbytes`` each, from their CRCs."""
    op = _shift_operator(nbytes)
    out = crcs[0]
    for c in crcs[1:]:
        out = _times(op, out) ^ c
    return out


def check_index(table: np.ndarray, codec: ChunkCodec, end: int, where: Callable[[tuple[int, ...]], str]) -> None:
    """Spec §5.5: every present entry of a shard index (``table``, (count, 2) uint64) lies
    wholly inside the shard, before its index (``offset + nbytes <= end``) -- the entries of
    inner chunks wholly in padding too, which no read decodes. CorruptChunkError naming the
    first entry that does not (``where(j)``: the array, chunk and inner chunk)."""
    off, nbytes = table[:, 0], table[:, 1]
    limit = np.uint64(end)
    bad = ~((off == _ABSENT) & (nbytes == _ABSENT)) & ((off > limit) | (nbytes > limit - np.minimum(off, limit)))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        j = tuple(int(x) for x in np.unravel_index(k, codec.grid))
        raise CorruptChunkError(f"{where(j)}: index entry ({int(off[k])}, {int(nbytes[k])}) does not fit in "
                                f"the shard: it reaches outside the {end} bytes of its inner chunks")


def inner_offset(table: np.ndarray, codec: ChunkCodec, j: tuple[int, ...], end: int,
                 where: str | Callable[[], str]) -> int:
    """Where inner chunk ``j`` starts in a shard whose inner chunks end at ``end``, from its
    checked index ``table``; CorruptChunkError (naming ``where``, or what it returns) for an
    absent inner chunk or an entry that is not one uncompressed inner chunk inside the shard
    (spec §5.5)."""
    off, nbytes = (int(x) for x in table[int(np.ravel_multi_index(j, codec.grid))])
    enc = codec.inner_nbytes + 4
    if nbytes == enc and off + nbytes <= end:
        return off
    where = where() if callable(where) else where
    if off == _ABSENT and nbytes == _ABSENT:
        raise CorruptChunkError(f"{where} is absent from its shard")
    raise CorruptChunkError(f"{where}: index entry ({off}, {nbytes}) does not fit an uncompressed inner "
                            f"chunk of {enc} bytes in the file")


def _vectored(op: Callable, fd: int, bufs: list, offset: int, short: Exception) -> None:
    """``os.pwritev``/``os.preadv`` until every buffer is done (they may stop short); raise
    ``short`` when no byte moves (a read past the end of the file)."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = op(fd, views, offset)
        if n == 0:
            raise short
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _pwritev_all(fd: int, bufs: list, offset: int) -> None:
    _vectored(os.pwritev, fd, bufs, offset, OSError(errno.EIO, "pwritev wrote nothing"))


def _preadv_all(fd: int, bufs: list, offset: int, where: str) -> None:
    _vectored(os.preadv, fd, bufs, offset, CorruptChunkError(f"{where} is truncated"))
