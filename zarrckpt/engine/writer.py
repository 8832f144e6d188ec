"""One process writes a checkpoint leaf by leaf: :class:`Writer` (spec §7, torch-free).

:func:`zarrckpt.save` needs the whole state dict at once. Converters and tools that
produce a checkpoint from a stream (another format read tensor by tensor) use this
instead: arrays are declared one at a time and written chunk by chunk, so host memory is
bounded by what the caller holds plus ``max_inflight_bytes``::

    with Writer("ckpt", metadata={"source": "x"}) as w:
        w.add(("model", "bias"), np.zeros(4, np.float32))          # a whole small array
        a = w.add_array(("model", "w"), shape=(4096, 4096), dtype=dtypes.by_zarr("bfloat16"),
                        chunk_shape=(256, 4096))
        for start in a.chunk_starts():                               # one write per chunk
            a.write(start, next_piece())
        w.add(("step",), 100)                                        # a JSON value
    # leaving the block commits; an exception abandons the save (the path is as before)

The steps follow spec §7 through the save engine (``engine.py``, as :func:`zarrckpt.save`
with one rank, over :class:`engine.OneProcess`): the location is claimed and a directory
of this save is made beside it (in place on object stores); every array ``zarr.json``,
chunk and intermediate group is written once, each chunk as it arrives
(:class:`engine.ChunkWriter`); one ``syncfs``; then the committed root, with the digests
of every array document (§6.6), is moved into place.

Writer choices (the spec's Appendix C is informative; these differ only where streaming
needs it): the chunk grid is the caller's (converters use pieces of a memory budget, so a
chunk is one piece); inner chunks (§5.5) as C.2; every leaf is its own array unless
``pack_bytes`` > 0 (deprecated), when leaves of at most that size are packed (§6.5) into
``.packs/0``, ``.packs/1`` ... of at most ``pack_limit`` bytes each, in the order they
are added.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format import dtypes as zdt
from . import save as engine
from ..format import documents as fmt
from ..format import tree as ztree
from ..errors import UnsupportedValueError, ZarrckptError
from ..storage import StorageOptions, open_storage

__all__ = ["ArrayWriter", "Writer"]

_PACKABLE = ("tensor", "ndarray", "bytes", "bytesio")
_PACK_ALIGN = 8
_ONE = engine.OneProcess()


_ARRAY = object()  # the value of an array leaf in Writer._insert (None is a value)


class _Ref:
    """Placeholder of an array leaf in the skeleton of the tree."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


@dataclass
class _Node:
    kind: str  # dict | list | tuple
    children: dict  # component -> _Node | _Ref | value
    segments: dict  # escaped segment -> component (collisions are refused at add time)


