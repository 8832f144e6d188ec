"""The only module that calls ``torch.distributed``.

Every collective zarrckpt issues is one of the named methods of :class:`Group`,
so the number and order of collectives in a save can be read off ``_save.py`` and the
save engine (``engine.py``), whose group protocol :class:`Group` implements.
Without an initialised process group everything degrades to a world of one.

A collective that fails (a peer died, the group timed out) raises
:class:`~zarrckpt.errors.DistributedError`, never a bare backend ``RuntimeError``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError, ZarrckptError, by_name

__all__ = ["Group", "ShardedInfo", "dtensor_info", "dtensor_type", "entry_timeout", "group", "is_dtensor", "is_sharded_tensor",
           "materialize_dtensor", "on_destroy_process_group", "sharded_tensor_info", "warn_if_world_without_group"]


def _collective(op: str):
    """Decorator: a failed collective becomes a DistributedError naming the operation, and
    marks the group's ranks broken (:func:`_mark_broken`): a collective over them that was
    still to start on this rank fails at once instead of waiting for peers that are in
    another collective or dead."""

    def wrap(fn):
        def run(self, *args, **kwargs):
            if self.active:
                self._fail_if_broken(op)
            try:
                return fn(self, *args, **kwargs)
            except ZarrckptError:
                raise
            except (RuntimeError, ValueError) as e:  # gloo/NCCL errors, DistBackendError
                why = f"collective {op} over {self.size} ranks failed on rank {self.rank}: {e}"
                _mark_broken(self, why)
                raise DistributedError(f"{why} (a peer process died or the group timed out)") from e

        run.__name__ = fn.__name__
        run.__doc__ = fn.__doc__
        return run

    return wrap


@dataclass(frozen=True)
class Group:
    """A process group (or the single-process world) as zarrckpt uses it. It implements
    the save engine's group protocol (``rank``, ``size``, :meth:`agree`, :meth:`broadcast`)."""

    pg: Any
    rank: int
    size: int

    @property
    def active(self) -> bool:
        return self.pg is not None and self.size > 1

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.pg is None else dist.get_global_rank(self.pg, group_rank)

    def global_ranks(self) -> tuple[int, ...]:
        return tuple(self.global_rank(r) for r in range(self.size))

    def timeout(self) -> timedelta | None:
        """The group's collective timeout (gloo/NCCL backends), if torch tells it."""
        if self.pg is None:
            return None
        for device in (torch.device("cpu"), torch.device("cuda")):
            try:
                t = self.pg._get_backend(device).options._timeout
            except Exception:  # noqa: BLE001 - private API, absent on some backends/versions
                continue
            if isinstance(t, timedelta):
                return t
        return None

    def _device(self) -> torch.device:
        if self.pg is not None and dist.get_backend(self.pg) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _max(self, t: torch.Tensor) -> None:
        """All-reduce (max) ``t`` in place, waiting as :meth:`_wait` does."""
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg, async_op=True), "all-reduce")

    def _wait(self, work: Any, op: str) -> None:
        """Wait for a collective in flight. While it has not ended, check every second (or
        size/256 s) whether another rank marked these ranks broken or the store is gone (the
        process hosting it, usually rank 0, died): then raise DistributedError at once. A
        blocked collective cannot otherwise be left before the group's timeout, however long
        (torch's default for gloo: 30 min), e.g. when the peers it waits for have failed in
        another collective or died."""
        if not work.is_completed():
            delay, every = 20e-6, max(1.0, self.size / 256)
            check_at = time.monotonic() + every
            while not work.is_completed():
                time.sleep(delay)
                delay = min(delay * 1.5, 2e-3)
                if time.monotonic() >= check_at:
                    self._leave_if_broken_elsewhere(f"collective {op}")
                    check_at = time.monotonic() + every
        work.wait()

    def _leave_if_broken_elsewhere(self, what: str) -> None:
        """Raise DistributedError (marking these ranks broken here) when the store says
        another rank marked them broken, or the store is gone."""
        why = _broken_elsewhere(self)
        if why is not None:
            _mark_broken(self, why, publish=False)
            raise DistributedError(f"{what} over {self.size} ranks abandoned on rank {self.rank}: {why}")

    def _wait_p2p(self, works: Sequence[Any], op: str) -> None:
        """Wait for point-to-point works. NCCL's are waited for directly (``wait`` only
        orders streams). gloo's never report completion before ``wait`` (measured), so they
        cannot be polled as :meth:`_wait` polls: a helper thread waits for them while this
        one checks every second (or size/256 s) whether another rank marked these ranks
        broken or the store is gone, and then raises DistributedError at once. The
        abandoned wait ends with the group (a peer's exit or the group's timeout); the ranks
        are marked broken, so nothing of zarrckpt uses the group again, and the thread holds
        the buffers, so nothing it still writes into is freed."""
        if self.pg is not None and dist.get_backend(self.pg) == "nccl":
            for w in works:
                w.wait()
            return
        done, failed = threading.Event(), []

        def wait_all() -> None:
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=wait_all, name=f"zarrckpt-{op}-wait", daemon=True).start()
        every = max(1.0, self.size / 256)
        while not done.wait(every):
            self._leave_if_broken_elsewhere(op)
        if failed:
            raise failed[0]

    def _fail_if_broken(self, op: str) -> None:
        why = _broken.get(self.global_ranks())
        if why is not None:
            raise DistributedError(
                f"collective {op} over {self.size} ranks not started on rank {self.rank}: an earlier "
                f"zarrckpt collective over these ranks failed ({why}); the process group cannot be "
                "used again")

    @_collective("all_true")
    def all_true(self, ok: bool) -> bool:
        """True iff ``ok`` on every rank (one all-reduce)."""
        if not self.active:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int32, device=self._device())
        self._max(t)
        return int(t.item()) == 0

    @_collective("check")
    def check(self, ok: bool, payloads: Sequence[bytes], root_values: Sequence[int] = ()
              ) -> tuple[bool, list[bool], list[int]]:
        """One all-reduce: (``ok`` on every rank, for each payload whether it is the same on
        every rank, rank 0's ``root_values`` — non-negative ints below 2**62 — everywhere)."""
        if not self.active:
            return ok, [True] * len(payloads), list(root_values)
        hs = [int.from_bytes(hashlib.blake2b(p, digest_size=7).digest(), "little") for p in payloads]
        mine = list(root_values) if self.rank == 0 else [0] * len(root_values)
        body = [v for h in hs for v in (h, -h)]
        t = torch.tensor([0 if ok else 1, *body, *mine], dtype=torch.int64, device=self._device())
        self._max(t)
        vals = [int(v) for v in t.tolist()]
        same = [vals[1 + 2 * i] == -vals[2 + 2 * i] for i in range(len(hs))]
        return vals[0] == 0, same, vals[1 + 2 * len(hs):]

    def _arrived(self, op: str) -> None:
        """Before a blocking object collective (torch's gather_object / all_gather_object
        cannot be polled): one all-reduce waited for as :meth:`_wait` does, so that a rank
        whose peers will never arrive (one failed an earlier collective, or rank 0, the
        store's host, died) fails at once instead of at the group's timeout; once every rank
        has arrived, the collective itself only fails if one dies inside it."""
        t = torch.zeros(1, dtype=torch.int32, device=self._device())
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg, async_op=True), op)

    @_collective("gather_object")
    def gather_to_root(self, obj: Any) -> list[Any] | None:
        """Objects of all ranks on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        self._arrived("gather_object")
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.global_rank(0), group=self.pg)
        return out

    @_collective("all_gather_object")
    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        self._arrived("all_gather_object")
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    @_collective("batch_isend_irecv")
    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
    ) -> None:
        """Point-to-point sends/receives (global ranks), matched per pair in list order."""
        if not sends and not recvs:
            return
        ops = [dist.P2POp(dist.isend, t, peer, group=self.pg) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.pg) for peer, t in recvs]
        self._wait_p2p(dist.batch_isend_irecv(ops), "batch_isend_irecv")

    @_collective("isend")
    def isend(self, t: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Start sending ``t`` to group rank ``peer`` (point to point, matched with the
        peer's :meth:`irecv` of the same tag in order); ``.wait()`` on the result."""
        return _Pending(self, "isend", dist.isend(t, group=self.pg, group_dst=peer, tag=tag))

    @_collective("irecv")
    def irecv(self, t: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Start receiving into ``t`` from group rank ``peer``; ``.wait()`` on the result."""
        return _Pending(self, "irecv", dist.irecv(t, group=self.pg, group_src=peer, tag=tag))

    def minimum(self, values: Sequence[int]) -> list[int]:
        """The element-wise minimum of every rank's ``values`` (ints, the same count on every
        rank), everywhere (one all-reduce)."""
        if not self.active or not values:
            return list(values)
        t = torch.tensor([-int(v) for v in values], dtype=torch.int64, device=self._device())
        self._max(t)
        return [-int(v) for v in t.tolist()]

    def broadcast(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` (ints in 0 .. 2**62-1) on every rank (one all-reduce)."""
        return self.check(True, [], values)[2]

    def agree(self, error: BaseException | None, what: str, error_class: type[ZarrckptError]) -> None:
        """One all-reduce; if any rank failed, every rank raises an error of one class
        (the engine's group protocol, :class:`zarrckpt.engine.save.Group`).

        The failing ranks' errors are gathered (a slow path, taken only on failure) so
        that every message names each failing rank and its error. A rank that failed
        with a zarrckpt error re-raises it; the others raise the same class (or
        ``error_class`` when the first failure is not a zarrckpt error). A rank that was
        interrupted (``KeyboardInterrupt``, ``SystemExit``: not an ``Exception``)
        re-raises that, as itself; the others are told that it was interrupted.
        """
        if self.all_true(error is None):
            return
        if not self.active:
            raise error
        msg = None if error is None else (type(error).__name__, _describe(error))
        msgs = self.all_gather(msg)
        bad = {r: m for r, m in enumerate(msgs) if m is not None}
        first = bad[min(bad)]
        cls = by_name(first[0]) or error_class
        text = (f"{what} failed on rank(s) {sorted(bad)}: "
                + "; ".join(f"rank {r}: {name}: {m}" for r, (name, m) in sorted(bad.items())))
        if error is not None and not isinstance(error, Exception):
            raise error
        if isinstance(error, ZarrckptError) and (len(bad) == 1 or type(error) is cls):
            raise error
        raise cls(text) from error

    def enter(self, what: str, timeout: float | None = None) -> None:
        """The first agreement of a zarrckpt call (``what``: "save", "load" ...): wait until
        every rank of the group has entered it, for at most ``timeout`` seconds (default:
        :func:`entry_timeout`; never longer than the group's own timeout).

        Through the process group's c10d store, not a collective, so it works for gloo and
        NCCL alike and a missing rank costs no broken communicator. One atomic decision per
        call: the last rank to arrive sets it to "go"; a rank whose wait times out sets it to
        "fail" and raises :class:`DistributedError` naming the ranks that did not arrive. A
        rank arriving after that finds "fail" and raises at once (it does not hang), and its
        next call lines up with the other ranks' next call again."""
        if not self.active:
            return
        limit = entry_timeout() if timeout is None else float(timeout)
        group_limit = self.timeout()
        if group_limit is not None:
            limit = min(limit, group_limit.total_seconds())
        ranks = self.global_ranks()
        with _side_lock:
            seq = _entries[ranks] = _entries.get(ranks, 0) + 1
        store = _store()
        base = f"zarrckpt/enter/{'-'.join(map(str, ranks))}/{seq}"
        try:
            broken = _broken.get(ranks)
            if broken is None and store.check([_broken_key(ranks)]):  # another rank's collective failed
                broken = store.get(_broken_key(ranks)).decode(errors="replace")
            if broken is not None:  # no collective can follow: every rank is told at once
                store.compare_set(f"{base}/decision", "", "broken " + broken)
            store.set(f"{base}/rank{self.rank}", what)
            if store.add(f"{base}/arrived", 1) == self.size:
                store.compare_set(f"{base}/decision", "", "go")
            try:
                store.wait([f"{base}/decision"], timedelta(seconds=limit))
            except Exception:  # noqa: BLE001 - the store's timeout error (DistStoreError ...)
                pass
            if store.check([f"{base}/decision"]):
                decision = store.get(f"{base}/decision").decode()
            else:  # timed out: give up, unless the last rank arrives at this very moment
                missing = [r for r in range(self.size) if not store.check([f"{base}/rank{r}"])]
                decision = store.compare_set(f"{base}/decision", "", "fail " + json.dumps(missing)).decode()
        except Exception as e:  # noqa: BLE001 - the store itself is gone (rank 0's process died)
            raise DistributedError(f"rank {self.rank} could not reach the process group's store "
                                   f"when entering zarrckpt {what}: {e}") from e
        if decision == "go":
            self._forget_entry(store, ranks, seq - 2)
            return
        if decision.startswith("broken "):
            raise DistributedError(
                f"zarrckpt {what} refused on rank {self.rank}: an earlier zarrckpt collective over "
                f"these ranks failed ({decision[7:]}); the process group cannot be used again")
        missing = json.loads(decision.split(" ", 1)[1])  # as the rank that gave up saw it
        if self.rank in missing:
            raise DistributedError(
                f"zarrckpt {what}: rank {self.rank} (global {self.global_rank(self.rank)}) entered "
                f"the call after the other ranks had given up waiting for it (they raised); every "
                f"rank of the group must call zarrckpt {what} at the same point")
        raise DistributedError(
            f"zarrckpt {what}: rank(s) {missing} (global "
            f"{[self.global_rank(r) for r in missing]}) did not enter the call within {limit:g} s "
            f"(every rank of the group of {self.size} must call it; set ZARRCKPT_ENTRY_TIMEOUT "
            f"for ranks that legitimately arrive later)")

    def _forget_entry(self, store: Any, ranks: tuple[int, ...], seq: int) -> None:
        """Rank 0 deletes an old entry's keys (every rank has passed it: all arrived later)."""
        if self.rank != 0 or seq < 1:
            return
        base = f"zarrckpt/enter/{'-'.join(map(str, ranks))}/{seq}"
        for key in ["arrived", "decision", *(f"rank{r}" for r in range(self.size))]:
            try:
                store.delete_key(f"{base}/{key}")
            except Exception:  # noqa: BLE001 - a store without deletes only keeps a few bytes
                return

    def side_group(self, backend: str = "gloo") -> Group:
        """A group over the same ranks for background work that must not share the
        caller's group (its collectives would interleave with the training loop's).
        Created once per set of ranks and backend, by those ranks only, with the caller's
        timeout."""
        if not self.active:
            return self
        ranks = self.global_ranks()
        key = ranks if backend == "gloo" else (*ranks, backend)
        with _side_lock:
            side = _side_groups.get(key)
            if side is None:
                kwargs: dict[str, Any] = {"use_local_synchronization": True}
                if self.timeout() is not None:
                    kwargs["timeout"] = self.timeout()
                pg = dist.new_group(ranks=list(ranks), backend=backend, **kwargs)
                side = _side_groups[key] = Group(pg, self.rank, self.size)
            return side


