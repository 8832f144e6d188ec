"""zarrckpt: distributed PyTorch checkpoints as plain Zarr v3.

The whole public API::

    save(state_dict, path, *, process_group=None, overwrite=False, **options)
    async_save(...same...) -> SaveFuture   # blocks only for device->host staging
    wait_for_saves(timeout=None)           # every async save of this process, done
    reserve_staging(state_dict | nbytes)   # allocate async staging memory up front
    release_staging()
    load(state_dict, path, *, process_group=None, strict=True, key_map=None, cast=False)
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
from .manager import CheckpointManager
from .reader import Checkpoint, CheckpointView, LazyArray
from .storage import StorageOptions
from .reader import open_checkpoint as open  # noqa: A001 - the public name is zarrckpt.open

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointChangedError",
    "CheckpointManager",
    "CheckpointExistsError",
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
    """Save ``state_dict`` to ``path``; every rank of ``process_group`` calls it (SPMD).

    Leaves may be tensors, DTensors, ``bytes``, NumPy arrays, JSON-able values, or
    Stateful objects (``state_dict()``/``load_state_dict()``), ``io.BytesIO``, and
    ShardedTensors with a ChunkShardingSpec. Returns this rank's report (bytes written,
    seconds per phase). ``metadata``: a JSON object stored in the root ``zarr.json``
    (rank 0's; the CheckpointManager records the step and metrics there).
    Options: see ``zarrckpt._save.SaveOptions``.

    On a local file system the new checkpoint is written next to ``path`` and moved
    into place when committed: an existing checkpoint there stays loadable until then.
    If any rank fails, every rank raises an error of the same class and the path is
    left as it was.
    """
    from ._save import SaveOptions, SaveRun, run_save

    return run_save(SaveRun(state_dict, path, process_group, overwrite, SaveOptions.from_kwargs(options),
                            metadata))


def async_save(state_dict: dict, path: Any, *, process_group: Any = None, overwrite: bool = False,
               metadata: dict | None = None, overlap: bool = False, **options: Any):
    """Like :func:`save`, but returns once the copies of the local shards to (pinned,
    reused) host buffers are issued; writing and the commit finish in a background
    thread. CUDA shards are copied on a side stream; the current stream waits for those
    copies (GPU-side), so the next steps queued on it cannot change the state too early,
    while the CPU goes on at once. ``overlap=True``: the current stream does not wait
    either (compute overlaps the copies); call ``fut.wait_staged(stream)`` before the
    optimizer changes the state. Returns a ``SaveFuture``: ``staged_seconds`` is the
    time the call blocked, ``result()`` waits for the commit and returns the report or
    raises. One save in flight at a time:
    a second call (from any thread) first waits until the previous save has committed.
    """
    from ._async import async_save as _async_save

    return _async_save(state_dict, path, process_group=process_group, overwrite=overwrite,
                       metadata=metadata, overlap=overlap, **options)


def load(state_dict: dict, path: Any, *, process_group: Any = None, strict: bool | str = True,
         key_map: Any = None, cast: bool = False, report: dict | None = None,
         max_staging_bytes: int = 1 << 30, max_inflight_bytes: int = 256 << 20,
         storage: StorageOptions | None = None) -> dict:
    """Load ``path`` in place into the tensors/DTensors of ``state_dict`` (any mesh,
    placements and world size), set non-tensor values, call ``load_state_dict`` on
    Stateful leaves, and return ``state_dict``.

    Every rank of ``process_group`` calls it (two small all-reduces); if it fails on
    one rank it fails on all, with an error of the same class naming the ranks.

    ``strict``: True (default): target keys missing from the checkpoint are an error,
    checkpoint keys the target lacks are reported (``report["unexpected"]``) — as in
    DCP, since pipeline and expert parallel ranks hold only their share; ``"exact"``:
    both are errors; False: neither.
    Targets on the meta device are replaced by real tensors in the returned dict.
    ``key_map``: dict or callable from target key to checkpoint key (renamed modules).
    ``cast``: convert saved dtypes to the target's (otherwise a mismatch is an error).
    ``report``: a dict to fill with bytes needed/fetched and seconds per phase.
    ``max_staging_bytes``: host buffer for device targets and casts (streamed through).
    ``max_inflight_bytes``: bytes of reads in flight (TensorStore buffers whole shards).
    ``storage``: ``StorageOptions`` (object-store endpoint, credentials, retries ...).
    """
    from ._load import load as _load

    return _load(state_dict, path, process_group=process_group, strict=strict,
                 key_map=key_map, cast=cast, report=report,
                 max_staging_bytes=max_staging_bytes, max_inflight_bytes=max_inflight_bytes,
                 storage=storage)


def wait_for_saves(timeout: float | None = None) -> list:
    """Wait until every ``async_save`` of this process has committed or failed; returns
    their ``SaveFuture``s. zarrckpt also waits (with a warning) before
    ``torch.distributed.destroy_process_group()`` and at interpreter exit."""
    from ._async import wait_for_saves as _wait

    return _wait(timeout)


def reserve_staging(state_dict_or_nbytes: dict | int) -> int:
    """Allocate async-save staging memory now (page-locking costs ~0.6 s per GiB), so the
    first ``async_save`` blocks no longer than later ones. Returns its size in bytes."""
    from .staging import reserve_staging as _reserve

    return _reserve(state_dict_or_nbytes)


def release_staging() -> None:
    """Free the async-save staging memory (after waiting for saves in flight)."""
    from .staging import release_staging as _release

    _release()


def load_state_dict(path: Any, keys: list[str] | None = None, *,
                    storage: StorageOptions | None = None, max_inflight_bytes: int = 256 << 20) -> dict:
    """One process, no preallocation: the nested state dict with plain CPU tensors
    (all of it, or only ``keys`` — exact keys or prefixes such as ``"model"``), every
    array read concurrently in pieces."""
    from ._load import load_state_dict as _lsd

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
