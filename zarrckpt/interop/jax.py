"""JAX in and out: sharded ``jax.Array``s from a checkpoint, and checkpoints from them.

``zarrckpt.jax.load(path, target)`` builds each ``jax.Array`` with
``jax.make_array_from_callback``: every process reads the boxes its own devices hold,
each stored byte at most once (replicas share one read, and devices whose boxes meet one
stored chunk share its read), straight from the stored chunks, then hands each device its
box. ``zarrckpt.jax.save(pytree, path)`` writes the same format
``zarrckpt.save`` writes: one Zarr array per leaf, its chunk grid following the
sharding, each chunk written once by the process holding it, committed as spec §7 says.
So a model trained in PyTorch (DTensors, any mesh) loads into JAX with any
``NamedSharding``, and what JAX saves loads back into DTensors. torch is not needed.

How a ``jax.Array`` is stored (spec §5.6):

=====================================  ==========================================
sharding over several devices          kind ``dtensor``: ``mesh`` = the JAX mesh axes
                                       (``dim_names``), axes named in the
                                       ``PartitionSpec`` first, in the order that
                                       gives JAX's nesting; ``Shard(d)`` for an axis
                                       that splits dimension ``d``, ``Replicate()``
                                       for the others; ``device_type`` the platform
one device (or a process-local array   kind ``tensor`` (like a plain torch tensor:
in a multi-process job)                taken to be equal on every process)
``numpy.ndarray`` / NumPy scalar       kind ``ndarray``
``bytes``, ``io.BytesIO``              kinds ``bytes``, ``bytesio``
Python scalars, str, None, containers  the tree (§6.2)
=====================================  ==========================================

Shardings other than ``NamedSharding`` are stored through the grid of boxes their
devices hold (one mesh dimension per split tensor dimension, plus one for replicas).
Small leaves are not packed (``pack_bytes`` of ``zarrckpt.save`` is 0 here), so every
array is visible to generic Zarr tools.

Multi-process jobs (``jax.distributed.initialize``): every process calls ``save`` /
``load`` with the same arguments, in the same order. ``load`` needs no communication.
``save`` agrees through ``jax.experimental.multihost_utils`` (four small all-gathers
and one broadcast): process 0 claims the location and commits; every process writes
the chunks its devices hold; a failure on one process fails the save on all of them,
and nothing is committed. These steps are the save engine's (``zarrckpt/engine.py``,
shared with ``zarrckpt.save``); ``_Processes`` is its group of JAX processes.
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine import commit as _commit
from ..format import dtypes
from ..engine import save as engine
from .. import errors as zerrors
from ..format import documents as fmt
from ..format import tree as ztree
from ..storage.inflight import InFlight
from .._optional import require
from ..errors import (
    DTypeMismatchError,
    MissingKeysError,
    SaveFailedError,
    ShapeMismatchError,
    StateDictMismatchError,
    UnsupportedPlacementError,
    UnsupportedValueError,
)
from ..format.layout import Layout, Replicate, Shard, unit_elements
from ..readers.checkpoint import Checkpoint, CheckpointView
from ..storage import StorageOptions, open_storage

jax = require("jax", "zarrckpt.jax")

__all__ = ["load", "save"]

Box = tuple[tuple[int, int], ...]


# ====================================================================== load


def _is_target_leaf(x: Any) -> bool:
    return isinstance(x, (jax.ShapeDtypeStruct, jax.sharding.Sharding, jax.Array))


@dataclass
class _Read:
    """One array to build: where it goes in the result, and how."""

    key: str  # the checkpoint key
    where: str  # the target key (for messages)
    shape: tuple[int, ...] | None  # None: the saved shape
    dtype: np.dtype | None  # None: the saved dtype
    sharding: Any
    info: fmt.ArrayInfo | None = None
    buffers: dict[Box, np.ndarray] = field(default_factory=dict)


class _Pending:
    """A placeholder in the result tree, replaced by its jax.Array once read."""

    def __init__(self, read: _Read) -> None:
        self.read = read


def load(path: Any, target: Any, *, keys: Iterable[str] | None = None,
         key_map: dict[str, str] | Callable[[str], str] | None = None, cast: bool = False,
         storage: StorageOptions | None = None, max_inflight_bytes: int = 256 << 20,
         report: dict | None = None) -> Any:
    """Load a checkpoint as ``jax.Array`` s with the shardings you give.

    ``target``:

    * one ``jax.sharding.Sharding`` for every array: the result is the checkpoint's nested
      dict (the part under ``keys``, exact keys or prefixes) with every tensor or NumPy
      leaf a ``jax.Array`` of its saved shape and dtype; bytes and values as stored;
    * a pytree (nested dicts, lists, tuples) whose leaves are ``jax.ShapeDtypeStruct``
      (with ``sharding=``; without, the first local device), ``Sharding`` s, or
      ``jax.Array`` s (their shape, dtype and sharding): the same structure back, each
      such leaf loaded; any other leaf is replaced by the checkpoint's value at its key.
      ``keys`` keeps only the target leaves under those keys.

    A target shape must equal the saved one (:class:`ShapeMismatchError`); a target
    dtype that differs from the saved one needs ``cast=True`` (:class:`DTypeMismatchError`),
    as does a 64-bit array while ``jax_enable_x64`` is off (JAX would truncate it).
    ``key_map`` (dict or callable): target key -> checkpoint key, for renamed leaves.
    Target keys missing from the checkpoint raise :class:`MissingKeysError`.

    Each process reads only the boxes its own (addressable) devices hold, each stored
    chunk (or inner chunk) at most once, however the target sharding cuts across them.
    ``report``: a dict filled with ``bytes_needed`` (the distinct boxes), ``bytes_fetched``
    (whole read units: inner chunks, or chunks), both in the stored data types, and
    ``seconds``.
    """
    t0 = time.perf_counter()
    ck = path if isinstance(path, CheckpointView) else Checkpoint(path, storage)
    with ck.reading():  # one root check after every read, not one per value
        wanted = None if keys is None else [k.rstrip("/") for k in ([keys] if isinstance(keys, str) else keys)]
        reads: list[_Read] = []
        if isinstance(target, jax.sharding.Sharding):
            if key_map is not None:
                raise TypeError("key_map maps target keys to checkpoint keys: it needs a pytree target")

            root = ck.checkpoint

            def leaf(key: str) -> Any:  # a full key (of the whole checkpoint)
                if root.array_info(key).kind in fmt.BYTE_KINDS:
                    return root.read(key)
                r = _Read(key, key, None, None, target)
                reads.append(r)
                return _Pending(r)

            result = ck.to_dict(wanted, load_array=leaf)
        else:
            result = _plan_pytree(ck, target, wanted, key_map, reads)
        _check(ck, reads, cast)
        fetched, needed = _read_boxes(ck, reads, max_inflight_bytes)
    out = _replace(result, lambda p: _make_array(p.read))
    if report is not None:
        report.update(arrays=len(reads), bytes_needed=needed, bytes_fetched=fetched,
                      seconds=time.perf_counter() - t0)
    return out


def _plan_pytree(ck: CheckpointView, target: Any, wanted: list[str] | None, key_map: Any,
                 reads: list[_Read]) -> Any:
    mapped = (lambda k: key_map.get(k, k)) if isinstance(key_map, dict) else (key_map or (lambda k: k))
    missing: list[str] = []

    def build(node: Any, path: tuple) -> Any:
        if isinstance(node, dict) and (node or not path) and not _is_target_leaf(node):
            out = {}
            for k, v in node.items():
                sub = build(v, path + (k,))
                if sub is not _DROP:
                    out[k] = sub
            return out if out or not node or not path else _DROP
        if isinstance(node, (list, tuple)) and node:
            items = [build(v, path + (i,)) for i, v in enumerate(node)]
            if all(i is _DROP for i in items):
                return _DROP
            items = [None if i is _DROP else i for i in items]  # keep positions
            if isinstance(node, tuple):
                return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
            return items
        tkey = ztree.key_of(path)
        if wanted is not None and not any(tkey == w or tkey.startswith(w + "/") for w in wanted):
            return _DROP
        ckey = mapped(tkey)
        if ckey not in ck:
            missing.append(tkey if ckey == tkey else f"{tkey} (-> {ckey})")
            return None
        if not _is_target_leaf(node):
            return ck.read(ckey)
        if not ck.is_array(ckey):
            raise StateDictMismatchError(f"key {tkey!r}: the target is an array but the checkpoint holds a "
                                         f"{type(ck.read(ckey)).__name__} value")
        if isinstance(node, jax.sharding.Sharding):
            r = _Read(ck._full(ckey), tkey, None, None, node)
        else:
            sharding = getattr(node, "sharding", None)
            if sharding is None:
                sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            r = _Read(ck._full(ckey), tkey, tuple(node.shape), np.dtype(node.dtype), sharding)
        reads.append(r)
        return _Pending(r)

    out = build(target, ())
    if missing:
        shown = ", ".join(map(repr, missing[:10])) + (f" ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise MissingKeysError(f"{len(missing)} key(s) of the target are not in checkpoint {ck.checkpoint.url!r}: "
                               f"{shown} (use key_map= for renamed leaves, or keys= to load a part)")
    return {} if out is _DROP else out


_DROP = object()


def _check(ck: CheckpointView, reads: list[_Read], cast: bool) -> None:
    """Shapes and dtypes, for every array, before anything is read."""
    root = ck.checkpoint
    infos = root.array_infos([r.key for r in reads])
    x64 = bool(jax.config.jax_enable_x64)
    for r in reads:
        info = r.info = infos[r.key]
        where = repr(r.where) + (f" (checkpoint key {r.key!r})" if r.key != r.where else "")
        if info.kind in fmt.BYTE_KINDS:
            raise StateDictMismatchError(f"array {where}: the checkpoint holds bytes there")
        if r.shape is not None and r.shape != info.shape:
            raise ShapeMismatchError(f"array {where}: saved shape {info.shape}, target {r.shape}")
        saved = info.dtype.numpy
        want = r.dtype if r.dtype is not None else saved
        if not x64 and want.itemsize == 8 and want.kind in "iuf":
            if not cast:
                raise DTypeMismatchError(
                    f"array {where} is {info.dtype.zarr}, but jax_enable_x64 is off and JAX would "
                    f"truncate it to 32 bits; enable it (jax.config.update('jax_enable_x64', True)) "
                    f"or pass cast=True")
            want = np.dtype(jax.dtypes.canonicalize_dtype(want))
        if want != saved and not cast:
            raise DTypeMismatchError(f"array {where}: saved dtype {info.dtype.zarr}, target {want} "
                                     "(pass cast=True to convert)")
        r.dtype = want
        if r.sharding.num_devices and info.shape:
            try:
                r.sharding.shard_shape(info.shape)
            except Exception as e:  # noqa: BLE001 - JAX's own message says why
                raise ShapeMismatchError(f"array {where} of shape {info.shape} cannot take sharding "
                                         f"{r.sharding}: {e}") from None


def _box(index: tuple, shape: tuple[int, ...]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape)) if index else ()


def _read_boxes(ck: CheckpointView, reads: list[_Read], max_inflight_bytes: int) -> tuple[int, int]:
    """Read every distinct box this process's devices hold, each stored byte at most once;
    returns the bytes fetched (whole read units) and the bytes of the distinct boxes (both
    in the stored data type).

    Storage reads whole units (inner chunks, else chunks). Boxes that touch no unit another
    box touches are read straight into their own buffers. Boxes that share units (a
    sharding that cuts across the stored chunks: each device's box would fetch the shared
    units again, 4x the bytes for a column split on 4 devices) are read together, once,
    into one buffer over their bounding box, and each device gets a view of it."""
    root = ck.checkpoint
    fetched = needed = 0
    by_key: dict[str, list[_Read]] = {}
    for r in reads:
        by_key.setdefault(r.key, []).append(r)
    with InFlight(max_inflight_bytes, op="read") as pending:
        for key, same in by_key.items():
            info = same[0].info
            wanted: set[Box] = set()
            for r in same:
                wanted |= {_box(idx, info.shape) for idx in
                           r.sharding.addressable_devices_indices_map(info.shape).values()}
            unit = info.inner_chunk_shape or info.chunk_shape
            views: dict[Box, np.ndarray] = {}
            for region, members, parts in _read_groups(sorted(wanted), unit, info.shape):
                buf = np.empty([b - a for a, b in region], dtype=info.dtype.numpy)
                for box in members:
                    views[box] = _view(buf, box, region)
                    needed += views[box].nbytes
                if not buf.size:
                    continue
                for part in parts:
                    fetched += unit_elements(part, unit, info.shape) * buf.itemsize
                    out = _view(buf, part, region)
                    pending.add(key, root.read_into(key, part, out), out.nbytes)
            for r in same:
                r.buffers = {box: views[box] for box in
                             {_box(idx, info.shape) for idx in
                              r.sharding.addressable_devices_indices_map(info.shape).values()}}
        pending.wait()
    for r in reads:
        if r.dtype != r.info.dtype.numpy:
            r.buffers = {b: v.astype(r.dtype) for b, v in r.buffers.items()}
    return fetched, needed


def _view(buf: np.ndarray, box: Box, region: Box) -> np.ndarray:
    """The part ``box`` of ``buf``, which holds ``region``: a view (0-d too, never a scalar)."""
    return buf[(*(slice(a - ra, b - ra) for (a, b), (ra, _) in zip(box, region)), ...)]


def _read_groups(boxes: list[Box], unit: tuple[int, ...] | None, shape: tuple[int, ...]
                 ) -> list[tuple[Box, list[Box], list[Box]]]:
    """``(region, member boxes, parts to read)`` per group of ``boxes`` that share read units
    (extent ``unit``, cut at ``shape``): each member lies in its region, and the parts (boxes
    inside the region) together touch every unit the members touch, each unit once."""
    if not shape or unit is None or not boxes:
        return [(b, [b], [b]) for b in boxes]

    def units(box: Box) -> Box:  # the unit-grid box a box touches
        return tuple((a // u, -(-b // u)) for (a, b), u in zip(box, unit))

    def meet(x: Box, y: Box) -> bool:
        return all(a < d and c < b for (a, b), (c, d) in zip(x, y))

    empty = [b for b in boxes if any(a >= e for a, e in b)]
    full = [b for b in boxes if b not in empty]
    grid = [units(b) for b in full]
    parent = list(range(len(full)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(full)):
        for j in range(i):
            if meet(grid[i], grid[j]):
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(full)):
        groups.setdefault(find(i), []).append(i)
    out = [(b, [b], []) for b in empty]
    for idx in groups.values():
        members = [full[i] for i in idx]
        if len(members) == 1:
            out.append((members[0], members, members))
            continue
        region = tuple((min(m[d][0] for m in members), max(m[d][1] for m in members))
                       for d in range(len(shape)))
        # the unit grid cut at every member's unit boundaries: cells lie wholly inside or
        # outside each member's units, so reading the covered cells reads each unit once
        cuts = [sorted({g[d][k] for g in (grid[i] for i in idx) for k in (0, 1)}) for d in range(len(shape))]
        cells = [tuple(zip(c[:-1], c[1:])) for c in cuts]
        covered = [cell for cell in _product(cells)
                   if any(all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(cell, grid[i])) for i in idx)]
        if len(covered) == _count(cells):
            parts = [region]  # the units of the region are all needed: one read
        else:  # a region with holes: each covered cell, clipped to the region
            parts = [tuple((max(lo * u, ra), min(hi * u, rb)) for (lo, hi), u, (ra, rb) in zip(cell, unit, region))
                     for cell in covered]
            parts = [p for p in parts if all(a < b for a, b in p)]
        out.append((region, members, parts))
    return out


def _product(cells: list[tuple]) -> list[tuple]:
    return list(itertools.product(*cells))


def _count(cells: list[tuple]) -> int:
    n = 1
    for c in cells:
        n *= len(c)
    return n


def _make_array(r: _Read) -> Any:
    shape = r.info.shape
    return jax.make_array_from_callback(shape, r.sharding, lambda index: r.buffers[_box(index, shape)])


def _replace(node: Any, fn: Callable[[_Pending], Any]) -> Any:
    if isinstance(node, _Pending):
        return fn(node)
    if isinstance(node, dict):
        return {k: _replace(v, fn) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace(v, fn) for v in node]
    if isinstance(node, tuple):
        items = [_replace(v, fn) for v in node]
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    return node


# ====================================================================== save


def _is_array_leaf(x: Any) -> bool:
    if isinstance(x, (jax.Array, np.ndarray, io.BytesIO)):
        return True
    # NumPy scalars that are not Python int/float/str subclasses (np.float32, np.int64, np.bool_)
    return isinstance(x, np.generic) and not isinstance(x, (int, float, str, bytes))


@dataclass
class _Plan:
    """One array of a JAX save, from this process's point of view."""

    key: str
    kind: str
    dtype: dtypes.DType
    layout: Layout
    mesh: tuple[tuple[int, ...], tuple[str, ...] | None, str | None] | None  # shape, names, device type
    parts: list[tuple[Callable[[Any], np.ndarray], tuple[engine.ChunkWrite, ...]]]  # (host data, its chunks)
    writes_metadata: bool


