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
  durable: the local commit point. It records the save's id, the committed root, the
  nodes of the save and each node's files with their sizes, and which of them this copy
  holds. A copy without a manifest is never used.

Save: plan and stage on the caller's thread as ``async_save`` does (one device->host copy);
then, in the manager's worker thread over a side gloo group: C0, leaders create each
node's hidden directory ``.zarrckpt-<id>.<hex>`` (under a §7.5 lock, so dead ones are
cleaned), C1, every rank writes into its node's directory, C2, leaders exchange the
node's files with its replica nodes (batches of ``replica_batch_bytes``), write what they
receive, sync, move the directory to ``step_<N>`` and write the manifest; C3. Then local
retention (leaders, ``local_keep_last``) and, on a ``persist_every`` step, promotion.

Promotion (same worker thread, side group): rank 0 claims ``<persistent>/step_<N>`` and
creates the save's directory there exactly as a save does (``engine.begin``); every
leader copies its node's own files from its local tier (no device memory, no staging);
C2; rank 0 publishes the committed root (``engine.finish``). A crash before the publish
leaves the persistent root as it was (plus a §7.5 leftover on file systems).

Restore: leaders list their manifests and check every listed file's size; one
all-gather; the newest step whose copies with one save id together hold every node's
files is chosen (unless the persistent root holds a newer step). Leaders missing files
get them from a peer holding them (point to point), write them into their copy, and,
once it holds everything, its committed root: then every rank loads its own node's copy
with :func:`zarrckpt.load` (any world size, any layout).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import group as zdist
from ..engine import commit as _commit
from ..engine import save as engine
from ..errors import SaveFailedError, StorageError
from ..format import documents as fmt
from ..storage import open_storage
from .save import SaveOptions, SaveRun

log = logging.getLogger("zarrckpt")

__all__ = ["Tiers", "node_name"]

MANIFEST_SUFFIX = ".tier.json"
MANIFEST_FORMAT = "zarrckpt-tier"
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


# ---- moving files between leaders --------------------------------------------------------


def _batches(files: list[tuple[str, int]], limit: int) -> list[list[tuple[str, int]]]:
    out: list[list[tuple[str, int]]] = []
    acc = limit + 1
    for rel, size in files:
        if acc + size > limit and (not out or out[-1]):
            out.append([])
            acc = 0
        out[-1].append((rel, size))
        acc += size
    return out


def transfer(g: zdist.Group, plan: list[tuple[int, int, str, list[tuple[str, int]]]], src_dir: Any,
             write: Any, batch_bytes: int) -> int:
    """Move files point to point: ``plan`` rows (src rank, dst rank, tag, files); the
    source reads ``src_dir(tag)/rel``, the destination calls ``write(tag, rel, bytes)``.
    Every rank computes the same rounds from ``plan``; at most ``batch_bytes`` (or one
    file) per row and round is in memory on each side. Returns bytes received here."""
    rows = [(s, d, tag, _batches(files, batch_bytes)) for s, d, tag, files in plan]
    rounds = max((len(b) for *_, b in rows), default=0)
    received = 0
    for k in range(rounds):
        sends, recvs, posts = [], [], []
        for s, d, tag, batches in rows:
            if k >= len(batches):
                continue
            batch = batches[k]
            n = sum(size for _, size in batch)
            if g.rank == s and n:
                buf = bytearray()
                for rel, size in batch:
                    data = _read(src_dir(tag), rel)
                    if len(data) != size:
                        raise StorageError(f"{rel} changed size while being copied ({len(data)} != {size})")
                    buf += data
                sends.append((g.global_rank(d), torch.frombuffer(buf, dtype=torch.uint8)))
            if g.rank == d:
                t = torch.empty(n, dtype=torch.uint8)
                if n:
                    recvs.append((g.global_rank(s), t))
                posts.append((tag, batch, t))
        g.exchange(sends, recvs)
        for tag, batch, t in posts:
            raw = t.numpy().tobytes()
            off = 0
            for rel, size in batch:
                write(tag, rel, raw[off:off + size])
                off += size
            received += len(raw)
    return received


# ---- the save of the local tier -------------------------------------------------------------


