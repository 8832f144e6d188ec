"""PyTorch Distributed Checkpoint (DCP) directories, read and written (needs torch).

What is unpickled, and why
--------------------------
A DCP directory (``torch.distributed.checkpoint.FileSystemWriter``) holds ``.metadata``
and data files ``__<rank>_<n>.distcp``. Three kinds of bytes in it are pickles:

1. **``.metadata``** is ``pickle.dump`` of a ``torch.distributed.checkpoint.metadata.Metadata``.
   DCP itself reads it with plain ``pickle.load`` (``FileSystemReader.read_metadata``,
   torch 2.13), which runs any callable a hostile file names (pytorch issue #189308); its
   own ``torch.load(weights_only=True)`` cannot read it (it is not a ``torch.save`` zip).
   zarrckpt reads it with :class:`MetadataUnpickler`, a ``pickle.Unpickler`` whose
   ``find_class`` admits exactly the globals DCP writes there and nothing else (the
   "restricting globals" pattern of the Python documentation; also what pytorch PR #191326
   proposed for DCP): the dataclasses ``Metadata``, ``TensorStorageMetadata``,
   ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
   ``MetadataIndex``, ``StorageMeta`` and the enum ``_MEM_FORMAT_ENCODING`` of
   ``torch.distributed.checkpoint.metadata``; ``_StorageInfo`` of
   ``torch.distributed.checkpoint.filesystem``; ``torch.Size``; ``torch`` dtypes and
   layouts (attributes that *are* a ``torch.dtype``/``torch.layout``, never callables);
   ``torch.serialization._get_layout`` (a name -> layout lookup); and ``pathlib`` paths
   (``StorageMeta.checkpoint_id``), which are replaced by a function that returns the
   path as a string. Persistent ids are refused. Everything a hostile file could do is
   build those objects (dataclass ``__new__`` + ``__dict__`` update, or
   ``TensorProperties.__setstate__``), which run no code of the file's choosing; the
   result is then checked field by field (:func:`check_metadata`) before anything is used.
2. **Tensor items** (each a ``torch.save`` zip inside a ``.distcp`` file) are opened as DCP
   does, with ``torch.load(weights_only=True)`` — torch's own restricted unpickler — and
   with ``map_location="meta"`` so that no data is read until a piece is asked for
   (:mod:`._torch_save`).
3. **Non-tensor values** (``BytesStorageMetadata`` items: DCP applies ``torch.save`` to
   every non-tensor leaf, ``step``, ``lr``, a scheduler's state, an ``io.BytesIO``) are loaded with
   ``torch.load(weights_only=True)`` with one global added to torch's allow-list,
   ``io.BytesIO`` (built from its bytes by its own ``__setstate__``); DCP itself uses
   ``weights_only=False`` there. A value that torch's restricted unpickler refuses is an
   error (or skipped, ``strict=False``). An item that is not a zip (older DCP versions
   wrote ``BytesIO`` leaves raw) is read as an ``io.BytesIO`` leaf.

Writing produces what ``dcp.save`` writes on one process, item for item (DCP's own
flattening rule, :func:`dcp_items`: a tuple, or a list of neither tensors nor dicts, is
one value): one ``__0_0.distcp`` with one ``torch.save`` item per piece of each tensor
(tensors larger than the memory budget become several chunks, as a sharded tensor's
are), ``BytesIO`` items for bytes and values through ``torch.save`` (``BytesIO`` leaves
too, as DCP does), and ``.metadata`` pickled from DCP's own dataclasses, written last
(DCP's commit point) through a temporary file.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..format import dtypes as zdt
from ..errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, UnsupportedValueError
from .common import ArrayLeaf, Skipped, ValueLeaf
from .torch_save import TensorFile, _torch, expand, refusal

METADATA = ".metadata"
DATA_FILE = "__0_0.distcp"
_MAX_METADATA = 1 << 30

_DCP_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")


def _path_str(*parts: Any) -> str:
    return os.path.join(*[str(p) for p in parts]) if parts else ""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        torch = _torch()
        if module == "torch.distributed.checkpoint.metadata" and name in _DCP_CLASSES:
            from torch.distributed.checkpoint import metadata as md

            return getattr(md, name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            from torch.distributed.checkpoint import filesystem as fs

            return fs._StorageInfo
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return _path_str
        raise FormatError(f"the DCP .metadata refers to {module}.{name}, which is not among the classes DCP "
                          "writes there; zarrckpt refuses to unpickle it (a hostile or non-DCP file?)")

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError("the DCP .metadata holds a persistent id, which DCP never writes")


def _layout(name: Any) -> Any:
    torch = _torch()
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise FormatError(f"the DCP .metadata names an unknown layout {name!r:.60}")
    return value


def read_metadata(directory: str) -> Any:
    path = os.path.join(directory, METADATA)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{directory} is not a DCP checkpoint (no {METADATA} file)") from None
    if size > _MAX_METADATA:
        raise FormatError(f"{path}: {size} bytes, too large for DCP metadata")
    with open(path, "rb") as fh:
        try:
            md = MetadataUnpickler(fh).load()
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 - any broken pickle
            raise FormatError(f"{path} is not a readable DCP metadata pickle: {type(e).__name__}: {e}"[:500]) from None
    check_metadata(md, path)
    return md


def check_metadata(md: Any, where: str) -> None:
    """Every field zarrckpt uses, checked (parse, don't trust)."""
    torch = _torch()
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise FormatError(f"{where}: {what}")

    def ints(v: Any, n: int | None = None) -> bool:
        return (isinstance(v, tuple) and (n is None or len(v) == n)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))

    need(isinstance(md, m.Metadata), f"holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    need(isinstance(sdm, dict), "state_dict_metadata is not a dict")
    for fqn, v in sdm.items():
        need(isinstance(fqn, str), f"key {fqn!r:.60} is not a string")
        if isinstance(v, m.TensorStorageMetadata):
            props = getattr(v, "properties", None)
            need(isinstance(props, m.TensorProperties) and isinstance(getattr(props, "dtype", None), torch.dtype),
                 f"{fqn!r}: bad tensor properties")
            need(ints(getattr(v, "size", None)) and len(v.size) <= 32, f"{fqn!r}: bad size")
            chunks = getattr(v, "chunks", None)
            need(isinstance(chunks, list), f"{fqn!r}: chunks is not a list")
            for c in chunks:
                need(isinstance(c, m.ChunkStorageMetadata) and ints(getattr(c, "offsets", None), len(v.size))
                     and ints(getattr(c, "sizes", None), len(v.size))
                     and all(o + s <= n for o, s, n in zip(c.offsets, c.sizes, v.size)),
                     f"{fqn!r}: a chunk outside the tensor of size {tuple(v.size)}")
        else:
            need(isinstance(v, m.BytesStorageMetadata), f"{fqn!r}: unknown storage metadata {type(v).__name__}")
    sd = getattr(md, "storage_data", None)
    need(isinstance(sd, dict), "storage_data is not a dict (not written by FileSystemWriter?)")
    for k, info in sd.items():
        need(isinstance(k, m.MetadataIndex) and isinstance(k.fqn, str), "a storage_data key is not a MetadataIndex")
        need(isinstance(info, _StorageInfo), f"{k.fqn!r}: storage info is a {type(info).__name__}")
        rp = getattr(info, "relative_path", None)
        need(isinstance(rp, str) and rp == os.path.basename(rp) and rp not in ("", ".", "..")
             and "\\" not in rp and "\0" not in rp, f"{k.fqn!r}: data file {rp!r:.80} is not a file of the directory")
        need(all(isinstance(getattr(info, a, None), int) and getattr(info, a) >= 0 for a in ("offset", "length")),
             f"{k.fqn!r}: bad offset or length")
    pd = getattr(md, "planner_data", None)
    need(pd is None or isinstance(pd, dict), "planner_data is not a dict")


class Source:
    """A DCP checkpoint directory written by ``FileSystemWriter``."""

    def __init__(self, src: str | os.PathLike, limit: int, strict: bool = True) -> None:
        self.dir = os.path.abspath(os.fspath(src))
        if not os.path.isdir(self.dir):
            raise CheckpointNotFoundError(f"no DCP checkpoint directory at {self.dir}")
        self.limit = limit
        self.md = read_metadata(self.dir)
        self.metadata = None
        self._items: dict[tuple, TensorFile] = {}

    def _path(self, fqn: str) -> tuple[tuple, tuple]:
        pd = self.md.planner_data if isinstance(self.md.planner_data, dict) else {}
        p = pd.get(fqn)
        if isinstance(p, (tuple, list)) and p and all(
                (isinstance(c, str)) or (isinstance(c, int) and not isinstance(c, bool) and c >= 0) for c in p):
            path = tuple(p)
        else:
            path = (fqn,)
        return path, tuple("list" if isinstance(c, int) else "dict" for c in path[1:])

    def _info(self, fqn: str, offsets: Any = None) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.md.storage_data.get(MetadataIndex(fqn, offsets))
        if info is None:
            raise FormatError(f"{self.dir}: {fqn!r} has no storage item"
                              + (f" for its chunk at {tuple(offsets)}" if offsets is not None else ""))
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedValueError(f"{self.dir}: {fqn!r} was saved through DCP storage extensions "
                                        f"{list(info.transform_descriptors)}, which zarrckpt does not read")
        return info

    def _item(self, fqn: str, info: Any) -> TensorFile:
        key = (info.relative_path, info.offset)
        tf = self._items.get(key)
        if tf is None:
            path = os.path.join(self.dir, info.relative_path)
            if not os.path.isfile(path):
                raise FormatError(f"{self.dir}: data file {info.relative_path} of {fqn!r} is missing")
            tf = TensorFile(path, info.offset, info.length, where=f"{path} (item of {fqn!r} at byte {info.offset})",
                            limit=self.limit)
            self._items[key] = tf
        return tf

    def leaves(self) -> Iterator[ArrayLeaf | ValueLeaf | Skipped]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        for fqn, v in self.md.state_dict_metadata.items():
            path, containers = self._path(fqn)
            if isinstance(v, TensorStorageMetadata):
                yield self._tensor(fqn, path, containers, v)
            else:
                yield from self._value(fqn, path, containers)

    def _tensor(self, fqn: str, path: tuple, containers: tuple, v: Any) -> ArrayLeaf | Skipped:
        try:
            row = zdt.by_torch(v.properties.dtype)
        except UnsupportedValueError as e:
            return Skipped(path, str(e))
        shape = tuple(v.size)
        chunks = []
        total = 0
        for c in v.chunks:
            box = tuple((o, o + s) for o, s in zip(c.offsets, c.sizes))
            chunks.append((box, self._info(fqn, c.offsets)))
            total += math.prod(c.sizes)
        if total != math.prod(shape) or _overlap([b for b, _ in chunks]):
            raise FormatError(f"{self.dir}: the chunks of {fqn!r} do not cover its {shape} elements exactly once")
        where = f"{self.dir}: {fqn!r}"

        def read(box: tuple) -> np.ndarray:
            out = np.empty([b - a for a, b in box], dtype=row.numpy)
            for cbox, info in chunks:
                inter = tuple((max(a, ca), min(b, cb)) for (a, b), (ca, cb) in zip(box, cbox))
                if any(a >= b for a, b in inter) and inter:
                    continue
                tf = self._item(fqn, info)
                t = tf.obj
                if not isinstance(t, _torch().Tensor) or tuple(t.shape) != tuple(b - a for a, b in cbox):
                    raise FormatError(f"{where}: its item at byte {info.offset} holds "
                                      f"{tuple(getattr(t, 'shape', ())) if hasattr(t, 'shape') else type(t).__name__}, "
                                      f"not a tensor of the chunk's shape {tuple(b - a for a, b in cbox)}")
                if t.dtype != v.properties.dtype:
                    raise FormatError(f"{where}: an item of dtype {t.dtype}, expected {v.properties.dtype}")
                leaf = tf.reader(t, where)
                if isinstance(leaf, Skipped):
                    raise UnsupportedValueError(leaf.reason)
                rel = tuple((a - ca, b - ca) for (a, b), (ca, _) in zip(inter, cbox))
                out[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, box))] = leaf.read(rel)
            return out

        return ArrayLeaf(path, shape, row, read, "tensor", containers)

    def _value(self, fqn: str, path: tuple, containers: tuple) -> Iterator[ArrayLeaf | ValueLeaf | Skipped]:
        info = self._info(fqn)
        file = os.path.join(self.dir, info.relative_path)
        try:
            with open(file, "rb") as fh:
                fh.seek(info.offset)
                raw = fh.read(info.length)
        except OSError as e:
            raise FormatError(f"{self.dir}: cannot read the item of {fqn!r} in {info.relative_path}: {e}") from None
        if len(raw) != info.length:
            raise FormatError(f"{file}: the item of {fqn!r} at byte {info.offset} is cut short")
        if not raw.startswith(b"PK\x03\x04"):
            from .common import in_memory_leaf

            yield in_memory_leaf(path, np.frombuffer(raw, np.uint8), "bytesio", containers)
            return
        try:
            value = load_value(raw)
        except pickle.UnpicklingError as e:
            yield Skipped(path, f"DCP value {fqn!r} is a pickled object that torch.load(weights_only=True) "
                                f"refuses ({refusal(e)})")
            return
        except Exception as e:  # noqa: BLE001
            raise FormatError(f"{file}: the item of {fqn!r} is not a readable torch.save zip: {e}"[:500]) from None
        yield from expand(path, containers, value)

    def close(self) -> None:
        for tf in self._items.values():
            tf.close()
        self._items.clear()