@dataclass(frozen=True)
class _Pending:
    """A point-to-point operation in flight; :meth:`wait` raises DistributedError."""

    group: Group
    op: str
    work: Any

    def wait(self) -> None:
        try:
            self.group._wait_p2p([self.work], self.op)
        except DistributedError:
            raise
        except (RuntimeError, ValueError) as e:
            why = f"{self.op} over {self.group.size} ranks failed on rank {self.group.rank}: {e}"
            _mark_broken(self.group, why)
            raise DistributedError(f"{why} (a peer process died or the group timed out)") from e


def _describe(error: BaseException) -> str:
    """One rank's error as the other ranks read it."""
    if not isinstance(error, Exception):
        return f"the process was interrupted ({type(error).__name__}{': ' + str(error) if str(error) else ''})"
    return str(error)


_side_groups: dict[tuple, Group] = {}
_side_lock = threading.Lock()
_entries: dict[tuple[int, ...], int] = {}  # zarrckpt calls entered, per set of ranks
# Sets of (global) ranks a zarrckpt collective over which failed on this process, and why.
# A failed collective leaves the group's ranks in different places (some in it, some in the
# next one, some dead), so every later collective over the same ranks fails at once, and the
# failure is published in the c10d store for the ranks still blocked in a collective
# (Group._wait). A side group over the same ranks counts as the same ranks.
# Ranks whose zarrckpt collective failed in this process: they hold for the process group
# they failed in, and are forgotten when the world is torn down (destroy_process_group(),
# which on_destroy_process_group wraps): a world made again over the same ranks (a restart
# in the same process, a notebook, a reused test worker) starts clean. The flag in the
# store goes with the store.
_broken: dict[tuple[int, ...], str] = {}


