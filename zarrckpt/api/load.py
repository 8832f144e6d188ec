"""Loading in place, with resharding. Every rank plans from the checkpoint's metadata
and its own targets, then reads only the boxes its local shards cover.

Phases (``g`` is the process group; C = one all-reduce, taken only when ``g`` has
more than one rank; on failure every rank raises an error of one class naming
the failing ranks)::

    open()      read and check the root (committed, format version)
    match()     target keys -> checkpoint keys (key_map); missing keys are an error,
                keys the target lacks are reported (strict="exact": an error too);
                an empty container of the target (a fresh optimizer's ``state``)
                where the checkpoint holds a subtree is filled from it
    validate()  every tensor target: shape, dtype (or cast), dense writable memory
                (no sparse, no stride-0 views); meta targets get real tensors. Nothing
                is touched before every check passed on every rank.
    C1
    read()      every region read, straight into CPU targets of the saved dtype, else
                through a bounded (pinned) arena then ``copy_``; non-tensor values and
                filled subtrees read; then the root is checked again: a checkpoint
                replaced meanwhile is CheckpointChangedError (also when a document or
                chunk check failed because of it)
    C2
    apply()     values set in the caller's containers (a Stateful stays in its slot),
                ``load_state_dict`` on Stateful leaves in key order (the same order on
                every rank)
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..distributed import group as zdist
from ..format import dtypes
from ..format import tree as ztree
from ..storage.inflight import InFlight
from ..planning.state import checked_target, is_array_leaf, is_stateful, needs_initialized_state, owner_of, resolve_stateful
from ..errors import (
    DTypeMismatchError,
    LoadFailedError,
    MissingKeysError,
    ShapeMismatchError,
    StateDictMismatchError,
    UnexpectedKeysError,
)
from ..format.layout import Layout, Replicate, slices as _slices, unit_elements
from ..readers.checkpoint import Checkpoint, CheckpointView
from ..distributed.staging import streaming_arena
from ..storage import ReadBatch, StorageOptions, tile_grid
from . import _progress, shared_reads
from ._gc import paused

log = logging.getLogger("zarrckpt")

__all__ = ["load", "load_state_dict"]

KeyMap = Mapping[str, str] | Callable[[str], str] | None
STRICT_MODES = (True, False, "exact")


def _mapper(key_map: KeyMap) -> Callable[[str], str]:
    if key_map is None:
        return lambda k: k
    if callable(key_map):
        return key_map
    return lambda k: key_map.get(k, k)


def _fmt_keys(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


class LoadRun:
    """One load on one rank, phase by phase."""

    def __init__(self, state_dict: dict, path: Any, g: zdist.Group, *, strict: Any, key_map: KeyMap,
                 cast: bool, max_staging_bytes: int, max_inflight_bytes: int,
                 storage: StorageOptions | None = None, shared_reads: bool | None = None,
                 progress: _progress.ProgressFn | None = None) -> None:
        if not isinstance(state_dict, dict):
            raise StateDictMismatchError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        self.state_dict = state_dict
        self.path = path
        self.g = g
        self.strict = strict
        self.mapped = _mapper(key_map)
        self.cast = cast
        self.max_staging_bytes = max_staging_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.storage = storage
        self.shared_reads = shared_reads
        self.shared: dict | None = None  # shared_reads.run's counters, when they ran
        self.ckpt: Checkpoint | None = None
        self.resolved: Any = None
        self.stateful: dict[tuple, Any] = {}  # key path -> the caller's Stateful there
        self.targets: list[tuple[tuple, Any, str]] = []  # (key path, target leaf, checkpoint key)
        self.tensors: list[tuple[tuple, Any, str]] = []  # the tensor targets among them
        self.pieces: list[list] = []  # per tensor target: _target_pieces (once validated)
        self.fills: list[tuple[tuple, str]] = []  # (key path of an empty container, checkpoint prefix)
        self.infos: dict = {}
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.reads: _Reads | None = None
        self.timings: dict[str, float] = {}
        self.progress = progress
        self.read_total = 0  # bytes this rank reads itself (progress)
        self.read_phases: dict[str, float] = {}  # _Reads.phases: where the read phase went

    def _timed(self, name: str, t0: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    def open(self) -> None:
        t0 = time.perf_counter()
        self.ckpt = Checkpoint(self.path, self.storage)
        self._timed("open", t0)

    def match(self) -> None:
        t0 = time.perf_counter()
        ckpt = self.ckpt
        self.resolved = resolve_stateful(self.state_dict, found=self.stateful)
        seen = set()
        for kp, leaf in ztree.flatten(self.resolved, is_array_leaf):
            tkey = ztree.key_of(kp)
            ckey = self.mapped(tkey)
            if ckey not in ckpt and _is_empty_container(leaf) and ckey in ckpt._groups:
                self.fills.append((kp, ckey))  # e.g. a fresh optimizer's empty "state"
                seen.update(_keys_under(ckpt, ckey))
                continue
            if ckey not in ckpt:
                if ckey in ckpt._groups and _opaque(leaf):
                    raise StateDictMismatchError(_not_a_container(tkey, ckey, leaf, _keys_under(ckpt, ckey)))
                self.missing.append(tkey if ckey == tkey else f"{tkey} (-> {ckey})")
                continue
            seen.add(ckey)
            self.targets.append((kp, leaf, ckey))
        self.unexpected = [k for k in ckpt.keys() if k not in seen]
        if self.strict and self.missing:
            raise MissingKeysError(
                f"{len(self.missing)} key(s) of the target are not in checkpoint {ckpt.url!r}: "
                f"{_fmt_keys(self.missing)} (pass strict=False to leave them as they are, or key_map=)")
        if self.strict == "exact" and self.unexpected:
            raise UnexpectedKeysError(
                f"checkpoint {ckpt.url!r} holds {len(self.unexpected)} key(s) the target lacks: "
                f"{_fmt_keys(self.unexpected)} (strict='exact'; the default strict=True ignores them)")
        self._timed("plan", t0)

    def validate(self) -> None:
        """Check every tensor target against the checkpoint, and that every subtree to fill
        can be filled; touch nothing."""
        t0 = time.perf_counter()
        with self.ckpt.reading():
            self._validate_tensors()
            self._validate_fills()
        self._timed("plan", t0)

    def _validate_tensors(self) -> None:
        ckpt = self.ckpt
        self.tensors = [t for t in self.targets if isinstance(t[1], torch.Tensor)]
        for kp, _, ck in self.tensors:
            if not ckpt.is_array(ck):
                raise StateDictMismatchError(
                    f"key {ztree.key_of(kp)!r}: the target is a tensor but the checkpoint holds a "
                    f"{type(ckpt.read(ck)).__name__} value")
        self.infos = ckpt.array_infos([ck for _, _, ck in self.tensors])
        checked = []
        self.pieces = []
        for kp, leaf, ck in self.tensors:
            info = self.infos[ck]
            where = ztree.key_of(kp) + (f" (checkpoint key {ck!r})" if ck != ztree.key_of(kp) else "")
            if not zdist.is_sharded_tensor(leaf):  # a ShardedTensor answers no layout query: its shards do
                checked_target(leaf, where)  # sparse, nested, quantized: the reason, before shapes
            if info.kind in ("bytes", "bytesio"):
                raise StateDictMismatchError(f"tensor {where!r}: the checkpoint holds bytes there")
            if tuple(leaf.shape) != info.shape:
                raise ShapeMismatchError(f"tensor {where!r}: saved shape {info.shape}, target {tuple(leaf.shape)}")
            saved = dtypes.torch_dtype(info.dtype)
            if saved != leaf.dtype and not self.cast:
                raise DTypeMismatchError(
                    f"tensor {where!r}: saved dtype {saved}, target {leaf.dtype} (pass cast=True to convert)")
            if leaf.device.type == "meta":
                leaf = _materialize(leaf)
                self.resolved = ztree.set_at(self.resolved, kp, leaf)
            pieces = _target_pieces(leaf, where)
            for local, _ in pieces:
                checked_target(local, where)  # a DTensor's local tensor, a ShardedTensor's shards
                if torch._debug_has_internal_overlap(local) == 1:
                    raise StateDictMismatchError(
                        f"tensor {where!r}: the target's elements share memory (an expanded or "
                        "stride-0 view); loading into it would keep only one value per shared "
                        "element. Pass a tensor that owns its memory (e.g. .clone()).")
            checked.append((kp, leaf, ck))
            self.pieces.append(pieces)
        self.tensors = checked

    def _validate_fills(self) -> None:
        """A subtree is filled with plain CPU tensors and values, as saved (the Stateful's
        ``load_state_dict`` then moves them, as ``torch.optim.Optimizer`` does to its
        parameters' devices). Refused where plain tensors would be wrong: the checkpoint
        holds DTensors/ShardedTensors there, or the owner is an optimizer of sharded
        parameters (FSDP2/TP), whose state must be sharded like them."""
        ckpt = self.ckpt
        for kp, ck in self.fills:
            stored = [k for k in _keys_under(ckpt, ck) if ckpt.is_array(k)]
            infos = ckpt.array_infos(stored)
            sharded = [k for k in stored if infos[k].kind in ("dtensor", "sharded_tensor")]
            owner = owner_of(self.stateful, kp)
            if sharded or needs_initialized_state(owner):
                raise StateDictMismatchError(_fill_refused(ztree.key_of(kp), ck, owner, sharded))

    def read(self) -> None:
        t0 = time.perf_counter()
        with self.ckpt.reading():  # one read: the root is checked after it (spec §7.3)
            self._read_all()
        self._timed("read", t0)
        if self.reads is not None:
            self.read_phases = self.reads.phases(self.timings["read"])

    def _read_all(self) -> None:
        ckpt = self.ckpt
        todo = []
        staged = 0  # bytes of targets that go through the staging arena (device, casts)
        for (kp, leaf, ck), pieces in zip(self.tensors, self.pieces):
            for local, boxes in pieces:
                if boxes:
                    todo.append((ck, boxes, local))
                    if not _direct(local, dtypes.torch_dtype(self.infos[ck].dtype)):
                        staged += local.numel() * max(local.element_size(), self.infos[ck].dtype.numpy.itemsize)
        fill_arrays = [k for _, ck in self.fills for k in _keys_under(ckpt, ck) if ckpt.is_array(k)]
        infos = {**self.infos, **ckpt.array_infos(fill_arrays)}
        if self._share():  # collective: every rank, before any read of its own can fail
            rest: list = []

            def pieces() -> list:
                left, mine = shared_reads.split(ckpt, self.infos, todo)
                rest.append(left)
                return mine
            g = self.g if self.g._device().type == "cpu" else self.g.side_group()
            self.shared = shared_reads.run(g, ckpt, pieces)
            todo = rest[0]
        self.reads = reads = _Reads(ckpt, self.max_staging_bytes, self.max_inflight_bytes, staged)
        if self.progress is not None:
            self.read_total = _read_bytes(todo, self.infos) + sum(
                math.prod(infos[k].shape) * infos[k].dtype.numpy.itemsize for k in fill_arrays)
            reads.pending = _Reporting(reads.pending, functools.partial(self.progress, "read"), self.read_total)
        # every target's torch calls before the first read starts: each releases the GIL and,
        # with the reader threads busy, waits to take it back (see _Reads.add)
        targets = [(ck, boxes, local, *_target(local, self.infos[ck])) for ck, boxes, local in todo]
        with reads:
            for ck, boxes, local, direct, base in targets:
                reads.add(ck, self.infos[ck], boxes, local, direct, base)
            plain = _plain_tensors(reads, infos, fill_arrays)
            reads.finish()
        if self.progress is not None:
            self.progress("read", self.read_total, self.read_total)
        filled = {k: _as_leaf(infos[k], plain[k]) for k in fill_arrays}
        for kp, ck in self.fills:
            sub = CheckpointView(ckpt, ck).to_dict(load_array=filled.__getitem__)
            self.resolved = ztree.set_at(self.resolved, kp, sub)
        for kp, leaf, ck in self.targets:
            if not isinstance(leaf, torch.Tensor):
                self.resolved = ztree.set_at(self.resolved, kp, _load_value(ckpt, ck))

    def _share(self) -> bool:
        """Read small pieces through chunk owners (shared_reads)? The same answer on every
        rank: one all-reduce (a rank given another kind of path must not desynchronize)."""
        if not self.g.active or self.g.size < 2 or self.shared_reads is False:
            return False
        want = self.shared_reads is True or bool(self.ckpt.storage.is_object_store)
        return self.g.all_true(want)

    def apply(self) -> None:
        """Set the values read into the caller's containers; Stateful leaves in key order,
        the same on every rank."""
        t0 = time.perf_counter()
        stateful: list[tuple[str, Any, Any]] = []
        _apply(self.state_dict, self.resolved, (), stateful)
        for _, obj, value in sorted(stateful, key=lambda s: s[0]):
            obj.load_state_dict(value)
        self._timed("apply", t0)
        if self.progress is not None:
            self.progress("apply", self.read_total, self.read_total)

    def report(self) -> dict:
        reads = self.reads
        shared = self.shared or {}
        return {"path": self.ckpt.url if self.ckpt else str(self.path), "rank": self.g.rank,
                "bytes_needed": (reads.bytes_needed if reads else 0) + shared.get("bytes_needed", 0),
                "bytes_fetched": (reads.bytes_fetched if reads else 0) + shared.get("bytes_fetched", 0),
                "shared_reads": self.shared,
                "missing": self.missing, "unexpected": self.unexpected,
                "seconds": {**self.timings, "total": sum(self.timings.values())},
                "read_seconds": self.read_phases}


def _opaque(leaf: Any) -> bool:
    """A target leaf that is no value a checkpoint stores and no container: an object whose
    state zarrckpt cannot reach (not Stateful, or it would have been resolved)."""
    return not isinstance(leaf, (dict, list, tuple, str, int, float, type(None))) and not is_array_leaf(leaf)


def _not_a_container(key: str, ck: str, leaf: Any, stored: list[str]) -> str:
    """Why an object target cannot take the subtree the checkpoint holds at its key."""
    has = [m for m in ("state_dict", "load_state_dict") if callable(getattr(leaf, m, None))]
    lacks = [m + "()" for m in ("state_dict", "load_state_dict") if m not in has]
    where = f"key {key!r}" + (f" (checkpoint prefix {ck!r})" if ck != key else "")
    return (f"{where}: the checkpoint holds a subtree there ({len(stored)} key(s): {_fmt_keys(stored, 3)}), "
            f"but the target holds an object of type {type(leaf).__name__}, which is neither a dict/list nor Stateful "
            f"(it has no {' or '.join(lacks)}), so zarrckpt cannot load into it. Pass its state dict "
            f"instead, or give it state_dict() and load_state_dict() (torch.distributed.checkpoint."
            f"stateful.Stateful)")


def _read_bytes(todo: list, infos: dict) -> int:
    """The bytes of the (key, [(global box, local box)], target) reads ``todo``."""
    return sum(math.prod(b - a for a, b in gbox) * infos[ck].dtype.numpy.itemsize
               for ck, boxes, _ in todo for gbox, _ in boxes)


class _Reporting:
    """The reads' in-flight bound, telling ``progress(done, total)`` the bytes of each read
    it is given (only when a progress callback was passed: no per-read work otherwise).
    Whole stored tiles may be read for a staged piece: ``done`` stops at ``total``."""

    def __init__(self, inner: InFlight, progress: Callable[[int, int], None], total: int) -> None:
        self.inner = inner
        self.report = progress
        self.total = total
        self.done = 0
        progress(0, total)

    def add(self, key: str, future: Any, nbytes: int) -> None:
        self.inner.add(key, future, nbytes)
        self.done = min(self.done + nbytes, self.total)
        self.report(self.done, self.total)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _is_empty_container(leaf: Any) -> bool:
    return isinstance(leaf, (dict, list, tuple)) and not leaf


def _keys_under(ckpt: Checkpoint, prefix: str) -> list[str]:
    """The checkpoint's leaf keys under ``prefix`` (full keys, stored order; no I/O)."""
    return CheckpointView(ckpt, prefix)._full_keys


def _fill_refused(key: str, ck: str, owner: Any, sharded: list[str]) -> str:
    """Why an empty subtree of the target cannot be filled from the checkpoint, and what to call."""
    what = f"{type(owner).__name__}'s state_dict()" if owner is not None else "target"
    why = (f"the checkpoint holds DTensors/ShardedTensors there ({_fmt_keys(sharded, 3)}), whose "
           "target placements an empty container does not give" if sharded else
           "its parameters are DTensors (FSDP2/TP) or FSDP flat parameters, so its state must be "
           "sharded like them")
    where = f"key {key!r}" + (f" (checkpoint prefix {ck!r})" if ck != key else "")
    return (f"{where}: the {what} is empty there (a fresh optimizer has no state yet) and {why}. "
            "Create the state first and load into it: model_sd, optim_sd = "
            "torch.distributed.checkpoint.state_dict.get_state_dict(model, optim); "
            "zarrckpt.load({'model': model_sd, 'optim': optim_sd}, path); set_state_dict(model, optim, "
            "model_state_dict=..., optim_state_dict=...) (save it the same way). "
            "zarrckpt.load_state_dict(path) reads the stored state as plain CPU tensors.")


def load(
    state_dict: dict,
    path: Any,
    *,
    process_group: Any = None,
    strict: Any = True,
    key_map: KeyMap = None,
    cast: bool = False,
    report: dict | None = None,
    max_staging_bytes: int = 1 << 30,
    max_inflight_bytes: int = 256 << 20,
    storage: StorageOptions | None = None,
    shared_reads: bool | None = None,
    progress: Any = None,
) -> dict:
    if strict not in STRICT_MODES:
        raise ValueError(f"strict must be True, False or 'exact', not {strict!r}")
    g = zdist.group(process_group)
    fn = _progress.resolve(progress, "load", g.rank)  # tqdm imported here, before any collective
    try:
        with paused():  # see _gc.paused: a collection inside one rank's load stalls every rank
            return _load(state_dict, path, g, strict, key_map, cast, report, max_staging_bytes,
                         max_inflight_bytes, storage, shared_reads, fn)
    finally:
        _progress.close(fn)


def _load(state_dict: dict, path: Any, g: zdist.Group, strict: Any, key_map: KeyMap, cast: bool,
          report: dict | None, max_staging_bytes: int, max_inflight_bytes: int, storage: StorageOptions | None,
          shared_reads: bool | None, progress: _progress.ProgressFn | None) -> dict:
    g.enter("load")  # every rank called load (else a DistributedError names who did not)
    run = None
    error = None
    try:
        run = LoadRun(state_dict, path, g, strict=strict, key_map=key_map, cast=cast,
                      max_staging_bytes=max_staging_bytes, max_inflight_bytes=max_inflight_bytes,
                      storage=storage, shared_reads=shared_reads, progress=progress)
        run.open()
        run.match()
        run.validate()
    except BaseException as e:  # noqa: BLE001 - every rank learns it at C1
        error = e
    g.agree(error, f"loading {str(path)!r}", LoadFailedError)  # C1
    try:
        run.read()
    except BaseException as e:  # noqa: BLE001 - every rank learns it at C2
        error = e
    g.agree(error, f"loading {str(path)!r}", LoadFailedError)  # C2
    run.apply()
    rep = run.report()
    log.info("zarrckpt load %s: %s", rep["path"], rep)
    if g.rank == 0:  # once per job, not once per rank
        _say_what_was_left(run.unexpected, run.missing, strict, rep["path"], g.size)
    if report is not None:
        report.update(rep)
    return state_dict


def _say_what_was_left(unexpected: list[str], missing: list[str], strict: Any, url: str, world: int) -> None:
    """What a load did not touch, said once per job (by rank 0, about its own target; every
    rank's lists are in its report): stored keys the target has no place for and, with
    strict=False, the target's keys the checkpoint lacks. One message in both modes:
    strict=False warns (``UserWarning``: it relaxed the check, so what it let through is
    said); strict=True logs it at INFO on the ``zarrckpt`` logger (stored keys the target
    lacks are normal there, as in DCP: pipeline/expert-parallel ranks, a model loaded
    without its optimizer; its missing keys were an error)."""
    parts = []
    if unexpected:
        parts.append(f"left {len(unexpected)} stored key(s) of {url!r} unloaded (the target has no "
                     f"place for them): {_fmt_keys(unexpected)}")
    if missing and strict is False:
        parts.append(f"left {len(missing)} key(s) of the target as they were (not in the checkpoint): "
                     f"{_fmt_keys(missing)}")
    if not parts:
        return
    on = f" on rank 0 of {world}" if world > 1 else ""
    text = (f"zarrckpt.load(strict={strict!r}){on} " + "; and ".join(parts)
            + "; report['unexpected'] and report['missing'] list them" + (" (each rank's own)" if world > 1 else ""))
    if strict is False:
        warnings.warn(text, UserWarning, stacklevel=6)  # the caller of zarrckpt.load
    else:
        log.info(text)


class _Reads:
    """Region reads of one load: straight into CPU targets of the saved dtype; through a
    bounded (pinned) arena for device targets and casts, batch by batch."""

    def __init__(self, ckpt: Checkpoint, max_staging_bytes: int, max_inflight_bytes: int,
                 staged_bytes: int | None = None) -> None:
        self.ckpt = ckpt
        self.arena = None
        self._lease = contextlib.ExitStack()  # the process's streaming arena, while borrowed
        # a region bigger than this is read as several pieces along inner-chunk boundaries,
        # so that the in-flight bound keeps many reads going whatever the tensor sizes
        self.piece_bytes = max(1 << 20, min(32 << 20, max_inflight_bytes // 8))
        # the arena: what the staged targets need (two pieces at least), at most the bound;
        # staged pieces fit in half of it
        want = max_staging_bytes if staged_bytes is None else max(staged_bytes, 2 * self.piece_bytes)
        self.max_staging_bytes = min(max_staging_bytes, want + (1 << 16))
        self.stage_piece_bytes = max(1, min(self.piece_bytes, self.max_staging_bytes // 2 - 128))
        self.pending = InFlight(max_inflight_bytes, op="read")  # reads in flight
        # small reads not yet handed to a reader thread: a batch holds at most a piece's bytes
        # (8 MiB with the default bound of 256 MiB in flight; less under a smaller bound)
        self.small = ReadBatch(min(ReadBatch.MAX_BYTES, self.piece_bytes))
        self.batch: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, staged) to copy
        self.halves: list = []  # the arena's two halves (double buffering), once needed
        self.half_np: list[np.ndarray] = []  # NumPy views of them
        self.cur = 0  # the half being read into
        self.copying: list[list] = [[], []]  # per half: CUDA events of its copies in flight
        self.scratch: dict[tuple[int, torch.device], torch.Tensor] = {}  # see _scratch
        self.bytes_needed = 0
        self.bytes_fetched = 0
        self.copy_s = 0.0  # issuing the copies out of the arena (_switch)
        self.sync_s = 0.0  # waiting for a half's device copies before reading into it again

    def phases(self, total: float) -> dict[str, float]:
        """Where the read phase's ``total`` seconds went on the calling thread: waiting for
        reads (the in-flight bound, a half's reads before its copies), issuing copies out of
        the arena, waiting for device copies, and the rest (issuing the reads)."""
        pending = getattr(self.pending, "inner", self.pending)
        wait = pending.waited
        return {"wait_reads": wait, "copy": self.copy_s, "device_sync": self.sync_s,
                "issue": max(0.0, total - wait - self.copy_s - self.sync_s)}

    def add(self, key: str, info: Any, boxes: list, local: torch.Tensor, direct: bool | None = None,
            base: np.ndarray | None = None) -> None:
        """Read the (global box, local box) pairs of array leaf ``key`` into ``local``,
        through the checkpoint's read primitive (packed leaves included). ``direct`` and
        ``base``: :func:`_target` of ``local``, computed by the caller before any read.

        Nothing here calls torch: a torch call releases the GIL, and while reads are in
        flight, dozens of reader threads take it in turn, so on a many-core host each such
        call waited about a millisecond and the reads were issued slower than they ran
        (a 2,000-tensor GPU load: 0.4 s of the main thread's 0.5 s). Staged pieces get
        NumPy views of the arena; their torch views are made in :meth:`_switch`, when the
        reads of that half are done."""
        if direct is None:
            direct, base = _target(local, info)
        unit = info.inner_chunk_shape or info.chunk_shape  # the smallest unit a read fetches
        itemsize = info.dtype.numpy.itemsize
        tile = None if direct or not info.shape else self.ckpt.tile_shape(key)
        files = self.ckpt.local_array(key)  # small reads of it go in batches (ReadBatch)
        for gbox, lbox in boxes:
            if any(a == b for a, b in gbox):
                continue
            self.bytes_needed += math.prod(b - a for a, b in gbox) * itemsize
            self.bytes_fetched += unit_elements(gbox, unit, info.shape) * itemsize
            for pg, pl in _pieces(gbox, lbox, unit, itemsize,
                                  self.piece_bytes if direct else self.stage_piece_bytes):
                # in flight: the whole units the piece touches, which a checked TensorStore
                # read of an unaligned piece allocates beside the target (reshards onto
                # shards smaller than a unit counted a row where a unit was held)
                cost = unit_elements(pg, unit, info.shape) * itemsize
                if direct:  # straight into the target
                    view = base[_slices(pl)] if pl else base
                    self._read(key, files, pg, view, False, max(view.nbytes, cost))
                    continue
                # piece by piece through the staging arena, then copied (and cast): whole
                # stored inner chunks as they lie in the file where the piece is made of them
                # (read with no copy; moved into place by the copy to the target, on its
                # device), else the piece itself
                grid = tile_grid(pg, tile, info.shape) if tile else None
                view = self._staging((math.prod(grid), *tile), info, local, pl, (grid, tile, pg)) \
                    if grid else None
                if view is not None:
                    self._read(key, files, pg, view, True, view.nbytes)
                    continue
                view = self._staging(tuple(b - a for a, b in pg), info, local, pl)
                self._read(key, files, pg, view, False, max(view.nbytes, cost))

    def _read(self, key: str, files: Any, box: tuple, out: np.ndarray, tiles: bool, cost: int) -> None:
        """Read ``box`` of ``key`` into ``out`` (its tiles, with ``tiles``): a small read of an
        array whose files are read directly (``files``) joins the batch (one pool task for
        many), others start now."""
        if files is not None and cost <= ReadBatch.SMALL:
            self.small.add(files, key, box, out, tiles, cost)
            if self.small.full:
                self._submit_small()
            return
        read = self.ckpt.read_tiles if tiles else self.ckpt.read_into
        self.pending.add(key, read(key, box, out), cost)

    def _submit_small(self) -> None:
        batch = self.small.submit()
        if batch is not None:
            self.pending.add(*batch)

    def _staging(self, shape: tuple[int, ...], info: Any, target: torch.Tensor, pl: tuple,
                 tiling: tuple | None = None) -> np.ndarray | None:
        """A host buffer for ``target[pl]``'s data, from the current half of the arena; when it
        is full, the other half's device copies must have finished (double buffering: one
        half is read into while the other's host->device copies run). ``tiling``: the
        buffer holds tiles (``(grid, tile shape, global box)``, see :func:`_untile`);
        None where they would not fit a half."""
        npdtype = info.dtype.numpy
        nbytes = math.prod(shape) * npdtype.itemsize
        if self.arena is None:
            self.arena = self._lease.enter_context(streaming_arena(self.max_staging_bytes))
            self.halves = self.arena.split(2)
            self.half_np = [h.raw().numpy() for h in self.halves]
        half = self.halves[self.cur]
        if nbytes > half.capacity:  # a tiny arena: a buffer of its own
            if tiling is not None:
                return None
            buf = torch.empty(shape, dtype=dtypes.torch_dtype(info.dtype), pin_memory=self.arena.pinned)
            self.batch.append((target, pl, buf))
            return dtypes.to_numpy(buf)
        if not half.fits(nbytes):
            self._switch()
            half = self.halves[self.cur]
        start = half.take_bytes(nbytes)
        self.batch.append((target, pl, (self.cur, start, nbytes, info.dtype, shape, tiling)))
        return self.half_np[self.cur][start:start + nbytes].view(npdtype).reshape(shape)

    def _switch(self) -> None:
        """Wait for the reads into the current half, start its copies to the targets, and
        make the other half current once its own copies are done."""
        self._submit_small()
        self.pending.wait()
        events = []
        t0 = time.perf_counter()
        with torch.no_grad():
            for target, pl, src in self.batch:
                dst = target[_slices(pl)] if pl else target
                if not isinstance(src, torch.Tensor):
                    half, start, nbytes, dtype, shape, tiling = src
                    src = self.halves[half].raw()[start:start + nbytes].view(dtypes.torch_dtype(dtype))
                    if tiling is not None:
                        _untile(src, *tiling, dst, self._scratch)
                        continue
                    src = src.view(shape)
                dst.copy_(src, non_blocking=True)
            for dev in {t.device for t, _, _ in self.batch if t.device.type == "cuda"}:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                events.append(ev)
        self.batch = []
        self.copying[self.cur] = events
        self.cur ^= 1
        t1 = time.perf_counter()
        self.copy_s += t1 - t0
        for ev in self.copying[self.cur]:
            ev.synchronize()
        self.sync_s += time.perf_counter() - t1
        self.copying[self.cur] = []
        if self.halves:
            self.halves[self.cur].reset()

    def _scratch(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """Device buffer ``slot`` (0: tiles copied from the host, 1: tiles put in order) of at
        least ``nbytes``, kept for the rest of the load. Copies through it are queued on the
        device's current stream, in order, so one buffer serves every piece."""
        buf = self.scratch.get((slot, device))
        if buf is None or buf.numel() < nbytes:
            buf = self.scratch[(slot, device)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def finish(self) -> None:
        self._switch()
        self._switch()  # both halves copied

    def __enter__(self) -> _Reads:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving by an error waits for every read still in flight (and copies issued);
        the streaming arena goes back to the process either way."""
        if exc_type is not None:
            self.pending.drain()
            for events in self.copying:
                for ev in events:
                    ev.synchronize()
        self.arena = None
        self.halves = []
        self.scratch = {}
        self._lease.close()


def _untile(src: torch.Tensor, grid: tuple[int, ...], tile: tuple[int, ...], box: tuple, dst: torch.Tensor,
            scratch: Callable[[int, int, torch.device], torch.Tensor]) -> None:
    """``dst`` (the part ``box`` of an array) from ``src``: the tiles of ``box`` (1-D, the
    array's dtype; ``grid`` of ``tile``-shaped tiles, C order, padding included), copied to
    ``dst``'s device first if they are not there. One strided copy puts the tiles in order
    (straight into ``dst`` where ``box`` holds whole tiles; else into a buffer whose part
    without padding is then copied); casts to ``dst``'s dtype on the way."""
    if src.device != dst.device:
        dev = scratch(0, src.numel() * src.element_size(), dst.device).view(src.dtype)
        dev.copy_(src, non_blocking=True)
        src = dev
    n = len(grid)
    order = [x for d in range(n) for x in (d, n + d)]
    tiles = src.view(*grid, *tile).permute(order)  # (grid 0, tile 0, grid 1, tile 1, ...)
    padded = [g * t for g, t in zip(grid, tile)]
    if all(p == b - a for p, (a, b) in zip(padded, box)):
        for d in reversed(range(n)):
            dst = dst.unflatten(d, (grid[d], tile[d]))
        dst.copy_(tiles, non_blocking=True)
        return
    ordered = scratch(1, src.numel() * src.element_size(), src.device).view(src.dtype).view(tiles.shape)
    ordered.copy_(tiles)
    dst.copy_(ordered.view(padded)[tuple(slice(0, b - a) for a, b in box)], non_blocking=True)


def _target(local: torch.Tensor, info: Any) -> tuple[bool, np.ndarray | None]:
    """(is ``local`` read straight into, its NumPy view if so): see :func:`_direct`."""
    if _direct(local, dtypes.torch_dtype(info.dtype)):
        return True, dtypes.to_numpy(local.detach())
    return False, None


def _direct(local: torch.Tensor, saved: torch.dtype) -> bool:
    """Read straight into ``local``'s memory: a CPU tensor of the saved dtype whose bits are
    its values (a conjugate or negative view goes through staging and ``copy_``)."""
    return local.device.type == "cpu" and local.dtype == saved and not local.is_conj() and not local.is_neg()


def _pieces(gbox, lbox, unit, itemsize: int, max_bytes: int):
    """(global box, local box) pieces of at most ~``max_bytes`` that split a region along
    its first dim spanning several read units, at unit (inner chunk) boundaries."""
    extents = [b - a for a, b in gbox]
    total = math.prod(extents) * itemsize
    d = next((i for i, ((a, b), u) in enumerate(zip(gbox, unit)) if b - a > u), None)
    if total <= max_bytes or d is None:
        yield gbox, lbox
        return
    a, b = gbox[d]
    u = unit[d]
    per_index = total // (b - a)
    step = max(u, (max_bytes // max(per_index, 1)) // u * u)
    s = a
    while s < b:
        e = min(b, (s // u) * u + step)  # ends on a unit boundary (or at the region's end)
        shift = s - a
        pg = gbox[:d] + ((s, e),) + gbox[d + 1:]
        lo = lbox[d][0] + shift
        pl = lbox[:d] + ((lo, lo + e - s),) + lbox[d + 1:]
        yield pg, pl
        s = e


def _load_value(ckpt: Checkpoint, key: str) -> Any:
    if not ckpt.is_array(key):
        return ckpt.read(key)
    info = ckpt.array_info(key)
    data = ckpt.read(key)
    if info.kind == "bytesio":
        return io.BytesIO(data if isinstance(data, bytes) else np.asarray(data).tobytes())
    if info.kind in ("bytes", "ndarray"):
        return data
    return dtypes.from_numpy(data, info.dtype)


def _materialize(leaf: torch.Tensor) -> torch.Tensor:
    """A real tensor for a meta target (as DCP does): on the mesh's device for DTensors,
    on the CPU otherwise. It replaces the target in the returned state dict."""
    if zdist.is_dtensor(leaf):
        return zdist.materialize_dtensor(leaf)
    if zdist.is_sharded_tensor(leaf):
        raise StateDictMismatchError("a ShardedTensor target on the meta device cannot be materialized")
    return torch.empty(leaf.shape, dtype=leaf.dtype, device="cpu")


@functools.lru_cache(maxsize=4096)
def _layout_boxes(shape: tuple, mesh_shape: tuple, placements: tuple, coord: tuple) -> tuple[Layout, tuple]:
    """A target layout and its (global box, local box) pairs at ``coord`` (cached: a
    state's leaves share few shapes and layouts, and loads repeat them)."""
    layout = Layout(shape, mesh_shape, placements)
    return layout, tuple(layout.local_boxes(coord))


def _target_pieces(leaf: torch.Tensor, key: str) -> list[tuple[torch.Tensor, list]]:
    """(local tensor, [(global box, local box), ...]) for each local piece of a target."""
    if zdist.is_dtensor(leaf):
        mesh_shape, _, placements, _, _, coord = zdist.dtensor_info(leaf)
        if coord is None:
            return []
        layout, boxes = _layout_boxes(tuple(leaf.shape), mesh_shape, placements, coord)
        local = leaf._local_tensor if hasattr(leaf, "_local_tensor") else leaf.to_local()
        layout.check_local_shape(tuple(local.shape), coord, key)
        return [(local, list(boxes))]
    if zdist.is_sharded_tensor(leaf):
        pieces = []
        for shard in leaf.local_shards():
            md = shard.metadata
            gbox = tuple((o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))
            pieces.append((shard.tensor, [(gbox, tuple((0, s) for s in md.shard_sizes))]))
        return pieces
    _, boxes = _layout_boxes(tuple(leaf.shape), (1,), (Replicate(),), (0,))
    return [(leaf, list(boxes))]


def _apply(orig: Any, res: Any, path: tuple, stateful: list) -> Any:
    """Write loaded values back into the caller's structure; Stateful leaves are collected
    (with their key) for ``load_state_dict`` in key order and stay in their slots (the
    container's ``__setitem__`` is not called for them, as in DCP). An empty dict or list
    filled from the checkpoint is filled in place."""
    if is_stateful(orig):
        stateful.append((ztree.key_of(path), orig, res))
        return orig
    if _is_empty_container(orig) and isinstance(res, (dict, list, tuple)) and res:
        if isinstance(orig, dict) and isinstance(res, dict):
            orig.update(res)
            return orig
        if isinstance(orig, list) and isinstance(res, list):
            orig.extend(res)
            return orig
        return res
    if isinstance(orig, dict) and isinstance(res, dict):
        for k in orig:
            if k in res:
                new = _apply(orig[k], res[k], path + (k,), stateful)
                if not is_stateful(orig[k]):
                    orig[k] = new
        return orig
    if isinstance(orig, list) and isinstance(res, (list, tuple)) and len(orig) == len(res):
        for i in range(len(orig)):
            new = _apply(orig[i], res[i], path + (i,), stateful)
            if not is_stateful(orig[i]):
                orig[i] = new
        return orig
    if isinstance(orig, tuple) and isinstance(res, (list, tuple)) and len(orig) == len(res):
        return type(orig)(_apply(o, r, path + (i,), stateful) for i, (o, r) in enumerate(zip(orig, res)))
    if isinstance(orig, torch.Tensor) and orig is res:
        return orig
    return res


def load_state_dict(path: Any, keys: list[str] | str | None = None, *,
                    storage: StorageOptions | None = None,
                    max_inflight_bytes: int = 256 << 20) -> dict:
    """The whole checkpoint (or the keys/prefixes asked for) as plain CPU tensors. Every
    array is read concurrently, in pieces (bounded by ``max_inflight_bytes``), so one
    process uses all its cores and the storage's parallelism. ``keys``: a key or prefix, or
    a list of them (a ``str`` is one key, not a sequence of letters)."""
    if isinstance(keys, str):
        keys = [keys]
    ckpt = Checkpoint(path, storage)
    with ckpt.reading():  # one read: the root is checked after it (spec §7.3)
        wanted: list[str] = []
        ckpt.to_dict(keys, lambda key: wanted.append(key))  # which leaves, without reading
        arrays = [k for k in wanted if ckpt.is_array(k)]
        infos = ckpt.array_infos(arrays)
        with _Reads(ckpt, 1, max_inflight_bytes) as reads:
            out = _plain_tensors(reads, infos, arrays)
            reads.finish()
        values = {k: _as_leaf(infos[k], out[k]) for k in arrays}
        return ckpt.to_dict(keys, lambda key: values[key] if key in values else ckpt.read(key))


def _plain_tensors(reads: _Reads, infos: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    """New CPU tensors of the saved dtypes for the array leaves ``keys``, their whole reads
    added to ``reads`` (done once ``reads.finish()`` returns)."""
    out = {k: torch.empty(infos[k].shape, dtype=dtypes.torch_dtype(infos[k].dtype)) for k in keys}
    targets = [(k, t, *_target(t, infos[k])) for k, t in out.items() if t.numel()]  # before any read
    for k, t, direct, base in targets:
        reads.add(k, infos[k], [(tuple((0, n) for n in infos[k].shape),) * 2], t, direct, base)
    return out


def _as_leaf(info: Any, t: torch.Tensor) -> Any:
    """A loaded array as the leaf type it was saved as."""
    if info.kind in ("bytes", "bytesio"):
        data = dtypes.to_numpy(t).tobytes()
        return io.BytesIO(data) if info.kind == "bytesio" else data
    if info.kind == "ndarray":
        return dtypes.to_numpy(t)
    return t
