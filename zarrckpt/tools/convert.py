"""Converters between zarrckpt and PyTorch DCP, ``torch.save`` and Hugging Face safetensors.

>>> from zarrckpt import convert                                           # doctest: +SKIP
>>> convert.from_safetensors("hf_model/", "ckpt")                          # doctest: +SKIP
>>> convert.to_safetensors("ckpt", "hf_out/", keys={"model/": ""},         # doctest: +SKIP
...                        dtype="bfloat16", max_shard_size="2GB")
>>> convert.convert("dcp_dir", "ckpt")         # formats detected            # doctest: +SKIP

Every function streams: a source is read tensor by tensor, and each tensor in pieces of at
most ``memory_limit / 8`` bytes (a piece is contiguous in C order, so file formats write it
sequentially and zarrckpt stores it as exactly one chunk); writes in flight are bounded
too, so the converting process holds about ``memory_limit`` bytes of tensor data at most,
whatever the checkpoint's size (``tests/test_convert_memory.py`` measures it). One
exception: :func:`to_dcp` writes a tuple holding tensors as one DCP item, as ``dcp.save``
does, so it holds that tuple's tensors at once.

Common options:

``keys``
    Which leaves, under which names (:func:`zarrckpt.interop.common.key_selector`): None
    (all); a prefix or a list of prefixes (string prefixes of the key: ``"model/"``); a
    mapping ``{old prefix: new prefix}`` (``{"model/": ""}``); or a callable
    ``key -> new key | None``. Keys are zarrckpt keys: escaped components joined by ``/``
    (spec §4). A Hugging Face name such as ``model.layers.0.weight`` is one component and
    its own key; DCP and ``torch.save`` leaves have the key of their path in the nested
    state dict (``model/layer.weight``).
``dtype``
    Cast floating-point arrays (float16/32/64, bfloat16, float8) to this dtype (``"bf16"``,
    ``torch.float16`` ...), or a mapping ``{from: to}`` of dtypes. None keeps every dtype.
``progress``
    ``callable(Progress)``, called after every piece and every leaf.
``memory_limit``
    Bytes of tensor data the conversion may hold at once (default 1 GiB).
``overwrite``
    Replace what is at ``dst`` (otherwise an existing destination is refused).
``strict``
    True: a leaf that cannot be converted (a dtype the destination lacks, a value that
    ``torch.load(weights_only=True)`` refuses) is an error. False: it is skipped and listed
    in the report. Non-tensor leaves are always skipped for safetensors, which holds
    tensors only.

Names survive round trips: a safetensors name comes back unchanged (it is one key
component), DCP's flattened names are rebuilt from its ``planner_data`` (so
``{"model": {"layer.weight": t}}`` is ``model/layer.weight`` in zarrckpt and
``model.layer.weight`` in DCP), and dtypes are kept bit for bit (bf16 and fp8 included)
unless ``dtype`` says otherwise.

Nothing is unpickled except by torch's ``weights_only`` unpickler, and DCP's
``.metadata`` by an allow-list of exactly the classes DCP writes there
(:mod:`zarrckpt.interop.dcp` says what and why). safetensors and zarrckpt conversions
need no torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format import dtypes as zdt
from ..format import documents as fmt
from ..engine.writer import Writer
from ..errors import CheckpointExistsError, CheckpointNotFoundError, MissingKeysError, UnsupportedValueError
from ..interop import common as cm
from ..storage import StorageOptions

__all__ = [
    "ConversionReport",
    "FORMATS",
    "Progress",
    "convert",
    "detect_format",
    "from_dcp",
    "from_safetensors",
    "from_torch_save",
    "to_dcp",
    "to_safetensors",
    "to_torch_save",
]

FORMATS = ("zarrckpt", "dcp", "safetensors", "torch_save")
DEFAULT_MEMORY_LIMIT = 1 << 30
_OVERWRITE = "overwrite=True"  # how refusals to replace a destination name the option


@dataclass(frozen=True)
class Progress:
    """Where a conversion is: ``bytes_done`` of ``bytes_total`` bytes of array data read,
    ``leaves_done`` of ``leaves_total`` leaves written; ``key`` the leaf being written."""

    key: str
    bytes_done: int
    bytes_total: int
    leaves_done: int
    leaves_total: int


@dataclass
class ConversionReport:
    """What a conversion did."""

    source: str
    destination: str
    source_format: str
    destination_format: str
    leaves: int = 0  # leaves written
    arrays: int = 0  # of which arrays
    bytes: int = 0  # array bytes read
    seconds: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    files: list[str] = field(default_factory=list)  # files written (file formats)


@dataclass
class _Item:
    leaf: cm.ArrayLeaf | cm.ValueLeaf
    path: tuple
    key: str
    containers: tuple | None
    dtype: zdt.DType | None = None  # arrays: the dtype written
    chunk: tuple[int, ...] = ()
    members: list[_Item] = field(default_factory=list)  # a sink's item made of several leaves

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kind of each container on the way to the leaf (dicts where none is said)."""
        given = tuple(self.containers or ())[:len(self.path) - 1]
        return given + ("dict",) * (len(self.path) - 1 - len(given))

    @property
    def nbytes(self) -> int:
        """Bytes of array data to read for it."""
        own = self.leaf.nbytes if isinstance(self.leaf, cm.ArrayLeaf) else 0
        return own + sum(m.nbytes for m in self.members)


