"""A save, phase by phase (spec §7 describes the commit rule these implement).

Phases and agreement points, in order (``g`` is the process group; C = one
all-reduce; a failure anywhere before an agreement point is reported there, and
every rank then raises an error of the same class naming the failing ranks)::

    enter()     every rank has called save (the c10d store, ``entry_timeout``)
    plan()      resolve Stateful, encode the tree, check every leaf and lay out each
                array: this rank's chunk writes and boundary sends (local, no I/O)
    C0 agree()  planning succeeded everywhere; every rank has the same path and
                storage options; same trees? (yes: small plain leaves are packed;
                no, e.g. pipeline stages: rank 0 gathers the trees); rank 0's save
                id and time
    prepare()   rank 0: check and claim the location, create this save's directory
                with its pending root and group documents (_commit.begin);
                every rank: slice boundary pieces and allocate receive buffers
    C1          directory ready everywhere
    exchange()  point-to-point boundary pieces (only nested uneven layouts)
    [async: stage() copies every local shard into the reused arena; C1b]
    write()     every rank writes its arrays' zarr.json (metadata writer = writer of
                chunk 0) and the chunks it owns; waits for every write it issued,
                even after an error; then one syncfs
    C2          all data durable everywhere
    commit()    rank 0: committed root, moved into place (_commit.publish)
    C3          commit durable; every rank returns

After a failure past C1, rank 0 deletes the save's directory (_commit.abandon).
``async_save`` (``api/async_save.py``) runs everything up to C1b in the caller's thread,
then write/C2/commit/C3 in a background thread over a separate gloo group.

Claim, C1, the chunk writes, C2, commit, C3 and abandon are the save engine's
(``engine/save.py``, shared with ``Writer`` and ``zarrckpt.jax.save``); this module is its
torch adapter: planning, packing, the boundary exchange and staging, and the records
(:class:`engine.ArrayWrite`) the engine writes from.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import json
import logging
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np
import torch

from ..engine import commit as _commit
from ..distributed import group as zdist
from ..format import dtypes, documents as fmt, tree as ztree
from ..engine import save as engine
from ..readers.previous import Previous
from ._gc import paused
from ..planning.plan import (ArrayPlan, PlanOptions, assign_packs, leaf_order, local_data, local_view, pack_bytes, plan_state,
                             drop_mesh_replicas, resolve_reusing, restrict_to_holders, with_save_id, with_source)
from ..planning.state import is_array_leaf, resolve_stateful
from ..format.layout import slices as _slices
from ..errors import SaveFailedError, UnsupportedValueError
from ..distributed.staging import Arena, staged_nbytes, streaming_arena, sync_devices
from ..storage import Storage, StorageOptions, open_storage, plain_body
from . import _progress

log = logging.getLogger("zarrckpt")

__all__ = ["SaveOptions", "SaveRun", "forget_staging", "plan_and_prepare", "run_save", "save"]


DEFAULT_CHUNK_TARGET_BYTES = 256 << 20  # see SaveOptions.chunk_target_bytes and BENCHMARKS.md


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
    pack_bytes: deprecated (default 0: every leaf is its own Zarr array). A value > 0
        packs plain leaves up to that size into hidden byte arrays, one per rank, as format
        1.1 writers did; generic Zarr readers do not see packed leaves (FutureWarning).
    chunk_target_bytes: chunks of DTensors and ShardedTensors group whole neighbouring
        shards into chunks of about this many bytes (the nearest count of chunks, 0.75-1.5x;
        default 256 MiB; None: one chunk per shard). Fewer, larger objects: at 1,024 ranks an array of small shards is
        one or two objects instead of 1,024. The other ranks send their shards of such a
        chunk to its writer first (over NCCL on GPUs, before any device-to-host copy);
        inner chunks stay within one shard, so loads on another layout still read only what
        they need. Shards of this size or more are one chunk each, as with None.
    storage: TensorStore settings (concurrency, fsync, object-store retries).
    entry_timeout: seconds every rank waits at the start of the save for the others to
        call it too, before it raises a DistributedError naming the ranks that did not
        (None: ``ZARRCKPT_ENTRY_TIMEOUT`` or 300 s; never more than the group's timeout).
    check_replicas: also compare the values of plain leaves (tensors, arrays, bytes that
        are not DTensors) across the ranks that hold them: one CRC-32C per leaf and rank,
        gathered once; different values are refused before anything is written, naming
        the keys and ranks (for debugging runs: it reads every plain leaf once, copying
        device ones to the host). Without it, a plain leaf is taken to be the same on every
        rank that holds it and one of them writes it; ranks whose plain leaves of one key
        differ in shape or dtype are always refused.
    incremental_from: a committed checkpoint (path) on the same local or parallel file
        system: every chunk whose array metadata, content hash and unit CRC-32Cs equal that
        checkpoint's is hard-linked from it instead of written (spec §7.9; the new
        checkpoint is complete and plain, deleting the other never breaks it). Implies
        ``content_hashes``. Where nothing can be linked (another file system, an object
        store, a root without content hashes) every chunk is written, with a warning.
    content_hashes: record the content hash of every chunk in the root (spec §6.6.2), so
        that a later save can be incremental from this one (costs one more pass over the
        data, in the writer threads; ``CheckpointManager(incremental=True)`` sets it).
    progress: a ``callable(phase, done_bytes, total_bytes)`` told this rank's progress
        (phase ``"write"``: chunk bytes handed to storage, then ``"commit"`` once; see
        ``api/_progress.py``), from the thread that writes (the caller's for ``save``, the
        background thread for ``async_save``); ``True``: a tqdm bar on rank 0; None
        (default): nothing, and no per-chunk work.

    compression, inner_chunk_bytes, replica_split_bytes, pack_bytes and chunk_target_bytes decide what
    lands on storage: every rank must pass the same values (ranks that disagree are
    refused before anything is written).
    """

    compression: str | dict | None = None
    inner_chunk_bytes: int = fmt.DEFAULT_INNER_CHUNK_BYTES
    replica_split_bytes: int | None = 64 << 20
    max_staging_bytes: int = 1 << 30
    pack_bytes: int = 0
    chunk_target_bytes: int | None = DEFAULT_CHUNK_TARGET_BYTES
    max_inflight_bytes: int = 256 << 20
    storage: StorageOptions = field(default_factory=StorageOptions)
    entry_timeout: float | None = None
    check_replicas: bool = False
    progress: Any = None
    incremental_from: Any = None
    content_hashes: bool = False

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> SaveOptions:
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown save option(s): {', '.join(sorted(unknown))}")
        opts = cls(**options)
        fmt.compression_codec(opts.compression)  # validates
        if opts.chunk_target_bytes is not None and (
                not isinstance(opts.chunk_target_bytes, int) or opts.chunk_target_bytes < 1):
            raise ValueError(f"chunk_target_bytes must be an int >= 1 or None, not {opts.chunk_target_bytes!r}")
        for name in ("inner_chunk_bytes", "max_staging_bytes", "max_inflight_bytes"):
            if not isinstance(getattr(opts, name), int) or getattr(opts, name) <= 0:
                raise ValueError(f"{name} must be a positive int, not {getattr(opts, name)!r}")
        if not isinstance(opts.pack_bytes, int) or opts.pack_bytes < 0:
            raise ValueError(f"pack_bytes must be an int >= 0, not {opts.pack_bytes!r}")
        if opts.pack_bytes > 0:
            warnings.warn(
                "pack_bytes > 0 is deprecated: packed leaves are hidden from generic Zarr readers "
                "(zarr-python, xarray, TensorStore see only byte arrays under .packs/). Small "
                "leaves are their own arrays by default; grouped chunks (chunk_target_bytes) keep "
                "the object count low", FutureWarning, stacklevel=4)
        if not (opts.progress is None or isinstance(opts.progress, bool) or callable(opts.progress)):
            raise ValueError(f"progress must be a callable(phase, done_bytes, total_bytes), True or None, "
                             f"not {opts.progress!r}")
        if not isinstance(opts.content_hashes, bool):
            raise ValueError(f"content_hashes must be True or False, not {opts.content_hashes!r}")
        if opts.incremental_from is not None and not isinstance(opts.incremental_from, (str, os.PathLike)):
            raise ValueError(f"incremental_from must be a checkpoint path, not {opts.incremental_from!r}")
        if not isinstance(opts.check_replicas, bool):
            raise ValueError(f"check_replicas must be True or False, not {opts.check_replicas!r}")
        if opts.entry_timeout is not None and not (
                isinstance(opts.entry_timeout, (int, float)) and opts.entry_timeout > 0):
            raise ValueError(f"entry_timeout must be a number of seconds > 0, not {opts.entry_timeout!r}")
        return opts

    @property
    def plan(self) -> PlanOptions:
        return PlanOptions(self.compression, self.inner_chunk_bytes, self.replica_split_bytes,
                           self.pack_bytes, self.chunk_target_bytes)


