"""What ``zarrs`` (PyPI, zarr-python's Rust codec pipeline; 0.2.3 measured) does with a
checkpoint: the README's reader table row.

zarrs runs inside zarr-python, which parses the metadata, so it needs the bfloat16/float8
types registered exactly as zarr-python does (zarrckpt's entry points do it). Measured with
0.2.3:

* default (non-strict) mode: every array reads, values equal to zarr-python's; bfloat16 and
  the float8 types are read by zarr-python's own pipeline, not by zarrs: zarrs' Python layer
  hands no array of NumPy kind ``V`` (ml_dtypes' types) to Rust, silently for bfloat16, and
  its Rust side refuses ``float8_e4m3fn`` and float8 fill values written as numbers
  (``0.0``, ``"NaN"``) with a warning;
* strict mode (``codec_pipeline.strict``): those arrays are refused
  (``UnsupportedDataTypeError`` for bfloat16, ``UnsupportedMetadataError`` for float8);
  every other data type reads through Rust.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr

zarrs = pytest.importorskip("zarrs")
from zarrs.pipeline import UnsupportedDataTypeError, UnsupportedMetadataError  # noqa: E402

import zarrckpt  # noqa: E402,F401 - the data types (installed entry points would do it too)

CKPT = Path(__file__).resolve().parent / "golden" / "v1.2" / "one_default"
ML = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in equal:RuntimeWarning")


def arrays() -> list[tuple[str, str]]:
    g = zarr.open_group(CKPT, mode="r")
    return sorted((n, json.loads((CKPT / n / "zarr.json").read_text())["data_type"])
                  for n, a in g.members(max_depth=None) if isinstance(a, zarr.Array))


def read(name: str, strict: bool):
    with zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline", "codec_pipeline.strict": strict}):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = zarr.open_array(CKPT / name, mode="r")
            assert type(a._async_array.codec_pipeline).__name__ == "ZarrsCodecPipeline"
            data = a[...]
    return data, [str(w.message) for w in caught if "ZarrsCodecPipeline" in str(w.message)]


def test_the_golden_checkpoint_has_every_ml_dtype():
    assert ML <= {dt for _, dt in arrays()}


def test_default_mode_reads_every_array_as_zarr_python_does():
    for name, dt in arrays():
        data, warned = read(name, strict=False)
        want = zarr.open_array(CKPT / name, mode="r")[...]
        assert (data.dtype, data.shape, data.tobytes()) == (want.dtype, want.shape, want.tobytes()), name
        assert bool(warned) == (dt in ML - {"bfloat16"}), (name, dt, warned)


def test_strict_mode_refuses_bfloat16_and_float8():
    for name, dt in arrays():
        if zarr.open_array(CKPT / name, mode="r").size == 0:
            continue  # nothing to decode (empty_bf16): read without a pipeline
        if dt == "bfloat16":
            assert np.dtype(zarr.open_array(CKPT / name, mode="r").dtype).kind == "V"  # the cause
            with pytest.raises(UnsupportedDataTypeError):
                read(name, strict=True)
        elif dt in ML:
            with pytest.raises(UnsupportedMetadataError):
                read(name, strict=True)
        else:
            data, warned = read(name, strict=True)
            assert data.tobytes() == zarr.open_array(CKPT / name, mode="r")[...].tobytes() and not warned, name
