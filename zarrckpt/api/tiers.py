"""Checkpoint tiers (spec §7.8): a node-local tier with peer replicas, and promotion of
every ``persist_every``-th step to the persistent root.

Used by :class:`~zarrckpt.api.manager.CheckpointManager` when it is given ``local_dir``.

Nodes. Ranks are grouped into nodes by host name (``ZARRCKPT_NODE`` overrides it). The
node's **leader** is its lowest rank. Node ``i`` (nodes ordered by their leader's rank)
sends its files to the next ``min(local_replicas, K - 1)`` nodes of the ring.

Layout of a node's local tier, ``<local_dir>/<node>/``:

* ``step_<N>/``: the node's copy of step N, written in the normal format by the node's
  own ranks (every rank writes the chunks and array documents it would write in a plain
  save) plus the files of the nodes it replicates, received over the process group. A
  copy that holds the files of every node also has the committed root ``zarr.json``: it is
  a plain checkpoint any reader reads. Other copies have no root (no reader takes them for
  a checkpoint; §7.7 skips them).
* ``step_<N>.tier.json``: the copy's **manifest**, written atomically after the copy is
  durable: the local commit point. It records the save's id, the run (the persistent
  root, :attr:`Tiers.run`), the committed root, the nodes of the save and each node's files
  with their sizes and digests (:func:`key_digest`, computed by the writing rank after C2),
  and which of them this copy holds. A copy without a manifest, or of another run, is never
  used; local retention deletes other runs' copies.

Save: plan and stage on the caller's thread as ``async_save`` does (one device->host copy);
then, in the manager's worker thread over a side gloo group: C0, leaders create each
node's hidden directory ``.zarrckpt-<id>.<hex>`` (under a §7.5 lock, so dead ones are
cleaned), C1, every rank writes into its node's directory, C2; every rank lists the
files it wrote (one all-gather), and all ranks of every node send their share of its files
to their counterparts on the replica nodes at once, which write them (``transfer``: streams
of messages read with ``preadv`` into reused buffers and written with ``pwrite``, reads,
sends, receives and writes overlapping; spec C.9); an agreement; then leaders sync, move
the directory to ``step_<N>`` and write the manifest; C3. Then local retention (leaders,
``local_keep_last``) and, on a ``persist_every`` step, promotion.

Promotion (same worker thread, side group): rank 0 claims ``<persistent>/step_<N>`` and
creates the save's directory there exactly as a save does (``engine.begin``); every
leader copies its node's own files from its local tier (no device memory, no staging);
C2; rank 0 publishes the committed root (``engine.finish``). A crash before the publish
leaves the persistent root as it was (plus a §7.5 leftover on file systems).

Restore: leaders list their manifests of this run and check every listed file's size;
one all-gather; rank 0 chooses the source and broadcasts it: the newest step whose copies
with one save id together hold every node's files, unless the persistent root (listed
whenever no step is asked for) holds a newer committed step. The ranks of a node missing
files get them, each a share, from the ranks of a node holding them (``transfer`` over a
side gloo group) into their node's copy, after the leader un-claimed them in its manifest,
and verify them against the digests; once it holds everything intact, the leader writes
its committed root and manifest: then every rank loads its own node's copy with
:func:`zarrckpt.load` (any world size, any layout). A fetched key that fails its digest, or
a load that fails on damage (every node then verifies its copy), un-claims the damaged
holdings and the next source is tried: a peer's copy, the persistent root, an older step
(``last_restore["skipped"]``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from ..distributed import group as zdist
from ..engine import commit as _commit
from ..engine import save as engine
from ..errors import (CheckpointNotFoundError, CorruptChunkError, DistributedError, FormatError,
                      IncompleteCheckpointError, LoadFailedError, SaveFailedError, StorageError)
from ..format import documents as fmt
from ..storage import open_storage
from ._gc import paused
from .save import SaveOptions, SaveRun

log = logging.getLogger("zarrckpt")

__all__ = ["Tiers", "node_name"]

MANIFEST_SUFFIX = ".tier.json"
MANIFEST_FORMAT = "zarrckpt-tier"
DIGEST_ALGORITHM = "crc32c"  # of the key's UTF-8 bytes, then the file's bytes (spec §7.8)
DIGEST_BLOCK = 8 << 20  # bytes read at once to compute a digest
# errors of a load that damaged bytes of a copy may cause (then the copies are verified)
_MAY_BE_DAMAGE = (CorruptChunkError, FormatError, StorageError, CheckpointNotFoundError, IncompleteCheckpointError)
MAX_ATTEMPTS = 64  # sources a restore tries at most (each failed one is excluded; a safety net)
DEFAULT_BATCH_BYTES = 64 << 20

# tests: called with (relative path) before each file a promotion copies
_promotion_hook: Any = None


def node_name() -> str:
    """This process's node: ``ZARRCKPT_NODE`` if set (tests simulate nodes), else the host."""
    return os.environ.get("ZARRCKPT_NODE") or socket.gethostname()


@dataclass(frozen=True)
class Nodes:
    """The nodes of a group: ``names`` in order of their leader's rank, ``ranks[i]``
    the group ranks of node i, this rank's node index."""

    names: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]
    me: int

    @property
    def leader(self) -> int:
        return self.ranks[self.me][0]

    def leader_of(self, i: int) -> int:
        return self.ranks[i][0]

    def replica_targets(self, i: int, replicas: int) -> list[int]:
        k = len(self.names)
        return [(i + j) % k for j in range(1, min(replicas, k - 1) + 1)]


def find_nodes(g: zdist.Group) -> Nodes:
    names = g.all_gather(node_name())
    order: list[str] = []
    for n in names:
        if n not in order:
            order.append(n)
    ranks = tuple(tuple(r for r, n in enumerate(names) if n == name) for name in order)
    return Nodes(tuple(order), ranks, order.index(names[g.rank]))


# ---- files ----------------------------------------------------------------------------


def list_files(directory: str) -> list[tuple[str, int]]:
    """(relative path with '/', size) of every regular file under ``directory``, sorted."""
    out = []
    for d, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(d, f)
            out.append((os.path.relpath(p, directory).replace(os.sep, "/"), os.path.getsize(p)))
    return sorted(out)


