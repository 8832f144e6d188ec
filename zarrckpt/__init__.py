"""zarrckpt: distributed PyTorch checkpoints as plain Zarr v3.

The whole public API::

    save(state_dict, path, *, process_group=None, overwrite=False, **options)
    async_save(...same...) -> SaveFuture   # blocks only for device->host staging
    wait_for_saves(timeout=None)           # every async save of this process, done
    reserve_staging(state_dict | nbytes)   # allocate async staging memory up front
    release_staging()
    load(state_dict, path, *, process_group=None, strict=True, key_map=None, cast=False, report=None,
         progress=None)                    # progress=True: a tqdm bar; or a callable (also save's)
    load_state_dict(path, keys=None) -> dict of plain CPU tensors
    open(path) -> Checkpoint          # torch-free, lazy, read-only view (LazyArray leaves)
    open_run(paths_or_manager_dir) -> xarray.Dataset with a step dimension (dask-backed)
    zarrckpt.jax.load(path, target) / zarrckpt.jax.save(pytree, path)   # JAX in and out
    errors: ZarrckptError and its subclasses (zarrckpt.errors)

torch is imported only when a function that needs it is called, so
``import zarrckpt``, ``zarrckpt.open``, ``open_run`` and ``zarrckpt.jax`` work where torch
is not installed; the torch-only functions then raise ``MissingDependencyError``.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    CheckpointChangedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConcurrentSaveError,
    CorruptChunkError,
    DistributedError,
    DTypeMismatchError,
    FormatError,
    IncompleteCheckpointError,
    IntegrityError,
    LoadFailedError,
    ManagerClosedError,
    MissingKeysError,
    SaveFailedError,
    ShapeMismatchError,
    StateDictMismatchError,
    StorageError,
    UnexpectedKeysError,
    UnsupportedPlacementError,
    UnsupportedValueError,
    ZarrckptError,
)
from ._optional import MissingDependencyError
from ._version import __version__
from .api.manager import CheckpointManager
from .engine.commit import clean_leftovers
from .readers.checkpoint import Checkpoint, CheckpointView, LazyArray
from .readers.checkpoint import open_checkpoint as open  # noqa: A001 - the public name is zarrckpt.open
from .storage import StorageOptions

__all__ = [
    "Checkpoint",
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointView",
    "ConcurrentSaveError",
    "CorruptChunkError",
    "DTypeMismatchError",
    "DistributedError",
    "FormatError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "LazyArray",
    "LoadFailedError",
    "ManagerClosedError",
    "MissingDependencyError",
    "MissingKeysError",
    "SaveFailedError",
    "ShapeMismatchError",
    "StateDictMismatchError",
    "StorageError",
    "StorageOptions",
    "UnexpectedKeysError",
    "UnsupportedPlacementError",
    "UnsupportedValueError",
    "ZarrckptError",
    "__version__",
    "async_save",
    "clean_leftovers",
    "load",
    "load_state_dict",
    "open",
    "open_run",
    "release_staging",
    "reserve_staging",
    "save",
    "wait_for_saves",
]


def save(state_dict: dict, path: Any, *, process_group: Any = None, overwrite: bool = False,
         metadata: dict | None = None, **options: Any) -> dict:
    """Save ``state_dict`` to ``path`` (a directory, or an ``s3://`` / ``gs://`` URL).
    Every rank of ``process_group`` calls it with its own shards (SPMD); it also works
    in one process without a process group. Returns this rank's report (bytes written,
    seconds per phase).

    Leaves may be tensors, DTensors, ShardedTensors with a ``ChunkShardingSpec``,
    ``bytes``, ``io.BytesIO``, NumPy arrays, JSON-able values, and Stateful objects
    (anything with ``state_dict()`` and ``load_state_dict()``, such as a model or an
    optimizer). Leaves that cannot be stored (sparse, quantized, meta tensors, other
    objects) raise an error naming the key before anything is written.

    ``overwrite``: replace a checkpoint already at ``path`` (without it, that is an error).
    ``metadata``: a JSON object recorded in the checkpoint (``zarrckpt.open(path).metadata``;
    rank 0's is kept).

    Options (keywords):

    * ``compression``: None (default), ``"zstd"``, ``"gzip"`` or ``{"name": "zstd", "level": 3}``.
    * ``inner_chunk_bytes``: the smallest piece a later load on another layout reads
      (default 1 MiB).
    * ``pack_bytes``: deprecated (default 0: every leaf is its own Zarr array, visible to
      generic Zarr tools); > 0 packs small plain leaves into hidden byte arrays, as 1.1 did.
    * ``replica_split_bytes``: replicated tensors at least this big are written by
      several replicas, each a part (default 64 MiB; None: one writer).
    * ``chunk_target_bytes``: a chunk of a DTensor/ShardedTensor groups whole neighbouring
      shards up to about this many bytes (default 256 MiB; None: one chunk per shard); at
      1,024 ranks, small shards make one or a few objects per array instead of 1,024.
    * ``max_staging_bytes``: host memory for copying GPU tensors out (default 1 GiB).
    * ``max_inflight_bytes``: bytes being written at once (default 256 MiB).
    * ``storage``: a :class:`StorageOptions` (threads, fsync, object-store endpoint, retries).
    * ``progress``: a ``callable(phase, done_bytes, total_bytes)`` told this rank's progress:
      ``"write"`` (chunk bytes handed to storage, at most ``max_inflight_bytes`` ahead of
      those stored; first 0, then after each chunk, then once all are durable), then
      ``"commit"`` once (``done_bytes == total_bytes``). Called from the calling thread
      (``async_save``: from its background thread). ``True``: a tqdm progress bar on
      rank 0 (needs tqdm: ``pip install tqdm``). None (default): no per-chunk work.

    Every rank must pass the same ``path``, ``overwrite``, ``compression``,
    ``inner_chunk_bytes``, ``pack_bytes``, ``replica_split_bytes`` and ``chunk_target_bytes``: ranks that disagree
    are refused before anything is written.

    The checkpoint becomes visible only once complete. On a local file system it is
    written next to ``path`` and moved into place at the end, so a checkpoint already
    there stays loadable until then. If any rank fails, every rank raises an error of
    the same class naming the failing ranks, and ``path`` is left as it was.
    """
    from .api.save import save as _save

    return _save(state_dict, path, process_group=process_group, overwrite=overwrite, metadata=metadata,
                 **options)


def async_save(state_dict: dict, path: Any, *, process_group: Any = None, overwrite: bool = False,
               metadata: dict | None = None, overlap: bool = False, **options: Any):
    """Like :func:`save` (same arguments), but training goes on while it writes: the call
    returns once this rank's shards are being copied to host memory (a buffer reused by
    every later save), and writing finishes in a background thread.

    GPU shards are copied on a side stream; work queued afterwards on the current
    stream waits for those copies on the GPU, so the next optimizer step cannot change
    the state too early, while the Python code goes on at once. ``overlap=True``: the
    current stream does not wait either; call ``fut.wait_staged(stream)`` before the
    optimizer changes the state.

    Returns a ``SaveFuture``: ``staged_seconds`` (how long the call blocked), ``done()``,
    ``result()`` (waits, then returns the report or raises the save's error). One save
    is in flight per process: a second call (from any thread) first waits until the
    previous one has finished. Call :func:`wait_for_saves` before exiting.
    """
    from .api.async_save import async_save as _async_save

    return _async_save(state_dict, path, process_group=process_group, overwrite=overwrite,
                       metadata=metadata, overlap=overlap, **options)


def load(state_dict: dict, path: Any, *, process_group: Any = None, strict: bool | str = True,
         key_map: Any = None, cast: bool = False, report: dict | None = None,
         max_staging_bytes: int = 1 << 30, max_inflight_bytes: int = 256 << 20,
         storage: StorageOptions | None = None, shared_reads: bool | None = None,
         progress: Any = None) -> dict:
    """Load the checkpoint at ``path`` into ``state_dict`` in place and return ``state_dict``.

    Tensors, DTensors and ShardedTensors are filled in place, whatever mesh, placements
    and number of processes saved them (each rank reads only what its shards hold);
    other values are set in their containers; Stateful objects (a model, an optimizer)
    get ``load_state_dict`` with their loaded state, in key order, and stay in their
    slots. An empty dict or list of the target where the checkpoint has entries (the
    ``state`` of a never-stepped optimizer) is filled with plain CPU tensors and values
    as saved; for optimizers of FSDP2/TP models, whose state must be sharded, this is
    refused: load into ``get_state_dict(model, optim)`` from
    ``torch.distributed.checkpoint.state_dict`` and apply it with ``set_state_dict``.
    Targets on the meta device are replaced by real tensors in the returned dict.

    Every rank of ``process_group`` calls it. Every target is checked against the
    checkpoint on every rank before any is written; if the load fails on one rank it
    fails on all, with an error of the same class naming the ranks. A checkpoint
    replaced (overwritten) while it is read raises ``CheckpointChangedError``.

    ``strict``: True (default): keys of the target missing from the checkpoint are an
    error; keys of the checkpoint the target lacks are normal, as in DCP (pipeline and
    expert parallel ranks hold only their share; a model loaded without its optimizer):
    listed in ``report["unexpected"]`` and in one INFO record of the ``zarrckpt`` logger,
    no warning. ``"exact"``: both are errors. False: neither; one ``UserWarning`` names the
    stored keys left unloaded and the target's keys left as they were. The log record and
    the warning are said once per job, by rank 0 about its own target (each rank's
    ``report`` lists its own keys). A target object that is neither a container nor
    Stateful where the checkpoint holds a subtree is an error in every mode.
    ``key_map``: a dict or function from target key to checkpoint key (renamed modules).
    ``cast``: convert saved dtypes to the target's (without it a mismatch is an error).
    ``report``: a dict to fill with bytes needed and read, seconds per phase, and the
    missing and unexpected keys.
    ``max_staging_bytes``: host memory for loading into GPU targets and for casts.
    ``max_inflight_bytes``: bytes being read at once.
    ``storage``: a :class:`StorageOptions` (object-store endpoint, credentials, retries ...).
    ``shared_reads``: pieces of at most 4 MiB are read through one owner rank per chunk
    object, which fetches the object once (one GET) and sends each rank its part over the
    process group, instead of every rank reading its part with its own requests (default
    None: on object stores, with more than one rank; True/False: always/never).
    ``progress``: a ``callable(phase, done_bytes, total_bytes)`` told this rank's progress,
    from the calling thread: ``"read"`` (bytes of stored data read into its targets by this
    rank, at most ``max_inflight_bytes`` ahead of the reads done; first 0, then as reads
    are issued, then once all are done), then ``"apply"`` once (``done_bytes ==
    total_bytes``). ``True``: a tqdm progress bar on rank 0 (needs tqdm: ``pip install
    tqdm``). None (default): no per-read work.
    """
    from .api.load import load as _load

    return _load(state_dict, path, process_group=process_group, strict=strict,
                 key_map=key_map, cast=cast, report=report,
                 max_staging_bytes=max_staging_bytes, max_inflight_bytes=max_inflight_bytes,
                 storage=storage, shared_reads=shared_reads, progress=progress)


def wait_for_saves(timeout: float | None = None) -> list:
    """Wait until every ``async_save`` of this process has committed or failed; returns
    their ``SaveFuture``s. zarrckpt also waits (with a warning) before
    ``torch.distributed.destroy_process_group()`` and at interpreter exit."""
    from .api.async_save import wait_for_saves as _wait

    return _wait(timeout)


def reserve_staging(state_dict_or_nbytes: dict | int) -> int:
    """Allocate async-save staging memory now (page-locking costs ~0.6 s per GiB), so the
    first ``async_save`` blocks no longer than later ones. Returns its size in bytes."""
    from .api.async_save import reserve_staging as _reserve

    return _reserve(state_dict_or_nbytes)


def release_staging() -> None:
    """Free the staging memory: the async-save buffer (after waiting for saves in flight),
    the buffer loads and sync saves of device tensors stream through, and the read buffers
    the direct file reader keeps between loads (up to 256 MiB)."""
    from .api.async_save import release_staging as _release

    _release()


def load_state_dict(path: Any, keys: list[str] | str | None = None, *,
                    storage: StorageOptions | None = None, max_inflight_bytes: int = 256 << 20) -> dict:
    """The checkpoint at ``path`` as a nested dict of plain CPU tensors (of the saved
    dtypes) and values, in one process, without preparing targets. ``keys``: only these
    exact keys or prefixes (``"model"`` or ``"model/"`` for everything under ``model``;
    one key may be given as a string);
    a key that is neither raises ``MissingKeysError`` naming the nearest keys.
    Arrays are read concurrently (``max_inflight_bytes`` at once). A checkpoint replaced
    while it is read raises ``CheckpointChangedError``."""
    from .api.load import load_state_dict as _lsd

    return _lsd(path, keys, storage=storage, max_inflight_bytes=max_inflight_bytes)


def _register_zarr_dtypes() -> None:
    # zarr-python 3.1 collects but does not load `zarr.data_type` entry points,
    # so register bf16/fp8 as soon as zarrckpt is imported (cheap; no torch).
    try:
        from .interop.zarr_dtypes import register
    except ImportError:  # pragma: no cover - zarr not installed
        return
    register()


_register_zarr_dtypes()


def open_run(paths_or_dir: Any, *, keys: Any = None, storage: StorageOptions | None = None) -> Any:
    """A run's checkpoints as one ``xarray.Dataset``: per array leaf, a dask-backed variable
    with a leading ``step`` dimension (needs xarray and dask, not torch).
    ``paths_or_dir``: a CheckpointManager root, a list of checkpoint paths/URLs, or one
    checkpoint; ``keys``: exact keys or prefixes. See :func:`zarrckpt.interop.xarray.open_run`."""
    from ._optional import require

    require("xarray", "zarrckpt.open_run()")
    from .interop.xarray import open_run as _open_run

    return _open_run(paths_or_dir, keys=keys, storage=storage)


def __getattr__(name: str) -> Any:
    # `zarrckpt.jax` without `import zarrckpt.jax` (jax itself is imported only then)
    if name == "jax":
        import importlib

        return importlib.import_module(".jax", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_only() -> None:
    # Without torch these raise MissingDependencyError naming the call and the extra to
    # install, instead of a ModuleNotFoundError from inside zarrckpt.
    from ._optional import needs_torch

    for name in ("save", "async_save", "load", "load_state_dict", "wait_for_saves",
                 "reserve_staging", "release_staging"):
        globals()[name] = needs_torch(globals()[name])


_torch_only()
