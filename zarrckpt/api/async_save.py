"""``async_save``: block training only for the device->host copy.

Foreground (caller's thread, caller's process group): local planning (the previous
save's plans reused when the state has the same structure), staging of every local
shard into the process's reused arena, and one all-reduce (planning and staging
succeeded everywhere). Then a background thread runs C0 (agreement on path and
options, the save id, the tree), prepare and C1, the exchange that builds grouped
chunks (on the staged host copies), the writes, C2/C3 and the commit, over a
*separate* gloo group (one per set of ranks, made by those ranks only, with the
caller's timeout), so no collective of the save ever interleaves with the training
loop's collectives on its own group. Errors found in the background (a checkpoint
already at the path, ranks that disagree on options) are raised by the future.

One save is in flight per process: ``async_save`` first waits for the previous
one to commit (its staging buffer is about to be reused), and concurrent calls
from several threads are serialized. Saves in flight are waited for (with a
warning) before ``torch.distributed.destroy_process_group`` and at interpreter
exit; :func:`wait_for_saves` waits explicitly.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import warnings
from typing import Any

import torch

from ..distributed import group as zdist
from ..distributed.staging import release_arenas, shared_arena, staged_nbytes
from ..errors import SaveFailedError
from ..format import tree as ztree
from ..storage import release_buffers
from ..planning.state import is_array_leaf, resolve_stateful
from ._gc import paused
from .save import SaveOptions, SaveRun, forget_staging

log = logging.getLogger("zarrckpt")

__all__ = ["SaveFuture", "async_save", "local_staging_bytes", "release_staging", "reserve_staging",
           "wait_for_saves"]

_foreground = threading.Lock()  # one async_save call at a time in this process
_state_lock = threading.Lock()
_inflight: list[SaveFuture] = []


class SaveFuture(cf.Future):
    """The handle ``async_save`` returns: a :class:`concurrent.futures.Future` of the save's
    report (``result(timeout)`` returns it or raises the save's error, the same class on
    every rank, naming the failing ranks; ``done()``, ``exception()``,
    ``add_done_callback()``, ``concurrent.futures.wait`` work as for any future).

    ``staging_completion``: a second future, done when the state may change, i.e. when the
    device->host copies are done (at once on the CPU; CUDA copies run on a side stream after
    ``async_save`` returns). ``upload_completion`` is the future itself. The two names are
    those of DCP's ``AsyncSaveResponse``, for trainers written against it.
    ``wait_staged(stream=None)``: wait for those copies on the CPU, or, given a CUDA
    stream, make that stream wait without blocking the CPU; ``staged()``: are they done?
    By default the current stream already waits for them.
    ``staged_seconds``: how long the caller was blocked.
    """

    def __init__(self, run: SaveRun, staged_seconds: float) -> None:
        super().__init__()
        self.run = run
        self.path = run.url
        self.staged_seconds = staged_seconds
        self.committed_at: float | None = None
        self.staging_completion: cf.Future = cf.Future()
        if run.staged_event is None:
            self.staging_completion.set_result(staged_seconds)

    @property
    def upload_completion(self) -> SaveFuture:
        return self

    def wait_staged(self, stream: Any = None) -> None:
        ev = self.run.staged_event
        if ev is None:
            return
        if stream is not None:
            stream.wait_event(ev)
        else:
            ev.synchronize()

    def staged(self) -> bool:
        ev = self.run.staged_event
        return ev is None or ev.query()

    def _staging_done(self, error: BaseException | None = None) -> None:
        if not self.staging_completion.done():
            if error is None:
                self.staging_completion.set_result(self.staged_seconds)
            else:
                self.staging_completion.set_exception(error)

    def __repr__(self) -> str:
        state = "committed" if self.done() and not self.exception() else (
            "failed" if self.done() else "writing")
        return f"<zarrckpt.SaveFuture {self.path!r} {state}, blocked {self.staged_seconds:.3f}s>"


def _background(fut: SaveFuture, side: zdist.Group) -> None:
    run = fut.run
    try:
        try:
            # This thread starts holding the GIL, while async_save, which has just started it,
            # waits to take it back and return: release it first (blocking, without Python
            # work), else the caller waits for this thread's next switch (5 ms).
            if run.staged_event is not None:
                # the copies: Python work while they run would also hold the GIL that the
                # caller's training step needs
                run.staged_event.synchronize()
                # a caller blocked in wait_staged() woke up with this thread: let it take
                # the GIL first
            time.sleep(0.001)
            fut._staging_done()
            run.agree(None)
            run.prepare()
            run.exchange()
            run.finish(run.write(streaming=False), side)
        except BaseException:
            run.abandon()
            raise
        fut.committed_at = time.time()
        report = run.report()
        report["seconds"]["blocked"] = fut.staged_seconds
        log.info("zarrckpt async save %s: %s", report["path"], report)
        fut.set_result(report)
    except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
        log.error("zarrckpt async save to %s failed: %s", run.url, e)
        fut._staging_done(e)
        fut.set_exception(e)
    finally:
        with _state_lock:
            if fut in _inflight:
                _inflight.remove(fut)


def wait_for_saves(timeout: float | None = None) -> list[SaveFuture]:
    """Wait until every async save of this process has committed or failed; returns
    their futures (check ``exception()``). Call it before tearing down the process
    group or exiting, or rely on the automatic wait (which warns)."""
    with _state_lock:
        futures = list(_inflight)
    deadline = None if timeout is None else time.monotonic() + timeout
    for f in futures:
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        cf.wait([f], timeout=left)
    return futures


def _wait_before(event: str) -> None:
    with _state_lock:
        pending = [f for f in _inflight if not f.done()]
    if not pending:
        return
    msg = (f"zarrckpt: {event} while {len(pending)} async save(s) are in flight "
           f"({', '.join(f.path for f in pending)}); waiting for them to commit. Call "
           "zarrckpt.wait_for_saves() (or SaveFuture.result()) first to silence this.")
    # a warning only: logging's last-resort handler would print the same line a second time
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    wait_for_saves()


def _hooks() -> None:
    zdist.on_destroy_process_group(lambda: _wait_before("destroy_process_group() was called"))
    global _exit_hooked
    if not _exit_hooked:
        _exit_hooked = True
        # runs before the interpreter joins non-daemon threads and before atexit handlers
        threading._register_atexit(lambda: _wait_before("the interpreter is exiting"))


_exit_hooked = False


def async_save(state_dict: dict, path: Any, *, process_group: Any = None, overwrite: bool = False,
               metadata: dict | None = None, overlap: bool = False, **options: Any) -> SaveFuture:
    t0 = time.perf_counter()
    with _foreground:
        with _state_lock:
            previous = list(_inflight)
        for f in previous:  # its staging buffer is about to be reused
            cf.wait([f])
        run = SaveRun(state_dict, path, process_group, overwrite, SaveOptions.from_kwargs(options), metadata,
                      "async_save")
        _hooks()
        run.enter("async_save")  # before the side group, whose creation needs every rank
        side = run.g.side_group()
        with paused():
            arena = shared_arena()
            error = run.plan(defer_tree=True, arena=arena)
            if error is None:
                error = run.stage(arena, overlap=overlap)
            if error is None and run.options.check_replicas:
                try:  # the values at the call (the background compares them at C0)
                    run.replica_crcs = run._plain_crcs()
                except BaseException as e:  # noqa: BLE001 - reported to every rank below
                    error = e
        what = f"planning and staging the save to {run.url!r}"
        ok, (plain_same,), _ = run.g.check(error is None, [run.plain_digest() if error is None else b""])
        if not ok:
            run.g.agree(error, what, SaveFailedError)
        if not plain_same:  # ranks hold different plain leaves: who writes them changes
            run.g.agree(run.restrict_and_stage(), what, SaveFailedError)
        run.g = side  # from here on, every collective of the save is on the side group
        fut = SaveFuture(run, time.perf_counter() - t0)
        with _state_lock:
            _inflight.append(fut)
        threading.Thread(target=_background, args=(fut, side), name="zarrckpt-async-save",
                         daemon=False).start()
    return fut


def local_staging_bytes(state_dict: dict) -> int:
    """Bytes an async save of ``state_dict`` stages on this rank (its local shards)."""
    total = 0
    for _, leaf in ztree.flatten(resolve_stateful(state_dict), is_array_leaf):
        if zdist.is_dtensor(leaf):
            leaf = leaf.to_local()
        elif zdist.is_sharded_tensor(leaf):
            shards = leaf.local_shards()
            leaf = shards[0].tensor if shards else None
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            total += staged_nbytes(leaf)
    return total


def reserve_staging(state_dict_or_nbytes: dict | int) -> int:
    """Allocate the async-save staging buffer now (page-locked when CUDA is present, which
    costs about 0.6 s per GiB), so the first ``async_save`` blocks no longer than later
    ones. Pass the state dict you will save (its local shards are summed) or a byte
    count. Returns the buffer's size in bytes."""
    n = state_dict_or_nbytes if isinstance(state_dict_or_nbytes, int) else local_staging_bytes(state_dict_or_nbytes)
    arena = shared_arena()
    arena.reserve(n)
    return arena.capacity


def release_staging() -> None:
    """Free the staging buffers: the async-save one (after waiting for async saves in
    flight, which still read from it), the one loads and sync saves stream through, and
    the direct file reader's buffers (up to 256 MiB kept between loads)."""
    wait_for_saves()
    forget_staging()
    release_arenas()
    release_buffers()
