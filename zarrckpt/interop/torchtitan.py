"""zarrckpt as torchtitan's checkpointer backend (torchtitan >= 0.3.0).

``ZarrckptCheckpointManager`` implements torchtitan's ``BaseCheckpointManager`` contract
(``torchtitan/components/checkpointer/base.py``) with ``zarrckpt.save`` /
``zarrckpt.async_save`` / ``zarrckpt.load``, following the DCP backend
(``checkpointer/dcp.py``, ``CheckpointManager``) option for option: the same step
directories (``<dump_folder>/<checkpoint.folder>/step-N``), the same flattened state
(model FQNs at the top level beside ``optimizer``, ``lr_scheduler``, ``dataloader``,
``train_state``), the same interval / first-step / last-step / ``keep_latest_k`` /
``load_step`` / ``exclude_from_loading`` / ``initial_load_*`` / ``load_only`` rules, and
the futures the trainer waits on (``save_future``, ``staging_future``).

Selecting it
------------
torchtitan builds the checkpointer from the job config's ``checkpoint`` section:
``Trainer.Config.checkpoint`` is typed ``BaseCheckpointManager.Config`` and the trainer
calls ``config.checkpoint.build(dataloader=..., model_parts=..., optimizers=...,
lr_schedulers=..., states={"train_state": trainer}, sd_adapter=..., base_folder=...)``;
``Configurable.Config.build`` constructs the class that declares the Config. So the
backend is chosen by the *type* of that section. Two ways:

1. In a config registry function (``--module my_configs --config my_job``)::

       from torchtitan.models.llama3.config_registry import llama3_debugmodel
       from zarrckpt.torchtitan import ZarrckptCheckpointManager

       def my_job():
           config = llama3_debugmodel()
           config.checkpoint = ZarrckptCheckpointManager.Config(
               enable=True, folder="checkpoint", interval=10, keep_latest_k=3,
               async_mode="async",            # "disabled" | "async" | "async_with_pinned_mem"
               last_save_model_only=True, export_dtype="bfloat16",
           )
           return config

2. Without writing a config: torchtitan's override mechanism swaps the DCP section of
   any registered config for this one, keeping every field set in the config or on
   the command line (``--checkpoint.interval 10`` etc. still apply)::

       torchrun ... -m torchtitan.train --module llama3 --config llama3_debugmodel \\
           --checkpoint.enable --checkpoint.interval 10 \\
           --override.imports zarrckpt.interop.torchtitan.use_zarrckpt

   (the target is the module where the ``@override`` factory is defined,
   ``zarrckpt.interop.torchtitan``; extra keywords, e.g. compression:
   ``'zarrckpt.interop.torchtitan.use_zarrckpt={"compression": "zstd"}'``).

What differs from the DCP backend
---------------------------------
* A step directory counts only once it is a committed zarrckpt checkpoint
  (``zarrckpt.open`` succeeds). Names must be exactly ``step-N``: zarrckpt writes a
  save into a hidden dot-directory next to it and moves it into place at the commit,
  and a killed save leaves at most a ``pending`` claim, so it never looks like a checkpoint.
* ``keep_latest_k`` counts the committed steps and the save in flight, as DCP counts
  its directories, but deletes only committed steps, never the one being written,
  in a background thread of rank 0; a step is first renamed to a hidden name (atomic)
  and then deleted, so a crash never leaves a partly deleted ``step-N``. Leftovers of
  dead zarrckpt saves are removed there too (``zarrckpt.clean_leftovers``).
* Each checkpoint records ``{"step": N, "torchtitan": {"model_only": ..., "dtype": ...}}``
  as its metadata. A model-only checkpoint (the last-step export, a seed checkpoint)
  found as the latest step is loaded model-only, with ``cast=True`` (a ``bfloat16``
  export into an ``float32`` model); model-only loads always cast, full resumes do
  not (a dtype change there is an error).
* ``async_with_pinned_mem``: the staging buffer is reserved once
  (``zarrckpt.reserve_staging``) and the save runs with ``overlap=True``;
  ``maybe_wait_for_staging`` (called by the trainer before ``optimizers.step()``) waits
  for the device->host copies (on CUDA: makes the current stream wait).
  ``async``: the call returns once the state is copied to host memory.
* A state whose value is ``None`` (no dataloader) is left out (DCP pickles it).
* The dataloader's state, ``{"dp_rank_<r>": bytes, "world_size": n}`` on each rank, is
  gathered (one ``all_gather_object`` per save and load) so that every rank holds the
  same keys: the stored keys are DCP's, and zarrckpt's async saves keep reusing their
  plans and staging (zarrckpt 1.2's reuse fails when ranks hold different keys; for
  ranks whose model keys differ, pipeline stages, the staging buffer is released before
  each async save so that it plans afresh).
* Not supported (refused in the Config): ``initial_load_in_hf``, ``last_save_in_hf``
  (HF safetensors go through DCP's HF reader/writer; use the DCP backend for them).

An initial load may come from a DCP checkpoint torchtitan wrote: convert it first with
``zarrckpt.convert.from_dcp(dcp_step_dir, zarr_dir)`` (or ``python -m zarrckpt convert``)
and set ``initial_load_path`` to the result (its keys are DCP's, which are these).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from ..api.async_save import async_save, release_staging, reserve_staging
from ..api.load import load
from ..api.save import save
from ..engine.commit import clean_leftovers
from ..errors import ZarrckptError
from ..readers.checkpoint import open_checkpoint

__all__ = ["ZarrckptCheckpointManager", "use_zarrckpt"]

_STEP = re.compile(r"step-(\d+)")
_PURGING = ".purging-"  # hidden name a purged step is moved to before it is deleted
_log = logging.getLogger("zarrckpt")


def _as_future(fut: Any) -> cf.Future:
    """``fut`` as a ``concurrent.futures.Future`` (zarrckpt's SaveFuture is one; wrapped
    otherwise, resolving with its ``result()``)."""
    if isinstance(fut, cf.Future):
        return fut
    out: cf.Future = cf.Future()

    def settle(f: Any = fut) -> None:
        try:
            out.set_result(f.result())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            out.set_exception(e)

    if hasattr(fut, "add_done_callback"):
        fut.add_done_callback(lambda f: settle(f))
    else:
        threading.Thread(target=settle, daemon=True, name="zarrckpt-future").start()
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _ranks_differ(keys: list[str]) -> bool:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    return any(k != every[0] for k in every)


def is_committed(path: str) -> bool:
    """Whether ``path`` holds a committed zarrckpt checkpoint."""
    try:
        open_checkpoint(path)
    except ZarrckptError:
        return False
    return True


def _metadata(path: str) -> dict:
    return open_checkpoint(path).metadata


class _AllRanksState:
    """A Stateful whose state differs per rank under per-rank keys (torchtitan's dataloader:
    ``{"dp_rank_<r>": bytes, "world_size": n}``), seen with every rank's entries on every
    rank (one ``all_gather_object``; each rank loads its own key). The stored keys are
    those DCP stores; every rank holding the same keys keeps zarrckpt's async saves on
    their fast path (see ``ZarrckptCheckpointManager._async_save``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> dict:
        local = self.inner.state_dict()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, local)
        merged: dict = {}
        for sd in every:
            merged.update(sd or {})
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)


