"""Looking at checkpoints without torch: ``info``, ``verify``, ``diff``, ``stats``, ``ls``.

The operations of the ``zarrckpt`` command (:mod:`zarrckpt.tools.cli`) as functions, for
notebooks and scripts (conversions are :mod:`zarrckpt.convert`)::

    import zarrckpt.inspect as zi

    zi.info("ckpt/step_100")                  # CheckpointInfo: state, mesh, each key's shape, dtype, layout
    zi.verify("ckpt/step_100", jobs=8).ok     # VerifyReport: documents, every chunk present, every CRC-32C
    zi.diff("a", "b", atol=1e-6).same         # DiffReport: keys, shapes, dtypes, max abs / rel differences
    zi.stats("ckpt/run1")                     # [CheckpointStats], one per step: norm, mean, std, ...
    zi.ls("s3://bucket/run1")                 # [Listing]: step, state, size, time of each checkpoint
    zi.leftovers("ckpt/run1")                 # [Leftover]: what dead (or running) saves left there

Each returns dataclasses of plain values, each with ``as_dict()`` (JSON values) and
``to_json()`` (JSON text: what ``zarrckpt ... --json`` prints); :func:`to_json` and
:func:`to_dict` do the same for any result or container of results. Paths are anything
:func:`zarrckpt.open` takes (``s3://``, ``gs://``, ``file://``, ``memory://``, plain
paths) with ``storage=StorageOptions(...)``.

**Selecting keys.** ``keys=`` of ``info``, ``diff`` and ``stats`` takes prefixes and globs
(:func:`key_filter`). A pattern that selects nothing is a typo, not an empty answer: it
raises :class:`~zarrckpt.errors.MissingKeysError` naming the pattern, the checkpoint, and
the closest keys or key prefixes ("did you mean 'model'?").

**Bounded memory.** Array data are read one stored chunk at a time; a shard (spec §5.5)
larger than ``max_read_bytes`` is read in groups of its inner chunks. ``jobs`` units are
read at once (``verify``) or ``jobs`` leaves at once (``diff``, ``stats``), so a call
holds about ``jobs x max_read_bytes`` of data (``diff`` and ``stats`` convert to float64:
up to 8x that for 1-byte types), whatever the size of a tensor or checkpoint.

**What verify checks** (spec's reader checklist, then more): the root document (digest,
strict parsing, committed), every array's ``zarr.json`` against the root's digest, that
every chunk (shard) object the chunk grid needs is in storage (a missing chunk would read
as fill values through a generic Zarr reader), and every chunk's data: read through
TensorStore, which checks each CRC-32C and each shard index and fails on a missing inner
chunk that overlaps the array (inner chunks wholly in an edge shard's padding may be
absent, §5.3). Pack arrays (``.packs/<n>``) are checked the same way, and the ranges of
their packed leaves against their length. Problems are collected, not raised: each names
the array path, the keys stored there, and the chunk.
"""

from __future__ import annotations

import concurrent.futures as cf
import difflib
import fnmatch
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format import documents as fmt
from ..engine.commit import Leftover, clean_leftovers
from ..readers.lazy import placement_str
from ..readers.verify import DEFAULT_JOBS, DEFAULT_MAX_READ_BYTES, Problem, VerifyReport, verify
from ..readers.walk import JsonReport, Progress, ProgressFn, boxes, json_text, json_values, parallel, raw_root
from ..errors import (CheckpointNotFoundError, FormatError, IncompleteCheckpointError, MissingDependencyError,
                      MissingKeysError, ZarrckptError)
from ..readers.checkpoint import Checkpoint
from ..readers.previous import same_content
from ..storage import StorageOptions, open_storage

__all__ = [
    "CheckpointInfo",
    "CheckpointStats",
    "DEFAULT_JOBS",
    "DEFAULT_MAX_READ_BYTES",
    "DiffReport",
    "LeafDiff",
    "LeafInfo",
    "Leftover",
    "Listing",
    "MeshInfo",
    "Problem",
    "Progress",
    "TensorStats",
    "VerifyReport",
    "diff",
    "info",
    "key_filter",
    "leftovers",
    "ls",
    "plot_format",
    "plot_norms",
    "stats",
    "to_dict",
    "to_json",
    "verify",
]

# ------------------------------------------------------------------ JSON


def to_json(obj: Any, *, indent: int | None = 2) -> str:
    """Any result of this module (or a list or dict of them) as JSON text: what
    ``zarrckpt ... --json`` prints. Strict JSON: non-finite floats are the strings
    ``"nan"``, ``"inf"``, ``"-inf"`` (see :func:`to_dict`)."""
    return json_text(obj, indent)


def to_dict(obj: Any) -> Any:
    """Any result of this module as plain JSON values (what :func:`to_json` writes):
    dataclasses as objects, tuples as lists, non-finite floats as the strings ``"nan"``,
    ``"inf"``, ``"-inf"``, bytes as ``{"bytes": length}``."""
    return json_values(obj)


