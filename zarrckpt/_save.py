"""A save, phase by phase (spec §6 describes the commit rule these implement).

Phases and collectives, in order (``g`` is the process group; C = collective)::

    every rank                                 rank 0
    ----------                                 ------
    plan()     resolve Stateful, encode the tree, lay out each array (local, no I/O)
    C0  agree()   one all-reduce: did planning succeed everywhere, and is the
                  (tree, array metadata) digest the same on every rank?  If not
                  the same (e.g. pipeline stages hold different keys), rank 0
                  gathers and merges the trees (slow path, once).
               prepare(): refuse or clear the directory, write the
               pending root zarr.json, group and array zarr.json
    C1  all_true  directory ready
    stage()    device -> host copies of the local shards
    exchange() point-to-point boundary pieces (only nested uneven layouts)
    write()    every rank writes the chunks it owns, fsynced, waits
    C2  all_true  all data durable
               commit(): root zarr.json rewritten with state "committed"
    C3  all_true  commit durable; every rank returns

``async_save`` runs stage/exchange in the caller's thread and write/commit in
a background thread whose C2/C3 go over a separate gloo group.
"""

from __future__ import annotations

import json
import logging
import platform
import threading
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
from .layout import Layout, Replicate
from .storage import Storage, StorageOptions
from .storage._tensorstore import translate_error

log = logging.getLogger("zarrckpt")

__all__ = ["SaveOptions", "SaveJob", "is_array_leaf", "resolve_stateful"]


