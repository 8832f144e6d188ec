"""Checkpoint tiers (spec §7.8): node-local copies with peer replicas, promotion to the
persistent root, restore from local / peers / persistent. 4 gloo ranks as 2 simulated
nodes (ZARRCKPT_NODE=node0/node1), restores onto 4 and 2 ranks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal

import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.api import tiers


def _state(world: int, step: int, mesh=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = mesh or init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(step)
    full = torch.randn(64, 24, generator=g)
    return {"w": distribute_tensor(full, mesh, [Shard(0)]),
            "b": torch.arange(10, dtype=torch.float32) + step,
            "step": step}


def _expected(step: int) -> torch.Tensor:
    return torch.randn(64, 24, generator=torch.Generator().manual_seed(step))


def _node(rank: int, world: int) -> str:
    return f"node{rank * 2 // world}" if world >= 2 else "node0"


def _mgr(local, persistent, **kw):
    kw.setdefault("local_replicas", 1)
    kw.setdefault("persist_every", 3)
    return zarrckpt.CheckpointManager(persistent, local_dir=local, **kw)


def rank_save(rank, world, local, persistent, steps, async_save, extra):
    os.environ["ZARRCKPT_NODE"] = _node(rank, world)
    with _mgr(local, persistent, async_save=async_save, **extra) as mgr:
        for s in steps:
            mgr.save(s, _state(world, s), metrics={"loss": 1.0 / s})
    return True


def rank_restore(rank, world, local, persistent, extra):
    os.environ["ZARRCKPT_NODE"] = _node(rank, world)
    target = _state(world, 0)
    with _mgr(local, persistent, **extra) as mgr:
        got = mgr.restore(target)
        rep = mgr.last_restore
    if got is None:
        return None
    full = target["w"].full_tensor()
    ok = torch.equal(full, _expected(got)) and torch.equal(target["b"], torch.arange(10.0) + got)
    return {"step": got, "source": rep["source"], "exact": ok, "fetched": rep.get("fetched_bytes", 0),
            "persistent_bytes_read": rep.get("persistent_bytes_read")}


def _run_save(clusters, world, local, persistent, steps=(1, 2, 3, 4, 5), async_save=True, **extra):
    assert all(clusters(world).run(rank_save, str(local), str(persistent), list(steps), async_save, extra))


def _restore(clusters, world, local, persistent, **extra):
    return clusters(world).run(rank_restore, str(local), str(persistent), extra)


def test_tiers_peers_persistent_and_world_size(clusters, tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    _run_save(clusters, 4, local, persistent)
    # each node holds its own files plus its peer's: every copy is complete (2 nodes, 1 replica)
    for node in ("node0", "node1"):
        names = sorted(os.listdir(local / node))
        assert names == ["step_00000004", "step_00000004.tier.json", "step_00000005",
                         "step_00000005.tier.json"], names  # local_keep_last=2
        m = json.loads((local / node / "step_00000005.tier.json").read_text())
        assert m["held"] == ["node0", "node1"] and m["complete"]
        # a complete local copy is a plain checkpoint
        sd = zarrckpt.load_state_dict(str(local / node / "step_00000005"))
        assert torch.equal(torch.as_tensor(np.asarray(sd["w"])), _expected(5))
    # every 3rd step was promoted
    assert zarrckpt.CheckpointManager(str(persistent)).steps() == [3]

    # all tiers intact: restored from the local tier
    res = _restore(clusters, 4, local, persistent)
    assert [r["source"] for r in res] == ["local"] * 4 and all(r["exact"] and r["step"] == 5 for r in res)

    # node1 replaced (empty local tier), persistent moved away: step 5 from the peers, bit-exact
    shutil.rmtree(local / "node1")
    moved = tmp_path / "moved"
    shutil.move(str(persistent), str(moved))
    res = _restore(clusters, 4, local, persistent)
    assert all(r["step"] == 5 and r["source"] == "peers" and r["exact"] for r in res), res
    assert sum(r["fetched"] for r in res) > 0 and all(r["persistent_bytes_read"] == 0 for r in res)
    assert not persistent.exists() or not any(persistent.iterdir())
    shutil.rmtree(persistent, ignore_errors=True)
    shutil.move(str(moved), str(persistent))

    # a different world size (2 ranks = 2 nodes of one rank): from the local tiers
    res = _restore(clusters, 2, local, persistent)
    assert all(r["step"] == 5 and r["exact"] for r in res), res

    # every local tier wiped: step 3 from persistent storage
    shutil.rmtree(local)
    res = _restore(clusters, 4, local, persistent)
    assert all(r["step"] == 3 and r["source"] == "persistent" and r["exact"] for r in res), res
    res = _restore(clusters, 2, local, persistent)
    assert all(r["step"] == 3 and r["source"] == "persistent" and r["exact"] for r in res), res


def test_incomplete_replica_is_never_used(clusters, tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    _run_save(clusters, 4, local, persistent, steps=(1, 2, 4, 5), async_save=False)
    # node0 wiped; node1's replica of node0's files for step 5 lost a file: step 5 cannot be
    # restored in full; step 4 (intact on node1) is restored from the peers instead
    shutil.rmtree(local / "node0")
    m = json.loads((local / "node1" / "step_00000005.tier.json").read_text())
    own1 = {rel for rel, _ in m["files"]["node1"]}
    victim = next(rel for rel, _ in m["files"]["node0"] if rel not in own1 and "/c" in rel)
    os.unlink(local / "node1" / "step_00000005" / victim)
    res = _restore(clusters, 4, local, persistent)
    assert all(r["step"] == 4 and r["source"] == "peers" and r["exact"] for r in res), res
    # a truncated file counts as missing too
    p = local / "node1" / "step_00000004"
    m4 = json.loads((local / "node1" / "step_00000004.tier.json").read_text())
    victim4 = next(rel for rel, size in m4["files"]["node0"] if rel not in own1 and size > 8)
    (p / victim4).write_bytes((p / victim4).read_bytes()[:-4])
    shutil.rmtree(local / "node0")
    res = _restore(clusters, 4, local, persistent)
    # no step is complete anywhere and nothing was promoted (persist_every=3, steps 1 2 4 5)
    assert all(r is None for r in res), res


def test_no_replicas_node_copy_is_partial(clusters, tmp_path):
    """local_replicas=0: a node's copy holds its own files only; there is no root, so no
    reader takes it for a checkpoint; with every node present the step is restored."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    _run_save(clusters, 4, local, persistent, steps=(1, 2), local_replicas=0)
    m = json.loads((local / "node0" / "step_00000002.tier.json").read_text())
    assert m["held"] == ["node0"] and not m["complete"]
    assert not (local / "node0" / "step_00000002" / "zarr.json").exists()
    res = _restore(clusters, 4, local, persistent, local_replicas=0)
    assert all(r["step"] == 2 and r["source"] == "peers" and r["exact"] for r in res), res
    # after the restore each node's copy is complete
    assert (local / "node0" / "step_00000002" / "zarr.json").exists()
    shutil.rmtree(local / "node1")  # node1 gone and no replicas
    shutil.rmtree(local / "node0" / "step_00000002")
    os.unlink(local / "node0" / "step_00000002.tier.json")
    res = _restore(clusters, 4, local, persistent, local_replicas=0)
    assert all(r is None for r in res), res  # step 1's node1 files are gone with node1