# ------------------------------------------------------------------ selecting keys


def key_filter(patterns: str | Iterable[str] | None) -> Callable[[str], bool]:
    """Keys to keep: all (None), or those matching one pattern. A pattern with ``*``,
    ``?`` or ``[`` is a glob over the whole key (``model/*.bias``); any other is a prefix
    of whole components (``model`` and ``model/`` both select ``model/...``)."""
    if patterns is None:
        return lambda k: True
    tests = [_pattern_test(p) for p in _patterns(patterns)]
    return lambda k: any(t(k) for t in tests)


def _patterns(patterns: str | Iterable[str]) -> list[str]:
    return [patterns] if isinstance(patterns, str) else list(patterns)


def _pattern_test(p: str) -> Callable[[str], bool]:
    """One pattern of :func:`key_filter` as a test of a key."""
    if any(c in p for c in "*?["):
        return lambda k: fnmatch.fnmatchcase(k, p)
    p = p.rstrip("/")
    return lambda k: not p or k == p or k.startswith(p + "/")


def _check_selects(patterns: str | Iterable[str] | None, keys: Sequence[str], where: str, *,
                   test: Callable[[str], Callable[[str], bool]] = _pattern_test, what: str = "key",
                   known: Sequence[str] | None = None) -> None:
    """Raise :class:`MissingKeysError` when a pattern of ``patterns`` selects none of
    ``keys`` (the keys of ``where``, a checkpoint's URL or a description), naming each such
    pattern with the closest of the ``known`` keys (default ``keys``) or their prefixes
    (``difflib``), or the top-level keys when none is close. ``test``: a pattern -> its
    test of a key (default :func:`key_filter`'s rule); ``what``: the noun of the message
    (``"array"`` when only arrays are searched)."""
    if patterns is None:
        return
    dead = [p for p in _patterns(patterns) if not any(map(test(p), keys))]
    if dead:
        raise MissingKeysError("; ".join(_no_match(p, keys if known is None else known, where, what) for p in dead))


def _no_match(pattern: str, keys: Sequence[str], where: str, what: str) -> str:
    names = _key_prefixes(keys)
    close = difflib.get_close_matches(pattern.rstrip("/"), names, n=3, cutoff=0.6)
    if close:
        quoted = [repr(c) for c in close]
        hint = "did you mean " + (", ".join(quoted[:-1]) + " or " if len(quoted) > 1 else "") + quoted[-1] + "?"
    else:
        top = sorted({k.split("/", 1)[0] for k in keys})
        hint = ("top-level keys: " + ", ".join(top[:12]) + (f", +{len(top) - 12} more" if len(top) > 12 else "")
                if top else f"it has no {what}s")
    return f"key pattern {pattern!r} selects no {what} of {where} ({hint})"


def _key_prefixes(keys: Sequence[str]) -> list[str]:
    """Every key and every prefix of whole components of one (``model``, ``model/layers``)."""
    out = dict.fromkeys(keys)
    for k in keys:
        parts = k.split("/")
        for i in range(1, len(parts)):
            out.setdefault("/".join(parts[:i]))
    return list(out)


# ------------------------------------------------------------------ opening, the root


def _committed_time(ck: Checkpoint) -> str | None:
    return ck.info.raw["attributes"][fmt.ATTR].get("committed")


# ------------------------------------------------------------------ info