class _Processes:
    """The processes of the JAX job, and the few agreements a save needs."""

    def __init__(self) -> None:
        self.rank = jax.process_index()
        self.size = jax.process_count()

    def _allgather(self, values: list[int]) -> np.ndarray:
        if self.size == 1:
            return np.asarray([values], dtype=np.int64)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(np.asarray(values, dtype=np.int32)))

    def broadcast(self, values: list[int]) -> list[int]:
        """Process 0's ``values`` (each in 0 .. 2**31-1) on every process."""
        if self.size == 1:
            return list(values)
        from jax.experimental import multihost_utils

        return [int(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32)))]

    def agree(self, error: BaseException | None, what: str, error_class: type[Exception] = SaveFailedError,
              fingerprint: str = "") -> None:
        """Every process learns whether ``what`` succeeded everywhere (and, with a
        ``fingerprint``, whether every process had the same one); if not, every process
        raises an error of one class naming the processes that failed (the engine's group
        protocol): a zarrckpt error's class, or ``error_class``. A process that was
        interrupted (``KeyboardInterrupt``, ``SystemExit``) re-raises that, as itself."""
        fp = int(fingerprint[:7], 16) if fingerprint else 0
        codes = self._allgather([_error_code(error), fp])
        failed = [r for r in range(self.size) if codes[r][0]]
        if not failed:
            if len({int(c[1]) for c in codes}) > 1:
                raise SaveFailedError(
                    f"{what}: the processes disagree on the path, the options or the tree to save "
                    "(every process must call zarrckpt.jax.save with the same pytree structure, "
                    "shapes, shardings and arguments); nothing was written")
            return
        cls = _error_class(int(codes[failed[0]][0]), error_class)
        names = "process " + ", ".join(map(str, failed))
        if error is not None:
            if self.size == 1 or not isinstance(error, Exception):
                raise error
            raise cls(f"{what} failed on {names}: {error}") from error
        raise cls(f"{what} failed on {names} (see the error there)")


