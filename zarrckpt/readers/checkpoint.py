"""Reading a checkpoint without torch: ``zarrckpt.open(path)``, a lazy, read-only view.

>>> ck = zarrckpt.open("ckpt/step_100")              # doctest: +SKIP
>>> ck                                                # a tree: shapes, dtypes, sizes, layouts  # doctest: +SKIP
>>> w = ck["model/layer.weight"]                      # a LazyArray: nothing read yet  # doctest: +SKIP
>>> w.shape, w.dtype, w.chunks, w.placements          # doctest: +SKIP
>>> w[:128, ::2]                                      # NumPy; reads only the chunks it touches  # doctest: +SKIP
>>> ck["model"].keys(), ck["step"], ck.step, ck.metrics  # doctest: +SKIP
>>> ck.read("model/layer.weight")                     # the whole array (ml_dtypes for bf16/fp8)  # doctest: +SKIP
>>> ck.tensorstore("model/layer.weight")[0:8].read().result()  # doctest: +SKIP

Every document is verified before it is used (spec §6.6): the root against its own
digest, each array ``zarr.json`` against the digest the root records, and both parsed
strictly (:mod:`zarrckpt.format.documents`). On a local file system, files that are not regular
files (a FIFO, a device) are refused before anything opens them, so a damaged or
hostile directory cannot hang a reader.

A handle is bound to the save it opened (spec §7.3). Every call that reads data or
values (``read``, ``ck[key]``, ``to_dict``, ``items``, a :class:`LazyArray`'s indexing,
``to_numpy`` and dask tasks) checks *after* its reads that the root at the path is
still that save's, and raises :class:`~zarrckpt.errors.CheckpointChangedError` if it was
replaced meanwhile (an overwrite), so a read never returns one save's values with
another's arrays. The check is one conditional read of the root ``zarr.json`` per call
(no bytes move while it is unchanged: TensorStore compares the storage generation). A
failing document or chunk check is also re-checked against the root: when the
checkpoint was replaced, the error is ``CheckpointChangedError`` (chained from the
original). ``keys()``, shapes, dtypes and ``metadata`` come from the root read at open
and do no I/O; a TensorStore handle from ``tensorstore(key)`` reads storage directly,
so call ``check_unchanged()`` after reading through it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ..format import documents as fmt
from ..format import tree as ztree
from ..storage.inflight import wait_all
from .lazy import LazyArray, checked_read, describe, format_bytes
from ..errors import CheckpointChangedError, CheckpointNotFoundError, FormatError, MissingKeysError
from ..storage import (Array, Storage, StorageOptions, file_type, in_memory_array, open_storage, storage_error,
                       translate_error)

__all__ = ["Checkpoint", "CheckpointView", "LazyArray", "open_checkpoint"]

Box = tuple[tuple[int, int], ...]


class CheckpointView:
    """A read-only view of a checkpoint's tree, or of the part of it under one key prefix.

    A mapping from leaf keys to leaves: ``keys()`` lists every leaf key under the view,
    ``/``-joined and escaped (spec §4), relative to its prefix; ``view[key]`` returns

    * a :class:`LazyArray` for a tensor or NumPy array leaf (packed or not): nothing is
      read until it is indexed or converted;
    * ``bytes`` for a ``bytes`` or ``io.BytesIO`` leaf, and the value for any other leaf
      (int, float, str, None, an empty container ...);
    * a :class:`CheckpointView` of the subtree when ``key`` is a prefix of leaf keys
      (``ck["model"]``, ``ck["optim/state"]``).

    ``key in view``, ``len(view)`` and iteration are over leaf keys, as ``keys()``.
    Methods that take a key (``read``, ``tensorstore``, ``array_info`` ...) take it relative
    to the view too. ``metadata``, ``step`` and ``metrics`` are the checkpoint's.

    Calls that read data or values check afterwards that the checkpoint was not replaced
    since it was opened (:meth:`check_unchanged`); ``with view.reading(): ...`` makes
    several calls one read with one check at its end.
    """

    def __init__(self, checkpoint: Checkpoint, prefix: str) -> None:
        self._ck = checkpoint
        self.prefix = prefix

    @property
    def checkpoint(self) -> Checkpoint:
        """The whole checkpoint this view belongs to."""
        return self._ck

    def _full(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"checkpoint keys are '/'-joined strings such as 'model/w', not "
                            f"{type(key).__name__} {key!r:.60}")
        key = key.rstrip("/") if len(key) > 1 else key
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    @functools.cached_property
    def _full_keys(self) -> list[str]:
        if not self.prefix:
            return list(self._ck._leaves)
        p = self.prefix + "/"
        return [k for k in self._ck._leaves if k.startswith(p)]

    # ---- the mapping ----------------------------------------------------------

    def keys(self) -> list[str]:
        """Every leaf key under this view (arrays and values), in stored order."""
        if not self.prefix:
            return list(self._full_keys)
        return [self._rel(k) for k in self._full_keys]

    def array_keys(self) -> list[str]:
        """Keys whose values are arrays (stored as their own array, or packed)."""
        return [self._rel(k) for k in self._full_keys if self._ck._is_array(k)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._full(key) in self._ck._leaves and (
            not self.prefix or self._full(key).startswith(self.prefix + "/"))

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._full_keys)

    @checked_read
    def __getitem__(self, key: str) -> Any:
        full = self._full(key)
        ck = self._ck
        if full in ck._leaves:
            return ck._leaf(full)
        if full in ck._groups:
            return CheckpointView(ck, full)
        raise KeyError(self._no_key(key))

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def values(self) -> list[Any]:
        return [v for _, v in self.items()]

    @checked_read
    def items(self) -> list[tuple[str, Any]]:
        """(key, leaf) pairs, as ``view[key]`` gives them (array metadata read concurrently)."""
        self._ck._array_infos([k for k in self._full_keys if self._ck._is_array(k)])
        return [(self._rel(k), self._ck._leaf(k)) for k in self._full_keys]

    def groups(self) -> list[str]:
        """The keys of the groups directly under this view (each a ``view[group]``)."""
        out: dict[str, None] = {}
        for k in self.keys():
            if "/" in k:
                out[k.split("/", 1)[0]] = None
        return list(out)

    def _no_key(self, key: str, what: str = "no key") -> str:
        import difflib

        names = self.keys() + [g for g in self._ck._groups if not self.prefix or g.startswith(self.prefix + "/")]
        near = difflib.get_close_matches(key, [self._rel(n) if n.startswith(self.prefix) else n
                                               for n in names], n=3)
        where = f"under {self.prefix!r} of" if self.prefix else "in"
        hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
        return f"{what} {key!r} {where} checkpoint {self._ck.url!r}{hint}"

    # ---- one read across an overwrite (spec §7.3) -------------------------------

    def check_unchanged(self) -> None:
        """Raise :class:`~zarrckpt.errors.CheckpointChangedError` unless the root at the
        path is still the one this handle opened (the same save, committed). One
        conditional read of the root ``zarr.json``: no bytes move while it is unchanged."""
        ck = self._ck
        local = ck.storage.local_path
        if local is not None:
            _require_regular(os.path.join(local, "zarr.json"), f"{ck.url}: the root zarr.json", missing_ok=True)
        changed = ck.storage.read_if_changed("zarr.json", ck._root_generation)
        if changed is None:  # the same generation: unchanged
            return
        data, generation = changed
        if data == ck._root_bytes:  # the same bytes, rewritten (copied, touched)
            ck._root_generation = generation
            return
        raise CheckpointChangedError(_changed_message(ck, data))

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Make the reads inside one read: the root is checked once, after them (by the
        outermost ``reading`` of the thread). A document or chunk check that fails inside
        is re-checked against the root: if the checkpoint was replaced, the error is
        ``CheckpointChangedError`` (chained from the original), else the original."""
        local = self._ck._read_depth
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            yield
        except (FormatError, OSError) as e:  # IntegrityError, CorruptChunkError, StorageError ...
            if depth == 0:
                self._explain(e)
            raise
        finally:
            local.depth = depth
        if depth == 0:
            self.check_unchanged()

    def _explain(self, error: BaseException) -> None:
        """A replaced checkpoint explains a failed read best: raise that instead."""
        try:
            self.check_unchanged()
        except CheckpointChangedError as changed:
            raise changed from error
        except Exception:  # noqa: BLE001 - the root is unreadable too: the original error says more
            return

    # ---- leaves -----------------------------------------------------------------

    def array(self, key: str) -> LazyArray:
        """The :class:`LazyArray` of any array leaf (``bytes`` leaves included)."""
        full = self._full(key)
        if not self._ck._is_array(full):
            raise KeyError(f"{full!r} is a value, not an array")
        return LazyArray(self._ck, full)

    def node(self, key: str) -> dict:
        return self._ck._node(self._full(key))

    def is_array(self, key: str) -> bool:
        return self._ck._is_array(self._full(key))

    def is_packed(self, key: str) -> bool:
        return "packed" in self._ck._node(self._full(key))

    @checked_read
    def array_info(self, key: str) -> fmt.ArrayInfo:
        full = self._full(key)
        return self._ck._array_infos([full])[full]

    def unit_crcs(self, key: str) -> Any:
        """The table of chunk positions of ``key``'s array (spec §6.6, format 1.3 on: the
        CRC-32C each unit must carry, by its linear index in the unit grid), or None."""
        full = self._full(key)
        return self._ck._positions(full, self._ck._array_infos([full])[full])

    @checked_read
    def array_infos(self, keys: Iterable[str]) -> dict[str, fmt.ArrayInfo]:
        """Parsed and verified ``zarr.json`` of many arrays, read concurrently and cached.
        A packed leaf's info comes from its tree node (its pack is checked when read)."""
        keys = list(keys)
        infos = self._ck._array_infos([self._full(k) for k in keys])
        return {k: infos[self._full(k)] for k in keys}

    def read_box(self, key: str, box: Iterable[tuple[int, int]]) -> np.ndarray:
        """The part ``box`` (``(start, stop)`` per dimension) of an array leaf, as NumPy;
        reads only the chunks (inner chunks) it touches. The root is not re-checked: call
        :meth:`check_unchanged` after the reads (or read inside :meth:`reading`)."""
        return self._ck._read_box(self._full(key), tuple((int(a), int(b)) for a, b in box))

    def read_into(self, key: str, box: Iterable[tuple[int, int]], out: np.ndarray) -> Any:
        """Start reading the part ``box`` of an array leaf into ``out`` (its extent and the
        leaf's NumPy dtype; a strided view is fine); returns a future. The root is not
        re-checked: call :meth:`check_unchanged` after the reads (or read inside
        :meth:`reading`)."""
        return self._ck._read_into(self._full(key), tuple((int(a), int(b)) for a, b in box), out)

    def local_array(self, key: str) -> Any:
        """The array that reads leaf ``key``'s chunk files directly (its ``read_now`` runs a
        read in the calling thread: :class:`~zarrckpt.storage._localfile.ReadBatch`), or None."""
        return self._ck._local(self._full(key))

    def tile_shape(self, key: str) -> tuple[int, ...] | None:
        """The tile shape :meth:`read_tiles` reads for an array leaf (its stored inner chunk
        shape), or None where its storage cannot read tiles (packed leaves, TensorStore)."""
        return self._ck._tile_shape(self._full(key))

    def read_tiles(self, key: str, box: Iterable[tuple[int, int]], out: np.ndarray) -> Any:
        """Start reading the stored inner chunks that meet ``box`` of an array leaf whole
        into ``out`` (see :meth:`zarrckpt.storage.Array.read_tiles`); returns a future. The
        root is not re-checked, as :meth:`read_into`."""
        return self._ck._stored(self._full(key)).read_tiles(tuple((int(a), int(b)) for a, b in box), out)

    @checked_read
    def tensorstore(self, key: str) -> Any:
        """A TensorStore handle of an array leaf, for lazy slicing.

        An array of its own is opened from storage (nothing is read until sliced). A packed
        leaf is small (``pack_bytes`` at most): its bytes are read from its pack and returned
        as an in-memory, read-only TensorStore array of its data type and shape. Reads
        through the handle go straight to storage: call :meth:`check_unchanged` after them
        to be sure the checkpoint was not replaced meanwhile."""
        return self._ck._tensorstore(self._full(key))

    @checked_read
    def read(self, key: str) -> Any:
        """One leaf: an ndarray (ml_dtypes for bf16/fp8), ``bytes``, or the stored value."""
        return self._ck._read(self._full(key))

    @checked_read
    def to_dict(self, keys: Iterable[str] | None = None,
                load_array: Callable[[str], Any] | None = None, *, lazy: bool = False) -> dict:
        """The nested state dict under this view (or the part under ``keys``: exact keys or
        prefixes). Arrays are read as NumPy arrays; with ``lazy=True`` they are
        :class:`LazyArray` s instead (nothing is read). ``load_array(full key)`` overrides both."""
        load = load_array or (self._ck._leaf if lazy else None)
        if not self.prefix:
            return self._ck._to_dict(keys, load)
        full = [self.prefix] if keys is None else [self._full(k) for k in keys]
        out = self._ck._to_dict(full, load)
        for comp in self._ck._leaves[self._full_keys[0]][0][:self.prefix.count("/") + 1]:
            out = out[comp]
        return out

    def to_xarray(self) -> Any:
        """An ``xarray.Dataset`` of the array leaves under this view, dask-backed (needs
        xarray and dask): see :func:`zarrckpt.readers.dataset.to_dataset`."""
        from .dataset import to_dataset

        return to_dataset(self)

    # ---- the checkpoint's metadata ----------------------------------------------

    @property
    def metadata(self) -> dict[str, Any]:
        """The JSON object the save recorded in the root (``save(..., metadata=)``; the
        CheckpointManager's ``{"step": N, "metrics": {...}}``), or ``{}``."""
        return dict(self._ck.info.metadata or {})

    @property
    def step(self) -> int | None:
        """``metadata["step"]`` when the save recorded it, else the value of a top-level
        integer leaf ``step`` (``save({"model": ..., "step": 100}, ...)``), else None."""
        step = (self._ck.info.metadata or {}).get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            return step
        leaf = self._ck._leaves.get("step")
        if leaf is not None and "json" in leaf[1]:
            value = leaf[1]["json"]
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @property
    def metrics(self) -> dict[str, Any]:
        """``metadata["metrics"]`` (recorded by ``CheckpointManager.save(metrics=)``), or ``{}``."""
        metrics = (self._ck.info.metadata or {}).get("metrics")
        return dict(metrics) if isinstance(metrics, dict) else {}

    def __repr__(self) -> str:
        return _render(self, f"<zarrckpt.CheckpointView {self.prefix!r} of {self._ck.url!r}: "
                             f"{_count(self)}>")