# ------------------------------------------------------------------ formats


def detect_format(path: str | os.PathLike) -> str:
    """``"zarrckpt"``, ``"dcp"``, ``"safetensors"`` or ``"torch_save"`` for a local path (a
    URL is taken to be zarrckpt); CheckpointNotFoundError if it is none of them."""
    p = os.fspath(path)
    if "://" in p and not p.startswith("file://"):
        return "zarrckpt"
    p = p.removeprefix("file://")
    if os.path.isdir(p):
        names = set(os.listdir(p))
        if "zarr.json" in names:
            return "zarrckpt"
        if ".metadata" in names:
            return "dcp"
        if any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
            return "safetensors"
        raise CheckpointNotFoundError(f"{p} is a directory holding no zarrckpt checkpoint, DCP checkpoint "
                                      "or safetensors files")
    if os.path.isfile(p):
        if p.endswith(".safetensors") or p.endswith(".safetensors.index.json"):
            return "safetensors"
        with open(p, "rb") as fh:
            head = fh.read(8)
        if head[:4] == b"PK\x03\x04":
            return "torch_save"
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if 0 < n < 100_000_000:
            with open(p, "rb") as fh:
                fh.seek(8)
                if fh.read(1) == b"{":
                    return "safetensors"
        raise CheckpointNotFoundError(f"{p} is neither a torch.save zip file nor a safetensors file")
    raise CheckpointNotFoundError(f"nothing at {p}")


def _open_source(fmt_name: str, src: Any, limit: int, storage: StorageOptions | None, strict: bool) -> Any:
    piece = _piece_budget(limit)
    if fmt_name == "zarrckpt":
        from ..interop.source import Source

        return Source(src, storage)
    if fmt_name == "safetensors":
        from ..interop.safetensors_io import Source

        return Source(src, piece)
    if fmt_name == "torch_save":
        from ..interop.torch_save import Source

        return Source(src, piece)
    if fmt_name == "dcp":
        from ..interop.dcp import Source

        return Source(src, piece, strict)
    raise ValueError(f"unknown format {fmt_name!r}; one of {', '.join(FORMATS)}")


def _piece_budget(limit: int) -> int:
    if not isinstance(limit, int) or limit < (64 << 10):
        raise ValueError(f"memory_limit must be an int of at least 64 KiB, not {limit!r}")
    return limit // 16


# ------------------------------------------------------------------ sinks


