"""``CheckpointManager``: one checkpoint per step under a root directory or URL.

::

    with zarrckpt.CheckpointManager("ckpt/run1", keep_last=3, keep_every=1000,
                                    async_save=True) as mgr:
        start = mgr.restore(state) or 0          # the latest committed step, if any
        mgr.install_preemption_handler()         # SIGTERM -> mgr.preempted
        for step in range(start + 1, steps + 1):
            train_step(...)
            stop = mgr.reached_preemption(step)  # every rank agrees (one all-reduce)
            if step % 100 == 0 or stop:
                mgr.save(step, state, metrics={"loss": loss})
            if stop:
                break                            # close() waits for the save in flight

Layout: ``<root>/step_<N>/`` is a plain zarrckpt checkpoint (``N`` zero-padded to 8
digits, so names sort by step); its root ``zarr.json`` records ``{"step": N, "metrics":
{...}}`` as its ``metadata``. Nothing else is stored: the committed checkpoints under
the root are the manager's whole state, so a job that restarts (on any world size)
finds them again and a checkpoint copied elsewhere stays self-describing.

Retention (rank 0, after each save has committed): a committed step is kept if it is
one of the last ``keep_last``, a multiple of ``keep_every``, one of the ``keep_best``
best by ``best_metric`` (``best_mode`` ``"min"`` or ``"max"``), or the latest; every
other committed step is deleted, as are interrupted saves (pending roots and the
hidden directories of saves that died), never the step being written.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from typing import Any

from .errors import CheckpointExistsError, ZarrckptError
from .storage import Storage

log = logging.getLogger("zarrckpt")

__all__ = ["CheckpointManager"]

_STEP = re.compile(r"step_(\d+)")
_HIDDEN = re.compile(r"\.step_(\d+)\.zarrckpt-.+")  # a save's own directory, or replaced data


class CheckpointManager:
    """Save, retain, find and restore per-step checkpoints; see the module docstring.

    Every rank of ``process_group`` creates the manager and calls ``save``/``restore``
    (SPMD). ``save_options`` are passed to every save (``compression``, ``pack_bytes``...).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: int | None = None,
                 best_metric: str = "loss", best_mode: str = "min", process_group: Any = None,
                 async_save: bool = False, **save_options: Any) -> None:
        for name, v in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, not {v!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        from ._optional import require

        require("torch", "CheckpointManager")
        from ._save import SaveOptions

        SaveOptions.from_kwargs(save_options)  # unknown options fail here, not at the first save
        self.root = os.fspath(root)
        self.storage = Storage(self.root, save_options.get("storage"))
        self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.process_group = process_group
        self.async_save = async_save
        self.save_options = save_options
        self.preempted = False
        self._futures: list[tuple[int, Any]] = []  # (step, SaveFuture) of async saves
        self._previous_handlers: dict[int, Any] = {}
        self._closed = False

    # ---- paths and steps ------------------------------------------------------

    def step_path(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/step_{int(step):08d}"

    def _children(self) -> list[str]:
        return self.storage.list_children()

    def _root_state(self, name: str) -> tuple[str, dict]:
        st = Storage(f"{self.root.rstrip('/')}/{name}", self.storage.options)
        try:
            root = st.read_json("zarr.json")
        except ZarrckptError:
            return "foreign", {}
        attrs = ((root or {}).get("attributes") or {}).get("zarrckpt") if isinstance(root, dict) else None
        if not isinstance(attrs, dict):
            return ("absent" if root is None else "foreign"), {}
        return ("committed" if attrs.get("state") == "committed" else "pending"), attrs

    def _scan(self) -> dict[int, tuple[str, dict, str]]:
        """step -> (state, root attributes, child name) for every step directory."""
        out = {}
        for name in self._children():
            m = _STEP.fullmatch(name)
            if m:
                state, attrs = self._root_state(name)
                out[int(m.group(1))] = (state, attrs, name)
        return out

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(s for s, (state, _, _) in self._scan().items() if state == "committed")

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict:
        """The metrics recorded with a committed step ({} if none)."""
        state, attrs = self._root_state(f"step_{int(step):08d}")
        if state != "committed":
            raise ZarrckptError(f"no committed checkpoint for step {step} under {self.root!r}")
        return dict(((attrs.get("metadata") or {}).get("metrics")) or {})

    # ---- save -----------------------------------------------------------------

    def save(self, step: int, state: dict, *, metrics: dict | None = None,
             overwrite: bool = False) -> Any:
        """Save ``state`` as step ``step``. Returns the save's report, or its SaveFuture
        when the manager saves asynchronously. A step that is already committed (or being
        written) is an error unless ``overwrite``. ``metrics`` (JSON numbers) are rank 0's,
        as non-tensor values are; retention's ``keep_best`` ranks steps by them."""
        import zarrckpt

        if self._closed:
            raise ZarrckptError("this CheckpointManager is closed")
        step = int(step)
        if any(s == step and not f.done() for s, f in self._futures):
            raise CheckpointExistsError(f"step {step} is being saved already under {self.root!r}")
        self._collect()
        existing, _ = self._root_state(f"step_{step:08d}")
        if existing == "committed" and not overwrite:
            raise CheckpointExistsError(f"step {step} is already saved under {self.root!r} "
                                        "(pass overwrite=True to replace it)")
        overwrite = overwrite or existing == "pending"  # an interrupted save of this step
        meta = {"step": step, "metrics": dict(metrics or {})}
        kwargs = dict(self.save_options, process_group=self.process_group, overwrite=overwrite,
                      metadata=meta)
        path = self.step_path(step)
        if self.async_save:
            fut = zarrckpt.async_save(state, path, **kwargs)
            self._futures.append((step, fut))
            return fut
        report = zarrckpt.save(state, path, **kwargs)
        self._retain(writing=set())
        from . import dist as zdist

        zdist.group(self.process_group).all_true(True)  # every rank sees retention done
        return report

    def _collect(self) -> None:
        """Apply retention for async saves that finished."""
        done = [(s, f) for s, f in self._futures if f.done()]
        if not done:
            return
        self._futures = [(s, f) for s, f in self._futures if not f.done()]
        for s, f in done:
            if f.exception() is not None:
                log.error("zarrckpt: async save of step %d failed: %s", s, f.exception())
        self._retain(writing={s for s, _ in self._futures})

    def _retain(self, writing: set[int]) -> None:
        """Rank 0: delete what retention does not keep, and interrupted saves."""
        from . import dist as zdist

        if zdist.group(self.process_group).rank != 0:
            return
        scan = self._scan()
        committed = sorted(s for s, (state, _, _) in scan.items() if state == "committed")
        keep = set(self._kept(committed, scan))
        for s, (state, _, name) in scan.items():
            if s in writing or s in keep:
                continue
            if state in ("committed", "pending"):
                self._delete(name)
        for name in self._children():
            m = _HIDDEN.fullmatch(name)
            if m and int(m.group(1)) not in writing:
                self._delete(name)

    def _kept(self, committed: list[int], scan: dict) -> list[int]:
        if not committed:
            return []
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return committed  # no retention asked for: keep everything
        keep = {committed[-1]}
        if self.keep_last:
            keep.update(committed[-self.keep_last:])
        if self.keep_every:
            keep.update(s for s in committed if s % self.keep_every == 0)
        if self.keep_best:
            scored = []
            for s in committed:
                m = ((scan[s][1].get("metadata") or {}).get("metrics") or {}).get(self.best_metric)
                if isinstance(m, (int, float)) and not isinstance(m, bool):
                    scored.append((m if self.best_mode == "min" else -m, s))
            keep.update(s for _, s in sorted(scored)[: self.keep_best])
        return sorted(keep)

    def _delete(self, name: str) -> None:
        try:
            Storage(f"{self.root.rstrip('/')}/{name}", self.storage.options).remove()
            log.info("zarrckpt: retention deleted %s/%s", self.root, name)
        except ZarrckptError as e:
            log.warning("zarrckpt: retention could not delete %s/%s: %s", self.root, name, e)

    # ---- restore ----------------------------------------------------------------

    def restore(self, state: dict, step: int | None = None, **load_options: Any) -> int | None:
        """Load step ``step`` (default: the latest committed one) into ``state`` in place;
        returns the step, or None when there is no committed checkpoint (``state`` is
        then untouched)."""
        import zarrckpt

        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        load_options.setdefault("storage", self.storage.options)
        zarrckpt.load(state, self.step_path(step), process_group=self.process_group, **load_options)
        return int(step)

    # ---- waiting, closing, preemption -----------------------------------------

    def wait(self) -> None:
        """Wait for async saves in flight, then apply retention; raises the first error."""
        futures = list(self._futures)
        first = None
        for _, f in futures:
            e = f.exception()
            first = first or e
        self._collect()
        if first is not None:
            raise first

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self.uninstall_preemption_handler()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the original error behind a failed save
            try:
                self.close()
            except Exception as e:  # noqa: BLE001
                log.error("zarrckpt: while closing after an error: %s", e)

    def install_preemption_handler(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        """On these signals (SIGTERM is what schedulers send before they kill a job), set
        ``self.preempted`` instead of dying; the training loop then saves and exits
        (:meth:`reached_preemption`). Only from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")

        def handler(signum, frame):
            self.preempted = True
            log.warning("zarrckpt: received signal %d: will save and stop at the next step", signum)

        for s in signals:
            self._previous_handlers[s] = signal.signal(s, handler)

    def uninstall_preemption_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s, h in self._previous_handlers.items():
            signal.signal(s, h)
        self._previous_handlers.clear()

    def reached_preemption(self, step: int) -> bool:
        """True on every rank once any rank was signalled (one small all-reduce), so that
        all ranks save the same step and stop together."""
        from . import dist as zdist

        return not zdist.group(self.process_group).all_true(not self.preempted)

    def __repr__(self) -> str:
        return f"<zarrckpt.CheckpointManager {self.root!r}>"