class Checkpoint(CheckpointView):
    """A committed checkpoint, opened for reading. Holds no data until asked.

    The root :class:`CheckpointView`: ``ck["model/w"]`` is a :class:`LazyArray`,
    ``ck["model"]`` a view, ``ck["step"]`` a value; see :class:`CheckpointView`.
    ``info`` is the parsed root (:class:`zarrckpt.format.documents.RootInfo`), ``storage`` and
    ``url`` where it is.
    """

    def __init__(self, path: str | os.PathLike, storage_options: StorageOptions | None = None) -> None:
        super().__init__(self, "")
        self.storage = open_storage(path, storage_options)
        self.url = self.storage.url
        _refuse_plain_file(self.storage)
        data, generation = self._read_document("zarr.json", "the root")
        if data is None:
            raise CheckpointNotFoundError(_not_found_message(self.storage))
        self.info = fmt.parse_root_bytes(data, self.url)
        self._root_bytes = data  # what check_unchanged compares with (spec §7.3)
        self._root_generation = generation
        self._read_depth = threading.local()  # per thread: how deep in reading() it is
        self._leaves: dict[str, tuple[ztree.KeyPath, dict]] = {
            key: (kp, node) for kp, key, node in self.info.leaves}
        self._arrays: dict[str, fmt.ArrayInfo] = {}
        self._packs: dict[str, np.ndarray] = {}
        self._handles: dict[Any, Any] = {}  # path -> Array; ("tensorstore", key) -> handle
        self._checked_files: set[str] = set()

    @functools.cached_property
    def _groups(self) -> frozenset[str]:
        """Every proper prefix of a leaf key (``model``, ``model/layers.0`` ...)."""
        out = set()
        for k in self._leaves:
            parts = k.split("/")
            out.update("/".join(parts[:i]) for i in range(1, len(parts)))
        return frozenset(out)

    @property
    def save_id(self) -> str:
        return self.info.save_id

    @property
    def created(self) -> str:
        """UTC time the save started (RFC 3339)."""
        return self.info.created

    @property
    def world_size(self) -> int:
        """How many processes saved it."""
        return self.info.world_size

    def __reduce__(self) -> tuple:
        # Pickled (dask's multiprocessing/distributed schedulers): reopened by URL, and
        # refused if another save replaced the checkpoint meanwhile.
        where = self.storage.local_path or self.url
        return _reopen, (where, self.storage.options, self.info.save_id)

    # ---- keys (full keys from here on) -----------------------------------------

    def _node(self, key: str) -> dict:
        try:
            return self._leaves[key][1]
        except KeyError:
            raise KeyError(self._no_key(key)) from None

    def _is_array(self, key: str) -> bool:
        node = self._node(key)
        return "array" in node or "packed" in node

    def _leaf(self, key: str) -> Any:
        """What ``ck[key]`` returns for a leaf: a LazyArray, bytes, or the value."""
        node = self._node(key)
        if "packed" in node:
            kind = node["packed"].get("kind")
        elif "array" in node:
            kind = self._array_infos([key])[key].kind
        else:
            return self._read(key)
        return self._read(key) if kind in fmt.BYTE_KINDS else LazyArray(self, key)

    # ---- metadata -----------------------------------------------------------

    def _array_infos(self, keys: list[str]) -> dict[str, fmt.ArrayInfo]:
        todo = [k for k in keys if k not in self._arrays]
        futures = []
        for k in todo:
            node = self._node(k)
            if "packed" in node:
                self._arrays[k] = fmt.parse_packed(node["packed"], k)
                continue
            if "array" not in node:
                raise KeyError(f"{k!r} is a value, not an array")
            if self.info.consolidated is not None:  # one read of the root was all (spec §6.7)
                self._arrays[k] = self._parse_entry(k, k, pack=False)
                continue
            self._check_document(f"{k}/zarr.json", f"array {k!r}: zarr.json")
            futures.append((k, self.storage.get(f"{k}/zarr.json")))
        for k, f in futures:
            self._arrays[k] = self._parse_array(k, k, _result_bytes(f, f"{self.url}/{k}/zarr.json"),
                                                pack=False)
        return {k: self._arrays[k] for k in keys}

    def _parse_array(self, key: str, path: str, data: bytes | None, *, pack: bool) -> fmt.ArrayInfo:
        doc = None
        if data is not None:
            fmt.check_array_digest(self.info, path, data, key)
            doc = fmt.decode_document(data, f"array {key!r}: {path}/zarr.json")
        return fmt.parse_array(doc, key, self.info.save_id, path=path, pack=pack, version=self.info.version)

    def _parse_entry(self, key: str, path: str, *, pack: bool) -> fmt.ArrayInfo:
        """The array at ``path`` from the root's consolidated metadata (spec §6.7): the
        root's digest covers it, so no other document is read."""
        return fmt.parse_array(self.info.consolidated[path], key, self.info.save_id, path=path, pack=pack,
                               version=self.info.version)

    def _read_document(self, key: str, what: str) -> tuple[bytes | None, bytes]:
        """(the document's bytes or None, their storage generation)."""
        self._check_document(key, f"{self.url}: {what} {key}")
        return self.storage.read_bytes(key)

    def _check_document(self, key: str, what: str) -> None:
        """Local file systems: a document about to be read is a regular file (spec §3.2)."""
        local = self.storage.local_path
        if local is not None:
            _require_regular(os.path.join(local, key), what, missing_ok=True)

    def _check_files(self, path: str, key: str) -> None:
        """Local file systems: ``<path>/zarr.json`` and every chunk file of the array must be
        regular files (a FIFO or a device would hang or never end a read). Arrays read
        through TensorStore, which opens chunk files itself, and ``verify`` walk them all
        here; an array whose ``checks_files`` is true (the direct reader) checks each chunk
        file it opens instead, so a load makes no metadata call per array."""
        local = self.storage.local_path
        if local is None or path in self._checked_files:
            return
        base = os.path.join(local, path)
        _require_regular(os.path.join(base, "zarr.json"), f"array {key!r}: zarr.json", missing_ok=True)
        stack = [os.path.join(base, "c")]
        while stack:
            p = stack.pop()
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue  # missing chunks are reported when read
            except OSError as e:
                raise storage_error(f"array {key!r}: cannot inspect {p}", e) from e
            if stat.S_ISDIR(st.st_mode):
                if p.count(os.sep) - base.count(os.sep) > fmt.MAX_RANK + 1:
                    raise FormatError(f"array {key!r}: chunk directories nest deeper than any chunk key")
                with os.scandir(p) as it:
                    stack.extend(e.path for e in it)
            elif not stat.S_ISREG(st.st_mode):
                raise FormatError(f"array {key!r}: {p} is not a regular file ({file_type(st.st_mode)}); "
                                  "a chunk must be a regular file")
        self._checked_files.add(path)

    # ---- data: the read primitive --------------------------------------------------

    def _read_into(self, key: str, box: Box, out: np.ndarray) -> Any:
        """Every read of array data goes through here (``load``, ``load_state_dict``,
        ``LazyArray``, ``verify``, ``convert``, ``zarrckpt.jax``, xarray/dask): the part
        ``box`` (global ``(start, stop)`` per dimension) of the array at ``key`` into
        ``out`` (an array of the box's extent and the array's NumPy dtype; a strided view
        is fine). ``key`` is a leaf key (an array of its own or a packed leaf) or a pack's
        path. Returns a future; :func:`~zarrckpt.storage.inflight.wait_all` and ``InFlight``
        name the key in its errors. Packed leaves are resolved here and nowhere else: their
        bytes come from their pack, read whole once and cached."""
        if not out.size:
            return _done()
        node = self._leaves.get(key)
        if node is not None and "packed" in node[1]:
            out[...] = self._packed_leaf(key)[tuple(slice(a, b) for a, b in box)]
            return _done()
        return self._stored(key).read_into(box, out)

    def _local(self, key: str) -> Any:
        """The :class:`~zarrckpt.storage._localfile.LocalArray` that reads leaf ``key``'s
        chunk files directly, or None (a packed leaf, an array read through TensorStore)."""
        node = self._leaves.get(key)
        if node is not None and "packed" in node[1]:
            return None
        array = self._stored(key)
        return array if getattr(array, "read_now", None) is not None else None

    def _tile_shape(self, key: str) -> tuple[int, ...] | None:
        node = self._leaves.get(key)
        if node is not None and "packed" in node[1]:
            return None
        return self._stored(key).tile_shape()

    def _read_box(self, key: str, box: Box) -> np.ndarray:
        """The part ``box`` of the array at ``key`` as a new NumPy array (:meth:`_read_into`)."""
        info = self._info_at(key)
        out = np.empty([b - a for a, b in box], dtype=info.dtype.numpy)
        wait_all([(key, self._read_into(key, box, out))])
        return out

    def _info_at(self, key: str) -> fmt.ArrayInfo:
        """The verified info of a leaf key or of a pack's path."""
        if key in self._leaves:
            return self._array_infos([key])[key]
        return self._pack_info(key)

    def _stored(self, path: str) -> Array:
        """The array stored at ``path`` (an array leaf's key or a pack's path), opened once."""
        array = self._handles.get(path)
        if array is None:
            info = self._info_at(path)
            try:
                array = self.storage.open_for_read(path, info.metadata, self._positions(path, info)).result()
            except Exception as e:  # noqa: BLE001
                raise translate_error(e, path) from e
            if not array.checks_files:  # TensorStore opens the chunk files itself
                self._check_files(path, path)
            self._handles[path] = array
        return array

    def _positions(self, path: str, info: fmt.ArrayInfo) -> np.ndarray | None:
        """The table of chunk positions of the array at ``path`` (spec §6.6, format 1.3 on;
        None before): the CRC-32C each of its units must carry, checked against its metadata."""
        if self.info.chunk_tables is None:
            return None
        return fmt.parse_chunk_table(self.info.chunk_tables[path], info.metadata, info.key)

    def _pack_info(self, path: str, leaf: str | None = None) -> fmt.ArrayInfo:
        """The verified info of the pack at ``path``; errors name ``leaf`` (a leaf packed in
        it) when given."""
        info = self._arrays.get(path)
        if info is None:
            if path not in self._pack_paths:
                raise KeyError(self._no_key(path))
            key = leaf or path
            if self.info.consolidated is not None:
                info = self._arrays[path] = self._parse_entry(key, path, pack=True)
            else:
                data = self._read_document(f"{path}/zarr.json", f"pack of {key!r}")[0]
                info = self._arrays[path] = self._parse_array(key, path, data, pack=True)
        return info

    @functools.cached_property
    def _pack_paths(self) -> frozenset[str]:
        return frozenset(n["packed"]["pack"] for _, n in self._leaves.values() if "packed" in n)

    def _packed_leaf(self, key: str) -> np.ndarray:
        """A packed leaf's data (spec §6.5): a read-only view of its bytes in its pack (each
        pack is read whole once, then cached), as the leaf's dtype and shape (``uint8`` for
        byte kinds)."""
        desc = self._node(key)["packed"]
        info = fmt.parse_packed(desc, key)
        path = desc["pack"]
        pack = self._packs.get(path)
        if pack is None:
            pack = self._read_box(path, ((0, self._pack_info(path, key).shape[0]),))
            pack.flags.writeable = False
            self._packs[path] = pack
        start, n = desc["offset"], desc["nbytes"]
        if start + n > pack.shape[0]:
            raise FormatError(f"packed leaf {key!r}: bytes {start}..{start + n} outside pack "
                              f"{path!r} of {pack.shape[0]} bytes")
        return pack[start:start + n].view(info.dtype.numpy).reshape(info.shape)

    def _tensorstore(self, key: str) -> Any:
        """A TensorStore handle for users (``tensorstore()``); zarrckpt itself never reads
        through it."""
        handle = self._handles.get(("tensorstore", key))
        if handle is None:
            if "packed" in self._node(key):
                handle = in_memory_array(self._packed_leaf(key))
            else:
                info = self._array_infos([key])[key]
                try:
                    handle = self.storage.open_tensorstore(key, info.metadata).result()
                except Exception as e:  # noqa: BLE001
                    raise translate_error(e, key) from e
                self._check_files(key, key)
            self._handles[("tensorstore", key)] = handle
        return handle

    def _read(self, key: str) -> Any:
        """A whole leaf: an ndarray (a copy), ``bytes`` for byte kinds, or the stored value."""
        node = self._node(key)
        if "array" not in node and "packed" not in node:
            return ztree.decode_tree(node, _no_array, key)
        info = self._array_infos([key])[key]
        out = self._read_box(key, tuple((0, s) for s in info.shape))
        return out.tobytes() if info.kind in fmt.BYTE_KINDS else out

    def _to_dict(self, keys: Iterable[str] | None, load_array: Callable[[str], Any] | None) -> dict:
        tree = self.info.tree if keys is None else self._prune(list(keys))
        by_packed = {id(n["packed"]): k for k, (_, n) in self._leaves.items() if "packed" in n}

        def leaf(body: Any) -> Any:
            key = by_packed[id(body)] if isinstance(body, dict) else body  # an array node: its key
            return (load_array or self._read)(key)

        return ztree.decode_tree(tree, leaf)

    def _prune(self, wanted: list[str]) -> dict:
        """The tree cut to ``wanted``: exact keys, or prefixes (with or without a trailing
        ``/``). A key that is neither is a MissingKeysError with the nearest keys."""
        wanted = [w.rstrip("/") if isinstance(w, str) and len(w) > 1 else w for w in wanted]
        for w in wanted:
            if not isinstance(w, str):
                raise TypeError(f"checkpoint keys are '/'-joined strings such as 'model/w', not "
                                f"{type(w).__name__} {w!r:.60}")
            if w not in self._leaves and w not in self._groups:
                raise MissingKeysError(self._no_key(w, "no key (nor keys under)"))

        def keep(path: ztree.KeyPath) -> bool:
            k = ztree.key_of(path)
            return any(k == w or k.startswith(w + "/") or w.startswith(k + "/") for w in wanted)

        def walk(node: dict, path: ztree.KeyPath) -> dict | None:
            ((kind, body),) = node.items()
            if kind == "dict":
                items = [[k, sub] for k, v in body if keep(path + (k,))
                         for sub in [walk(v, path + (k,))] if sub is not None]
                return {"dict": items}
            return node

        return walk(self.info.tree, ())

    def __repr__(self) -> str:
        step = self.step
        return _render(self, f"<zarrckpt.Checkpoint {self.url!r}"
                             + (f" step {step}" if step is not None else "")
                             + f": {_count(self)}, saved {self.info.created} by {self.info.world_size} "
                             + ("process>" if self.info.world_size == 1 else "processes>"))