class _ZarrSink:
    name = "zarrckpt"

    def __init__(self, dst: Any, overwrite: bool, limit: int, metadata: dict | None, storage: StorageOptions | None,
                 compression: Any, pack_bytes: int, inner_chunk_bytes: int) -> None:
        piece = _piece_budget(limit)
        self.w = Writer(dst, overwrite=overwrite, metadata=metadata, compression=compression,
                        inner_chunk_bytes=inner_chunk_bytes, pack_bytes=min(pack_bytes, piece),
                        pack_limit=max(min(16 << 20, piece), min(pack_bytes, piece)),
                        max_inflight_bytes=max(limit // 16, 1), storage=storage)
        self.dst = self.w.url

    def accept(self, item: _Item) -> str | None:
        if isinstance(item.leaf, cm.ValueLeaf):
            try:
                from ..format.tree import encode_tree

                encode_tree({"v": item.leaf.value}, lambda x: False)
            except UnsupportedValueError as e:
                return str(e)
        return None

    def plan(self, items: list[_Item]) -> list[_Item]:
        return items

    def write(self, item: _Item, pieces: Iterator[tuple[tuple, np.ndarray]]) -> None:
        leaf = item.leaf
        if isinstance(leaf, cm.ValueLeaf):
            self.w.add(item.path, leaf.value, containers=item.containers)
            return
        a = self.w.add_array(item.path, leaf.shape, item.dtype, kind=leaf.kind, chunk_shape=item.chunk,
                             containers=item.containers)
        for start, data in pieces:
            a.write(start, data)

    def commit(self) -> list[str]:
        self.w.commit()
        return []

    def abandon(self) -> None:
        self.w.abandon()


class _SafetensorsSink:
    name = "safetensors"

    def __init__(self, dst: Any, overwrite: bool, max_shard_size: Any, prefix: str,
                 metadata: dict[str, str] | None) -> None:
        from ..interop import safetensors_io as st

        self.st = st
        self.dst = os.path.abspath(os.fspath(dst))
        self.single = self.dst.endswith(".safetensors")
        self.max = None if self.single else st.parse_size(max_shard_size)
        self.prefix = prefix
        self.metadata = metadata
        self.old = st.check_destination(self.dst, prefix, overwrite, self.single)
        self.names: dict[str, str] = {}
        self.writers: list[Any] = []
        self.files: list[str] = []

    def accept(self, item: _Item) -> str | None:
        leaf = item.leaf
        if isinstance(leaf, cm.ValueLeaf):
            return "not a tensor (safetensors holds tensors only)"
        if leaf.kind in ("bytes", "bytesio"):
            return f"a {leaf.kind} leaf, not a tensor (safetensors holds tensors only)"
        if item.dtype.zarr not in self.st.FROM_ZARR:
            return f"dtype {item.dtype.zarr} has no safetensors dtype (cast it with dtype=)"
        return None

    @staticmethod
    def is_expected_skip(item: _Item) -> bool:
        return isinstance(item.leaf, cm.ValueLeaf) or item.leaf.kind in ("bytes", "bytesio")

    def plan(self, items: list[_Item]) -> list[_Item]:
        st = self.st
        planned = []
        for it in items:
            name = cm.dotted(it.path)
            if name in self.names:
                raise UnsupportedValueError(f"keys {self.names[name]!r} and {it.key!r} both have the safetensors "
                                            f"name {name!r}; rename one with keys=")
            self.names[name] = it.key
            planned.append(st.Planned(name, it.dtype, it.leaf.shape, it))
        shards = [st.order(s) for s in st.shard(st.order(planned), self.max)]
        if self.single:
            paths = [self.dst]
        else:
            os.makedirs(self.dst, exist_ok=True)
            paths = [os.path.join(self.dst, n) for n in st.shard_names(self.prefix, len(shards))]
        meta = dict(self.metadata) if self.metadata is not None else {"format": "pt"}
        self.shards = list(zip(paths, shards))
        self.weight_map = {p.name: os.path.basename(path) for path, s in self.shards for p in s}
        self.total = sum(p.nbytes for p in planned)
        self.meta = meta
        self._queue = [(path, s) for path, s in self.shards]
        self._current = None
        self._left: list = []
        return [p.item for _, s in self.shards for p in s]

    def write(self, item: _Item, pieces: Iterator[tuple[tuple, np.ndarray]]) -> None:
        if not self._left:
            if self._current is not None:
                self._current.finish()
            path, s = self._queue.pop(0)
            self._current = self.st.FileWriter(path, s, self.meta)
            self.writers.append(self._current)
            self._left = list(s)
        planned = self._left.pop(0)
        assert planned.item is item
        for _, data in pieces:
            self._current.write(data)

    def commit(self) -> list[str]:
        import json

        st = self.st
        for path, s in self._queue:  # files with no tensor: only when nothing was selected
            w = st.FileWriter(path, s, self.meta)
            self.writers.append(w)
        self._queue = []
        for w in self.writers:
            if w.fh.closed is False:
                w.finish()
        finals = {w.final for w in self.writers}
        for old in self.old:
            if old not in finals and os.path.exists(old):
                os.remove(old)
        for w in self.writers:
            os.replace(w.tmp, w.final)
        self.files = [w.final for w in self.writers]
        if not self.single and len(self.writers) > 1:
            index = os.path.join(self.dst, f"{self.prefix}{st.INDEX_SUFFIX}")
            tmp = index + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))},
                          fh, indent=2, ensure_ascii=False)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, index)
            self.files.append(index)
        return self.files

    def abandon(self) -> None:
        for w in self.writers:
            w.discard()