def _overlap(boxes: list[tuple]) -> bool:
    if len(boxes) > 4096:
        return False  # the volume check already caught gaps; pairwise overlap checks grow as n^2
    for i in range(len(boxes)):
        for j in range(i):
            if all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(boxes[i], boxes[j])) and boxes[i]:
                return True
    return False


# ------------------------------------------------------------------ writing


class _Node:
    """A container of :func:`dcp_items`' tree: its kind and its entries (a node, or the
    index of a leaf)."""

    __slots__ = ("kind", "entries")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[Any, _Node | int] = {}


def dcp_items(leaves: Sequence[tuple[tuple, tuple | None, str]]) -> list[tuple[int, list[int]]]:
    """The items DCP stores for a state dict given by its leaves, by DCP's own flattening
    rule (``traverse_state_dict`` of ``torch.distributed.checkpoint._traverse``, torch 2.4
    and later, which ``dcp.save`` and ``dcp.load`` apply to a state dict alike):

    * a dict is traversed: each entry is an item, or holds items;
    * a tuple is one item (a value DCP ``torch.save``-s whole), whatever it holds;
    * a list is one item unless an entry is a tensor, a dict, or a list that is not one
      item itself; then each entry is traversed;
    * any other value is an item; an empty dict (met where dicts are traversed) leaves no
      item.

    ``leaves``: ``(key path, kinds of the containers on the way, what)``, ``what`` being
    ``"tensor"``, ``"dict"`` (an empty dict) or ``"value"`` (any other leaf: a container
    value must be given by its entries). Returns ``(n, indexes)`` per item in the order of
    the leaves: the subtree at the first ``n`` components of the paths of the leaves
    ``indexes`` (``n`` the whole path for a leaf that is an item itself). The indexes of
    the empty dicts DCP drops are in no item."""
    root = _Node("dict")
    for i, (path, containers, _) in enumerate(leaves):
        kinds = tuple(containers or ()) + ("dict",) * len(path)
        node = root
        for depth, comp in enumerate(path[:-1]):
            child = node.entries.setdefault(comp, _Node(kinds[depth]))
            if not isinstance(child, _Node):
                raise UnsupportedValueError(f"{_dotted(path[:depth + 1])!r} is a leaf, and {_dotted(path)!r} "
                                            "cannot be under it in DCP; rename one with keys=")
            node = child
        if path[-1] in node.entries:
            raise UnsupportedValueError(f"two leaves have the DCP name {_dotted(path)!r}; rename one with keys=")
        node.entries[path[-1]] = i
    out: list[tuple[int, list[int]]] = []
    _visit(root, 0, leaves, out)
    return out


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def _visit(node: _Node, depth: int, leaves: Sequence[tuple], out: list[tuple[int, list[int]]]) -> None:
    for entry in node.entries.values():
        if isinstance(entry, int):
            if leaves[entry][2] != "dict":
                out.append((depth + 1, [entry]))
        elif _terminal(entry, leaves):
            out.append((depth + 1, list(_indexes(entry))))
        else:
            _visit(entry, depth + 1, leaves, out)