def _changed_message(ck: Checkpoint, data: bytes | None) -> str:
    """Which save the handle read from, and what the path holds now."""
    if data is None:
        now = "no root zarr.json"
    else:
        attrs = fmt.root_attributes(data) or {}
        now = (f"save {attrs.get('save_id')}, {attrs.get('state')}" if attrs
               else "a root zarr.json that is not a zarrckpt root")
    return (f"checkpoint {ck.url!r} was replaced while it was being read (opened save "
            f"{ck.info.save_id}; the path now holds {now}): what was read may mix both saves; "
            "open or load it again")


def _reopen(where: str, options: StorageOptions, save_id: str) -> Checkpoint:
    ck = Checkpoint(where, options)
    if ck.info.save_id != save_id:
        raise CheckpointChangedError(f"checkpoint {ck.url!r} was replaced (save {save_id} -> "
                                     f"{ck.info.save_id}) since it was opened")
    return ck


# ------------------------------------------------------------------ repr


_REPR_LEAVES = 200  # leaves a repr shows (arrays' metadata is read for them)


def _count(view: CheckpointView) -> str:
    n_arrays = sum(view._ck._is_array(k) for k in view._full_keys)
    n = len(view)
    return f"{n} key{'s' if n != 1 else ''} ({n_arrays} array{'s' if n_arrays != 1 else ''})"