class _TorchSaveSink:
    name = "torch_save"

    def __init__(self, dst: Any, overwrite: bool) -> None:
        from ..interop.torch_save import Sink

        self.s = Sink(dst, overwrite)
        self.dst = self.s.dst

    def accept(self, item: _Item) -> str | None:
        if isinstance(item.leaf, cm.ArrayLeaf) and item.leaf.kind in ("tensor", "ndarray"):
            try:
                zdt.torch_dtype(item.dtype)
            except UnsupportedValueError as e:
                return str(e)
        if isinstance(item.leaf, cm.ArrayLeaf) and item.leaf.kind in ("bytes", "bytesio") and not item.leaf.nbytes:
            return ("an empty bytes value: torch pickles b'' as a call of bytes(), which "
                    "torch.load(weights_only=True) refuses to read back")
        if isinstance(item.leaf, cm.ValueLeaf):
            from ..interop.torch_save import unloadable_int

            if unloadable_int(item.leaf.value) is not None:
                return ("it holds an integer of more than 255 bytes (about 614 digits), which "
                        "torch.load(weights_only=True) cannot read back; store it as a string")
        return None

    def plan(self, items: list[_Item]) -> list[_Item]:
        from ..interop.torch_save import tensor_spec

        entries = []
        self.arrays = []
        for it in items:
            leaf = it.leaf
            if isinstance(leaf, cm.ValueLeaf):
                entries.append((it, it.path, it.containers, leaf.value))
            elif leaf.kind in ("bytes", "bytesio"):  # bytes objects, read now (small: RNG states, blobs)
                data = leaf.read(((0, leaf.shape[0]),)) if leaf.shape[0] else np.empty(0, np.uint8)
                entries.append((it, it.path, it.containers, data.tobytes()))
            else:
                entries.append((it, it.path, it.containers, tensor_spec(leaf.shape, it.dtype)))
                self.arrays.append(it)
        self.s.begin(entries)
        return self.arrays

    def write(self, item: _Item, pieces: Iterator[tuple[tuple, np.ndarray]]) -> None:
        self.s.write_array(item, pieces)

    def commit(self) -> list[str]:
        self.s.commit()
        return [self.s.dst]

    def abandon(self) -> None:
        self.s.abandon()


class _DCPSink:
    """DCP items as ``dcp.save`` makes them (:func:`zarrckpt.interop.dcp.dcp_items`): a
    tuple, or a list holding neither tensors nor dicts, is one item ``torch.save``-d whole
    (its leaves read and assembled), a plain-JSON dict is traversed, and an empty dict,
    for which DCP stores nothing, is skipped and listed in the report."""

    name = "dcp"

    def __init__(self, dst: Any, overwrite: bool) -> None:
        from ..interop.dcp import Sink

        self.s = Sink(dst, overwrite)
        self.dst = self.s.dir
        self.dropped: list[tuple[str, str]] = []

    accept = _TorchSaveSink.accept

    def plan(self, items: list[_Item]) -> list[_Item]:
        from ..interop.dcp import dcp_items

        atoms = [a for it in items for a in _atoms(it)]
        groups = dcp_items([(a.path, a.kinds, _dcp_what(a)) for a in atoms])
        planned = []
        for n, members in groups:
            first = atoms[members[0]]
            if n == len(first.path):
                planned.append(first)
            else:
                path = first.path[:n]
                planned.append(_Item(cm.ValueLeaf(path, None, first.kinds[:n - 1]), path, cm.key_of(path),
                                     first.kinds[:n - 1], members=[atoms[i] for i in members]))
        kept = {i for _, members in groups for i in members}
        self.dropped = [(a.key, "an empty dict, for which DCP stores nothing (dcp.save drops it too)")
                        for i, a in enumerate(atoms) if i not in kept]
        return planned

    def write(self, item: _Item, pieces: Iterator[tuple[tuple, np.ndarray]]) -> None:
        leaf = item.leaf
        if item.members:
            self.s.write_bytes(item.path, item.containers, None, _assemble(item, pieces))
        elif isinstance(leaf, cm.ValueLeaf):
            self.s.write_bytes(item.path, item.containers, None, leaf.value)
        elif leaf.kind in ("bytes", "bytesio"):  # torch.saved as DCP does: bytes, or an io.BytesIO
            self.s.write_bytes(item.path, item.containers, None, _torch_value(item, pieces))
        else:
            self.s.write_array(item.path, item.containers, leaf.shape, item.dtype, pieces)

    def commit(self) -> list[str]:
        from ..interop.dcp import DATA_FILE, METADATA

        self.s.commit()
        return [os.path.join(self.dst, DATA_FILE), os.path.join(self.dst, METADATA)]

    def abandon(self) -> None:
        self.s.abandon()


