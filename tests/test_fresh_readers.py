"""Generic readers in a fresh interpreter that imports nothing of zarrckpt's (issue 29 item 2).

This file imports nothing of zarrckpt either: ``.ci/run`` runs it once more where only the
``zarrckpt-dtypes`` distribution (``dtypes/``) is installed, with ``ZARRCKPT_DTYPES_ONLY=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"

_FRESH = r"""
import json, sys
import zarr
path, tool = sys.argv[1], sys.argv[2]
n, dtypes = 0, set()
if tool == "xarray":
    import xarray as xr
    tree = xr.open_datatree(path, engine="zarr")
    for node in tree.subtree:
        for v in node.ds.data_vars.values():
            v.values
            n += 1
            dtypes.add(str(v.dtype))
else:
    g = zarr.open_group(path, mode="r")
    for _, a in g.members(max_depth=None):
        if isinstance(a, zarr.Array):
            if tool == "dask":
                import dask.array as da
                da.from_zarr(a).compute()
            else:
                a[...]
            n += 1
            dtypes.add(str(a.dtype))
from zarr.core.dtype import data_type_registry
print(json.dumps({"arrays": n, "dtypes": sorted(dtypes), "zarrckpt": "zarrckpt" in sys.modules,
                  "types_from": data_type_registry.get("bfloat16").__module__}))
"""

# Every data type a checkpoint can hold, bf16 and every float8 included (formats 1.0 and 1.2).
FRESH_CASES = [("v1.2", "one_default"), ("v1.0", "one_unpacked")]


def _arrays_stored(path: Path) -> int:
    return sum(1 for d, _, files in os.walk(path) if "zarr.json" in files
               and json.loads(Path(d, "zarr.json").read_text(encoding="utf-8"))["node_type"] == "array")


@pytest.mark.parametrize("tool", ["zarr", "dask", "xarray"])
@pytest.mark.parametrize("version,name", FRESH_CASES, ids=[f"{v}-{n}" for v, n in FRESH_CASES])
def test_generic_readers_list_and_read_everything_in_a_fresh_process(tmp_path, tool, version, name):
    """Issue 29 item 2: zarr-python, dask and xarray (``open_datatree(engine="zarr")``, whose
    engine is built in, so xarray loads no plugin) list the whole checkpoint and read every
    array, bf16/fp8 included, in a fresh interpreter that imports nothing of zarrckpt's: the
    data types come from the installed distribution's entry points alone (zarr 3.1-3.3: the
    ``zarr.buffer`` one; 3.4: ``zarr.data_type``). The interpreter runs outside the source
    tree, so only what is installed is importable. ``.ci/run`` runs it again with only
    ``zarrckpt-dtypes`` installed (``ZARRCKPT_DTYPES_ONLY=1``)."""
    if tool != "zarr":
        pytest.importorskip("dask.array" if tool == "dask" else "xarray")
    path = GOLDEN / version / name
    r = subprocess.run([sys.executable, "-c", _FRESH, str(path), tool], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["arrays"] == _arrays_stored(path)
    if version == "v1.2":
        assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"} <= set(got["dtypes"]), got
    if os.environ.get("ZARRCKPT_DTYPES_ONLY"):
        assert got["types_from"] == "zarrckpt_dtypes" and not got["zarrckpt"], got
    else:
        assert got["types_from"] in ("zarrckpt.interop.zarr_dtypes", "zarrckpt_dtypes"), got
