"""What each reader checks, pinned: the reader table of docs/pages/generic-readers.md (the README's
"Reading without zarrckpt" section moved there).

Torch-free on purpose: ``.ci/run`` runs this file a second time on Python 3.12 with the newest
zarr-python, NumPy and TensorStore (no torch installed), beside the pinned set. Every case reads
the golden checkpoints (``tests/golden``, written by released versions) and copies of them with
one chunk damaged:

- zarrckpt (``zarrckpt.open``) refuses a flipped byte and a deleted chunk;
- zarr-python and TensorStore refuse a flipped byte (CRC-32C) but return fill values for a
  deleted chunk, TensorStore too unless opened with ``fill_missing_data_reads: false``;
- zarr-python reads ``bfloat16``/``float8`` arrays once zarrckpt's data types are registered;
  with zarrckpt (or zarrckpt-dtypes) installed that needs no import on any zarr version
  (``tests/test_fresh_readers.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import zarr

import zarrckpt
from zarrckpt.errors import CorruptChunkError
from zarrckpt.interop.zarr_dtypes import register

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = [(d.name, name) for d in sorted(GOLDEN.iterdir()) if (d / "manifest.json").is_file()
         for name in json.loads((d / "manifest.json").read_text(encoding="utf-8"))["checkpoints"]]
ZARR_VERSION = tuple(int(x) for x in zarr.__version__.split(".")[:2])


def expected_leaves(node: dict, path: tuple = ()) -> dict[tuple, dict]:
    """Array leaves of a manifest description, keyed by key path."""
    if "leaf" in node:
        return {path: node}
    ((kind, body),) = node.items()
    out: dict[tuple, dict] = {}
    if kind == "dict":
        for k, sub in body:
            out.update(expected_leaves(sub, path + (k,)))
    elif kind in ("list", "tuple", "namedtuple"):
        items = body["items"] if isinstance(body, dict) else body
        for i, sub in enumerate(items):
            if isinstance(sub, dict):
                out.update(expected_leaves(sub, path + (i,)))
    return out


def manifest(version: str, name: str) -> dict:
    return json.loads((GOLDEN / version / "manifest.json").read_text(encoding="utf-8"))["checkpoints"][name]


def sha256_of(value) -> str:
    if isinstance(value, (bytes, bytearray)):
        return hashlib.sha256(bytes(value)).hexdigest()
    a = np.ascontiguousarray(value)
    return hashlib.sha256(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest()


def own_arrays(path: Path) -> list[tuple[str, dict]]:
    """(array path, its zarrckpt attributes) of every array stored under its own key."""
    out = []
    for dirpath, _, files in os.walk(path):
        if "zarr.json" not in files or dirpath == str(path):
            continue
        doc = json.loads(Path(dirpath, "zarr.json").read_text(encoding="utf-8"))
        rel = os.path.relpath(dirpath, path)
        if doc["node_type"] == "array" and not rel.startswith(".packs"):
            out.append((rel, doc["attributes"]["zarrckpt"]))
    return sorted(out)


def chunk_files(path: Path, array: str) -> list[Path]:
    return sorted(p for p in (path / array / "c").rglob("*") if p.is_file() and p.stat().st_size > 4)


@pytest.mark.parametrize("version,name", CASES, ids=[f"{v}-{n}" for v, n in CASES])
def test_zarrckpt_open_reads_golden_without_torch(version, name):
    """Every array leaf, bit for bit, through the torch-free reader."""
    from zarrckpt.format.tree import key_of

    ckpt = zarrckpt.open(GOLDEN / version / name)
    want = expected_leaves(manifest(version, name)["expected"])
    assert want
    for kp, node in want.items():
        got = ckpt.read(key_of(kp))
        if not isinstance(got, (bytes, bytearray)):
            got = np.asarray(got)
            assert list(got.shape) == node["shape"], kp
        assert sha256_of(got) == node["sha256"], kp


@pytest.mark.parametrize("version,name", CASES, ids=[f"{v}-{n}" for v, n in CASES])
def test_tensorstore_and_zarr_python_read_every_array_alike(version, name):
    register()
    path = GOLDEN / version / name
    for array, _ in own_arrays(path):
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / array)}},
                    read=True).result()
        z = zarr.open_array(path / array, mode="r")
        a, b = np.asarray(t.read().result()), np.asarray(z[...])
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), array


def _damaged_copy(tmp_path: Path, damage: str) -> tuple[Path, str, dict]:
    """A copy of a golden checkpoint with one array's only chunk damaged: (path, array, attrs)."""
    src = GOLDEN / "v1.0" / "one_unpacked"
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    array, attrs = next((a, at) for a, at in own_arrays(dst) if a == "model/layer.weight")
    (chunk,) = chunk_files(dst, array)
    if damage == "flip":
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        chunk.write_bytes(bytes(raw))
    else:
        chunk.unlink()
    return dst, array, attrs