def _atoms(it: _Item) -> Iterator[_Item]:
    """``it``, or the leaves of a value holding a container (a plain-JSON subtree of a
    zarrckpt source is one leaf), each an item of its own."""
    value = it.leaf.value if isinstance(it.leaf, cm.ValueLeaf) else None
    if not isinstance(value, (dict, list, tuple)) or not value:
        yield it
        return
    kind = "dict" if isinstance(value, dict) else "tuple" if isinstance(value, tuple) else "list"
    kinds = it.kinds + (kind,)
    for k, v in value.items() if isinstance(value, dict) else enumerate(value):
        path = it.path + (k,)
        yield from _atoms(_Item(cm.ValueLeaf(path, v, kinds), path, cm.key_of(path), kinds))


def _dcp_what(it: _Item) -> str:
    """What DCP's flattening sees in a leaf: a tensor, an empty dict, or another value."""
    if isinstance(it.leaf, cm.ArrayLeaf) and it.leaf.kind in ("tensor", "ndarray"):
        return "tensor"
    empty_dict = isinstance(it.leaf, cm.ValueLeaf) and isinstance(it.leaf.value, dict) and not it.leaf.value
    return "dict" if empty_dict else "value"


def _assemble(group: _Item, pieces: Iterator[tuple[tuple, np.ndarray]]) -> Any:
    """The value of a group of leaves, nested as they are; ``pieces``: the pieces of its
    arrays, one array after another (:func:`_pieces`)."""
    n = len(group.path)
    entries = []
    for m in group.members:
        value = m.leaf.value if isinstance(m.leaf, cm.ValueLeaf) else _torch_value(m, pieces)
        entries.append((("v",) + m.path[n:], m.kinds[n - 1:], value))
    return cm.nest(entries)["v"]


def _torch_value(it: _Item, pieces: Iterator[tuple[tuple, np.ndarray]]) -> Any:
    """An array leaf read whole from its next pieces, as torch holds it: a tensor,
    ``bytes`` or an ``io.BytesIO``."""
    leaf = it.leaf
    out = np.empty(leaf.shape, it.dtype.numpy)
    for _, box in cm.piece_boxes(leaf.shape, it.chunk):
        _, data = next(pieces)
        out[tuple(slice(a, b) for a, b in box)] = data
    if leaf.kind == "bytes":
        return out.tobytes()
    if leaf.kind == "bytesio":
        import io

        return io.BytesIO(out.tobytes())
    return zdt.from_numpy(out, it.dtype)


# ------------------------------------------------------------------ the conversion


def _run(src: Any, dst: Any, src_format: str, make_sink: Callable[[Any], Any], *, keys: cm.KeysArg, dtype: Any,
         progress: Callable[[Progress], None] | None, memory_limit: int, strict: bool,
         storage: StorageOptions | None) -> ConversionReport:
    t0 = time.perf_counter()
    select = cm.key_selector(keys)
    to_dtype = cm.dtype_caster(dtype)
    piece = _piece_budget(memory_limit)
    source = _open_source(src_format, src, memory_limit, storage, strict)
    sink = None
    try:
        report = ConversionReport(str(src), str(dst), src_format, "")
        items: list[_Item] = []
        seen: list[str] = []  # every key of the source looked at, for the hints of an error
        picked: list[str] = []  # the keys selected
        for key, new, leaf in _selected(source.leaves(), select, seen):
            picked.append(key)
            if isinstance(leaf, cm.Skipped):
                _skip(report, key, leaf.reason, strict)
                continue
            path, containers = cm.renamed(leaf.path, leaf.containers, key, new)
            it = _Item(leaf, path, new, containers)
            if isinstance(leaf, cm.ArrayLeaf):
                it.dtype = to_dtype(leaf.dtype) if leaf.kind in ("tensor", "ndarray") else leaf.dtype
                itemsize = max(leaf.dtype.numpy.itemsize, it.dtype.numpy.itemsize)
                it.chunk = cm.piece_shape(leaf.shape, itemsize, piece)
            items.append(it)
        _check_keys_select(keys, picked, seen, src)
        sink = _open_sink(make_sink, source)
        report.destination = str(sink.dst)
        report.destination_format = sink.name
        kept = []
        for it in items:
            why = sink.accept(it)
            if why is None:
                kept.append(it)
            else:
                expected = getattr(sink, "is_expected_skip", lambda _: False)(it)
                _skip(report, it.key, why, strict and not expected)
        ordered = sink.plan(kept)
        report.skipped.extend(getattr(sink, "dropped", ()))
        total = sum(it.nbytes for it in ordered)
        done = [0, 0]

        def tick(key: str) -> None:
            if progress is not None:
                progress(Progress(key, done[0], total, done[1], len(ordered)))

        for it in ordered:
            sink.write(it, _pieces(it, done, tick))
            done[1] += 1
            report.leaves += 1
            report.arrays += isinstance(it.leaf, cm.ArrayLeaf)
            tick(it.key)
        report.files = sink.commit()
        report.bytes = done[0]
    except BaseException:
        if sink is not None:
            sink.abandon()
        raise
    finally:
        source.close()
    report.seconds = time.perf_counter() - t0
    return report


