"""zarrckpt.engine.writer.Writer: one process writes a checkpoint leaf by leaf (spec §7), and the
converters need no torch for safetensors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import zarrckpt
from zarrckpt.format import dtypes
from zarrckpt.engine.writer import Writer
from zarrckpt.errors import CheckpointExistsError, ZarrckptError

BF16 = dtypes.by_zarr("bfloat16")


def test_streamed_arrays_values_and_packs(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((100, 30)).astype(dtypes.by_zarr("bfloat16").numpy)
    smalls = {f"s{i}": rng.standard_normal(40).astype(np.float32) for i in range(30)}
    with Writer(tmp_path / "ck", metadata={"step": 3}, pack_bytes=1024, pack_limit=2048) as w:
        a = w.add_array(("model", "big"), big.shape, BF16, chunk_shape=(7, 30))
        for start in a.chunk_starts():
            a.write(start, big[a.chunk_box(start)[0][0]:a.chunk_box(start)[0][1]])
        with pytest.raises(ValueError, match="written already"):
            a.write((0, 0), big[:7])
        with pytest.raises(ValueError, match="not the start of a chunk"):
            a.write((3, 0), big[3:10])
        for k, v in smalls.items():
            w.add(("small", k), v)
        w.add(("zero_d",), np.array(2.5, np.float64))
        w.add(("empty",), np.empty((0, 3), np.float32))
        w.add(("lst",), np.arange(3), containers=None)
        w.add(("seq", 1), 7, containers=("list",))
        w.add(("seq", 0), "a", containers=("list",))
        w.add(("blob",), b"\x00\x01")
        w.add(("nan",), float("nan"))
    ckpt = zarrckpt.open(tmp_path / "ck")
    assert ckpt.info.metadata == {"step": 3}
    packs = {ckpt.node(f"small/{k}")["packed"]["pack"] for k in smalls}
    assert len(packs) > 1  # several packs of at most pack_limit bytes
    sd = zarrckpt.load_state_dict(tmp_path / "ck")
    assert sd["model"]["big"].view(dtypes.torch_dtype(BF16)).shape == (100, 30)
    np.testing.assert_array_equal(ckpt.read("model/big").view(np.int16), big.view(np.int16))
    for k, v in smalls.items():
        np.testing.assert_array_equal(ckpt.read(f"small/{k}"), v)
    assert ckpt.read("zero_d") == 2.5 and ckpt.read("empty").shape == (0, 3)
    assert sd["seq"] == ["a", 7] and sd["blob"] == b"\x00\x01" and sd["nan"] != sd["nan"]


def test_incomplete_or_failed_writes_commit_nothing(tmp_path):
    w = Writer(tmp_path / "ck")
    a = w.add_array(("w",), (10,), dtypes.by_zarr("float32"), chunk_shape=(5,))
    a.write((0,), np.zeros(5, np.float32))
    with pytest.raises(ZarrckptError, match="not every chunk was written"):
        w.commit()
    assert not os.path.exists(tmp_path / "ck") and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with Writer(tmp_path / "ck") as w:
            w.add(("w",), np.ones(3))
            raise RuntimeError("the caller failed")
    assert os.listdir(tmp_path) == []
    with Writer(tmp_path / "ck") as w:
        w.add(("w",), np.ones(3))
    with pytest.raises(CheckpointExistsError):
        Writer(tmp_path / "ck")
    with Writer(tmp_path / "ck", overwrite=True) as w:
        w.add(("v",), np.zeros(2))
    assert zarrckpt.open(tmp_path / "ck").keys() == ["v"]
    with pytest.raises(ValueError, match="is a leaf"):
        with Writer(tmp_path / "ck2") as w:
            w.add(("a",), 1)
            w.add(("a", "b"), 2)
    assert not os.path.exists(tmp_path / "ck2")


def test_unpacked_arrays_read_by_zarr_python(tmp_path):
    zarr = pytest.importorskip("zarr")
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    with Writer(tmp_path / "ck", pack_bytes=0) as w:
        a = w.add_array(("m", "x"), x.shape, dtypes.by_numpy(x.dtype), chunk_shape=(1, 6))
        for start in a.chunk_starts():
            a.write(start, x[start[0]:start[0] + 1])
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "ck" / "m" / "x"), mode="r")[...], x)


def test_safetensors_conversion_needs_no_torch(tmp_path):
    code = f"""
import sys, numpy as np
sys.modules["torch"] = None  # importing torch now fails
from zarrckpt import convert
from zarrckpt.interop.safetensors_io import Planned, header_bytes
from zarrckpt.format import dtypes
items = [Planned("a.b", dtypes.by_zarr("bfloat16"), (3, 2), None)]
with open(r"{tmp_path}/x.safetensors", "wb") as f:
    f.write(header_bytes(items, None) + bytes(range(12)))
convert.from_safetensors(r"{tmp_path}/x.safetensors", r"{tmp_path}/ck")
convert.to_safetensors(r"{tmp_path}/ck", r"{tmp_path}/y.safetensors")
assert open(r"{tmp_path}/y.safetensors", "rb").read().endswith(bytes(range(12)))
print("checkpoint at", r"{tmp_path}/ck")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_none_values_are_values_not_arrays(tmp_path):
    """Issue 18: a None leaf was taken for an array, and the committed root named more arrays
    than num_arrays (every reader refused it)."""
    with Writer(tmp_path / "ck") as w:
        w.add(("w",), np.ones(3, np.float32))
        w.add(("optim", "param_groups", 0, "foreach"), None, containers=("dict", "list", "dict"))
        w.add(("x",), None)
    assert zarrckpt.load_state_dict(tmp_path / "ck")["optim"] == {"param_groups": [{"foreach": None}]}
    assert zarrckpt.load_state_dict(tmp_path / "ck")["x"] is None


def test_an_unreadable_root_is_never_committed(tmp_path, monkeypatch):
    """The root is parsed as readers parse it before the commit: a writer bug fails the save."""
    w = Writer(tmp_path / "ck")
    w.add(("w",), np.ones(3, np.float32))
    monkeypatch.setattr(w, "tree", lambda: {"dict": [["w", {"array": "w"}], ["v", {"array": "v"}]]})
    with pytest.raises(ZarrckptError, match="would not be readable.*num_arrays"):
        w.commit()
    assert not os.path.exists(tmp_path / "ck")