# ---------------------------------------------------------- a promotion killed mid-copy


def _hashes(root):
    import hashlib

    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _child_promote_and_die(local, persistent, die_at, snap):
    os.environ["ZARRCKPT_NODE"] = "solo"
    mgr = _mgr(local, persistent, persist_every=2)
    for s in (1, 2):
        mgr.save(s, {"w": torch.full((256, 64), float(s)), **{f"b{i}": torch.full((8,), float(s)) for i in range(6)}})
    mgr.wait()
    with open(snap, "w") as f:
        json.dump(_hashes(persistent), f)
    calls = {"n": 0}

    def hook(rel):
        calls["n"] += 1
        if calls["n"] == abs(die_at):
            if die_at < 0:
                raise OSError("simulated failure mid-copy")
            os.kill(os.getpid(), signal.SIGKILL)

    tiers._promotion_hook = hook
    for s in (3, 4):
        mgr.save(s, {"w": torch.full((256, 64), float(s)), **{f"b{i}": torch.full((8,), float(s)) for i in range(6)}})
    mgr.wait()
    mgr.close()


@pytest.mark.parametrize("how", ["killed", "failed"])
def test_promotion_interrupted_leaves_persistent_root_as_it_was(tmp_path, how):
    local, persistent = str(tmp_path / "local"), str(tmp_path / "persistent")
    snap = str(tmp_path / "snap.json")
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child_promote_and_die, args=(local, persistent, 3 if how == "killed" else -3, snap))
    p.start()
    p.join(120)
    assert p.exitcode == (-signal.SIGKILL if how == "killed" else 0), p.exitcode
    with open(snap) as f:
        before = json.load(f)
    assert sorted({k.split(os.sep)[0] for k in before}) == ["step_00000002"]
    mgr = zarrckpt.CheckpointManager(persistent)
    assert mgr.steps() == [2], mgr.steps()  # step 4 was never committed
    # what else is there is a dead save's leftovers (spec 7.5): a pending claim of step 4,
    # which no reader takes for a checkpoint, a hidden directory, a lock file
    for n in os.listdir(persistent):
        if n not in ("step_00000002", "step_00000004"):
            assert n.startswith(".zarrckpt-"), n
    if os.path.exists(os.path.join(persistent, "step_00000004")):
        with open(os.path.join(persistent, "step_00000004", "zarr.json")) as f:
            assert json.load(f)["attributes"]["zarrckpt"]["state"] == "pending"
    assert _hashes(persistent + "/step_00000002") == {
        k[len("step_00000002/"):]: v for k, v in before.items()}
    sd = zarrckpt.load_state_dict(os.path.join(persistent, "step_00000002"))
    assert np.array_equal(np.asarray(sd["w"]), np.full((256, 64), 2.0, dtype=np.float32))
    # leftovers of the dead promotion are cleaned like a dead save's (spec 7.5)
    from zarrckpt.engine.commit import clean_leftovers

    clean_leftovers(persistent)
    assert sorted(os.listdir(persistent)) == ["step_00000002"]
    # the local tier still has step 4, restorable without persistent storage
    os.environ["ZARRCKPT_NODE"] = "solo"
    try:
        with _mgr(local, persistent, persist_every=2) as m2:
            target = {"w": torch.zeros(256, 64), **{f"b{i}": torch.zeros(8) for i in range(6)}}
            assert m2.restore(target) == 4 and m2.last_restore["source"] == "local"
            assert torch.equal(target["w"], torch.full((256, 64), 4.0))
    finally:
        del os.environ["ZARRCKPT_NODE"]
