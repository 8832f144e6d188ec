"""CheckpointManager across crashes: dead saves' leftovers removed (never a live save's),
retention that deletes in two phases (a kill between them leaves no committed-but-unreadable
step), retention of async saves in the background and after restarts, unreadable roots
raised instead of skipped, and storage options passed through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import zarrckpt
from zarrckpt.errors import StorageError
from zarrckpt.storage import FaultStorage
from zarrckpt.storage.memory import unavailable

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from test_clean import REPO, BlockedSave, hidden, killed_save  # noqa: E402


def st(step: int) -> dict:
    return {"w": torch.full((8, 8), float(step)), "step": step}


def step_save(root, step: int) -> str:
    """A manager's save of ``step`` (for the scripts of test_clean)."""
    return (f"zarrckpt.CheckpointManager({str(root)!r}).save({step}, "
            f"{{'w': torch.ones(256, 1024), 'step': {step}}})")


# ------------------------------------------------------------------ leftovers (item 6)


def test_manager_removes_dead_leftovers_when_constructed(tmp_path):
    root = tmp_path / "run"
    zarrckpt.CheckpointManager(root).save(1, st(1))
    killed_save(step_save(root, 2))
    assert len(hidden(root)) == 2 and "step_00000002" in os.listdir(root)
    mgr = zarrckpt.CheckpointManager(root)
    mgr.wait()  # cleaning runs in the background
    assert sorted(os.listdir(root)) == ["step_00000001"]
    assert mgr.steps() == [1]


def test_manager_retention_leaves_a_live_save_of_another_job_alone(tmp_path):
    root = tmp_path / "run"
    with BlockedSave(step_save(root, 7)):
        before = sorted(os.listdir(root))
        mgr = zarrckpt.CheckpointManager(root, keep_last=1)
        for s in (1, 2, 3):
            mgr.save(s, st(s))
        mgr.close()
        assert sorted(os.listdir(root)) == sorted(before + ["step_00000003"])
    mgr = zarrckpt.CheckpointManager(root, keep_last=1)
    mgr.save(4, st(4))  # the other job is gone now: its leftovers go
    assert sorted(os.listdir(root)) == ["step_00000004"]


# ------------------------------------------------------------------ two-phase deletion (item 14)


def test_a_kill_while_retention_deletes_leaves_no_committed_unreadable_step(tmp_path):
    root = tmp_path / "run"
    store = FaultStorage(root)
    mgr = zarrckpt.CheckpointManager(store, keep_last=1, pack_bytes=0)
    mgr.save(1, {"w": torch.ones(64, 64), "v": torch.ones(8), "step": 1})
    # the deletion of step 1 (key by key, in key order) dies once array v is gone: what a
    # kill there leaves on disk, and the lock of the deletion is released as a kill does
    store.fail(ops="delete", keys="*/w/*", error=unavailable("killed while deleting"))
    mgr.save(2, {"w": torch.full((64, 64), 2.0), "v": torch.ones(8), "step": 2})
    assert any(e.op == "delete" and e.error is None for e in store.events)  # half deleted
    store.heal()
    mgr = zarrckpt.CheckpointManager(root, keep_last=1, pack_bytes=0)
    assert mgr.steps() == [2] and mgr.latest_step() == 2
    target = {"w": torch.zeros(64, 64), "v": torch.zeros(8), "step": 0}
    assert mgr.restore(target) == 2 and torch.equal(target["w"], torch.full((64, 64), 2.0))
    mgr.save(3, {**target, "step": 3})
    assert sorted(os.listdir(root)) == ["step_00000003"]  # the half-deleted step is gone too


