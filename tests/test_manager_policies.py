"""The CheckpointManager policies trainers configure (issue 17 item 5; torchtitan's names):
interval and first-step saves, a model-only last save in an export dtype, an initial load
path, load-only runs, path checks, retention errors that never undo a commit."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import zarrckpt
from zarrckpt.engine import commit as _commit


def state(v: float) -> dict:
    v = float(v)
    return {"model": {"w": torch.full((4, 4), v), "b": torch.full((4,), v), "n": torch.arange(3)},
            "optim": {"m": torch.full((4, 4), -v)}, "step": int(v)}


def test_interval_first_step_last_and_forced_saves(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", save_interval=3, save_first_step=True)
    saved = [s for s in range(1, 8) if mgr.save(s, state(s), last=(s == 7)) is not None]
    assert saved == [1, 3, 6, 7] and mgr.steps() == [1, 3, 6, 7]
    assert mgr.save(8, state(8)) is None and mgr.save(8, state(8), force=True) is not None
    assert [mgr.should_save(s) for s in (9, 10, 11, 12)] == [True, False, False, True]
    assert mgr.steps() == [1, 3, 6, 7, 8]


def test_load_only_runs_save_nothing_and_restore(tmp_path):
    zarrckpt.CheckpointManager(tmp_path / "run").save(5, state(5))
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", load_only=True)
    target = state(0)
    assert mgr.restore(target) == 5 and mgr.restored_from == "step"
    assert torch.equal(target["model"]["w"], torch.full((4, 4), 5.0))
    assert mgr.save(6, state(6)) is None and mgr.save(7, state(7), last=True) is None
    assert mgr.steps() == [5]


def test_last_save_exports_the_model_in_bf16_and_loads_into_fp32_with_cast(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", save_interval=10, last_save_model_only=True,
                                     export_dtype=torch.bfloat16)
    src = state(1.1)
    mgr.save(10, src)  # an ordinary save: everything, fp32
    mgr.save(12, src, last=True)  # the export
    ck = zarrckpt.open(mgr.step_path(12))
    assert sorted(ck.keys()) == ["model/b", "model/n", "model/w"]
    assert ck.array_info("model/w").dtype.zarr == "bfloat16" and ck.array_info("model/n").dtype.zarr == "int64"
    assert zarrckpt.open(mgr.step_path(10)).array_info("model/w").dtype.zarr == "float32"
    target = {"model": state(0)["model"]}
    with pytest.raises(zarrckpt.DTypeMismatchError):
        mgr.restore(target, step=12)
    assert mgr.restore(target, step=12, cast=True) == 12
    assert target["model"]["w"].dtype == torch.float32
    assert torch.equal(target["model"]["w"], torch.full((4, 4), 1.1).to(torch.bfloat16).float())
    assert torch.equal(target["model"]["n"], torch.arange(3))


def test_initial_load_path_fills_the_model_only_until_the_run_has_a_step(tmp_path):
    zarrckpt.save(state(3), tmp_path / "pretrained")
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", initial_load_path=tmp_path / "pretrained")
    target = state(0)
    assert mgr.restore(target) == 0 and mgr.restored_from == "initial"
    assert torch.equal(target["model"]["w"], torch.full((4, 4), 3.0))
    assert torch.equal(target["optim"]["m"], torch.full((4, 4), -0.0))  # model only: optim untouched
    mgr.save(1, state(1))
    again = state(0)
    assert mgr.restore(again) == 1 and mgr.restored_from == "step"
    assert torch.equal(again["optim"]["m"], torch.full((4, 4), -1.0))
    full = zarrckpt.CheckpointManager(tmp_path / "run2", initial_load_path=tmp_path / "pretrained",
                                      initial_load_model_only=False)
    target = state(0)
    assert full.restore(target) == 0 and torch.equal(target["optim"]["m"], torch.full((4, 4), -3.0))
    none = zarrckpt.CheckpointManager(tmp_path / "run3")
    assert none.restore(state(0)) is None and none.restored_from is None


@pytest.mark.parametrize("root", ["", "   ", " run", "run ", None, b"run", 3])
def test_paths_that_are_surely_mistakes_are_refused(tmp_path, root, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, TypeError)):
        zarrckpt.CheckpointManager(root)
    if root is not None:  # None: no initial load, the default
        with pytest.raises((ValueError, TypeError)):
            zarrckpt.CheckpointManager("run", initial_load_path=root)
    assert os.listdir(tmp_path) == []  # nothing created


@pytest.mark.parametrize("bad", [{"save_interval": 0}, {"save_interval": True}, {"export_dtype": torch.int8},
                                 {"export_dtype": "bf16"}, {"model_key": ""}])
def test_bad_policies_are_refused(tmp_path, bad):
    with pytest.raises(ValueError):
        zarrckpt.CheckpointManager(tmp_path / "run", **bad)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_retention_error_after_a_commit_is_a_warning(tmp_path, monkeypatch, caplog, async_save):
    def refuse(st):
        raise PermissionError(13, "Permission denied", str(st.url))

    monkeypatch.setattr(_commit, "retire", refuse)
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", keep_last=1, async_save=async_save)
    with caplog.at_level(logging.WARNING, logger="zarrckpt"):
        for s in (1, 2, 3):
            out = mgr.save(s, state(s))
            if async_save:
                out.result(timeout=60)
        mgr.wait()
    assert mgr.steps() == [1, 2, 3]  # nothing could be deleted; every save committed
    assert any("retention could not delete" in r.getMessage() for r in caplog.records)
    mgr.close()


def test_model_only_export_needs_the_model_key(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", last_save_model_only=True, model_key="net")
    with pytest.raises(KeyError, match="net"):
        mgr.save(1, state(1), last=True)
    assert mgr.steps() == []
