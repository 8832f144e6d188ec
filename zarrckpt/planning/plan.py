"""What a save writes, as frozen records: one :class:`ArrayPlan` per array of this rank.

Planning is local (no collectives, no I/O): each leaf is checked and laid out
(``layout.py``), and the chunks this rank writes and the boundary pieces it sends
are computed. Later steps never modify a plan; they derive new ones
(:func:`with_save_id`, :func:`assign_packs`, :func:`restrict_to_holders`).
Executing a plan (copying, exchanging) is ``api/save.py``'s job; writing it, the save
engine's (``engine/save.py``).
"""

from __future__ import annotations

import io
import json
import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from ..distributed import group as zdist
from ..format import dtypes, documents as fmt, tree as ztree
from .state import checked_dtype, checked_tensor, is_array_leaf, is_stateful, resolve_stateful
from ..errors import UnsupportedPlacementError, UnsupportedValueError
from ..format.layout import ChunkWrite, Layout, Replicate, Send, Shard

__all__ = ["ArrayPlan", "PACK_ALIGN", "PackMember", "PlanOptions", "assign_packs", "drop_mesh_replicas", "leaf_order", "local_data", "local_view",
           "pack_bytes", "plan_state", "resolve_reusing", "restrict_to_holders", "reusable_plans", "with_save_id",
           "with_source"]

PACK_ALIGN = 8
PLAIN_KINDS = ("tensor", "ndarray", "bytes", "bytesio")


@dataclass(frozen=True)
class PlanOptions:
    """The save options that decide what lands on storage; every rank must agree on them."""

    compression: str | dict | None
    inner_chunk_bytes: int
    replica_split_bytes: int | None
    pack_bytes: int
    chunk_target_bytes: int | None = None  # group whole shards into chunks of at least this


@dataclass(frozen=True)
class PackMember:
    """A small plain leaf stored at ``offset`` of a pack array."""

    key: str
    offset: int
    nbytes: int
    source: Any  # host tensor/ndarray, or a device tensor copied when the pack is built


@dataclass(frozen=True)
class ArrayPlan:
    """One array of the save from this rank's point of view."""

    key: str
    kind: str  # tensor | dtensor | sharded_tensor | ndarray | bytes | bytesio | pack
    dtype: dtypes.DType
    layout: Layout
    coord: tuple[int, ...] | None  # this rank's mesh coordinate (None: holds no part)
    mesh_ranks: tuple[int, ...]  # global rank of every mesh coordinate, row-major
    metadata: dict[str, Any]  # the array's zarr.json document
    writes: tuple[ChunkWrite, ...]  # chunks this rank writes
    sends: tuple[Send, ...]  # pieces this rank sends to other chunks' writers
    source: Any  # local data (tensor or ndarray); None for packs and non-holders
    members: tuple[PackMember, ...] = ()  # kind "pack" only

    def rank_of(self, coord: tuple[int, ...]) -> int:
        return self.mesh_ranks[int(np.ravel_multi_index(coord, self.layout.mesh_shape))]

    @property
    def nbytes(self) -> int:
        return math.prod(self.layout.shape) * self.dtype.numpy.itemsize

    @property
    def on_host(self) -> bool:
        return not isinstance(self.source, torch.Tensor) or self.source.device.type == "cpu"

    def host_view(self) -> np.ndarray:
        """Zero-copy NumPy view of host-resident local data."""
        if isinstance(self.source, torch.Tensor):
            return dtypes.to_numpy(self.source)
        return self.source