@dataclass(frozen=True)
class MeshInfo(JsonReport):
    """The device mesh an array was saved from: ``shape`` (``(2, 4)``) and its dimension
    names (``("dp", "tp")``, or None). ``str()``: ``(dp=2, tp=4)``."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None = None

    def __str__(self) -> str:
        names = self.dim_names or (None,) * len(self.shape)
        return "(" + ", ".join(f"{n}={s}" if n else str(s) for n, s in zip(names, self.shape)) + ")"


@dataclass
class LeafInfo(JsonReport):
    """One leaf: an array (``kind`` tensor, dtensor, sharded_tensor, ndarray, bytes,
    bytesio) with its saved layout, or a value (``kind`` ``"value"``, ``value`` set).

    ``dtype``: the Zarr data type name (``float32``, ``bfloat16``); ``shape``: the global
    shape; ``nbytes``: decoded bytes; ``chunks``: the stored chunk (shard) shape, None when
    ``packed`` (stored in a pack with other small leaves); ``inner_chunks``: the inner
    chunk shape of a sharded array; ``mesh`` and ``placements``: a DTensor's save-time mesh
    and placements (``["Shard(0)"]``)."""

    key: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    nbytes: int = 0
    chunks: tuple[int, ...] | None = None
    inner_chunks: tuple[int, ...] | None = None
    packed: bool = False
    mesh: MeshInfo | None = None
    placements: list[str] | None = None
    value: Any = None

    @property
    def is_array(self) -> bool:
        return self.kind != "value"

    def layout(self) -> str:
        """``packed``, ``chunks [8, 6] (inner [4, 3])``, plus a mesh and placements."""
        if not self.is_array:
            return ""
        if self.packed:
            return "packed"
        out = f"chunks {list(self.chunks or ())}" if self.shape else "one chunk"
        if self.inner_chunks:
            out += f" (inner {list(self.inner_chunks)})"
        if self.mesh is not None:
            out += f", {self.kind} {self.mesh} [{', '.join(self.placements or ())}]"
        elif self.kind not in ("tensor", "bytes"):
            out += f", {self.kind}"
        return out


@dataclass
class CheckpointInfo(JsonReport):
    """What :func:`info` found: the root's record and every selected leaf, in stored order.
    A pending checkpoint (an interrupted or running save) has ``state == "pending"``, its
    root's ``save_id``, ``created`` and ``world_size``, and no leaves.

    ``url``: where it is; ``state``: ``committed`` or ``pending``; ``version``: the format
    version (``"1.1"``); ``save_id``: the save's id; ``created``/``committed``: UTC times
    (ISO 8601) the save started and committed; ``world_size``: the processes that saved
    it; ``writer``: software versions; ``metadata``: the caller's own JSON object (the
    ``metadata=`` of the save; a CheckpointManager's ``step`` and ``metrics``); ``step``:
    ``metadata["step"]``, else a top-level integer leaf ``step`` (a pending one: the
    ``step_<N>`` of its directory); ``meshes``: the distinct meshes of its DTensors;
    ``leaves``: a :class:`LeafInfo` per selected key. Also ``num_keys``, ``num_arrays``,
    ``nbytes`` (array data of the selected leaves), in ``as_dict()`` too."""

    url: str
    state: str
    version: str | None = None
    save_id: str | None = None
    created: str | None = None
    committed: str | None = None
    world_size: int | None = None
    writer: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    meshes: list[MeshInfo] = field(default_factory=list)
    leaves: list[LeafInfo] = field(default_factory=list)

    _json_extra = ("num_keys", "num_arrays", "nbytes")

    @property
    def num_keys(self) -> int:
        return len(self.leaves)

    @property
    def num_arrays(self) -> int:
        return sum(leaf.is_array for leaf in self.leaves)

    @property
    def nbytes(self) -> int:
        """Bytes of array data (decoded, of the selected leaves)."""
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def metrics(self) -> dict[str, Any]:
        """``metadata["metrics"]`` (a CheckpointManager's), else {}."""
        metrics = self.metadata.get("metrics")
        return metrics if isinstance(metrics, dict) else {}


def info(path: str | os.PathLike, *, keys: str | Iterable[str] | None = None,
         storage: StorageOptions | None = None) -> CheckpointInfo:
    """The checkpoint at ``path``: state, format version, times, world size, meshes, and
    every leaf (under ``keys``: prefixes or globs, see :func:`key_filter`) with its shape,
    dtype, bytes and saved layout. Reads the root and every array ``zarr.json``
    (concurrently), no array data. A pending root is described, not refused. A pattern
    of ``keys`` that selects no key raises :class:`MissingKeysError` (with the closest
    keys)."""
    try:
        ck = Checkpoint(path, storage)
    except IncompleteCheckpointError:
        st = open_storage(path, storage)
        attrs = raw_root(st) or {}
        return CheckpointInfo(st.url, "pending", version=attrs.get("version"), save_id=attrs.get("save_id"),
                              created=attrs.get("created"), world_size=attrs.get("world_size"),
                              writer=dict(attrs.get("writer") or {}), step=_run_step(st.url, None))
    all_keys = ck.keys()
    _check_selects(keys, all_keys, ck.url)
    keep = key_filter(keys)
    selected = [k for k in all_keys if keep(k)]
    infos = ck.array_infos([k for k in selected if ck.is_array(k)])
    leaves = []
    meshes: list[MeshInfo] = []
    with ck.reading():  # one root check after the values, not one per value
        for k in selected:
            a = infos.get(k)
            if a is None:
                leaves.append(LeafInfo(k, "value", value=ck.read(k)))
                continue
            mesh = None
            if a.mesh_shape is not None:
                mesh = MeshInfo(tuple(a.mesh_shape), tuple(a.mesh_dim_names) if a.mesh_dim_names else None)
                if mesh not in meshes:
                    meshes.append(mesh)
            packed = ck.is_packed(k)
            leaves.append(LeafInfo(
                k, a.kind, a.dtype.zarr, a.shape, math.prod(a.shape) * a.dtype.numpy.itemsize,
                None if packed else a.chunk_shape, a.inner_chunk_shape, packed, mesh,
                [placement_str(p) for p in a.placements] if a.placements is not None else None))
    return CheckpointInfo(ck.url, "committed", ck.info.version, ck.save_id, ck.created, _committed_time(ck),
                          ck.world_size, dict(ck.info.writer), ck.metadata, ck.step, meshes, leaves)


# ------------------------------------------------------------------ ls


@dataclass
class Listing(JsonReport):
    """One checkpoint under a run directory or prefix. ``state``: ``committed``,
    ``pending`` (a save interrupted or still running) or ``damaged`` (a root that cannot
    be read; ``error`` says why). ``time``: the commit (else the start) of the save;
    ``nbytes``: its array data (committed checkpoints).

    ``step`` is the step of the checkpoint in its run: ``N`` for a CheckpointManager step
    directory ``step_<N>`` (the name the manager saves, finds, retains and restores it by),
    else the step the checkpoint records. ``saved_step`` is the step the checkpoint
    records (``metadata["step"]``, else a top-level integer leaf ``step``), whatever its
    name; ``zarrckpt ls`` notes a checkpoint whose two differ.

    ``own_bytes`` / ``shared_bytes`` (local file systems, with ``sizes``): the bytes of its
    files held by it alone, and those of files hard-linked with another checkpoint (an
    incremental save, spec §7.9; deleting this checkpoint frees only ``own_bytes``)."""

    url: str
    name: str
    state: str
    step: int | None = None
    time: str | None = None
    save_id: str | None = None
    world_size: int | None = None
    num_arrays: int | None = None
    nbytes: int | None = None
    error: str | None = None
    saved_step: int | None = None
    own_bytes: int | None = None
    shared_bytes: int | None = None


def _file_bytes(path: str) -> tuple[int, int]:
    """(bytes of files with one link, bytes of files with more) under ``path``."""
    own = shared = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if st.st_nlink > 1:
                shared += st.st_size
            else:
                own += st.st_size
    return own, shared


def _run_step(url: str, saved_step: int | None) -> int | None:
    """The step of the checkpoint at ``url`` in its run (``ls``, ``stats``): ``N`` when its
    name is a CheckpointManager step directory ``step_<N>``, whatever it records, else
    ``saved_step`` (what it records), else None."""
    step = fmt.parse_step_name(os.fspath(url).rstrip("/").rsplit("/", 1)[-1])
    return saved_step if step is None else step


def ls(url: str | os.PathLike, *, storage: StorageOptions | None = None, sizes: bool = True,
       jobs: int = 8) -> list[Listing]:
    """The checkpoints at ``url``: the checkpoint itself, or every child directory or
    prefix holding a zarrckpt root (a CheckpointManager's ``step_<N>``, or any name), in
    step order. Names starting with ``.`` (a save's own directory, spec §7.2) are left
    out: :func:`leftovers` finds those. ``sizes``: also read every array ``zarr.json`` for
    ``nbytes``. Raises :class:`CheckpointNotFoundError` when there is no checkpoint there
    at all."""
    root = os.fspath(url)
    st = open_storage(root, storage)
    if st.local_path is not None and os.path.isfile(st.local_path.rstrip("/")):
        raise CheckpointNotFoundError(f"{root!r} is a file, not a checkpoint or a directory of checkpoints")
    if st.read_bytes("zarr.json")[0] is not None:
        found = [_listing(root, st.name, storage, sizes)]
    else:
        names = [n for n in st.list_children() if not n.startswith(".")]
        base = root.rstrip("/")
        with cf.ThreadPoolExecutor(max(1, jobs)) as pool:
            found = list(pool.map(lambda n: _listing(f"{base}/{n}", n, storage, sizes), names))
    out = [x for x in found if x is not None]
    if not out:
        raise CheckpointNotFoundError(f"no zarrckpt checkpoints at {root!r} (neither a checkpoint nor a "
                                      "directory or prefix holding any)")
    return sorted(out, key=lambda x: (x.step is None, x.step if x.step is not None else 0, x.name))


def leftovers(url: str | os.PathLike, *, storage: StorageOptions | None = None) -> list[Leftover]:
    """What saves left at ``url`` on a local file system (spec §7.5: hidden directories
    ``.<name>.zarrckpt-<id>``, pending claims, lock files), as
    :func:`zarrckpt.clean_leftovers` finds them with ``dry_run=True``: nothing is removed.
    ``live``: the save still runs. For a checkpoint itself, the leftovers of its name in
    its parent directory. ``[]`` on object stores (no lock tells a dead save from a
    running one there) and where ``url`` is not a directory."""
    path = open_storage(os.fspath(url), storage).local_path
    if path is None or not os.path.isdir(path):
        return []
    path = path.rstrip("/") or "/"
    if os.path.exists(os.path.join(path, "zarr.json")):
        parent, name = os.path.split(path)
        return clean_leftovers(parent, dry_run=True, name=name, options=storage)
    return clean_leftovers(path, dry_run=True, options=storage)


def _listing(url: str, name: str, storage: StorageOptions | None, sizes: bool) -> Listing | None:
    st = open_storage(url, storage)
    if st.local_path is not None and not os.path.isdir(st.local_path):
        return None
    try:
        ck = Checkpoint(url, storage)
    except IncompleteCheckpointError:
        attrs = raw_root(st) or {}
        return Listing(url, name, "pending", _run_step(url, None), attrs.get("created"), attrs.get("save_id"),
                       attrs.get("world_size"))
    except CheckpointNotFoundError:
        return None  # no root, or a Zarr group that is not a checkpoint
    except FormatError as e:
        return Listing(url, name, "damaged", _run_step(url, None), error=str(e))
    out = Listing(url, name, "committed", _run_step(url, ck.step), _committed_time(ck), ck.save_id, ck.world_size,
                  saved_step=ck.step)
    arrays = ck.array_keys()
    out.num_arrays = len(arrays)
    if sizes:
        try:
            out.nbytes = sum(math.prod(a.shape) * a.dtype.numpy.itemsize for a in ck.array_infos(arrays).values())
        except ZarrckptError as e:  # a document changed, missing or unreadable
            out.state, out.error = "damaged", str(e)
        if st.local_path is not None:
            out.own_bytes, out.shared_bytes = _file_bytes(st.local_path)
    return out


# ------------------------------------------------------------------ diff


@dataclass
class LeafDiff(JsonReport):
    """How one key compares. ``status``: ``identical`` (same dtype, shape and bits; equal
    values), ``close`` (within ``atol``/``rtol``, when given), ``different``, ``shape``,
    ``dtype`` (values compared as numbers when shapes agree), ``kind`` (an array in one,
    a value in the other). ``max_abs`` = max |a - b|, ``max_rel`` = max |a - b| / |b|
    (inf where b is 0 and a is not), over elements whose bits differ; a NaN against a
    number counts as an infinite difference, two NaNs as none. ``num_different``:
    elements whose bits differ (after comparing as numbers when dtypes differ)."""

    key: str
    status: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    numel: int = 0
    num_different: int = 0
    num_outside: int = 0  # elements outside the tolerance (when one is given)
    max_abs: float | None = None
    max_rel: float | None = None
    value_a: Any = None  # values (non-array leaves) that differ
    value_b: Any = None


@dataclass
class DiffReport(JsonReport):
    """:func:`diff`'s result: ``same`` is True only when both hold the same keys and every
    leaf is ``identical`` (or ``close``, when a tolerance was given)."""

    a: str
    b: str
    atol: float | None
    rtol: float | None
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    leaves: list[LeafDiff] = field(default_factory=list)

    _json_extra = ("same",)

    @property
    def same(self) -> bool:
        ok = ("identical", "close") if self.atol is not None or self.rtol is not None else ("identical",)
        return not self.only_a and not self.only_b and all(d.status in ok for d in self.leaves)

    @property
    def differing(self) -> list[LeafDiff]:
        ok = ("identical", "close") if self.atol is not None or self.rtol is not None else ("identical",)
        return [d for d in self.leaves if d.status not in ok]


def diff(a: str | os.PathLike, b: str | os.PathLike, *, atol: float | None = None, rtol: float | None = None,
         keys: str | Iterable[str] | None = None, storage: StorageOptions | None = None,
         progress: ProgressFn | None = None, jobs: int = DEFAULT_JOBS,
         max_read_bytes: int = 16 << 20) -> DiffReport:
    """Compare checkpoint ``a`` with checkpoint ``b``, key by key (under ``keys``): keys
    only in one, kinds, shapes, dtypes, values, and for arrays the number of differing
    elements and the largest absolute and relative differences (:class:`LeafDiff`),
    computed chunk by chunk of ``a`` (see the module docstring). With ``atol`` and/or
    ``rtol`` (a missing one is 0), arrays whose every element has
    ``|a - b| <= atol + rtol * |b|`` (NaN matching NaN) are ``close``. A pattern of
    ``keys`` that selects no key of either raises :class:`MissingKeysError`."""
    tol = None if atol is None and rtol is None else (float(atol or 0.0), float(rtol or 0.0))
    if tol is not None and (tol[0] < 0 or tol[1] < 0 or not all(map(math.isfinite, tol))):
        raise ValueError(f"atol and rtol must be finite and >= 0, not {atol!r} and {rtol!r}")
    ca, cb = Checkpoint(a, storage), Checkpoint(b, storage)
    _check_selects(keys, list(dict.fromkeys(ca.keys() + cb.keys())), f"{ca.url} or {cb.url}")
    keep = key_filter(keys)
    ka = [k for k in ca.keys() if keep(k)]
    kb = [k for k in cb.keys() if keep(k)]
    in_b = set(kb)
    in_a = set(ka)
    report = DiffReport(ca.url, cb.url, atol, rtol, [k for k in ka if k not in in_b], [k for k in kb if k not in in_a])
    common = [k for k in ka if k in in_b]
    ia = ca.array_infos([k for k in common if ca.is_array(k)])
    ib = cb.array_infos([k for k in common if cb.is_array(k)])
    total = sum(_nbytes(ia[k]) for k in common if k in ia and k in ib)

    def one(k: str) -> LeafDiff:
        if k in ia and k in ib:
            if ia[k].kind != "pack" and same_content(ca, cb, k):  # recorded hashes: no chunk read
                a = ia[k]
                return LeafDiff(k, "identical", a.dtype.zarr, a.dtype.zarr, a.shape, a.shape, math.prod(a.shape))
            return _diff_array(ca, cb, k, ia[k], ib[k], tol, max_read_bytes)
        if k in ia or k in ib:
            return LeafDiff(k, "kind", ia[k].dtype.zarr if k in ia else None, ib[k].dtype.zarr if k in ib else None)
        va, vb = ca.read(k), cb.read(k)
        same = _same_value(va, vb)
        return LeafDiff(k, "identical" if same else "different", value_a=None if same else va,
                        value_b=None if same else vb)

    results: dict[str, LeafDiff] = {}
    done = 0
    for n, (k, d) in enumerate(parallel(one, common, jobs), 1):
        results[k] = d
        done += _nbytes(ia[k]) if k in ia and k in ib else 0
        if progress is not None:
            progress(Progress(k, done, total, n, len(common)))
    report.leaves = [results[k] for k in common]
    return report


def _nbytes(a: fmt.ArrayInfo) -> int:
    return math.prod(a.shape) * a.dtype.numpy.itemsize


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and x != x and y != y:
        return True
    if type(x) is not type(y):
        return False
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same_value(x[k], y[k]) for k in x)
    return x == y