class TierRun(SaveRun):
    """A save whose location is the node's ``step_<N>`` in its local tier: every rank writes
    into its node's hidden directory; the leaders commit their node's copy after the
    replica exchange (see the module docstring)."""

    def __init__(self, tiers: Tiers, state: dict, step: int, metadata: dict) -> None:
        self.tiers = tiers
        self.step = step
        self.name = fmt.step_name(step)
        super().__init__(state, os.path.join(tiers.node_root, self.name), tiers.mgr.process_group, True,
                         SaveOptions.from_kwargs({k: v for k, v in tiers.mgr.save_options.items()}), metadata)
        self.lock: _commit.SaveLock | None = None
        self.committed_root: dict | None = None
        self.replica_bytes = 0

    @property
    def nodes(self) -> Nodes:
        return self.tiers.nodes

    def _must_agree(self) -> bytes:
        from dataclasses import asdict

        return json.dumps(["tier", self.name, asdict(self.options.plan)], sort_keys=True, default=str).encode()

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
            mine = list_files(self.store.local_path) if leader else None
            root = self._root("committed") if g.rank == 0 else None
        except BaseException as e:  # noqa: BLE001
            mine, root, error = None, None, e
        views = g.all_gather((mine, root, error is None))
        if not all(ok for _, _, ok in views):
            g.agree(error or SaveFailedError("another rank failed"), "listing the local tier", SaveFailedError)
        self.committed_root = views[0][1]
        files = {nodes.names[i]: views[nodes.leader_of(i)][0] for i in range(len(nodes.names))}
        plan = []
        for i in range(len(nodes.names)):
            for j in self.tiers.targets(i):
                plan.append((nodes.leader_of(i), nodes.leader_of(j), nodes.names[i], files[nodes.names[i]]))
        store_dir = self.store.local_path
        try:
            self.replica_bytes = transfer(
                g, plan, lambda _tag: store_dir,
                lambda _tag, rel, data: None if os.path.exists(os.path.join(store_dir, rel))
                else _write(store_dir, rel, data), self.tiers.batch_bytes)
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
                    "created": self.created, "nodes": list(nodes.names), "node": nodes.names[nodes.me],
                    "held": held, "complete": complete, "files": files, "root": self.committed_root})
        except BaseException as e:  # noqa: BLE001 - reported at C3
            error = e
        finally:
            if leader and self.lock is not None and error is None:
                self.lock.release()
        g.agree(error, f"committing the local tier copies of step {self.step}", SaveFailedError)  # C3
        self._timed("commit", t0)

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
        self.batch_bytes = batch_bytes
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
    def node_root(self) -> str:
        return os.path.join(self.local_dir, self.nodes.names[self.nodes.me])

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
            with am._gc_paused():
                error = run.plan(defer_tree=True)
                if error is None:
                    error = run.stage(shared_arena())
            run.g.agree(error, f"planning and staging the local tier save of step {step}", SaveFailedError)
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
        root = self.node_root
        steps = sorted(s for s in (fmt.parse_step_name(n[:-len(MANIFEST_SUFFIX)]) for n in os.listdir(root)
                                   if n.endswith(MANIFEST_SUFFIX)) if s is not None)
        keep = set(steps[-self.local_keep_last:])
        for s in steps:
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
        groups = fmt.group_paths(run.all_docs) if g.rank == 0 and error is None else []
        pending = run._root("pending") if g.rank == 0 and error is None else None
        target = engine.begin(g, location, run.save_id, True, pending, groups, error=error)
        error = None
        copied = 0
        try:
            if g.rank == nodes.leader:
                store = _commit.save_store(location, run.save_id)
                src = os.path.join(self.node_root, run.name)
                m = read_manifest(self.node_root, run.name)
                me = nodes.names[nodes.me]
                if m is None or m.get("save_id") != run.save_id or me not in valid_nodes(self.node_root, m):
                    raise StorageError(f"the local copy of step {run.step} on node {me} is gone or incomplete")
                group_docs = {f"{p}/zarr.json" for p in fmt.group_paths(run.all_docs)} | {"zarr.json"}
                futures = []
                inflight = 0
                for rel, size in m["files"][me]:
                    if rel in group_docs:
                        continue
                    if _promotion_hook is not None:
                        _promotion_hook(rel)
                    futures.append(store.put(rel, _read(src, rel)))
                    copied += size
                    inflight += size
                    if inflight > self.batch_bytes:
                        for f in futures:
                            f.result()
                        futures, inflight = [], 0
                for f in futures:
                    f.result()
                store.flush()
        except BaseException as e:  # noqa: BLE001 - reported at C2
            error = e
        try:
            engine.finish(g, location.url, target, error, lambda: run.committed_root)
        except BaseException:
            engine.abandon(g, target)
            raise
        return {"path": location.url, "bytes_copied": copied, "seconds": time.perf_counter() - t0}

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

    def _scan(self) -> dict[int, list[tuple[str, list[str], str]]]:
        """step -> [(save id, valid nodes, created)] of this node's manifests."""
        root = self.node_root
        out: dict[int, list] = {}
        if not os.path.isdir(root):
            return out
        for n in os.listdir(root):
            if not n.endswith(MANIFEST_SUFFIX):
                continue
            step = fmt.parse_step_name(n[:-len(MANIFEST_SUFFIX)])
            m = read_manifest(root, n[:-len(MANIFEST_SUFFIX)]) if step is not None else None
            if m is None or int(m.get("step", -1)) != step:
                continue
            out.setdefault(step, []).append((m["save_id"], sorted(valid_nodes(root, m)), m.get("created", "")))
        return out

    def choose(self, step: int | None) -> dict:
        """Every rank: which step to restore and from where (one all-gather)."""
        g, nodes = self.g, self.nodes
        leader = g.rank == nodes.leader
        scan, persistent, error = None, None, None
        try:
            scan = self._scan() if leader else None
            if g.rank == 0:
                steps = self.mgr.steps()
                if step is not None:
                    persistent = step if step in steps else None
                else:
                    persistent = steps[-1] if steps else None
        except Exception as e:  # noqa: BLE001 - e.g. the persistent root unreachable: every rank raises
            error = e
        g.agree(error, "listing the tiers' and the persistent root's steps", StorageError)
        views = g.all_gather((scan, persistent))
        persistent = views[0][1]
        # (step, save id) -> node index -> valid nodes; and the save's nodes
        holdings: dict[tuple[int, str], dict[int, set[str]]] = {}
        created: dict[tuple[int, str], str] = {}
        for i in range(len(nodes.names)):
            for s, copies in (views[nodes.leader_of(i)][0] or {}).items():
                for sid, valid, c in copies:
                    holdings.setdefault((s, sid), {})[i] = set(valid)
                    created[(s, sid)] = c
        # newest first; restore() takes the first whose copies cover the save's nodes
        usable = []
        for (s, sid), per in holdings.items():
            if step is not None and s != step:
                continue
            usable.append(((s, created[(s, sid)]), s, sid, per))
        usable.sort(reverse=True)
        return {"candidates": usable, "persistent": persistent, "views": views}

    def restore(self, state: dict, step: int | None, **load_options: Any) -> int | None:
        from .load import load

        g, nodes = self.g, self.nodes
        t0 = time.perf_counter()
        choice = self.choose(step)
        persistent = choice["persistent"]
        chosen = None
        for _, s, sid, per in choice["candidates"]:
            if persistent is not None and s < persistent:
                break
            # the save's nodes, from any manifest of that save (all name the same)
            need = self._save_nodes(s, sid, per)
            if need is not None and set().union(*per.values()) >= set(need):
                chosen = (s, sid, per, need)
                break
        report: dict[str, Any] = {}
        if chosen is None:
            if persistent is None:
                self.last_restore = None
                return None
            load_options.setdefault("storage", self.mgr.storage.options)
            load(state, self.mgr.storage.child(fmt.step_name(persistent)), process_group=self.mgr.process_group,
                 report=report, **load_options)
            self.last_restore = {"source": "persistent", "step": persistent, "path": self.mgr.step_path(persistent),
                                 "fetched_bytes": 0, "seconds": time.perf_counter() - t0, "load": report}
            return persistent
        s, sid, per, need = chosen
        name = fmt.step_name(s)
        # what each node lacks, and from whom (the next node in the ring that holds it)
        k = len(nodes.names)
        files = self._files_of(s, sid, per)
        plan = []
        for d in range(k):
            have = per.get(d, set())
            for m in need:
                if m in have:
                    continue
                src = next(((d + j) % k for j in range(1, k) if m in per.get((d + j) % k, set())), None)
                plan.append((nodes.leader_of(src), nodes.leader_of(d), m, files[m]))
        leader = g.rank == nodes.leader
        copy_dir = os.path.join(self.node_root, name)
        error = None
        fetched = 0
        try:
            if leader and any(r[1] == g.rank for r in plan):
                os.makedirs(copy_dir, exist_ok=True)
            fetched = transfer(g, plan, lambda _tag: copy_dir,
                               lambda _tag, rel, data: _write(copy_dir, rel, data), self.batch_bytes)
            if leader:
                self._complete_copy(s, sid, need, files, per.get(nodes.me, set()), copy_dir)
        except BaseException as e:  # noqa: BLE001
            error = e
        from ..errors import LoadFailedError

        g.agree(error, f"gathering the local tier copies of step {s}", LoadFailedError)
        source = "local" if not plan else "peers"
        load(state, copy_dir, process_group=self.mgr.process_group, report=report, **load_options)
        total = sum(f for f in g.all_gather(fetched))
        self.last_restore = {"source": source, "step": s, "path": copy_dir, "fetched_bytes": fetched,
                             "fetched_bytes_all_nodes": total, "persistent_bytes_read": 0,
                             "seconds": time.perf_counter() - t0, "load": report}
        return s

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
            if m is not None and m.get("save_id") != sid:
                m = None
        m = g.all_gather(m)[nodes.leader_of(holder)]
        cache[key] = m
        return m

    def _complete_copy(self, s: int, sid: str, need: list[str], files: dict, had: set[str], copy_dir: str) -> None:
        """Leader: the node's copy now holds every node's files: sync, write the committed
        root and a manifest that says so."""
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