_ERROR_CLASSES = tuple(getattr(zerrors, n) for n in zerrors.__all__)


def _error_code(error: BaseException | None) -> int:
    if error is None:
        return 0
    for i, cls in enumerate(_ERROR_CLASSES):
        if type(error) is cls:
            return i + 2
    return 1


def _error_class(code: int, fallback: type[Exception]) -> type[Exception]:
    return _ERROR_CLASSES[code - 2] if code >= 2 else fallback


def _named_mesh(sharding: Any) -> tuple | None:
    """(mesh shape, axis names, placements, {device id: coordinate}) of a NamedSharding,
    with the axes its PartitionSpec names first, in spec order (DTensor nests the
    placements of one tensor dimension in mesh order, as JAX nests a tuple of axes)."""
    mesh, spec = sharding.mesh, sharding.spec
    if not hasattr(mesh, "devices"):
        return None
    names = list(mesh.axis_names)
    sizes = dict(mesh.shape)
    order: list[Any] = []
    dim_of: dict[Any, int] = {}
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        for n in entry if isinstance(entry, tuple) else (entry,):
            if n not in sizes or n in dim_of:
                return None  # UNCONSTRAINED, or something this mapping does not know
            order.append(n)
            dim_of[n] = d
    axes = order + [n for n in names if n not in dim_of]
    mesh_shape = tuple(int(sizes[n]) for n in axes)
    placements = tuple(Shard(dim_of[n]) if n in dim_of else Replicate() for n in axes)
    devs = np.transpose(np.asarray(mesh.devices), [names.index(n) for n in axes])
    coord_of = {dev.id: tuple(int(i) for i in c) for c, dev in np.ndenumerate(devs)}
    return mesh_shape, tuple(str(n) for n in axes), placements, coord_of