def _split_elems(options: PlanOptions, dt: dtypes.DType) -> int | None:
    split = options.replica_split_bytes
    return None if split is None else max(split // dt.numpy.itemsize, 1)


def _group_elems(options: PlanOptions, dt: dtypes.DType) -> int | None:
    target = options.chunk_target_bytes
    return None if target is None else max(target // dt.numpy.itemsize, 1)


def _metadata(key: str, layout: Layout, dt: dtypes.DType, attrs: dict, options: PlanOptions) -> dict:
    leaf_name = key.rsplit("/", 1)[-1]
    return fmt.array_metadata(
        shape=layout.shape, dtype=dt, chunk_shape=layout.chunk_shape, attrs=attrs,
        dimension_names=[f"{leaf_name}.{d}" for d in range(len(layout.shape))],
        compression=fmt.compression_codec(options.compression),
        inner_chunk_bytes=options.inner_chunk_bytes,
        cell_shape=layout.cell_shape if layout.grouped else None,
    )


def _plan(key, kind, dt, layout, coord, mesh_ranks, attrs, source, options) -> ArrayPlan:
    writes, sends = layout.save_plan(coord) if coord is not None else ((), ())
    return ArrayPlan(key, kind, dt, layout, coord, tuple(mesh_ranks),
                     _metadata(key, layout, dt, attrs, options), tuple(writes), tuple(sends), source)


# Plans of earlier saves, by everything they are computed from (key, shape, dtype, mesh,
# placements, coordinate, options): a training loop saves the same structure every time,
# and planning thousands of leaves afresh would cost ~0.2 ms each in the blocking part of
# an async save. Plans are immutable; a hit only gets the new leaf's data as its source.
# Saves from several threads (a manager's and the caller's) share it: reads and writes
# hold _CACHE_LOCK; a plan is built outside it (two threads may build the same one; the
# first stored wins).
_CACHE: dict[tuple, ArrayPlan] = {}
_CACHE_MAX = 1 << 17
_CACHE_LOCK = threading.Lock()


def _cached(ck: tuple, build: Callable[[], ArrayPlan]) -> ArrayPlan:
    with _CACHE_LOCK:
        hit = _CACHE.get(ck)
    if hit is None:
        built = build()
        with _CACHE_LOCK:
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.clear()
            hit = _CACHE.setdefault(ck, built)
    return hit


def plan_leaf(key: str, leaf: Any, g: zdist.Group, options: PlanOptions, okey: Any = None) -> ArrayPlan:
    """Check one array leaf and lay it out; errors name the key. ``okey``: a hashable form
    of ``options`` (plans are then reused across saves, see ``_CACHE``)."""
    if zdist.is_dtensor(leaf):
        try:
            mesh_shape, names, placements, mesh_t, device_type, coord = zdist.dtensor_info(leaf)
        except UnsupportedPlacementError as e:
            raise UnsupportedPlacementError(f"tensor {key!r}: {e}") from None
        dt = checked_dtype(leaf.dtype, key)
        local = checked_tensor(leaf.to_local(), key) if coord is not None else None
        mesh_ranks = tuple(mesh_t.reshape(-1).tolist())

        def build() -> ArrayPlan:
            layout = Layout(tuple(leaf.shape), mesh_shape, placements, key=key,
                            replica_split_min_elems=_split_elems(options, dt),
                            group_min_elems=_group_elems(options, dt))
            attrs = fmt.array_attrs(kind="dtensor", save_id="", dtype=dt, mesh_shape=mesh_shape,
                                    mesh_dim_names=names, placements=placements, device_type=device_type)
            return _plan(key, "dtensor", dt, layout, coord, mesh_ranks, attrs, None, options)
        ck = ("dtensor", key, tuple(leaf.shape), dt.zarr, tuple(mesh_shape), names and tuple(names),
              tuple(placements), device_type, coord, mesh_ranks, okey)
        plan = _cached(ck, build) if okey is not None else build()
        if local is not None:
            plan.layout.check_local_shape(tuple(local.shape), coord, key)
        return _with(plan, source=local)
    if zdist.is_sharded_tensor(leaf):
        info = zdist.sharded_tensor_info(leaf, key)
        dt = checked_dtype(leaf.dtype, key)
        placements = (Shard(info.dim),) if leaf.dim() else (Replicate(),)
        layout = Layout(tuple(leaf.size()), (len(info.ranks),), placements, key=key,
                        replica_split_min_elems=_split_elems(options, dt),
                        group_min_elems=_group_elems(options, dt))
        local = None
        if info.coord is not None:
            if info.local is None:  # an empty shard: torch keeps none
                local = torch.empty(layout.local_shape(info.coord), dtype=leaf.dtype)
            else:
                local = checked_tensor(info.local, key)
            layout.check_local_shape(tuple(local.shape), info.coord, key)
        attrs = fmt.array_attrs(kind="sharded_tensor", save_id="", dtype=dt, mesh_shape=(len(info.ranks),),
                                placements=placements, device_type=info.device_type)
        return _plan(key, "sharded_tensor", dt, layout, info.coord, info.ranks, attrs, local, options)
    if isinstance(leaf, torch.Tensor):
        kind, source = "tensor", checked_tensor(leaf, key)
        dt = checked_dtype(source.dtype, key)
    elif isinstance(leaf, np.ndarray):
        if leaf.dtype.hasobject:
            raise UnsupportedValueError(f"array {key!r}: NumPy arrays of Python objects cannot be "
                                        "stored without pickle")
        kind, source, dt = "ndarray", leaf, checked_dtype(leaf.dtype, key)
    elif isinstance(leaf, io.BytesIO):
        kind, dt, source = "bytesio", dtypes.by_zarr("uint8"), np.frombuffer(leaf.getvalue(), np.uint8)
    else:
        kind, dt, source = "bytes", dtypes.by_zarr("uint8"), np.frombuffer(bytes(leaf), np.uint8)

    def build_plain() -> ArrayPlan:
        layout = Layout(tuple(source.shape), (g.size,), (Replicate(),), key=key,
                        replica_split_min_elems=_split_elems(options, dt))
        attrs = fmt.array_attrs(kind=kind, save_id="", dtype=dt)
        return _plan(key, kind, dt, layout, (g.rank,), g.global_ranks(), attrs, None, options)
    ck = (kind, key, tuple(source.shape), dt.zarr, g.rank, tuple(g.global_ranks()), okey)
    plan = _cached(ck, build_plain) if okey is not None else build_plain()
    return _with(plan, source=source)


def plan_state(resolved: dict, g: zdist.Group, options: PlanOptions, *, defer_tree: bool = False
               ) -> tuple[dict | None, list[ArrayPlan], Any]:
    """(the tree document, this rank's array plans sorted by key, a token) of a resolved
    state dict. The token is the same object for saves whose plans are the same (None:
    plans not reusable), so callers may keep what they derive from plans by it.
    Every leaf is checked here, before anything touches storage.

    A training loop saves the same structure every time: when every leaf has the
    signature it had in the previous save over the same group with the same options
    (key path, type, shape, dtype, device, mesh and placements), that save's plans are
    reused whole and only get the new leaves as sources; O(leaves) tuple compares instead
    of O(leaves) planning. ``defer_tree``: on such a hit, return None for the tree (the
    caller encodes it later, e.g. off the critical path; ``resolved`` is its own copy of
    the containers, :func:`resolve_stateful`, and the leaves are unchanged types)."""
    okey = json.dumps(asdict(options), sort_keys=True, default=repr)
    hit, leaves, sig, sources = _lookup(resolved, g, okey)
    if hit is not None:
        plans, order = hit[1], hit[2]
        if sources is None:
            sources = [leaf for _, leaf in leaves if is_array_leaf(leaf)]
        out = [_with(plans[i], source=None if plans[i].coord is None else _fast_source(sources[j]))
               for i, j in order]
        return (None if defer_tree else ztree.encode_tree(resolved, is_array_leaf)), out, hit
    tree = ztree.encode_tree(resolved, is_array_leaf)
    arrays = [(j, plan_leaf(ztree.key_of(path), leaf, g, options, okey))
              for j, (path, leaf) in enumerate((pl for pl in leaves if is_array_leaf(pl[1])))]
    arrays.sort(key=lambda jp: jp[1].key)
    plans = [p for _, p in arrays]
    entry = None
    if sig is not None:
        entry = (sig, tuple(_with(p, source=None) for p in plans), tuple((i, j) for i, (j, _) in enumerate(arrays)),
                 _template(resolved))
        with _CACHE_LOCK:
            if len(_STATES) >= 16:
                _STATES.clear()
            _STATES[(tuple(g.global_ranks()), g.rank, okey)] = entry
    return tree, plans, entry


def _lookup(resolved: dict, g: zdist.Group, okey: str) -> tuple[Any, list | None, tuple | None, list | None]:
    """(the cached entry whose signature this state has, or None; the leaves; the signature;
    the array leaves in key-path order when the entry's template matched). The template
    walk (:func:`_match`) is the fast path: one pass over the state, comparing as it goes,
    no key paths built; on any difference the signature is computed and compared as before
    (a mesh equal to the cached one but another object, for instance)."""
    with _CACHE_LOCK:
        hit = _STATES.get((tuple(g.global_ranks()), g.rank, okey))
    if hit is not None:
        arrays: list = []
        if _match(resolved, hit[3], arrays):
            return hit, None, hit[0], arrays
    leaves = list(ztree.flatten(resolved, is_array_leaf))
    sig = _signature(leaves)
    return (hit if sig is not None and hit is not None and hit[0] == sig else None), leaves, sig, None


def reusable_plans(resolved: dict, g: zdist.Group, options: PlanOptions) -> tuple[Any, list] | None:
    """(token, array leaves in key-path order) when ``plan_state`` would reuse the plans of
    an earlier save (the same token); None otherwise. For callers that keep what they
    derived from those plans (async staging) and need only this save's leaves."""
    hit, leaves, _, arrays = _lookup(resolved, g, json.dumps(asdict(options), sort_keys=True, default=repr))
    if hit is None:
        return None
    return hit, arrays if arrays is not None else [leaf for _, leaf in leaves if is_array_leaf(leaf)]


def resolve_reusing(state: Any, g: zdist.Group, options: PlanOptions,
                    feed: Any = None) -> tuple[Any, tuple[Any, list] | None]:
    """``(resolve_stateful(state), reusable_plans(that, g, options))`` in one walk over the
    state where the previous save's template matches (the blocked part of later async
    saves: one pass instead of two over thousands of leaves).

    ``feed``: called with the array leaves found so far whenever the walk has found
    ``feed.at`` of them, as long as the state matches the template of ``feed.token``
    (async staging starts its copies while the rest is walked)."""
    okey = json.dumps(asdict(options), sort_keys=True, default=repr)
    with _CACHE_LOCK:
        hit = _STATES.get((tuple(g.global_ranks()), g.rank, okey))
    if hit is not None:
        arrays: list = []
        ok = [True]
        resolved = _resolve_match(state, hit[3], arrays, ok, 0,
                                  feed if feed is not None and feed.token is hit else None)
        if ok[0]:
            return resolved, (hit, arrays)
    else:
        resolved = resolve_stateful(state)
    return resolved, reusable_plans(resolved, g, options)


def _resolve_match(obj: Any, t: tuple | None, arrays: list, ok: list, depth: int, feed: Any = None) -> Any:
    """resolve_stateful's copy of ``obj`` while matching it against template ``t`` (see
    _match); ``ok[0]`` turns False at the first difference (the copy is still made).
    ``feed``: see resolve_reusing (called between the items of a dict)."""
    if not ok[0] or depth > ztree.MAX_DEPTH:
        ok[0] = False
        return resolve_stateful(obj, depth)
    if is_stateful(obj):
        return _resolve_match(obj.state_dict(), t, arrays, ok, depth, feed)
    kind = t[0]
    if type(obj) is dict or (type(obj) is tuple or type(obj) is list) or isinstance(obj, (dict, list)):
        if kind == 5:  # an empty container leaf
            ok[0] = type(obj) is t[1] and not obj
            return resolve_stateful(obj, depth)
        if isinstance(obj, dict):
            if kind != 0 or tuple(obj) != t[1]:
                ok[0] = False
                return resolve_stateful(obj, depth)
            copy = {}
            for (k, v), c in zip(obj.items(), t[2]):
                copy[k] = v if c[0] == 3 and type(v) is c[1] and _tensor_matches(v, c, arrays, ok) \
                    else _resolve_match(v, c, arrays, ok, depth + 1, feed)
                if feed is not None and len(arrays) >= feed.at and ok[0]:
                    feed(arrays)
            return copy
        if kind != 1 or len(obj) != t[1]:
            ok[0] = False
            return resolve_stateful(obj, depth)
        out = [v if c[0] == 3 and type(v) is c[1] and _tensor_matches(v, c, arrays, ok)
               else _resolve_match(v, c, arrays, ok, depth + 1, feed) for v, c in zip(obj, t[2])]
        return out if isinstance(obj, list) else tuple(out)
    if not _match(obj, t, arrays):  # leaves, and tuple subclasses (kept as they are)
        ok[0] = False
    return obj


_STRIDED = torch.strided


def _tensor_matches(v: torch.Tensor, c: tuple, arrays: list, ok: list) -> bool:
    """The plain-tensor leaf of _resolve_match, inlined at its container (``type(v)`` is
    ``c[1]`` already, so not a Stateful); True: ``v`` is its own resolved copy."""
    if (v.is_nested or v.shape != c[2] or v.dtype is not c[3] or v.device != c[4] or v.layout is not _STRIDED
            or v.is_neg() or (c[3].is_complex and v.is_conj())):  # dtypes, layouts: singletons
        ok[0] = False
    elif ok[0]:
        arrays.append(v)
    return True


def leaf_order(token: Any) -> dict[int, int]:
    """Plan index (in key order) -> array-leaf index (in key-path order), of a token."""
    return dict(token[2])


def local_data(leaf: Any) -> Any:
    """The local data of an array leaf whose plan is reused (see ``reusable_plans``)."""
    return _fast_source(leaf)


def local_view(leaf: Any) -> Any:
    """``local_data`` without ``detach`` (a microsecond per leaf), for callers that only
    copy from it under ``torch.no_grad()``."""
    if type(leaf) is torch.Tensor:
        return leaf
    if isinstance(leaf, torch.Tensor):
        return leaf._local_tensor if hasattr(leaf, "_local_tensor") else leaf
    return _fast_source(leaf)


# The previous save's plans per (group, rank, options): (signature, plans without sources,
# (plan index, array-leaf index) pairs, template). See plan_state.
#
# Assumes: a plan is a function of what the signature records per leaf (key path, type,
# shape, dtype, device, and for DTensors the mesh object, placements and the local tensor's
# device) and of the group's ranks, this rank and the options. Invalidated: a state whose
# signature (plan_state) or template (resolve_reusing: one walk, same compares) differs in
# any of those, another group or options (another key), more than 16 keys (cleared). The
# entry is also the token that api/save.py's staging record is kept by: a new entry is new
# staging. Tests: test_async.py (test_later_saves_reuse_the_plans_and_follow_every_change),
# test_staging_reuse.py, tests/gpu (a leaf moved from the CPU to the GPU between saves).
_STATES: dict[tuple, tuple] = {}


def _signature(leaves: list[tuple[tuple, Any]]) -> tuple | None:
    """What plan_state's plans depend on, per leaf; None when a leaf's plan cannot be
    reused (ShardedTensors, conjugate/negative views, tensors on the meta device)."""
    dtensor = zdist.dtensor_type()
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if dtensor is not None and isinstance(leaf, dtensor):
                out.append((path, 1, leaf.shape, leaf.dtype, leaf.device_mesh, leaf.placements,  # the mesh itself: held, never confused by id
                            leaf._local_tensor.device))  # async staging decided per device how to copy
                continue
            if type(leaf) is not torch.Tensor and not isinstance(leaf, torch.nn.Parameter):
                return None  # a ShardedTensor, or a tensor subclass: plan it afresh
            if (leaf.is_nested or leaf.is_conj() or leaf.is_neg() or leaf.layout != torch.strided
                    or leaf.device.type == "meta"):  # nested: no .shape; planned afresh, refused by name
                return None
            out.append((path, 2, leaf.shape, leaf.dtype, leaf.device))
        elif isinstance(leaf, np.ndarray):
            out.append((path, 3, leaf.shape, leaf.dtype))
        elif isinstance(leaf, (bytes, bytearray, memoryview)):
            out.append((path, 4, type(leaf), memoryview(leaf).nbytes))
        elif isinstance(leaf, io.BytesIO):
            out.append((path, 5, leaf.getbuffer().nbytes))
        else:
            out.append((path, type(leaf)))
    return tuple(out)


def _template(obj: Any, root: bool = True) -> tuple:
    """The structure of a resolved state as :func:`_match` compares it: what ``flatten``
    walks (dicts, non-empty lists and tuples) and, per leaf, what ``_signature`` records.
    Only built for states whose signature is not None (every leaf's plan reusable)."""
    if isinstance(obj, dict) and (obj or root):
        return (0, tuple(obj), tuple(_template(v, False) for v in obj.values()))
    if isinstance(obj, (list, tuple)) and obj:
        return (1, len(obj), tuple(_template(v, False) for v in obj))
    dtensor = zdist.dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        # the local tensor's device too: the staging a later async save reuses decided per
        # leaf how it is copied (gathered on its GPU, or copied straight) from it
        return (2, obj.shape, obj.dtype, obj.device_mesh, tuple(obj.placements), obj._local_tensor.device)
    if isinstance(obj, torch.Tensor):
        return (3, type(obj), obj.shape, obj.dtype, obj.device)
    if isinstance(obj, np.ndarray):
        return (4, type(obj), obj.shape, obj.dtype)
    if isinstance(obj, (dict, list, tuple)):
        return (5, type(obj))  # an empty container: a leaf of its own
    if isinstance(obj, io.BytesIO):
        return (6, type(obj), obj.getbuffer().nbytes)
    if is_array_leaf(obj):
        return (6, type(obj), memoryview(obj).nbytes)  # bytes, bytearray, memoryview
    return (7, type(obj))


def _match(obj: Any, t: tuple, arrays: list) -> bool:
    """Whether ``obj`` has the structure and leaf signatures of template ``t``; appends
    its array leaves' local data (key-path order) to ``arrays``. A few attribute compares
    per leaf, no key paths: the blocked part of a later async save of thousands of leaves."""
    kind = t[0]
    if kind == 0:
        if not isinstance(obj, dict) or tuple(obj) != t[1]:
            return False
        for v, c in zip(obj.values(), t[2]):
            if not _match(v, c, arrays):
                return False
        return True
    if kind == 1:
        if not isinstance(obj, (list, tuple)) or len(obj) != t[1]:
            return False
        for v, c in zip(obj, t[2]):
            if not _match(v, c, arrays):
                return False
        return True
    if kind == 3:
        if (type(obj) is not t[1] or obj.is_nested or obj.shape != t[2] or obj.dtype != t[3] or obj.device != t[4]
                or obj.layout != torch.strided or obj.is_conj() or obj.is_neg()):
            return False
        arrays.append(obj)
        return True
    if kind == 2:
        dtensor = zdist.dtensor_type()
        if (dtensor is None or type(obj) is not dtensor or obj._spec.mesh is not t[3]
                or obj._spec.placements != t[4] or obj.shape != t[1] or obj.dtype is not t[2]
                or obj._local_tensor.device != t[5]):
            return False
        arrays.append(obj._local_tensor)  # what local_data takes of it
        return True
    if kind == 4:
        if type(obj) is not t[1] or obj.shape != t[2] or obj.dtype != t[3]:
            return False
        arrays.append(obj)
        return True
    if kind == 5:
        return type(obj) is t[1] and not obj
    if kind == 6:
        if type(obj) is not t[1] or (obj.getbuffer() if t[1] is io.BytesIO else memoryview(obj)).nbytes != t[2]:
            return False
        arrays.append(obj)
        return True
    return type(obj) is t[1]


def _fast_source(leaf: Any) -> Any:
    """A reused plan's source: what plan_leaf makes of a leaf that passed its checks."""
    if isinstance(leaf, torch.Tensor):
        local = leaf._local_tensor if hasattr(leaf, "_local_tensor") else leaf
        return local.detach()
    if isinstance(leaf, np.ndarray):
        return leaf
    if isinstance(leaf, io.BytesIO):
        return np.frombuffer(leaf.getvalue(), np.uint8)
    return np.frombuffer(bytes(leaf), np.uint8)


def _with(plan: ArrayPlan, **changes: Any) -> ArrayPlan:
    """``dataclasses.replace`` without re-running ``__init__`` (a save derives two plans per
    leaf: thousands of leaves made replace's cost show in the blocked time of async saves)."""
    new = object.__new__(ArrayPlan)
    new.__dict__.update(plan.__dict__)
    new.__dict__.update(changes)
    return new


def with_source(plan: ArrayPlan, source: Any) -> ArrayPlan:
    """``plan`` with other local data (e.g. its staged host copy)."""
    return _with(plan, source=source)


def with_save_id(plan: ArrayPlan, save_id: str) -> ArrayPlan:
    attrs = dict(plan.metadata["attributes"][fmt.ATTR], save_id=save_id)
    metadata = dict(plan.metadata, attributes={**plan.metadata["attributes"], fmt.ATTR: attrs})
    return _with(plan, metadata=metadata)


def drop_mesh_replicas(plans: list[ArrayPlan], g: zdist.Group, same: bool) -> list[ArrayPlan]:
    """A DTensor whose mesh spans fewer ranks than the group can be held whole by several
    disjoint meshes: FSDP over ``mesh["dp"]`` of a dp x tp world leaves a parameter that TP
    does not split (a norm, a bias) as the same DTensor on every tp index. Like a plain
    leaf, it is stored once: by the mesh holding the lowest global rank among those that
    hold the key; on every other mesh this rank's plan holds no part (coordinate None, no
    writes, no sends, no source). Two meshes both writing the array raced on its files.

    ``same`` (every rank planned the same keys and documents, so every rank finds the
    same candidate keys): one all-reduce of one int per candidate; else one all-gather.
    Collective; no collective when no DTensor's mesh is smaller than the group."""
    def candidate(p: ArrayPlan) -> bool:
        return p.kind == "dtensor" and math.prod(p.layout.mesh_shape) < g.size

    if not g.active:
        return plans
    mine = {p.key: min(p.mesh_ranks) for p in plans if candidate(p) and p.coord is not None}
    if same:
        keys = sorted({p.key for p in plans if candidate(p)})
        if not keys:
            return plans
        lowest = dict(zip(keys, g.minimum([mine.get(k, 2**62) for k in keys])))
    else:
        lowest = {}
        for view in g.all_gather(mine):
            for k, r in view.items():
                lowest[k] = min(r, lowest.get(k, r))
    return [_with(p, coord=None, writes=(), sends=(), source=None)
            if p.key in mine and mine[p.key] != lowest[p.key] else p for p in plans]


def restrict_to_holders(plan: ArrayPlan, holders: list[int], g: zdist.Group,
                        options: PlanOptions) -> ArrayPlan:
    """A plain array replicated over the group ranks that hold it, not the whole group
    (pipeline stages hold different plain leaves)."""
    layout = Layout(plan.layout.shape, (len(holders),), (Replicate(),), key=plan.key,
                    replica_split_min_elems=_split_elems(options, plan.dtype))
    coord = (holders.index(g.rank),)
    writes, sends = layout.save_plan(coord)
    metadata = _metadata(plan.key, layout, plan.dtype, plan.metadata["attributes"][fmt.ATTR], options)
    return replace(plan, layout=layout, coord=coord, mesh_ranks=tuple(g.global_rank(h) for h in holders),
                   metadata=metadata, writes=tuple(writes), sends=tuple(sends))


def assign_packs(plans: list[ArrayPlan], g: zdist.Group, options: PlanOptions, save_id: str
                 ) -> tuple[list[ArrayPlan], dict[str, dict]]:
    """Replace small plain leaves by slices of per-rank pack arrays (spec §6.5).

    Thousands of tiny arrays cost two files each (``zarr.json`` + chunk), and file
    creation dominates such saves; packed, they cost two files per rank. Every rank
    holds every plain leaf (the caller checked), so every rank computes the same
    assignment: greedy by size over the ranks, in key order, balanced and
    deterministic. Returns the new plans and the tree nodes of the packed leaves.
    No data is copied here: a pack's bytes are gathered when it is written.
    """
    small = [p for p in plans if p.kind in PLAIN_KINDS and p.nbytes <= options.pack_bytes]
    if len(small) < 2:
        return plans, {}
    loads = [0] * g.size
    groups: list[list[ArrayPlan]] = [[] for _ in range(g.size)]
    for p in small:
        r = min(range(g.size), key=lambda i: (loads[i], i))
        groups[r].append(p)
        loads[r] += -(-p.nbytes // PACK_ALIGN) * PACK_ALIGN
    nodes: dict[str, dict] = {}
    packs = []
    row = dtypes.by_zarr("uint8")
    for r, group in enumerate(groups):
        if not group:
            continue
        pack_key = f"{fmt.PACKS}/{r}"
        offset = 0
        members = []
        for p in group:
            nodes[p.key] = {"packed": {
                "pack": pack_key, "offset": offset, "nbytes": p.nbytes, "kind": p.kind,
                "data_type": p.dtype.zarr, "shape": list(p.layout.shape)}}
            members.append(PackMember(p.key, offset, p.nbytes, p.source))
            offset += -(-p.nbytes // PACK_ALIGN) * PACK_ALIGN
        layout = Layout((loads[r],), (1,), (Replicate(),), key=pack_key)
        attrs = fmt.array_attrs(kind="pack", save_id=save_id, dtype=row)
        mine = r == g.rank
        packs.append(replace(
            _plan(pack_key, "pack", row, layout, (0,) if mine else None, (g.global_rank(r),), attrs,
                  None, options),
            members=tuple(members) if mine else ()))
    packed = {p.key for p in small}
    return [p for p in plans if p.key not in packed] + packs, nodes


def pack_bytes(plan: ArrayPlan) -> np.ndarray:
    """The bytes of a pack array, gathered from its members (device data copied here)."""
    buf = np.zeros(plan.layout.shape[0], dtype=np.uint8)
    for m in plan.members:
        if not m.nbytes:
            continue
        src = m.source
        if isinstance(src, torch.Tensor):
            src = dtypes.to_numpy(src.cpu() if src.device.type != "cpu" else src)
        buf[m.offset:m.offset + m.nbytes] = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    return buf