def test_one_unpacked_has_the_array_the_damage_cases_use():
    assert any(a == "model/layer.weight" for a, _ in own_arrays(GOLDEN / "v1.0" / "one_unpacked"))


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_zarrckpt_refuses_damage(tmp_path, damage):
    path, array, _ = _damaged_copy(tmp_path, damage)
    ckpt = zarrckpt.open(path)
    with pytest.raises(CorruptChunkError, match="layer.weight"):
        ckpt.read("model/layer.weight")


def test_zarr_python_refuses_a_flipped_byte(tmp_path):
    path, array, _ = _damaged_copy(tmp_path, "flip")
    with pytest.raises(Exception, match="(?i)checksum|crc"):
        zarr.open_array(path / array, mode="r")[...]


def test_zarr_python_reads_a_deleted_chunk_as_fill_values(tmp_path):
    """Documented, not wanted: why the README says to read with zarrckpt or TensorStore
    with ``fill_missing_data_reads: false`` when the data matters."""
    path, array, _ = _damaged_copy(tmp_path, "delete")
    data = zarr.open_array(path / array, mode="r")[...]
    assert not np.asarray(data).any()


def test_tensorstore_refuses_a_flipped_byte(tmp_path):
    path, array, _ = _damaged_copy(tmp_path, "flip")
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / array)}}).result()
    with pytest.raises(ValueError, match="(?i)digest|checksum|crc"):
        t.read().result()


def test_tensorstore_refuses_a_deleted_chunk_only_when_asked(tmp_path):
    path, array, _ = _damaged_copy(tmp_path, "delete")
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / array)}}
    assert not np.asarray(ts.open(spec).result().read().result()).any()
    strict = ts.open({**spec, "fill_missing_data_reads": False}).result()
    with pytest.raises(ValueError):
        strict.read().result()


# ------------------------------------------------------------ the docs' TensorStore recipe

RECIPE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "pages" / "generic-readers.md"


def _recipe() -> dict:
    """Runs the ``open_arrays`` block of docs/pages/generic-readers.md as written; returns its namespace."""
    text = RECIPE_PAGE.read_text(encoding="utf-8")
    blocks = [b.split("\n", 1)[1] for b in text.split("```python")[1:]]
    (code,) = [b.split("```", 1)[0] for b in blocks if "def open_arrays(" in b]
    ns: dict = {}
    exec(compile(code, str(RECIPE_PAGE), "exec"), ns)  # noqa: S102 - the docs page's own snippet
    return ns


def _kvstore(path: Path) -> dict:
    return {"driver": "file", "path": str(path) + "/"}


@pytest.mark.parametrize("version,name", CASES, ids=[f"{v}-{n}" for v, n in CASES])
def test_readme_tensorstore_recipe_opens_every_array(version, name):
    """Every stored array (bf16/fp8 included), values as zarr-python reads them."""
    register()
    path = GOLDEN / version / name
    arrays = _recipe()["open_arrays"](_kvstore(path))
    stored = sorted(os.path.relpath(d, path) for d, _, files in os.walk(path) if "zarr.json" in files
                    and json.loads(Path(d, "zarr.json").read_text(encoding="utf-8"))["node_type"] == "array")
    assert sorted(arrays) == stored
    for array, t in arrays.items():
        a, b = np.asarray(t.read().result()), np.asarray(zarr.open_array(path / array, mode="r")[...])
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), array


def test_readme_tensorstore_recipe_reads_only_the_root_document(tmp_path):
    """Format 1.2: with every zarr.json but the root's removed, it still opens and reads all."""
    src = GOLDEN / "v1.2" / "one_default"
    shutil.copytree(src, tmp_path / "c")
    removed = [p for p in (tmp_path / "c").rglob("zarr.json") if p.parent != tmp_path / "c"]
    for p in removed:
        p.unlink()
    arrays = _recipe()["open_arrays"](_kvstore(tmp_path / "c"))
    assert len(arrays) == len(removed) - sum(1 for p in removed if '"group"' in (src / p.relative_to(tmp_path / "c")).read_text())
    assert any(str(t.dtype) == 'dtype("bfloat16")' for t in arrays.values())
    for t in arrays.values():
        t.read().result()


def test_readme_tensorstore_recipe_refuses_a_deleted_chunk_and_a_pending_checkpoint(tmp_path):
    path, array, _ = _damaged_copy(tmp_path, "delete")
    arrays = _recipe()["open_arrays"](_kvstore(path))
    with pytest.raises(ValueError):
        arrays[array].read().result()
    root = json.loads((path / "zarr.json").read_text(encoding="utf-8"))
    root["attributes"]["zarrckpt"]["state"] = "pending"
    (path / "zarr.json").write_text(json.dumps(root), encoding="utf-8")
    with pytest.raises(ValueError, match="not a committed"):
        _recipe()["open_arrays"](_kvstore(path))