def _purge_worker(requests: queue.Queue, manager: ZarrckptCheckpointManager) -> None:
    while True:
        req = requests.get()
        if req is None:
            requests.task_done()
            return
        try:
            manager._purge_now()
        except Exception as e:  # noqa: BLE001 - a failed purge must not stop later ones
            logger.warning("Checkpointer (zarrckpt) failed to purge %s: %s", manager.folder, e)
        finally:
            requests.task_done()


class ZarrckptCheckpointManager(BaseCheckpointManager):
    """torchtitan checkpointer backed by zarrckpt; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Synchronous, async (blocks until the state is copied to host memory), or async
        with a reserved (pinned) staging buffer and copies overlapping the next step."""

        compression: str | None = None
        """zarrckpt compression of every array: None, "zstd" or "gzip"."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {mode}")
            self.async_mode = mode
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise ValueError("the zarrckpt checkpointer does not read or write HF safetensors "
                                 "(initial_load_in_hf / last_save_in_hf); use the DCP checkpointer")
            if self.compression not in (None, "zstd", "gzip"):
                raise ValueError(f"compression must be None, 'zstd' or 'gzip', not {self.compression!r}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: cf.Future | None = None
        self.staging_future: Any = None  # the SaveFuture of a pinned-memory save
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        self.async_mode = config.async_mode
        self.save_options: dict[str, Any] = {}
        if config.compression:
            self.save_options["compression"] = config.compression
        self._reserved = False
        self._keys_differ: bool | None = None  # do ranks hold different model keys (pipeline stages)?
        self._inflight: set[int] = set()  # steps whose async save has not ended
        self._lock = threading.Lock()
        self.keep_latest_k = config.keep_latest_k
        self.purge_thread: threading.Thread | None = None
        if self.keep_latest_k > 0 and _rank() == 0:
            self.purge_queue: queue.Queue = queue.Queue()
            self.purge_thread = threading.Thread(target=_purge_worker, args=(self.purge_queue, self),
                                                 daemon=True, name="zarrckpt-torchtitan-purge")
            self.purge_thread.start()
        logger.info("Checkpointing (zarrckpt) active. Checkpoints will be loaded from and saved to %s",
                    self.folder)

    def __del__(self) -> None:
        self.close()

    # ---- paths and steps ----------------------------------------------------------

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return filesystem.join(folder or self.folder, f"step-{step}")

    def _step_dirs(self, folder: str = "") -> dict[int, str]:
        """step -> path of every directory named exactly ``step-N`` (committed or not)."""
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return {}
        out = {}
        for name in filesystem.listdir(folder):
            m = _STEP.fullmatch(name)
            if m:
                out[int(m.group(1))] = filesystem.join(folder, name)
        return out

    def _find_load_step(self, folder: str = "") -> int:
        """The highest step whose directory is a committed zarrckpt checkpoint, or -1."""
        for step, path in sorted(self._step_dirs(folder).items(), reverse=True):
            if is_committed(path):
                return step
            logger.info("Checkpointer (zarrckpt): %s is not a committed zarrckpt checkpoint; skipped", path)
        return -1

    # ---- states -----------------------------------------------------------------------

    def _flattened_model_states_sd(self, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
        states = state_dict if state_dict is not None else self.states
        sd = {k: (_AllRanksState(v) if k == DATALOADER else v)
              for k, v in states.items() if k != MODEL and v is not None}
        if MODEL in states:
            sd.update(states[MODEL].state_dict())
        return sd

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return self.states[MODEL].state_dict()
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        return self._flattened_model_states_sd(
            {k: v for k, v in self.states.items() if k not in self.exclude_from_loading})

    # ---- save -------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self.enable or self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        if last_step:
            return True
        return curr_step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        self._maybe_wait_for_staging()
        begin = time.monotonic()
        if last_step:
            self._save_last_step(curr_step)
            logger.info("Last step checkpoint completed in %.2fs", time.monotonic() - begin)
            return True
        path = self._create_checkpoint_id(curr_step)
        states = self._flattened_model_states_sd()
        meta = {"step": int(curr_step), "torchtitan": {"model_only": False}}
        if self.async_mode == "disabled":
            save(states, path, overwrite=True, metadata=meta, **self.save_options)
        else:
            pinned = self.async_mode == "async_with_pinned_mem"
            if self._keys_differ is None:
                self._keys_differ = _ranks_differ(sorted(self.states[MODEL].cached_state_dict))
            if self._keys_differ:
                # zarrckpt 1.2's async save reusing the previous save's plans fails when ranks
                # hold different keys; releasing the staging buffer makes it plan afresh
                release_staging()
                self._reserved = False
            if pinned and not self._reserved:
                reserve_staging(states)
                self._reserved = True
            with self._lock:
                self._inflight.add(curr_step)
            try:
                fut = async_save(states, path, overwrite=True, metadata=meta, overlap=pinned,
                                          **self.save_options)
            except BaseException:
                with self._lock:
                    self._inflight.discard(curr_step)
                raise
            self.save_future = _as_future(fut)
            self.save_future.add_done_callback(lambda _f, s=curr_step: self._save_ended(s))
            if pinned:
                self.staging_future = fut
        self._purge_stale_checkpoints()
        logger.info("Finished %s the checkpoint in %.2f seconds.",
                    "saving" if self.async_mode == "disabled" else "staging", time.monotonic() - begin)
        return True

    def _save_ended(self, step: int) -> None:
        with self._lock:
            self._inflight.discard(step)

    def _save_last_step(self, curr_step: int) -> None:
        if self.last_save_model_only:
            states = {k: v.to(self.export_dtype)
                      if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
                      else v
                      for k, v in self.states[MODEL].state_dict().items()}
            meta = {"step": int(curr_step),
                    "torchtitan": {"model_only": True, "dtype": str(self.export_dtype).removeprefix("torch.")}}
            logger.info("Saving a model only checkpoint in %s at last step, step %d.", self.export_dtype, curr_step)
        else:
            states = self._flattened_model_states_sd()
            meta = {"step": int(curr_step), "torchtitan": {"model_only": False}}
            logger.info("Saving a full checkpoint at last step, step %d.", curr_step)
        save(states, self._create_checkpoint_id(curr_step), overwrite=True, metadata=meta,
                      **self.save_options)

    # ---- purge ------------------------------------------------------------------------

    def _should_purge(self) -> bool:
        return self.keep_latest_k > 0 and self.purge_thread is not None

    def _purge_stale_checkpoints(self) -> None:
        """Ask rank 0's purge thread to apply ``keep_latest_k`` (it scans and deletes in
        the background)."""
        if self._should_purge():
            self.purge_queue.put("purge")

    def _purge_now(self) -> list[int]:
        """Keep the newest ``keep_latest_k`` of the committed steps and the steps being
        saved; delete the other committed steps. Returns the steps deleted."""
        if not filesystem.isdir(self.folder):
            return []
        with self._lock:
            inflight = set(self._inflight)
        dirs = self._step_dirs()
        committed = {s for s, p in dirs.items() if s not in inflight and is_committed(p)}
        ranked = sorted(committed | inflight)
        keep = set(ranked[-self.keep_latest_k:])
        deleted = []
        for step in sorted(committed - keep):
            with self._lock:
                if step in self._inflight:  # a save of this step began since the scan
                    continue
            self._delete(dirs[step])
            deleted.append(step)
        self._remove_leftovers()
        return deleted

    def _delete(self, path: str) -> None:
        logger.info("Checkpointer (zarrckpt) is deleting %s.", path)
        begin = time.monotonic()
        if filesystem.is_remote(path):
            filesystem.rmtree(path)
        else:
            parent, name = os.path.split(path.rstrip("/"))
            aside = os.path.join(parent, f".{name}{_PURGING}{uuid.uuid4().hex}")
            os.rename(path, aside)  # gone from step-N in one step; then deleted at leisure
            shutil.rmtree(aside, ignore_errors=True)
        logger.info("Checkpointer (zarrckpt) deleted %s in %.2f seconds.", path, time.monotonic() - begin)

    def _remove_leftovers(self) -> None:
        if filesystem.is_remote(self.folder):
            return
        for name in os.listdir(self.folder):
            if name.startswith(".step-") and _PURGING in name:  # a purge that was killed
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        try:
            clean_leftovers(self.folder)  # dead saves' hidden directories and claims
        except Exception as e:  # noqa: BLE001 - best effort
            _log.warning("zarrckpt: could not remove leftovers under %s: %s", self.folder, e)

    def wait_for_purge(self) -> None:
        """Wait until every purge asked for so far has run (rank 0; no-op elsewhere)."""
        if self._should_purge():
            self.purge_queue.join()

    # ---- load -------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        has_folder = filesystem.exists(self.folder)
        load_step = -1
        if has_folder:
            load_step = self._find_load_step() if step == -1 else step
        if step != -1 and not has_folder:
            raise FileNotFoundError(f"--checkpoint.load_step={step} not found because "
                                    f"checkpoint.folder {self.folder} does not exist")
        if load_step == -1:
            if not self.initial_load_path:
                logger.info("No checkpoint was provided, this is a fresh start.")
                return False
            path = self.initial_load_path
            if not is_committed(path):
                raise ValueError(f"Checkpoint.initial_load_path is invalid: {path} is not a committed "
                                 "zarrckpt checkpoint (convert a DCP one with zarrckpt.convert.from_dcp)")
            model_only = self.initial_load_model_only
        else:
            path = self._create_checkpoint_id(load_step)
            if not is_committed(path):
                raise FileNotFoundError(f"--checkpoint.load_step={load_step} not found at {path} "
                                        "(no committed zarrckpt checkpoint there)")
            model_only = load_step == 0
        if (_metadata(path).get("torchtitan") or {}).get("model_only") and not model_only:
            logger.warning("Checkpointer (zarrckpt): %s holds only the model; loading only the model", path)
            model_only = True
        logger.info("Loading the checkpoint from %s.", path)
        begin = time.monotonic()
        states = self._states_to_load(model_only)
        load(states, path, cast=model_only)
        self.states[MODEL].load_state_dict({k: v for k, v in states.items()
                                            if k in self.states[MODEL].cached_state_dict})
        logger.info("Finished loading the checkpoint in %.2f seconds.", time.monotonic() - begin)
        return True

    # ---- waiting and closing ------------------------------------------------------------

    def _maybe_wait_for_staging(self) -> None:
        fut, self.staging_future = self.staging_future, None
        if fut is None:
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            fut.wait_staged(torch.cuda.current_stream())  # the next kernels wait, not the CPU
        else:
            fut.wait_staged()

    def _wait_for_saving(self) -> None:
        fut, self.save_future = self.save_future, None
        if fut is not None:
            fut.result()

    def _close(self) -> None:
        if getattr(self, "save_future", None) is not None:
            try:
                self._wait_for_saving()
            except Exception as e:  # noqa: BLE001 - closing: report, do not raise
                logger.error("Checkpointer (zarrckpt): the last async save failed: %s", e)
        if getattr(self, "purge_thread", None) is not None and self.purge_thread.is_alive():
            self.purge_queue.put(None)
            self.purge_thread.join()


def use_zarrckpt(cfg: Any, **fields: Any) -> ZarrckptCheckpointManager.Config:
    """A torchtitan checkpoint Config (the DCP one) as this backend's, every shared field
    copied; ``fields`` set the others (``compression=...``). Registered as the torchtitan
    override ``zarrckpt.interop.torchtitan.use_zarrckpt`` (``--override.imports``)."""
    from torchtitan.config.override import derive

    return derive(cfg, ZarrckptCheckpointManager.Config, **fields)


try:
    from torchtitan.components.checkpointer.dcp import CheckpointManager as _DCPCheckpointManager
    from torchtitan.config.override import override as _override
except ImportError:  # pragma: no cover - a torchtitan without overrides: set the Config instead
    pass
else:
    use_zarrckpt = _override(target=_DCPCheckpointManager.Config,
                             description="zarrckpt checkpointer backend")(use_zarrckpt)
