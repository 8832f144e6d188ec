"""``verify``: every document, chunk and checksum of a checkpoint, damage reported, not raised.

In order: the root (strict parsing, its own digest, committed), every array ``zarr.json``
(a regular file, present, its SHA-256 as the root records it, valid per spec §5, equal to
its entry in the root's consolidated metadata), the
ranges of packed leaves within their packs, one listing of the store to find every chunk
(shard) object the chunk grid needs (a missing one is reported without reading it: a
generic Zarr reader would return fill values for it), then every stored chunk read
through the checkpoint's read primitive with TensorStore's zarr3 decoder (the reference
decoder of checksums and shard indexes, whatever path zarrckpt's loads take: local
loads read chunk files themselves), which checks each CRC-32C and shard index and fails on a missing
inner chunk that overlaps the array (inner chunks wholly in an edge shard's padding may be
absent, §5.3). A failed shard is re-read inner chunk by inner chunk to name each broken
one. Finally the root is read again: a checkpoint replaced meanwhile is reported.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..format import documents as fmt
from .walk import Box, JsonReport, Progress, ProgressFn, box_bytes, chunk_grid, parallel, raw_root, units
from ..errors import CheckpointNotFoundError, FormatError, IncompleteCheckpointError, IntegrityError, ZarrckptError
from .checkpoint import Checkpoint, _result_bytes
from ..storage import StorageOptions, open_storage, status_code

__all__ = ["DEFAULT_JOBS", "DEFAULT_MAX_READ_BYTES", "Problem", "VerifyReport", "verify"]

DEFAULT_MAX_READ_BYTES = 64 << 20
DEFAULT_JOBS = 4


@dataclass
class Problem(JsonReport):
    """One thing wrong. ``kind``: ``uncommitted``, ``root`` (the root document),
    ``digest`` (a document that does not match its SHA-256), ``metadata`` (an array
    document that breaks the spec, or differs from the root's consolidated entry), ``missing`` (a document, chunk or inner chunk absent),
    ``checksum`` (a chunk or shard index failing its CRC-32C, a truncated chunk),
    ``position`` (format 1.3: an intact chunk or inner chunk whose CRC-32C is not the one the
    root records for its place, spec §6.6: swapped chunk files, a redirected index entry),
    ``unreadable`` (any other read failure), ``pack`` (a packed leaf outside its pack),
    ``changed`` (the checkpoint was replaced during the check). ``array``: the array path
    (``model/w``, ``.packs/0``); ``keys``: the leaves stored there; ``chunk``: the chunk's
    storage key under the array (``c/1/0``), with ``inner`` the inner chunk's index in its
    shard."""

    kind: str
    message: str
    array: str | None = None
    keys: list[str] = field(default_factory=list)
    chunk: str | None = None
    inner: tuple[int, ...] | None = None

    def where(self) -> str:
        """``model/w chunk c/1/0 inner [0, 1]``, ``.packs/0 (holds model/a, model/b) chunk c/0``,
        or ``root zarr.json``."""
        if self.array is None:
            return "root zarr.json"
        out = self.array
        if self.keys and self.keys != [self.array]:
            shown = ", ".join(self.keys[:3]) + (f", +{len(self.keys) - 3} more" if len(self.keys) > 3 else "")
            out += f" (holds {shown})"
        if self.chunk is not None:
            out += f" chunk {self.chunk}"
            if self.inner is not None:
                out += f" inner {list(self.inner)}"
        return out


@dataclass
class VerifyReport(JsonReport):
    """What :func:`verify` checked and found. ``ok`` is True only when nothing is wrong."""

    url: str
    state: str
    save_id: str | None = None
    arrays: int = 0
    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    _json_extra = ("ok",)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _Target:
    """An array to check: its path, the leaf keys stored in it, its parsed metadata."""

    path: str
    keys: list[str]
    pack: bool
    info: fmt.ArrayInfo | None = None


def verify(path: str | os.PathLike, *, jobs: int = DEFAULT_JOBS, progress: ProgressFn | None = None,
           storage: StorageOptions | None = None, max_read_bytes: int = DEFAULT_MAX_READ_BYTES) -> VerifyReport:
    """Check everything about the checkpoint at ``path`` (see the module docstring) and
    report every problem found: a :class:`VerifyReport` whose ``ok`` is True only when
    the root is committed and intact, every array document matches its digest and the
    spec, every chunk the grid needs is stored and every chunk decodes with correct
    checksums. ``jobs`` chunks are read at once. Raises only when there is no checkpoint
    at ``path`` (:class:`CheckpointNotFoundError`) or storage cannot be reached
    (:class:`StorageError`); damage is reported, not raised."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, not {jobs!r}")
    t0 = time.perf_counter()
    try:
        ck = Checkpoint(path, dataclasses.replace(storage or StorageOptions(), chunk_io="tensorstore"))
    except CheckpointNotFoundError:
        raise
    except IncompleteCheckpointError as e:
        st = open_storage(path, storage)
        attrs = raw_root(st) or {}
        return VerifyReport(st.url, "pending", attrs.get("save_id"), seconds=time.perf_counter() - t0,
                            problems=[Problem("uncommitted", str(e))])
    except FormatError as e:
        st = open_storage(path, storage)
        return VerifyReport(st.url, "damaged", seconds=time.perf_counter() - t0,
                            problems=[Problem("digest" if isinstance(e, IntegrityError) else "root", str(e))])
    report = VerifyReport(ck.url, "committed", ck.save_id)
    targets = _targets(ck)
    report.arrays = len(targets)
    _check_documents(ck, targets, report)
    present = _stored_keys(ck)
    _check_packed_ranges(ck, targets, report)
    work: list[tuple[_Target, tuple[int, ...], Box]] = []
    for t in targets:
        if t.info is None:
            continue
        for index, box in chunk_grid(t.info.shape, t.info.chunk_shape):
            key = fmt.chunk_key(index)
            if f"{t.path}/{key}" not in present:
                report.problems.append(Problem("missing", "not in storage (a generic Zarr reader would return fill "
                                                      "values)", t.path, t.keys, key))
                continue
            work.append((t, index, box))
    report.chunks = len(work)
    _check_chunks(ck, work, report, jobs, progress, max_read_bytes)
    _check_unchanged(ck, report)
    report.seconds = time.perf_counter() - t0
    return report