def _selected(leaves: Iterator[cm.Leaf], select: Callable[[str], str | None], seen: list[str]
              ) -> Iterator[tuple[str, str, cm.Leaf]]:
    """``(key, new key, leaf)`` of the leaves ``select`` keeps; every key looked at is
    appended to ``seen``. A value holding a container (a zarrckpt source gives a plain-JSON
    subtree as one leaf) that is not kept whole is split into its entries, so that
    ``keys="optim/param_groups/0/"`` selects inside it as it does inside any other subtree."""
    for leaf in leaves:
        try:
            key = cm.key_of(leaf.path)
        except UnsupportedValueError as e:
            key = repr(leaf.path)
            leaf = cm.Skipped(leaf.path, str(e))
        seen.append(key)
        new = select(key)
        if new is not None:
            yield key, new, leaf
        elif isinstance(leaf, cm.ValueLeaf) and isinstance(leaf.value, (dict, list, tuple)) and leaf.value:
            yield from _selected(_entries(leaf), select, seen)


def _check_keys_select(keys: cm.KeysArg, picked: list[str], seen: list[str], src: Any) -> None:
    """Refuse, before anything is written, a ``keys`` prefix (an old prefix of a mapping)
    that selects none of the source's keys, or a callable that selects none at all: the
    conversion would write an empty checkpoint or file. :class:`MissingKeysError` names
    each such prefix with the closest keys of the source or their prefixes
    (:func:`zarrckpt.inspect._check_selects`, as the command line's ``-k`` does);
    ``picked``: the keys selected, ``seen``: every key of the source looked at."""
    from .inspect import _check_selects

    if keys is None:
        return
    where = os.fspath(src) if isinstance(src, (str, os.PathLike)) else str(src)
    if callable(keys) and not isinstance(keys, (str, Mapping)):
        if seen and not picked:
            name = getattr(keys, "__name__", type(keys).__name__)
            top = sorted({k.split("/", 1)[0] for k in seen})
            raise MissingKeysError(f"keys={name} selects no key of {where} (top-level keys: "
                                   + ", ".join(top[:12]) + (f", +{len(top) - 12} more" if len(top) > 12 else "")
                                   + ")")
        return
    prefixes = [keys] if isinstance(keys, str) else [str(p) for p in keys]
    _check_selects(prefixes, picked, where, test=lambda p: lambda k: k.startswith(p), known=seen)


def _entries(leaf: cm.ValueLeaf) -> Iterator[cm.ValueLeaf]:
    value = leaf.value
    kind = "dict" if isinstance(value, dict) else "tuple" if isinstance(value, tuple) else "list"
    containers = tuple(leaf.containers or ("dict",) * (len(leaf.path) - 1)) + (kind,)
    for k, v in value.items() if isinstance(value, dict) else enumerate(value):
        yield cm.ValueLeaf(leaf.path + (k,), v, containers)


def _open_sink(make_sink: Callable[[Any], Any], source: Any) -> Any:
    """The destination, claimed. A refusal to replace what is there that ``overwrite=True``
    would lift names that option in its message and carries its text as the error's
    ``option`` attribute, so that the command line can name its flag instead
    (``str(e).replace(e.option, "--overwrite")``)."""
    try:
        return make_sink(source)
    except CheckpointExistsError as e:
        e.option = _OVERWRITE if _OVERWRITE in str(e) else None  # type: ignore[attr-defined]
        raise


def _pieces(it: _Item, done: list[int], tick: Callable[[str], None]) -> Iterator[tuple[tuple, np.ndarray]]:
    """``(start, data)`` of every piece of an array item, cast; of a group, those of its
    arrays, one after another."""
    for m in it.members:
        yield from _pieces(m, done, tick)
    if not isinstance(it.leaf, cm.ArrayLeaf):
        return
    for start, box in cm.piece_boxes(it.leaf.shape, it.chunk):
        data = it.leaf.read(box)
        done[0] += data.nbytes
        if it.dtype is not None and it.dtype != it.leaf.dtype:
            data = cm.cast(data, it.dtype)
        yield start, data
        tick(it.key)


def _skip(report: ConversionReport, key: str, why: str, strict: bool) -> None:
    if strict:
        raise UnsupportedValueError(f"cannot convert {key!r}: {why} (pass strict=False to skip it, or leave it "
                                    "out with keys=)")
    report.skipped.append((key, why))