def _broken_key(ranks: tuple[int, ...]) -> str:
    return f"zarrckpt/broken/{'-'.join(map(str, ranks))}"


def _mark_broken(g: Group, why: str, publish: bool = True) -> None:
    """Remember that a collective over ``g``'s ranks failed here, and tell the other ranks
    through the store (best effort: the store may be what died)."""
    if not g.active:
        return
    ranks = g.global_ranks()
    _hook_destroy()  # before _side_lock: it takes it too
    with _side_lock:
        if ranks in _broken:
            return
        _broken[ranks] = why
    if publish:
        try:
            _store().compare_set(_broken_key(ranks), "", why)
        except Exception:  # noqa: BLE001 - the store's host died: the others find it gone
            pass


def _broken_elsewhere(g: Group) -> str | None:
    """Why a collective over ``g``'s ranks cannot end, as the store tells (None: no sign)."""
    key = _broken_key(g.global_ranks())
    try:
        store = _store()
        if not store.check([key]):
            return None
        return store.get(key).decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - TCPStore errors when its host process is gone
        return (f"the process group's store cannot be reached ({e}); the process hosting it "
                "(usually rank 0) has died")

ENTRY_TIMEOUT_S = 300.0


def entry_timeout() -> float:
    """How long a zarrckpt call waits for every rank to enter it: ``ZARRCKPT_ENTRY_TIMEOUT``
    (seconds) or 300. Long enough for ranks that arrive late after uneven work (one rank
    evaluating, a slow data loader), well below the 10-30 minutes a collective would hang."""
    value = os.environ.get("ZARRCKPT_ENTRY_TIMEOUT")
    if value is None or not value.strip():
        return ENTRY_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"ZARRCKPT_ENTRY_TIMEOUT must be a number of seconds > 0, not {value!r}")
    return seconds