class SaveRun:
    """The execution state of one save on one rank. The plan itself is ``arrays``
    (frozen :class:`ArrayPlan` records); this object holds what executing it needs."""

    def __init__(self, state_dict: dict, path: Any, process_group: Any, overwrite: bool,
                 options: SaveOptions, metadata: dict | None = None, what: str = "save") -> None:
        if not isinstance(state_dict, dict):
            raise UnsupportedValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if metadata is not None:
            try:
                if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
                    raise TypeError("not a dict with str keys")
                json.dumps(metadata, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise UnsupportedValueError(f"metadata must be a JSON object (finite numbers, str "
                                            f"keys): {e}") from None
        self.metadata = metadata
        self.g = zdist.group(process_group)
        self.path = path
        self.url = str(path)
        self.overwrite = overwrite
        self.options = options
        self.state = state_dict
        self.location: Storage | None = None  # where the checkpoint is committed
        self.store: Storage | None = None  # where this save writes (its own directory)
        self.target: _commit.Target | None = None  # rank 0 only
        self.save_id = fmt.new_save_id()  # rank 0's value reaches every rank at C0
        self.created_us = int(time.time() * 1e6)
        self.created = ""
        self.tree: dict | None = {}
        self.resolved: Any = None  # the resolved state, while the tree is not encoded yet
        self.plan_token: Any = None  # plan_state's token: same plans as an earlier save
        self.leaf_sources: list | None = None  # plans reused with their staging: this save's array leaves
        self.feed: _Feed | None = None  # plans reused: staging copies issued during plan()'s walk
        self.restricted = False  # plain arrays already restricted to their holders (async)
        self.arrays: list[ArrayPlan] = []
        self.all_docs: dict[str, dict] = {}  # every array's zarr.json (rank 0: of all ranks)
        self.gathered: list | None = None  # rank 0, slow path: every rank's (tree, docs)
        self.sends: list[tuple[int, torch.Tensor]] = []
        self.recvs: list[tuple[int, torch.Tensor]] = []
        self.fills: list[tuple[np.ndarray, torch.Tensor]] = []
        self.assembled: dict[str, dict[tuple[int, ...], np.ndarray]] = {}  # chunks built by exchange
        self.staged: dict[str, np.ndarray] = {}  # async: host copies of local data
        # sync saves of device data (_stream_stage): the leaves copied through the arena in
        # write order, their positions, and the host copies of the current batch not yet written
        self.stream_order: list[ArrayPlan] = []
        self.stream_pos: dict[str, int] = {}
        self.stream_ahead: dict[str, np.ndarray] = {}
        self.staged_event: Any = None  # async, CUDA: recorded when the side-stream copies end
        self.replica_crcs: dict[str, int] | None = None  # check_replicas, async: taken at the call
        self.timings: dict[str, float] = {}
        self.bytes_written = 0
        self.bytes_linked = 0  # chunk file bytes linked from incremental_from instead of written
        self.bytes_staged = 0
        self.progress = _progress.resolve(options.progress, what, self.g.rank)  # tqdm imported here

    def _timed(self, name: str, t0: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0

    # ---- entry ------------------------------------------------------------------

    def enter(self, what: str) -> None:
        """Before anything else: every rank of the group has called ``what`` (a rank that
        did not is named within ``entry_timeout``, instead of a hang until the group's
        timeout); without a group, warn when the environment says there are several."""
        if not self.g.active:
            zdist.warn_if_world_without_group(what)
        self.g.enter(what, self.options.entry_timeout)

    # ---- plan and C0 ----------------------------------------------------------

    def plan(self, *, defer_tree: bool = False, arena: Arena | None = None) -> BaseException | None:
        """Local planning; returns the error (reported to every rank at C0).
        ``defer_tree`` (async saves): where the plans of the previous save are reused,
        the tree is encoded at C0, in the background (``plan_state``). ``arena`` (async
        saves, then staged into it): where the previous save's staging applies, its copies
        start during the walk of the state (:class:`_Feed`; :meth:`stage` issues the rest)."""
        t0 = time.perf_counter()
        feed = None
        try:
            self.location = open_storage(self.path, self.options.storage)
            self.url = self.location.url
            st = _STAGED
            if defer_tree and st is not None:  # async: plans and staging of the last save, reused?
                if arena is not None and st.token is not None and st.arena == arena.identity():
                    side = _copy_stream(st.cuda) if st.cuda is not None and arena.pinned else None
                    feed = _Feed(st, arena, side)
                self.resolved, reuse = resolve_reusing(self.state, self.g, self.options.plan, feed)
                if reuse is not None and reuse[0] is st.token:
                    self.plan_token, self.leaf_sources, self.feed = reuse[0], reuse[1], feed
                    self.tree, self.arrays = None, []  # the arrays come with the staging (stage())
                    return None
                if feed is not None:
                    feed.abandon()
                    feed = None
            else:
                self.resolved = resolve_stateful(self.state)
            self.tree, self.arrays, self.plan_token = plan_state(self.resolved, self.g, self.options.plan,
                                                                 defer_tree=defer_tree)
            if self.tree is not None:
                self.resolved = None
        except BaseException as e:  # noqa: BLE001 - C0 tells everyone
            self.tree, self.arrays, self.resolved, self.feed = {}, [], None, None
            _abandon(feed)  # copies it issued must not land in the arena after a later save's
            return e
        finally:
            self._timed("plan", t0)
        return None

    def _must_agree(self) -> bytes:
        where = None  # where the checkpoint goes (not how each rank authenticates)
        if self.location is not None:
            where = self.location.identity()
        # metadata is not here: like non-tensor values it is rank 0's (ranks' metrics differ)
        return json.dumps([where, self.overwrite, asdict(self.options.plan), self.options.check_replicas],
                          sort_keys=True, default=str).encode()

    def agree(self, error: BaseException | None) -> None:
        """C0: planning succeeded everywhere, ranks agree on path and options; merge trees
        if ranks hold different keys; take rank 0's save id and time."""
        t0 = time.perf_counter()
        if self.tree is None and error is None:  # deferred by plan(defer_tree=True)
            try:
                self.tree = ztree.encode_tree(self.resolved, is_array_leaf)
            except BaseException as e:  # noqa: BLE001 - C0 tells everyone
                error = e
            self.resolved = None
        payload = b"" if error or not self.g.active else _agreement_payload(self.tree, self.arrays)
        must = self._must_agree()
        ids = [int(self.save_id[:15], 16), int(self.save_id[15:30], 16), self.created_us]
        ok, (same, agreed), ids = self.g.check(error is None, [payload, must], ids)
        if not ok:
            self.g.agree(error, f"planning the save to {self.url!r}", SaveFailedError)
        if not agreed:
            views = self.g.all_gather(must.decode())
            raise SaveFailedError(
                "ranks disagree on the path or on options that decide what is stored (every rank "
                "must pass the same path, overwrite, compression, inner_chunk_bytes, "
                "replica_split_bytes, pack_bytes, chunk_target_bytes and check_replicas): "
                + "; ".join(f"rank {r}: {v}" for r, v in enumerate(views)) + "; nothing was written")
        self.save_id = f"{ids[0]:015x}{ids[1]:015x}"
        self.created = fmt.utc_from_us(ids[2])
        self.arrays = [with_save_id(p, self.save_id) for p in self.arrays]
        if self.options.check_replicas:  # before packing turns plain leaves into packs
            crcs, err = None, None
            try:
                crcs = self._plain_crcs()
            except BaseException as e:  # noqa: BLE001 - every rank learns it from the gather
                err = f"rank {self.g.rank}: {type(e).__name__}: {e}"
            views = self.g.all_gather((crcs, err))
            failed = [e for _, e in views if e is not None]
            if failed:
                raise SaveFailedError("check_replicas: reading the plain leaves failed: " + "; ".join(failed))
            _check_replica_values([c for c, _ in views])
        if same and self.options.pack_bytes > 0:
            self.arrays, nodes = assign_packs(self.arrays, self.g, self.options.plan, self.save_id)
            self.tree = fmt.with_packed_nodes(self.tree, nodes)
        if not same and not self.restricted:
            # Slow path (e.g. pipeline stages hold different keys): plain arrays are
            # written by the ranks that hold them; rank 0 merges the trees in prepare().
            held = _held_plain(self.g.all_gather(self._plain_specs()), self.g.size)
            self.arrays = [
                restrict_to_holders(p, held[p.key], self.g, self.options.plan)
                if p.kind in _PLAIN_KINDS else p
                for p in self.arrays]
        self.arrays = drop_mesh_replicas(self.arrays, self.g, same)
        self.all_docs = {p.key: p.metadata for p in self.arrays}
        if not same:
            self.gathered = self.g.gather_to_root((self.tree, self.all_docs))
        self.store = _commit.save_store(self.location, self.save_id)
        self._timed("plan", t0)

    # ---- prepare and C1 -------------------------------------------------------

    def prepare(self) -> None:
        """Every rank prepares its boundary exchange; rank 0 claims the location and
        creates the save's directory (engine.begin). C1."""
        t0 = time.perf_counter()
        error = None
        pending, groups = None, []
        try:
            if self.g.rank == 0:
                if self.gathered is not None:
                    self.tree = _merge_trees([t for t, _ in self.gathered])
                    for _, docs in reversed(self.gathered):
                        self.all_docs.update(docs)
                pending, groups = self._root("pending"), fmt.group_paths(self.all_docs)
            self._plan_exchange()
        except BaseException as e:  # noqa: BLE001 - reported to every rank at C1
            error = e
        self.target = engine.begin(self.g, self.location, self.save_id, self.overwrite, pending, groups,
                                   error=error)
        self._timed("prepare", t0)

    def _root(self, state: str, chunk_crcs: dict | None = None, content_hashes: dict | None = None) -> dict:
        return fmt.root_metadata(
            state=state, save_id=self.save_id, world_size=self.g.size, created=self.created,
            writer=fmt.writer_versions(), tree=self.tree if state == "committed" else None,
            array_docs=self.all_docs if state == "committed" else None,
            **({"metadata": self.metadata} if self.metadata is not None else {}),
            chunk_crcs=chunk_crcs,  # spec §6.6 (1.3): every rank's chunk CRCs, gathered at C2
            content_hashes=content_hashes,  # spec §6.6.2: incremental and hash-recording saves
        )

    def _plan_exchange(self) -> None:
        """Slice the pieces this rank sends and allocate what it receives (no collective)."""
        for p in self.arrays:
            if p.coord is None:
                continue
            for s in p.sends:
                local = p.layout.to_local(p.coord, s.box)
                self.sends.append((p.rank_of(s.dst), p.source[_slices(local)]))
            for w in p.writes:
                if len(w.sources) == 1 and w.sources[0][0] == p.coord:
                    continue  # the common case: a chunk inside this rank's own shard
                buf = np.empty([b - a for a, b in w.box], dtype=p.dtype.numpy)
                for src, box in w.sources:
                    view = buf[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, w.box))]
                    if src == p.coord:
                        self.fills.append((view, p.source[_slices(p.layout.to_local(p.coord, box))]))
                    else:
                        self.recvs.append((p.rank_of(src), view))
                self.assembled.setdefault(p.key, {})[w.index] = buf

    # ---- exchange, stage -------------------------------------------------------

    def exchange(self) -> None:
        """Assemble the chunks made of several ranks' shards (grouped small shards, nested
        uneven layouts): each rank sends every peer one flat byte buffer holding its pieces
        for that peer in plan order (the receiver lays out the same pieces at the same
        offsets), so the exchange is at most one send and one receive per peer pair and one
        device-to-host copy, whatever the number of arrays (a 2,000-array state made
        thousands of point-to-point operations and small synchronous copies)."""
        t0 = time.perf_counter()
        device = self.source_device()
        sends: dict[int, list[torch.Tensor]] = {}
        for peer, t in self.sends:
            sends.setdefault(peer, []).append(t)
        recvs: dict[int, list[np.ndarray]] = {}
        for peer, view in self.recvs:
            recvs.setdefault(peer, []).append(view)
        if self.sends or self.recvs:
            out = [(peer, _packed(ts, device)) for peer, ts in sends.items()]
            total = {peer: _packed_size(v.nbytes for v in views) for peer, views in recvs.items()}
            flat = torch.empty(sum(total.values()), dtype=torch.uint8, device=device)
            ins, at = [], 0
            for peer in recvs:
                ins.append((peer, flat[at:at + total[peer]]))
                at += total[peer]
            self.g.exchange(out, ins)
            places, at = [], 0
            for peer, views in recvs.items():
                places += [(view, at + o) for view, o in zip(views, _packed_offsets(v.nbytes for v in views))]
                at += total[peer]
            self._to_host(flat, places)
        if self.fills:  # this rank's own pieces of chunks it assembles
            pieces = [t for _, t in self.fills]
            offsets = _packed_offsets(t.numel() * t.element_size() for t in pieces)
            self._to_host(_packed(pieces, device), [(view, o) for (view, _), o in zip(self.fills, offsets)])
        self.sends, self.recvs, self.fills = [], [], []
        self._timed("exchange", t0)

    def _to_host(self, flat: torch.Tensor, places: list[tuple[np.ndarray, int]]) -> None:
        """Copy the pieces of the flat byte buffer ``flat`` at their offsets into their host
        ``views`` (ascending offsets). From a device: through the process's pinned streaming
        arena (the one sync saves and loads reuse), a window of whole pieces at a time; one
        pageable copy of the whole buffer ran at a fraction of the pinned copy's speed."""
        def put(host: np.ndarray, base: int, part: list) -> None:
            for view, o in part:
                view[...] = host[o - base:o - base + view.nbytes].view(view.dtype).reshape(view.shape)

        if flat.device.type != "cuda":
            put(flat.numpy(), 0, places)
            return
        with streaming_arena(min(self.options.max_staging_bytes, flat.numel())) as arena:
            buf = arena.raw()
            host, cap, i = buf.numpy(), buf.numel(), 0
            while i < len(places):
                start, j = places[i][1], i
                while j < len(places) and places[j][1] + places[j][0].nbytes - start <= cap:
                    j += 1
                if j == i:  # a piece bigger than the arena: a copy of its own
                    view, o = places[i]
                    put(flat[o:o + view.nbytes].cpu().numpy(), o, [places[i]])
                    i += 1
                    continue
                end = places[j - 1][1] + places[j - 1][0].nbytes
                buf[:end - start].copy_(flat[start:end])
                put(host, start, places[i:j])
                i = j

    def source_device(self) -> torch.device:
        """The device of this rank's tensors that take part in the exchange."""
        for _, t in self.sends:
            return t.device
        for _, t in self.fills:
            return t.device
        return self.g._device()

    def stage(self, arena: Arena, *, overlap: bool = False) -> BaseException | None:
        """Async saves, right after planning: copy every local shard this rank writes or
        sends into the reused arena, and make the copies the plans' sources, so that C0,
        the exchange and the writes run in the background on host data. Host data is
        copied before this returns. CUDA data is copied on a side stream, after the work
        already queued on the current stream, and this returns without waiting: the
        current stream is made to wait for the copies (``overlap=False``), so later work
        on it cannot change the state too early; with ``overlap=True`` nothing waits, and
        the caller must call ``wait_staged`` before it changes the state.
        ``self.staged_event`` marks the end of the copies.

        When the plans are those of the previous async save (same ``plan_token``) and the
        arena is the same buffer, so are the host views and the staged plans
        (:class:`_Staging`): the copies are issued in batches, and nothing is done per leaf
        but collecting its source; when ``plan(arena=...)`` reused them, most batches were
        issued during its walk of the state (:class:`_Feed`) and the rest are issued here."""
        global _STAGED
        t0 = time.perf_counter()
        feed, self.feed = self.feed, None
        try:
            st = _STAGED
            if self.leaf_sources is not None and st is not None and st.arena == arena.identity():
                leaves = self.leaf_sources  # plan() found this save's plans in st
                todo = st.todo
                if feed is None or feed.st is not st:
                    feed, srcs = None, [local_view(leaves[j]) for j in st.leaf_index]  # copied under no_grad
                self.arrays = arrays = list(st.all_plans)
            else:
                if feed is not None:
                    feed.abandon()
                    feed = None
                if self.leaf_sources is not None:  # the arena changed meanwhile: plan as usual
                    _, self.arrays, self.plan_token = plan_state(self.resolved, self.g, self.options.plan,
                                                                 defer_tree=True)
                    self.leaf_sources = None
                arrays = self.arrays
                todo = [i for i, p in enumerate(arrays) if p.source is not None and (p.writes or p.sends)]
                srcs = [arrays[i].source for i in todo]
            if not (self.plan_token is not None and st is not None and st.token is self.plan_token
                    and st.todo == todo and st.arena == arena.identity()):
                st = _STAGED = None
                nbytes = sum(staged_nbytes(t) for t in srcs if isinstance(t, torch.Tensor))
                arena.reserve(nbytes)
            else:
                nbytes = st.nbytes
            self.bytes_staged = nbytes
            cuda = st.cuda if st is not None else next(
                (t.device for t in srcs if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
            side = None
            if cuda is not None and arena.pinned:
                side = _copy_stream(cuda)
                side.wait_stream(torch.cuda.current_stream(cuda))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext(), torch.no_grad():
                if st is None:
                    st = _Staging.first(self, arena, todo, srcs, nbytes, cuda)
                    if self.plan_token is not None:
                        _STAGED = st
                elif feed is not None:  # most steps were issued while plan() walked the state
                    srcs = feed.finish(leaves)
                else:
                    st.copy(srcs, arena)
            if self.leaf_sources is None:  # else arrays are st.all_plans already
                for i, plan in zip(todo, st.plans):
                    arrays[i] = plan
            self.staged = dict(st.views)
            if side is not None:
                if overlap:  # the sources' memory must outlive the copies on the side stream
                    for t in srcs:
                        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                            t.record_stream(side)
                self.staged_event = torch.cuda.Event()
                self.staged_event.record(side)
                if not overlap:  # later work on the current stream (frees included) waits
                    torch.cuda.current_stream(cuda).wait_event(self.staged_event)
            elif cuda is not None:
                torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported to every rank by the caller
            _abandon(feed)
            _STAGED = None  # the arena's state is unknown: the next save stages afresh
            return e
        finally:
            self._timed("stage", t0)
        return None

    def plain_digest(self) -> bytes:
        """What decides who writes the plain arrays: their keys, shapes and dtypes (async
        saves compare it across ranks before returning; see :meth:`restrict_and_stage`)."""
        token = self.plan_token
        hit = _PLAIN_DIGESTS.get(id(token)) if token is not None else None
        if hit is not None and hit[0] is token:
            return hit[1]
        digest = json.dumps(self._plain_specs()).encode()
        if token is not None:
            if len(_PLAIN_DIGESTS) > 64:
                _PLAIN_DIGESTS.clear()
            _PLAIN_DIGESTS[id(token)] = (token, digest)
        return digest

    def restrict_and_stage(self) -> BaseException | None:
        """Async saves whose ranks hold different plain leaves (pipeline stages, per-rank
        values): each plain array is written by the ranks that hold it, which may give
        this rank chunks of arrays it did not stage; those are copied now, before
        ``async_save`` returns (the caller may change its state at once). Collective."""
        global _STAGED
        try:
            held = _held_plain(self.g.all_gather(self._plain_specs()), self.g.size)
        except BaseException as e:  # noqa: BLE001 - reported to every rank by the caller
            return e
        try:
            order = leaf_order(self.plan_token) if self.leaf_sources is not None else {}
            for i, p in enumerate(self.arrays):
                if p.kind not in _PLAIN_KINDS:
                    continue
                new = restrict_to_holders(p, held[p.key], self.g, self.options.plan)
                if (new.writes or new.sends) and p.key not in self.staged:
                    src = p.source if p.source is not None else local_data(self.leaf_sources[order[i]])
                    host = src.detach().to("cpu", copy=True) if isinstance(src, torch.Tensor) else np.array(src)
                    self.staged[p.key] = dtypes.to_numpy(host) if isinstance(host, torch.Tensor) else host
                    new = with_source(new, host)
                elif p.key in self.staged:
                    new = with_source(new, p.source)
                self.arrays[i] = new
            self.restricted = True
            _STAGED = None  # the staged plans of this save are not those of the next
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    def _plain_specs(self) -> list[tuple[str, list[int], str]]:
        """(key, shape, data type) of every plain array this rank holds (see _held_plain)."""
        return sorted((p.key, list(p.layout.shape), p.dtype.zarr) for p in self.arrays if p.kind in _PLAIN_KINDS)

    def _plain_crcs(self) -> dict[str, int]:
        """CRC-32C of the bytes of every plain array this rank holds (``check_replicas``).
        Async saves take them before async_save returns (:attr:`replica_crcs`): the values
        at the call."""
        if self.replica_crcs is not None:
            return self.replica_crcs
        if self.staged_event is not None:  # staged host copies of device leaves: complete them
            self.staged_event.synchronize()
        order = leaf_order(self.plan_token) if self.leaf_sources is not None else {}
        out = {}
        for i, p in enumerate(self.arrays):
            if p.kind not in _PLAIN_KINDS:
                continue
            src = p.source if p.source is not None or i not in order else local_data(self.leaf_sources[order[i]])
            if src is None:
                continue
            if isinstance(src, torch.Tensor):
                src = dtypes.to_numpy(src.detach().cpu().contiguous())
            out[p.key] = crc32c.crc32c(plain_body(np.asarray(src)))  # bf16/fp8 too: through uint8
        return out

    def _needs_data(self, p: ArrayPlan) -> bool:
        """Does this rank write a chunk of ``p`` straight from its own local data?"""
        built = self.assembled.get(p.key, {})
        return p.source is not None and any(w.index not in built for w in p.writes)

    # ---- write and C2 -----------------------------------------------------------

    def write(self, *, streaming: bool) -> BaseException | None:
        """Write every chunk this rank owns and make it durable (engine.write_arrays).
        ``streaming`` (sync saves): host data is written straight from the caller's
        tensors, device data through a bounded arena. Returns the error (reported to all
        ranks at C2); every write issued has completed (or failed) when this returns."""
        t0 = time.perf_counter()
        error = None
        try:
            with self._arena(streaming) as arena:
                documents = {p.key: p.metadata for p in self.arrays
                             if p.coord is not None and p.layout.metadata_writer() == p.coord}
                arrays = [self._array_write(p, arena) for p in self.arrays if p.writes]
                # the device leaves _stream_stage copies, in the order the engine asks for them
                self.stream_order = [p for p in self.arrays if p.writes and p.key not in self.staged
                                     and p.kind != "pack" and not p.on_host and self._needs_data(p)]
                self.stream_pos = {p.key: i for i, p in enumerate(self.stream_order)}
                self.stream_ahead = {}
                self.chunk_crcs = {}  # spec §6.6: this rank's chunk CRCs, for the root (finish)
                self.content = self._content()
                self.bytes_written += engine.write_arrays(
                    self.store, documents, arrays, self.options.max_inflight_bytes, self.chunk_crcs,
                    None if self.progress is None else functools.partial(self.progress, "write"),
                    content=self.content)
                if self.content is not None:  # this save's own tally (others may run in this process)
                    self.bytes_linked += sum(self.content.linked)
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            error = e
        finally:
            self.assembled.clear()
            self.staged.clear()
            self.stream_order, self.stream_pos, self.stream_ahead = [], {}, {}
        self._timed("write", t0)
        return error

    def _content(self) -> engine.Content | None:
        """Incremental saves (``incremental_from``) and saves that record content hashes
        (``content_hashes``): what the writes record and may link (storage/content.py, readers/previous.py)."""
        o = self.options
        if o.incremental_from is None and not o.content_hashes:
            return None
        previous = Previous.open(o.incremental_from, o.storage, self.store) if o.incremental_from is not None \
            else None
        return engine.Content(previous)

    def _arena(self, streaming: bool) -> Any:
        """Sync saves of device data: the process's streaming arena (reused by every save
        and load), as big as that data or ``max_staging_bytes``."""
        device = [p.source for p in self.arrays if p.writes and self._needs_data(p) and not p.on_host]
        if not (streaming and device):
            return contextlib.nullcontext()
        return streaming_arena(min(self.options.max_staging_bytes, sum(map(staged_nbytes, device))))

    def _array_write(self, p: ArrayPlan, arena: Arena | None) -> engine.ArrayWrite:
        """The engine's record of ``p``: chunks built by the exchange as they are, the
        others as regions of this rank's local data."""
        built = self.assembled.get(p.key, {})
        chunks = tuple(engine.ChunkWrite(w.index, w.box, data=built[w.index]) if w.index in built
                       else engine.ChunkWrite(w.index, w.box, local=p.layout.to_local(p.coord, w.box))
                       for w in p.writes)
        return engine.ArrayWrite(p.key, p.metadata, chunks, functools.partial(self._host, p, arena))

    def _host(self, p: ArrayPlan, arena: Arena | None, out: engine.ChunkWriter) -> np.ndarray:
        """This rank's data of ``p`` on the host: staged (async), the pack's bytes, a view
        of host memory, or device data copied through the arena."""
        host = self.staged.get(p.key)
        if host is not None:
            return host
        if p.kind == "pack":
            return pack_bytes(p)
        return p.host_view() if p.on_host else self._stream_stage(p, arena, out)

    def _stream_stage(self, p: ArrayPlan, arena: Arena, out: engine.ChunkWriter) -> np.ndarray:
        """Device data through a bounded arena, a batch at a time: the copies of this leaf
        and of the device leaves written after it, as many as fit, are issued together and
        waited for once (one device synchronisation per batch, not per leaf: 2,000 small
        leaves spent ~1.2 s of a 1.8 s save in per-leaf synchronisations on an H100 host).
        A leaf not in the current batch starts the next one, once the writes reading the
        arena are done (an order other than the plan's only costs a new batch)."""
        t0 = time.perf_counter()
        ahead = self.stream_ahead
        host = ahead.pop(p.key, None)
        if host is None:
            need = staged_nbytes(p.source)
            if need > arena.capacity:  # one tensor bigger than the bound: a buffer of its own
                host = dtypes.to_numpy(p.source.cpu())
            else:
                ahead.clear()
                out.wait()
                arena.reset()
                order, pos = self.stream_order, self.stream_pos.get(p.key, -1)
                batch = [p] + ([q for q in order[pos + 1:]] if pos >= 0 else [])
                for q in batch:
                    n = staged_nbytes(q.source)
                    if q is not p and (n > arena.capacity or not arena.fits(n)):
                        break
                    ahead[q.key] = arena.stage(q.source)[1]
                sync_devices([p.source])
                host = ahead.pop(p.key)
        self._timed("stage", t0)
        return host

    # ---- C2, commit, C3 ---------------------------------------------------------

    def finish(self, error: BaseException | None, g: zdist.Group) -> None:
        """C2 (all data durable), the commit, C3; over group ``g`` (engine.finish)."""
        t0 = time.perf_counter()
        content = getattr(self, "content", None)
        engine.finish(g, self.url, self.target, error, functools.partial(self._root, "committed"),
                      crcs=getattr(self, "chunk_crcs", None), hashes=None if content is None else content.hashes)
        self._timed("commit", t0)
        if self.progress is not None:
            self.progress("commit", self.bytes_written, self.bytes_written)

    def abandon(self) -> None:
        """After a failure that every rank has seen: rank 0 removes this save's directory."""
        _progress.close(self.progress)
        engine.abandon(self.g, self.target)

    def report(self) -> dict[str, Any]:
        return {
            "path": self.url,
            "rank": self.g.rank,
            "save_id": self.save_id,
            "arrays": len(self.arrays),
            "bytes_written": self.bytes_written - self.bytes_linked,
            "bytes_linked": self.bytes_linked,
            "bytes_staged": self.bytes_staged,
            "seconds": {**self.timings, "total": sum(self.timings.values())},
        }


class _Step:
    """One batch of a later save's staging copies, in arena order (see :class:`_Staging`):
    ``groups``, per dtype, the small CUDA leaves gathered in the device buffer (positions,
    and their views in it), moved to the arena span ``[start, end)`` by one device->host
    copy; then ``direct``, copied by one ``_foreach_copy_`` straight into the arena.
    ``need``: how many array leaves a walk of the state has found when every source of
    this step is known."""

    __slots__ = ("need", "start", "end", "groups", "direct", "buf", "spans")

    def __init__(self) -> None:
        self.need = 0
        self.start = self.end = -1
        self.spans: tuple[torch.Tensor, torch.Tensor] | None = None  # (arena span, device buffer span)
        self.buf = 0  # which of the two device buffers its leaves are gathered in
        self.groups: list[tuple[list[int], list[torch.Tensor]]] = []
        self.direct: list[int] = []


class _Staging:
    """How the last async save staged its plans, kept for the next one with the same plans
    (async saves stage one at a time: async_save's foreground lock).

    The first save copies leaf by leaf into the arena, in the order a walk of the state
    finds its array leaves (the leaves later saves gather first, then the others: see
    :meth:`first`), and records the host views and the plans whose sources they are. A later save copies into the same views, in steps of up to ``_BATCH`` bytes of the
    arena (:class:`_Step`; the first one smaller, so that the device starts early): CUDA
    leaves of up to ``_SMALL`` bytes are first gathered on the device, one fused
    ``torch._foreach_copy_`` per dtype into a device buffer laid out as their part of the
    arena, then moved by one device->host copy (thousands of small copies would each pay a
    launch and a DMA setup). Steps use two device buffers in turn, and their device->host
    copies run on a second stream, so one step's gathering overlaps the previous step's
    copy. Larger CUDA leaves and CPU leaves are copied by ``_foreach_copy_`` straight into
    the arena (CPU: by the copy threads). A later save
    whose plans are reused issues each step while it walks its state, as soon as the walk
    has found the step's leaves (:class:`_Feed`), so the copies run while the rest of the
    state is walked."""

    _SMALL = 4 << 20  # leaves up to this size are gathered on the device first
    _BATCH = 32 << 20  # device buffer of one step (the arena span of its leaves); two of them
    _FIRST = 8 << 20  # the first step's span (CUDA)

    def __init__(self) -> None:
        self.token: Any = None
        self.todo: list[int] = []
        self.arena: tuple[int, int] = (0, 0)
        self.nbytes = 0
        self.used = 0
        self.cuda: torch.device | None = None
        self.threads = False  # CPU: steps copied by the copy threads
        self.hosts: list[Any] = []
        self.plans: list[ArrayPlan] = []
        self.views: list[tuple[str, np.ndarray]] = []
        self.values: list[int] = []  # positions of NumPy sources (copied with [...] =)
        self.steps: list[_Step] = []
        self.device_bufs: list[torch.Tensor] = []
        self.streams: tuple[Any, Any] = (None, None)  # (the side stream: gathers; its partner: device->host)
        self.events: list[tuple[Any, Any]] = []  # per device buffer: (gathered, copied), reused
        self.pending: list[Any] = [None, None]  # per device buffer: the end of its last device->host copy
        self.landing: list[tuple[torch.Tensor, torch.Tensor]] = []  # host emulation: span copies not landed yet
        self.leaf_index: list[int] = []  # per staged plan: its array leaf's index (walk order)
        self.all_plans: tuple[ArrayPlan, ...] = ()

    @classmethod
    def first(cls, run: SaveRun, arena: Arena, todo: list[int], srcs: list, nbytes: int,
              cuda: torch.device | None) -> _Staging:
        st = cls()
        st.token, st.todo, st.nbytes, st.cuda = run.plan_token, todo, nbytes, cuda
        n = len(todo)
        if run.plan_token is not None:
            order = leaf_order(run.plan_token)
            st.leaf_index = [order[i] for i in todo]
            walk = sorted(range(n), key=st.leaf_index.__getitem__)  # the order a walk finds them
        else:
            walk = list(range(n))
        st.hosts, st.views, st.plans = [None] * n, [None] * n, [None] * n
        base = arena.base_ptr()
        # The arena: first the leaves that later saves gather on the device, then the others,
        # each part in walk order. A step's device->host copy of its gathered leaves covers
        # the arena span from its first to its last gathered leaf; were the other leaves
        # interleaved (walk order: exp_avg, exp_avg_sq on the GPU, AdamW's 0-d ``step`` on
        # the CPU ...), that copy would overwrite them with whatever the device buffer held
        # there, after their own copy: later async saves on GPUs stored stale values.
        gathers = {k for k in walk if isinstance(srcs[k], torch.Tensor) and cls.gathers(srcs[k], arena)}
        for k in [k for k in walk if k in gathers] + [k for k in walk if k not in gathers]:
            src, p = srcs[k], run.arrays[todo[k]]
            if isinstance(src, torch.Tensor):
                host, view = arena.stage(src)
            else:
                host = view = np.array(src, copy=True)
                st.values.append(k)
            st.hosts[k], st.views[k], st.plans[k] = host, (p.key, view), with_source(p, host)
        items = [(st.hosts[k].data_ptr() - base, srcs[k].numel() * srcs[k].element_size(), k, k in gathers)
                 for k in walk if isinstance(srcs[k], torch.Tensor)]
        st.arena, st.used = arena.identity(), arena.used()
        if run.plan_token is not None:
            staged = dict(zip(todo, st.plans))
            # every plan of the save: staged ones with their host copies, the others without
            # a source (this rank writes and sends nothing of them)
            st.all_plans = tuple(staged.get(i) or with_source(p, None) for i, p in enumerate(run.arrays))
        st._steps(items)
        return st

    @classmethod
    def gathers(cls, src: torch.Tensor, arena: Arena) -> bool:
        """Is ``src`` gathered on the device by later saves (a small contiguous CUDA leaf,
        staged into page-locked memory)? Decided once, by the first save's staging."""
        return (src.device.type == "cuda" and arena.pinned and src.is_contiguous()
                and 0 < src.numel() * src.element_size() <= cls._SMALL)

    def _steps(self, items: list[tuple[int, int, int, bool]]) -> None:
        """Cut the staged leaves (walk order; ``(arena offset, nbytes, position, gathered)``)
        into steps of at most ``_BATCH`` bytes (on the CPU: about an eighth of the bytes per
        copy thread, so that they all work). The gathered leaves of a step are neighbours in
        the arena (``first`` puts them before every other leaf), so the span its one
        device->host copy writes holds none of the step's other leaves, nor any other step's."""
        total = sum(n for _, n, _, _ in items)
        limit = self._BATCH
        device = self.cuda is not None or any(g for _, _, _, g in items)  # or its host emulation
        if not device:
            self.threads = _COPY_THREADS >= 2 and len(items) >= 64 and total >= (16 << 20)
            limit = min(limit, max(total // (2 * _COPY_THREADS), 1 << 20)) if self.threads else total + 1
        step, taken, small, gathering = _Step(), 0, [], 0
        for off, n, k, gathered in items + [(0, 0, None, False)]:
            if (step.direct or small) and (k is None or taken + n > (
                    limit if self.steps or not device else min(limit, self._FIRST))):
                if small:
                    step.start, step.end = small[0][0], small[-1][0] + small[-1][1]
                    groups: dict[torch.dtype, list[int]] = {}
                    for _, _, j in small:
                        groups.setdefault(self.hosts[j].dtype, []).append(j)
                    step.groups = [(ks, []) for ks in groups.values()]
                    step.buf, gathering = gathering % 2, gathering + 1
                self.steps.append(step)
                step, small, taken = _Step(), [], 0
            if k is None:
                break
            taken += n
            if gathered:
                small.append((off, n, k))
            else:
                step.direct.append(k)
            step.need = max(step.need, self.leaf_index[k] + 1 if self.leaf_index else 0)

    def _device_views(self, arena: Arena) -> None:
        """The two device buffers and each gathered leaf's view in its step's buffer (made
        once per staging); every save starts with no copy pending on them."""
        self.pending = [None, None]
        self.landing = []
        span = max((s.end - s.start for s in self.steps if s.groups), default=0)
        if not span or self.device_bufs:
            return
        streams = ()
        if self.cuda is not None:
            self.streams = streams = (_copy_stream(self.cuda), _copy_stream(self.cuda, 1))
        for _ in range(2 if sum(1 for s in self.steps if s.groups) > 1 else 1):
            buf = torch.empty(span, dtype=torch.uint8, device=self.cuda or "cpu")
            for stream in streams:  # used on both: freed only after their work on it
                buf.record_stream(stream)
            self.device_bufs.append(buf)
        if self.cuda is not None:
            self.events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in self.device_bufs]
        base = arena.base_ptr()
        raw = arena.raw()
        for s in self.steps:
            if s.groups:
                s.spans = (raw[s.start:s.end], self.device_bufs[s.buf][:s.end - s.start])
            for ks, views in s.groups:
                views.clear()
                buf = self.device_bufs[s.buf]
                for k in ks:
                    h = self.hosts[k]
                    off = h.data_ptr() - base - s.start
                    views.append(buf[off:off + h.numel() * h.element_size()].view(h.dtype).view(h.shape))

    def issue(self, step: _Step, srcs: list, arena: Arena, copies: list) -> None:
        """Issue one step's copies (on the current stream, the side stream, and its partner
        for device->host copies of gathered leaves; CPU: on a copy thread, its future
        appended to ``copies``)."""
        hosts = self.hosts
        if step.groups and self.cuda is None:
            # host emulation of gathering (tests: CI has no GPU; only a patched ``gathers``
            # gathers CPU leaves): the span's copy lands at finish(), as late as a
            # device->host copy on the partner stream may land
            for ks, views in step.groups:
                torch._foreach_copy_(views, [srcs[k] for k in ks])
            host, device = step.spans
            self.landing.append((host, device.clone()))
        elif step.groups:
            gather, d2h = self.streams
            gathered, copied = self.events[step.buf]
            if self.pending[step.buf] is not None:  # the buffer's previous copy has read it
                gather.wait_event(self.pending[step.buf])
            for ks, views in step.groups:
                torch._foreach_copy_(views, [srcs[k] for k in ks])
            gathered.record(gather)
            d2h.wait_event(gathered)
            host, device = step.spans
            torch.cuda.set_stream(d2h)
            try:
                host.copy_(device, non_blocking=True)
                copied.record(d2h)
            finally:
                torch.cuda.set_stream(gather)
            self.pending[step.buf] = copied
        if step.direct:
            dst, src = [hosts[k] for k in step.direct], [srcs[k] for k in step.direct]
            if self.threads:
                copies.append(_copy_pool().submit(torch._foreach_copy_, dst, src))
            else:
                torch._foreach_copy_(dst, src, non_blocking=self.cuda is not None and arena.pinned)

    def copy(self, srcs: list, arena: Arena) -> None:
        """Every step at once (the sources known already)."""
        self._device_views(arena)
        copies: list = []
        for step in self.steps:
            self.issue(step, srcs, arena, copies)
        self.finish(srcs, arena, copies)

    def finish(self, srcs: list, arena: Arena, copies: list) -> None:
        """After the last step: wait for the copy threads (CPU); make the current stream
        wait for the device->host copies of the partner stream (CUDA); NumPy sources."""
        for f in copies:
            f.result()
        for host, data in self.landing:
            host.copy_(data)
        self.landing = []
        for ev in self.pending:
            if ev is not None:
                torch.cuda.current_stream(self.cuda).wait_event(ev)
        self.pending = [None, None]
        for k in self.values:
            self.hosts[k][...] = srcs[k]
        arena.skip(self.used)


class _Feed:
    """A later async save's staging, fed by the walk of its state (``resolve_reusing``):
    called whenever the walk has found ``at`` array leaves, it issues every step whose
    leaves are all found (on the side stream, after the work queued on the current
    stream). ``token``: the plans the walk must match for these steps to apply."""

    def __init__(self, st: _Staging, arena: Arena, side: Any) -> None:
        self.st, self.arena, self.side = st, arena, side
        self.token = st.token
        self.srcs: list = [None] * len(st.todo)
        self.copies: list = []
        self.next = 0
        self.at = st.steps[0].need if st.steps else 1 << 62
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(st.cuda))
        st._device_views(arena)

    def __call__(self, leaves: list) -> None:
        st, srcs, li = self.st, self.srcs, self.st.leaf_index
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext(), torch.no_grad():
            while self.next < len(st.steps) and st.steps[self.next].need <= len(leaves):
                step = st.steps[self.next]
                for k in [k for ks, _ in step.groups for k in ks] + step.direct:
                    srcs[k] = local_view(leaves[li[k]])
                st.issue(step, srcs, self.arena, self.copies)
                self.next += 1
        self.at = st.steps[self.next].need if self.next < len(st.steps) else 1 << 62

    def finish(self, leaves: list) -> list:
        """The rest of the steps and the NumPy sources; returns every source (by position)."""
        self(leaves)
        for k in self.st.values:
            self.srcs[k] = local_view(leaves[self.st.leaf_index[k]])
        self.st.finish(self.srcs, self.arena, self.copies)
        return self.srcs

    def abandon(self) -> None:
        """The walk found a different state: wait for the copies issued (the arena is
        staged afresh)."""
        for f in self.copies:
            f.result()
        if self.side is not None and self.next:
            self.side.synchronize()


def _abandon(feed: _Feed | None) -> None:
    """Wait for the copies a feed issued, on an error path (nothing raised from here)."""
    if feed is not None:
        try:
            feed.abandon()
        except BaseException:  # noqa: BLE001 - the error being reported is the first one
            log.debug("zarrckpt: waiting for the staging copies after an error failed", exc_info=True)


# ---- What is kept from one save or load for the next, what it assumes, what drops it ----
#
# _STAGED (the last async save's _Staging): its host views into the arena, the plans whose
#   sources they are, its steps (which leaves are gathered on the device, which copied
#   straight) and two device buffers. Assumes: the same plans (token: plan.py's _STATES
#   entry, whose signature covers key paths, types, shapes, dtypes, devices, meshes and
#   placements), the same list of staged plans (``todo``), the same arena buffer
#   (``Arena.identity``). Dropped: another token or todo (stage() stages afresh), the arena
#   reallocated (reserve_staging() growing it, release_staging()), an error while staging,
#   ranks holding different plain leaves (restrict_and_stage), forget_staging(). The copies
#   of a later save always read the leaves its own walk found (replaced tensor objects
#   included); the arena's layout keeps each gathered span free of other leaves (first()).
#   Tests: test_staging_reuse.py (all of these, with gathering emulated on the host),
#   tests/gpu/ (the same on GPUs).
# _PLAIN_DIGESTS: the keys, shapes and dtypes of a token's plain arrays, by the token
#   itself (id() checked against the object kept); cleared past 64.
# The arenas (distributed/staging.py): the async one is reused while large enough and its
#   identity names the buffer; the streaming one is lent to one load or sync save at a
#   time (a concurrent one gets a temporary arena), reset before each use, and a load
#   reuses a half only after that half's device copies have completed (api/load.py
#   _Reads._switch). Device buffers of a load (_Reads.scratch) live for that load only.
# Read buffers (storage/_localfile.py _RUN_BUFFERS): handed to one read at a time, given
#   back after it; content never outlives the read that filled it.
# Copy streams (_copy_streams): per device, stateless between saves; every save makes its
#   side stream wait for the work queued on the current stream before its first copy.
_STAGED: _Staging | None = None
_PLAIN_DIGESTS: dict[int, tuple[Any, bytes]] = {}
_PLAIN_KINDS = ("tensor", "ndarray", "bytes", "bytesio")
_COPY_POOL: cf.ThreadPoolExecutor | None = None


def _copy_pool() -> cf.ThreadPoolExecutor:
    """Threads for host-to-host staging copies: a memcpy per leaf is bound by one core,
    and thousands of small leaves are copied faster by several (torch releases the GIL)."""
    global _COPY_POOL
    if _COPY_POOL is None:
        _COPY_POOL = cf.ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="zarrckpt-stage")
    return _COPY_POOL


_COPY_THREADS = max(1, min(8, torch.get_num_threads()))


def forget_staging() -> None:
    """Drop the last async save's staging record (its host views and device buffer)."""
    global _STAGED
    _STAGED = None


_PACK_ALIGN = 64  # offsets of pieces in an exchange buffer: every dtype's view is aligned


def _packed_offsets(sizes) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += -(-n // _PACK_ALIGN) * _PACK_ALIGN
    return out


def _packed_size(sizes) -> int:
    return sum(-(-n // _PACK_ALIGN) * _PACK_ALIGN for n in sizes)


def _packed(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bytes of ``tensors`` (any strides) one after another at :func:`_packed_offsets`,
    in one flat uint8 buffer on ``device``."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    flat = torch.empty(_packed_size(sizes), dtype=torch.uint8, device=device)
    with torch.no_grad():
        for t, o, n in zip(tensors, _packed_offsets(sizes), sizes):
            if n:
                flat[o:o + n].view(t.dtype).view(t.shape).copy_(t)
    return flat


# Side streams per device for async staging copies, made once; async saves run their
# foreground part one at a time, but load/save threads of their own may stage too.
_copy_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
_copy_streams_lock = threading.Lock()


def _copy_stream(device: torch.device, which: int = 0) -> torch.cuda.Stream:
    """Side stream ``which`` of ``device`` for async staging copies (0: the one a save's
    staging runs on; 1: its partner for the device->host copies of gathered leaves)."""
    with _copy_streams_lock:
        stream = _copy_streams.get((device, which))
        if stream is None:
            stream = _copy_streams[(device, which)] = torch.cuda.Stream(device)
    return stream


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


_DOC_BYTES: dict[int, tuple[Any, bytes]] = {}


def _agreement_payload(tree: Any, arrays: Sequence[ArrayPlan]) -> bytes:
    """What C0 compares across ranks: the tree and every array document, as sorted-key
    JSON. A plan's document is the same object from save to save while the state keeps its
    layout (the plan cache), so its encoding is kept with it: thousands of documents were
    encoded again by every save (~15 ms per 1,000 on a 2-core VM)."""
    parts = [json.dumps(tree, sort_keys=True).encode()]
    for p in sorted(arrays, key=lambda p: p.key):
        hit = _DOC_BYTES.get(id(p.metadata))
        if hit is None or hit[0] is not p.metadata:
            if len(_DOC_BYTES) > 1 << 16:
                _DOC_BYTES.clear()
            hit = _DOC_BYTES[id(p.metadata)] = (p.metadata, json.dumps(p.metadata, sort_keys=True).encode())
        parts += [json.dumps(p.key).encode(), hit[1]]
    return b"\0".join(parts)


def _held_plain(specs: list[list], size: int) -> dict[str, list[int]]:
    """The ranks holding each plain array, from every rank's (key, shape, data type) list.
    A plain leaf (not a DTensor) is stored once, from one of the ranks that hold it: ranks
    whose leaves of one key differ in shape or data type are refused (before anything is
    written) rather than having one of them stored silently."""
    held: dict[str, list[int]] = {}
    seen: dict[str, dict[tuple, list[int]]] = {}
    for r, rank_specs in enumerate(specs):
        for key, shape, dt in rank_specs:
            held.setdefault(key, []).append(r)
            seen.setdefault(key, {}).setdefault((tuple(shape), dt), []).append(r)
    bad = {k: v for k, v in seen.items() if len(v) > 1}
    if bad:
        lines = [f"{k!r}: " + ", ".join(f"{list(shape)} {dt} on rank(s) {_ranks(rs)}" for (shape, dt), rs in v.items())
                 for k, v in sorted(bad.items())[:8]]
        raise UnsupportedValueError(
            f"ranks hold different plain tensors under the same key ({len(bad)} key(s)): " + "; ".join(lines)
            + ". A plain tensor is saved once, as the same value on every rank that holds it; a tensor "
            "sharded across ranks must be a DTensor (e.g. DTensor.from_local(t, mesh, [Shard(0)]) instead "
            "of dtensor.to_local()), and per-rank values need per-rank keys; nothing was written")
    return held


def _check_replica_values(crcs: list[dict[str, int]]) -> None:
    """``check_replicas``: every rank that holds a plain leaf holds the same bytes."""
    by_key: dict[str, dict[int, list[int]]] = {}
    for r, mine in enumerate(crcs):
        for k, c in mine.items():
            by_key.setdefault(k, {}).setdefault(c, []).append(r)
    bad = sorted(k for k, v in by_key.items() if len(v) > 1)
    if bad:
        parts = [f"{k!r} (" + " / ".join(f"rank(s) {_ranks(rs)}" for rs in by_key[k].values()) + ")"
                 for k in bad[:8]]
        raise UnsupportedValueError(
            f"check_replicas: {len(bad)} plain leaf/leaves differ between the ranks that hold them: "
            + ", ".join(parts) + ". A plain tensor is saved once from one rank: make per-rank values "
            "per-rank keys, or sharded tensors DTensors; nothing was written")


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs[:6])) + (f" and {len(rs) - 6} more" if len(rs) > 6 else "")


def plan_and_prepare(run: SaveRun) -> None:
    """The foreground part common to save and async_save: plan, C0, prepare, C1, exchange.
    After a failure past C1 the save's directory is removed again."""
    run.agree(run.plan())
    run.prepare()
    try:
        run.exchange()
    except BaseException:
        run.abandon()
        raise


def save(state_dict: dict, path: Any, *, process_group: Any = None, overwrite: bool = False,
         metadata: dict | None = None, **options: Any) -> dict[str, Any]:
    """:func:`zarrckpt.save` (see there): every rank saves its shards; returns its report."""
    with paused():  # see _gc.paused: one full collection cost 0.15 s of a 0.4 s save (2,000 leaves)
        return run_save(SaveRun(state_dict, path, process_group, overwrite, SaveOptions.from_kwargs(options),
                                metadata))


def run_save(run: SaveRun) -> dict[str, Any]:
    run.enter("save")
    plan_and_prepare(run)
    try:
        run.finish(run.write(streaming=True), run.g)
    except BaseException:
        run.abandon()
        raise
    report = run.report()
    log.info("zarrckpt save %s: %s", report["path"], report)
    return report
