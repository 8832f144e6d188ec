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
from zarrckpt.storage import Storage

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
    script = f"""
import os, signal, sys, torch
sys.path.insert(0, {REPO!r})
import zarrckpt
from zarrckpt.storage import Storage

mgr = zarrckpt.CheckpointManager({str(root)!r}, keep_last=1, pack_bytes=0)
mgr.save(1, {{"w": torch.ones(64, 64), "v": torch.ones(8), "step": 1}})
real = Storage.remove

def remove_half_then_die(self):  # the deletion of step 1: one array's document, then killed
    path = self.local_path
    if path is not None and os.path.isdir(os.path.join(path, "w")):
        os.remove(os.path.join(path, "w", "zarr.json"))
        os.kill(os.getpid(), signal.SIGKILL)
    real(self)

Storage.remove = remove_half_then_die
mgr.save(2, {{"w": torch.full((64, 64), 2.0), "v": torch.ones(8), "step": 2}})
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    mgr = zarrckpt.CheckpointManager(root, keep_last=1, pack_bytes=0)
    assert mgr.steps() == [2] and mgr.latest_step() == 2
    target = {"w": torch.zeros(64, 64), "v": torch.zeros(8), "step": 0}
    assert mgr.restore(target) == 2 and torch.equal(target["w"], torch.full((64, 64), 2.0))
    mgr.save(3, {**target, "step": 3})
    assert sorted(os.listdir(root)) == ["step_00000003"]  # the half-deleted step is gone too


def test_object_store_retention_uncommits_before_deleting(monkeypatch):
    url = "memory://mgr-retire/run"
    mgr = zarrckpt.CheckpointManager(url, keep_last=1)
    mgr.save(1, st(1))

    def fail(self, *args, **kwargs):
        raise StorageError(f"injected: deleting {self.url}")

    monkeypatch.setattr(Storage, "clear", fail)
    monkeypatch.setattr(Storage, "remove", fail)
    mgr.save(2, st(2))  # retention of step 1 fails after its first phase
    assert mgr.steps() == [2] and mgr.latest_step() == 2
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load_state_dict(mgr.step_path(1))
    monkeypatch.undo()
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


def test_an_unreadable_newest_root_is_an_error_not_a_rollback(tmp_path, monkeypatch):
    root = tmp_path / "run"
    mgr = zarrckpt.CheckpointManager(root)
    for s in (1, 2, 3):
        mgr.save(s, st(s))
    os.makedirs(root / "step_00000004")  # a save just starting (absent root): skipped
    (root / "step_00000005").mkdir()
    (root / "step_00000005" / "zarr.json").write_text("not json")  # not a checkpoint: skipped
    assert mgr.steps() == [1, 2, 3]
    real = Storage.read_bytes

    def unavailable(self, key):
        if self.url.endswith("step_00000003") and key == "zarr.json":
            raise StorageError(f"reading {self.url}/{key}: UNAVAILABLE: HTTP 503 (injected)")
        return real(self, key)

    monkeypatch.setattr(Storage, "read_bytes", unavailable)
    for call in (mgr.steps, mgr.latest_step, lambda: mgr.restore(st(0))):
        with pytest.raises(StorageError, match="step_00000003.*503"):
            call()
    assert mgr.restore(target := st(0), step=2) == 2 and target["step"] == 2  # an explicit step still loads
    mgr.save(6, st(6))  # retention with an unreadable root deletes nothing ...
    monkeypatch.undo()
    assert mgr.steps() == [1, 2, 3, 6]


# ------------------------------------------------------------------ storage options (item 17)


def test_storage_options_reach_every_save_and_restore(tmp_path, monkeypatch):
    opts = zarrckpt.StorageOptions(request_retries=2, fsync="off")
    seen = []
    real_save, real_load = zarrckpt.save, zarrckpt.load

    def save(*args, **kwargs):
        seen.append(("save", kwargs.get("storage")))
        return real_save(*args, **kwargs)

    def load(*args, **kwargs):
        seen.append(("load", kwargs.get("storage")))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(zarrckpt, "save", save)
    monkeypatch.setattr(zarrckpt, "load", load)
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", storage=opts)
    assert mgr.storage.options is opts
    mgr.save(1, st(1))
    mgr.restore(st(0))
    assert seen == [("save", opts), ("load", opts)]