def _render(view: CheckpointView, header: str) -> str:
    """The header, then the tree: groups as ``name/`` headings, arrays with dtype, shape,
    size and layout, values as ``name = value`` (short lists of values on one line)."""
    ck = view._ck
    shown = view._full_keys[:_REPR_LEAVES]
    try:
        ck._array_infos([k for k in shown if ck._is_array(k)])
    except Exception as e:  # noqa: BLE001 - a repr never raises
        return f"{header}\n  (metadata unreadable: {e})"
    lines = [header]
    open_groups: list[str] = []
    inline: str | None = None  # a group shown on one line: skip its leaves
    for i, full in enumerate(shown):
        if inline is not None and full.startswith(inline + "/"):
            continue
        inline = None
        parts = view._rel(full).split("/")
        common = 0
        while common < min(len(open_groups), len(parts) - 1) and open_groups[common] == parts[common]:
            common += 1
        open_groups = open_groups[:common]
        for g in parts[common:-1]:
            group = "/".join(filter(None, [view.prefix, *open_groups, g]))
            short = _short_list(ck, group, view._full_keys[i:i + 9])
            indent = "  " * (len(open_groups) + 1)
            if short is not None:
                lines.append(f"{indent}{g} = {short}")
                inline = group
                break
            lines.append(f"{indent}{g}/")
            open_groups.append(g)
        if inline is not None:
            continue
        indent = "  " * (len(open_groups) + 1)
        try:
            if ck._is_array(full):
                a = LazyArray(ck, full)
                if a.kind in fmt.BYTE_KINDS:
                    lines.append(f"{indent}{parts[-1]}  {a.kind} ({format_bytes(a.nbytes)})")
                else:
                    lines.append(f"{indent}{parts[-1]}  {describe(a)}")
            else:
                value = repr(ck._read(full))
                lines.append(f"{indent}{parts[-1]} = {value if len(value) <= 60 else value[:57] + '...'}")
        except Exception as e:  # noqa: BLE001
            lines.append(f"{indent}{parts[-1]}  (unreadable: {e})")
    if len(view) > len(shown):
        lines.append(f"  ... {len(view) - len(shown)} more keys")
    return "\n".join(lines)


