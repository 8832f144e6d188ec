"""Small objects on local file systems are written in batches (``ChunkWriter._later``,
``TensorStoreStorage.put_files``): the same files and bytes as one write per object, a
failure names the array that failed and keeps the old checkpoint, async saves too."""

from __future__ import annotations

import errno
import os
import re

import ml_dtypes
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.engine.save import ChunkWriter
from zarrckpt.storage import _tensorstore as t


def small_state(value: float, n: int = 150) -> dict:
    """Leaves of every small kind: float, bf16, bool, int, 0-d, and one array large enough
    for the sharded path (not batched)."""
    sd = {f"layers.{i}.w": torch.full((3, 5 + i % 7), value + i) for i in range(n)}
    sd["bf16"] = torch.arange(40, dtype=torch.bfloat16) * value
    sd["mask"] = torch.arange(33) % 3 == 0
    sd["ids"] = torch.arange(17, dtype=torch.int64) * int(value)
    sd["scalar"] = torch.tensor(value)
    sd["big"] = torch.full((1024, 1024), value)
    return {"model": sd, "step": int(value)}


def files(root) -> dict[str, bytes]:
    """Every chunk file and array document below ``root``, the save's own id masked (the
    root and the group documents also hold its time)."""
    out = {}
    for d, _, names in os.walk(root):
        for name in names:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, root)
            if name != "zarr.json" or os.path.exists(os.path.join(d, "c")) or "/c/" in rel:
                out[rel] = re.sub(rb'"save_id":"[0-9a-f]+"', b'"save_id":""', open(path, "rb").read())
    return out


@pytest.fixture
def batches(monkeypatch):
    """The batches written: their sizes (objects per put_files call)."""
    sizes: list[int] = []
    real = t.TensorStoreStorage.put_files

    def put_files(self, items):
        sizes.append(len(items))
        return real(self, items)
    monkeypatch.setattr(t.TensorStoreStorage, "put_files", put_files)
    return sizes


def test_batches_write_the_same_bytes_as_one_write_per_object(tmp_path, monkeypatch, batches):
    sd = small_state(3.0)
    zarrckpt.save(sd, tmp_path / "batched")
    assert batches and max(batches) <= ChunkWriter.BATCH_FILES
    assert sum(batches) >= 2 * 150  # a document and a chunk per small array
    monkeypatch.setattr(t.TensorStoreStorage, "puts_files", property(lambda self: False))
    before = len(batches)
    zarrckpt.save(sd, tmp_path / "one_by_one")
    assert len(batches) == before  # the per-object path
    a, b = files(tmp_path / "batched"), files(tmp_path / "one_by_one")
    assert a.keys() == b.keys() and len(a) > 300
    assert [k for k in a if a[k] != b[k]] == []
    out = zarrckpt.load_state_dict(tmp_path / "batched")
    for k, v in sd["model"].items():
        assert torch.equal(out["model"][k], v), k
    assert out["step"] == 3


def test_a_batch_is_bounded_by_bytes_too(tmp_path, batches, monkeypatch):
    monkeypatch.setattr(ChunkWriter, "BATCH_BYTES", 1000)
    sd = {f"w{i}": torch.full((100,), float(i)) for i in range(20)}  # 404 bytes per chunk file
    zarrckpt.save(sd, tmp_path / "c")
    assert batches and max(batches) <= 3
    out = zarrckpt.load_state_dict(tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_a_failed_batched_write_names_its_array_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c"
    zarrckpt.save(small_state(1.0), path)
    real = t._put_file

    def full(p, data, fsync):
        if f"{os.sep}layers.97.w{os.sep}c" in p:
            raise OSError(errno.ENOSPC, "No space left on device", p)
        real(p, data, fsync)
    monkeypatch.setattr(t, "_put_file", full)
    with pytest.raises(zarrckpt.StorageError, match=r"array 'model/layers\.97\.w'") as ei:
        zarrckpt.save(small_state(2.0), path, overwrite=True)
    assert ei.value.errno == errno.ENOSPC
    monkeypatch.setattr(t, "_put_file", real)
    out = zarrckpt.load_state_dict(path)
    assert out["step"] == 1 and torch.equal(out["model"]["layers.97.w"], torch.full((3, 5 + 97 % 7), 98.0))


def test_async_saves_batch_and_hold_the_values_at_the_call(tmp_path, batches):
    sd = small_state(1.0)
    futs = []
    for step in range(3):
        futs.append(zarrckpt.async_save(sd, tmp_path / f"s{step}"))
        for v in sd["model"].values():  # training goes on at once
            bump(v)
    for f in futs:
        f.result()
    assert batches
    want = small_state(1.0)["model"]
    for step in range(3):
        out = zarrckpt.load_state_dict(tmp_path / f"s{step}")
        for k, v in want.items():
            assert torch.equal(out["model"][k], v), (step, k)
            bump(v)


def bump(v: torch.Tensor) -> None:
    if v.dtype == torch.bool:
        v.logical_not_()
    else:
        v.add_(1)


def test_zarr_python_reads_batched_files(tmp_path):
    zarr = pytest.importorskip("zarr")
    sd = small_state(5.0, n=20)
    zarrckpt.save(sd, tmp_path / "c")
    g = zarr.open_group(str(tmp_path / "c"), mode="r")
    assert np.array_equal(g["model/layers.3.w"][...], sd["model"]["layers.3.w"].numpy())
    assert np.array_equal(g["model/mask"][...], sd["model"]["mask"].numpy())
    bf = g["model/bf16"][...]
    want = sd["model"]["bf16"].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    assert np.array_equal(np.asarray(bf).view(np.int16), want.view(np.int16))