def test_object_store_retention_uncommits_before_deleting():
    store = FaultStorage()  # memory: an object store's rules
    mgr = zarrckpt.CheckpointManager(store, keep_last=1)
    mgr.save(1, st(1))
    store.fail(ops=("clear", "remove"), keys="step_00000001", error=unavailable("injected: deleting"))
    mgr.save(2, st(2))  # retention of step 1 fails after its first phase
    assert mgr.steps() == [2] and mgr.latest_step() == 2
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load_state_dict(mgr.step_path(1))
    store.heal()
    mgr.save(3, st(3))
    assert mgr.steps() == [3] and mgr.storage.list_children() == ["step_00000003"]


# ------------------------------------------------------------------ async retention (item 15)


def test_async_retention_runs_in_the_background_after_each_commit(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", keep_last=2, async_save=True)
    for s in range(1, 6):
        mgr.save(s, st(s)).result()
    deadline = time.monotonic() + 30
    while mgr.steps() != [4, 5] and time.monotonic() < deadline:  # no save/wait/close called
        time.sleep(0.05)
    assert mgr.steps() == [4, 5]
    mgr.close()


KILLED_AFTER_ASYNC_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
import zarrckpt
mgr = zarrckpt.CheckpointManager({root!r}, keep_last=2, async_save=True)
step = (mgr.latest_step() or 0) + 1
mgr.save(step, {{"w": torch.full((64, 64), float(step)), "step": step}}).result()
print(len(mgr.steps()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # right after the commit, before anything else
"""


def test_jobs_killed_after_each_async_save_stay_within_keep_last_plus_one(tmp_path):
    root = str(tmp_path / "run")
    code = KILLED_AFTER_ASYNC_SAVE.format(repo=REPO, root=root)
    for run in range(1, 6):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert p.returncode == -signal.SIGKILL, p.stderr
        assert int(p.stdout) <= 3, (run, p.stdout)  # as seen at the commit
        steps = zarrckpt.CheckpointManager(root).steps()
        assert len(steps) <= 3 and steps[-1] == run, (run, steps)


# ------------------------------------------------------------------ unreadable roots (item 16)


def test_an_unreadable_newest_root_is_an_error_not_a_rollback(tmp_path):
    root = tmp_path / "run"
    store = FaultStorage(root)
    mgr = zarrckpt.CheckpointManager(store)
    for s in (1, 2, 3):
        mgr.save(s, st(s))
    os.makedirs(root / "step_00000004")  # a save just starting (absent root): skipped
    (root / "step_00000005").mkdir()
    (root / "step_00000005" / "zarr.json").write_text("not json")  # not a checkpoint: skipped
    assert mgr.steps() == [1, 2, 3]
    store.fail(ops="read_bytes", keys="step_00000003/zarr.json", error=unavailable("HTTP 503 (injected)"))
    for call in (mgr.steps, mgr.latest_step, lambda: mgr.restore(st(0))):
        with pytest.raises(StorageError, match="step_00000003.*503"):
            call()
    assert mgr.restore(target := st(0), step=2) == 2 and target["step"] == 2  # an explicit step still loads
    mgr.save(6, st(6))  # retention with an unreadable root deletes nothing ...
    store.heal()
    assert mgr.steps() == [1, 2, 3, 6]


# ------------------------------------------------------------------ storage options (item 17)


def test_storage_options_reach_every_save_and_restore(tmp_path, monkeypatch):
    opts = zarrckpt.StorageOptions(request_retries=2, fsync="off")
    seen = []
    from zarrckpt.api.load import load as real_load  # what the manager calls (not the facade)
    from zarrckpt.api.save import save as real_save

    def save(*args, **kwargs):
        seen.append(("save", kwargs.get("storage")))
        return real_save(*args, **kwargs)

    def load(*args, **kwargs):
        seen.append(("load", kwargs.get("storage")))
        return real_load(*args, **kwargs)

    monkeypatch.setattr("zarrckpt.api.save.save", save)
    monkeypatch.setattr("zarrckpt.api.load.load", load)
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", storage=opts)
    assert mgr.storage.options is opts
    mgr.save(1, st(1))
    mgr.restore(st(0))
    assert seen == [("save", opts), ("load", opts)]