def _zarr_sink(dst: Any, overwrite: bool, memory_limit: int, metadata: dict | None, storage: StorageOptions | None,
               compression: Any, pack_bytes: int, inner_chunk_bytes: int, src_format: str):
    def make(source: Any) -> _ZarrSink:
        meta: dict[str, Any] = {"converted_from": src_format}
        st_meta = getattr(source, "metadata", None)
        if src_format == "safetensors" and st_meta:
            meta["safetensors_metadata"] = dict(st_meta)
        meta.update(metadata or {})
        return _ZarrSink(dst, overwrite, memory_limit, meta, storage, compression, pack_bytes, inner_chunk_bytes)

    return make


# ------------------------------------------------------------------ public functions


def from_safetensors(src: str | os.PathLike, dst: Any, *, keys: cm.KeysArg = None, dtype: Any = None,
                     progress: Callable[[Progress], None] | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                     overwrite: bool = False, strict: bool = True, metadata: dict | None = None,
                     compression: Any = None, pack_bytes: int = 0,
                     inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES,
                     storage: StorageOptions | None = None) -> ConversionReport:
    """A safetensors file, a sharded checkpoint (its ``*.safetensors.index.json``), or a
    directory holding either -> a zarrckpt checkpoint at ``dst`` (path or URL). Each tensor
    name becomes one key (``model.layers.0.weight``); the files' ``__metadata__`` is kept
    in the root metadata (``safetensors_metadata``). ``pack_bytes``/``compression``/
    ``inner_chunk_bytes``: as :func:`zarrckpt.save`. No torch needed."""
    return _run(src, dst, "safetensors",
                _zarr_sink(dst, overwrite, memory_limit, metadata, storage, compression, pack_bytes,
                           inner_chunk_bytes, "safetensors"),
                keys=keys, dtype=dtype, progress=progress, memory_limit=memory_limit, strict=strict, storage=None)


def to_safetensors(src: Any, dst: str | os.PathLike, *, keys: cm.KeysArg = None, dtype: Any = None,
                   progress: Callable[[Progress], None] | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                   overwrite: bool = False, strict: bool = True, max_shard_size: int | str | None = "5GB",
                   prefix: str = "model", metadata: dict[str, str] | None = None,
                   storage: StorageOptions | None = None) -> ConversionReport:
    """A zarrckpt checkpoint -> Hugging Face safetensors.

    ``dst`` ending in ``.safetensors``: one file. Otherwise a folder: ``<prefix>.safetensors``
    when the tensors fit in ``max_shard_size`` bytes (``"5GB"`` as transformers, ``"500MB"``,
    ``"2GiB"``, an int; None: never shard), else ``<prefix>-00001-of-0000N.safetensors`` ...
    and ``<prefix>.safetensors.index.json``. Other files of the folder (``config.json``)
    are kept; with ``overwrite`` an earlier export with the same prefix is replaced.
    A key's safetensors name is its path joined with ``.`` (``model/layers/0/w`` ->
    ``model.layers.0.w``; a one-component key is its own name). Non-tensor leaves are
    skipped (listed in the report). ``metadata``: the files' ``__metadata__`` (default
    ``{"format": "pt"}``, or what :func:`from_safetensors` kept)."""
    def make(source: Any) -> _SafetensorsSink:
        meta = metadata
        kept = getattr(source, "metadata", None)
        if meta is None and isinstance(kept, dict) and isinstance(kept.get("safetensors_metadata"), dict):
            meta = kept["safetensors_metadata"]
        return _SafetensorsSink(dst, overwrite, max_shard_size, prefix, meta)

    return _run(src, dst, "zarrckpt", make, keys=keys, dtype=dtype, progress=progress,
                memory_limit=memory_limit, strict=strict, storage=storage)


def from_torch_save(src: str | os.PathLike, dst: Any, *, keys: cm.KeysArg = None, dtype: Any = None,
                    progress: Callable[[Progress], None] | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                    overwrite: bool = False, strict: bool = True, metadata: dict | None = None,
                    compression: Any = None, pack_bytes: int = 0,
                    inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES,
                    storage: StorageOptions | None = None) -> ConversionReport:
    """A ``torch.save`` file (zip format) -> zarrckpt. Loaded with
    ``torch.load(weights_only=True, map_location="meta")`` only (no data read up front);
    tensors are streamed from the file. Nested dicts, lists and tuples keep their shape
    (``{"model": {"w": t}}`` -> key ``model/w``); a file holding one tensor or value has
    the key ``value``."""
    return _run(src, dst, "torch_save",
                _zarr_sink(dst, overwrite, memory_limit, metadata, storage, compression, pack_bytes,
                           inner_chunk_bytes, "torch_save"),
                keys=keys, dtype=dtype, progress=progress, memory_limit=memory_limit, strict=strict, storage=None)