class ArrayWriter:
    """One array being written: every chunk exactly once, each as one whole write."""

    def __init__(self, writer: Writer, key: str, shape: tuple[int, ...], dtype: zdt.DType,
                 chunk_shape: tuple[int, ...], doc: dict | None, pack: tuple[bytearray, int] | None) -> None:
        self._w = writer
        self.key = key
        self.shape = shape
        self.dtype = dtype
        self.chunk_shape = chunk_shape
        self.grid = tuple(-(-s // c) for s, c in zip(shape, chunk_shape))
        self.num_chunks = math.prod(self.grid) if all(shape) else 0
        self._doc = doc
        self._pack = pack  # (pack buffer, offset) of a packed leaf
        self._written: set[tuple[int, ...]] = set()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.numpy.itemsize

    @property
    def complete(self) -> bool:
        return len(self._written) == self.num_chunks

    def chunk_starts(self) -> Iterator[tuple[int, ...]]:
        """The first element of every chunk, in C order (none for an empty array)."""
        if not self.num_chunks:
            return
        for index in np.ndindex(*self.grid):
            yield tuple(i * c for i, c in zip(index, self.chunk_shape))

    def chunk_box(self, start: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple((a, min(a + c, s)) for a, c, s in zip(start, self.chunk_shape, self.shape))

    def write(self, start: tuple[int, ...], data: np.ndarray) -> None:
        """Write the chunk that begins at ``start`` (``data`` of the chunk's shape, clipped
        at the array's edge, and of this array's dtype). ``data`` must not change until
        :meth:`Writer.commit` (or until the writer's in-flight bound retires it)."""
        start = tuple(int(a) for a in start)
        if len(start) != len(self.shape) or any(a % c or not 0 <= a < max(s, 1) for a, c, s in
                                                zip(start, self.chunk_shape, self.shape)):
            raise ValueError(f"array {self.key!r}: {start} is not the start of a chunk of shape "
                             f"{self.chunk_shape} in an array of shape {self.shape}")
        index = tuple(a // c for a, c in zip(start, self.chunk_shape))
        box = self.chunk_box(start)
        extent = tuple(b - a for a, b in box)
        data = np.asarray(data)
        if data.shape != extent:
            raise ValueError(f"array {self.key!r}: the chunk at {start} has shape {extent}, got data of "
                             f"shape {data.shape}")
        if data.dtype != self.dtype.numpy:
            raise ValueError(f"array {self.key!r}: data of dtype {data.dtype}, expected {self.dtype.numpy}")
        if index in self._written:
            raise ValueError(f"array {self.key!r}: the chunk at {start} was written already "
                             "(every chunk is written exactly once, spec §7.2)")
        if self._w._closed:
            raise ZarrckptError(f"array {self.key!r}: the writer is closed")
        self._written.add(index)
        if self._pack is not None:
            buf, offset = self._pack
            if data.size:
                buf[offset:offset + data.nbytes] = np.require(data, requirements="C").reshape(-1).view(np.uint8).data
            return
        self._w._write_chunk(self, index, box, data)


class Writer:
    """Write one checkpoint from one process, leaf by leaf (see the module docstring).

    ``overwrite``: replace a committed checkpoint at ``path`` (otherwise refused).
    ``metadata``: the caller's JSON object for the root (``Checkpoint.info.metadata``).
    ``compression``, ``inner_chunk_bytes``: as :func:`zarrckpt.save`.
    ``pack_bytes``: deprecated; 0 (default): every leaf is its own array. Leaves of kind
    tensor/ndarray/bytes/bytesio up to a size > 0 are packed (generic Zarr tools do not see
    packed leaves). ``pack_limit``: bytes of one
    pack array (a pack is held in memory until it is written).
    ``max_inflight_bytes``: bytes of chunk writes in flight (each is referenced, not copied).
    """

    def __init__(self, path: Any, *, overwrite: bool = False, metadata: dict | None = None,
                 compression: str | dict | None = None, inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES,
                 pack_bytes: int = 0, pack_limit: int = 16 << 20, max_inflight_bytes: int = 256 << 20,
                 storage: StorageOptions | None = None, writer: dict[str, str] | None = None) -> None:
        if metadata is not None:
            fmt.check_metadata(metadata)
        if pack_bytes < 0 or pack_limit < pack_bytes:
            raise ValueError(f"need 0 <= pack_bytes <= pack_limit, got {pack_bytes} and {pack_limit}")
        self._codec = fmt.compression_codec(compression)
        self.inner_chunk_bytes = inner_chunk_bytes
        self.pack_bytes = pack_bytes
        self.pack_limit = pack_limit
        self.metadata = metadata
        self.location = open_storage(path, storage)
        self.url = self.location.url
        self.save_id, self.created = engine.new_identity(_ONE)
        self._writer = fmt.writer_versions(writer)
        self._root = _Node("dict", {}, {})
        self._docs: dict[str, dict] = {}
        self._arrays: list[ArrayWriter] = []
        self._nodes: dict[str, dict] = {}  # key -> packed node
        self._groups: set[str] = set()
        self._pack: bytearray | None = None
        self._pack_members: list[ArrayWriter] = []
        self._num_packs = 0
        self._closed = False
        pending = fmt.root_metadata(state="pending", save_id=self.save_id, world_size=1,
                                    created=self.created, writer=self._writer)
        self._target = engine.begin(_ONE, self.location, self.save_id, overwrite, pending, [])
        self.store = self._target.store
        self._crcs: dict = {}  # spec §6.6: every chunk's CRC-32Cs, for the table of positions
        self._out = engine.ChunkWriter(self.store, max_inflight_bytes, self._crcs)

    @property
    def bytes_written(self) -> int:
        """Bytes of chunk data written so far."""
        return self._out.bytes_written

    # ---- leaves ------------------------------------------------------------------

    def add_array(self, path: tuple, shape: tuple[int, ...], dtype: zdt.DType, *, kind: str = "tensor",
                  chunk_shape: tuple[int, ...] | None = None, containers: tuple[str, ...] | None = None
                  ) -> ArrayWriter:
        """Declare an array leaf at key path ``path``; write its chunks through the returned
        :class:`ArrayWriter`. ``chunk_shape`` defaults to the whole array (a whole array of
        at most ``pack_bytes`` is packed). ``containers``:
        the kind (``"dict"``, ``"list"``, ``"tuple"``) of each container on the way, for
        containers this call creates (default ``"dict"``)."""
        if kind not in ("tensor", "ndarray", "bytes", "bytesio"):
            raise ValueError(f"array kind must be tensor, ndarray, bytes or bytesio, not {kind!r}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"bad shape {shape}")
        if kind in ("bytes", "bytesio") and (dtype.zarr != "uint8" or len(shape) != 1):
            raise ValueError(f"a {kind} leaf is a 1-d uint8 array")
        chunk = tuple(max(s, 1) for s in shape) if chunk_shape is None else tuple(int(c) for c in chunk_shape)
        if len(chunk) != len(shape) or any(not 1 <= c <= max(s, 1) for c, s in zip(chunk, shape)):
            raise ValueError(f"chunk shape {chunk} does not fit shape {shape} (1 <= c <= max(s, 1))")
        key = self._insert(path, _ARRAY, containers)
        fmt.check_shape(shape, dtype.numpy.itemsize, f"array {key!r}")
        nbytes = math.prod(shape) * dtype.numpy.itemsize
        whole = tuple(max(s, 1) for s in shape)
        if kind in _PACKABLE and self.pack_bytes and nbytes <= self.pack_bytes and chunk == whole:
            buf, offset = self._pack_slot(nbytes)
            self._nodes[key] = {"packed": {"pack": f"{fmt.PACKS}/{self._num_packs}", "offset": offset,
                                           "nbytes": nbytes, "kind": kind, "data_type": dtype.zarr,
                                           "shape": list(shape)}}
            a = ArrayWriter(self, key, shape, dtype, whole, None, (buf, offset))
            self._pack_members.append(a)
        else:
            doc = self._array_doc(key, shape, dtype, chunk, kind)
            a = ArrayWriter(self, key, shape, dtype, chunk, doc, None)
            self._put_doc(key, doc)
        self._arrays.append(a)
        return a

    def add(self, path: tuple, value: Any, *, kind: str | None = None,
            containers: tuple[str, ...] | None = None) -> None:
        """Add a whole leaf: a NumPy array (``kind`` ``"tensor"`` by default, or
        ``"ndarray"``), ``bytes`` (kind ``"bytes"``, or ``"bytesio"``), or a value the tree
        stores (JSON-able, non-finite floats; spec §6.2)."""
        if isinstance(value, (bytes, bytearray, memoryview)):
            data = np.frombuffer(bytes(value), np.uint8)
            self._add_whole(path, data, kind or "bytes", containers)
        elif isinstance(value, np.ndarray):
            self._add_whole(path, value, kind or "tensor", containers)
        else:
            self._insert(path, value, containers)

    def _add_whole(self, path: tuple, data: np.ndarray, kind: str, containers: tuple[str, ...] | None) -> None:
        dt = zdt.by_numpy(data.dtype)
        a = self.add_array(path, data.shape, dt, kind=kind, containers=containers)
        if a.num_chunks:
            a.write((0,) * data.ndim, np.require(data, requirements="C"))

    # ---- the tree skeleton -------------------------------------------------------------

    def _insert(self, path: tuple, value: Any, containers: tuple[str, ...] | None) -> str:
        """Put a leaf (an array when ``value`` is :data:`_ARRAY`; None is a value like any
        other) into the skeleton; returns its key."""
        path = tuple(path)
        if not path:
            raise ValueError("the key path of a leaf is not empty")
        if len(path) > ztree.MAX_DEPTH:
            raise UnsupportedValueError(f"key path {path!r:.200} has more than {ztree.MAX_DEPTH} components")
        key = ztree.key_of(path)  # validates every component (spec §4)
        if self._closed:
            raise ZarrckptError(f"{key!r}: the writer is closed")
        leaf: Any = _Ref(key) if value is _ARRAY else value
        if value is not _ARRAY:
            try:  # refuse what the tree cannot hold now, naming the key (spec §6.2)
                ztree.encode_tree({"v": value}, lambda x: False)
            except UnsupportedValueError as e:
                raise UnsupportedValueError(f"{key!r}: {e}") from None
        node = self._root
        for depth, comp in enumerate(path):
            seg = ztree.escape(comp)
            other = node.segments.get(seg)
            if other is not None and (other != comp or type(other) is not type(comp)):
                raise UnsupportedValueError(f"keys {other!r} and {comp!r} under "
                                            f"{ztree.key_of(path[:depth]) or '<root>'!r} map to the "
                                            f"same stored name {seg!r}")
            if node.kind != "dict" and (not isinstance(comp, int) or isinstance(comp, bool) or comp < 0):
                raise UnsupportedValueError(f"{key!r}: {ztree.key_of(path[:depth])!r} is a {node.kind}, "
                                            f"whose components are indexes >= 0, not {comp!r}")
            last = depth == len(path) - 1
            child = node.children.get(comp)
            if last:
                if child is not None:
                    raise ValueError(f"{key!r} was added already")
                node.children[comp] = leaf
            else:
                if child is None:
                    kind = containers[depth] if containers and depth < len(containers) else "dict"
                    if kind not in ("dict", "list", "tuple"):
                        raise ValueError(f"container kind {kind!r} (dict, list or tuple)")
                    child = node.children[comp] = _Node(kind, {}, {})
                elif not isinstance(child, _Node):
                    raise ValueError(f"{ztree.key_of(path[:depth + 1])!r} is a leaf; cannot add {key!r} "
                                     "under it")
            node.segments[seg] = comp
            node = child  # type: ignore[assignment]
        return key

    def _skeleton(self, node: _Node) -> Any:
        items = {k: self._skeleton(v) if isinstance(v, _Node) else v for k, v in node.children.items()}
        if node.kind == "dict":
            return items
        seq = [items.get(i) for i in range(max(items) + 1)] if items else []  # gaps: None (as DCP)
        return tuple(seq) if node.kind == "tuple" else seq

    def tree(self) -> dict:
        """The ``tree`` document of the leaves added so far (spec §6.2)."""
        skeleton = self._skeleton(self._root)
        tree = ztree.encode_tree(skeleton, lambda x: isinstance(x, _Ref))
        return fmt.with_packed_nodes(tree, self._nodes)

    # ---- documents and chunks ------------------------------------------------------------

    def _array_doc(self, key: str, shape: tuple[int, ...], dtype: zdt.DType, chunk: tuple[int, ...],
                   kind: str) -> dict:
        leaf_name = key.rsplit("/", 1)[-1]
        return fmt.array_metadata(
            shape=shape, dtype=dtype, chunk_shape=chunk,
            attrs=fmt.array_attrs(kind=kind, save_id=self.save_id, dtype=dtype),
            dimension_names=[f"{leaf_name}.{d}" for d in range(len(shape))],
            compression=self._codec, inner_chunk_bytes=self.inner_chunk_bytes)

    def _put_doc(self, path: str, doc: dict) -> None:
        for grp in fmt.group_paths([path]):
            if grp not in self._groups:
                self._groups.add(grp)
                self._out.document(grp, fmt.group_metadata())
        self._docs[path] = doc
        self._out.document(path, doc)

    def _write_chunk(self, a: ArrayWriter, index: tuple[int, ...], box: tuple[tuple[int, int], ...],
                     data: np.ndarray) -> None:
        self._out.chunk(a.key, self._docs[a.key], index, box, data)

    # ---- packs -------------------------------------------------------------------

    def _pack_slot(self, nbytes: int) -> tuple[bytearray, int]:
        size = -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN
        if self._pack is not None and len(self._pack) + size > self.pack_limit:
            self._flush_pack()
        if self._pack is None:
            self._pack = bytearray()
        offset = len(self._pack)
        self._pack.extend(bytes(size))
        return self._pack, offset

    def _flush_pack(self) -> None:
        if self._pack is None:
            return
        missing = [a.key for a in self._pack_members if not a.complete]
        if missing:
            raise ZarrckptError(f"packed leaves {missing[:5]} were declared but never written")
        path = f"{fmt.PACKS}/{self._num_packs}"
        data = np.frombuffer(bytes(self._pack), np.uint8)
        row = zdt.by_zarr("uint8")
        doc = fmt.array_metadata(shape=data.shape, dtype=row, chunk_shape=(max(data.shape[0], 1),),
                                 attrs=fmt.array_attrs(kind="pack", save_id=self.save_id, dtype=row),
                                 dimension_names=[f"{self._num_packs}.0"], compression=self._codec,
                                 inner_chunk_bytes=self.inner_chunk_bytes)
        self._put_doc(path, doc)
        pack = ArrayWriter(self, path, data.shape, row, (max(data.shape[0], 1),), doc, None)
        if pack.num_chunks:
            pack.write((0,), data)
        self._pack, self._pack_members = None, []
        self._num_packs += 1

    # ---- commit --------------------------------------------------------------------

    def commit(self) -> dict[str, Any]:
        """Write what is left, make everything durable, and commit (spec §7.2). Returns a
        small report. On failure the save is abandoned and the error raised."""
        if self._closed:
            raise ZarrckptError(f"the save to {self.url!r} is closed already")
        try:
            self._flush_pack()
            missing = [a.key for a in self._arrays if not a.complete]
            if missing:
                raise ZarrckptError(f"arrays {missing[:5]} were declared but not every chunk was written "
                                    f"({len(missing)} incomplete); nothing was committed")
            tree = self.tree()
            self._out.finish()
            engine.finish(_ONE, self.url, self._target, None, functools.partial(self._committed_root, tree),
                          crcs=self._crcs)
        except BaseException:
            self.abandon()
            raise
        self._closed = True
        return {"path": self.url, "save_id": self.save_id, "arrays": len(self._docs),
                "leaves": len(self._arrays), "bytes_written": self.bytes_written}

    def _committed_root(self, tree: dict, chunk_crcs: dict | None = None) -> dict:
        """The committed root, parsed as a reader will (spec §6.1-6.3, §6.6), so that a
        save never commits a checkpoint that readers refuse; a failure is a bug of the
        writer, reported before the commit."""
        root = fmt.root_metadata(state="committed", save_id=self.save_id, world_size=1, created=self.created,
                                 writer=self._writer, tree=tree, array_docs=self._docs, metadata=self.metadata,
                                 chunk_crcs=chunk_crcs)
        try:
            fmt.parse_root_bytes(fmt.root_bytes(root), self.url)
        except ZarrckptError as e:
            raise ZarrckptError(f"the checkpoint about to be committed at {self.url!r} would not be "
                                f"readable, so nothing was committed (a bug in zarrckpt; please report "
                                f"it): {e}") from e
        return root

    def abandon(self) -> None:
        """Stop: wait for writes in flight, then remove this save's directory and claim."""
        if self._closed:
            return
        self._closed = True
        try:
            self._out.stop()
        finally:
            engine.abandon(_ONE, self._target)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abandon()
        elif not self._closed:
            self.commit()