def _as_number(x: np.ndarray) -> np.ndarray:
    if x.dtype.kind == "c":
        return x.astype(np.complex128)
    return x.astype(np.float64)


def _bit_rows(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.reshape(-1).view(np.uint8).reshape(x.size, x.dtype.itemsize)


def _diff_array(ca: Checkpoint, cb: Checkpoint, key: str, ia: fmt.ArrayInfo, ib: fmt.ArrayInfo,
                tol: tuple[float, float] | None, budget: int) -> LeafDiff:
    d = LeafDiff(key, "identical", ia.dtype.zarr, ib.dtype.zarr, ia.shape, ib.shape, math.prod(ia.shape))
    if ia.shape != ib.shape:
        d.status = "shape"
        return d
    same_dtype = ia.dtype == ib.dtype
    max_abs = max_rel = 0.0
    for box in boxes(ia, budget):
        xa, xb = ca.read_box(key, box), cb.read_box(key, box)
        if same_dtype:
            ne = (_bit_rows(xa) != _bit_rows(xb)).any(axis=1).reshape(xa.shape)
            if not ne.any():
                continue
            va, vb = _as_number(xa[ne]), _as_number(xb[ne])
        else:
            va, vb = _as_number(xa).reshape(-1), _as_number(xb).reshape(-1)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            nan_a, nan_b = np.isnan(va), np.isnan(vb)
            equal = (va == vb) | (nan_a & nan_b)
            if not same_dtype:
                va, vb, nan_a, nan_b = va[~equal], vb[~equal], nan_a[~equal], nan_b[~equal]
                equal = equal[~equal]
            dist = np.where(equal, 0.0, np.abs(va - vb))
            dist[nan_a ^ nan_b] = np.inf
            mag = np.abs(vb)
            rel = np.where(dist == 0, 0.0, np.where(mag == 0, np.inf, dist / np.where(mag == 0, 1, mag)))
        d.num_different += int(dist.size)
        if dist.size:
            max_abs = max(max_abs, float(dist.max()))
            max_rel = max(max_rel, float(rel.max()))
            if tol is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    d.num_outside += int(np.count_nonzero(~(equal | (dist <= tol[0] + tol[1] * mag))))
    if d.num_different:
        d.max_abs, d.max_rel = max_abs, max_rel
    if not same_dtype:
        d.status = "dtype"
    elif d.num_different == 0:
        d.status = "identical"
    elif tol is not None and d.num_outside == 0:
        d.status = "close"
    else:
        d.status = "different"
    return d


# ------------------------------------------------------------------ stats


@dataclass
class TensorStats(JsonReport):
    """Statistics of one array leaf over its finite elements (NaN and Inf are counted
    apart, as fractions of all elements): ``norm`` (L2), ``mean``, ``std`` (population,
    ddof 0), ``min``, ``max``; ``zeros``, ``nan``, ``inf`` fractions of all elements.
    None where there is no finite element. Complex arrays: of the elements' magnitudes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    norm: float | None = None
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    max: float | None = None
    zeros: float | None = None
    nan: float | None = None
    inf: float | None = None


@dataclass
class CheckpointStats(JsonReport):
    """:func:`stats` of one checkpoint: its step in its run (``N`` of a
    ``step_<N>`` directory, else the saved step, else None) and one :class:`TensorStats`
    per array leaf."""

    url: str
    step: int | None
    tensors: list[TensorStats] = field(default_factory=list)


class _Moments:
    """Count, mean and sum of squared deviations merged chunk by chunk (Chan et al.), so
    the result does not depend on how the array is chunked beyond rounding."""

    def __init__(self) -> None:
        self.total = self.zeros = self.nan = self.inf = self.n = 0
        self.mean = self.m2 = self.sumsq = 0.0
        self.lo = math.inf
        self.hi = -math.inf

    def add(self, x: np.ndarray) -> None:
        x = np.abs(x.astype(np.complex128)) if x.dtype.kind == "c" else x.astype(np.float64)
        x = x.reshape(-1)
        self.total += x.size
        self.zeros += int(np.count_nonzero(x == 0))
        nan = np.isnan(x)
        inf = np.isinf(x)
        n_nan, n_inf = int(np.count_nonzero(nan)), int(np.count_nonzero(inf))
        self.nan += n_nan
        self.inf += n_inf
        f = x[~(nan | inf)] if n_nan or n_inf else x
        if not f.size:
            return
        m = float(f.mean())
        with np.errstate(over="ignore"):
            m2 = float(np.square(f - m).sum())
            self.sumsq += float(np.dot(f, f))
        n = self.n + f.size
        delta = m - self.mean
        self.m2 += m2 + delta * delta * self.n * f.size / n
        self.mean += delta * f.size / n
        self.n = n
        self.lo = min(self.lo, float(f.min()))
        self.hi = max(self.hi, float(f.max()))

    def result(self, key: str, a: fmt.ArrayInfo) -> TensorStats:
        out = TensorStats(key, a.dtype.zarr, a.shape, self.total)
        if self.total:
            out.zeros, out.nan, out.inf = self.zeros / self.total, self.nan / self.total, self.inf / self.total
        if self.n:
            out.norm, out.mean = math.sqrt(self.sumsq), self.mean
            out.std, out.min, out.max = math.sqrt(max(self.m2, 0.0) / self.n), self.lo, self.hi
        return out


def stats(paths: str | os.PathLike | Sequence[str | os.PathLike], *, keys: str | Iterable[str] | None = None,
          storage: StorageOptions | None = None, progress: ProgressFn | None = None, jobs: int = DEFAULT_JOBS,
          max_read_bytes: int = 16 << 20) -> list[CheckpointStats]:
    """Statistics of every array leaf (under ``keys``; ``bytes`` leaves left out) of one
    checkpoint, of a run directory (every committed checkpoint under it, see :func:`ls`),
    or of a list of checkpoints, computed chunk by chunk: one :class:`CheckpointStats`
    per checkpoint, in step order. A pattern of ``keys`` that selects no such array of
    any of them raises :class:`MissingKeysError`. In a run, an array whose recorded content
    hashes and unit CRC-32Cs say it is unchanged since the checkpoint before (incremental
    saves) is not read again: it takes that checkpoint's statistics."""
    run = _run(paths, storage)
    keep = key_filter(keys)
    work: list[tuple[int, Checkpoint, str, fmt.ArrayInfo]] = []
    for i, (_, ck) in enumerate(run):
        ks = [k for k in ck.array_keys() if keep(k)]
        for k, a in ck.array_infos(ks).items():
            if a.kind not in fmt.BYTE_KINDS:
                work.append((i, ck, k, a))
    where = run[0][1].url if len(run) == 1 else f"{len(run)} checkpoints ({run[0][1].url} ... {run[-1][1].url})"
    _check_selects(keys, [k for *_, k, _ in work], where, what="array",
                   known=list(dict.fromkeys(k for _, ck in run for k in ck.array_keys())))
    # an array whose recorded content hashes say it holds the values of the step before
    # (incremental runs, spec §6.6.2) is not read again: it has that step's statistics
    same = {(i, k) for i, ck, k, a in work
            if i > 0 and same_content(run[i - 1][1], ck, k)}
    held = {(i, k) for i, _, k, _ in work}
    same = {(i, k) for i, k in same if (i - 1, k) in held}
    todo = [w for w in work if (w[0], w[2]) not in same]
    total = sum(_nbytes(a) for *_, a in todo)

    def one(item: tuple[int, Checkpoint, str, fmt.ArrayInfo]) -> TensorStats:
        _, ck, k, a = item
        acc = _Moments()
        for box in boxes(a, max_read_bytes):
            acc.add(ck.read_box(k, box))
        return acc.result(k, a)

    found: dict[tuple[int, str], TensorStats] = {}
    done = 0
    for n, (item, s) in enumerate(parallel(one, todo, jobs), 1):
        found[item[0], item[2]] = s
        done += _nbytes(item[3])
        if progress is not None:
            progress(Progress(item[2], done, total, n, len(todo)))
    out = [CheckpointStats(ck.url, step) for step, ck in run]
    for i, _, k, _ in work:  # in step order: the step before's statistics are there already
        if (i, k) in same:
            found[i, k] = found[i - 1, k]
        out[i].tensors.append(found[i, k])
    return out


def _run(paths: Any, storage: StorageOptions | None) -> list[tuple[int | None, Checkpoint]]:
    """``[(step or None, Checkpoint)]``: one checkpoint, a directory or prefix of checkpoints
    (committed ones; pending ones are left out), or a list of checkpoints; in step order
    when every step is known, else in the order given."""
    if isinstance(paths, (str, os.PathLike)):
        try:
            cks = [Checkpoint(paths, storage)]
        except CheckpointNotFoundError:
            cks = [Checkpoint(x.url, storage) for x in ls(paths, storage=storage, sizes=False)
                   if x.state == "committed"]
            if not cks:
                raise CheckpointNotFoundError(f"no committed checkpoints at {os.fspath(paths)!r}") from None
    else:
        cks = [Checkpoint(p, storage) for p in paths]
    run = [(_run_step(ck.url, ck.step), ck) for ck in cks]
    if all(step is not None for step, _ in run):
        run.sort(key=lambda sc: sc[0])
    return run


# image formats matplotlib writes through pillow (the others it writes itself); pgf is left
# out (it needs a LaTeX installation)
_PILLOW_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "tif": "TIFF", "tiff": "TIFF", "webp": "WEBP",
                   "gif": "GIF", "avif": "AVIF"}