def _grid_mesh(sharding: Any, shape: tuple[int, ...]) -> tuple | None:
    """The same for any sharding, from the boxes its devices hold: one mesh dimension
    per split tensor dimension, then one for the replicas of each box."""
    boxes = {dev: _box(idx, shape) for dev, idx in sharding.devices_indices_map(shape).items()}
    starts = [sorted({b[d][0] for b in boxes.values()}) for d in range(len(shape))]
    split = [d for d in range(len(shape)) if len(starts[d]) > 1]
    by_box: dict[Box, list[Any]] = {}
    for dev in sorted(boxes, key=lambda d: d.id):
        by_box.setdefault(boxes[dev], []).append(dev)
    replicas = {len(v) for v in by_box.values()}
    if len(replicas) != 1:
        return None
    (r,) = replicas
    mesh_shape = tuple(len(starts[d]) for d in split) + ((r,) if r > 1 or not split else ())
    placements = tuple(Shard(d) for d in split) + ((Replicate(),) if r > 1 or not split else ())
    coord_of = {dev.id: tuple(starts[d].index(boxes[dev][d][0]) for d in split)
                + ((by_box[boxes[dev]].index(dev),) if r > 1 or not split else ()) for dev in boxes}
    return mesh_shape, None, placements, coord_of


def _reproduces(layout: Layout, coord_of: dict, sharding: Any, shape: tuple[int, ...]) -> bool:
    if any(s == 0 for s in shape):
        return True  # nothing is stored
    for dev, idx in sharding.devices_indices_map(shape).items():
        coord = coord_of.get(dev.id)
        if coord is None:
            return False
        boxes = list(layout.local_boxes(coord))
        if len(boxes) != 1 or boxes[0][0] != _box(idx, shape):
            return False
    return True