def _store() -> Any:
    """The default process group's c10d store (every group's ranks can reach it)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def warn_if_world_without_group(what: str) -> None:
    """Warn when this process has no process group but its environment says it is one of
    several (``WORLD_SIZE`` > 1, as torchrun sets): the call covers this process alone."""
    if dist.is_available() and dist.is_initialized():
        return
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1:
        warnings.warn(
            f"zarrckpt.{what}: WORLD_SIZE={world} but no process group is initialized; this "
            f"process {what}s on its own, as a world of 1 (call torch.distributed."
            "init_process_group() first if the processes should act together)",
            RuntimeWarning, stacklevel=3)


def group(process_group: Any = None) -> Group:
    """The caller's group: the given one, else the default one, else a world of one."""
    if not dist.is_available() or not dist.is_initialized():
        return Group(None, 0, 1)
    pg = process_group if process_group is not None else dist.group.WORLD
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


# ----------------------------------------------------------- process-group teardown

_destroy_callbacks: list[Callable[[], None]] = []
_destroy_hooked = False


def on_destroy_process_group(callback: Callable[[], None]) -> None:
    """Run ``callback`` before ``torch.distributed.destroy_process_group`` tears groups down
    (async saves in flight need their side group until they commit)."""
    with _side_lock:
        if callback not in _destroy_callbacks:
            _destroy_callbacks.append(callback)
    _hook_destroy()


