"""A save, phase by phase (spec §7 describes the commit rule these implement).

Phases and collectives, in order (``g`` is the process group; C = collective)::

    every rank                                 rank 0
    ----------                                 ------
    plan()     resolve Stateful, encode the tree, lay out each array and compute
               this rank's chunk writes (local, no I/O)
    C0  agree()   one all-reduce: did planning succeed everywhere, is the
                  (tree, array metadata) digest the same on every rank, and
                  rank 0's save id and time.  Same everywhere: small plain
                  leaves are packed (every rank computes the same packs).  Not
                  the same (e.g. pipeline stages hold different keys): rank 0
                  gathers the trees (slow path), and plain arrays are written
                  by the ranks that hold them.
               prepare(): refuse or un-commit and clear the
               directory, write the pending root and group zarr.json
    C1  all_true  directory ready
    exchange() point-to-point boundary pieces (only nested uneven layouts)
    write()    every rank writes its arrays' zarr.json (metadata writer = writer
               of chunk 0) and the chunks it owns, staging device data through a
               bounded pinned buffer; then one syncfs
    C2  all_true  all data durable
               commit(): root zarr.json rewritten with state "committed"
    C3  all_true  commit durable; every rank returns

``async_save`` (``_async.py``) runs plan/C0/prepare/C1/exchange and the staging of
every local shard in the caller's thread, then write/C2/commit/C3 in a background
thread whose collectives go over a separate gloo group.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import dist as zdist
from . import dtypes, format as fmt, tree as ztree
from .errors import (
    CheckpointExistsError,
    SaveFailedError,
    UnsupportedPlacementError,
    UnsupportedValueError,
    ZarrckptError,
)
from .layout import ChunkWrite, Layout, Replicate, Send
from ._io import InFlight
from .staging import Arena, staged_nbytes, sync_devices
from .storage import Array, Storage, StorageOptions

log = logging.getLogger("zarrckpt")

__all__ = ["SaveOptions", "SaveJob", "is_array_leaf", "resolve_stateful"]


@dataclass(frozen=True)
class SaveOptions:
    """Options of :func:`zarrckpt.save` (keyword ``**options``).

    compression: None (default), ``"zstd"``, ``"gzip"`` or ``{"name": "zstd", "level": 3}``.
    inner_chunk_bytes: target size of the inner chunks that resharded loads read.
    replica_split_bytes: a replicated cell at least this big is split into chunks
        written by different replicas (None: one writer per cell).
    max_staging_bytes: host memory a sync save of device tensors may use for
        device->host staging (it streams through a buffer of this size).
    max_inflight_bytes: bytes of chunk writes in flight at once (TensorStore holds an
        encoded shard in memory while writing it).
    pack_bytes: plain (non-DTensor) leaves up to this size are packed into one array
        per rank instead of one array each (0 disables packing).
    storage: TensorStore concurrency settings.
    """

    compression: str | dict | None = None
    inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES
    replica_split_bytes: int | None = 64 << 20
    max_staging_bytes: int = 1 << 30
    pack_bytes: int = 64 << 10
    max_inflight_bytes: int = 256 << 20
    storage: StorageOptions = field(default_factory=StorageOptions)

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> SaveOptions:
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown save option(s): {', '.join(sorted(unknown))}")
        return cls(**options)


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (dict, list, tuple, torch.Tensor))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def resolve_stateful(obj: Any) -> Any:
    """A copy of the nested containers with every Stateful replaced by its state_dict()."""
    if is_stateful(obj):
        return resolve_stateful(obj.state_dict())
    if isinstance(obj, dict):
        return {k: resolve_stateful(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve_stateful(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(resolve_stateful(v) for v in obj)
    return obj


def is_array_leaf(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, np.ndarray, bytes, bytearray, memoryview))


def _writer_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    try:
        ts_version = version("tensorstore")
    except PackageNotFoundError:  # pragma: no cover
        ts_version = "unknown"
    return {
        "zarrckpt": __version__,
        "torch": torch.__version__,
        "tensorstore": ts_version,
        "python": platform.python_version(),
    }


@dataclass
class Item:
    """One array of the save, from this rank's point of view."""

    key: str
    kind: str
    dtype: dtypes.DType
    layout: Layout
    coord: tuple[int, ...] | None
    rank_of: Callable[[tuple[int, ...]], int]  # coordinate -> global rank
    source: Any  # tensor / ndarray holding this rank's local data (None: not on this rank)
    metadata: dict[str, Any]
    writes: list[ChunkWrite] = field(default_factory=list)  # chunks this rank writes
    sends: list[Send] = field(default_factory=list)  # pieces this rank sends to writers
    assembled: dict = field(default_factory=dict)  # chunk index -> buffer built by exchange()
    host: np.ndarray | None = None  # host copy/view of the local data

    @property
    def on_host(self) -> bool:
        return not isinstance(self.source, torch.Tensor) or self.source.device.type == "cpu"

    def host_view(self) -> np.ndarray:
        """Zero-copy NumPy view of host-resident local data."""
        if isinstance(self.source, torch.Tensor):
            src = self.source.detach() if self.source.requires_grad else self.source
            return dtypes.to_numpy(src)
        return self.source