def key_digest(rel: str, data: bytes | memoryview | None = None, directory: str | None = None) -> int:
    """The digest a manifest records for key ``rel`` (spec §7.8): CRC-32C (the checksum of
    §5.5) of the key's UTF-8 bytes followed by the file's bytes, from ``data`` or read from
    ``directory`` in blocks of ``DIGEST_BLOCK``. Starting from the key ties the bytes to
    their place, and keeps the digest of a chunk file (which ends with its own CRC-32C,
    whose CRC-32C alone is the same constant for every such file) distinct."""
    crc = crc32c.crc32c(rel.encode("utf-8"))
    if data is not None:
        return crc32c.crc32c(data, crc)
    buf = bytearray(DIGEST_BLOCK)
    view = memoryview(buf)
    with open(os.path.join(directory, rel), "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return crc
            crc = crc32c.crc32c(view[:n], crc)


def bad_keys(directory: str, entries: list[tuple[str, int]], digests: dict[str, int]) -> list[str]:
    """The keys of ``entries`` ((key, size) pairs) that are missing under ``directory``, of
    another size, or whose digest differs from ``digests`` (a key without a recorded digest
    is bad: nothing says its bytes are right)."""
    bad = []
    for rel, size in entries:
        try:
            ok = (os.path.getsize(os.path.join(directory, rel)) == size and rel in digests
                  and key_digest(rel, directory=directory) == digests[rel])
        except OSError:
            ok = False
        if not ok:
            bad.append(rel)
    return bad


def _read(directory: str, rel: str) -> bytes:
    with open(os.path.join(directory, rel), "rb") as f:
        return f.read()


def _write(directory: str, rel: str, data: bytes) -> None:
    p = os.path.join(directory, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = p + ".tmp-zarrckpt"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, p)


def _sync(directory: str) -> None:
    open_storage(directory).flush()


def _write_manifest(root: str, name: str, manifest: dict) -> None:
    path = os.path.join(root, name + MANIFEST_SUFFIX)
    tmp = path + ".tmp-zarrckpt"
    with open(tmp, "w") as f:
        json.dump(manifest, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(root: str, name: str) -> dict | None:
    try:
        with open(os.path.join(root, name + MANIFEST_SUFFIX)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT else None


def of_run(m: dict | None, run: str) -> bool:
    """Manifest ``m`` is one of run ``run`` (its persistent root's URL) and records the
    digests of its keys: only such copies are restored (spec §7.8). A copy of another run
    (the same ``local_dir`` used by a run before) or of a writer that recorded no digests is
    never used."""
    if m is None or m.get("run") != run:
        return False
    d = m.get("digests")
    return isinstance(d, dict) and d.get("algorithm") == DIGEST_ALGORITHM and isinstance(d.get("keys"), dict)


def newest_complete_copy(root: str, run: str, step: int) -> str | None:
    """The directory of this node's newest copy of run ``run`` before ``step`` that holds
    every node's files (its committed root is there: a plain checkpoint), or None."""
    if not os.path.isdir(root):
        return None
    steps = sorted((s for s in (fmt.parse_step_name(n[:-len(MANIFEST_SUFFIX)]) for n in os.listdir(root)
                                if n.endswith(MANIFEST_SUFFIX)) if s is not None and s < step), reverse=True)
    for s in steps:
        name = fmt.step_name(s)
        m = read_manifest(root, name)
        if of_run(m, run) and m.get("complete") and os.path.isfile(os.path.join(root, name, "zarr.json")):
            return os.path.join(root, name)
    return None


def valid_nodes(root: str, m: dict) -> set[str]:
    """The nodes whose files this copy holds in full (present, with the recorded sizes)."""
    d = os.path.join(root, fmt.step_name(int(m["step"])))
    ok = set()
    for node in m.get("held", []):
        files = m["files"].get(node)
        if files is None:
            continue
        try:
            if all(os.path.getsize(os.path.join(d, rel)) == size for rel, size in files):
                ok.add(node)
        except OSError:
            continue
    return ok


def delete_step(root: str, name: str) -> None:
    """Un-use a local copy (its manifest first), then delete it (a committed copy is
    retired as §7.6 says)."""
    try:
        os.unlink(os.path.join(root, name + MANIFEST_SUFFIX))
    except FileNotFoundError:
        pass
    d = os.path.join(root, name)
    if os.path.isdir(d):
        if os.path.exists(os.path.join(d, "zarr.json")):
            _commit.retire(open_storage(d))
        else:
            shutil.rmtree(d, ignore_errors=True)


# ---- moving files between nodes ------------------------------------------------------------
#
# A *stream* moves a list of file segments from one rank to one or more ranks of other
# nodes: the concatenated bytes of its segments, cut into messages of ``message_bytes``.
# Both ends compute the same segments and messages from the plan, so no sizes or names
# travel. The sender reads each message once (``os.preadv`` straight into a reused slot)
# and sends it to every destination; while it is in flight the next slot is read. The
# receiver keeps ``depth`` receives posted and writes each completed slot with
# ``os.pwrite`` from a memoryview while the others are being received. Every stream runs
# in a thread of its own, so every rank of a node moves data at once.

MESSAGE_BYTES = 8 << 20  # gloo point to point is flat from ~1 MiB; CPU per byte of the transfer falls to ~8 MiB (BENCHMARKS.md, issue 19)
DEPTH = 3  # slots per stream and side: one being read or written, two in flight
MAX_LANES = 4  # streams per pair of ranks, at most (default_lanes)

Segment = tuple[str, int, int, int]  # (relative path, offset, length, size of the whole file)

# tests: called as (label, message index) by a sender after each message is sent, and as
# (label + " received", message index) by a receiver after each message is written
_transfer_hook: Any = None


@dataclass(frozen=True)
class Stream:
    """``segments`` from group rank ``src`` to each group rank of ``dst`` (every
    destination gets the same bytes; ``tag`` keeps streams apart)."""

    src: int
    dst: tuple[int, ...]
    segments: tuple[Segment, ...]
    tag: int = 0

    @property
    def nbytes(self) -> int:
        return sum(s[2] for s in self.segments)


def split_ranges(files: list[tuple[str, int]], parts: int) -> list[list[Segment]]:
    """Cut the concatenation of ``files`` into ``parts`` contiguous ranges of (nearly) equal
    bytes, as segments (a file may be cut between two ranges)."""
    total = sum(size for _, size in files)
    bounds = [total * i // parts for i in range(parts + 1)]
    out: list[list[Segment]] = [[] for _ in range(parts)]
    pos, part = 0, 0
    for rel, size in files:
        off = 0
        while True:
            while part < parts - 1 and pos >= bounds[part + 1]:
                part += 1
            n = min(size - off, bounds[part + 1] - pos) if part < parts - 1 else size - off
            if n > 0 or (size == 0 and off == 0):
                out[part].append((rel, off, n, size))
            off += n
            pos += n
            if off >= size:
                break
    return out


def node_streams(src_ranks: tuple[int, ...], dst_nodes: list[tuple[int, ...]], files: list[tuple[str, int]],
                 pairs: int, lanes: int = 1) -> list[Stream]:
    """Streams moving ``files`` (which every rank of the source node can read) to every
    node of ``dst_nodes``: ``pairs`` contiguous byte ranges of (nearly) equal size, range
    ``p`` sent by ``src_ranks[p % S]`` to rank ``p % D`` of each destination node (with
    ``pairs = S`` each sending rank reads its range once, whatever the destination nodes'
    sizes), each cut again into ``lanes`` streams that run at once (more threads reading,
    sending and writing for one pair of ranks)."""
    out = []
    for j, segs in enumerate(split_ranges(files, pairs * lanes)):
        p = j // lanes
        if segs:
            out.append(Stream(src_ranks[p % len(src_ranks)], tuple(d[p % len(d)] for d in dst_nodes), tuple(segs)))
    return out


def default_lanes(ranks_on_node: int) -> int:
    """Streams per pair of ranks: this host's CPUs shared by its ranks, 1 to 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_LANES, cpus // max(1, ranks_on_node)))


def _messages(total: int, size: int) -> list[int]:
    """Lengths of the messages of a stream of ``total`` bytes (none for an empty stream)."""
    return [min(size, total - a) for a in range(0, total, size)]


class _Slots:
    """Reused host buffers of ``message_bytes`` (one process-wide pool): a stream takes
    ``depth`` of them and gives them back. Bounded by the most streams a rank ever ran at
    once times ``depth``."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, n: int, size: int) -> list[torch.Tensor]:
        with self._lock:
            free = self._free.setdefault(size, [])
            got = [free.pop() for _ in range(min(n, len(free)))]
        return got + [torch.empty(size, dtype=torch.uint8) for _ in range(n - len(got))]

    def give(self, slots: list[torch.Tensor]) -> None:
        with self._lock:
            for t in slots:
                self._free.setdefault(t.numel(), []).append(t)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_slots = _Slots()


class _Files:
    """A cursor over a stream's segments: :meth:`move` reads the next ``len(view)`` bytes
    into ``view`` (``os.preadv``) or writes them from it (``os.pwrite``), keeping the
    current file open."""

    def __init__(self, directory: str, segments: tuple[Segment, ...], write: bool) -> None:
        self.dir, self.segments, self.write = directory, segments, write
        self.i, self.done = 0, 0  # segment, bytes of it done
        self.fd, self.fd_rel = -1, None
        self.made: set[str] = set()

    def _open(self, rel: str, size: int) -> int:
        if self.fd_rel != rel:
            self.close()
            path = os.path.join(self.dir, rel)
            if self.write:
                parent = os.path.dirname(path)
                if parent not in self.made:
                    os.makedirs(parent, exist_ok=True)
                    self.made.add(parent)
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                # the file's final size; never cuts bytes below it, which another
                # stream may be writing (a file cut between two ranges)
                os.ftruncate(self.fd, size)
            else:
                self.fd = os.open(path, os.O_RDONLY)
            self.fd_rel = rel
        return self.fd

    def move(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            rel, off, n, size = self.segments[self.i]
            k = min(n - self.done, len(view) - pos)
            fd = self._open(rel, size)
            at, end = off + self.done, pos + k
            while pos < end:
                if self.write:
                    m = os.pwrite(fd, view[pos:end], at)
                else:
                    m = os.preadv(fd, [view[pos:end]], at)
                    if m == 0:
                        raise StorageError(f"{self.dir}/{rel} is shorter than the {size} bytes listed")
                pos, at = pos + m, at + m
            self.done += k
            if self.done == n:
                self.i, self.done = self.i + 1, 0

    def end(self) -> None:
        """After the last byte: create the empty files listed last (writing side)."""
        for rel, _, n, size in self.segments[self.i:]:
            if n - self.done:
                raise StorageError(f"stream for {self.dir} ended {n - self.done} bytes early in {rel}")
            if self.write:
                self._open(rel, size)
            self.i, self.done = self.i + 1, 0
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.fd_rel = -1, None


def _send(g: zdist.Group, s: Stream, directory: str, message_bytes: int, depth: int, label: str) -> None:
    """Read ``s`` from ``directory`` and send it. A failure to read is raised after the
    stream was sent in full (the rest as it stood), so that no peer waits for it."""
    lengths = _messages(s.nbytes, message_bytes)
    slots = _slots.take(min(depth, len(lengths)), message_bytes)
    views = [memoryview(t.numpy()) for t in slots]
    inflight: list[list[Any]] = [[] for _ in slots]
    files = _Files(directory, s.segments, write=False)
    error: BaseException | None = None
    try:
        for k, n in enumerate(lengths):
            j = k % len(slots)
            for w in inflight[j]:
                w.wait()
            if error is None:
                try:
                    files.move(views[j][:n])
                except Exception as e:  # noqa: BLE001 - raised once the stream is sent
                    error = e
            inflight[j] = [g.isend(slots[j][:n], d, s.tag) for d in s.dst]
            if _transfer_hook is not None:
                _transfer_hook(label, k)
        for ws in inflight:
            for w in ws:
                w.wait()
    finally:
        files.close()
    _slots.give(slots)  # not after a failed send: the transport may still read them
    if error is not None:
        raise error


def _receive(g: zdist.Group, s: Stream, directory: str, message_bytes: int, depth: int, label: str) -> int:
    """Receive ``s`` and write it under ``directory``; ``depth`` receives stay posted while
    a slot is written. A failure to write is raised after the stream was received."""
    lengths = _messages(s.nbytes, message_bytes)
    slots = _slots.take(min(depth, len(lengths)), message_bytes)
    views = [memoryview(t.numpy()) for t in slots]
    files = _Files(directory, s.segments, write=True)
    error: BaseException | None = None
    posted: dict[int, Any] = {}
    try:
        for k in range(min(len(slots), len(lengths))):
            posted[k] = g.irecv(slots[k][:lengths[k]], s.src, s.tag)
        for k, n in enumerate(lengths):
            j = k % len(slots)
            posted.pop(k).wait()
            if error is None:
                try:
                    files.move(views[j][:n])
                except Exception as e:  # noqa: BLE001 - raised once the stream is received
                    error = e
            if _transfer_hook is not None:
                _transfer_hook(f"{label} received", k)
            if k + len(slots) < len(lengths):
                posted[k + len(slots)] = g.irecv(slots[j][:lengths[k + len(slots)]], s.src, s.tag)
        if error is None:
            try:
                files.end()
            except Exception as e:  # noqa: BLE001
                error = e
    finally:
        files.close()
    _slots.give(slots)  # not after a failed receive: the transport may still write them
    if error is not None:
        raise error
    return s.nbytes


def transfer(g: zdist.Group, streams: list[Stream], src_dir: str, dst_dir: str, *,
             message_bytes: int = MESSAGE_BYTES, depth: int = DEPTH, label: str = "") -> int:
    """Run this rank's ends of ``streams`` (every rank passes the same list), each in a
    thread: sending reads from ``src_dir``, receiving writes under ``dst_dir``. Returns the
    bytes received here. Raises the first error after every stream of this rank ended."""
    tagged = [dataclasses.replace(s, tag=i) for i, s in enumerate(streams)]
    jobs: list[tuple[Any, tuple]] = []
    for s in tagged:
        if s.src == g.rank:
            jobs.append((_send, (g, s, src_dir, message_bytes, depth, label)))
        if g.rank in s.dst:
            jobs.append((_receive, (g, s, dst_dir, message_bytes, depth, label)))
    if not jobs:
        return 0
    if len(jobs) == 1:
        fn, args = jobs[0]
        return fn(*args) or 0
    with cf.ThreadPoolExecutor(len(jobs), thread_name_prefix="zarrckpt-tier-io") as pool:
        futures = [pool.submit(fn, *args) for fn, args in jobs]
        cf.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:  # a broken connection first: it explains the others
        raise next((e for e in errors if isinstance(e, DistributedError)), errors[0])
    return sum(f.result() or 0 for f in futures)


# ---- the save of the local tier -------------------------------------------------------------


class TierRun(SaveRun):
    """A save whose location is the node's ``step_<N>`` in its local tier: every rank writes
    into its node's hidden directory; the leaders commit their node's copy after the
    replica exchange (see the module docstring)."""

    def __init__(self, tiers: Tiers, state: dict, step: int, metadata: dict) -> None:
        self.tiers = tiers
        self.step = step
        self.name = fmt.step_name(step)
        options = dict(tiers.mgr.save_options)
        if getattr(tiers.mgr, "incremental", False):  # spec §7.9: hashes recorded, unchanged chunks linked
            options["content_hashes"] = True
        super().__init__(state, os.path.join(tiers.node_root, self.name), tiers.mgr.process_group, True,
                         SaveOptions.from_kwargs(options), metadata)
        self.lock: _commit.SaveLock | None = None
        self.committed_root: dict | None = None
        self.replica_bytes = 0

    @property
    def nodes(self) -> Nodes:
        return self.tiers.nodes

    def _must_agree(self) -> bytes:
        from dataclasses import asdict

        return json.dumps(["tier", self.name, asdict(self.options.plan)], sort_keys=True, default=str).encode()

    def _content(self) -> Any:
        """Incremental managers (``incremental=True``): hashes recorded, and chunks this rank
        writes that did not change since this node's newest complete copy of the run (one
        with its committed root: every node's files) are hard-linked from it (spec §7.9).
        Replicas received from other nodes are written as sent."""
        if not self.options.content_hashes:
            return None
        from ..readers.previous import Previous

        prev = newest_complete_copy(self.tiers.node_root, self.tiers.run, self.step)
        previous = Previous.open(prev, None, self.store) if prev is not None else None
        return engine.Content(previous)

    def prepare(self) -> None:
        t0 = time.perf_counter()
        error = None
        try:
            if self.g.rank == 0 and self.gathered is not None:
                from .save import _merge_trees

                self.tree = _merge_trees([t for t, _ in self.gathered])
                for _, docs in reversed(self.gathered):
                    self.all_docs.update(docs)
            self._plan_exchange()
        except BaseException as e:  # noqa: BLE001
            error = e
        slow = self.g.broadcast([1 if self.gathered is not None else 0])[0]
        if slow:  # ranks hold different keys: rank 0's merged tree and documents everywhere
            merged = self.g.all_gather((self.tree, self.all_docs) if self.g.rank == 0 else None)[0]
            self.tree, self.all_docs = merged
        if error is None and self.g.rank == self.nodes.leader:
            try:
                root = self.tiers.node_root
                os.makedirs(root, exist_ok=True)
                self.lock = _commit.SaveLock.acquire(self.location, self.save_id)
                delete_step(root, self.name)  # an earlier copy of this step: replaced
                self.store.make_dir()
                for grp in fmt.group_paths(self.all_docs):
                    _write(self.store.local_path, f"{grp}/zarr.json", fmt.encode_document(fmt.group_metadata()))
            except BaseException as e:  # noqa: BLE001
                error = e
        try:
            self.g.agree(error, f"preparing the local tier save of step {self.step}", SaveFailedError)
        except BaseException:
            self.abandon()
            raise
        self._timed("prepare", t0)

    def finish(self, error: BaseException | None, g: zdist.Group) -> None:
        t0 = time.perf_counter()
        g.agree(error, f"writing the local tier save of step {self.step}", SaveFailedError)  # C2
        error = None
        nodes = self.nodes
        leader = g.rank == nodes.leader
        try:
            mine = self._written_files()
            crcs = engine.pack_crcs(getattr(self, "chunk_crcs", None) or {})
            recorded = getattr(self, "content", None)  # engine.Content of a hash-recording save
            hashes = recorded.hashes if recorded is not None else None
        except BaseException as e:  # noqa: BLE001
            mine, crcs, hashes, error = None, None, None, e
        views = g.all_gather((mine, crcs, error is None, (self.tiers.message_bytes, self.tiers.lanes_for(nodes)),
                              hashes))
        if not all(ok for _, _, ok, _, _ in views):
            g.agree(error or SaveFailedError("another rank failed"), "listing the local tier save's files",
                    SaveFailedError)
        # rank 0's committed root, with every rank's chunk CRCs (format 1.3, spec §6.6), to every rank
        root = None
        if g.rank == 0:
            try:
                extra = {}
                if self.options.content_hashes:  # spec §6.6.2: what later saves and promotions compare
                    extra["content_hashes"] = engine.merge_crcs([v[4] or {} for v in views])
                root = self._root("committed", chunk_crcs=engine.merge_crcs([engine.unpack_crcs(v[1]) for v in views]),
                                  **extra)
            except BaseException as e:  # noqa: BLE001 - every rank learns it below
                error = e
        self.committed_root = g.all_gather(root)[0]
        if self.committed_root is None:
            g.agree(error or SaveFailedError("rank 0 could not build the committed root"),
                    "building the local tier save's root", SaveFailedError)
        # each node's files: its ranks' in rank order, each rank's as it wrote them
        files = {nodes.names[i]: list(dict([f[:2] for r in nodes.ranks[i] for f in views[r][0]]).items())
                 for i in range(len(nodes.names))}
        digests = {f[0]: f[2] for r in range(g.size) for f in views[r][0]}
        groups = {f"{p}/zarr.json" for p in fmt.group_paths(self.all_docs)}  # every leader wrote them
        streams = []
        for i in range(len(nodes.names)):
            if self.tiers.targets(i):
                send = [f for f in files[nodes.names[i]] if f[0] not in groups]
                streams += node_streams(nodes.ranks[i], [nodes.ranks[j] for j in self.tiers.targets(i)], send,
                                        len(nodes.ranks[i]), views[0][3][1])
        store_dir = self.store.local_path
        t1 = time.perf_counter()
        try:
            self.replica_bytes = transfer(g, streams, store_dir, store_dir, message_bytes=views[0][3][0],
                                          depth=self.tiers.depth, label=f"save {self.step}")
        except BaseException as e:  # noqa: BLE001 - every rank learns it at the next agreement
            error = e
        self._timed("replicate", t1)
        t0 += time.perf_counter() - t1  # "commit" is the rest
        g.agree(error, f"replicating the local tier copies of step {self.step}", SaveFailedError)
        try:
            if leader:
                held = sorted({nodes.names[nodes.me]} | {nodes.names[i] for i in range(len(nodes.names))
                                                          if nodes.me in self.tiers.targets(i)})
                complete = set(held) == set(nodes.names)
                if complete:  # every node's files: a plain committed checkpoint
                    _sync(store_dir)
                    _write(store_dir, "zarr.json", fmt.encode_document(self.committed_root))
                _sync(store_dir)
                os.rename(store_dir, os.path.join(self.tiers.node_root, self.name))
                _write_manifest(self.tiers.node_root, self.name, {
                    "format": MANIFEST_FORMAT, "step": self.step, "save_id": self.save_id,
                    "run": self.tiers.run, "created": self.created, "nodes": list(nodes.names),
                    "node": nodes.names[nodes.me], "held": held, "complete": complete, "files": files,
                    "digests": {"algorithm": DIGEST_ALGORITHM, "keys": digests}, "root": self.committed_root})
        except BaseException as e:  # noqa: BLE001 - reported at C3
            error = e
        finally:
            if leader and self.lock is not None and error is None:
                self.lock.release()
        g.agree(error, f"committing the local tier copies of step {self.step}", SaveFailedError)  # C3
        self._timed("commit", t0)

    def _written_files(self) -> list[tuple[str, int, int]]:
        """(key, size, digest) of every file this rank wrote into its node's directory: the
        intermediate groups (leader), the array documents and chunks of its plans (C.4).
        The digest (:func:`key_digest`) reads each file back once, after C2 (from the page
        cache, or memory on ``/dev/shm``): what the manifests record is what is stored."""
        rels: list[str] = []
        if self.g.rank == self.nodes.leader:
            rels += [f"{p}/zarr.json" for p in fmt.group_paths(self.all_docs)]
        for p in self.arrays:
            if p.coord is not None and p.layout.metadata_writer() == p.coord:
                rels.append(f"{p.key}/zarr.json")
            rels += [f"{p.key}/{fmt.chunk_key(w.index)}" for w in p.writes]
        d = self.store.local_path
        return [(rel, os.path.getsize(os.path.join(d, rel)), key_digest(rel, directory=d))
                for rel in dict.fromkeys(rels)]

    def abandon(self) -> None:
        if self.g.rank == self.nodes.leader:
            try:
                if self.store is not None and self.store.local_path and os.path.isdir(self.store.local_path):
                    shutil.rmtree(self.store.local_path, ignore_errors=True)
            finally:
                if self.lock is not None:
                    self.lock.release()

    def report(self) -> dict[str, Any]:
        rep = super().report()
        rep.update(step=self.step, tier="local", node=self.nodes.names[self.nodes.me],
                   replica_bytes_received=self.replica_bytes)
        return rep


# ---- the tiers of one manager -----------------------------------------------------------------


class Tiers:
    """The local tier and promotion of a :class:`CheckpointManager` (module docstring)."""

    def __init__(self, mgr: Any, local_dir: Any, local_replicas: int, persist_every: int | None,
                 local_keep_last: int, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.mgr = mgr
        self.local_dir = os.path.abspath(os.fspath(local_dir))
        self.local_replicas = local_replicas
        self.persist_every = persist_every
        self.local_keep_last = local_keep_last
        self.batch_bytes = batch_bytes  # promotion: bytes of writes in flight
        self.message_bytes = MESSAGE_BYTES  # replicas and fetches: rank 0's value is used
        self.depth = DEPTH
        self.lanes: int | None = None  # streams per pair of ranks (rank 0's); None: default_lanes
        self._nodes: Nodes | None = None
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="zarrckpt-tiers")
        self._tasks: list[cf.Future] = []
        self.last_restore: dict | None = None

    # nodes, paths
    @property
    def g(self) -> zdist.Group:
        return zdist.group(self.mgr.process_group)

    @property
    def nodes(self) -> Nodes:
        if self._nodes is None:
            self._nodes = find_nodes(self.g)
        return self._nodes

    @property
    def run(self) -> str:
        """The identity of this run's tier copies: the persistent root, as its absolute real
        path on a file system (the same run whatever the working directory or symbolic link
        it is named by), else its URL without a trailing ``/`` (spec §7.8)."""
        local = getattr(self.mgr.storage, "local_path", None)
        return os.path.realpath(local) if local else self.mgr.root.rstrip("/")

    @property
    def node_root(self) -> str:
        return os.path.join(self.local_dir, self.nodes.names[self.nodes.me])

    def lanes_for(self, nodes: Nodes) -> int:
        return self.lanes if self.lanes is not None else default_lanes(len(nodes.ranks[nodes.me]))

    def targets(self, i: int) -> list[int]:
        return self.nodes.replica_targets(i, self.local_replicas)

    # ---- save

    def save(self, step: int, state: dict, metadata: dict) -> Any:
        from . import async_save as am
        from ..distributed.staging import shared_arena

        t0 = time.perf_counter()
        _ = self.nodes  # one all-gather on the caller's group, the first time
        with am._foreground:
            with am._state_lock:
                previous = list(am._inflight)
            for f in previous:  # the staging buffer is about to be reused
                cf.wait([f])
            run = TierRun(self, state, step, metadata)
            am._hooks()
            run.enter("async_save")
            side = run.g.side_group()
            with paused():
                arena = shared_arena()
                error = run.plan(defer_tree=True, arena=arena)
                if error is None:
                    error = run.stage(arena)
            what = f"planning and staging the local tier save of step {step}"
            ok, (plain_same,), _ = run.g.check(error is None, [run.plain_digest() if error is None else b""])
            if not ok:
                run.g.agree(error, what, SaveFailedError)
            if not plain_same:  # ranks hold different plain leaves: who writes them changes (async_save)
                run.g.agree(run.restrict_and_stage(), what, SaveFailedError)
            run.g = side
            fut = am.SaveFuture(run, time.perf_counter() - t0)
            with am._state_lock:
                am._inflight.append(fut)
            promote = self.persist_every is not None and step % self.persist_every == 0
            self._tasks.append(self._worker.submit(self._background, fut, side, promote))
        return fut

    def _background(self, fut: Any, side: zdist.Group, promote: bool) -> None:
        from . import async_save as am

        run: TierRun = fut.run
        am._background(fut, side)  # C0 .. C3 of the local tier; sets the future
        if fut.exception() is not None:
            return
        if run.g.rank == self.nodes.leader:
            try:
                self._retain_local()
            except Exception as e:  # noqa: BLE001
                log.warning("zarrckpt: local tier retention under %s failed: %s", self.node_root, e)
        if promote:
            try:
                fut.promotion = self._promote(run, side)
            except Exception as e:  # noqa: BLE001 - the local copies stand; persistent is as it was
                fut.promotion = {"error": str(e)}
                log.error("zarrckpt: promoting step %d to %s failed: %s", run.step, self.mgr.root, e)
            if side.rank == 0:
                self.mgr._retain()

    def _retain_local(self) -> None:
        """Leader: keep this run's newest ``local_keep_last`` copies; delete the others, and
        every copy of another run (never restored by this one; on ``/dev/shm`` they hold the
        host's memory: a ``local_dir`` serves one run at a time)."""
        root = self.node_root
        steps, foreign = [], []
        for n in os.listdir(root):
            s = fmt.parse_step_name(n[:-len(MANIFEST_SUFFIX)]) if n.endswith(MANIFEST_SUFFIX) else None
            if s is None:
                continue
            m = read_manifest(root, fmt.step_name(s))
            (steps if of_run(m, self.run) else foreign).append(s)
        keep = set(sorted(steps)[-self.local_keep_last:])
        for s in foreign:
            if s not in keep:
                log.warning("zarrckpt: deleting %s/%s: a local tier copy of another run than %s", root,
                            fmt.step_name(s), self.run)
        for s in steps + foreign:
            if s not in keep:
                delete_step(root, fmt.step_name(s))
        # copies that never got a manifest (a crash between the move and the manifest)
        for n in os.listdir(root):
            s = fmt.parse_step_name(n)
            if s is not None and s not in keep and not os.path.exists(os.path.join(root, n + MANIFEST_SUFFIX)):
                delete_step(root, n)
        _commit.clean_leftovers(root)

    def _promote(self, run: TierRun, g: zdist.Group) -> dict:
        """Copy the finished local files of ``run``'s step into a new checkpoint under the
        persistent root, committed as a save is (engine.begin / engine.finish)."""
        t0 = time.perf_counter()
        mgr, nodes = self.mgr, self.nodes
        location = mgr.storage.child(run.name)
        skip, error = 0, None
        if g.rank == 0:
            try:  # an unreadable root (storage down): every rank fails at begin's C1, none waits
                state, _ = mgr._root_state(run.name)
                skip = 1 if state == "committed" else 0
            except Exception as e:  # noqa: BLE001
                error = e
        if g.broadcast([skip])[0]:
            return {"skipped": "committed already"}
        prev_step = -1  # incremental managers: the newest committed persistent step before this one
        if g.rank == 0 and error is None and getattr(mgr, "incremental", False):
            try:
                prev_step = _previous_committed(mgr, run.step)
            except Exception as e:  # noqa: BLE001 - nothing is reused; the promotion still copies
                log.warning("zarrckpt: promoting step %d copies every file: listing the persistent root "
                            "failed (%s)", run.step, e)
        prev_step = g.broadcast([prev_step + 1])[0] - 1
        groups = fmt.group_paths(run.all_docs) if g.rank == 0 and error is None else []
        pending = run._root("pending") if g.rank == 0 and error is None else None
        target = engine.begin(g, location, run.save_id, True, pending, groups, error=error)
        error = None
        copied = linked = 0
        try:
            if g.rank == nodes.leader:
                store = _commit.save_store(location, run.save_id)
                src = os.path.join(self.node_root, run.name)
                m = read_manifest(self.node_root, run.name)
                me = nodes.names[nodes.me]
                if (m is None or m.get("save_id") != run.save_id or not of_run(m, self.run)
                        or me not in valid_nodes(self.node_root, m)):
                    raise StorageError(f"the local copy of step {run.step} on node {me} is gone or incomplete")
                digests = m["digests"]["keys"]
                group_docs = {f"{p}/zarr.json" for p in fmt.group_paths(run.all_docs)} | {"zarr.json"}
                futures = []
                inflight = 0
                reuse = _Reuse.open(mgr.storage.child(fmt.step_name(prev_step)).url, mgr.save_options.get("storage"), store,
                                    run.committed_root) if prev_step >= 0 else None
                for rel, size in m["files"][me]:
                    if rel in group_docs:
                        continue
                    if _promotion_hook is not None:
                        _promotion_hook(rel)
                    if reuse is not None and reuse.take(rel, size):
                        linked += size
                        continue
                    data = _read(src, rel)
                    if key_digest(rel, data) != digests.get(rel):  # never a damaged byte into persistent
                        raise StorageError(f"{src}/{rel} does not match its digest in the manifest of step "
                                           f"{run.step}: the local copy is damaged; step {run.step} is not promoted")
                    futures.append(store.put(rel, data))
                    copied += size
                    inflight += size
                    if inflight > self.batch_bytes:
                        for f in futures:
                            f.result()
                        futures, inflight = [], 0
                for f in futures:
                    f.result()
                if reuse is not None:
                    reuse.confirm()  # S3: the step copied from is the one compared
                store.flush()
        except BaseException as e:  # noqa: BLE001 - reported at C2
            error = e
        try:
            engine.finish(g, location.url, target, error, lambda: run.committed_root)
        except BaseException:
            engine.abandon(g, target)
            raise
        return {"path": location.url, "bytes_copied": copied, "bytes_linked": linked,
                "seconds": time.perf_counter() - t0}

    # ---- waiting

    def wait(self) -> None:
        tasks, self._tasks = self._tasks, []
        cf.wait(tasks)
        for t in tasks:
            if t.exception() is not None:
                raise t.exception()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)

    # ---- restore
    #
    # A restore tries *sources*, newest step first: a tier step (restorable from the
    # copies of this run, fetching what a node lacks from a peer) or a committed step of the
    # persistent root; at the same step the tiers come first. Rank 0 makes each choice from
    # what every rank holds (one all-gather) and broadcasts it. A source found damaged (a
    # fetched key or a copy that fails its digest, a load that fails on bad bytes) is
    # excluded and said in ``last_restore["skipped"]``, and the next one is tried: a copy
    # that lost a node's keys gets them from a peer's copy, else the persistent root, else
    # an older step.

    def _scan(self) -> dict[int, list[tuple[str, list[str], str]]]:
        """step -> [(save id, valid nodes, created)] of this node's manifests of this run."""
        root = self.node_root
        out: dict[int, list] = {}
        if not os.path.isdir(root):
            return out
        for n in os.listdir(root):
            if not n.endswith(MANIFEST_SUFFIX):
                continue
            step = fmt.parse_step_name(n[:-len(MANIFEST_SUFFIX)])
            m = read_manifest(root, n[:-len(MANIFEST_SUFFIX)]) if step is not None else None
            if m is None or int(m.get("step", -1)) != step or not of_run(m, self.run):
                continue
            out.setdefault(step, []).append((m["save_id"], sorted(valid_nodes(root, m)), m.get("created", "")))
        return out

    def choose(self, step: int | None, excluded: set | frozenset = frozenset()) -> dict:
        """Every rank: the tiers' candidate steps of this run, newest first (one all-gather of
        the leaders' manifests), less the ``excluded`` holdings ((step, save id, node index,
        node whose keys) found damaged during this restore). The persistent root is not read
        here (:class:`_Persistent`)."""
        g, nodes = self.g, self.nodes
        leader = g.rank == nodes.leader
        scan, error = None, None
        try:
            scan = self._scan() if leader else None
        except Exception as e:  # noqa: BLE001
            error = e
        g.agree(error, "listing the tiers' steps", StorageError)
        views = g.all_gather((scan, None))
        # (step, save id) -> node index -> valid nodes; and the save's nodes
        holdings: dict[tuple[int, str], dict[int, set[str]]] = {}
        created: dict[tuple[int, str], str] = {}
        for i in range(len(nodes.names)):
            for s, copies in (views[nodes.leader_of(i)][0] or {}).items():
                for sid, valid, c in copies:
                    holdings.setdefault((s, sid), {})[i] = {m for m in valid if (s, sid, i, m) not in excluded}
                    created[(s, sid)] = c
        # newest first; restore() takes the first whose copies cover the save's nodes
        usable = []
        for (s, sid), per in holdings.items():
            if step is not None and s != step:
                continue
            usable.append(((s, created[(s, sid)]), s, sid, per))
        usable.sort(reverse=True)
        return {"candidates": usable, "views": views}

    def _restorable(self, choice: dict) -> tuple | None:
        """Every rank (the same answer everywhere: it is computed from the gathered
        manifests): the newest candidate whose copies together hold every node's keys, as
        (step, save id, holdings, the save's nodes)."""
        for _, s, sid, per in choice["candidates"]:
            need = self._save_nodes(s, sid, per)  # from any manifest of that save (all name the same)
            if need is not None and set().union(*per.values()) >= set(need):
                return s, sid, per, need
        return None

    def restore(self, state: dict, step: int | None, **load_options: Any) -> int | None:
        """Every rank: restore ``step`` (None: the newest) from the best source (see above);
        returns the step, or None when no source of this run holds one (nothing was
        damaged). Sets ``last_restore`` (``source``, ``step``, ``reason``, ``skipped`` ...).
        Raises when every source that holds a step was found damaged, and when the
        persistent root cannot be listed while it may hold a newer step (the hint says to
        pass the step to take the tiers' copy without it)."""
        g = self.g
        t0 = time.perf_counter()
        skipped: list[dict] = []
        excluded: set[tuple[int, str, int, str]] = set()
        bad_persistent: set[int] = set()
        persistent = _Persistent(self.mgr)
        self.last_restore = None
        for _ in range(MAX_ATTEMPTS):
            choice = self.choose(step, excluded)
            tier = self._restorable(choice)
            decision, error = None, None
            if g.rank == 0:
                try:
                    decision = self._decide(step, tier, persistent, bad_persistent)
                except Exception as e:  # noqa: BLE001 - every rank raises it
                    error = e
            g.agree(error, "listing the persistent root's steps", StorageError)
            decision = g.all_gather(decision)[0]  # rank 0's, everywhere
            if decision["source"] is None:
                if skipped:
                    raise LoadFailedError(
                        "no source of this run could be restored: every step found was damaged: "
                        + "; ".join(f"{d['source']} step {d['step']}: {d['why']}" for d in skipped))
                self.last_restore = {"source": None, "step": None, "reason": decision["reason"], "skipped": []}
                return None
            report: dict[str, Any] = {}
            if decision["source"] == "persistent":
                p = decision["step"]
                why = self._load_persistent(state, p, report, load_options)
                if why is not None:
                    bad_persistent.add(p)
                    skipped.append({"source": "persistent", "step": p, "why": why})
                    log.warning("zarrckpt: restore: the persistent root's step %d is damaged, trying the next "
                                "source: %s", p, why)
                    continue
                self.last_restore = {"source": "persistent", "step": p, "path": self.mgr.step_path(p),
                                     "reason": decision["reason"], "skipped": skipped, "fetched_bytes": 0,
                                     "seconds": time.perf_counter() - t0, "load": report}
                return p
            s, sid, per, need = tier
            assert (s, sid) == (decision["step"], decision["save_id"])
            done = self._from_tier(state, s, sid, per, need, excluded, report, load_options)
            if isinstance(done, str):  # damage found and excluded
                skipped.append({"source": "tiers", "step": s, "why": done})
                log.warning("zarrckpt: restore: a local tier copy of step %d is damaged, trying the next "
                            "source: %s", s, done)
                continue
            self.last_restore = dict(done, step=s, reason=decision["reason"], skipped=skipped,
                                     seconds=time.perf_counter() - t0, load=report)
            return s
        raise LoadFailedError(f"restore gave up after {MAX_ATTEMPTS} damaged sources: {skipped[-3:]}")

    def _decide(self, step: int | None, tier: tuple | None, persistent: _Persistent,
                bad_persistent: set[int]) -> dict:
        """Rank 0: which source to take, and why. The persistent root is listed whenever it
        may hold a newer step than the tiers' best (no step asked for: a job that ran on
        other hosts may have promoted newer steps), or the tiers lack the asked step; a step
        asked for that the tiers hold needs no listing."""
        s = tier[0] if tier is not None else None
        if step is not None and tier is not None:
            return {"source": "tiers", "step": s, "save_id": tier[1],
                    "reason": f"step {step} asked for; restorable from the tiers"}
        try:
            p = persistent.newest(step, s, bad_persistent)
        except StorageError as e:
            hint = (f"; the tiers hold step {s}: pass restore(step={s}) to take it without listing the persistent "
                    "root" if s is not None else "")
            raise StorageError(f"cannot list the persistent root {self.mgr.root!r}, which may hold a newer step "
                               f"than the tiers: {e}{hint}") from e
        if p is not None:
            why = (f"the persistent root's step {p} is newer than the tiers' newest restorable step {s}"
                   if s is not None else f"no tier copy of this run is restorable"
                   + (f" at step {step}" if step is not None else "")
                   + f"; the persistent root's newest committed step is {p}")
            return {"source": "persistent", "step": p, "save_id": None, "reason": why}
        if tier is None:
            return {"source": None, "step": None, "save_id": None,
                    "reason": "no tier copy of this run is restorable and the persistent root holds no "
                              "committed step" + (f" {step}" if step is not None else "")}
        return {"source": "tiers", "step": s, "save_id": tier[1],
                "reason": f"step {s} is the tiers' newest restorable step and the persistent root holds no "
                          "newer committed step"}

    def _load_persistent(self, state: dict, p: int, report: dict, load_options: dict) -> str | None:
        """Every rank: load the persistent root's step ``p``. Returns None, or why the step
        is damaged (every rank agrees: a damaged document or chunk), then to be skipped;
        raises any other error."""
        from .load import load

        opts = dict(load_options)
        opts.setdefault("storage", self.mgr.storage.options)
        try:
            load(state, self.mgr.storage.child(fmt.step_name(p)), process_group=self.mgr.process_group,
                 report=report, **opts)
            return None
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - every rank raised (load's agreement)
            if not self.g.all_true(isinstance(e, (CorruptChunkError, FormatError))):
                raise
            return f"{type(e).__name__}: {e}"

    # -- one tier step

    def _from_tier(self, state: dict, s: int, sid: str, per: dict, need: list[str], excluded: set,
                   report: dict, load_options: dict) -> dict | str:
        """Every rank: restore step ``s`` of save ``sid`` from the tiers: fetch what each
        node lacks (and verify it), complete the copies, load this node's copy. Returns the
        report's fields, or why a copy was found damaged (its holdings then excluded)."""
        from .load import load

        g, nodes = self.g, self.nodes
        name = fmt.step_name(s)
        # what each node lacks, and from whom (the next node in the ring that holds it);
        # a key the node holds already (an intermediate group) is not fetched
        k = len(nodes.names)
        files = self._files_of(s, sid, per)
        wanted: dict[tuple[int, int], dict[str, int]] = {}
        owners: dict[tuple[int, int], set[str]] = {}
        for d in range(k):
            have = per.get(d, set())
            held = {rel for m in have for rel, _ in files[m]}
            for m in need:
                if m in have:
                    continue
                src = next((d + j) % k for j in range(1, k) if m in per.get((d + j) % k, set()))
                bucket = wanted.setdefault((src, d), {})
                bucket.update((rel, size) for rel, size in files[m] if rel not in held)
                owners.setdefault((src, d), set()).add(m)
        message_bytes, lanes = g.all_gather((self.message_bytes, self.lanes_for(nodes)))[0] if wanted else (0, 1)
        streams = []
        for (src, d), bucket in sorted(wanted.items()):
            streams += node_streams(nodes.ranks[src], [nodes.ranks[d]], sorted(bucket.items()),
                                    max(len(nodes.ranks[src]), len(nodes.ranks[d])), lanes)
        copy_dir = os.path.join(self.node_root, name)
        error = None
        fetched = 0
        t1 = time.perf_counter()
        if streams:
            side = g.side_group()  # gloo, whatever the caller's group is
            try:  # a copy stops claiming the nodes it will fetch before any byte is written
                if g.rank == nodes.leader:
                    self._unclaim(s, sid, [m for m in need if m not in per.get(nodes.me, set())], copy_dir)
            except BaseException as e:  # noqa: BLE001
                error = e
            g.agree(error, f"preparing the local tier copy of step {s} for a fetch", LoadFailedError)
            try:
                fetched = transfer(side, streams, copy_dir, copy_dir, message_bytes=message_bytes,
                                   depth=self.depth, label=f"restore {s}")
            except BaseException as e:  # noqa: BLE001
                error = e
            g.agree(error, f"fetching the local tier copies of step {s} from the peers", LoadFailedError)
            damage = self._check_fetched(s, sid, need, files, per, wanted, owners, excluded, copy_dir)
            if damage is not None:
                return damage
        fetch_seconds = time.perf_counter() - t1
        try:
            if g.rank == nodes.leader:
                self._complete_copy(s, sid, need, files, per.get(nodes.me, set()), copy_dir)
        except BaseException as e:  # noqa: BLE001
            error = e
        g.agree(error, f"completing the local tier copies of step {s}", LoadFailedError)
        try:
            load(state, copy_dir, process_group=self.mgr.process_group, report=report, **load_options)
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - every rank raised (load's agreement): damage, or not?
            if not g.all_true(isinstance(e, _MAY_BE_DAMAGE)):
                raise  # a target that does not match ...: no need to read the copies
            damage = self._check_copies(s, sid, need, files, excluded, copy_dir)
            if damage is None:
                raise  # the copies are intact: the error is not theirs (a target mismatch ...)
            return f"loading it failed ({type(e).__name__}: {str(e)[:200]}); {damage}"
        total = sum(f for f in g.all_gather(fetched))
        return {"source": "local" if not streams else "peers", "path": copy_dir, "fetched_bytes": fetched,
                "fetched_bytes_all_nodes": total, "persistent_bytes_read": 0, "fetch_seconds": fetch_seconds}

    def _my_share(self, entries: list) -> list:
        """This rank's share of its node's ``entries`` (every ``n``-th, ``n`` the node's ranks)."""
        ranks = self.nodes.ranks[self.nodes.me]
        return entries[ranks.index(self.g.rank)::len(ranks)]

    def _check_fetched(self, s: int, sid: str, need: list[str], files: dict, per: dict, wanted: dict,
                       owners: dict, excluded: set, copy_dir: str) -> str | None:
        """Every rank, after a fetch: the ranks of each receiving node verify what it received
        against the manifest's digests, each a share. If any key is bad: the source node's
        leader verifies those keys in its own copy and stops claiming the nodes whose keys are
        damaged there; the holdings that supplied bad keys are excluded; the receiving
        node's manifest claims only the nodes whose keys all arrived intact (no root, never
        complete). Returns None (all intact), or what was found."""
        g, nodes = self.g, self.nodes
        digests = self._shared_manifest(s, sid, per)["digests"]["keys"]
        mine = sorted({kv for (src, d), bucket in wanted.items() if d == nodes.me for kv in bucket.items()})
        error, bad = None, []
        try:
            bad = bad_keys(copy_dir, self._my_share(mine), digests)
        except BaseException as e:  # noqa: BLE001
            error = e
        g.agree(error, f"verifying the keys of step {s} fetched from the peers", LoadFailedError)
        every = sorted({x for part in g.all_gather([(nodes.me, rel) for rel in bad]) for x in part})
        if not every:
            return None
        # which (source, receiver, node whose keys) carried a bad key
        pairs = set()
        for d, rel in every:
            for (src, dd), bucket in wanted.items():
                if dd == d and rel in bucket:
                    pairs |= {(src, d, m) for m in owners[(src, dd)] if rel in dict(files[m])}
        try:
            if g.rank == nodes.leader:
                # a source: are the keys it sent damaged in its own copy?
                sent = sorted({rel for d, rel in every for (src, dd), b in wanted.items()
                               if src == nodes.me and dd == d and rel in b})
                if sent:
                    sizes = {rel: size for m in need for rel, size in files[m]}
                    damaged = set(bad_keys(copy_dir, [(rel, sizes[rel]) for rel in sent], digests))
                    drop = [m for m in per.get(nodes.me, set()) if damaged & {rel for rel, _ in files[m]}]
                    if drop:
                        self._unclaim(s, sid, drop, copy_dir)
                # a receiver: claim the nodes whose keys all arrived intact
                if any(d == nodes.me for (_, d) in wanted):
                    bad_here = {rel for d, rel in every if d == nodes.me}
                    fetched = {m for (src, d), ms in owners.items() if d == nodes.me for m in ms}
                    ok = {m for m in fetched if not bad_here & {rel for rel, _ in files[m]}}
                    self._claim(s, sid, sorted((per.get(nodes.me, set()) | ok)), copy_dir)
        except BaseException as e:  # noqa: BLE001
            error = e
        g.agree(error, f"un-claiming the damaged copies of step {s}", LoadFailedError)
        excluded.update((s, sid, src, m) for src, _, m in pairs)
        shown = ", ".join(f"{rel} (from {nodes.names[src]}'s copy)" for src, _, rel in sorted(
            {(src, d, rel) for d, rel in every for (src, dd), b in wanted.items() if dd == d and rel in b})[:5])
        return f"{len(every)} key(s) fetched failed their digests: {shown}"

    def _check_copies(self, s: int, sid: str, need: list[str], files: dict, excluded: set,
                      copy_dir: str) -> str | None:
        """Every rank, after a load of step ``s`` failed: each node's ranks verify their
        node's copy (each a share of its keys, against the manifest's digests; the leader
        its root against the manifest's). A node's copy stops claiming the nodes whose keys
        are damaged (its root removed), and those holdings are excluded; a damaged root is
        removed (the next attempt writes it again). Returns None (every copy intact), or
        what was found."""
        g, nodes = self.g, self.nodes
        m = self._shared_manifest(s, sid, {0: set()})
        digests = m["digests"]["keys"]
        mine = read_manifest(self.node_root, fmt.step_name(s)) if g.rank == nodes.leader else None
        error, bad, root_bad = None, [], False
        try:
            entries = sorted({x for n in need for x in map(tuple, files[n])})
            bad = bad_keys(copy_dir, self._my_share(entries), digests)
            if g.rank == nodes.leader:
                try:
                    with open(os.path.join(copy_dir, "zarr.json"), "rb") as f:
                        root_bad = f.read() != fmt.encode_document(m["root"])
                except FileNotFoundError:
                    root_bad = False
        except BaseException as e:  # noqa: BLE001
            error = e
        g.agree(error, f"verifying the local tier copies of step {s}", LoadFailedError)
        every = g.all_gather((nodes.me, bad, root_bad))
        per_node: dict[int, set[str]] = {}
        roots = set()
        for i, b, r in every:
            per_node.setdefault(i, set()).update(b)
            if r:
                roots.add(i)
        if not any(per_node.values()) and not roots:
            return None
        error = None
        try:
            if g.rank == nodes.leader:
                here = per_node.get(nodes.me, set())
                drop = [n for n in need if here & {rel for rel, _ in files[n]}]
                if drop and mine is not None:
                    self._unclaim(s, sid, drop, copy_dir)
                elif nodes.me in roots:
                    os.unlink(os.path.join(copy_dir, "zarr.json"))
        except BaseException as e:  # noqa: BLE001
            error = e
        g.agree(error, f"un-claiming the damaged copies of step {s}", LoadFailedError)
        found = []
        for i, b in sorted(per_node.items()):
            for n in need:
                if b & {rel for rel, _ in files[n]}:
                    excluded.add((s, sid, i, n))
                    found.append(f"{nodes.names[i]}'s copy of {n}'s keys ({', '.join(sorted(b)[:3])})")
        found += [f"{nodes.names[i]}'s root zarr.json (removed)" for i in sorted(roots)]
        return "damaged: " + "; ".join(found)

    def _save_nodes(self, s: int, sid: str, per: dict) -> list[str] | None:
        m = self._shared_manifest(s, sid, per)
        return None if m is None else list(m["nodes"])

    def _files_of(self, s: int, sid: str, per: dict) -> dict[str, list]:
        return {n: [tuple(x) for x in v] for n, v in self._shared_manifest(s, sid, per)["files"].items()}

    def _shared_manifest(self, s: int, sid: str, per: dict) -> dict | None:
        """The manifest of save ``sid`` of step ``s`` as its lowest holding node's leader has
        it, on every rank (one broadcast of a small document per step looked at)."""
        key = (s, sid)
        cache = getattr(self, "_manifests", None)
        if cache is None:
            cache = self._manifests = {}
        if key in cache:
            return cache[key]
        nodes, g = self.nodes, self.g
        holder = min(per)  # a node index with a manifest of this save
        m = None
        if g.rank == nodes.leader_of(holder):
            m = read_manifest(self.node_root, fmt.step_name(s))
            if m is not None and (m.get("save_id") != sid or not of_run(m, self.run)):
                m = None
        m = g.all_gather(m)[nodes.leader_of(holder)]
        cache[key] = m
        return m

    def _unclaim(self, s: int, sid: str, fetching: list[str], copy_dir: str) -> None:
        """Leader, before its node fetches ``fetching`` into its copy of step ``s`` of save
        ``sid`` (or once their keys in it are found damaged): a copy of another save of that
        step is deleted; a manifest of this save that lists any of them as held is rewritten
        without them, and the copy's root removed, so that a fetch cut short (files written in
        place, at their final sizes) leaves a copy that does not claim them."""
        m = read_manifest(self.node_root, fmt.step_name(s))
        if m is not None and m.get("save_id") != sid:  # a copy of another save of this step:
            delete_step(self.node_root, fmt.step_name(s))  # replaced by the one fetched
            return
        if m is None or not set(fetching) & set(m.get("held", [])):
            return
        try:
            os.unlink(os.path.join(copy_dir, "zarr.json"))
        except FileNotFoundError:
            pass
        _write_manifest(self.node_root, fmt.step_name(s), dict(
            m, held=sorted(set(m["held"]) - set(fetching)), complete=False))

    def _claim(self, s: int, sid: str, held: list[str], copy_dir: str) -> None:
        """Leader, after a fetch that brought damaged keys: a manifest (never complete, no
        root) claiming ``held``, the nodes whose keys the copy holds intact, once they are
        durable."""
        m = self._shared_manifest(s, sid, {0: set()})
        if not held or not os.path.isdir(copy_dir):
            return
        _sync(copy_dir)
        _write_manifest(self.node_root, fmt.step_name(s), dict(
            m, node=self.nodes.names[self.nodes.me], held=sorted(held), complete=False))

    def _complete_copy(self, s: int, sid: str, need: list[str], files: dict, had: set[str], copy_dir: str) -> None:
        """Leader: the node's copy now holds every node's files (fetched ones verified by
        their digests): sync, write the committed root and a manifest that says so."""
        m = self._shared_manifest(s, sid, {0: set()})
        if set(had) >= set(need) and os.path.exists(os.path.join(copy_dir, "zarr.json")):
            return  # complete already
        for node in need:
            for rel, size in files[node]:
                if os.path.getsize(os.path.join(copy_dir, rel)) != size:
                    raise StorageError(f"{copy_dir}/{rel} has the wrong size after the transfer")
        _sync(copy_dir)
        _write(copy_dir, "zarr.json", fmt.encode_document(m["root"]))
        _sync(copy_dir)
        mine = dict(m, node=self.nodes.names[self.nodes.me], held=sorted(need), complete=True)
        _write_manifest(self.node_root, fmt.step_name(s), mine)


class _Persistent:
    """Rank 0's view of the persistent root during one restore: one listing at most, and
    the roots of the steps it names read newest first, only as far as needed (usually
    none, or one)."""

    def __init__(self, mgr: Any) -> None:
        self.mgr = mgr
        self.names: dict[int, str] | None = None
        self.states: dict[int, str] = {}

    def newest(self, step: int | None, floor: int | None, exclude: set[int]) -> int | None:
        """The newest committed step (only ``step`` when given) above ``floor``, not in
        ``exclude``; None if there is none. A root that cannot be read raises (§7.7: it may
        be the newest step)."""
        if self.names is None:
            self.names = {}
            for n in self.mgr._children():
                s = fmt.parse_step_name(n)
                if s is not None:
                    self.names[s] = n
        for s in sorted(self.names, reverse=True):
            if (step is not None and s != step) or s in exclude or (floor is not None and s <= floor):
                continue
            if s not in self.states:
                self.states[s] = self.mgr._root_state(self.names[s])[0]
            if self.states[s] == "committed":
                return s
        return None


def _previous_committed(mgr: Any, step: int) -> int:
    """The newest committed step of the persistent root before ``step``, or -1."""
    names = {s: n for n in mgr._children() if (s := fmt.parse_step_name(n)) is not None and s < step}
    for s in sorted(names, reverse=True):
        if mgr._root_state(names[s])[0] == "committed":
            return s
    return -1


class _Reuse:
    """An incremental manager's promotion: a chunk file whose bytes the previous committed
    step of the persistent root holds (the same array metadata, content hash and unit
    CRC-32Cs, spec §7.9, compared from the two roots without reading a chunk) is
    hard-linked from it on file systems, or copied server-side from it on S3, instead of
    sent from the node's local tier."""

    def __init__(self, previous: Any, mine: Any, docs: dict, store: Any) -> None:
        self.previous, self.mine, self.docs, self.store = previous, mine, docs, store
        self.dirs: set[str] = set()
        self.copier = store.copier if previous.bucket is not None else None

    @classmethod
    def open(cls, prev_url: str, storage_options: Any, store: Any, root: dict | None) -> _Reuse | None:
        """None (everything is sent) where the step before records nothing to compare, is not
        in the same file system or bucket, or this step's root records no content hashes."""
        from ..readers.previous import Previous

        if root is None:
            return None
        try:
            info = fmt.parse_root(root, "the promoted step's root")
            recorded = root.get("attributes", {}).get("zarrckpt", {}).get("digests", {}).get("content")
        except Exception:  # noqa: BLE001
            return None
        if not (isinstance(recorded, dict) and recorded.get("algorithm") == fmt.CONTENT_ALGORITHM
                and isinstance(recorded.get("chunks"), dict) and info.chunk_tables and info.consolidated):
            return None
        previous = Previous.open(prev_url, storage_options, store)
        if previous is None:
            return None
        mine = Previous("", dict(info.consolidated), dict(info.chunk_tables), dict(recorded["chunks"]))
        return cls(previous, mine, dict(info.consolidated), store)

    def take(self, rel: str, size: int) -> bool:
        """Link or copy file ``rel`` from the step before; False: send it."""
        found = _chunk_of(rel, self.docs)
        if found is None:
            return False
        key, index = found
        doc = self.docs[key]
        new, old = self.mine.array(key, doc), self.previous.array(key, doc)
        if new is None or old is None or len(index) != new.hashes.ndim - 1 \
                or any(i >= n for i, n in zip(index, new.hashes.shape)):
            return False
        if not old.matches(index, bytes(new.hashes[index]), new.chunk_crcs(index)):
            return False
        from ..storage import content

        if self.copier is None:
            dst = os.path.join(self.store.local_path, rel)
            if not content.link(old.path(index), dst, self.dirs):
                return False
            if getattr(getattr(self.store, "options", None), "fsync", None) == "each":
                content.fsync_path(dst)  # as a linking save does; "end": the promotion's syncfs
            return True
        if not self.copier.copy(old.object_key(index), self.store.object_key(rel), size, self.previous.tried):
            return False
        content.count(chunks_copied=1, bytes_copied=size)
        return True

    def confirm(self) -> None:
        self.previous.confirm()


def _chunk_of(rel: str, docs: dict) -> tuple[str, tuple[int, ...]] | None:
    """(array key, chunk index) of chunk file ``rel`` ("<key>/c/<i>/<j>..." with the default
    "/" separator), or None for any other file."""
    at = rel.rfind("/c/")
    key, rest = (rel[:at], rel[at + 3:]) if at >= 0 else (rel[:-2], "") if rel.endswith("/c") else (None, None)
    doc = docs.get(key) if key is not None else None
    if not isinstance(doc, dict):
        return None
    enc = doc.get("chunk_key_encoding", {})
    if enc.get("name") != "default" or enc.get("configuration", {}).get("separator", "/") != "/":
        return None
    parts = rest.split("/") if rest else []
    if not all(p.isdigit() for p in parts) or len(parts) != len(doc.get("shape", ())):
        return None
    return key, tuple(int(p) for p in parts)