def _targets(ck: Checkpoint) -> list[_Target]:
    """Every array of the checkpoint: array nodes (in key order) and pack arrays, each
    with the leaf keys stored in it."""
    out: dict[str, _Target] = {}
    for key in ck.keys():
        node = ck.node(key)
        if "array" in node:
            out[key] = _Target(key, [key], False)
        elif "packed" in node:
            p = node["packed"]["pack"]
            out.setdefault(p, _Target(p, [], True)).keys.append(key)
    return list(out.values())


def _check_documents(ck: Checkpoint, targets: list[_Target], report: VerifyReport) -> None:
    """Each array ``zarr.json``: a regular file (local stores), present, matching its digest,
    valid (spec §5). Read concurrently."""
    pending = []
    for t in targets:
        try:
            ck._check_files(t.path, t.keys[0])
        except ZarrckptError as e:
            report.problems.append(Problem("metadata", str(e), t.path, t.keys))
            continue
        pending.append((t, ck.storage.get(f"{t.path}/zarr.json")))
    for t, future in pending:
        try:
            data = _result_bytes(future, f"{ck.url}/{t.path}/zarr.json")
            if data is None:
                report.problems.append(Problem("missing", "its zarr.json is not in storage", t.path, t.keys))
                continue
            t.info = ck._parse_array(t.keys[0] if not t.pack else t.path, t.path, data, pack=t.pack)
            ck._arrays[t.path] = t.info  # what the read primitive reads it by
            cons = ck.info.consolidated
            if cons is not None and fmt.decode_document(data, t.path) != cons[t.path]:
                report.problems.append(Problem("metadata", "its zarr.json differs from its entry in the root's "
                                               "consolidated_metadata (spec §6.7)", t.path, t.keys))
        except IntegrityError as e:
            report.problems.append(Problem("digest", str(e), t.path, t.keys))
        except FormatError as e:
            report.problems.append(Problem("metadata", str(e), t.path, t.keys))