def _hook_destroy() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` once: the callbacks first; when the
    whole world goes, zarrckpt's side groups and broken-rank flags go with it."""
    global _destroy_hooked
    with _side_lock:
        if _destroy_hooked:
            return
        _destroy_hooked = True
        from torch.distributed import distributed_c10d as c10d

        original = c10d.destroy_process_group

        def destroy_process_group(group: Any = None) -> None:
            for cb in list(_destroy_callbacks):
                cb()
            if group is None:
                _side_groups.clear()
                _broken.clear()
            original(group)

        destroy_process_group.__doc__ = original.__doc__
        destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        c10d.destroy_process_group = destroy_process_group
        dist.destroy_process_group = destroy_process_group


# ------------------------------------------------------------------ DTensor & co.


def is_dtensor(obj: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(obj, DTensor)


@functools.cache
def dtensor_type() -> type | None:
    """The DTensor class (None: torch without distributed). Cached: later async saves ask
    once per leaf, and an import statement costs 0.4 us even when the module is loaded."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return None
    return DTensor


def is_sharded_tensor(obj: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, ShardedTensor)


def _placements(placements: tuple) -> tuple:
    """zarrckpt's form of a DTensor's placements (cached: a state has few distinct ones)."""
    hit = _PLACEMENTS.get(placements)
    if hit is not None:
        return hit
    from torch.distributed.tensor import Partial, Replicate, Shard

    from ..errors import UnsupportedPlacementError
    from ..format.layout import Replicate as LReplicate
    from ..format.layout import Shard as LShard
    from ..format.layout import StridedShard as LStrided

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        _StridedShard = ()

    out = []
    for p in placements:
        if _StridedShard and isinstance(p, _StridedShard):
            out.append(LStrided(p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(LShard(p.dim))
        elif isinstance(p, Replicate):
            out.append(LReplicate())
        elif isinstance(p, Partial):
            raise UnsupportedPlacementError(
                f"placement Partial ({p!r}, a pending reduction) has no stored form: call "
                "dtensor.redistribute(placements=[Replicate() ...]) or .full_tensor() first"
            )
        else:
            raise UnsupportedPlacementError(f"unknown DTensor placement {p!r}")
    out = tuple(out)
    if len(_PLACEMENTS) < 4096:
        _PLACEMENTS[placements] = out
    return out


_PLACEMENTS: dict[tuple, tuple] = {}
# DeviceMesh.mesh rebuilds its rank tensor on every access (torch >= 2.9, ~0.4 ms): the
# facts of a mesh are kept per mesh object (by identity, held weakly: DeviceMesh's own
# __eq__ compares layouts, which would merge meshes of different groups)
_MESHES: dict[int, tuple[Any, tuple]] = {}
_MESHES_LOCK = threading.Lock()


def _mesh_info(mesh: Any) -> tuple:
    with _MESHES_LOCK:
        hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    rank_t = mesh.mesh
    coord = mesh.get_coordinate()
    info = (tuple(rank_t.shape), tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None, rank_t,
            mesh.device_type, tuple(coord) if coord is not None else None)
    try:
        key = id(mesh)
        ref = weakref.ref(mesh, lambda _r, key=key: _forget_mesh(key, _r))
    except TypeError:  # pragma: no cover - a mesh type without weak references
        return info
    with _MESHES_LOCK:
        _MESHES[key] = (ref, info)
    return info


def _forget_mesh(key: int, ref: Any) -> None:
    with _MESHES_LOCK:
        hit = _MESHES.get(key)
        if hit is not None and hit[0] is ref:
            del _MESHES[key]


def dtensor_info(t: Any) -> tuple[tuple[int, ...], tuple[str, ...] | None, tuple, Any, str, tuple[int, ...] | None]:
    """(mesh shape, dim names, zarrckpt placements, mesh rank tensor, device type, coordinate)."""
    shape, names, rank_t, device_type, coord = _mesh_info(t.device_mesh)
    return shape, names, _placements(tuple(t.placements)), rank_t, device_type, coord


def materialize_dtensor(t: Any) -> Any:
    """A DTensor like meta DTensor ``t`` with real (uninitialized) local memory on its
    mesh's device."""
    from torch.distributed.tensor import DTensor

    mesh = t.device_mesh
    device: Any = mesh.device_type
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.empty(t.to_local().shape, dtype=t.dtype, device=device)
    return DTensor.from_local(local, mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


@dataclass(frozen=True)
class ShardedInfo:
    """A ShardedTensor with a ChunkShardingSpec seen as a 1-D mesh with ``Shard(dim)``."""

    dim: int
    ranks: tuple[int, ...]  # global rank of each mesh coordinate
    device_type: str
    coord: tuple[int, ...] | None  # this process's coordinate (None: holds no shard)
    local: torch.Tensor | None


def sharded_tensor_info(st: Any, key: str) -> ShardedInfo:
    """Map a ShardedTensor to a Shard layout; refuse sharding specs that have none."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from ..errors import UnsupportedPlacementError

    spec = st.sharding_spec()
    if not isinstance(spec, ChunkShardingSpec) or not isinstance(spec.dim, int):
        raise UnsupportedPlacementError(
            f"tensor {key!r}: ShardedTensor with {type(spec).__name__} has no stored layout; only "
            "ChunkShardingSpec over an integer dim is supported (convert to a DTensor first)")
    ndim = len(st.size())
    dim = spec.dim % ndim if ndim else 0
    ranks = []
    device_type = "cpu"
    for p in spec.placements:
        ranks.append(int(p.rank()))
        device_type = p.device().type
    pg = st._process_group
    me = dist.get_rank()
    # placements name ranks of the ShardedTensor's process group; map them to global ranks
    granks = tuple(dist.get_global_rank(pg, r) if pg is not None and pg is not dist.group.WORLD else r
                   for r in ranks)
    coord = (granks.index(me),) if me in granks else None
    locals_ = st.local_shards()
    if len(locals_) > 1:
        raise UnsupportedPlacementError(f"tensor {key!r}: a ShardedTensor with several local shards "
                                        "on one rank has no stored layout")
    local = locals_[0].tensor if locals_ else None
    return ShardedInfo(dim, granks, device_type, coord, local)
