"""zarr-python data types for the bfloat16 / float8 arrays that TensorStore writes.

bfloat16 and the float8 formats are not core Zarr v3 data types, so zarr-python cannot open
an array whose ``zarr.json`` says ``"data_type": "bfloat16"`` unless a plugin teaches it the
name; without one, ``zarr.open_group`` of a hierarchy holding one such array fails whole
(``No Zarr data type found that matches 'bfloat16'``). ``bfloat16`` and ``float8_e5m2`` are
registered extension names in zarr-extensions; the other names (``float8_e4m3fn``,
``float8_e4m3fnuz``, ``float8_e5m2fnuz``, ``float8_e8m0fnu``) are the ones TensorStore uses.
ml_dtypes supplies the NumPy dtypes behind all of them.

This file ships twice, byte for byte (``tests/test_zarr_dtypes.py`` checks it): as
``zarrckpt.interop.zarr_dtypes`` in zarrckpt, and as the module ``zarrckpt_dtypes`` of the
distribution ``zarrckpt-dtypes`` (``dtypes/`` in zarrckpt's repository: zarr, NumPy and
ml_dtypes only, no torch or TensorStore), for readers who want nothing else. With either
installed, zarr-python, dask and xarray read these arrays **without any import**:

* zarr-python 3.4 loads the ``zarr.data_type`` entry points both distributions declare
  the first time it looks a data type up (3.4.2 tried);
* zarr-python 3.1 to 3.3 collect those entry points but never load them (3.1.6, 3.2.0 and
  3.3.0 never call the data type registry's ``_lazy_load``). They do load their
  ``zarr.buffer`` entry points the first time it needs a buffer class, which is before it
  parses any metadata, so both distributions also declare one there: it names zarr's own
  CPU buffer class (:data:`_ZarrCpuBuffer`, registered again under the name it already
  has: nothing about buffers changes) and loading it imports this module, which registers
  the data types (:func:`register` runs at import).

Fill values follow TensorStore's JSON encoding: a number, ``"NaN"``, ``"Infinity"``,
``"-Infinity"``, or ``"0x.."`` with the big-endian bits of the value (TensorStore writes that for
NaNs other than the canonical one; zarr's own parser would read it as a float16/32/64). Types
without infinities (or without -0) turn those into NaN (or 0) exactly as TensorStore does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Self, SupportsFloat, SupportsIndex, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import HasEndianness, HasItemSize
from zarr.core.dtype.npy.common import (
    endianness_to_numpy_str,
    float_from_json_v2,
    float_to_json_v2,
    get_endianness_from_numpy_dtype,
)
from zarr.core.buffer.cpu import Buffer as _ZarrCpuBuffer
from zarr.core.dtype.wrapper import TBaseDType, ZDType

try:  # zarr >= 3.2 moved it (the old name warns)
    from zarr.errors import DataTypeValidationError
except ImportError:  # zarr 3.1
    from zarr.core.dtype.common import DataTypeValidationError

if TYPE_CHECKING:
    from zarr.core.common import JSON, ZarrFormat
    from zarr.core.dtype.common import DTypeConfig_V2, DTypeJSON

__all__ = [
    "BFloat16",
    "Float8E4M3FN",
    "Float8E4M3FNUZ",
    "Float8E5M2",
    "Float8E5M2FNUZ",
    "Float8E8M0FNU",
    "register",
]


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType[np.dtype[np.generic], np.generic], HasItemSize):
    """Shared logic for ml_dtypes floats. The Zarr v3 name is also the ml_dtypes / NumPy dtype name,
    and the Zarr v2 name (as written by TensorStore's zarr v2 driver).

    zarr's ``BaseFloat`` is not reused because it always carries an endianness, and the ``bytes``
    codec then demands ``"endian"`` in its configuration, which TensorStore (rightly) omits for
    1-byte types. Only :class:`BFloat16` mixes in ``HasEndianness``.
    """

    @property
    def item_size(self) -> int:
        return self.dtype_cls().itemsize

    @classmethod
    def from_native_dtype(cls, dtype: TBaseDType) -> Self:
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._zarr_v3_name}.")

    def to_native_dtype(self) -> np.dtype[np.generic]:
        return self.dtype_cls()

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        if data == {"name": cls._zarr_v3_name, "object_codec_id": None}:
            return cls()
        raise DataTypeValidationError(f"Invalid Zarr v2 JSON for {cls.__name__}: {data!r}")

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Self:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(f"Invalid Zarr v3 JSON for {cls.__name__}: {data!r}")

    def to_json(self, zarr_format: ZarrFormat) -> DTypeConfig_V2[str, None] | str:  # type: ignore[override]
        if zarr_format == 2:
            return {"name": self._zarr_v3_name, "object_codec_id": None}
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format}")  # pragma: no cover

    def _check_scalar(self, data: object) -> TypeGuard[SupportsFloat | SupportsIndex | str]:
        if isinstance(data, str):
            try:
                float(data)
            except ValueError:
                return False
            return True
        return isinstance(data, SupportsFloat | SupportsIndex)

    def cast_scalar(self, data: object) -> np.generic:
        if isinstance(data, np.generic) and data.dtype == self.dtype_cls():
            return data  # already this type: keep the exact bits (e.g. a NaN payload)
        if self._check_scalar(data):
            return self._from_float(float(data))  # type: ignore[arg-type]
        raise TypeError(f"Cannot convert {data!r} ({type(data)}) to a scalar of {self}.")

    def _from_float(self, value: float) -> np.generic:
        return self.dtype_cls().type(value)  # type: ignore[no-any-return]

    def _from_bits(self, bits: int) -> np.generic:
        return np.array(bits, dtype=f"u{self.item_size}").view(self.dtype_cls())[()]  # type: ignore[no-any-return]

    def _to_bits(self, value: np.generic) -> int:
        return int(np.asarray(value).view(f"u{self.item_size}"))

    def default_scalar(self) -> np.generic:
        return self.cast_scalar(0)

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> np.generic:
        if isinstance(data, str) and data.startswith("0x"):
            if zarr_format == 3 and len(data) == 2 + 2 * self.item_size:
                return self._from_bits(int(data, 16))
            raise ValueError(f"Invalid fill value {data!r} for {self._zarr_v3_name}.")
        if isinstance(data, str | int | float) and not isinstance(data, bool):
            return self.cast_scalar(float_from_json_v2(data))
        raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}.")

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        value = self.cast_scalar(data)
        if (
            zarr_format == 3
            and np.isnan(value)
            and self._to_bits(value) != self._to_bits(self._from_float(float("nan")))
        ):
            return f"0x{self._to_bits(value):0{2 * self.item_size}x}"
        return float_to_json_v2(float(value))


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """bfloat16 (zarr-extensions name ``bfloat16``); 2 bytes, so the ``bytes`` codec's endianness applies."""

    _zarr_v3_name: ClassVar[Literal["bfloat16"]] = "bfloat16"
    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))

    @classmethod
    def from_native_dtype(cls, dtype: TBaseDType) -> Self:
        if cls._check_native_dtype(dtype):
            return cls(endianness=get_endianness_from_numpy_dtype(dtype))
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected bfloat16.")

    def to_native_dtype(self) -> np.dtype[np.generic]:
        return self.dtype_cls().newbyteorder(endianness_to_numpy_str(self.endianness))

    def to_json(self, zarr_format: ZarrFormat) -> DTypeConfig_V2[str, None] | str:  # type: ignore[override]
        if zarr_format == 2 and self.endianness != "little":
            raise ValueError("The Zarr v2 name 'bfloat16' means little-endian bfloat16.")
        return super().to_json(zarr_format)


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """OCP FP8 E4M3 (no infinities, NaN = S.1111.111); TensorStore name ``float8_e4m3fn``."""

    _zarr_v3_name: ClassVar[Literal["float8_e4m3fn"]] = "float8_e4m3fn"
    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fn))


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """OCP FP8 E5M2 (IEEE-like, with infinities); zarr-extensions name ``float8_e5m2``."""

    _zarr_v3_name: ClassVar[Literal["float8_e5m2"]] = "float8_e5m2"
    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2))


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FNUZ(_MLFloat):
    """FP8 E4M3, no infinities or -0, single NaN 0x80; TensorStore name ``float8_e4m3fnuz``."""

    _zarr_v3_name: ClassVar[Literal["float8_e4m3fnuz"]] = "float8_e4m3fnuz"
    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fnuz))


