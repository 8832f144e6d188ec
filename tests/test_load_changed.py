"""Loads that race an overwrite of the checkpoint they read (spec §7.3): wherever the
overwrite lands, the error is CheckpointChangedError, never an integrity or chunk error
and never a mix of two saves. A real ``save(overwrite=True)`` runs at each moment."""

from __future__ import annotations

import pytest
import torch

from _v11 import as_format_1_1

import zarrckpt
from zarrckpt.api import load as _load


def state(value: float, n: int = 3000) -> dict:
    return {"model": {"w": torch.full((n,), value), "b": torch.full((4,), value)}, "step": int(value)}


def target(n: int = 3000) -> dict:
    return {"model": {"w": torch.zeros(n), "b": torch.zeros(4)}, "step": -1}


def overwrite_before(monkeypatch, obj, name: str, path, n: int = 5000) -> None:
    """``obj.name`` runs after ``path`` was overwritten (other values and shapes)."""
    real = getattr(obj, name)

    def hooked(*args, **kwargs):
        zarrckpt.save(state(2.0, n), path, overwrite=True, pack_bytes=0)
        monkeypatch.setattr(obj, name, real)  # once
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, hooked)


def test_overwrite_between_the_root_and_the_array_documents(tmp_path, monkeypatch):
    """Was IntegrityError: the new save's array zarr.json does not match the old root's digest
    (a 1.1 checkpoint, whose loads read the array documents; 1.2 takes them from the root)."""
    path = tmp_path / "c"
    zarrckpt.save(state(1.0), path, pack_bytes=0)
    as_format_1_1(path)
    overwrite_before(monkeypatch, _load.LoadRun, "validate", path)
    t = target()
    with pytest.raises(zarrckpt.CheckpointChangedError, match="replaced while it was being read") as ei:
        zarrckpt.load(t, path)
    assert isinstance(ei.value.__cause__, zarrckpt.IntegrityError)
    assert not t["model"]["w"].any() and t["step"] == -1  # nothing loaded


@pytest.mark.parametrize("n", [3000, 5000], ids=["same-shapes", "other-shapes"])
def test_load_state_dict_overwrite_between_validation_and_chunk_reads(tmp_path, monkeypatch, n):
    """Was CorruptChunkError: the arrays opened with the old metadata read the new chunks."""
    path = tmp_path / "c"
    zarrckpt.save(state(1.0), path, pack_bytes=0)
    overwrite_before(monkeypatch, _load._Reads, "add", path, n)
    with pytest.raises(zarrckpt.CheckpointChangedError, match="replaced while it was being read"):
        zarrckpt.load_state_dict(path)


def test_in_place_load_overwrite_between_validation_and_chunk_reads(tmp_path, monkeypatch):
    path = tmp_path / "c"
    zarrckpt.save(state(1.0), path, pack_bytes=0)
    overwrite_before(monkeypatch, _load._Reads, "add", path)
    with pytest.raises(zarrckpt.CheckpointChangedError, match="replaced while it was being read"):
        zarrckpt.load(target(), path)


def test_overwrite_during_the_value_reads(tmp_path, monkeypatch):
    """Values and bytes leaves are read before the final check too."""
    path = tmp_path / "c"
    zarrckpt.save({**state(1.0), "blob": b"x" * 100_000}, path, pack_bytes=0)
    overwrite_before(monkeypatch, _load, "_load_value", path)
    with pytest.raises(zarrckpt.CheckpointChangedError):
        zarrckpt.load({**target(), "blob": b""}, path)


def test_a_damaged_document_without_an_overwrite_stays_an_integrity_error(tmp_path):
    path = tmp_path / "c"
    zarrckpt.save(state(1.0), path, pack_bytes=0)
    as_format_1_1(path)  # 1.2 loads read no array document (spec §6.7)
    f = path / "model" / "w" / "zarr.json"
    f.write_bytes(f.read_bytes().replace(b'"fill_value":0', b'"fill_value":1'))
    with pytest.raises(zarrckpt.IntegrityError, match="'model/w'"):
        zarrckpt.load(target(), path)
    with pytest.raises(zarrckpt.IntegrityError, match="'model/w'"):
        zarrckpt.load_state_dict(path)


def test_a_load_after_the_overwrite_reads_the_new_save(tmp_path):
    path = tmp_path / "c"
    zarrckpt.save(state(1.0), path, pack_bytes=0)
    zarrckpt.save(state(2.0), path, overwrite=True, pack_bytes=0)
    t = target()
    zarrckpt.load(t, path)
    assert torch.equal(t["model"]["w"], torch.full((3000,), 2.0)) and t["step"] == 2