def _check_packed_ranges(ck: Checkpoint, targets: list[_Target], report: VerifyReport) -> None:
    for t in targets:
        if not t.pack or t.info is None:
            continue
        length = t.info.shape[0]
        for key in t.keys:
            d = ck.node(key)["packed"]
            if d["offset"] + d["nbytes"] > length:
                report.problems.append(Problem(
                    "pack", f"packed leaf {key!r}: bytes {d['offset']}..{d['offset'] + d['nbytes']} lie outside "
                    f"its pack of {length} bytes", t.path, [key]))


def _stored_keys(ck: Checkpoint) -> set[str]:
    """Every storage key under the checkpoint (one listing)."""
    return set(ck.storage.list_keys())


def _classify(e: BaseException) -> str:
    if getattr(e, "zarrckpt_misplaced", False):  # intact bytes at another unit's place (spec §6.6)
        return "position"
    code = status_code(e)
    if code == "NOT_FOUND":
        return "missing"
    if code == "DATA_LOSS":
        return "checksum"
    return "unreadable"


def _detail(e: BaseException) -> str:
    text = str(e)
    code = status_code(e)
    text = text[len(code) + 2:] if code else text
    return text.split(" [source locations=")[0].strip()


def _check_chunks(ck: Checkpoint, work: list[tuple[_Target, tuple[int, ...], Box]], report: VerifyReport,
                  jobs: int, progress: ProgressFn | None, budget: int) -> None:
    def todo() -> Iterator[tuple[_Target, tuple[int, ...], Box, Box]]:
        for t, index, box in work:
            for u in units(box, t.info.inner_chunk_shape, t.info.dtype.numpy.itemsize, budget):
                yield t, index, box, u

    total = sum(box_bytes(box, t.info.dtype.numpy.itemsize) for t, _, box in work)
    count = sum(1 for _ in todo())
    def check(unit: tuple[_Target, tuple[int, ...], Box, Box]) -> list[Problem]:
        t, index, chunk_box, box = unit
        try:
            _read(ck, t, box)
            return []
        except Exception as e:  # noqa: BLE001
            return _locate(ck, t, index, chunk_box, box, e)

    done_bytes = 0
    for n, (unit, problems) in enumerate(parallel(check, todo(), jobs), 1):
        t, _, _, box = unit
        done_bytes += box_bytes(box, t.info.dtype.numpy.itemsize)
        report.problems.extend(problems)
        if progress is not None:
            progress(Progress(t.keys[0], done_bytes, total, n, count))
    report.bytes = done_bytes


def _read(ck: Checkpoint, t: _Target, box: Box) -> None:
    """Read ``box`` of the array ``t`` through the read primitive, raising the storage
    layer's own error (its status says missing, checksum or undecodable)."""
    out = np.empty([b - a for a, b in box], dtype=t.info.dtype.numpy)
    ck._read_into(t.path, box, out).result()


def _locate(ck: Checkpoint, t: _Target, index: tuple[int, ...], chunk_box: Box, box: Box, e: BaseException
            ) -> list[Problem]:
    """The problems behind a failed read of ``box``: for a shard, each failing inner chunk
    (or the shard index once, when it is what fails); else the chunk."""
    key = fmt.chunk_key(index)
    inner = t.info.inner_chunk_shape
    if inner is None or "shard index" in str(e):
        what = "shard index: " if inner is not None else ""
        return [Problem(_classify(e), what + _detail(e), t.path, t.keys, key)]
    subs = units(box, inner, 1, 0)  # one inner chunk each
    out = []
    for sub in subs:
        try:
            _read(ck, t, sub)
        except Exception as e2:  # noqa: BLE001
            pos = tuple((a - c0) // n for (a, _), (c0, _), n in zip(sub, chunk_box, inner))
            out.append(Problem(_classify(e2), _detail(e2), t.path, t.keys, key, pos))
    if not out or (len(out) == len(subs) > 1):  # the whole shard fails: one problem
        return [Problem(_classify(e), _detail(e), t.path, t.keys, key)]
    return out


def _check_unchanged(ck: Checkpoint, report: VerifyReport) -> None:
    attrs = raw_root(ck.storage)
    if attrs is None or attrs.get("save_id") != ck.save_id or attrs.get("state") != "committed":
        report.problems.append(Problem("changed", f"the checkpoint at {ck.url!r} was replaced or un-committed "
                                       "while it was being verified; verify it again"))
