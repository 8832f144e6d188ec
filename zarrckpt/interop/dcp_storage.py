"""PyTorch DCP storage layer: ``dcp.save``/``dcp.load`` read and write zarrckpt checkpoints.

::

    import torch.distributed.checkpoint as dcp
    from zarrckpt.dcp_storage import ZarrckptStorageReader, ZarrckptStorageWriter

    dcp.save(state, storage_writer=ZarrckptStorageWriter("ckpt/step_100"))
    dcp.load(state, storage_reader=ZarrckptStorageReader("ckpt/step_100"))  # any layout

Reading (:class:`ZarrckptStorageReader`)
----------------------------------------
``read_metadata`` opens the checkpoint (root digest, consolidated metadata) and flattens
its tree exactly as DCP's ``flatten_state_dict`` flattens a target state dict (torch 2.13
``traverse_state_dict``: mappings are entered; a list is entered only if it holds a tensor,
a mapping or such a list; a tuple is one value), with array leaves of kinds ``tensor``,
``dtensor`` and ``sharded_tensor`` counting as tensors. Each such leaf becomes a
``TensorStorageMetadata`` with **one chunk covering the whole array** (DCP's planner only
intersects boxes with it; the zarr chunk grid is the reader's business), every other leaf
a ``BytesStorageMetadata``; the FQN is the path joined with ``"."`` (``optim.state.
layer.weight.exp_avg`` for the zarrckpt key ``optim/state/layer.weight/exp_avg``), and
``planner_data`` maps each FQN to its path, as DCP's own metadata does. ``read_data``
reads each ``ReadItem``'s box with :meth:`Checkpoint.read_into` straight into the target
(CPU tensors of the stored dtype; others through a temporary and ``copy_``), so only the
chunks / inner chunks a rank's boxes touch are fetched; the root is checked once more
after the reads (``Checkpoint.reading``). A non-tensor leaf is handed to DCP as the
``torch.save`` stream of its value (``bytes`` leaves as ``bytes``, ``bytesio`` as
``io.BytesIO``, ``ndarray`` as NumPy, tensors inside a tuple as tensors), as DCP's
``load_bytes`` expects.

Writing (:class:`ZarrckptStorageWriter`)
----------------------------------------
The zarrckpt save engine's steps (spec §7), spread over DCP's calls:

* ``prepare_local_plan`` (every rank): refuses dtypes the format lacks.
* ``prepare_global_plan`` (coordinator; sees every rank's boxes): rebuilds every key from
  ``planner_data`` (the nested path: the same keys ``zarrckpt.save`` stores for the same
  state dict), chooses each array's chunk grid, assigns every chunk to exactly one rank,
  checks the keys form a tree, then claims the location (``engine.begin``: pending root,
  this save's own directory beside it on file systems). Each rank's ``SavePlan`` carries
  the save id, the coordinator's codec options and its arrays in ``storage_data``.
  Anything refused here is refused before anything is written.
* ``write_data`` (every rank): array documents, then chunks, through the engine's
  :class:`ChunkWriter` (small chunks by the direct path, others through TensorStore, at
  most ``max_inflight_bytes`` in flight); waits for every write, then one ``syncfs``.
  A non-tensor item arrives as a ``torch.save`` stream; it is decoded with
  ``torch.load(weights_only=True)`` (``io.BytesIO`` allowed, as :mod:`.dcp` does) and
  stored as a zarrckpt value: JSON-able values (non-finite floats included) in the tree,
  ``bytes`` as a ``bytes`` array, ``io.BytesIO`` as ``bytesio``, tensors inside a value
  as ``tensor`` arrays; anything else (a pickled object) fails the save. Never pickle on
  storage.
* ``finish`` (coordinator, only after every rank's writes succeeded and are durable):
  builds the tree, writes the intermediate groups, and commits a 1.2 root with digests
  and consolidated metadata (``format.documents.root_metadata``, checked by the reader's
  own parser first) through ``engine.commit.publish``.

Decisions:

* **Kind ``tensor``, not ``sharded_tensor``/``dtensor``.** A ``WriteItem`` has no mesh or
  placements. ``dtensor`` needs both; ``sharded_tensor`` (spec §5.6) claims a 1-d mesh
  with one ``shard`` placement, which 2-D layouts (``[Shard(0), Shard(1)]``) and nested
  uneven ones do not have; inventing a layout would record something false. The spec
  says the array is the global tensor whatever its kind and readers need not interpret
  mesh/placements, so every tensor is stored as kind ``tensor`` (readers return a tensor;
  ``zarrckpt.load`` reshards it onto any target like any other array).
* **Chunk grid.** Along each dimension the chunk extent is the gcd of the box boundaries
  (every box offset and end other than 0 and the extent), so every box is a union of
  whole chunks and every chunk lies in exactly one box: one writer per chunk (spec §7.2),
  no exchange between ranks. Even sharding gives one chunk per shard, as
  ``zarrckpt.save``; nested uneven sharding (9 rows on 2x2 ``[Shard(0), Shard(0)]``:
  boxes of 3,2,2,2 rows) gives 1-row chunks. An array whose grid would exceed
  ``max(max_chunks, 16 x its boxes)`` chunks is refused in ``prepare_global_plan`` (use
  :func:`zarrckpt.save`, which exchanges boundary rows instead). Boxes that overlap or
  leave a gap are refused there too. Replicated boxes (the same box on several ranks,
  when the planner did not dedup them) are written by the lowest rank only, as are
  non-tensor items present on several ranks.
* **Failure.** DCP has no abort hook: when a rank fails, ``finish`` is not called and
  nothing is committed; what the save wrote is a ``pending`` claim and (file systems) the
  hidden ``.zarrckpt-<id>.<hex of name>`` directory, both refused by readers. The coordinator's
  writer removes them (``engine.commit.abandon``) at its next save, at :meth:`abort`, when
  it is garbage-collected, or at interpreter exit; a killed process leaves what
  ``zarrckpt clean`` removes.
* **Overwrite** as DCP's ``FileSystemWriter`` (``overwrite=True`` by default): a save to a
  path holding a zarrckpt checkpoint replaces it, through the engine's commit protocol
  (spec §7.3: atomic on file systems; on object stores the old checkpoint is un-committed
  first). A non-empty directory that is not a zarrckpt checkpoint is refused even then.
* **Plan caching** (``DefaultSavePlanner(enable_plan_caching=True)``): on a cached save
  DCP hands each rank its *cached* final plan, whose ``storage_data`` names the earlier
  save's id, and ``prepare_global_plan`` receives only unusable delta plans. That cannot
  be told apart safely, so a cached save is refused in ``prepare_global_plan`` (before
  anything is written); the first save with caching works.
* ``use_collectives=False`` with several ranks is refused (every rank would claim the
  location as its own coordinator).
* Dict keys come back as DCP spells them: strings (an int dict key ``3`` is stored as
  ``"3"``); an int path component is a list index (DCP's traversal). Values that a
  nested dict held (DCP's leaves) are stored where ``zarrckpt.save`` stores them.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import threading
import uuid
import weakref
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    LoadItemType,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..engine import commit as _commit
from ..engine import save as engine
from ..errors import SaveFailedError, UnsupportedValueError, ZarrckptError
from ..format import documents as fmt
from ..format import dtypes as zdt
from .dcp import load_value
from ..format import tree as ztree
from ..readers.checkpoint import Checkpoint
from ..storage import Storage, StorageOptions, open_storage
from ..storage.inflight import wait_all

__all__ = ["ZarrckptStorageReader", "ZarrckptStorageWriter"]

_TENSOR_KINDS = ("tensor", "dtensor", "sharded_tensor")
_CRCS = "zarrckpt-crcs"  # tags the storage_data that carries a rank's chunk CRC-32Cs to finish()
_ONE = engine.OneProcess()
DEFAULT_MAX_CHUNKS = 4096


# ---------------------------------------------------------------------- shared


class _Ref:
    """An array leaf inside a tree skeleton (writer) or a decoded checkpoint tree (reader)."""

    __slots__ = ("key", "kind", "shape", "dtype")

    def __init__(self, key: str, kind: str = "tensor", shape: tuple = (), dtype: str = "") -> None:
        self.key, self.kind, self.shape, self.dtype = key, kind, tuple(shape), dtype

    def __getstate__(self):
        return (self.key, self.kind, self.shape, self.dtype)

    def __setstate__(self, state):
        self.key, self.kind, self.shape, self.dtype = state

    @property
    def is_tensor(self) -> bool:
        return self.kind in _TENSOR_KINDS

    def __repr__(self) -> str:
        return f"_Ref({self.key!r}, {self.kind})"


def dcp_leaves(obj: dict, is_tensor) -> list[tuple[tuple, Any]]:
    """``(path, value)`` of every leaf DCP's ``flatten_state_dict`` makes of ``obj``
    (torch 2.13 ``_traverse.traverse_state_dict``): mappings are entered (keys as ``str``),
    a list only if an entry is a tensor or a mapping/list that is entered, anything else
    (tuples included) is one leaf."""
    out: list[tuple[tuple, Any]] = []

    def terminal(value: Any) -> bool:
        if isinstance(value, dict):
            return False
        if not isinstance(value, list):
            return True
        for entry in value:
            if isinstance(entry, (dict, list)) and not terminal(entry):
                return False
            if is_tensor(entry):
                return False
        return True

    def visit(path: tuple, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif terminal(value):
            out.append((path, value))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(path + (i,), v)

    for key, value in obj.items():
        visit((str(key),), value)
    return out


def _fqn(path: tuple) -> str:
    return ".".join(map(str, path))


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# ---------------------------------------------------------------------- reader


class ZarrckptStorageReader(StorageReader):
    """``dcp.load(state, storage_reader=ZarrckptStorageReader(path))``: load a zarrckpt
    checkpoint through DCP, onto any layout (see the module docstring). ``path``: a path,
    URL or :class:`~zarrckpt.storage.Storage`; ``storage``: :class:`StorageOptions`."""

    def __init__(self, path: Any, storage: StorageOptions | None = None) -> None:
        super().__init__()
        self.path = path
        self.storage = storage
        self.checkpoint_id = path if isinstance(path, (str, os.PathLike)) else None
        self._ck: Checkpoint | None = None
        self._values: dict[str, Any] = {}  # fqn -> decoded value (with _Refs) of a bytes leaf
        self._keys: dict[str, str] = {}  # fqn -> zarrckpt key of a tensor leaf
        self._dtypes: dict[str, zdt.DType] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_id
            self.checkpoint_id = checkpoint_id
        self._ck = None
        self._values, self._keys, self._dtypes = {}, {}, {}

    @property
    def checkpoint(self) -> Checkpoint:
        if self._ck is None:
            self._ck = Checkpoint(self.path, self.storage)
        return self._ck

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        ck = self.checkpoint
        by_packed = {id(node["packed"]): key for _, key, node in ck.info.leaves if "packed" in node}
        infos = ck.array_infos([key for _, key, node in ck.info.leaves if "array" in node])

        def ref(body: Any) -> _Ref:
            if isinstance(body, dict):  # a packed leaf's descriptor
                key = by_packed[id(body)]
                return _Ref(key, body["kind"], tuple(body["shape"]), body["data_type"])
            info = infos[body]
            return _Ref(body, info.kind, info.shape, info.dtype.zarr)

        tree = ztree.decode_tree(ck.info.tree, ref)
        md: dict[str, Any] = {}
        mappings: dict[str, tuple] = {}
        seen: dict[str, tuple] = {}
        for path, value in dcp_leaves(tree, lambda x: isinstance(x, _Ref) and x.is_tensor):
            fqn = _fqn(path)
            if fqn in seen:
                raise ZarrckptError(f"checkpoint {ck.url!r}: the keys {ztree.key_of(seen[fqn])!r} and "
                                    f"{ztree.key_of(path)!r} both flatten to the DCP name {fqn!r}")
            seen[fqn] = path
            mappings[fqn] = path
            if isinstance(value, _Ref) and value.is_tensor:
                row = zdt.by_zarr(value.dtype)
                size = torch.Size(value.shape)
                md[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=zdt.torch_dtype(row)), size=size,
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
                self._keys[fqn] = value.key
                self._dtypes[fqn] = row
            else:
                md[fqn] = BytesStorageMetadata()
                self._values[fqn] = value
        return Metadata(state_dict_metadata=md, planner_data=mappings,
                        storage_meta=StorageMeta(checkpoint_id=str(ck.url), load_id=uuid.uuid4().hex))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._keys and not self._values:
            self.read_metadata()  # a reader handed a metadata it did not read itself

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _materialize(self, value: Any) -> Any:
        ck = self.checkpoint
        if isinstance(value, _Ref):
            if value.kind == "bytes":
                return ck.read(value.key)
            if value.kind == "bytesio":
                return io.BytesIO(ck.read(value.key))
            data = ck.read(value.key)
            if value.kind == "ndarray":
                return data
            return zdt.from_numpy(np.ascontiguousarray(data), zdt.by_zarr(value.dtype)).clone()
        if isinstance(value, dict):
            return {k: self._materialize(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._materialize(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self._materialize(v) for v in value)
        return value

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        ck = self.checkpoint
        with ck.reading():  # the root is checked once more after every read (spec §7.3)
            pending: list[tuple[str, Any]] = []
            copies: list[tuple[Any, torch.Tensor, np.ndarray, zdt.DType]] = []
            direct: list[tuple[Any, torch.Tensor]] = []
            for item in plan.items:
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    if fqn not in self._values:
                        raise ZarrckptError(f"{fqn!r} is not a value of checkpoint {ck.url!r}")
                    buf = io.BytesIO()
                    torch.save(self._materialize(self._values[fqn]), buf)
                    buf.seek(0)
                    planner.load_bytes(item, buf)
                    continue
                key, row = self._keys[fqn], self._dtypes[fqn]
                base = item.storage_index.offset or torch.Size([0] * len(item.lengths))
                box = tuple((int(b) + int(o), int(b) + int(o) + int(n))
                            for b, o, n in zip(base, item.storage_offsets, item.lengths))
                target = planner.resolve_tensor(item).detach()
                if tuple(target.shape) != tuple(int(n) for n in item.lengths):
                    raise ZarrckptError(f"{fqn!r}: target piece of shape {tuple(target.shape)}, read box "
                                        f"{box}")
                if target.device.type == "cpu" and target.dtype == zdt.torch_dtype(row) and not target.is_conj():
                    pending.append((key, ck.read_into(key, box, zdt.to_numpy(target))))
                    direct.append((item, target))
                else:
                    tmp = np.empty([b - a for a, b in box], dtype=row.numpy)
                    pending.append((key, ck.read_into(key, box, tmp)))
                    copies.append((item, target, tmp, row))
            wait_all(pending)
        for item, target in direct:
            planner.commit_tensor(item, target)
        for item, target, tmp, row in copies:
            target.copy_(zdt.from_numpy(tmp, row))
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True when ``checkpoint_id`` holds a zarrckpt root (any state)."""
        try:
            data, _ = open_storage(checkpoint_id).read_bytes("zarr.json")
        except Exception:  # noqa: BLE001 - not ours
            return False
        return fmt.root_attributes(data) is not None


