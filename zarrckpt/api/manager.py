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

Retention (rank 0): a committed step is kept if it is one of the last ``keep_last``, a
multiple of ``keep_every``, one of the ``keep_best`` best by ``best_metric``
(``best_mode`` ``"min"`` or ``"max"``), or the latest; every other committed step is
deleted (un-committed first, spec §7.6), never a step being written. It runs in a
background thread of rank 0 (no collectives)

* after each commit: synchronous saves wait for it before ``save`` returns; async saves
  queue it as soon as the save commits;
* at a manager's first ``save``, on what is on storage (a job killed after its saves
  leaves no more than the bound below to the next one), while that save goes on.

No retention or deletion sits where the other ranks wait for rank 0 to enter a call: a
save never waits for the previous commit's retention (slow deletes make it late, never
the save fail; commits meanwhile queue one more run, not one each). So the committed
steps that no ``keep_every``/``keep_best`` rule keeps number at most ``keep_last + 1``
(the last ``keep_last`` and one just committed whose retention has not run yet) as long
as deleting keeps up with saving, whether the job runs on or is killed after every save.

Decisions every rank must share are made once by rank 0 and broadcast (after an entry
check): whether ``save`` overwrites its step (an interrupted save of it) or refuses (a
committed one), and which step ``restore()`` loads. No rank acts on its own read of a
root that rank 0's retention may change in between.

Leftovers of saves that died (hidden directories, pending claims, lock files; spec
§7.5) are removed on file systems in the background when the manager is constructed
and with every retention, only once their writer is known to be gone (its lock is
free): a live save of another job under the same root is never touched. On object
stores retention deletes interrupted (pending) steps older than the newest committed one
that this manager is not writing (a newer one is left to the save that replaces it): a
root there must be written by one job at a time.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import signal
import threading
from typing import Any

from ..engine import commit as _commit
from ..format import documents as fmt
from .._optional import require
from ..errors import (CheckpointExistsError, CheckpointNotFoundError, IncompleteCheckpointError,
                      ManagerClosedError, StorageError)
from ..storage import open_storage

log = logging.getLogger("zarrckpt")

__all__ = ["CheckpointManager"]


def _check_root(root: Any, what: str) -> None:
    """A path or URL a manager can use: refuse what is surely a mistake before anything
    is created (an empty or blank string, spaces around a path)."""
    from ..storage import Storage

    if isinstance(root, Storage):  # a storage object (tests, custom backends) is checked by itself
        return
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path or URL (str or os.PathLike), not {type(root).__name__}")
    text = os.fspath(root)
    if isinstance(text, bytes):
        raise TypeError(f"{what} must be a str path, not bytes")
    if not text.strip():
        raise ValueError(f"{what} is empty or blank ({text!r}): give the directory or URL of the run")
    if text != text.strip():
        raise ValueError(f"{what} {text!r} begins or ends with white space; pass {text.strip()!r} if "
                         "that is what you meant")


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