def to_torch_save(src: Any, dst: str | os.PathLike, *, keys: cm.KeysArg = None, dtype: Any = None,
                  progress: Callable[[Progress], None] | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                  overwrite: bool = False, strict: bool = True,
                  storage: StorageOptions | None = None) -> ConversionReport:
    """A zarrckpt checkpoint -> one ``torch.save`` file that ``torch.load(weights_only=True)``
    reads: the nested state dict with CPU tensors (NumPy-array leaves become tensors,
    bytes leaves ``bytes``). Written with bounded memory (tensor data are streamed into a
    file laid out by torch.save itself)."""
    return _run(src, dst, "zarrckpt", lambda source: _TorchSaveSink(dst, overwrite), keys=keys, dtype=dtype,
                progress=progress, memory_limit=memory_limit, strict=strict, storage=storage)


def from_dcp(src: str | os.PathLike, dst: Any, *, keys: cm.KeysArg = None, dtype: Any = None,
             progress: Callable[[Progress], None] | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
             overwrite: bool = False, strict: bool = True, metadata: dict | None = None,
             compression: Any = None, pack_bytes: int = 0,
             inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES,
             storage: StorageOptions | None = None) -> ConversionReport:
    """A DCP checkpoint directory (``FileSystemWriter``, any number of ranks) -> zarrckpt.
    Sharded tensors are assembled piece by piece from their chunks. See
    :mod:`zarrckpt.interop.dcp` for exactly what is unpickled and how."""
    return _run(src, dst, "dcp",
                _zarr_sink(dst, overwrite, memory_limit, metadata, storage, compression, pack_bytes,
                           inner_chunk_bytes, "dcp"),
                keys=keys, dtype=dtype, progress=progress, memory_limit=memory_limit, strict=strict, storage=None)


def to_dcp(src: Any, dst: str | os.PathLike, *, keys: cm.KeysArg = None, dtype: Any = None,
           progress: Callable[[Progress], None] | None = None, memory_limit: int = DEFAULT_MEMORY_LIMIT,
           overwrite: bool = False, strict: bool = True, storage: StorageOptions | None = None) -> ConversionReport:
    """A zarrckpt checkpoint -> a DCP directory as ``dcp.save`` writes it from one process
    (``dcp.load`` and ``dcp_to_torch_save`` read it). Tensors larger than the piece budget
    are stored as several chunks, as a sharded tensor's are. The leaves become DCP's items
    by DCP's own flattening rule (:func:`zarrckpt.interop.dcp.dcp_items`): a tuple, and a
    list holding neither a tensor nor a dict, is one item (``torch.save`` of the whole
    value: AdamW's ``betas``, a param group's ``params``); an empty dict, for which DCP
    stores nothing, is skipped and listed in the report."""
    return _run(src, dst, "zarrckpt", lambda source: _DCPSink(dst, overwrite), keys=keys, dtype=dtype,
                progress=progress, memory_limit=memory_limit, strict=strict, storage=storage)


def convert(src: Any, dst: Any, *, from_format: str | None = None, to_format: str | None = None,
            **options: Any) -> ConversionReport:
    """Convert between zarrckpt and another format, detecting ``src``'s format
    (:func:`detect_format`) unless given. One side must be zarrckpt; ``to_format``
    defaults to zarrckpt when the source is another format, else it is required (or
    implied by a ``dst`` ending in ``.safetensors``). ``options``: those of the function
    called (:func:`from_safetensors` ...)."""
    src_fmt = from_format or detect_format(src)
    if to_format is None:
        if src_fmt != "zarrckpt":
            to_format = "zarrckpt"
        elif os.fspath(dst).endswith(".safetensors"):
            to_format = "safetensors"
        else:
            raise ValueError("converting from zarrckpt: say to_format= (dcp, safetensors or torch_save)")
    for name in (src_fmt, to_format):
        if name not in FORMATS:
            raise ValueError(f"unknown format {name!r}; one of {', '.join(FORMATS)}")
    if (src_fmt == "zarrckpt") == (to_format == "zarrckpt"):
        raise ValueError(f"one side must be zarrckpt (got {src_fmt} -> {to_format})")
    fn = {"safetensors": (from_safetensors, to_safetensors), "dcp": (from_dcp, to_dcp),
          "torch_save": (from_torch_save, to_torch_save)}
    if src_fmt == "zarrckpt":
        return fn[to_format][1](src, dst, **options)
    return fn[src_fmt][0](src, dst, **options)
