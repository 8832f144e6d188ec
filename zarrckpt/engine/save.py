"""The save engine: spec §7 (claim, documents, chunks, flush, commit) run once, for every
writer. torch-free and JAX-free: a framework reaches it through a :class:`Group`.

Who calls what, in order (every rank unless marked; C = an agreement of the group)::

    new_identity(group)   rank 0's save id and time on every rank (one broadcast;
                          SaveRun folds it into its planning all-reduce, C0)
    begin(...)            rank 0 only: check and claim the location, create this save's
                          directory with its pending root and group documents
                          (``_commit.begin``); then C1 on every rank. A failure anywhere
                          (a rank's own preparation included) abandons the save
    write_arrays(...)     the array documents this rank writes, then its chunks (whole
                          plain chunks by the small-chunk path, others through TensorStore),
                          at most ``max_inflight_bytes`` in flight; waits for every write
                          it issued, even after an error; then one syncfs
    finish(...)           C2 (all data durable everywhere); rank 0 only: the committed
                          root, moved into place (``_commit.publish``); C3
    abandon(...)          after a failure every rank has seen: rank 0 only removes this
                          save's directory and claim (``_commit.abandon``)

What each rank writes is planned by the adapters, which hand the engine frozen records
(:class:`ArrayWrite`, :class:`ChunkWrite`): ``_save.SaveRun`` (torch process groups:
DTensors, packing, boundary exchange, staging), ``_writer.Writer`` (one process; arrays
declared and written chunk by chunk, through :class:`ChunkWriter` directly) and
``interop.jax.save`` (JAX processes).

Taken from PyTorch DCP (``torch/distributed/checkpoint``; research memo A1): frozen
records between planning and storage (``WriteItem``/``SavePlan``); a published call
order per rank with the coordinator-only steps marked (the ``StorageWriter``
docstring); agree-or-raise, where every rank raises the same class naming each failed
rank (``_DistWrapper``/``CheckpointException``), but an ``Exception`` subclass, with
``KeyboardInterrupt``/``SystemExit`` re-raised as themselves on their own rank; and a
one-process group for free (DCP's ``use_dist=False``; here :class:`OneProcess`). Not
taken: DCP gathers whole plans and pickled exceptions on the coordinator; here an
agreement moves a status per rank (messages only on failure), and each rank writes
its own documents to storage.

Taken from Orbax (``orbax/checkpoint/_src``; memo A2): the group is a small protocol of
agreements and a broadcast from the primary (``multihost.BarrierSyncFn``,
``broadcast_one_to_all``, the ``SignalingClient`` protocol), not a framework's process
group; and its save sequence (barrier, primary creates the temporary directory, every
host writes, barrier, primary finalizes with a commit file or a rename, barrier),
which is begin/C1, write_arrays, C2, publish, C3 here (``_commit`` does the rename).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import crc32c
import numpy as np

from . import commit as _commit
from ..format import dtypes
from ..format import documents as fmt
from ..storage.inflight import InFlight
from ..errors import SaveFailedError, ZarrckptError
from ..format.layout import slices
from ..storage import Storage, plain_body, translate_error
from ..storage import content as _content

__all__ = [
    "ArrayWrite",
    "ChunkWrite",
    "ChunkWriter",
    "Content",
    "Group",
    "OneProcess",
    "SMALL_CHUNK_BYTES",
    "abandon",
    "begin",
    "fast_chunk_shape",
    "finish",
    "merge_crcs",
    "new_identity",
    "pack_crcs",
    "unpack_crcs",
    "write_arrays",
]

SMALL_CHUNK_BYTES = 1 << 20  # whole plain chunks up to this size skip TensorStore (spec C.5 step 3)

Box = tuple[tuple[int, int], ...]


class Group(Protocol):
    """The processes of one save, as the engine needs them."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def agree(self, error: BaseException | None, what: str, error_class: type[ZarrckptError]) -> None:
        """Every rank passes its own ``error`` (None: it succeeded at ``what``). Returns on
        every rank if none failed; otherwise every rank raises an error of one class naming
        the failing ranks: a rank's own zarrckpt error, or ``error_class`` for others. A
        rank that was interrupted (an error that is not an ``Exception``, such as
        ``KeyboardInterrupt``) re-raises it as itself."""
        ...

    def broadcast(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` (ints in 0 .. 2**31-1) on every rank."""
        ...


class OneProcess:
    """The group of a save made by one process: every agreement is its own outcome."""

    rank = 0
    size = 1

    def agree(self, error: BaseException | None, what: str, error_class: type[ZarrckptError]) -> None:
        if error is not None:
            raise error

    def broadcast(self, values: list[int]) -> list[int]:
        return list(values)


def new_identity(group: Group) -> tuple[str, str]:
    """(save id, creation time) of a new save, rank 0's on every rank (one broadcast)."""
    save_id = fmt.new_save_id()  # 30 hex digits: five values of 24 bits
    us = int(time.time() * 1e6)
    values = group.broadcast([int(save_id[i:i + 6], 16) for i in range(0, 30, 6)]
                             + [us >> 26, us & ((1 << 26) - 1)])
    return "".join(f"{v:06x}" for v in values[:5]), fmt.utc_from_us((values[5] << 26) | values[6])


# ---- records -------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ChunkWrite:
    """One chunk a rank writes: its index in the chunk grid, its box in the array, and its
    data: ``data`` (the chunk itself), or else the region ``local`` of the host data of the
    :class:`ArrayWrite` it belongs to."""

    index: tuple[int, ...]
    box: Box
    local: Box | None = None
    data: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class ArrayWrite:
    """Chunks of one array that a rank writes from one source (an array may have several
    records, one per local shard). ``document`` is the array's ``zarr.json`` (its chunk
    shape and codecs decide how each chunk is written). ``host(writer)`` returns the host
    data the chunks' ``local`` regions index; the engine calls it once, just before the
    record's first chunk, and drops it after the last (a staging buffer may be reused
    after ``writer.wait()``)."""

    key: str
    document: dict[str, Any]
    chunks: tuple[ChunkWrite, ...]
    host: Callable[[ChunkWriter], np.ndarray] | None = None


def fast_chunk_shape(document: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The chunk shape of an array whose whole chunks skip TensorStore (spec C.5 step 3:
    codecs :data:`~zarrckpt.format.documents.PLAIN_CODECS`, a chunk of at most
    :data:`SMALL_CHUNK_BYTES`); None if its chunks go through TensorStore."""
    if document["codecs"] != fmt.PLAIN_CODECS:
        return None
    shape = tuple(document["chunk_grid"]["configuration"]["chunk_shape"])
    itemsize = dtypes.by_zarr(document["data_type"]).numpy.itemsize
    return shape if math.prod(shape) * itemsize <= SMALL_CHUNK_BYTES else None


# ---- writing -------------------------------------------------------------------------


class ChunkWriter:
    """The documents and chunks one rank writes into one store: each chunk by the
    small-chunk path when :func:`fast_chunk_shape` allows, else through TensorStore; at
    most ``max_inflight_bytes`` in flight (on object stores the first failure stops the
    rest). Leaving a ``with`` block by an exception waits for every write issued."""

    # small objects (documents, plain chunks) go to local files in batches of these bounds:
    # 16 files keep the 4 writer threads busy from 64 objects on (latency-bound file systems)
    # and cost what 64 do (BENCHMARKS.md)
    BATCH_FILES = 16
    BATCH_BYTES = 4 << 20

    def __init__(self, store: Storage, max_inflight_bytes: int,
                 crcs: dict[str, dict[tuple[int, ...], np.ndarray]] | None = None,
                 content: Content | None = None) -> None:
        self.store = store
        # incremental saves (storage/content.py, readers/previous.py): the content hashes this rank computes, and
        # the previous checkpoint whose unchanged chunk files it links
        self.content = content
        self.bytes_written = 0
        # spec §6.6 (format 1.3): key -> chunk index -> the CRC-32C of each of the chunk's
        # units, filled in by the writes (computed where each write computes its CRCs)
        self.crcs = crcs
        self._batch: list | None = [] if getattr(store, "puts_files", False) else None
        self._batch_bytes = 0
        self._pending = InFlight(max_inflight_bytes, op="write", abort=store.is_object_store)
        self._fast: dict[str, tuple[int, ...] | None] = {}
        self._opening: dict[str, Any] = {}  # key -> future of an array being opened
        self._arrays: dict[str, Any] = {}  # key -> array open for writing

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.stop()

    def document(self, key: str, doc: Mapping[str, Any]) -> None:
        """Write ``<key>/zarr.json`` as its exact bytes (spec §3.1)."""
        data = fmt.encode_document(doc)
        if self._batch is not None:
            self._later(f"{key}/zarr.json", key, data, False)
        else:
            self._pending.add(key, self.store.put(f"{key}/zarr.json", data), 0)

    def _later(self, path: str, key: str, body: Any, crc: Any, link: tuple | None = None) -> None:
        """Queue one small object for the next batch of local file writes (its bytes must
        not change until written), sending the batch when it is full. ``link``: see
        ``_put_files`` (incremental saves)."""
        self._batch.append((path, key, body, crc) if link is None else (path, key, body, crc, link))
        self._batch_bytes += len(body)
        if len(self._batch) >= self.BATCH_FILES or self._batch_bytes >= self.BATCH_BYTES:
            self._send()

    def _send(self) -> None:
        if self._batch:
            batch, nbytes = self._batch, self._batch_bytes
            self._batch, self._batch_bytes = [], 0
            self._pending.add(batch[0][1], self.store.put_files(batch), nbytes)

    def is_fast(self, key: str, document: Mapping[str, Any], shape: tuple[int, ...]) -> bool:
        """Does a chunk of this shape of array ``key`` take the small-chunk path?"""
        if key not in self._fast:
            self._fast[key] = fast_chunk_shape(document)
        return shape == self._fast[key]

    def open_soon(self, key: str, document: Mapping[str, Any]) -> None:
        """Start opening array ``key`` for TensorStore writes (no I/O: its metadata is
        ``document``), so that many arrays open at once."""
        if key not in self._opening and key not in self._arrays:
            self._opening[key] = self.store.open_for_write(key, document)

    def chunk(self, key: str, document: Mapping[str, Any], index: tuple[int, ...], box: Box,
              data: np.ndarray) -> None:
        """Write one chunk (``data`` of the box's shape and the array's dtype; it must not
        change until the write completes)."""
        slot = None
        if self.crcs is not None:
            units = fmt.unit_shape(document)
            present = tuple(min(c // n, -(-(b - a) // n)) for (a, b), c, n in
                            zip(box, document["chunk_grid"]["configuration"]["chunk_shape"], units))
            slot = self.crcs.setdefault(key, {})[index] = np.zeros(present, np.uint32)
        if self.is_fast(key, document, data.shape):
            link = None
            if self.content is not None:  # spec §6.6.2; linked where §7.9 allows (checked in the writer)
                rec = self.content.of(key, document)
                digest = rec.hashes[index] = _content.chunk_hash([plain_body(data)])
                if rec.previous is not None and slot is not None:
                    link = rec.previous.plain_link(index, digest)
                    if link is not None:
                        link = (*link, self.content.linked)
            if self._batch is not None:
                self._later(f"{key}/{fmt.chunk_key(index)}", key, plain_body(data), True if slot is None else slot,
                            link)
                self.bytes_written += data.nbytes
                return
            crc = None
            if slot is not None:
                slot[...] = crc = crc32c.crc32c(plain_body(data))
            if link is not None and link[1] == crc and getattr(rec.previous, "bucket", None) is not None:
                # S3: the previous checkpoint's object, copied server-side (or written if that fails)
                future = self.store.copy_or_write_plain_chunk(key, index, data, crc, rec.previous.object_key(index),
                                                              rec.previous.bucket, self.content.linked,
                                                              rec.previous.tried)
            else:
                future = self.store.write_plain_chunk(key, index, data, crc)
        else:
            array = self._array(key, document)
            if self.content is not None and array.links_chunks:
                future = array.write(box, data, stable=True, crcs=slot, content=self.content.of(key, document))
            else:
                future = array.write(box, data, stable=True, crcs=slot)
        self.bytes_written += data.nbytes
        self._pending.add(key, future, data.nbytes)

    def _array(self, key: str, document: Mapping[str, Any]) -> Any:
        array = self._arrays.get(key)
        if array is None:
            future = self._opening.pop(key, None) or self.store.open_for_write(key, document)
            try:
                array = self._arrays[key] = future.result()
            except Exception as e:  # noqa: BLE001 - named by key like every write error
                raise translate_error(e, key, "write") from e
        return array

    def wait(self) -> None:
        """Wait for every write issued so far; raise the first error (after all completed)."""
        self._send()
        self._pending.wait()

    def finish(self) -> None:
        """Wait for every write, then make them durable (one syncfs). An incremental save
        that copied chunks on S3 then checks that the previous checkpoint is still the one
        it compared them with (``Previous.confirm``)."""
        try:
            self._send()
            self._pending.wait()
        finally:
            self.store.close()
        self.store.flush()
        if self.content is not None and self.content.previous is not None:
            self.content.previous.confirm()  # S3, after any copy tried: PREV unchanged

    def stop(self) -> None:
        """After an error: wait for the writes in flight, ignoring theirs (object stores:
        cancel what has not completed), and release the store's writer threads. A batch not
        yet sent is dropped."""
        if self._batch:
            self._batch, self._batch_bytes = [], 0
        try:
            self._pending.drain()
        finally:
            self.store.close()


class Content:
    """An incremental or hash-recording save's side of :class:`ChunkWriter`: the content
    hash of every chunk this rank writes (key -> chunk index -> 16 bytes, spec §6.6.2) and
    the previous checkpoint to link unchanged chunk files from (``previous.array(key,
    document)`` -> a ``storage.content.PreviousArray`` or None; ``previous`` None: record
    only; see ``readers/previous.py``)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.hashes: dict[str, dict[tuple[int, ...], bytes]] = {}
        self.linked: list[int] = []  # data bytes of each chunk linked (appended by the writers)
        self._arrays: dict[str, Any] = {}

    def of(self, key: str, document: Mapping[str, Any]) -> Any:
        rec = self._arrays.get(key)
        if rec is None:
            prev = self.previous.array(key, dict(document)) if self.previous is not None else None
            rec = self._arrays[key] = _ArrayContent(prev, self.hashes.setdefault(key, {}), self.linked)
        return rec


class _ArrayContent:
    __slots__ = ("previous", "hashes", "linked")

    def __init__(self, previous: Any, hashes: dict, linked: list[int]) -> None:
        self.previous = previous
        self.hashes = hashes
        self.linked = linked


def write_arrays(store: Storage, documents: Mapping[str, Mapping[str, Any]], arrays: Sequence[ArrayWrite],
                 max_inflight_bytes: int, crcs: dict | None = None,
                 progress: Callable[[int, int], None] | None = None, content: Content | None = None) -> int:
    """Every rank, between C1 and C2: write the array ``documents`` (key -> ``zarr.json``)
    this rank writes, then the chunks of ``arrays`` in order; wait for all, then one
    syncfs. Returns the bytes of chunk data written. A failure is raised after every
    write issued has completed (or was cancelled). ``crcs``: a dict that receives, per
    array key and chunk index, the CRC-32Cs of the chunk's units (spec §6.6), for
    :func:`finish`. ``progress``: called in this thread with (chunk bytes issued, this
    rank's chunk bytes) before the first chunk and after each (issued bytes run at most
    ``max_inflight_bytes`` ahead of completed ones), and once more when all are durable;
    None: no per-chunk work at all."""
    with ChunkWriter(store, max_inflight_bytes, crcs, content) as out:
        for key, doc in documents.items():
            out.document(key, doc)
        for a in arrays:  # open every array that needs TensorStore at once
            if not all(out.is_fast(a.key, a.document, _extent(c.box)) for c in a.chunks):
                out.open_soon(a.key, a.document)
        if progress is None:
            for a in arrays:
                _write_chunks(out, a)
        else:
            report = _Reported(progress, arrays)
            for a in arrays:
                _write_chunks(out, a, report)
        out.finish()
    if progress is not None:
        progress(report.done, report.total)
    return out.bytes_written


class _Reported:
    """write_arrays' ``progress``: the chunk bytes issued so far, of ``total``."""

    def __init__(self, progress: Callable[[int, int], None], arrays: Sequence[ArrayWrite]) -> None:
        self.progress = progress
        self.done = 0
        self.total = sum(math.prod(_extent(c.box)) * dtypes.by_zarr(a.document["data_type"]).numpy.itemsize
                         for a in arrays for c in a.chunks)
        progress(0, self.total)

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        self.progress(self.done, self.total)


def _write_chunks(out: ChunkWriter, a: ArrayWrite, report: _Reported | None = None) -> None:
    host = a.host(out) if a.host is not None and any(c.data is None for c in a.chunks) else None
    if report is None:
        for c in a.chunks:
            data = c.data if c.data is not None else host[slices(c.local)]
            out.chunk(a.key, a.document, c.index, c.box, data)
        return
    for c in a.chunks:
        data = c.data if c.data is not None else host[slices(c.local)]
        out.chunk(a.key, a.document, c.index, c.box, data)
        report(data.nbytes)


def _extent(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


# ---- claim and commit ------------------------------------------------------------------


def begin(group: Group, location: Storage, save_id: str, overwrite: bool, pending_root: dict | None,
          groups: list[str], *, error: BaseException | None = None) -> _commit.Target | None:
    """Rank 0: claim ``location`` and create this save's directory with ``pending_root``
    and the ``groups`` documents (``_commit.begin``), unless ``error`` (this rank's own
    preparation failed). Then C1 on every rank: on failure anywhere every rank raises and
    rank 0 abandons the save. Returns rank 0's target (None on other ranks)."""
    target = None
    if group.rank == 0 and error is None:
        try:
            target = _commit.begin(location, save_id, overwrite, pending_root, groups)
        except BaseException as e:  # noqa: BLE001 - reported to every rank at C1
            error = e
    try:
        group.agree(error, f"preparing the save to {location.url!r}", SaveFailedError)
    except BaseException:
        abandon(group, target)
        raise
    return target


def finish(group: Group, url: str, target: _commit.Target | None, error: BaseException | None,
           committed_root: Callable[..., dict], crcs: dict | None = None,
           hashes: dict | None = None) -> None:
    """C2 (``error``: this rank's write failure, None if its data is durable); rank 0
    commits ``committed_root()`` (``_commit.publish``); C3. The caller abandons the save
    if this raises.

    ``crcs`` (this rank's, from :func:`write_arrays`): after C2 they are gathered to rank 0
    (one gather of small lists: 4 bytes per unit written, ~40 per chunk, and the keys) and
    rank 0 commits ``committed_root(chunk_crcs=every rank's)``, a root of format 1.3 with the
    table of chunk positions (spec §6.6). A group that cannot gather (no ``gather_to_root``)
    commits ``committed_root()``, a 1.2 root.

    ``hashes`` (saves that record content hashes, spec §6.6.2): this rank's chunk content
    hashes, gathered with the CRCs (16 bytes per chunk written) and committed as
    ``committed_root(content_hashes=)``."""
    group.agree(error, f"writing the save to {url!r}", SaveFailedError)
    error = None
    gathered = _gather_crcs(group, crcs, hashes) if crcs is not None else None
    if group.rank == 0:
        try:
            if gathered is not None:
                extra = {}
                if hashes is not None:
                    extra["content_hashes"] = merge_crcs([h for _, h in gathered])
                    gathered = [c for c, _ in gathered]
                committed_root = functools.partial(committed_root, chunk_crcs=merge_crcs(gathered), **extra)
            _commit.publish(target, committed_root())
        except BaseException as e:  # noqa: BLE001 - reported to every rank at C3
            error = e
    group.agree(error, f"committing the save to {url!r}", SaveFailedError)


def _gather_crcs(group: Group, crcs: dict, hashes: dict | None = None) -> list | None:
    """Every rank's CRC-32Cs on rank 0 (a list per rank; None elsewhere, and None on every
    rank of a group that cannot gather). Each rank sends ``{key: [(chunk index, shape,
    uint32 bytes)]}``: the bytes per rank are 4 per unit it wrote plus ~40 per chunk and
    its array keys (a 70B model at 1,024 ranks: ~3 KB of CRCs per rank, 3.2 MB on rank 0)."""
    if group.size == 1:
        return [crcs if hashes is None else (crcs, hashes)]
    gather = getattr(group, "gather_to_root", None)
    if gather is None:
        return None
    views = gather(pack_crcs(crcs) if hashes is None else (pack_crcs(crcs), hashes))
    if views is None:
        return None
    if hashes is None:
        return [unpack_crcs(view) for view in views]
    return [(unpack_crcs(c), h) for c, h in views]


def pack_crcs(crcs: dict) -> dict:
    """One rank's chunk CRC-32Cs (``write_arrays(crcs=)``) as plain bytes, to send."""
    return {key: [(index, a.shape, a.astype("<u4").tobytes()) for index, a in chunks.items()]
            for key, chunks in crcs.items()}


def unpack_crcs(view: dict) -> dict:
    """:func:`pack_crcs` undone."""
    return {key: {index: np.frombuffer(raw, "<u4").reshape(shape) for index, shape, raw in chunks}
            for key, chunks in view.items()}


def merge_crcs(views: list[dict]) -> dict:
    """Every rank's chunk CRC-32Cs in one mapping, for ``committed_root(chunk_crcs=)``."""
    out: dict[str, dict] = {}
    for view in views:
        for key, chunks in view.items():
            out.setdefault(key, {}).update(chunks)
    return out


def abandon(group: Group, target: _commit.Target | None) -> None:
    """After a failure every rank has seen: rank 0 removes this save's directory."""
    if group.rank == 0:
        _commit.abandon(target)
