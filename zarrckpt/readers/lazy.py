"""``LazyArray``: one array leaf of an open checkpoint, read only when indexed.

>>> w = zarrckpt.open("ckpt/step_100")["model/layers.0.weight"]   # doctest: +SKIP
>>> w.shape, w.dtype, w.chunks, w.placements                      # doctest: +SKIP
((4096, 4096), dtype(bfloat16), (2048, 4096), (Shard(dim=0),))
>>> w[:128, ::2]        # reads only the chunks these rows touch  # doctest: +SKIP

Indexing follows NumPy (integers, negative indices, slices with steps, ``...``, ``None``,
integer and boolean arrays, with NumPy's rules for where advanced-index dimensions go)
and returns NumPy arrays (ml_dtypes types for bfloat16 and float8). It goes through
TensorStore, which fetches only the chunks (with sharding: inner chunks) the selection
touches, verifies their CRC-32C, and fails on a missing chunk instead of returning fill
values. TensorStore does not wrap negative indices, so they are turned into NumPy's
meaning here first.

Every read (indexing, ``to_numpy``, a dask task) checks afterwards that the checkpoint
was not replaced since it was opened, and raises ``CheckpointChangedError`` if it was
(see :mod:`zarrckpt.readers.checkpoint`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..format import documents as fmt
from .._optional import require
from ..format.layout import Layout, Replicate, Shard, StridedShard
from ..storage.inflight import wait_all

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = ["LazyArray", "checked_read", "describe", "format_bytes", "normalize_index", "placement_str",
           "saved_layout"]


def checked_read(method: Callable) -> Callable:
    """A method of an object with a ``_ck`` (its checkpoint) that reads as one read: the
    root is checked after it (spec §7.3), see ``CheckpointView.reading``."""

    @functools.wraps(method)
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._ck.reading():
            return method(self, *args, **kwargs)

    return read


class LazyArray:
    """An array leaf of a checkpoint (an array of its own, or packed), read on demand.

    Nothing is read when it is created; its ``zarr.json`` (already verified against the
    root's digest) gives ``shape``, ``dtype``, ``chunks`` and the saved layout.

    ``chunks`` is the chunk grid's chunk shape: each chunk is one stored object written
    by one process (with the sharding codec, one shard). ``inner_chunks`` is the shape
    of the inner chunks a shard holds (the smallest unit a partial read fetches), or
    None without sharding. A packed leaf is one chunk of its own shape.
    """

    def __init__(self, checkpoint: Checkpoint, key: str) -> None:
        self._ck = checkpoint
        self.key = key

    # ---- what it is ---------------------------------------------------------

    @functools.cached_property
    def info(self) -> fmt.ArrayInfo:
        """The parsed, verified array metadata (:class:`zarrckpt.format.documents.ArrayInfo`)."""
        return self._ck.array_info(self.key)

    @property
    def kind(self) -> str:
        """``tensor``, ``dtensor``, ``sharded_tensor``, ``ndarray``, ``bytes`` or ``bytesio``."""
        return self.info.kind

    @property
    def packed(self) -> bool:
        return self._ck.is_packed(self.key)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype (``ml_dtypes.bfloat16`` ... for bfloat16 and float8)."""
        return self.info.dtype.numpy

    @property
    def data_type(self) -> str:
        """The Zarr ``data_type`` name (also torch's dtype name)."""
        return self.info.dtype.zarr

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def chunks(self) -> tuple[int, ...]:
        return self.info.chunk_shape

    @property
    def inner_chunks(self) -> tuple[int, ...] | None:
        return self.info.inner_chunk_shape

    @property
    def dimension_names(self) -> tuple[str | None, ...] | None:
        names = self.info.metadata.get("dimension_names")
        return tuple(names) if names is not None else None

    @property
    def attrs(self) -> dict[str, Any]:
        """The array's ``attributes.zarrckpt`` (spec §5.6); for a packed leaf its descriptor."""
        if self.packed:
            return dict(self.info.metadata)
        return dict(self.info.metadata["attributes"][fmt.ATTR])

    @property
    def mesh(self) -> dict[str, Any] | None:
        """The save-time device mesh of a DTensor/ShardedTensor (``shape``, ``dim_names``,
        ``device_type``), or None for other kinds."""
        mesh = self.attrs.get("mesh")
        return dict(mesh) if isinstance(mesh, dict) else None

    @property
    def placements(self) -> tuple | None:
        """The save-time placements (:mod:`zarrckpt.format.layout` ``Shard``, ``StridedShard``,
        ``Replicate``), one per mesh dimension, or None for other kinds."""
        return self.info.placements

    @functools.cached_property
    def layout(self) -> Layout | None:
        """The save-time :class:`zarrckpt.format.layout.Layout` (which part each mesh coordinate
        held), or None for kinds without a mesh or a chunk grid zarrckpt's rule does not
        give (a checkpoint from another writer)."""
        return saved_layout(self.info)

    @functools.cached_property
    def writers(self) -> dict[tuple[int, ...], tuple[int, ...]] | None:
        """``{chunk index: mesh coordinate that wrote it}`` (spec Appendix C.4), from the
        saved layout; None where :attr:`layout` is None. Mesh coordinates, not ranks: the
        format does not record which rank sat at which coordinate."""
        lay = self.layout
        if lay is None:
            return None
        out: dict[tuple[int, ...], tuple[int, ...]] = {}
        for coord in itertools.product(*(range(m) for m in lay.mesh_shape)):
            for w in lay.save_plan(coord)[0]:
                out[w.index] = coord
        return out

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    # ---- data ---------------------------------------------------------------

    @checked_read
    def __getitem__(self, index: Any) -> Any:
        """NumPy-style selection, with NumPy's own semantics. Reads only what the selection
        touches: the bounding box of each slice (a step reads the rows between), and runs
        of nearby indices of an integer or boolean array index."""
        norm = normalize_index(index, self.shape)
        boxes, extent, local_index = _selection(norm, self.shape, self._read_unit())
        out = np.empty(extent, dtype=self.dtype)
        wait_all([(self.key, self._ck._read_into(self.key, box, out[dst] if dst else out))
                  for box, dst in boxes])
        out = out[local_index]
        return out[()] if out.ndim == 0 else out

    def _read_unit(self) -> tuple[int, ...]:
        """The extent of the smallest stored unit (an inner chunk, else a chunk)."""
        return self.inner_chunks or self.chunks

    @checked_read
    def to_numpy(self) -> np.ndarray:
        """The whole array as a NumPy array (read concurrently, straight into it)."""
        return self._ck._read_box(self.key, tuple((0, n) for n in self.shape))

    def read(self) -> np.ndarray:
        """Same as :meth:`to_numpy`."""
        return self.to_numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.to_numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def tensorstore(self) -> Any:
        """A TensorStore handle (lazy; a packed leaf's is an in-memory copy)."""
        return self._ck.tensorstore(self.key)

    def dask(self, chunks: Any = None) -> Any:
        """A dask array over this leaf. Its chunks are the stored chunks (:attr:`chunks`)
        unless ``chunks`` says otherwise, so each task reads one stored object once."""
        da = require("dask.array", "LazyArray.dask()")
        chunks = self.chunks if chunks is None else chunks
        token = hashlib.sha1(repr((self._ck.url, self._ck.info.save_id, self.key, chunks)).encode()).hexdigest()
        name = f"zarrckpt-{self.key.rsplit('/', 1)[-1]}-{token[:16]}"
        return da.from_array(self, chunks=chunks, name=name, asarray=False, lock=False,
                             meta=np.empty((0,) * self.ndim, dtype=self.dtype))

    def to_torch(self) -> Any:
        """The whole array as a CPU torch tensor of the saved dtype (needs torch)."""
        require("torch", "LazyArray.to_torch()")
        from ..format import dtypes

        data = self.to_numpy()
        return dtypes.from_numpy(np.require(data, requirements="C"), self.info.dtype)  # 0-d stays 0-d

    def __reduce__(self) -> tuple:
        return _lazy_array, (self._ck, self.key)

    def __repr__(self) -> str:
        try:
            return f"<zarrckpt.LazyArray {self.key!r} {describe(self)}>"
        except Exception as e:  # noqa: BLE001 - a repr never raises
            return f"<zarrckpt.LazyArray {self.key!r} (unreadable: {e})>"


def _lazy_array(ck: Checkpoint, key: str) -> LazyArray:
    return LazyArray(ck, key)


def describe(a: LazyArray, *, chunks: bool = True) -> str:
    """``bfloat16[4096, 4096] 32.0 MiB, chunks [2048, 4096], dtensor (dp=2, tp=2) [Shard(0), ...]``"""
    out = f"{a.data_type}{list(a.shape)} {format_bytes(a.nbytes)}"
    if a.packed:
        return out + ", packed"
    if chunks and a.ndim:
        out += f", chunks {list(a.chunks)}"
        if a.inner_chunks:
            out += f" (inner {list(a.inner_chunks)})"
    if a.kind != "tensor":
        out += f", {a.kind}"
    mesh = a.mesh
    if mesh is not None:
        names = mesh.get("dim_names") or [None] * len(mesh["shape"])
        dims = ", ".join(f"{n}={s}" if n else str(s) for n, s in zip(names, mesh["shape"]))
        out += f" mesh ({dims}) [{', '.join(placement_str(p) for p in a.placements or ())}]"
    return out


def placement_str(p: Any) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, StridedShard):
        return f"StridedShard({p.dim}, sf={p.split_factor})"
    if isinstance(p, Replicate):
        return "Replicate()"
    return repr(p)


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