def _short_list(ck: Checkpoint, group: str, following: list[str]) -> str | None:
    """The repr of a group that is a list or tuple of at most 8 values and fits on a line.
    ``following``: the leaf keys from the group's first on (a group's leaves are
    consecutive in stored order)."""
    keys = [k for k in following if k.startswith(group + "/")]
    if not 0 < len(keys) <= 8 or any(ck._is_array(k) or "/" in k[len(group) + 1:] for k in keys):
        return None
    value = CheckpointView(ck, group).to_dict()
    if not isinstance(value, (list, tuple)):
        return None
    text = repr(value)
    return text if len(text) <= 60 else None


def _done() -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(None)
    return f


def _no_array(key: str) -> Any:  # pragma: no cover - values never hold arrays
    raise FormatError(f"value node refers to array {key!r}")


def _result_bytes(future: Any, where: str) -> bytes | None:
    """The result of a :meth:`Storage.get` future (a StorageError naming ``where``)."""
    try:
        return future.result()
    except ValueError as e:  # a Storage whose futures fail with the backend's error
        raise storage_error(f"reading {where}", e) from e


def _require_regular(path: str, what: str, *, missing_ok: bool) -> None:
    """``path`` (symlinks followed) is a regular file, or absent when ``missing_ok``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    except NotADirectoryError:
        return  # a parent is a file: the read reports it missing
    except OSError as e:
        raise storage_error(f"{what}: cannot inspect {path}", e) from e
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{what} ({path}) is {file_type(st.st_mode)}, not a regular file")


# ------------------------------------------------------------------ not a checkpoint

_CONVERTER = ("convert it with `zarrckpt convert SRC DST` or zarrckpt.convert (from_dcp, from_safetensors, "
              "from_torch_save)")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def _refuse_plain_file(storage: Storage) -> None:
    """A local path that is a file is never a checkpoint (a checkpoint is a directory)."""
    local = storage.local_path
    if local is None:
        return
    path = local.rstrip("/") or "/"
    if os.path.isfile(path):
        raise CheckpointNotFoundError(f"{storage.url!r} is {_file_kind(path)}, not a zarrckpt "
                                      "checkpoint (a checkpoint is a directory with a zarr.json)")


def _file_kind(path: str) -> str:
    name = os.path.basename(path)
    if name.endswith(".safetensors"):
        return f"a safetensors file; {_CONVERTER}"
    if name.endswith(_TORCH_SUFFIXES):
        return f"a torch.save file; {_CONVERTER}"
    return "a file"


def _not_found_message(storage: Storage) -> str:
    """Why there is no checkpoint at the location, naming what is there instead if it is a
    format people confuse with this one."""
    def has(key: str) -> bool:
        local = storage.local_path
        if local is not None:
            return os.path.exists(os.path.join(local, key))
        try:
            return storage.read_bytes(key)[0] is not None
        except Exception:  # noqa: BLE001 - only a hint
            return False

    url = storage.url
    if has(".metadata"):
        return (f"{url!r} is a PyTorch Distributed Checkpoint (DCP) directory (it has a .metadata "
                f"file), not a zarrckpt checkpoint; {_CONVERTER}")
    local = storage.local_path
    names = []
    if local is not None and os.path.isdir(local):
        try:
            names = sorted(os.listdir(local))
        except OSError:
            names = []
    if has("model.safetensors") or has("model.safetensors.index.json") or any(
            n.endswith(".safetensors") for n in names):
        return f"{url!r} holds safetensors files, not a zarrckpt checkpoint; {_CONVERTER}"
    torch_files = [n for n in names if n.endswith(_TORCH_SUFFIXES)]
    if torch_files:
        return (f"no zarrckpt checkpoint at {url!r} (no zarr.json); it holds torch.save files "
                f"({', '.join(torch_files[:3])}); {_CONVERTER}")
    return f"no zarrckpt checkpoint at {url!r} (no zarr.json)"


def open_checkpoint(path: str | os.PathLike, *, storage: StorageOptions | None = None,
                    **storage_options: Any) -> Checkpoint:
    """Open a committed checkpoint for reading (no torch needed): a lazy, read-only view.
    ``storage``, or ``StorageOptions`` fields as keywords (``endpoint=`` ...), say how to
    reach it."""
    if storage is not None and storage_options:
        raise TypeError("pass either storage= or StorageOptions fields as keywords, not both")
    return Checkpoint(path, storage or (StorageOptions(**storage_options) if storage_options else None))