def plot_format(out: str | os.PathLike) -> str:
    """The image format :func:`plot_norms` writes to ``out``: the one its suffix names
    (``.png``, ``.pdf``, ``.svg``, ``.jpg`` ...; PNG without a suffix). A suffix matplotlib
    cannot write here raises ``ValueError`` naming those it can; one pillow would write
    but cannot here raises :class:`~zarrckpt.errors.MissingDependencyError`. Checks only
    (no file is written): call it before a long computation."""
    from .._optional import require

    require("matplotlib", "plot_norms()")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ext = os.path.splitext(os.fspath(out))[1].lower().lstrip(".")
    if not ext:
        return "png"
    known = sorted(set(FigureCanvasAgg(Figure()).get_supported_filetypes()) - {"pgf"})
    if ext not in known:
        raise ValueError(f"cannot write a plot to {os.fspath(out)!r}: no image format is named "
                         f".{ext}; matplotlib writes {', '.join('.' + k for k in known)}")
    if ext in _PILLOW_FORMATS:
        try:
            from PIL import Image
        except ImportError as e:  # matplotlib needs pillow: a broken install
            raise MissingDependencyError(f"a .{ext} plot needs pillow, which cannot be imported ({e}); "
                                         "pip install pillow, or write .png, .svg or .pdf", "PIL") from e
        Image.init()
        if _PILLOW_FORMATS[ext] not in Image.SAVE:
            raise MissingDependencyError(
                f"cannot write a plot to {os.fspath(out)!r}: the installed pillow cannot write "
                f"{_PILLOW_FORMATS[ext]} images; write .png, .svg or .pdf, or install a pillow "
                f"built with {_PILLOW_FORMATS[ext]} support", "PIL")
    return ext