def _terminal(node: _Node, leaves: Sequence[tuple]) -> bool:
    """DCP's ``_is_terminal``: is this container one item?"""
    if node.kind != "list":
        return node.kind == "tuple"
    for entry in node.entries.values():
        if isinstance(entry, int):
            if leaves[entry][2] in ("tensor", "dict"):
                return False
        elif entry.kind == "dict" or entry.kind == "list" and not _terminal(entry, leaves):
            return False
    return True


def _indexes(node: _Node) -> Iterator[int]:
    for entry in node.entries.values():
        if isinstance(entry, int):
            yield entry
        else:
            yield from _indexes(entry)



class Sink:
    """A DCP checkpoint directory as ``dcp.save`` writes it from one process."""

    def __init__(self, dst: str | os.PathLike, overwrite: bool) -> None:
        torch = _torch()
        self.torch = torch
        self.dir = os.path.abspath(os.fspath(dst))
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise CheckpointExistsError(f"{self.dir} exists and is not a directory")
        names = os.listdir(self.dir) if os.path.isdir(self.dir) else []
        if names:
            ours = [n for n in names if n == METADATA or n.endswith(".distcp") or n == METADATA + ".tmp"]
            if not overwrite or len(ours) != len(names) or METADATA not in names:
                raise CheckpointExistsError(
                    f"{self.dir} is not empty" + ("; pass overwrite=True to replace the DCP checkpoint there"
                                                  if METADATA in names and len(ours) == len(names) else
                                                  " and is not a DCP checkpoint; choose an empty or new directory"))
            os.remove(os.path.join(self.dir, METADATA))  # un-commit first, then the data
            for n in ours:
                if n != METADATA:
                    os.remove(os.path.join(self.dir, n))
        os.makedirs(self.dir, exist_ok=True)
        self.fh = open(os.path.join(self.dir, DATA_FILE), "wb")
        self.sdm: dict[str, Any] = {}
        self.storage: dict[Any, Any] = {}
        self.planner: dict[str, tuple] = {}

    @staticmethod
    def fqn_path(path: tuple, containers: tuple | None) -> tuple:
        """DCP's object path: dict keys as strings, list and tuple indexes as ints."""
        kinds = tuple(containers or ()) + ("dict",) * len(path)
        parents = ("dict",) + kinds[:len(path) - 1]
        return tuple(c if k != "dict" and isinstance(c, int) else str(c) for c, k in zip(path, parents))

    def _register(self, path: tuple, containers: tuple | None) -> str:
        obj_path = self.fqn_path(path, containers)
        fqn = ".".join(map(str, obj_path))
        if fqn in self.sdm:
            raise UnsupportedValueError(f"two leaves have the DCP name {fqn!r}; rename one with keys=")
        self.planner[fqn] = obj_path
        return fqn

    def write_array(self, path: tuple, containers: tuple | None, shape: tuple, dtype: zdt.DType,
                    pieces: Iterator[tuple[tuple, np.ndarray]]) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                           TensorStorageMetadata)

        torch = self.torch
        fqn = self._register(path, containers)
        tdt = zdt.torch_dtype(dtype)
        chunks = []
        empty = not math.prod(shape)
        source = iter([((0,) * len(shape), np.empty(shape, dtype.numpy))]) if empty else pieces
        for start, data in source:
            t = zdt.from_numpy(np.require(data, requirements="C"), dtype)
            offset = self.fh.tell()
            torch.save(t, self.fh)
            length = self.fh.tell() - offset
            index = len(chunks)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(data.shape)))
            self.storage[MetadataIndex(fqn, torch.Size(start), index)] = _StorageInfo(DATA_FILE, offset, length)
        self.sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=tdt), size=torch.Size(shape),
                                              chunks=chunks)

    def write_bytes(self, path: tuple, containers: tuple | None, raw: bytes | None, value: Any = None) -> None:
        """A BytesIO leaf (``raw``) or a value DCP pickles with torch.save."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        fqn = self._register(path, containers)
        if raw is None:
            buf = io.BytesIO()
            self.torch.save(value, buf)
            raw = buf.getvalue()
        offset = self.fh.tell()
        self.fh.write(raw)
        self.storage[MetadataIndex(fqn)] = _StorageInfo(DATA_FILE, offset, len(raw))
        self.sdm[fqn] = BytesStorageMetadata()

    def commit(self) -> None:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        md = Metadata(state_dict_metadata=self.sdm, planner_data=self.planner, storage_data=self.storage,
                      storage_meta=StorageMeta(checkpoint_id=self.dir, save_id=str(uuid.uuid4())),
                      version=CURRENT_DCP_VERSION)
        tmp = os.path.join(self.dir, METADATA + ".tmp")
        with open(tmp, "wb") as fh:
            pickle.dump(md, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(self.dir, METADATA))
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def abandon(self) -> None:
        try:
            self.fh.close()
        finally:
            for n in (DATA_FILE, METADATA + ".tmp"):
                p = os.path.join(self.dir, n)
                if os.path.exists(p):
                    os.remove(p)
            if os.path.isdir(self.dir) and not os.listdir(self.dir):
                os.rmdir(self.dir)


__all__ = ["DATA_FILE", "METADATA", "MetadataUnpickler", "Sink", "Source", "check_metadata", "dcp_items",
           "load_value", "read_metadata"]


def load_value(raw: bytes) -> Any:
    """A non-tensor item DCP wrote (a ``torch.save`` stream), through torch's restricted
    unpickler (``weights_only=True``) with ``io.BytesIO`` allowed: DCP pickles BytesIO
    leaves too. Raises what ``torch.load`` raises for anything else."""
    torch = _torch()
    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
