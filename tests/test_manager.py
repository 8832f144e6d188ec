"""CheckpointManager: steps, retention, restore, no double saves, interrupted saves,
preemption, and a job killed mid-save that resumes from the previous step."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

import zarrckpt

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from _cluster import free_port  # noqa: E402


def st(step: int) -> dict:
    return {"w": torch.full((8, 8), float(step)), "step": step}


def test_steps_latest_restore(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run")
    assert mgr.latest_step() is None and mgr.steps() == []
    target = st(0)
    assert mgr.restore(target) is None and target["step"] == 0
    for s in (10, 20, 30):
        mgr.save(s, st(s), metrics={"loss": 1.0 / s})
    assert mgr.steps() == [10, 20, 30] and mgr.latest_step() == 30
    assert mgr.restore(target) == 30 and target["step"] == 30 and torch.equal(target["w"], st(30)["w"])
    assert mgr.restore(target, step=10) == 10 and target["step"] == 10
    assert mgr.metrics(20) == {"loss": 1.0 / 20}
    assert sorted(os.listdir(tmp_path / "run")) == ["step_00000010", "step_00000020", "step_00000030"]
    ck = zarrckpt.open(tmp_path / "run" / "step_00000020")
    assert ck.info.raw["attributes"]["zarrckpt"]["metadata"] == {"step": 20, "metrics": {"loss": 0.05}}


def test_retention_last_every_best(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", keep_last=2, keep_every=5, keep_best=1)
    losses = {1: 0.9, 2: 0.1, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.5, 7: 0.4, 8: 0.3, 9: 0.35, 10: 0.2, 11: 0.25}
    for s, loss in losses.items():
        mgr.save(s, st(s), metrics={"loss": loss})
    # last 2: 10, 11; every 5th: 5, 10; best loss: 2
    assert mgr.steps() == [2, 5, 10, 11]
    mgr_max = zarrckpt.CheckpointManager(tmp_path / "run2", keep_last=1, keep_best=2, best_metric="acc",
                                         best_mode="max")
    for s, acc in {1: 0.5, 2: 0.9, 3: 0.7, 4: 0.1}.items():
        mgr_max.save(s, st(s), metrics={"acc": acc})
    assert mgr_max.steps() == [2, 3, 4]


def test_no_two_saves_into_one_step(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run")
    mgr.save(1, st(1))
    with pytest.raises(zarrckpt.CheckpointExistsError):
        mgr.save(1, st(2))
    assert mgr.restore(st(0)) == 1 and zarrckpt.load_state_dict(mgr.step_path(1))["step"] == 1
    mgr.save(1, st(7), overwrite=True)
    assert zarrckpt.load_state_dict(mgr.step_path(1))["step"] == 7


def test_async_manager_and_one_step_in_flight(tmp_path):
    with zarrckpt.CheckpointManager(tmp_path / "run", keep_last=2, async_save=True) as mgr:
        futs = [mgr.save(s, st(s)) for s in range(1, 6)]
        assert all(hasattr(f, "result") for f in futs)
    assert mgr.steps() == [4, 5]
    with pytest.raises(zarrckpt.ZarrckptError, match="closed"):
        mgr.save(6, st(6))


def test_interrupted_saves_are_cleaned_never_the_latest(tmp_path):
    mgr = zarrckpt.CheckpointManager(tmp_path / "run", keep_last=5)
    mgr.save(1, st(1))
    mgr.save(2, st(2))
    # what saves that died leave: a pending claim, a hidden directory of its own
    os.makedirs(tmp_path / "run" / "step_00000003")
    root = json.loads((tmp_path / "run" / "step_00000002" / "zarr.json").read_text())
    root["attributes"]["zarrckpt"]["state"] = "pending"
    (tmp_path / "run" / "step_00000003" / "zarr.json").write_text(json.dumps(root))
    zarrckpt.save(st(4), tmp_path / "run" / ".step_00000004.zarrckpt-0123456789abcdef0123456789abcd")
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert mgr.latest_step() == 2
    mgr.save(5, st(5))
    assert sorted(os.listdir(tmp_path / "run")) == ["notes.txt", "step_00000001", "step_00000002",
                                                   "step_00000005"]


def test_unknown_options_fail_at_construction(tmp_path):
    with pytest.raises(TypeError, match="compresion"):
        zarrckpt.CheckpointManager(tmp_path / "run", compresion="zstd")
    with pytest.raises(ValueError, match="keep_last"):
        zarrckpt.CheckpointManager(tmp_path / "run", keep_last=0)


def test_on_memory_url():
    mgr = zarrckpt.CheckpointManager("memory://mgr/run", keep_last=1)
    for s in (1, 2, 3):
        mgr.save(s, st(s))
    assert mgr.steps() == [3]
    target = st(0)
    assert mgr.restore(target) == 3 and target["step"] == 3


PREEMPT_SCRIPT = """
import sys, time, torch
sys.path.insert(0, {repo!r})
import zarrckpt
state = {{"w": torch.zeros(4), "step": 0}}
with zarrckpt.CheckpointManager({root!r}, keep_last=2) as mgr:
    start = mgr.restore(state) or 0
    mgr.install_preemption_handler()
    print("ready", flush=True)
    for step in range(start + 1, 10**6):
        state["w"] += 1; state["step"] = step
        time.sleep(0.01)
        stop = mgr.reached_preemption(step)
        if step % 50 == 0 or stop:
            mgr.save(step, state)
        if stop:
            print("preempted at", step, flush=True)
            break
