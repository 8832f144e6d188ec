"""xarray views of a checkpoint and of a whole run, dask-backed (needs xarray and dask).

>>> run = zarrckpt.open_run("ckpt/run1", keys=["model"])     # doctest: +SKIP
>>> run["model/layers.0.weight"].dims                          # doctest: +SKIP
('step', 'model/layers.0.weight.0', 'model/layers.0.weight.1')
>>> norms = run.map(lambda v: np.sqrt((v.astype("float32") ** 2).sum(
...     [d for d in v.dims if d != "step"]))).compute()        # doctest: +SKIP

Every array leaf (tensors, DTensors, NumPy arrays; packed or not) becomes one variable
named by its key, with dimensions ``<key>.0``, ``<key>.1`` ... (``dimension_names`` as
zarrckpt stores them are ``<last key segment>.<d>``, unique within one group, which is
what ``xarray.open_zarr(path, group=...)`` needs; a dataset of many groups needs the
whole key). In a run, a leading ``step`` dimension stacks the checkpoints in step order.
Each variable is a dask array whose chunks are the stored chunks, read through
TensorStore (CRC-32C checked, missing chunks are errors): a reduction over a run reads
each chunk of each checkpoint once. ``bytes`` leaves and values are left out.

Unchanged values are known without reading them: each run variable's attribute
``same_as_previous`` holds, per step, 1 where the array's recorded content hashes and
unit CRC-32Cs (checkpoints saved with ``content_hashes=True`` or incrementally, spec
§6.6.2) say it holds the values of the step before, 0 where they differ, -1 where the
roots cannot tell; the steps marked 1 reuse the step before's chunks in the dask graph,
so a reduction over a run reads a frozen array once, not once per step.

Coordinates: ``step``; ``path`` (each checkpoint's URL); ``metrics/<name>`` for every
metric the saves recorded as a number in every checkpoint
(``CheckpointManager.save(metrics=)``).

The module also registers the ``zarrckpt`` engine for ``xarray.open_dataset`` (entry
point ``xarray.backends``): ``xarray.open_dataset(path)`` with no ``engine`` picks it for a
checkpoint directory (or a run, with ``engine="zarrckpt"``), without ``import zarrckpt``.
xarray's own ``zarr`` engine (``open_zarr``, ``open_datatree(engine="zarr")``) reads bf16/fp8
checkpoints without any import too, in any order: the data types come from zarrckpt's
``zarr.data_type``/``zarr.buffer`` entry points, which zarr-python itself loads (see
:mod:`zarrckpt.interop.zarr_dtypes`), not from this engine.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..format import documents as fmt
from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, ShapeMismatchError
from ..readers.checkpoint import Checkpoint
from ..readers.previous import content_tables, same_content
from ..readers.dataset import selected_keys, to_dataset, variable_attrs, xarray_module
from ..storage import StorageOptions, open_storage

try:  # the backend class needs xarray; the functions say what to install when it is missing
    from xarray.backends import BackendEntrypoint as _BackendBase
except ImportError:  # pragma: no cover - exercised without xarray
    _BackendBase = object  # type: ignore[assignment,misc]

__all__ = ["ZarrckptBackendEntrypoint", "find_checkpoints", "open_run", "to_dataset"]



def find_checkpoints(paths_or_dir: Any, *, storage: StorageOptions | None = None) -> list[tuple[int, Checkpoint]]:
    """``[(step, Checkpoint)]`` in step order, for a list of checkpoint paths/URLs (or open
    Checkpoints), a CheckpointManager root (its ``step_<N>`` checkpoints; interrupted
    saves are skipped), or one checkpoint. A checkpoint's step is the one its save
    recorded (``Checkpoint.step``), else the ``N`` of a ``step_<N>`` directory name, else
    its position in the list."""
    if isinstance(paths_or_dir, (str, os.PathLike, Checkpoint)):
        found = _single_or_run(paths_or_dir, storage)
    elif isinstance(paths_or_dir, Sequence):
        found = [(p if isinstance(p, Checkpoint) else Checkpoint(p, storage), _dir_step(p))
                 for p in paths_or_dir]
    else:
        raise TypeError(f"open_run takes a path, a URL or a list of them, not {type(paths_or_dir).__name__}")
    out = []
    for i, (ck, dir_step) in enumerate(found):
        step = ck.step if ck.step is not None else dir_step if dir_step is not None else i
        out.append((step, ck))
    steps = [s for s, _ in out]
    dup = sorted({s for s in steps if steps.count(s) > 1})
    if dup:
        raise ValueError(f"several checkpoints have step {dup[0]}: "
                         + ", ".join(ck.url for s, ck in out if s == dup[0]))
    return sorted(out, key=lambda sc: sc[0])


def _dir_step(p: Any) -> int | None:
    name = (p.url if isinstance(p, Checkpoint) else os.fspath(p)).rstrip("/").rsplit("/", 1)[-1]
    return fmt.parse_step_name(name)


def _single_or_run(where: Any, storage: StorageOptions | None) -> list[tuple[Checkpoint, int | None]]:
    if isinstance(where, Checkpoint):
        return [(where, _dir_step(where))]
    try:
        return [(Checkpoint(where, storage), _dir_step(where))]
    except CheckpointNotFoundError:
        pass  # not a checkpoint itself: a directory of step_<N> checkpoints?
    root = os.fspath(where).rstrip("/")
    found = []
    for name in open_storage(root, storage).list_children():
        step = fmt.parse_step_name(name)
        if step is None:
            continue
        try:
            found.append((Checkpoint(f"{root}/{name}", storage), step))
        except (IncompleteCheckpointError, CheckpointNotFoundError):
            continue  # a save in flight or interrupted: not part of the run yet
    if not found:
        raise CheckpointNotFoundError(f"no checkpoints at {root!r}: neither a zarrckpt checkpoint nor a "
                                      "directory of committed step_<N> checkpoints (a CheckpointManager root)")
    return found


def open_run(paths_or_dir: Any, *, keys: Iterable[str] | None = None,
             storage: StorageOptions | None = None) -> Any:
    """An ``xarray.Dataset`` of a run: for every array leaf, a dask-backed variable with a
    leading ``step`` dimension over the run's checkpoints (see the module docstring).

    ``paths_or_dir``: a CheckpointManager root, a list of checkpoint paths/URLs, or one
    checkpoint. ``keys``: exact keys or prefixes to include (default: every array leaf).
    Without ``keys``, a leaf missing from some checkpoints, or whose shape or dtype changes
    between them, is left out with a warning; a key asked for by ``keys`` must be in
    every checkpoint with one shape and dtype."""
    xr = xarray_module("zarrckpt.open_run()")
    import dask.array as da

    run = find_checkpoints(paths_or_dir, storage=storage)
    steps = [s for s, _ in run]
    cks = [ck for _, ck in run]
    per_ck = [selected_keys(ck, keys) for ck in cks]
    order = list(dict.fromkeys(k for ks in per_ck for k in ks))
    present = [set(ks) for ks in per_ck]
    if keys is not None:
        for w in [keys] if isinstance(keys, str) else keys:
            for ck, ks in zip(cks, per_ck):
                if not any(k == w or k.startswith(w.rstrip("/") + "/") for k in ks):
                    raise KeyError(f"no array leaf {w!r} (nor under it) in checkpoint {ck.url!r}")
    skipped: list[str] = []
    variables = {}
    for k in order:
        if not all(k in p for p in present):
            if keys is not None:
                missing = [ck.url for ck, p in zip(cks, present) if k not in p]
                raise KeyError(f"array {k!r} is missing from {len(missing)} checkpoint(s) of the run: "
                               f"{', '.join(missing[:3])}")
            skipped.append(f"{k} (not in every checkpoint)")
            continue
        arrays = [ck.array(k) for ck in cks]
        first = arrays[0]
        odd = [a for a in arrays if a.shape != first.shape or a.dtype != first.dtype]
        if odd:
            msg = (f"array {k!r} is {first.data_type}{list(first.shape)} at step {steps[0]} but "
                   f"{odd[0].data_type}{list(odd[0].shape)} in {odd[0]._ck.url!r}")
            if keys is not None:
                raise ShapeMismatchError(msg)
            skipped.append(msg)
            continue
        same = _same_as_previous(cks, k)
        parts = [arrays[0].dask()]
        for a, s in zip(arrays[1:], same[1:]):
            parts.append(parts[-1] if s == 1 else a.dask())  # the same values: read once
        data = da.stack(parts)
        variables[k] = xr.Variable(("step", *(f"{k}.{d}" for d in range(first.ndim))), data,
                                   attrs={**variable_attrs(first.info, k), "same_as_previous": same})
    if skipped:
        warnings.warn(f"open_run left out {len(skipped)} array(s): " + "; ".join(skipped[:5])
                      + ("; ..." if len(skipped) > 5 else ""), stacklevel=2)
    coords: dict[str, Any] = {"step": ("step", np.asarray(steps, dtype=np.int64)),
                              "path": ("step", [ck.url for ck in cks])}
    for name in dict.fromkeys(n for ck in cks for n in ck.metrics):
        values = [ck.metrics.get(name) for ck in cks]
        coord = f"metrics/{name}"
        if coord not in variables and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            coords[coord] = ("step", np.asarray(values, dtype=np.float64))
    return xr.Dataset(variables, coords=coords)


def _same_as_previous(cks: Sequence[Checkpoint], key: str) -> list[int]:
    """Per checkpoint of a run, whether array ``key`` holds the values it held in the one
    before, known from the roots alone (no chunk read): 1 the same (both roots record the
    same content hashes and unit CRC-32Cs and the same chunk-deciding metadata: the two
    checks of an incremental save, spec §7.9), 0 different, -1 unknown (the first
    checkpoint, a root without content hashes, a packed leaf)."""
    out = [-1]
    for a, b in zip(cks, cks[1:]):
        if content_tables(a, key) is None or content_tables(b, key) is None:
            out.append(-1)
        else:
            out.append(1 if same_content(a, b, key) else 0)
    return out


def _is_checkpoint_dir(path: str) -> bool:
    try:
        with open(os.path.join(path, "zarr.json"), "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b'"zarrckpt"' in head


class ZarrckptBackendEntrypoint(_BackendBase):  # type: ignore[misc,valid-type]
    """``xarray.open_dataset(path, engine="zarrckpt", keys=None)``: a checkpoint as
    :func:`to_dataset` gives it, or a CheckpointManager root as :func:`open_run` does."""

    description = "zarrckpt checkpoints (one checkpoint, or a CheckpointManager run directory)"
    url = "https://github.com/zarrckpt/zarrckpt"
    open_dataset_parameters = ("filename_or_obj", "drop_variables", "keys")

    def open_dataset(self, filename_or_obj: Any, *, drop_variables: Any = None,
                     keys: Iterable[str] | None = None) -> Any:
        where = os.fspath(filename_or_obj)
        try:
            ds = to_dataset(Checkpoint(where), keys=keys)
        except CheckpointNotFoundError:
            ds = open_run(where, keys=keys)
        if drop_variables:
            ds = ds.drop_vars(drop_variables, errors="ignore")
        return ds

    def guess_can_open(self, filename_or_obj: Any) -> bool:
        try:
            path = os.fspath(filename_or_obj)
        except TypeError:
            return False
        return os.path.isdir(path) and _is_checkpoint_dir(path)