class CheckpointManager:
    """Save, retain, find and restore per-step checkpoints; see the module docstring.

    Every rank of ``process_group`` creates the manager and calls ``save``/``restore``
    (SPMD). ``save_options`` are passed to every save (``compression``...);
    ``storage=StorageOptions(...)`` among them also reaches every restore (unless it passes
    its own), retention and cleaning.

    The policies trainers configure (torchtitan's names in brackets):

    * ``save_interval`` [``interval``]: ``save(step, ...)`` saves only steps that are a
      multiple of it (None: every call saves); ``save_first_step``
      [``enable_first_step_checkpoint``] also saves step 1; ``save(..., last=True)``
      [``last_step``] and ``save(..., force=True)`` (preemption) always save.
      :meth:`should_save` says whether a call would.
    * ``last_save_model_only`` + ``export_dtype`` [same names]: the last save stores only
      ``state[model_key]``, floating tensors cast to ``export_dtype`` (a model export).
    * ``initial_load_path`` + ``initial_load_model_only`` [same names]: when the root holds
      no committed step, :meth:`restore` loads from that checkpoint (only
      ``state[model_key]`` by default) and returns 0.
    * ``load_only`` [same name]: ``save`` saves nothing.
    * ``incremental=True``: every save records content hashes, and links from the newest
      committed step below it (rank 0's listing, shared) every chunk file whose content did
      not change (``save(incremental_from=...)``, spec §7.9): frozen parameters are written
      once. Each step stays a complete checkpoint; retention deletes steps as usual (a
      hard-linked file lives while any step holds it). Local and parallel file systems link;
      S3 copies server-side within a bucket (``obstore``); elsewhere every chunk is written.
      With ``local_dir`` (tiers, spec §7.8): each node's copy links from its newest complete
      copy, and a promotion links (or, on S3, copies) from the previous committed step of
      the persistent root what did not change; replicas to peers are sent whole.
    * ``restore(..., cast=True)``: load checkpoints of other dtypes (a bf16 export into an
      fp32 model), and every other option of :func:`zarrckpt.load`.

    Retention errors after a commit (an undeletable step, a root that cannot be listed) are
    logged as warnings; the save they follow has committed and ``save`` does not raise.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: int | None = None,
                 best_metric: str = "loss", best_mode: str = "min", process_group: Any = None,
                 async_save: bool = False, save_interval: int | None = None, save_first_step: bool = False,
                 last_save_model_only: bool = False, export_dtype: Any = None, model_key: str = "model",
                 initial_load_path: str | os.PathLike | None = None, initial_load_model_only: bool = True,
                 load_only: bool = False, local_dir: str | os.PathLike | None = None,
                 local_replicas: int = 1, persist_every: int | None = None, local_keep_last: int = 2,
                 incremental: bool = False, **save_options: Any) -> None:
        _check_root(root, "root")
        if local_dir is not None:
            _check_root(local_dir, "local_dir")
        for name, v in (("local_replicas", local_replicas), ("local_keep_last", local_keep_last)):
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "local_replicas" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'local_replicas' else 1}, not {v!r}")
        if persist_every is not None and (not isinstance(persist_every, int) or isinstance(persist_every, bool)
                                          or persist_every < 1):
            raise ValueError(f"persist_every must be a positive int or None, not {persist_every!r}")
        if initial_load_path is not None:
            _check_root(initial_load_path, "initial_load_path")
        for name, v in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best),
                        ("save_interval", save_interval)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, not {v!r}")
        if export_dtype is not None:
            import torch

            if not isinstance(export_dtype, torch.dtype) or not export_dtype.is_floating_point:
                raise ValueError(f"export_dtype must be a floating torch.dtype or None, not {export_dtype!r}")
        if not isinstance(model_key, str) or not model_key:
            raise ValueError(f"model_key must be a non-empty str, not {model_key!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        from .._optional import require

        require("torch", "CheckpointManager")
        from .save import SaveOptions

        SaveOptions.from_kwargs(save_options)  # unknown options fail here, not at the first save
        self.storage = open_storage(root, save_options.get("storage"))
        self.root = self.storage.url
        self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.process_group = process_group
        self.async_save = async_save
        self.save_options = save_options
        if not isinstance(incremental, bool):
            raise ValueError(f"incremental must be True or False, not {incremental!r}")
        self.incremental = incremental
        self.save_interval, self.save_first_step = save_interval, bool(save_first_step)
        self.last_save_model_only, self.export_dtype, self.model_key = bool(last_save_model_only), export_dtype, model_key
        self.initial_load_path, self.initial_load_model_only = initial_load_path, bool(initial_load_model_only)
        self.load_only = bool(load_only)
        self.restored_from: str | None = None  # "step" or "initial" after restore()
        self.preempted = False
        self._futures: list[tuple[int, Any]] = []  # (step, SaveFuture) of async saves
        self._previous_handlers: dict[int, Any] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._writing: set[int] = set()  # steps whose save has not ended yet
        self._deleting: set[int] = set()  # steps retention is deleting now (rank 0)
        self._changed = threading.Condition(self._lock)  # a deletion ended
        self._retain_queued = False  # a retention run is queued, not started
        self._retained = False  # retention ran at least once (the first save runs it first)
        self._background: cf.ThreadPoolExecutor | None = None  # rank 0: retention, cleaning
        self._tasks: list[cf.Future] = []
        self._handoffs: list[threading.Event] = []  # one per async save: retention queued
        self.last_restore: dict | None = None  # the last restore's report ("source": ...)
        self._tiers = None
        if local_dir is not None:
            from .tiers import Tiers

            self._tiers = Tiers(self, local_dir, local_replicas, persist_every, local_keep_last)
        if self.storage.can_rename and self._rank0():
            self._in_background(self._clean_leftovers)

    # ---- paths and steps ------------------------------------------------------

    def step_path(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/{fmt.step_name(int(step))}"

    def _children(self) -> list[str]:
        return self.storage.list_children()

    def _root_state(self, name: str) -> tuple[str, dict]:
        """('absent' | 'foreign' | 'pending' | 'committed', zarrckpt attributes). A root that
        cannot be read (after the storage layer's retries) is an error, never skipped: it
        may be the latest committed step."""
        st = self.storage.child(name)
        try:
            data, _ = st.read_bytes("zarr.json")
        except StorageError as e:
            raise StorageError(f"cannot read the root of {name} under {self.root!r}, so cannot tell "
                               f"whether it is a committed step (not skipping it): {e}") from e
        return fmt.root_state(data)

    def _scan(self) -> dict[int, tuple[str, dict, str]]:
        """step -> (state, root attributes, child name) for every step directory."""
        out = {}
        for name in self._children():
            step = fmt.parse_step_name(name)
            if step is not None:
                state, attrs = self._root_state(name)
                out[step] = (state, attrs, name)
        return out

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(s for s, (state, _, _) in self._scan().items() if state == "committed")

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict:
        """The metrics recorded with a committed step ({} if none)."""
        state, attrs = self._root_state(fmt.step_name(int(step)))
        if state == "pending":
            raise IncompleteCheckpointError(f"step {step} under {self.root!r} is not committed (its save "
                                            "was interrupted or is still running)")
        if state != "committed":
            raise CheckpointNotFoundError(f"no committed checkpoint for step {step} under {self.root!r}")
        return dict(((attrs.get("metadata") or {}).get("metrics")) or {})

    # ---- save -----------------------------------------------------------------

    def should_save(self, step: int, *, last: bool = False, force: bool = False) -> bool:
        """Would ``save(step, ..., last=last, force=force)`` save? (The same on every rank.)"""
        if self.load_only:
            return False
        if last or force or self.save_interval is None:
            return True
        return step % self.save_interval == 0 or (self.save_first_step and step == 1)

    def save(self, step: int, state: dict, *, metrics: dict | None = None,
             overwrite: bool = False, last: bool = False, force: bool = False) -> Any:
        """Save ``state`` as step ``step``, if the policies say so (:meth:`should_save`;
        otherwise return None). Returns the save's report, or its SaveFuture when the
        manager saves asynchronously. A step that is already committed (or being written)
        is an error unless ``overwrite``. ``metrics`` (JSON numbers) are rank 0's, as
        non-tensor values are; retention's ``keep_best`` ranks steps by them. ``last``:
        the run's last step (always saved; model only with ``last_save_model_only``);
        ``force``: save whatever the interval (e.g. on preemption)."""
        if self._closed:
            raise ManagerClosedError(f"this CheckpointManager of {self.root!r} is closed; make a new one")
        require("torch", "CheckpointManager.save()")
        step = int(step)
        if not self.should_save(step, last=last, force=force):
            return None
        if last and self.last_save_model_only:
            state = self._model_export(state)
        if self._tiers is not None:  # every save to the local tier (spec §7.8)
            fut = self._tiers.save(step, state, {"step": step, "metrics": dict(metrics or {})})
            self._futures.append((step, fut))
            if self.async_save:
                return fut
            return fut.result()
        with self._lock:
            if step in self._writing:
                raise CheckpointExistsError(f"step {step} is being saved already under {self.root!r}")
            self._writing.add(step)  # from here on retention leaves this step alone
        try:
            self._collect()
            self._before_save(step)
            overwrite = bool(self._decide("CheckpointManager.save", lambda: self._overwrite(step, overwrite)))
            meta = {"step": step, "metrics": dict(metrics or {})}
            kwargs = dict(self.save_options, process_group=self.process_group, overwrite=overwrite,
                          metadata=meta)
            if self.incremental:
                kwargs["content_hashes"] = True
                prev = self._decide("CheckpointManager.save", lambda: 1 + max(
                    [s for s in self.steps() if s < step], default=-1))
                if prev:
                    kwargs["incremental_from"] = self.storage.child(fmt.step_name(prev - 1)).url
            path = self.storage.child(fmt.step_name(step))
            if self.async_save:
                from .async_save import async_save

                fut = async_save(state, path, **kwargs)
            else:
                from .save import save

                report = save(state, path, **kwargs)
        except BaseException:
            with self._lock:
                self._writing.discard(step)
            raise
        if self.async_save:
            self._futures.append((step, fut))
            handed_off = threading.Event()  # set once its retention is queued
            self._handoffs.append(handed_off)
            fut.add_done_callback(lambda _, s=step, ev=handed_off: self._after_async_save(s, ev))
            return fut
        with self._lock:
            self._writing.discard(step)
        if self._rank0():  # in the retention thread, after the first save's (errors are logged)
            self._queue_retention()
            self._wait_background()
        from ..distributed import group as zdist

        zdist.group(self.process_group).all_true(True)  # every rank sees retention done
        return report

    def _model_export(self, state: dict) -> dict:
        """``{model_key: state[model_key]}``, floating tensors cast to ``export_dtype``."""
        import torch

        from ..planning.state import resolve_stateful

        if self.model_key not in state:
            raise KeyError(f"last_save_model_only: the state has no {self.model_key!r} key "
                           f"(model_key=...; its keys: {sorted(map(str, state))[:10]})")
        model = resolve_stateful(state[self.model_key])

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and self.export_dtype is not None:
                return x.detach().to(self.export_dtype)
            if isinstance(x, dict):
                return {k: cast(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
                return type(x)(cast(v) for v in x)
            return x
        return {self.model_key: cast(model)}

    def _before_save(self, step: int) -> None:
        """Rank 0, before the save's entry check, where the other ranks may already wait:
        nothing here waits for storage (spec C.7). The manager's first save queues retention
        of what is on storage (a killed job's saves) in the background; the previous commit's
        retention is not waited for (slow deletes make it late, never the save). ``step`` is
        in ``_writing`` already, so retention leaves it alone; only if retention is deleting
        that very step at this moment (a save of an old or interrupted step number) does
        this wait for that one deletion: writing into a step being deleted would lose data."""
        if not self._rank0():
            return
        if not self._retained:
            self._retained = True
            self._queue_retention()
        with self._changed:
            while step in self._deleting:
                self._changed.wait()

    def _overwrite(self, step: int, overwrite: bool) -> int:
        """Rank 0's decision for ``save(step)``: 1 to overwrite (asked for, or the step holds
        an interrupted save), 0 not to; a committed step without ``overwrite`` is an error."""
        existing, _ = self._root_state(fmt.step_name(step))
        if existing == "committed" and not overwrite:
            raise CheckpointExistsError(f"step {step} is already saved under {self.root!r} "
                                        "(pass overwrite=True to replace it)")
        return int(overwrite or existing == "pending")  # pending: an interrupted save of this step

    def _decide(self, what: str, decide: Any) -> int:
        """A decision every rank must share, made once: rank 0 runs ``decide()`` (a
        non-negative int from its own reads of storage) and every rank gets its value, after
        an entry check (every rank is in the call, so the all-reduce that carries the value
        waits only for rank 0's reads). No rank acts on its own read of a root that rank 0's
        retention may change in between. Rank 0's error is raised on every rank."""
        from ..distributed import group as zdist

        g = zdist.group(self.process_group)
        if not g.active:
            return decide()
        g.enter(what)
        value, error = 0, None
        if g.rank == 0:
            try:
                value = int(decide())
            except BaseException as e:  # noqa: BLE001 - every rank raises it below
                error = e
        ok, _, (value,) = g.check(error is None, [], [value])
        if not ok:
            g.agree(error, f"{what} under {self.root!r}", StorageError)
        return value

    def _after_async_save(self, step: int, handed_off: threading.Event) -> None:
        """In the async save's thread, once it committed or failed: retention, in the
        background (rank 0; no collectives)."""
        try:
            with self._lock:
                self._writing.discard(step)
            if self._rank0():
                self._queue_retention()
        finally:
            handed_off.set()

    def _queue_retention(self) -> None:
        """Rank 0: run retention in the background thread, unless a run is queued that has
        not started yet (it will see this commit too: slow retention does not pile up)."""
        with self._lock:
            if self._retain_queued:
                return
            self._retain_queued = True
        self._in_background(self._retain)

    def _collect(self) -> None:
        """Forget async saves that finished, logging those that failed."""
        done = [(s, f) for s, f in self._futures if f.done()]
        self._futures = [(s, f) for s, f in self._futures if not f.done()]
        for s, f in done:
            if f.exception() is not None:
                log.error("zarrckpt: async save of step %d failed: %s", s, f.exception())

    def _rank0(self) -> bool:
        from ..distributed import group as zdist

        return zdist.group(self.process_group).rank == 0

    def _in_background(self, fn: Any) -> None:
        with self._lock:
            if self._background is None:
                self._background = cf.ThreadPoolExecutor(1, thread_name_prefix="zarrckpt-retention")
            self._tasks.append(self._background.submit(self._logged, fn))

    @staticmethod
    def _logged(fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - background: nobody to raise to
            log.error("zarrckpt: %s failed: %s", fn.__name__.strip("_"), e)

    def _wait_background(self) -> None:
        """Wait until every async save ended and the retention it queued has run."""
        for ev in list(self._handoffs):
            ev.wait()
        self._handoffs = [ev for ev in self._handoffs if not ev.is_set()]
        with self._lock:
            tasks, self._tasks = self._tasks, []
        cf.wait(tasks)

    def _retain(self) -> None:
        """Rank 0: retire what retention does not keep; remove dead saves' leftovers. Runs in
        the retention thread (or tiers' worker), while saves go on: a step is deleted only if
        no save of it has begun (checked under the lock just before, the step then marked as
        being deleted, so that a save of it waits: :meth:`_before_save`)."""
        if not self._rank0():
            return
        self._retained = True
        with self._lock:
            self._retain_queued = False  # a commit from now on queues another run
        try:
            scan = self._scan()
        except Exception as e:  # noqa: BLE001 - an unreadable root: deleting on a partial view is unsafe
            log.warning("zarrckpt: retention skipped this time under %s: %s", self.root, e)
            return
        committed = sorted(s for s, (state, _, _) in scan.items() if state == "committed")
        keep = set(self._kept(committed, scan))
        for s, (state, _, name) in sorted(scan.items()):
            if s in keep:
                continue
            if state == "committed":
                retire = True
            elif (state in ("pending", "absent") and not self.storage.can_rename and committed
                  and s < committed[-1]):
                # object stores: an interrupted save (or a half-deleted step) of this root's job,
                # older than its newest step; a newer one is left to the save that will
                # replace it (a restarted job saves that step again, with overwrite)
                retire = False
            else:
                continue
            with self._lock:
                if s in self._writing:
                    continue
                self._deleting.add(s)
            try:
                self._delete(name, retire=retire)
            finally:
                with self._changed:
                    self._deleting.discard(s)
                    self._changed.notify_all()
        if self.storage.can_rename:  # file systems: pending claims and hidden directories, if dead
            try:
                self._clean_leftovers()
            except Exception as e:  # noqa: BLE001 - the saves are committed; say what is left
                log.warning("zarrckpt: could not remove leftovers under %s: %s", self.root, e)

    def _clean_leftovers(self) -> None:
        """Remove what saves that died left under the root (file systems; spec §7.5)."""
        _commit.clean_leftovers(self.root, options=self.storage.options)

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

    def _delete(self, name: str, retire: bool) -> None:
        st = self.storage.child(name)
        try:
            _commit.retire(st) if retire else st.remove()
            log.info("zarrckpt: retention deleted %s/%s", self.root, name)
        except Exception as e:  # noqa: BLE001 - never raised from save(): the step it follows committed
            log.warning("zarrckpt: retention could not delete %s/%s: %s", self.root, name, e)

    # ---- restore ----------------------------------------------------------------

    def restore(self, state: dict, step: int | None = None, **load_options: Any) -> int | None:
        """Load step ``step`` (default: the latest committed one) into ``state`` in place;
        returns the step. When the root holds no committed step: with ``initial_load_path``,
        load that checkpoint (``state[model_key]`` only, with ``initial_load_model_only``)
        and return 0; else return None (``state`` is then untouched). ``restored_from``
        says which: ``"step"``, ``"initial"`` or None. ``load_options``: those of
        :func:`zarrckpt.load` (``cast=True``, ``strict``, ``key_map`` ...)."""
        require("torch", "CheckpointManager.restore()")
        from .load import load

        self.restored_from = None
        self.last_restore = None
        if self._tiers is not None:
            found = self._tiers.restore(state, step, **load_options)
            if found is not None:
                self.last_restore = self._tiers.last_restore
                self.restored_from = "step"
                return found
            if step is not None:
                raise CheckpointNotFoundError(f"step {step} is in no tier (local, peers, {self.root!r})")
        if step is None:  # rank 0's listing, for every rank (steps may commit meanwhile)
            found = self._decide("CheckpointManager.restore", lambda: 1 + _or(self.latest_step(), -1))
            step = None if found == 0 else found - 1
            if step is None:
                if self.initial_load_path is None:
                    return None
                target = state
                if self.initial_load_model_only:
                    if self.model_key not in state:
                        raise KeyError(f"initial_load_model_only: the state has no {self.model_key!r} key")
                    target = {self.model_key: state[self.model_key]}
                load(target, self.initial_load_path, process_group=self.process_group, **load_options)
                if target is not state:
                    state[self.model_key] = target[self.model_key]
                self.restored_from = "initial"
                return 0
        load_options.setdefault("storage", self.storage.options)

        load(state, self.storage.child(fmt.step_name(int(step))), process_group=self.process_group, **load_options)
        self.restored_from = "step"
        self.last_restore = {"source": "persistent", "step": int(step), "path": self.step_path(int(step))}
        return int(step)

    # ---- waiting, closing, preemption -----------------------------------------

    def wait(self) -> None:
        """Wait for async saves in flight and for retention and cleaning in the background;
        raises the first save's error."""
        if self._tiers is not None:
            self._tiers.wait()
        futures = list(self._futures)
        first = None
        for _, f in futures:
            e = f.exception()
            first = first or e
        self._collect()
        self._wait_background()
        if first is not None:
            raise first

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._tiers is not None:
                self._tiers.close()
            if self._background is not None:
                self._background.shutdown(wait=True)
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
        from ..distributed import group as zdist

        return not zdist.group(self.process_group).all_true(not self.preempted)

    def __repr__(self) -> str:
        return f"<zarrckpt.CheckpointManager {self.root!r}>"