"""


def test_sigterm_saves_and_exits(tmp_path):
    root = str(tmp_path / "run")
    code = PREEMPT_SCRIPT.format(repo=os.path.dirname(TESTS), root=root)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    step = int(out.split("preempted at")[1])
    mgr = zarrckpt.CheckpointManager(root)
    assert mgr.latest_step() == step
    sd = zarrckpt.load_state_dict(mgr.step_path(step))
    assert sd["step"] == step and torch.equal(sd["w"], torch.full((4,), float(step)))


# --------------------------------------------------- killed mid-save, resumed elsewhere


def rank_train_and_die(rank, world, port, root, q):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (world,))
    mgr = zarrckpt.CheckpointManager(root, keep_last=3, pack_bytes=0)
    for step in (1, 2, 3):
        w = distribute_tensor(torch.full((64, 32), float(step)), mesh, [Shard(0)])
        if step == 3:
            from zarrckpt.storage import _tensorstore as t

            real = t._put_file
            calls = {"n": 0}

            def die(*a):
                calls["n"] += 1
                if calls["n"] == 3:
                    q.put((rank, "dying"))
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.05)
                real(*a)

            t._put_file = die
        mgr.save(step, {"w": w, **{f"b{i}": torch.full((4,), float(step)) for i in range(20)},
                        "step": step})
        q.put((rank, f"saved {step}"))


def test_killed_mid_save_resumes_from_previous_step_on_another_world_size(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    root = str(tmp_path / "run")
    port = free_port()
    procs = [ctx.Process(target=rank_train_and_die, args=(r, 2, port, root, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == -signal.SIGKILL for p in procs), [p.exitcode for p in procs]
    # one process resumes: the previous step, the state it held
    mgr = zarrckpt.CheckpointManager(root, keep_last=3, pack_bytes=0)
    assert mgr.latest_step() == 2
    target = {"w": torch.zeros(64, 32), **{f"b{i}": torch.zeros(4) for i in range(20)}, "step": 0}
    assert mgr.restore(target) == 2
    assert target["step"] == 2 and torch.equal(target["w"], torch.full((64, 32), 2.0))
    mgr.save(3, {**target, "step": 3})  # the interrupted step is reusable; leftovers go
    assert mgr.steps() == [1, 2, 3]
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002", "step_00000003"]