# ---------------------------------------------------------------------- writer


@dataclasses.dataclass(frozen=True)
class _ArraySpec:
    """One tensor array as the coordinator decided it (identical on every rank)."""

    key: str
    shape: tuple[int, ...]
    dtype: str  # zarr name
    chunk: tuple[int, ...]
    doc_writer: int  # the rank that writes its zarr.json


@dataclasses.dataclass(frozen=True)
class _RankData:
    """``SavePlan.storage_data`` of one rank."""

    rank: int  # this plan's index in DCP's group
    save_id: str
    created: str
    codec: dict | None
    inner_chunk_bytes: int
    arrays: dict[str, _ArraySpec]  # fqn -> spec, of the arrays this rank writes to
    paths: dict[str, tuple]  # fqn -> key path of this rank's items
    skip: frozenset  # (fqn, offsets) of items another rank writes


def _array_doc(spec: _ArraySpec, save_id: str, codec: dict | None, inner: int) -> dict:
    row = zdt.by_zarr(spec.dtype)
    leaf = spec.key.rsplit("/", 1)[-1]
    return fmt.array_metadata(shape=spec.shape, dtype=row, chunk_shape=spec.chunk,
                              attrs=fmt.array_attrs(kind="tensor", save_id=save_id, dtype=row),
                              dimension_names=[f"{leaf}.{d}" for d in range(len(spec.shape))],
                              compression=codec, inner_chunk_bytes=inner)


