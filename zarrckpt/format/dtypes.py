"""torch dtype <-> Zarr v3 ``data_type`` <-> NumPy dtype.

torch is never imported at module level: the torch-free reader needs only the
Zarr/NumPy half of the table. bfloat16 and float8 types have no NumPy builtin;
ml_dtypes supplies them, and torch tensors of those types are moved through
NumPy as same-width integer views (zero-copy both ways).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from ..errors import UnsupportedValueError

if TYPE_CHECKING:
    import torch

__all__ = ["DType", "ZARR_NAMES", "as_strided", "by_numpy", "by_torch", "by_zarr", "fill_value", "from_numpy",
           "to_numpy", "torch_dtype"]


@dataclass(frozen=True)
class DType:
    """One row of the table. ``zarr`` is also the name recorded as ``torch_dtype``."""

    zarr: str  # Zarr v3 data_type as TensorStore writes it
    numpy: np.dtype
    torch: str  # attribute of the torch module
    view_as: str | None  # torch int dtype to view through when NumPy lacks the type


_ROWS = [
    DType("bool", np.dtype(np.bool_), "bool", None),
    DType("int8", np.dtype(np.int8), "int8", None),
    DType("int16", np.dtype(np.int16), "int16", None),
    DType("int32", np.dtype(np.int32), "int32", None),
    DType("int64", np.dtype(np.int64), "int64", None),
    DType("uint8", np.dtype(np.uint8), "uint8", None),
    DType("uint16", np.dtype(np.uint16), "uint16", None),
    DType("uint32", np.dtype(np.uint32), "uint32", None),
    DType("uint64", np.dtype(np.uint64), "uint64", None),
    DType("float16", np.dtype(np.float16), "float16", None),
    DType("float32", np.dtype(np.float32), "float32", None),
    DType("float64", np.dtype(np.float64), "float64", None),
    DType("complex64", np.dtype(np.complex64), "complex64", None),
    DType("complex128", np.dtype(np.complex128), "complex128", None),
    DType("bfloat16", np.dtype(ml_dtypes.bfloat16), "bfloat16", "int16"),
    DType("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn", "uint8"),
    DType("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2", "uint8"),
    DType("float8_e4m3fnuz", np.dtype(ml_dtypes.float8_e4m3fnuz), "float8_e4m3fnuz", "uint8"),
    DType("float8_e5m2fnuz", np.dtype(ml_dtypes.float8_e5m2fnuz), "float8_e5m2fnuz", "uint8"),
    DType("float8_e8m0fnu", np.dtype(ml_dtypes.float8_e8m0fnu), "float8_e8m0fnu", "uint8"),
]
_BY_ZARR = {r.zarr: r for r in _ROWS}
ZARR_NAMES = tuple(_BY_ZARR)


def by_zarr(name: str) -> DType:
    try:
        return _BY_ZARR[name]
    except KeyError:
        raise UnsupportedValueError(
            f"data type {name!r} is not one zarrckpt reads; supported: {', '.join(ZARR_NAMES)}"
        ) from None


def by_torch(dtype: torch.dtype) -> DType:
    name = str(dtype).removeprefix("torch.")
    row = _BY_ZARR.get(name)
    if row is None:
        raise UnsupportedValueError(
            f"torch dtype {dtype} has no Zarr v3 data type in zarrckpt; supported: "
            f"{', '.join(r.torch for r in _ROWS)}"
        )
    return row


def by_numpy(dtype: np.dtype) -> DType:
    dtype = np.dtype(dtype)
    for r in _ROWS:
        if r.numpy == dtype:
            return r
    raise UnsupportedValueError(
        f"NumPy dtype {dtype} has no Zarr v3 data type in zarrckpt; supported: {', '.join(ZARR_NAMES)}"
    )


def torch_dtype(row: DType) -> torch.dtype:
    import torch

    try:
        return getattr(torch, row.torch)
    except AttributeError:
        raise UnsupportedValueError(
            f"this torch ({torch.__version__}) has no dtype torch.{row.torch}"
        ) from None


def fill_value(row: DType) -> Any:
    """The JSON fill value written for every array (never relied on: chunks are always stored)."""
    if row.zarr == "bool":
        return False
    if row.zarr.startswith("complex"):
        return [0.0, 0.0]
    if row.zarr == "float8_e8m0fnu":  # has no zero; NaN is the one value every reader agrees on
        return "NaN"
    return 0


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view sharing memory with CPU tensor ``t`` (no copy)."""
    import torch

    row = by_torch(t.dtype)
    if row.view_as is None:
        return t.numpy()
    return t.view(getattr(torch, row.view_as)).numpy().view(row.numpy)


def from_numpy(a: np.ndarray, row: DType) -> torch.Tensor:
    """A CPU tensor sharing memory with ``a`` (no copy), of the row's torch dtype."""
    import torch

    if row.view_as is None:
        return torch.from_numpy(a)
    int_np = np.dtype(getattr(np, row.view_as))
    return torch.from_numpy(a.view(int_np)).view(torch_dtype(row))


def as_strided(a: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """``np.lib.stride_tricks.as_strided`` for every dtype of the table (a writable view of
    ``a``'s memory). NumPy builds that view from ``__array_interface__``, whose type string
    it cannot parse back for some ml_dtypes types (float8_e5m2 says ``'<f1'``: ``TypeError:
    data type '<f1' not understood``), so the view is made over same-width raw items and
    given ``a``'s dtype back."""
    raw = a.view(np.dtype((np.void, a.dtype.itemsize)))
    return np.lib.stride_tricks.as_strided(raw, shape, strides).view(a.dtype)