def _plan_leaf(key: str, leaf: Any, procs: _Processes, split_elems: Callable[[dtypes.DType], int | None]) -> _Plan:
    if isinstance(leaf, io.BytesIO):
        kind, host = "bytesio", np.frombuffer(leaf.getvalue(), np.uint8)
    elif isinstance(leaf, (bytes, bytearray, memoryview)):
        kind, host = "bytes", np.frombuffer(bytes(leaf), np.uint8)
    elif isinstance(leaf, (np.ndarray, np.generic)):
        if np.asarray(leaf).dtype.hasobject:
            raise UnsupportedValueError(f"array {key!r}: NumPy arrays of Python objects cannot be "
                                        "stored without pickle")
        kind, host = "ndarray", np.asarray(leaf)
    else:
        kind, host = "tensor", None
    try:
        row = dtypes.by_numpy(leaf.dtype if host is None else host.dtype)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"array {key!r}: {e}") from None
    shape = tuple(int(s) for s in leaf.shape) if host is None else host.shape
    sharding = leaf.sharding if host is None else None
    distributed = (sharding is not None and len(sharding.device_set) > 1
                   and (procs.size == 1 or not leaf.is_fully_addressable))
    if not distributed:
        # One copy per process, taken to be equal (as torch plain tensors): chunks are
        # spread over the processes (replica writers), each written from the local copy.
        layout = Layout(shape, (procs.size,), (Replicate(),), key=key, replica_split_min_elems=split_elems(row))
        coord = (procs.rank,)
        chunks = _chunk_writes(layout, coord, layout.save_plan(coord)[0])
        parts = [(functools.partial(_to_host, leaf if host is None else host), chunks)] if chunks else []
        return _Plan(key, kind, row, layout, None, parts, layout.metadata_writer() == coord)
    found = None
    if isinstance(sharding, jax.sharding.NamedSharding):
        found = _named_mesh(sharding)
    for attempt in (found, "grid"):
        if attempt == "grid":
            attempt = _grid_mesh(sharding, shape)
        if attempt is None:
            continue
        mesh_shape, names, placements, coord_of = attempt
        layout = Layout(shape, mesh_shape, placements, key=key, replica_split_min_elems=split_elems(row))
        if _reproduces(layout, coord_of, sharding, shape):
            break
    else:
        raise UnsupportedPlacementError(f"array {key!r}: sharding {sharding} holds boxes that no mesh of "
                                        "Shard/Replicate placements describes; reshard it first")
    device_type = next(iter(sharding.device_set)).platform
    parts = []
    mine = set()
    for shard in leaf.addressable_shards:
        coord = coord_of[shard.device.id]
        mine.add(coord)
        plan_writes, sends = layout.save_plan(coord)
        if sends or any(src != coord for w in plan_writes for src, _ in w.sources):
            raise UnsupportedPlacementError(f"array {key!r}: chunks straddle devices' shards")  # pragma: no cover
        if plan_writes:
            parts.append((functools.partial(_to_host, shard.data), _chunk_writes(layout, coord, plan_writes)))
    return _Plan(key, "dtensor", row, layout, (mesh_shape, names, device_type), parts,
                 layout.metadata_writer() in mine)