def _value_doc(key: str, data: np.ndarray, kind: str, save_id: str, codec: dict | None, inner: int) -> dict:
    row = zdt.by_numpy(data.dtype)
    leaf = key.rsplit("/", 1)[-1]
    return fmt.array_metadata(shape=data.shape, dtype=row, chunk_shape=tuple(max(s, 1) for s in data.shape),
                              attrs=fmt.array_attrs(kind=kind, save_id=save_id, dtype=row),
                              dimension_names=[f"{leaf}.{d}" for d in range(data.ndim)],
                              compression=codec, inner_chunk_bytes=inner)


def chunk_grid(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, ...]:
    """Per dimension the gcd of every box boundary other than 0 and the extent (the extent
    itself, at least 1, where there is none): every box is a union of whole chunks."""
    chunk = []
    for d, s in enumerate(shape):
        g = 0
        for off, size in boxes:
            for p in (off[d], off[d] + size[d]):
                if 0 < p < s:
                    g = math.gcd(g, p)
        chunk.append(g or max(s, 1))
    return tuple(chunk)


def _chunk_indexes(off: tuple, size: tuple, chunk: tuple) -> list[tuple[int, ...]]:
    ranges = [range(o // c, -(-(o + n) // c)) for o, n, c in zip(off, size, chunk)]
    return [tuple(r[i] for r, i in zip(ranges, idx)) for idx in np.ndindex(*[len(r) for r in ranges])]


def _skeleton_insert(root: dict, path: tuple, leaf: Any, where: str) -> None:
    node = root
    for depth, comp in enumerate(path[:-1]):
        child = node.get(comp)
        if child is None:
            child = node[comp] = {}
        elif not isinstance(child, dict):
            raise UnsupportedValueError(f"{where}: {ztree.key_of(path[:depth + 1])!r} is a leaf and also has "
                                        f"entries below it ({ztree.key_of(path)!r})")
        node = child
    if path[-1] in node:
        raise UnsupportedValueError(f"{where}: key {ztree.key_of(path)!r} is given twice (or is a leaf and "
                                    "a container)")
    node[path[-1]] = leaf


def _containers(node: Any) -> Any:
    """Dict-of-components -> the nested object: a dict whose keys are all ints is a list
    (DCP's int path components are list indexes); gaps are None."""
    if isinstance(node, _Leaf):
        return node.value
    if not isinstance(node, dict):
        return node
    items = {k: _containers(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items):
        seq = [None] * (max(items) + 1)
        for k, v in items.items():
            seq[k] = v
        return seq
    return items


class _Leaf:
    """A leaf in the writer's component tree (so that a leaf dict value is not entered)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _split_value(value: Any, path: tuple, arrays: list) -> Any:
    """``value`` with every bytes / BytesIO / tensor inside replaced by a :class:`_Ref`
    (their data appended to ``arrays`` as (key, kind, ndarray))."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        key = ztree.key_of(path)
        arrays.append((key, "bytes", np.frombuffer(bytes(value), np.uint8)))
        return _Ref(key, "bytes")
    if isinstance(value, io.BytesIO):
        key = ztree.key_of(path)
        arrays.append((key, "bytesio", np.frombuffer(value.getvalue(), np.uint8)))
        return _Ref(key, "bytesio")
    if isinstance(value, torch.Tensor):
        key = ztree.key_of(path)
        t = value.detach()
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            raise UnsupportedValueError(f"{key!r}: a {t.layout} / quantized / nested / meta tensor inside a "
                                        "value cannot be stored")
        zdt.by_torch(t.dtype)
        arrays.append((key, "tensor", np.require(zdt.to_numpy(t.cpu().contiguous()), requirements="C")))
        return _Ref(key, "tensor")
    if isinstance(value, dict):
        return {k: _split_value(v, path + (k,), arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_split_value(v, path + (i,), arrays) for i, v in enumerate(value)]
        return tuple(out) if isinstance(value, tuple) else out
    return value


def _decode_value(buf: Any, fqn: str) -> Any:
    raw = buf.getvalue() if isinstance(buf, io.BytesIO) else bytes(buf)
    try:
        return load_value(raw)
    except Exception as e:  # noqa: BLE001 - named
        raise UnsupportedValueError(
            f"the value {fqn!r} is a pickled object that torch.load(weights_only=True) refuses "
            f"({type(e).__name__}: {str(e)[:300]}); zarrckpt never pickles: store it as JSON-able "
            "values, bytes or tensors (or give it state_dict()/load_state_dict())") from None


class _Abandon:
    """Removes a claimed, uncommitted save (a weakref finalizer of the coordinator's writer)."""

    def __init__(self) -> None:
        self.target: _commit.Target | None = None
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            target, self.target = self.target, None
        if target is not None:
            _commit.abandon(target)


class ZarrckptStorageWriter(StorageWriter):
    """``dcp.save(state, storage_writer=ZarrckptStorageWriter(path))``: write a zarrckpt
    checkpoint through DCP (see the module docstring).

    ``path``: a path, URL or :class:`~zarrckpt.storage.Storage`; ``overwrite`` (default True,
    as DCP's ``FileSystemWriter``): replace a zarrckpt checkpoint already at ``path``,
    atomically (spec §7.3: on file systems the new one is written beside it and exchanged
    with it at the commit; the old one stays loadable until then, and a failed save leaves
    it as it was); False: a checkpoint there is an error. Unlike ``FileSystemWriter``, a
    non-empty directory that is not a zarrckpt checkpoint (a DCP checkpoint, say) is never
    written into, whatever ``overwrite`` says; ``storage``: :class:`StorageOptions`; ``compression``,
    ``inner_chunk_bytes``, ``max_inflight_bytes``: as :func:`zarrckpt.save` (the
    coordinator's apply to every rank); ``metadata``: the root's user metadata (JSON);
    ``max_chunks``: an array's chunk grid may have up to ``max(max_chunks, 16 x boxes)``
    chunks (nested uneven layouts need small chunks; beyond that the save is refused).
    """

    def __init__(self, path: Any, overwrite: bool = True, storage: StorageOptions | None = None, *,
                 compression: str | dict | None = None,
                 inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES,
                 max_inflight_bytes: int = 256 << 20, metadata: dict | None = None,
                 max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        super().__init__()
        if metadata is not None:
            fmt.check_metadata(metadata)
        self.path = path
        self.checkpoint_id = path if isinstance(path, (str, os.PathLike)) else None
        self.overwrite = overwrite
        self.storage = storage
        self.codec = fmt.compression_codec(compression)
        self.inner_chunk_bytes = inner_chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.metadata = metadata
        self.max_chunks = max_chunks
        self.is_coordinator = False
        self.save_id: str | None = None
        self._specs: dict[str, _ArraySpec] = {}
        self._paths: dict[str, tuple] = {}
        self._order: list[str] = []
        self._world = 1
        self._created = ""
        self._pending = _Abandon()
        self._finalizer = weakref.finalize(self, self._pending)
        self._dcp_save_id = uuid.uuid4().hex

    # ---- per save -------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.abort()
        if checkpoint_id is not None:
            self.path = checkpoint_id
            self.checkpoint_id = checkpoint_id
        self._dcp_save_id = uuid.uuid4().hex

    def abort(self) -> None:
        """Remove what a failed save of this writer left (its claim and directory);
        nothing if it committed. Called at the next save, on garbage collection, at exit."""
        self._pending()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.abort()  # a failed earlier save of this writer: clean it before starting again
        self.is_coordinator = is_coordinator
        self.save_id, self._specs, self._paths, self._order = None, {}, {}, []
        if kwargs.get("use_collectives", True) is False:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise SaveFailedError("ZarrckptStorageWriter needs use_collectives=True with several "
                                      "ranks (one coordinator claims and commits the checkpoint)")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path) if self.checkpoint_id is not None else None,
                           save_id=self._dcp_save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                td = item.tensor_data
                try:
                    zdt.by_torch(td.properties.dtype)
                except UnsupportedValueError as e:
                    raise UnsupportedValueError(f"{item.index.fqn!r}: {e}") from None
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if any(not p.usable for p in plans):
            raise SaveFailedError(
                "ZarrckptStorageWriter cannot use a cached DCP save plan (enable_plan_caching=True): the "
                "cached plans name an earlier save; save with DefaultSavePlanner(enable_plan_caching=False). "
                "Nothing was written")
        mappings: dict[str, tuple] = {}
        for p in plans:
            if isinstance(p.planner_data, dict):
                for fqn, path in p.planner_data.items():
                    mappings.setdefault(fqn, tuple(path))

        def path_of(fqn: str) -> tuple:
            path = mappings.get(fqn, (fqn,))
            ztree.key_of(path)  # valid components (spec §4)
            if len(path) > ztree.MAX_DEPTH:
                raise UnsupportedValueError(f"{fqn!r}: more than {ztree.MAX_DEPTH} levels")
            return path

        # every tensor's boxes, every value's first rank
        tensors: dict[str, dict] = {}
        values: dict[str, int] = {}
        skip: list[set] = [set() for _ in plans]
        for rank, p in enumerate(plans):
            for item in p.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    if fqn in tensors:
                        raise UnsupportedValueError(f"{fqn!r} is a tensor on one rank and a value on another")
                    if fqn in values:
                        skip[rank].add((fqn, None))
                    else:
                        values[fqn] = rank
                    continue
                if fqn in values:
                    raise UnsupportedValueError(f"{fqn!r} is a tensor on one rank and a value on another")
                td = item.tensor_data
                size = tuple(int(s) for s in td.size)
                dtype = zdt.by_torch(td.properties.dtype).zarr
                t = tensors.setdefault(fqn, {"shape": size, "dtype": dtype, "boxes": {}})
                if t["shape"] != size or t["dtype"] != dtype:
                    raise UnsupportedValueError(f"{fqn!r}: ranks disagree on its global shape / dtype "
                                                f"({t['shape']} {t['dtype']} vs {size} {dtype})")
                off = tuple(int(o) for o in td.chunk.offsets)
                sz = tuple(int(s) for s in td.chunk.sizes)
                box = (off, sz)
                if any(o < 0 or o + n > s for o, n, s in zip(off, sz, size)) or len(off) != len(size):
                    raise UnsupportedValueError(f"{fqn!r}: box {box} outside the shape {size}")
                if box in t["boxes"]:
                    skip[rank].add((fqn, off))  # replicated: the lowest rank writes it
                else:
                    t["boxes"][box] = rank

        specs: dict[str, _ArraySpec] = {}
        skeleton: dict = {}
        paths: dict[str, tuple] = {}
        for fqn, t in tensors.items():
            path = path_of(fqn)
            paths[fqn] = path
            key = ztree.key_of(path)
            shape = t["shape"]
            fmt.check_shape(shape, zdt.by_zarr(t["dtype"]).numpy.itemsize, f"array {key!r}")
            boxes = [b for b in t["boxes"] if all(b[1])]
            chunk = chunk_grid(shape, boxes)
            grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
            total = math.prod(grid) if all(shape) else 0
            limit = max(self.max_chunks, 16 * len(boxes))
            if total > limit:
                raise UnsupportedValueError(
                    f"{fqn!r}: its shards (boxes {sorted(boxes)[:4]}...) fit only a grid of {total} chunks of "
                    f"shape {chunk} (more than {limit}); nested uneven sharding is stored by zarrckpt.save, which "
                    "exchanges boundary rows. Nothing was written")
            owner: dict[tuple, int] = {}
            for box in boxes:
                for idx in _chunk_indexes(box[0], box[1], chunk):
                    if idx in owner:
                        raise UnsupportedValueError(f"{fqn!r}: shards overlap (box {box}); nothing was written")
                    owner[idx] = t["boxes"][box]
            if len(owner) != total:
                raise UnsupportedValueError(f"{fqn!r}: the shards cover {len(owner)} of its {total} chunks "
                                            f"(shape {shape}, chunks {chunk}); nothing was written")
            first = owner.get((0,) * len(shape), 0)
            specs[fqn] = _ArraySpec(key, shape, t["dtype"], chunk, first)
            _skeleton_insert(skeleton, path, _Leaf(None), "DCP keys")
        for fqn in values:
            path = path_of(fqn)
            paths[fqn] = path
            _skeleton_insert(skeleton, path, _Leaf(None), "DCP keys")

        # claim the location (engine.begin, as Writer): the last step, so a refusal above
        # leaves nothing behind
        self.save_id, self._created = engine.new_identity(_ONE)
        self._world = len(plans)
        self._specs, self._paths = specs, paths
        self._order = list(mappings)  # flatten order: the tree keeps the state dict's key order
        location = open_storage(self.path, self.storage)
        pending = fmt.root_metadata(state="pending", save_id=self.save_id, world_size=self._world,
                                    created=self._created, writer=self._writer_versions())
        target = engine.begin(_ONE, location, self.save_id, self.overwrite, pending, [])
        with self._pending.lock:
            self._pending.target = target
        out = []
        for rank, p in enumerate(plans):
            mine = {i.index.fqn for i in p.items}
            data = _RankData(
                rank=rank, save_id=self.save_id, created=self._created, codec=self.codec,
                inner_chunk_bytes=self.inner_chunk_bytes,
                arrays={f: s for f, s in specs.items() if f in mine or s.doc_writer == rank},
                paths={f: paths[f] for f in mine if f in paths},
                skip=frozenset(skip[rank]))
            out.append(dataclasses.replace(p, storage_data=data))
        return out

    @staticmethod
    def _writer_versions() -> dict[str, str]:
        return fmt.writer_versions({"torch.distributed.checkpoint": "zarrckpt.dcp_storage"})

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        data = plan.storage_data
        if not isinstance(data, _RankData):
            raise SaveFailedError("this SavePlan was not prepared by ZarrckptStorageWriter.prepare_global_plan "
                                  "(a cached plan? see the module docstring); nothing was written")
        store = _commit.save_store(open_storage(self.path, self.storage), data.save_id)
        results: list[WriteResult] = []
        docs = {f: _array_doc(s, data.save_id, data.codec, data.inner_chunk_bytes) for f, s in data.arrays.items()}
        crcs: dict = {}  # spec §6.6: the CRC-32Cs of the units this rank writes, for the root
        out = engine.ChunkWriter(store, self.max_inflight_bytes, crcs)
        try:
            for fqn, spec in data.arrays.items():
                if spec.doc_writer == data.rank:
                    out.document(spec.key, docs[fqn])
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    if (fqn, None) in data.skip:
                        results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                        continue
                    path = data.paths.get(fqn, (fqn,))
                    value = _decode_value(planner.resolve_data(item), fqn)
                    arrays: list = []
                    skel = _split_value(value, path, arrays)
                    try:  # refuse what the tree cannot hold, naming the key (spec §6.2)
                        ztree.encode_tree({"v": skel}, lambda x: isinstance(x, _Ref), ())
                    except UnsupportedValueError as e:
                        raise UnsupportedValueError(f"{fqn!r}: {e}") from None
                    value_docs = {}
                    nbytes = 0
                    for key, kind, arr in arrays:
                        doc = _value_doc(key, arr, kind, data.save_id, data.codec, data.inner_chunk_bytes)
                        value_docs[key] = doc
                        out.document(key, doc)
                        if arr.size or arr.ndim == 0:
                            out.chunk(key, doc, (0,) * arr.ndim, tuple((0, s) for s in arr.shape), arr)
                            nbytes += arr.nbytes
                    results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                               storage_data=("value", fqn, path, skel, value_docs)))
                    continue
                td = item.tensor_data
                off = tuple(int(o) for o in td.chunk.offsets)
                sz = tuple(int(s) for s in td.chunk.sizes)
                if (fqn, off) in data.skip or not all(sz):
                    results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                    continue
                spec, doc = data.arrays[fqn], docs[fqn]
                t = planner.resolve_data(item).detach()
                if tuple(t.shape) != sz:
                    raise SaveFailedError(f"{fqn!r}: the data has shape {tuple(t.shape)}, its box {sz}")
                if t.device.type != "cpu":
                    t = t.cpu()
                if t.is_conj():
                    t = t.resolve_conj()
                a = zdt.to_numpy(t)
                for idx in _chunk_indexes(off, sz, spec.chunk):
                    box = tuple((i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, spec.chunk, spec.shape))
                    local = tuple(slice(a0 - o, b0 - o) for (a0, b0), o in zip(box, off))
                    piece = a[local] if local else a
                    out.chunk(spec.key, doc, idx, box, np.require(piece, requirements="C"))
                results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                           storage_data=None))
            out.finish()  # every write done, then one syncfs: durable before finish() commits
        except BaseException:
            out.stop()
            raise
        if results:  # this rank's chunk CRCs reach finish() with its last result (DCP gathers them)
            last = results[-1]
            results[-1] = WriteResult(index=last.index, size_in_bytes=last.size_in_bytes,
                                      storage_data=(_CRCS, engine.pack_crcs(crcs), last.storage_data))
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        target = self._pending.target
        if target is None or self.save_id is None:
            raise SaveFailedError("finish() without a prepared save (prepare_global_plan claims the location)")
        try:
            skeleton: dict = {}
            docs = {s.key: _array_doc(s, self.save_id, self.codec, self.inner_chunk_bytes)
                    for s in self._specs.values()}
            leaves: dict[str, tuple[tuple, Any]] = {
                fqn: (self._paths[fqn], _Ref(spec.key)) for fqn, spec in self._specs.items()}
            crcs = []
            for rank_results in results:
                for r in rank_results:
                    sd = r.storage_data
                    if isinstance(sd, tuple) and sd and sd[0] == _CRCS:
                        crcs.append(engine.unpack_crcs(sd[1]))
                        sd = sd[2]
                    if isinstance(sd, tuple) and sd and sd[0] == "value":
                        _, fqn, path, skel, value_docs = sd
                        leaves[fqn] = (tuple(path), skel)
                        docs.update(value_docs)
            order = {fqn: i for i, fqn in enumerate(self._order)}
            for fqn in sorted(leaves, key=lambda f: order.get(f, len(order))):
                path, leaf = leaves[fqn]
                _skeleton_insert(skeleton, path, _Leaf(leaf), "DCP keys")
            tree = ztree.encode_tree(_containers(skeleton), lambda x: isinstance(x, _Ref))
            root = fmt.root_metadata(state="committed", save_id=self.save_id, world_size=self._world,
                                     created=self._created, writer=self._writer_versions(), tree=tree,
                                     array_docs=docs, metadata=self.metadata,
                                     chunk_crcs=engine.merge_crcs(crcs))  # format 1.3 (spec §6.6)
            try:
                fmt.parse_root_bytes(fmt.root_bytes(root), target.location.url)
            except ZarrckptError as e:
                raise ZarrckptError(f"the checkpoint about to be committed at {target.location.url!r} would not "
                                    f"be readable, so nothing was committed (a bug; please report it): {e}") from e
            group_doc = fmt.encode_document(fmt.group_metadata())
            wait_all([(g, target.store.put(f"{g}/zarr.json", group_doc)) for g in fmt.group_paths(docs)], "write")
            _commit.publish(target, root)
        except BaseException:
            self.abort()
            raise
        with self._pending.lock:
            self._pending.target = None  # committed: nothing to abandon

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for any path or URL zarrckpt can write to (no I/O)."""
        return isinstance(checkpoint_id, (str, os.PathLike, Storage))

