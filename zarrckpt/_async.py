"""``async_save``: block training only for the device->host copy.

Foreground (caller's thread, caller's process group): plan, C0, prepare, C1,
boundary exchange, and staging into the process's reused arena. Then a
background thread writes the chunks and runs C2/C3 + the commit over a
*separate* gloo group created once per caller group, so no collective of the
save ever interleaves with the training loop's collectives on its own group.

At most one async save is in flight per process: a new ``async_save`` first
waits for the previous one (its staging buffers are about to be reused).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import Any

from . import dist as zdist
from ._save import SaveJob, SaveOptions, plan_and_prepare
from .staging import shared_arena

log = logging.getLogger("zarrckpt")

__all__ = ["SaveFuture", "async_save"]

_side_groups: dict[Any, zdist.Group] = {}
_inflight: SaveFuture | None = None
_lock = threading.Lock()


class SaveFuture:
    """The handle ``async_save`` returns.

    ``staged_seconds``: how long the caller was blocked (set before return).
    ``done()`` / ``result(timeout)``: the commit; ``result`` returns the report or raises
    the save's error (``SaveFailedError`` names the failing ranks).
    """

    def __init__(self, job: SaveJob, staged_seconds: float) -> None:
        self.job = job
        self.path = job.storage.url
        self.staged_seconds = staged_seconds
        self.committed_at: float | None = None
        self._future: cf.Future = cf.Future()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> dict:
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "committed" if self.done() and not self.exception() else (
            "failed" if self.done() else "writing")
        return f"<zarrckpt.SaveFuture {self.path!r} {state}, blocked {self.staged_seconds:.3f}s>"


def _side_group(g: zdist.Group) -> zdist.Group:
    key = id(g.pg)
    if key not in _side_groups:
        _side_groups[key] = g.new_side_group()  # collective on the caller's group, foreground
    return _side_groups[key]


def _background(fut: SaveFuture, side: zdist.Group) -> None:
    job = fut.job
    try:
        job.finish(job.write(streaming=False), side)
        fut.committed_at = time.time()
        report = job.report()
        report["seconds"]["blocked"] = fut.staged_seconds
        log.info("zarrckpt async save %s: %s", report["path"], report)
        fut._future.set_result(report)
    except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
        log.error("zarrckpt async save to %s failed: %s", job.storage.url, e)
        fut._future.set_exception(e)


def async_save(state_dict: dict, path: Any, *, process_group: Any = None, overwrite: bool = False,
               **options: Any) -> SaveFuture:
    global _inflight
    t0 = time.perf_counter()
    with _lock:
        previous = _inflight
    if previous is not None:
        try:
            previous.result()
        except BaseException:  # noqa: BLE001 - already reported through its own future
            pass
    job = SaveJob(state_dict, path, process_group, overwrite, SaveOptions.from_kwargs(options))
    side = _side_group(job.g)
    plan_and_prepare(job)
    job.stage_all(shared_arena())
    fut = SaveFuture(job, time.perf_counter() - t0)
    with _lock:
        _inflight = fut
    threading.Thread(target=_background, args=(fut, side), name="zarrckpt-async-save",
                     daemon=False).start()
    return fut