def _plan_leaves(pytree: dict, procs: _Processes, split_elems: Callable[[dtypes.DType], int | None]
                 ) -> list[_Plan]:
    """This process's plan of every array leaf, in key order."""
    plans = [_plan_leaf(ztree.key_of(kp), leaf, procs, split_elems)
             for kp, leaf in ztree.flatten(pytree, _is_array_leaf)
             if _is_array_leaf(leaf) or isinstance(leaf, (bytes, bytearray, memoryview))]
    return sorted(plans, key=lambda p: p.key)


def _split_elems(replica_split_bytes: int | None, row: dtypes.DType) -> int | None:
    """Elements of a replicated cell from which it is split among replicas (None: never)."""
    return None if replica_split_bytes is None else max(replica_split_bytes // row.numpy.itemsize, 1)


def _chunk_writes(layout: Layout, coord: tuple[int, ...], writes: list) -> tuple[engine.ChunkWrite, ...]:
    """The engine's records of the chunks written from the shard at ``coord``."""
    return tuple(engine.ChunkWrite(w.index, w.box, local=layout.to_local(coord, w.box)) for w in writes)


def _to_host(data: Any, out: engine.ChunkWriter) -> np.ndarray:
    """A shard's (or a process-local leaf's) data on the host, when its chunks are written."""
    return np.asarray(data)


def _doc(p: _Plan, save_id: str, compression: dict | None, inner_chunk_bytes: int) -> dict:
    if p.mesh is not None:
        mesh_shape, names, device_type = p.mesh
        attrs = fmt.array_attrs(kind=p.kind, save_id=save_id, dtype=p.dtype, mesh_shape=mesh_shape,
                                mesh_dim_names=names, placements=p.layout.placements, device_type=device_type)
    else:
        attrs = fmt.array_attrs(kind=p.kind, save_id=save_id, dtype=p.dtype)
    leaf_name = p.key.rsplit("/", 1)[-1]
    return fmt.array_metadata(
        shape=p.layout.shape, dtype=p.dtype, chunk_shape=p.layout.chunk_shape, attrs=attrs,
        dimension_names=[f"{leaf_name}.{d}" for d in range(len(p.layout.shape))],
        compression=compression, inner_chunk_bytes=inner_chunk_bytes)


def save(pytree: dict, path: Any, *, overwrite: bool = False, metadata: dict | None = None,
         compression: str | dict | None = None, inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES,
         replica_split_bytes: int | None = 64 << 20, storage: StorageOptions | None = None,
         max_inflight_bytes: int = 256 << 20) -> dict:
    """Save a pytree of (sharded) ``jax.Array`` s in zarrckpt's format; see the module
    docstring for how leaves are stored. Every process of a multi-process job calls it.

    ``pytree``: a dict of nested dicts, lists and tuples (named tuples are stored as
    tuples) whose leaves are ``jax.Array``, NumPy arrays and scalars, ``bytes``,
    ``io.BytesIO``, and JSON-able values. Options as :func:`zarrckpt.save`:
    ``overwrite``, ``metadata`` (a JSON object recorded in the root, e.g. the step),
    ``compression``, ``inner_chunk_bytes``, ``replica_split_bytes``, ``storage``.

    The chunks of each array follow its sharding: every distinct shard is one chunk (or
    several, for a replicated shard of at least ``replica_split_bytes``), written once,
    by one device's process (spec Appendix C.4 picks which replica). On a local file
    system the checkpoint is written next to ``path`` and moved into place at the
    commit (spec §7.3); an existing checkpoint stays readable until then.
    Returns this process's report (bytes written, seconds per phase).
    """
    procs = _Processes()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if not isinstance(pytree, dict):
        raise UnsupportedValueError(f"zarrckpt.jax.save takes a dict (nested dicts, lists and tuples), "
                                    f"not {type(pytree).__name__}")
    location = open_storage(path, storage)
    compression_codec = fmt.compression_codec(compression)
    error: BaseException | None = None
    tree: dict = {}
    plans: list[_Plan] = []
    fingerprint = ""
    try:
        if metadata is not None:
            fmt.check_metadata(metadata)
        tree = ztree.encode_tree(pytree, _is_array_leaf)
        plans = _plan_leaves(pytree, procs, functools.partial(_split_elems, replica_split_bytes))
        fingerprint = hashlib.sha256(json.dumps(
            [tree, [_doc(p, "0" * 30, compression_codec, inner_chunk_bytes) for p in plans],
             location.identity(),
             overwrite, metadata], sort_keys=True, default=str).encode()).hexdigest()
    except BaseException as e:  # noqa: BLE001 - every process learns of it
        error = e
    # C0: planned everywhere, the same everywhere; process 0's save id and time
    procs.agree(error, f"planning the save to {location.url!r}", SaveFailedError, fingerprint)
    save_id, created = engine.new_identity(procs)
    docs = {p.key: _doc(p, save_id, compression_codec, inner_chunk_bytes) for p in plans}
    timings["plan"] = time.perf_counter() - t0
    root = functools.partial(fmt.root_metadata, save_id=save_id, world_size=procs.size, created=created,
                             writer=fmt.writer_versions({"jax": jax.__version__}))

    t0 = time.perf_counter()  # process 0 claims the location and creates this save's directory; C1
    target = engine.begin(procs, location, save_id, overwrite, root(state="pending"), fmt.group_paths(docs))
    timings["prepare"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        written = 0
        crcs: dict = {}  # spec §6.6: this process's unit CRC-32Cs (a 1.3 root where they can be gathered)
        try:
            written = engine.write_arrays(
                _commit.save_store(location, save_id), {p.key: docs[p.key] for p in plans if p.writes_metadata},
                [engine.ArrayWrite(p.key, docs[p.key], chunks, host) for p in plans for host, chunks in p.parts],
                max_inflight_bytes, crcs)
        except BaseException as e:  # noqa: BLE001 - reported to every process at C2
            error = e
        timings["write"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.finish(procs, location.url, target, error,
                      functools.partial(root, state="committed", tree=tree, array_docs=docs,
                                        **({"metadata": metadata} if metadata is not None else {})), crcs=crcs)
        timings["commit"] = time.perf_counter() - t0
    except BaseException:
        engine.abandon(procs, target)
        raise
    return {"path": location.url, "process": procs.rank, "save_id": save_id, "arrays": len(plans),
            "bytes_written": written, "seconds": {**timings, "total": sum(timings.values())}}