@dataclass(frozen=True)
class SaveOptions:
    """Options of :func:`zarrckpt.save` (keyword ``**options``).

    compression: None (default), ``"zstd"``, ``"gzip"`` or ``{"name": "zstd", "level": 3}``.
    inner_chunk_bytes: target size of the inner chunks that resharded loads read.
    replica_split_bytes: a replicated cell at least this big is split into chunks
        written by different replicas (None: one writer per cell).
    storage: TensorStore concurrency settings.
    """

    compression: str | dict | None = None
    inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES
    replica_split_bytes: int | None = 64 << 20
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
    source: Any  # tensor / ndarray holding this rank's local data
    metadata: dict[str, Any]
    host: np.ndarray | None = None  # staged local data
    chunks: list = field(default_factory=list)  # [(box, np.ndarray)] ready to write


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
        self.save_id = fmt.new_save_id()
        self.created = fmt.utc_now()
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
        self.items = items
        self._timed("plan", t0)

    def _item(self, key: str, leaf: Any) -> Item:
        g = self.g
        plain_rank_of = (lambda c: c[0]) if g.pg is None else (
            lambda c, pg=g.pg: torch.distributed.get_global_rank(pg, c[0]))
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
        return Item(key, kind, dt, layout, (g.rank,), plain_rank_of, source,
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
        ok, same = self.g.check(error is None, payload)
        if not ok:
            self._fail(error, "planning the save")
        self.all_docs = {it.key: it.metadata for it in self.items}
        if not same:
            gathered = self.g.gather_to_root((self.tree, self.all_docs))
            if gathered is not None:
                self.tree = _merge_trees([t for t, _ in gathered])
                for _, docs in reversed(gathered):
                    self.all_docs.update(docs)
        self._timed("plan", t0)

    def _fail(self, error: BaseException | None, what: str) -> None:
        """Slow path after a failed all_true: tell every rank who failed and why."""
        msgs = self.g.all_gather(None if error is None else f"{type(error).__name__}: {error}")
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
            st.write_json("zarr.json", self._root("pending")).result()  # un-commit first
            st.clear()
        st.make_dir()
        st.write_json("zarr.json", self._root("pending")).result()
        futures = []
        groups = set()
        for key, doc in self.all_docs.items():
            parts = key.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
            doc = json.loads(json.dumps(doc))
            doc["attributes"][fmt.ATTR]["save_id"] = self.save_id
            futures.append(st.write_json(f"{key}/zarr.json", doc))
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

    def stage(self) -> None:
        """Copy this rank's local shards to host memory (numpy views of CPU tensors)."""
        t0 = time.perf_counter()
        for it in self.items:
            if it.coord is None or it.source is None:
                continue
            src = it.source
            if isinstance(src, torch.Tensor):
                if src.device.type != "cpu":
                    src = src.detach().to("cpu")
                it.host = dtypes.to_numpy(src.detach())
            else:
                it.host = src
        self._timed("stage", t0)

    def exchange(self) -> None:
        """Send boundary pieces to the writers of chunks that straddle shards; build the
        list of (box, data) each rank writes."""
        t0 = time.perf_counter()
        sends, recvs, assemble = [], [], []
        for it in self.items:
            if it.coord is None:
                continue
            writes, pieces_out = it.layout.save_plan(it.coord)
            for s in pieces_out:
                local = it.layout.to_local(it.coord, s.box)
                piece = np.ascontiguousarray(it.host[_slices(local)])
                sends.append((it.rank_of(s.dst), dtypes.from_numpy(piece, it.dtype)))
            for w in writes:
                if len(w.sources) == 1 and w.sources[0][0] == it.coord:
                    local = it.layout.to_local(it.coord, w.box)
                    it.chunks.append((w.box, it.host[_slices(local)]))
                    continue
                buf = np.empty([b - a for a, b in w.box], dtype=it.dtype.numpy)
                for src, box in w.sources:
                    dst_view = buf[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, w.box))]
                    if src == it.coord:
                        dst_view[...] = it.host[_slices(it.layout.to_local(it.coord, box))]
                    else:
                        tmp = np.empty(dst_view.shape, dtype=it.dtype.numpy)
                        recvs.append((it.rank_of(src), dtypes.from_numpy(tmp, it.dtype)))
                        assemble.append((dst_view, tmp))
                it.chunks.append((w.box, buf))
        self.g.exchange(_as_bytes(sends), _as_bytes(recvs))
        for dst_view, tmp in assemble:
            dst_view[...] = tmp
        self._timed("exchange", t0)

    def write(self) -> None:
        """Write every chunk this rank owns and wait until it is durable. C2."""
        t0 = time.perf_counter()
        error = None
        try:
            futures = []
            for it in self.items:
                if not it.chunks:
                    continue
                arr = self.storage.open_for_write(it.key, it.metadata).result()
                from .storage import Array

                a = Array(arr, it.key)
                for box, data in it.chunks:
                    futures.append((it.key, a.write(box, data, stable=True)))
                    self.bytes_written += data.nbytes
            for key, f in futures:
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001
                    raise translate_error(e, key) from e
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            error = e
        for it in self.items:
            it.chunks.clear()
        self._timed("write", t0)
        if not self.g.all_true(error is None):
            self._fail(error, "writing chunks")

    def commit(self) -> None:
        """Rank 0 makes the checkpoint visible with one small write. C3."""
        t0 = time.perf_counter()
        error = None
        if self.g.rank == 0:
            try:
                self.storage.write_json("zarr.json", self._root("committed")).result()
            except BaseException as e:  # noqa: BLE001
                error = e
        if not self.g.all_true(error is None):
            self._fail(error, "committing")
        self._timed("commit", t0)

    def report(self) -> dict[str, Any]:
        return {
            "path": self.storage.url,
            "rank": self.g.rank,
            "arrays": len(self.items),
            "bytes_written": self.bytes_written,
            "seconds": dict(self.timings),
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
        index = {json.dumps(k): pair for pair in a["dict"] for k in [pair[0]]}
        for k, node in b["dict"]:
            mine = index.get(json.dumps(k))
            if mine is None:
                a["dict"].append([k, node])
            else:
                _merge_into(mine[1], node)


def run_save(job: SaveJob) -> dict[str, Any]:
    error = None
    try:
        job.plan()
    except BaseException as e:  # noqa: BLE001 - C0 tells everyone
        error = e
        job.tree, job.items = {}, []
    job.agree(error)
    job.prepare()
    job.stage()
    job.exchange()
    job.write()
    job.commit()
    report = job.report()
    log.info("zarrckpt save %s: %s", report["path"], report)
    return report


_ = threading  # async_save builds on these phases