class SaveJob:
    def __init__(self, state_dict: dict, path: Any, process_group: Any, overwrite: bool,
                 options: SaveOptions) -> None:
        if not isinstance(state_dict, dict):
            raise UnsupportedValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        self.g = zdist.group(process_group)
        self.path = path
        self.overwrite = overwrite
        self.options = options
        self.storage = Storage(path, options.storage)
        self.timings: dict[str, float] = {}
        self.bytes_written = 0
        self.bytes_staged = 0
        # rank 0's values reach every rank through C0 (agree())
        self.save_id = fmt.new_save_id()
        self.created_us = int(time.time() * 1e6)
        self._state = state_dict

    # ---- phases -------------------------------------------------------------

    def _timed(self, name: str, t0: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    def plan(self) -> None:
        t0 = time.perf_counter()
        resolved = resolve_stateful(self._state)
        self.tree = ztree.encode_tree(resolved, is_array_leaf)
        items = []
        for path, leaf in ztree.flatten(resolved, is_array_leaf):
            if is_array_leaf(leaf):
                items.append(self._item(ztree.key_of(path), leaf))
        items.sort(key=lambda it: it.key)
        for it in items:
            if it.coord is not None:
                it.writes, it.sends = it.layout.save_plan(it.coord)
        self.items = items
        self._timed("plan", t0)

    def _item(self, key: str, leaf: Any) -> Item:
        g = self.g
        split = self.options.replica_split_bytes
        if zdist.is_dtensor(leaf):
            try:
                mesh_shape, names, placements, mesh_t, device_type, coord = zdist.dtensor_info(leaf)
            except UnsupportedPlacementError as e:
                raise UnsupportedPlacementError(f"tensor {key!r}: {e}") from None
            dt = dtypes.by_torch(leaf.dtype)
            layout = Layout(tuple(leaf.shape), mesh_shape, placements, key=key,
                            replica_split_min_elems=None if split is None else split // dt.numpy.itemsize)
            local = leaf.to_local() if coord is not None else None
            if local is not None and tuple(local.shape) != layout.local_shape(coord):
                raise ZarrckptError(
                    f"tensor {key!r}: DTensor local shape {tuple(local.shape)} at mesh coordinate "
                    f"{coord} differs from {layout.local_shape(coord)} computed from placements "
                    f"{leaf.placements}; please report this layout"
                )
            attrs = fmt.array_attrs(kind="dtensor", save_id="", dtype=dt, mesh_shape=mesh_shape,
                                    mesh_dim_names=names, placements=placements, device_type=device_type)
            return Item(key, "dtensor", dt, layout, coord, lambda c, m=mesh_t: int(m[c]), local,
                        self._metadata(key, layout, dt, attrs))
        if isinstance(leaf, torch.Tensor):
            kind, dt, source = "tensor", dtypes.by_torch(leaf.dtype), leaf.detach()
        elif isinstance(leaf, np.ndarray):
            dt = dtypes.by_numpy(leaf.dtype)
            kind, source = "ndarray", leaf
        else:
            kind, dt, source = "bytes", dtypes.by_zarr("uint8"), np.frombuffer(bytes(leaf), np.uint8)
        layout = Layout(tuple(source.shape), (g.size,), (Replicate(),), key=key,
                        replica_split_min_elems=None if split is None else split // dt.numpy.itemsize)
        attrs = fmt.array_attrs(kind=kind, save_id="", dtype=dt)
        return Item(key, kind, dt, layout, (g.rank,), lambda c: self._global(c[0]), source,
                    self._metadata(key, layout, dt, attrs))

    def _metadata(self, key: str, layout: Layout, dt: dtypes.DType, attrs: dict) -> dict:
        leaf_name = key.rsplit("/", 1)[-1]
        return fmt.array_metadata(
            shape=layout.shape, dtype=dt, chunk_shape=layout.chunk_shape, attrs=attrs,
            dimension_names=[f"{leaf_name}.{d}" for d in range(len(layout.shape))],
            compression=fmt.compression_codec(self.options.compression),
            inner_chunk_bytes=self.options.inner_chunk_bytes,
        )

    def agree(self, error: BaseException | None) -> None:
        """C0: planning succeeded everywhere; merge trees if ranks differ."""
        t0 = time.perf_counter()
        payload = b"" if error else json.dumps(
            [self.tree, {it.key: it.metadata for it in self.items}], sort_keys=True).encode()
        ids = [int(self.save_id[:15], 16), int(self.save_id[15:30], 16), self.created_us]
        ok, same, ids = self.g.check(error is None, payload, ids)
        self.save_id = f"{ids[0]:015x}{ids[1]:015x}"
        self.created = fmt.utc_from_us(ids[2])
        for it in self.items:
            it.metadata["attributes"][fmt.ATTR]["save_id"] = self.save_id
        if not ok:
            self._fail(error, "planning the save")
        self._gathered = None
        if same and self.options.pack_bytes > 0:
            self._pack_small()
        self.all_docs = {it.key: it.metadata for it in self.items}
        if not same:
            # Slow path (e.g. pipeline stages hold different keys): rank 0 merges the
            # trees in prepare(); plain arrays are written by the ranks that hold them.
            self._gathered = self.g.gather_to_root((self.tree, self.all_docs))
            held = self.g.all_gather(sorted(it.key for it in self.items if it.kind != "dtensor"))
            for it in self.items:
                if it.kind != "dtensor":
                    self._restrict_to_holders(it, [r for r, keys in enumerate(held) if it.key in keys])
        self._timed("plan", t0)

    def _pack_small(self) -> None:
        """Replace small plain leaves by slices of per-rank pack arrays (spec §6.5).

        Thousands of tiny arrays cost two files each (``zarr.json`` + chunk), and file
        creation dominates such saves; packed, they cost two files per rank. Every rank
        holds every plain leaf, so every rank computes the same assignment: greedy by
        size over the ranks, in key order, so packs are balanced and deterministic.
        """
        small = [it for it in self.items
                 if it.kind in ("tensor", "ndarray", "bytes")
                 and _nbytes(it) <= self.options.pack_bytes]
        if len(small) < 2:
            return
        loads = [0] * self.g.size
        packs: list[list[Item]] = [[] for _ in range(self.g.size)]
        for it in small:
            r = min(range(self.g.size), key=lambda i: (loads[i], i))
            packs[r].append(it)
            loads[r] += -(-_nbytes(it) // PACK_ALIGN) * PACK_ALIGN
        nodes: dict[str, dict] = {}
        new_items = []
        for r, members in enumerate(packs):
            if not members:
                continue
            pack_key = f"{fmt.PACKS}/{r}"
            buf = np.zeros(loads[r], dtype=np.uint8) if r == self.g.rank else None
            offset = 0
            for it in members:
                n = _nbytes(it)
                nodes[it.key] = {"packed": {
                    "pack": pack_key, "offset": offset, "nbytes": n, "kind": it.kind,
                    "data_type": it.dtype.zarr, "shape": list(it.layout.shape)}}
                if buf is not None and n:
                    src = it.host_view() if it.on_host else dtypes.to_numpy(it.source.detach().cpu())
                    buf[offset:offset + n] = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
                offset += -(-n // PACK_ALIGN) * PACK_ALIGN
            row = dtypes.by_zarr("uint8")
            layout = Layout((loads[r],), (1,), (Replicate(),), key=pack_key)
            attrs = fmt.array_attrs(kind="pack", save_id=self.save_id, dtype=row)
            item = Item(pack_key, "pack", row, layout, (0,) if r == self.g.rank else None,
                        lambda c, r=r: self._global(r), buf, self._metadata(pack_key, layout, row, attrs))
            if item.coord is not None:
                item.writes, item.sends = layout.save_plan(item.coord)
            new_items.append(item)
        packed = {it.key for it in small}
        self.items = [it for it in self.items if it.key not in packed] + new_items
        self.tree = _replace_arrays(self.tree, nodes)

    def _global(self, group_rank: int) -> int:
        g = self.g
        return group_rank if g.pg is None else torch.distributed.get_global_rank(g.pg, group_rank)

    def _restrict_to_holders(self, it: Item, holders: list[int]) -> None:
        """Replicate a plain array over the group ranks that hold it, not the whole group."""
        g = self.g
        split = self.options.replica_split_bytes
        it.layout = Layout(it.layout.shape, (len(holders),), (Replicate(),), key=it.key,
                           replica_split_min_elems=None if split is None else split // it.dtype.numpy.itemsize)
        it.coord = (holders.index(g.rank),)
        it.rank_of = lambda c, hs=holders: self._global(hs[c[0]])
        it.writes, it.sends = it.layout.save_plan(it.coord)

    def _fail(self, error: BaseException | None, what: str, g: zdist.Group | None = None) -> None:
        """Slow path after a failed all_true: tell every rank who failed and why."""
        msgs = (g or self.g).all_gather(None if error is None else f"{type(error).__name__}: {error}")
        bad = {r: m for r, m in enumerate(msgs) if m is not None}
        if error is not None:
            raise error
        raise SaveFailedError(
            f"save to {self.storage.url!r} failed while {what} on rank(s) {sorted(bad)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items()))
            + "; nothing was committed"
        )

    def prepare(self) -> None:
        """Rank 0: make the directory a pending zarrckpt checkpoint with all metadata. C1."""
        t0 = time.perf_counter()
        error = None
        if self.g.rank == 0:
            try:
                self._prepare_rank0()
            except BaseException as e:  # noqa: BLE001 - reported to every rank below
                error = e
        if not self.g.all_true(error is None):
            self._fail(error, "preparing the checkpoint directory")
        self._timed("prepare", t0)

    def _prepare_rank0(self) -> None:
        if self._gathered is not None:
            self.tree = _merge_trees([t for t, _ in self._gathered])
            for _, docs in reversed(self._gathered):
                self.all_docs.update(docs)
        st = self.storage
        root = st.read_json("zarr.json") if st.exists() else None
        attrs = ((root or {}).get("attributes") or {}).get(fmt.ATTR)
        if root is not None and isinstance(attrs, dict):
            if attrs.get("state") == "committed" and not self.overwrite:
                raise CheckpointExistsError(
                    f"a complete checkpoint exists at {st.url!r} (saved {attrs.get('created')}); "
                    "pass overwrite=True to replace it"
                )
        elif not st.is_empty():
            raise CheckpointExistsError(
                f"{st.url!r} exists, is not empty and is not a zarrckpt checkpoint; refusing to "
                "write into it (choose an empty or new path)"
            )
        # From here on the directory is ours: a committed or interrupted zarrckpt save.
        if root is not None:
            st.write_json("zarr.json", self._root("pending"), atomic=True).result()  # un-commit first
            st.flush()  # ... durably, before anything of the old checkpoint is deleted
            st.clear()
        st.make_dir()
        st.write_json("zarr.json", self._root("pending"), atomic=True).result()
        # Array zarr.json files are written by each array's metadata writer in write(),
        # spreading thousands of small writes over the ranks; rank 0 writes the groups.
        futures = []
        groups = set()
        for key in self.all_docs:
            parts = key.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        for grp in groups:
            futures.append(st.write_json(f"{grp}/zarr.json", fmt.group_metadata()))
        for f in futures:
            f.result()

    def _root(self, state: str) -> dict:
        return fmt.root_metadata(
            state=state, save_id=self.save_id, world_size=self.g.size, created=self.created,
            writer=_writer_versions(), tree=self.tree if state == "committed" else None,
            num_arrays=len(self.all_docs),
        )

    def exchange(self) -> None:
        """Build chunks that straddle shards: send own pieces to their writers, receive
        the pieces of chunks this rank writes (nested uneven layouts only)."""
        t0 = time.perf_counter()
        sends, recvs, fills = [], [], []
        for it in self.items:
            if it.coord is None:
                continue
            for s in it.sends:
                local = it.layout.to_local(it.coord, s.box)
                piece = it.source[_slices(local)].detach().contiguous()
                sends.append((it.rank_of(s.dst), piece))
            for w in it.writes:
                if len(w.sources) == 1 and w.sources[0][0] == it.coord:
                    continue  # the common case: a chunk inside this rank's own shard
                buf = np.empty([b - a for a, b in w.box], dtype=it.dtype.numpy)
                for src, box in w.sources:
                    view = buf[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, w.box))]
                    if src == it.coord:
                        piece = it.source[_slices(it.layout.to_local(it.coord, box))].detach()
                        view[...] = dtypes.to_numpy(piece.cpu().contiguous())
                    else:
                        tmp = torch.empty(view.shape, dtype=dtypes.torch_dtype(it.dtype),
                                          device=it.source.device if isinstance(it.source, torch.Tensor) else "cpu")
                        recvs.append((it.rank_of(src), tmp))
                        fills.append((view, tmp))
                it.assembled[w.index] = buf
        if sends or recvs:
            self.g.exchange(_as_bytes(sends), _as_bytes(recvs))
        for view, tmp in fills:
            view[...] = dtypes.to_numpy(tmp.cpu())
        self._timed("exchange", t0)

    def stage_all(self, arena: Arena) -> None:
        """Async saves: copy every local shard this rank writes into the reused arena."""
        t0 = time.perf_counter()
        todo = [it for it in self.items if _needs_data(it)]
        tensors = [it.source for it in todo if isinstance(it.source, torch.Tensor)]
        self.bytes_staged = sum(staged_nbytes(t) for t in tensors)
        arena.reserve(self.bytes_staged)
        for it in todo:
            if isinstance(it.source, torch.Tensor):
                _, it.host = arena.stage(it.source)
            else:
                it.host = np.array(it.source, copy=True)
        sync_devices(tensors)
        self._timed("stage", t0)

    def write(self, *, streaming: bool) -> BaseException | None:
        """Write every chunk this rank owns and wait until it is durable.

        ``streaming`` (sync saves): host-resident data is written straight from the
        caller's tensors; device data goes through a bounded arena, batch by batch.
        Returns the error (reported to all ranks by the caller).
        """
        t0 = time.perf_counter()
        error = None
        try:
            self._write(streaming)
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            error = e
        for it in self.items:
            it.assembled.clear()
            it.host = None
        self._timed("write", t0)
        return error

    def _write(self, streaming: bool) -> None:
        pending = InFlight(self.options.max_inflight_bytes)
        for it in self.items:
            if it.coord is not None and it.layout.metadata_writer() == it.coord:
                pending.add(it.key, self.storage.write_json(f"{it.key}/zarr.json", it.metadata), 0)
        todo = [it for it in self.items if it.writes]
        # Open every array that needs TensorStore at once (no I/O: metadata is assumed).
        opened = [(it, None if _all_small(it) else self.storage.open_for_write(it.key, it.metadata))
                  for it in todo]
        arena = None
        device = [it.source for it in todo if _needs_data(it) and not it.on_host]
        if streaming and device:
            arena = Arena(min(self.options.max_staging_bytes, sum(map(staged_nbytes, device))))
        for it, fut in opened:
            arr = None
            host = it.host
            if host is None and _needs_data(it):
                if it.on_host:
                    host = it.host_view()
                else:
                    host = self._stream_stage(it, arena, pending)
            small = _small_chunks(it)
            for w in it.writes:
                data = it.assembled.get(w.index)
                if data is None:
                    data = host[_slices(it.layout.to_local(it.coord, w.box))]
                if small and data.shape == it.layout.chunk_shape:
                    pending.add(it.key, self.storage.write_plain_chunk(it.key, w.index, data), data.nbytes)
                else:
                    if arr is None:
                        arr = Array((fut or self.storage.open_for_write(it.key, it.metadata)).result(), it.key)
                    pending.add(it.key, arr.write(w.box, data, stable=True), data.nbytes)
                self.bytes_written += data.nbytes
        pending.wait()
        del arena  # pinned memory is not kept past the save
        self.storage.flush()  # one syncfs for everything this rank wrote

    def _stream_stage(self, it: Item, arena: Arena, pending: InFlight) -> np.ndarray:
        """Device data through a bounded arena: when full, wait for the writes using it."""
        t0 = time.perf_counter()
        need = staged_nbytes(it.source)
        if need > arena.capacity:  # one tensor bigger than the bound: a buffer of its own
            host = dtypes.to_numpy(it.source.detach().cpu())
        else:
            if not arena.fits(need):
                pending.wait()
                arena.reset()
            _, host = arena.stage(it.source)
            sync_devices([it.source])
        self._timed("stage", t0)
        return host

    def finish(self, error: BaseException | None, g: zdist.Group) -> None:
        """C2 (all data durable) then commit and C3, over group ``g``."""
        if not g.all_true(error is None):
            self._fail(error, "writing chunks", g)
        self.commit(g)

    def commit(self, g: zdist.Group) -> None:
        """Rank 0 makes the checkpoint visible with one small write. C3."""
        t0 = time.perf_counter()
        error = None
        if g.rank == 0:
            try:
                self.storage.write_json("zarr.json", self._root("committed"), atomic=True).result()
                self.storage.flush()
            except BaseException as e:  # noqa: BLE001
                error = e
        if not g.all_true(error is None):
            self._fail(error, "committing", g)
        self._timed("commit", t0)

    def report(self) -> dict[str, Any]:
        return {
            "path": self.storage.url,
            "rank": self.g.rank,
            "arrays": len(self.items),
            "bytes_written": self.bytes_written,
            "bytes_staged": self.bytes_staged,
            "seconds": {**self.timings, "total": sum(self.timings.values())},
        }


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _as_bytes(pairs):
    """Exchange raw bytes so every dtype (bool, fp8 ...) travels through every backend."""
    out = []
    for peer, t in pairs:
        out.append((peer, t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)))
    return out


def _merge_trees(trees: list[dict]) -> dict:
    """Union of dict nodes; for a leaf present on several ranks the lowest rank wins."""
    base = json.loads(json.dumps(trees[0]))
    for t in trees[1:]:
        _merge_into(base, t)
    return base


def _merge_into(a: dict, b: dict) -> None:
    if "dict" in a and "dict" in b:
        index = {ztree.escape(pair[0]): pair for pair in a["dict"]}
        for k, node in b["dict"]:
            mine = index.get(ztree.escape(k))
            if mine is None:
                a["dict"].append([k, node])
                index[ztree.escape(k)] = a["dict"][-1]
            elif mine[0] != k or type(mine[0]) is not type(k):
                raise UnsupportedValueError(
                    f"ranks disagree on a key: {mine[0]!r} on one rank and {k!r} on another "
                    f"map to the same stored name {ztree.escape(k)!r}")
            else:
                _merge_into(mine[1], node)


SMALL_CHUNK_BYTES = 1 << 20
PACK_ALIGN = 8


def _nbytes(it: Item) -> int:
    return int(np.prod(it.layout.shape, dtype=np.int64)) * it.dtype.numpy.itemsize


def _replace_arrays(node: dict, nodes: dict[str, dict]) -> dict:
    """The tree with ``{"array": key}`` leaves swapped for ``nodes[key]``."""
    ((kind, body),) = node.items()
    if kind == "array":
        return nodes.get(body, node)
    if kind == "dict":
        return {"dict": [[k, _replace_arrays(v, nodes)] for k, v in body]}
    if kind in ("list", "tuple"):
        return {kind: [_replace_arrays(v, nodes) for v in body]}
    return node
_PLAIN = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def _plain_codecs(metadata: dict) -> bool:
    return metadata["codecs"] == _PLAIN


def _small_chunks(it: Item) -> bool:
    """Whole chunks of this array take the small-chunk fast path (edge chunks don't)."""
    return _plain_codecs(it.metadata) and (
        np.prod(it.layout.chunk_shape) * it.dtype.numpy.itemsize <= SMALL_CHUNK_BYTES)


def _all_small(it: Item) -> bool:
    """Every chunk of this rank goes through the small-chunk fast path."""
    return _small_chunks(it) and all(
        tuple(b - a for a, b in w.box) == it.layout.chunk_shape for w in it.writes)


def _needs_data(it: Item) -> bool:
    """Does this rank write a chunk straight from its own local data?"""
    return any(w.index not in it.assembled for w in it.writes)


def plan_and_prepare(job: SaveJob) -> None:
    """The foreground part common to save and async_save: plan, C0, prepare, C1, exchange."""
    error = None
    try:
        job.plan()
    except BaseException as e:  # noqa: BLE001 - C0 tells everyone
        error = e
        job.tree, job.items = {}, []
    job.agree(error)
    job.prepare()
    job.exchange()


def run_save(job: SaveJob) -> dict[str, Any]:
    plan_and_prepare(job)
    job.finish(job.write(streaming=True), job.g)
    report = job.report()
    log.info("zarrckpt save %s: %s", report["path"], report)
    return report
