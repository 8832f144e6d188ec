"""zarr-python <-> TensorStore interop for the bfloat16 / float8 data types in zarrckpt.interop.zarr_dtypes.

Every array holds every bit pattern of its type (all NaNs, -0, infinities, subnormals), and is one
chunk larger than the written data so the fill value is exercised too. Comparisons are on raw bits.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.dtype import get_data_type_from_json, get_data_type_from_native_dtype

from zarrckpt.interop.zarr_dtypes import BFloat16, Float8E8M0FNU, register

NAMES = [
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]
CHUNK = 64

# zarr's empty-chunk check compares NaN chunks to the fill value with ==.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in equal:RuntimeWarning")


@pytest.fixture(autouse=True)
def _registered() -> None:
    register()


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def all_values(name: str) -> np.ndarray:
    """Every bit pattern of the type, as a 1-D array of that type."""
    dtype = np.dtype(getattr(ml_dtypes, name))
    return np.arange(2 ** (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}").view(dtype)


def ts_spec(path: Path) -> dict:
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}


def ts_read(path: Path) -> np.ndarray:
    return ts.open(ts_spec(path), open=True).result().read().result()


TS_E8M0_BUG = pytest.mark.xfail(
    strict=True,
    reason="TensorStore writes float8_e8m0fnu fill values as numbers with a wrong exponent bias "
    "(bits 0x7f -> 1.8e19); only its default 0.0 and NaN are interpreted consistently",
)


@pytest.mark.parametrize(
    ("name", "fill_value"),
    [
        pytest.param(name, fill, marks=TS_E8M0_BUG if (name, fill) == ("float8_e8m0fnu", "0x7f") else ())
        for name in NAMES
        for fill in (None, "NaN", "0x7f")
    ],
)
def test_tensorstore_write_zarr_read(tmp_path: Path, name: str, fill_value: str | None) -> None:
    data = all_values(name)
    if fill_value == "0x7f" and data.dtype.itemsize == 2:
        fill_value = "0xffc1"  # a non-canonical NaN, which TensorStore writes as hex
    metadata: dict = {
        "shape": [data.size + CHUNK],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [CHUNK]}},
        "data_type": name,
        "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
    }
    if fill_value is not None:
        metadata["fill_value"] = fill_value
    store = ts.open({**ts_spec(tmp_path), "metadata": metadata}, create=True).result()
    store[: data.size].write(data).result()
    expected = ts_read(tmp_path)  # includes TensorStore's reading of the fill value

    arr = zarr.open_array(tmp_path, mode="r")
    assert arr.dtype == data.dtype
    got = arr[...]
    assert got.dtype == data.dtype
    np.testing.assert_array_equal(bits(got[: data.size]), bits(data))
    np.testing.assert_array_equal(bits(got), bits(expected))


@pytest.mark.parametrize("fill_value", [None, float("nan"), 1.5])
@pytest.mark.parametrize("name", NAMES)
def test_zarr_write_tensorstore_read(tmp_path: Path, name: str, fill_value: float | None) -> None:
    data = all_values(name)
    arr = zarr.create_array(
        tmp_path,
        shape=(data.size + CHUNK,),
        chunks=(CHUNK,),
        dtype=data.dtype,
        fill_value=fill_value,
        serializer=BytesCodec(),
        compressors=[Crc32cCodec()],
    )
    arr[: data.size] = data
    meta = json.loads((tmp_path / "zarr.json").read_text())
    assert meta["data_type"] == name

    got = ts_read(tmp_path)
    assert got.dtype == data.dtype
    np.testing.assert_array_equal(bits(got[: data.size]), bits(data))
    np.testing.assert_array_equal(bits(got), bits(arr[...]))


def test_zarr_big_endian_bfloat16_tensorstore_read(tmp_path: Path) -> None:
    data = all_values("bfloat16")
    arr = zarr.create_array(
        tmp_path,
        shape=data.shape,
        chunks=(4096,),
        dtype=BFloat16(endianness="big"),
        serializer=BytesCodec(endian="big"),
        compressors=None,
    )
    arr[...] = data
    np.testing.assert_array_equal(bits(ts_read(tmp_path)), bits(data))
    np.testing.assert_array_equal(bits(zarr.open_array(tmp_path, mode="r")[...]), bits(data))


ZARR_NEG_ZERO = pytest.mark.xfail(
    strict=True,
    reason="zarr 3.1.6 compares chunks to a 0 fill value by value (not bits) for these dtypes, so "
    "with write_empty_chunks=False a chunk of +-0 is dropped and -0 reads back as +0",
)


@pytest.mark.parametrize(
    ("name", "write_empty_chunks"),
    [("bfloat16", True), ("float8_e4m3fn", True), ("float8_e5m2", False)]
    + [pytest.param(name, False, marks=ZARR_NEG_ZERO) for name in ("bfloat16", "float8_e4m3fn")],
)
def test_negative_zero_chunk(tmp_path: Path, name: str, write_empty_chunks: bool) -> None:
    data = np.array([-0.0] * CHUNK + [0.0, -0.0] * (CHUNK // 2), dtype=getattr(ml_dtypes, name))
    arr = zarr.create_array(
        tmp_path,
        shape=data.shape,
        chunks=(CHUNK,),
        dtype=data.dtype,
        fill_value=0,
        config={"write_empty_chunks": write_empty_chunks},
    )
    arr[...] = data
    np.testing.assert_array_equal(bits(ts_read(tmp_path)), bits(data))


@pytest.mark.parametrize("name", NAMES)
def test_dtype_wrapper(name: str) -> None:
    native = np.dtype(getattr(ml_dtypes, name))
    zdtype = get_data_type_from_json(name, zarr_format=3)
    assert zdtype.to_native_dtype() == native
    assert get_data_type_from_native_dtype(native) == zdtype
    assert zdtype.to_json(zarr_format=3) == name
    assert zdtype.item_size == native.itemsize == (2 if name == "bfloat16" else 1)
    for fill in (0, 0.0, -0.0, "NaN", "Infinity", 1.5):
        value = zdtype.from_json_scalar(fill, zarr_format=3)
        assert value.dtype == native
        assert bits(np.asarray(value)) == bits(np.asarray(zdtype.cast_scalar(fill)))
        again = zdtype.from_json_scalar(zdtype.to_json_scalar(value, zarr_format=3), zarr_format=3)
        assert bits(np.asarray(again)) == bits(np.asarray(value))


def test_e8m0_zero_fill_matches_tensorstore() -> None:
    # TensorStore writes fill_value 0.0 for float8_e8m0fnu meaning bits 0x00 (2**-127); ml_dtypes maps 0 to NaN.
    assert bits(np.asarray(Float8E8M0FNU().from_json_scalar(0.0, zarr_format=3))) == 0


def test_register_is_idempotent() -> None:
    register()
    register()
    assert get_data_type_from_json("float8_e4m3fn", zarr_format=3).item_size == 1


# ------------------------------------------------------------------ loading without `import zarrckpt`


def test_entry_points_load_through_zarrs_lazy_hook() -> None:
    """zarr 3.1-3.3 collect the ``zarr.data_type`` entry points into the registry's lazy list
    but never call ``_lazy_load()`` (the ``zarr.buffer`` entry point registers the types there);
    zarr 3.4 does, and gets exactly these classes."""
    from importlib.metadata import entry_points

    from zarr.core.dtype import data_type_registry
    from zarr.core.dtype.registry import DataTypeRegistry

    from zarrckpt.interop import zarr_dtypes

    eps = {e.name: e for e in entry_points(group="zarr.data_type")}
    assert set(NAMES) <= set(eps)
    # collected by zarr itself: still in the lazy list (3.1, which never loads it), or already
    # loaded from it by a zarr that calls the hook (3.4)
    collected = {e.name for e in data_type_registry._lazy_load_list} | set(data_type_registry.contents)
    assert collected >= set(NAMES)
    fresh = DataTypeRegistry()
    fresh._lazy_load_list.extend(eps[n] for n in NAMES)
    fresh._lazy_load()
    assert {n: fresh.get(n) for n in NAMES} == {c._zarr_v3_name: c for c in zarr_dtypes._DTYPES}


READ_SCRIPT = """
import sys
import zarr
a = zarr.open_group(sys.argv[1], mode="r")["a"] if sys.argv[2] == "group" else zarr.open_array(sys.argv[1] + "/a", mode="r")
print(a[...].tolist())
"""


@pytest.mark.parametrize("first", ["group", "array"])
def test_zarr_python_reads_bfloat16_without_import(tmp_path: Path, first: str) -> None:
    """In a fresh interpreter, outside the source tree, zarr-python reads a TensorStore
    bfloat16 array with nothing imported but zarr: on zarr 3.4 through the ``zarr.data_type``
    entry points; on 3.1-3.3 through the ``zarr.buffer`` one, which zarr loads at its first
    buffer lookup: opening a group does one before parsing any member (3.1 refused
    'bfloat16' there before), but ``zarr.open_array`` straight on a bfloat16 array parses
    its metadata first, so as a process's first zarr call it still fails there (README)."""
    import subprocess
    import sys

    import zarr

    zarr.create_group(tmp_path / "g", zarr_format=3)
    ts.open({**ts_spec(tmp_path / "g" / "a"), "metadata": {"shape": [2], "data_type": "bfloat16"}},
            create=True).result().write(np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)).result()
    r = subprocess.run([sys.executable, "-c", READ_SCRIPT, str(tmp_path / "g"), first], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    if first == "array" and tuple(int(x) for x in zarr.__version__.split(".")[:2]) < (3, 4):
        assert r.returncode != 0 and "bfloat16" in r.stderr, (r.stdout, r.stderr)
        return
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[1.5, -2.0]"


# ------------------------------------------------------------ the zarrckpt-dtypes distribution

ROOT = Path(__file__).resolve().parent.parent


def _entry_points(pyproject: Path) -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["entry-points"]


def test_zarrckpt_dtypes_is_this_module_byte_for_byte():
    """``dtypes/`` builds the torch- and TensorStore-free distribution ``zarrckpt-dtypes``;
    its one module must stay the module zarrckpt ships."""
    assert (ROOT / "dtypes" / "zarrckpt_dtypes.py").read_bytes() == \
        (ROOT / "zarrckpt" / "interop" / "zarr_dtypes.py").read_bytes()


def test_zarrckpt_dtypes_declares_the_entry_points_zarrckpt_declares():
    ours, theirs = _entry_points(ROOT / "pyproject.toml"), _entry_points(ROOT / "dtypes" / "pyproject.toml")
    for group in ("zarr.data_type", "zarr.buffer"):
        assert {k: v.replace("zarrckpt.interop.zarr_dtypes:", "zarrckpt_dtypes:") for k, v in ours[group].items()} \
            == theirs[group], group
    assert set(ours["zarr.data_type"]) == set(NAMES)


def test_the_buffer_entry_point_changes_no_buffer():
    """zarr 3.1-3.3 register what the ``zarr.buffer`` entry point names under its fully
    qualified name: it must be zarr's own CPU buffer class, which is registered under that
    name already, so loading it changes nothing but importing this module."""
    import zarr.registry
    from zarr.core.buffer.cpu import Buffer

    from zarrckpt.interop import zarr_dtypes

    assert zarr_dtypes._ZarrCpuBuffer is Buffer
    assert zarr.registry.get_buffer_class() is Buffer