# ------------------------------------------------------------------ the saved layout


def saved_layout(info: fmt.ArrayInfo) -> Layout | None:
    """The :class:`Layout` that gives ``info``'s chunk grid from its mesh and placements.

    zarrckpt splits a large replicated cell into chunks written by different replicas
    (``replica_split_bytes``, Appendix C.1); the threshold is not stored, so the few
    thresholds that give different grids are tried. None if none reproduces the grid."""
    if info.placements is None or info.mesh_shape is None:
        return None
    shape, mesh, pl = info.shape, info.mesh_shape, info.placements
    base = Layout(shape, mesh, pl, key=info.key)
    if base.chunk_shape == info.chunk_shape:
        return base
    cell = int(np.prod(base.chunk_shape, dtype=np.int64))
    # The split factor k is the largest divisor of the longest chunk extent up to
    # min(replicas, cell // (threshold // 8)): threshold 1 gives k's cap = replicas,
    # 8 * (cell // j) caps it at j (>= 8; below 8 no threshold splits at all).
    for split_min in [1, *(8 * (cell // j) for j in range(8, base.replicas + 1))]:
        lay = Layout(shape, mesh, pl, key=info.key, replica_split_min_elems=max(split_min, 1))
        if lay.chunk_shape == info.chunk_shape:
            return lay
    return None


# ------------------------------------------------------------------ NumPy indexing


_INDEX_HELP = ("only integers, slices (`:`), ellipsis (`...`), numpy.newaxis (`None`) and integer "
               "or boolean arrays are valid indices")


def normalize_index(index: Any, shape: tuple[int, ...]) -> tuple:
    """A NumPy index as TensorStore must be given it to mean what NumPy means: negative
    integers and slice bounds resolved (TensorStore does not wrap them), boolean arrays
    as the integer arrays of their ``nonzero()``, ``...`` expanded, and integer scalars as
    0-d arrays when an array index is present (NumPy then treats them as advanced
    indices). Out-of-range indices raise :class:`IndexError` as NumPy would."""
    if not isinstance(index, tuple):
        index = (index,)
    items: list[Any] = []
    for it in index:
        if it is Ellipsis or it is None or isinstance(it, slice):
            items.append(it)
        elif isinstance(it, (bool, np.bool_)):
            raise IndexError("boolean scalar indices are not supported; " + _INDEX_HELP)
        elif _is_int(it):
            items.append(operator.index(it))
        else:
            arr = np.asarray(it)
            if arr.dtype == np.bool_:
                if arr.ndim == 0:
                    raise IndexError("boolean scalar indices are not supported; " + _INDEX_HELP)
                items.append(arr)  # consumes arr.ndim dimensions, as in NumPy
            elif arr.dtype.kind in "iu":
                items.append(arr.astype(np.int64))
            else:
                raise IndexError(_INDEX_HELP)
    if sum(it is Ellipsis for it in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    consuming = sum(it.ndim if isinstance(it, np.ndarray) and it.dtype == np.bool_ else 1
                    for it in items if it is not None and it is not Ellipsis)
    if consuming > len(shape):
        raise IndexError(f"too many indices for array: array is {len(shape)}-dimensional, but "
                         f"{consuming} were indexed")
    fill = [slice(None)] * (len(shape) - consuming)
    if any(it is Ellipsis for it in items):
        pos = next(i for i, it in enumerate(items) if it is Ellipsis)
        items[pos:pos + 1] = fill
    else:
        items.extend(fill)
    has_array = any(isinstance(it, np.ndarray) for it in items)
    out: list[Any] = []
    d = 0
    for it in items:
        if it is None:
            out.append(None)
            continue
        if isinstance(it, np.ndarray) and it.dtype == np.bool_:
            if it.shape != tuple(shape[d:d + it.ndim]):
                raise IndexError(f"boolean index of shape {it.shape} does not match the indexed "
                                 f"dimensions {tuple(shape[d:d + it.ndim])} (from axis {d})")
            out.extend(np.nonzero(it))
            d += it.ndim
            continue
        n = shape[d]
        if isinstance(it, slice):
            start, stop, step = it.indices(n)
            out.append(slice(start, stop, step) if len(range(start, stop, step)) else slice(0, 0, 1))
        elif isinstance(it, np.ndarray):
            bad = (it < -n) | (it >= n)
            if bad.any():
                raise IndexError(f"index {int(it[bad].flat[0])} is out of bounds for axis {d} with size {n}")
            out.append(np.where(it < 0, it + n, it))
        else:
            if not -n <= it < n:
                raise IndexError(f"index {it} is out of bounds for axis {d} with size {n}")
            i = it + n if it < 0 else it
            out.append(np.array(i, dtype=np.int64) if has_array else i)
        d += 1
    return tuple(out)


def _selection(norm: tuple, shape: tuple[int, ...], unit: tuple[int, ...]
               ) -> tuple[list[tuple[tuple, tuple]], tuple[int, ...], tuple]:
    """How to read a normalized index (:func:`normalize_index`): ``(boxes, extent,
    index)``. Each ``(box, dst)`` is a box of the array to read into the slices ``dst`` of a
    compact buffer of shape ``extent``; ``index`` then selects the result from that buffer
    with NumPy's semantics. A slice or an integer reads its bounding run; an integer array
    reads runs of its sorted distinct values, merging values less than a read ``unit``
    apart (so a stored unit is fetched once)."""
    runs: list[list[tuple[int, int, int]]] = []  # per dimension: (start, stop, offset in buffer)
    extent: list[int] = []
    index: list[Any] = []
    d = 0
    for it in norm:
        if it is None:
            index.append(None)
            continue
        if isinstance(it, slice):
            r = range(it.start, it.stop, it.step)
            lo, hi = (min(r[0], r[-1]), max(r[0], r[-1]) + 1) if len(r) else (0, 0)
            stop = it.stop - lo
            index.append(slice(it.start - lo, stop if stop >= 0 else None, it.step) if len(r) else slice(0, 0))
            dim_runs = [(lo, hi)]
        elif isinstance(it, np.ndarray):
            values = np.unique(it)
            cut = np.nonzero(np.diff(values) > unit[d])[0] + 1  # a new run after a gap of a unit
            dim_runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(values, cut) if r.size]
            starts = np.array([a for a, _ in dim_runs] or [0], dtype=np.int64)
            offsets = np.cumsum([0] + [b - a for a, b in dim_runs])[:-1] if dim_runs else np.zeros(1, np.int64)
            which = np.searchsorted(starts, it, side="right") - 1
            index.append(offsets[which] + it - starts[which])
        else:
            dim_runs = [(it, it + 1)]
            index.append(0)
        offset = 0
        with_offsets = []
        for a, b in dim_runs:
            with_offsets.append((a, b, offset))
            offset += b - a
        runs.append(with_offsets)
        extent.append(offset)
        d += 1
    boxes = [(tuple((a, b) for a, b, _ in combo), tuple(slice(o, o + b - a) for a, b, o in combo))
             for combo in itertools.product(*runs)]
    return boxes, tuple(extent), tuple(index)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer))
