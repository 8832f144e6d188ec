"""One checkpoint (or the part under a view) as an ``xarray.Dataset`` of dask arrays
(needs xarray and dask): ``CheckpointView.to_xarray()``. Runs of checkpoints, and the
``xarray.open_dataset`` engine, are :mod:`zarrckpt.interop.xarray`'s."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._optional import require
from ..format import documents as fmt
from .lazy import placement_str

if TYPE_CHECKING:
    from .checkpoint import Checkpoint, CheckpointView

__all__ = ["dataset_attrs", "selected_keys", "to_dataset", "variable_attrs", "xarray_module"]


def xarray_module(what: str) -> Any:
    require("dask.array", what)
    return require("xarray", what)


def selected_keys(view: CheckpointView, keys: Iterable[str] | None) -> list[str]:
    """Array keys (relative to ``view``) of tensor-like leaves under ``keys`` (exact keys or
    prefixes; all when None)."""
    out = []
    wanted = None if keys is None else [k.rstrip("/") for k in ([keys] if isinstance(keys, str) else keys)]
    for k in view.array_keys():
        if wanted is not None and not any(k == w or k.startswith(w + "/") for w in wanted):
            continue
        out.append(k)
    infos = view.array_infos(out)
    return [k for k in out if infos[k].kind not in fmt.BYTE_KINDS]


def variable_attrs(info: fmt.ArrayInfo, key: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {"zarrckpt_key": key, "kind": info.kind, "data_type": info.dtype.zarr,
                             "chunks": list(info.chunk_shape)}
    if info.placements is not None:
        attrs["mesh_shape"] = list(info.mesh_shape or ())
        attrs["placements"] = [placement_str(p) for p in info.placements]
    return attrs


def to_dataset(view: CheckpointView, *, keys: Iterable[str] | None = None) -> Any:
    """One checkpoint (or the part under a view) as an ``xarray.Dataset`` of dask arrays,
    one variable per array leaf under ``keys`` (exact keys or prefixes; default all)."""
    xr = xarray_module("to_dataset()")
    variables = {}
    for k in selected_keys(view, keys):
        a = view.array(k)
        variables[k] = xr.Variable(tuple(f"{k}.{d}" for d in range(a.ndim)), a.dask(),
                                   attrs=variable_attrs(a.info, view._full(k)))
    ds = xr.Dataset(variables)
    ds.attrs.update(dataset_attrs(view.checkpoint))
    return ds


def dataset_attrs(ck: Checkpoint) -> dict[str, Any]:
    attrs: dict[str, Any] = {"zarrckpt_url": ck.url, "save_id": ck.save_id, "created": ck.created}
    if ck.step is not None:
        attrs["step"] = ck.step
    return attrs