@dataclass(frozen=True, kw_only=True)
class Float8E5M2FNUZ(_MLFloat):
    """FP8 E5M2, no infinities or -0, single NaN 0x80; TensorStore name ``float8_e5m2fnuz``."""

    _zarr_v3_name: ClassVar[Literal["float8_e5m2fnuz"]] = "float8_e5m2fnuz"
    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2fnuz))


@dataclass(frozen=True, kw_only=True)
class Float8E8M0FNU(_MLFloat):
    """OCP MX scale type: unsigned powers of two 2**-127..2**127 plus NaN (0xff), no zero;
    TensorStore name ``float8_e8m0fnu``."""

    _zarr_v3_name: ClassVar[Literal["float8_e8m0fnu"]] = "float8_e8m0fnu"
    dtype_cls = type(np.dtype(ml_dtypes.float8_e8m0fnu))

    def _from_float(self, value: float) -> np.generic:
        # ml_dtypes turns 0 into NaN; TensorStore rounds it to 2**-127 (bits 0x00) and writes that
        # value as the fill value 0.0 (its default). Follow TensorStore so both read the same bits.
        return self._from_bits(0) if value == 0 else super()._from_float(value)

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        # Write non-NaN fill values as hex bits: TensorStore (0.1.86) maps JSON numbers for this
        # type with a wrong exponent bias (1.0 -> bits 0x3f), but parses hex bit-exactly.
        value = self.cast_scalar(data)
        if zarr_format == 3 and not np.isnan(value):
            return f"0x{self._to_bits(value):02x}"
        return super().to_json_scalar(value, zarr_format=zarr_format)


_DTYPES: tuple[type[_MLFloat], ...] = (
    BFloat16,
    Float8E4M3FN,
    Float8E5M2,
    Float8E4M3FNUZ,
    Float8E5M2FNUZ,
    Float8E8M0FNU,
)


def register() -> None:
    """Register all data types with zarr-python's data type registry (idempotent)."""
    for cls in _DTYPES:
        data_type_registry.register(cls._zarr_v3_name, cls)  # type: ignore[arg-type]


# Importing this module registers the types: zarr 3.1 imports it through the ``zarr.buffer``
# entry point (see the module docstring), and ``_ZarrCpuBuffer`` is what that entry point names.
register()