def plot_norms(results: Sequence[CheckpointStats], out: str | os.PathLike, *, title: str | None = None) -> str:
    """An image at ``out`` of how each tensor's norm moves across the checkpoints of
    ``results``: the L2 norm per step (log scale when the norms span more than a decade),
    and below it the change relative to the first step, one line per key. The format is
    the one ``out``'s suffix names (:func:`plot_format`: PNG, PDF, SVG, JPEG ...; PNG
    without a suffix). Needs matplotlib (``pip install 'zarrckpt[plot]'``). Returns the path."""
    kind = plot_format(out)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r.step if r.step is not None else i for i, r in enumerate(results)]
    series: dict[str, list[float]] = {}
    for i, r in enumerate(results):
        for t in r.tensors:
            series.setdefault(t.key, [math.nan] * len(results))[i] = t.norm if t.norm is not None else math.nan
    fig = Figure(figsize=(10, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(series) <= 10 else "tab20"].colors
    for i, (key, ys) in enumerate(series.items()):
        style = {"color": palette[i % len(palette)], "linestyle": ("-", "--", ":", "-.")[i // len(palette) % 4],
                 "marker": "o", "markersize": 3, "linewidth": 1.2}
        top.plot(steps, ys, label=key, **style)
        first = next((y for y in ys if y == y), math.nan)
        bottom.plot(steps, [(y / first - 1) * 100 if first else math.nan for y in ys], **style)
    positive = [y for ys in series.values() for y in ys if y == y and y > 0]
    if positive and max(positive) / min(positive) > 10:
        top.set_yscale("log")
    top.set_ylabel("L2 norm")
    top.set_title(title or "norm of each tensor across steps")
    bottom.set_ylabel(f"change since step {steps[0]} (%)" if steps else "change (%)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    if len(series) <= 24:
        top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    path = os.fspath(out)
    fig.savefig(path, format=kind)
    return path
