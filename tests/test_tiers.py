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


def _knobs(rank: int, world: int, extra: dict) -> tuple[dict, dict]:
    """Test-only keys of ``extra`` (``_nodes``: node name per rank, ``_message_bytes``,
    ``_lanes``, ``_per_rank``: each rank also holds a key of its own, ``_step``: restore(step=)) apart
    from the manager's options; sets this rank's node."""
    extra = dict(extra)
    knobs = {k: extra.pop(k) for k in list(extra) if k.startswith("_")}
    nodes = knobs.get("_nodes")
    os.environ["ZARRCKPT_NODE"] = nodes[rank] if nodes else _node(rank, world)
    return knobs, extra


def _tuned(mgr, knobs):
    if "_message_bytes" in knobs:
        mgr._tiers.message_bytes = knobs["_message_bytes"]
    if "_lanes" in knobs:
        mgr._tiers.lanes = knobs["_lanes"]
    return mgr


def _own(rank: int, step: int) -> torch.Tensor:
    """The value of the key only rank ``rank`` holds (``_per_rank``)."""
    return torch.arange(3 + rank, dtype=torch.float64) * step + rank


def rank_save(rank, world, local, persistent, steps, async_save, extra):
    knobs, extra = _knobs(rank, world, extra)
    with _tuned(_mgr(local, persistent, async_save=async_save, **extra), knobs) as mgr:
        for s in steps:
            state = _state(world, s)
            if knobs.get("_per_rank"):
                state[f"own{rank}"] = _own(rank, s)
            mgr.save(s, state, metrics={"loss": 1.0 / s})
    return True


def rank_restore(rank, world, local, persistent, extra):
    knobs, extra = _knobs(rank, world, extra)
    target = _state(world, 0)
    if knobs.get("_per_rank"):
        target[f"own{rank}"] = torch.zeros(3 + rank, dtype=torch.float64)
    with _tuned(_mgr(local, persistent, **extra), knobs) as mgr:
        got = mgr.restore(target, knobs.get("_step"))
        rep = mgr.last_restore
    if got is None:
        return None
    full = target["w"].full_tensor()
    ok = torch.equal(full, _expected(got)) and torch.equal(target["b"], torch.arange(10.0) + got)
    if knobs.get("_per_rank"):
        ok = ok and torch.equal(target[f"own{rank}"], _own(rank, got))
    return {"step": got, "source": rep["source"], "exact": ok, "fetched": rep.get("fetched_bytes", 0),
            "persistent_bytes_read": rep.get("persistent_bytes_read"), "reason": rep.get("reason"),
            "skipped": rep.get("skipped")}


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
    # what else is there is a dead save's leftovers (spec 7.5): a pending claim of step 4,
    # which no reader takes for a checkpoint, a hidden directory, a lock file (looked at
    # before a manager exists: its background cleaner removes them)
    for n in os.listdir(persistent):
        if n not in ("step_00000002", "step_00000004"):
            assert n.startswith(".zarrckpt-"), n
    if os.path.exists(os.path.join(persistent, "step_00000004")):
        with open(os.path.join(persistent, "step_00000004", "zarr.json")) as f:
            assert json.load(f)["attributes"]["zarrckpt"]["state"] == "pending"
    mgr = zarrckpt.CheckpointManager(persistent)
    assert mgr.steps() == [2], mgr.steps()  # step 4 was never committed
    mgr.close()  # its background cleaner done (it would race with the clean_leftovers below)
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


# ---------------------------------------------------------- replicas: cases of issue 19's follow-up


def _listing(root) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root).replace(os.sep, "/")] = os.path.getsize(p)
    return out


def test_restore_older_step_from_peers(clusters, tmp_path):
    """restore(step=N) of a step older than the newest: from the peers when this node's copy
    is gone, with small messages and several lanes (files cut between messages, ranges and
    lanes)."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    _run_save(clusters, 4, local, persistent, persist_every=None, local_keep_last=3, _message_bytes=1000,
              _lanes=3)
    assert sorted(n for n in os.listdir(local / "node1") if n.endswith(".tier.json")) == [
        "step_00000003.tier.json", "step_00000004.tier.json", "step_00000005.tier.json"]
    shutil.rmtree(local / "node1")
    res = _restore(clusters, 4, local, persistent, persist_every=None, local_keep_last=3, _step=4,
                   _message_bytes=1000, _lanes=2)
    assert all(r["step"] == 4 and r["source"] == "peers" and r["exact"] for r in res), res
    # node1's ranks fetched the whole step 4 (node0's copy holds every node's files)
    m = json.loads((local / "node0" / "step_00000004.tier.json").read_text())
    total = sum(size for rel, size in dict(kv for n in m["files"].values() for kv in map(tuple, n)).items())
    assert sum(r["fetched"] for r in res) == total and res[0]["fetched"] == 0 and res[1]["fetched"] == 0
    # node1's copy of step 4 is complete, byte for byte node0's; steps 3 and 5 stayed gone
    assert _listing(local / "node1" / "step_00000004") == _listing(local / "node0" / "step_00000004")
    assert sorted(os.listdir(local / "node1")) == ["step_00000004", "step_00000004.tier.json"]
    for a, b in ((local / "node0" / "step_00000004", local / "node1" / "step_00000004"),):
        for rel in _listing(a):
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_save_with_per_rank_keys(clusters, tmp_path):
    """Ranks holding different keys (a plain tensor only one rank has): the local tier, the
    replicas and the restores (local, then peers) hold every rank's key."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    _run_save(clusters, 4, local, persistent, steps=(1, 2), persist_every=2, _per_rank=True)
    for node in ("node0", "node1"):
        m = json.loads((local / node / "step_00000002.tier.json").read_text())
        assert m["complete"]
        sd = zarrckpt.load_state_dict(str(local / node / "step_00000002"))
        for r in range(4):
            assert np.array_equal(np.asarray(sd[f"own{r}"]), _own(r, 2).numpy()), (node, r)
    sd = zarrckpt.load_state_dict(str(persistent / "step_00000002"))
    assert all(np.array_equal(np.asarray(sd[f"own{r}"]), _own(r, 2).numpy()) for r in range(4))
    res = _restore(clusters, 4, local, persistent, _per_rank=True)
    assert all(r["step"] == 2 and r["source"] == "local" and r["exact"] for r in res), res
    shutil.rmtree(local / "node0")
    shutil.rmtree(persistent)
    res = _restore(clusters, 4, local, persistent, _per_rank=True)
    assert all(r["step"] == 2 and r["source"] == "peers" and r["exact"] for r in res), res


def test_peer_restore_onto_other_world_sizes(clusters, tmp_path):
    """Saved by 4 ranks (2 nodes of 2); node1 wiped, no persistent root: restored from the
    peers onto 2 ranks (2 nodes of 1) and onto 3 ranks (nodes of 2 and 1)."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    _run_save(clusters, 4, local, persistent, steps=(1, 2, 3), persist_every=None, _message_bytes=2048)
    snapshot = tmp_path / "snapshot"
    shutil.copytree(local, snapshot)
    for world in (2, 3):
        shutil.rmtree(local)
        shutil.copytree(snapshot, local)
        shutil.rmtree(local / "node1")
        res = _restore(clusters, world, local, persistent, persist_every=None, _message_bytes=2048)
        assert all(r["step"] == 3 and r["source"] == "peers" and r["exact"] for r in res), (world, res)
        assert sum(r["fetched"] for r in res) > 0
        assert _listing(local / "node1" / "step_00000003") == _listing(local / "node0" / "step_00000003")


def test_uneven_nodes_two_replicas(clusters, tmp_path):
    """Nodes of different sizes (2, 1 and 1 ranks) and local_replicas=2: every node's copy
    holds every node's files (the one-rank nodes receive the two-rank node's two ranges);
    each node's own files in its manifest are exactly those its ranks wrote; a wiped node
    is restored from the peers."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    nodes = ["na", "na", "nb", "nc"]
    _run_save(clusters, 4, local, persistent, steps=(1, 2), persist_every=None, local_replicas=2,
              _nodes=nodes, _message_bytes=1500)
    listings = {n: _listing(local / n / "step_00000002") for n in ("na", "nb", "nc")}
    assert listings["na"] == listings["nb"] == listings["nc"]
    m = json.loads((local / "na" / "step_00000002.tier.json").read_text())
    assert m["complete"] and m["held"] == ["na", "nb", "nc"]
    listed = {rel: size for files in m["files"].values() for rel, size in files}
    assert listed == {k: v for k, v in listings["na"].items() if k != "zarr.json"}
    # with no replicas, a node's copy is what its own ranks wrote, as its manifest lists it
    _run_save(clusters, 4, tmp_path / "alone", persistent, steps=(1,), persist_every=None, local_replicas=0,
              _nodes=nodes)
    for n in ("na", "nb", "nc"):
        m = json.loads((tmp_path / "alone" / n / "step_00000001.tier.json").read_text())
        assert dict(map(tuple, m["files"][n])) == _listing(tmp_path / "alone" / n / "step_00000001"), n
    shutil.rmtree(local / "na")
    res = _restore(clusters, 4, local, persistent, persist_every=None, local_replicas=2, _nodes=nodes)
    assert all(r["step"] == 2 and r["source"] == "peers" and r["exact"] for r in res), res


def test_split_ranges_and_streams():
    """The byte ranges cover every file exactly once, in order, with (nearly) equal sizes,
    empty files included; streams map ranges to ranks of nodes of any size."""
    files = [("a", 10), ("e", 0), ("b", 1), ("c", 33), ("z", 0)]
    for parts in range(1, 8):
        ranges = tiers.split_ranges(files, parts)
        sizes = [sum(n for _, _, n, _ in r) for r in ranges]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 44, (parts, sizes)
        flat = [seg for r in ranges for seg in r]
        got: dict[str, list] = {}
        for rel, off, n, size in flat:
            got.setdefault(rel, []).append((off, n, size))
        assert list(got) == [rel for rel, _ in files]  # in order, each file once
        for rel, size in files:
            pieces = got[rel]
            assert [off for off, _, _ in pieces] == [sum(n for _, n, _ in pieces[:i]) for i in range(len(pieces))]
            assert sum(n for _, n, _ in pieces) == size and all(sz == size for _, _, sz in pieces)
    # a node of 3 ranks sending to nodes of 2 and 1: ranges 0, 1, 2 from ranks 0, 1, 2;
    # to ranks 10, 11, 10 and 20, 20, 20
    st = tiers.node_streams((0, 1, 2), [(10, 11), (20,)], files, 3)
    assert [(s.src, s.dst) for s in st] == [(0, (10, 20)), (1, (11, 20)), (2, (10, 20))]
    # a fetch by a node of 4 ranks from a node of 2, 2 lanes: 8 streams, every rank busy
    st = tiers.node_streams((0, 1), [(4, 5, 6, 7)], files, 4, lanes=2)
    assert [(s.src, s.dst) for s in st] == [(0, (4,)), (0, (4,)), (1, (5,)), (1, (5,)),
                                            (0, (6,)), (0, (6,)), (1, (7,)), (1, (7,))]
    assert sum(s.nbytes for s in st) == 44


# ---------------------------------------------------------- a rank killed during replication


def _four_processes(target, port, *args) -> list:
    """Ranks 0-3 as spawned processes running ``target(rank, 4, port, *args)``, joined (150 s
    each; any still alive then is killed)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, 4, port, *args)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return procs


def _kill_child(rank, world, port, local, die_rank, die_label, result_dir):
    """One rank of a world of its own: saves steps 1 and 2 (committed), then step 3, during
    whose replication rank ``die_rank`` kills itself (SIGKILL) after its first message."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZARRCKPT_NODE=_node(rank, world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))

    def hook(label, k):
        if label == die_label and k == 0 and rank == die_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    outcome = "committed"
    mgr = _mgr(local, os.path.join(local, "..", "persistent"), persist_every=None, async_save=True)
    mgr._tiers.message_bytes = 1024
    try:
        for s in (1, 2):
            mgr.save(s, _state(world, s)).result()
        tiers._transfer_hook = hook
        mgr.save(3, _state(world, 3)).result()
    except Exception as e:  # noqa: BLE001 - the expected outcome on the survivors
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(outcome)
    os._exit(0)  # the group is broken: no teardown, no waiting for it


@pytest.mark.parametrize("die_rank", [3, 0])
def test_rank_killed_during_replication(clusters, tmp_path, die_rank):
    """A rank is SIGKILLed while step 3's replicas are being sent: no node commits a copy of
    step 3 (no manifest), the survivors' saves fail instead of committing, and a restart
    restores step 2 bit-exact, from the local tiers and, with a node wiped, from the peers."""
    from _cluster import free_port

    local = tmp_path / "local"
    results = tmp_path / "results"
    results.mkdir()
    procs = _four_processes(_kill_child, free_port(), str(local), die_rank, "save 3", str(results))
    assert procs[die_rank].exitcode == -signal.SIGKILL
    outcomes = {int(f.name[4:]): f.read_text() for f in results.iterdir()}
    assert die_rank not in outcomes
    assert all(o != "committed" for o in outcomes.values()), outcomes  # no survivor thinks step 3 is saved
    for node in ("node0", "node1"):
        assert (local / node / "step_00000002.tier.json").exists()
        assert not (local / node / "step_00000003.tier.json").exists(), node
        assert not (local / node / "step_00000003").exists(), node  # only a hidden leftover
    res = _restore(clusters, 4, local, tmp_path / "persistent", persist_every=None)
    assert all(r["step"] == 2 and r["source"] == "local" and r["exact"] for r in res), res
    shutil.rmtree(local / ("node1" if die_rank == 3 else "node0"))
    res = _restore(clusters, 4, local, tmp_path / "persistent", persist_every=None)
    assert all(r["step"] == 2 and r["source"] == "peers" and r["exact"] for r in res), res
    # the dead save's hidden directory and lock are leftovers, cleaned by the next save
    _run_save(clusters, 4, local, tmp_path / "persistent", steps=(3,), persist_every=None)
    for node in ("node0", "node1"):
        assert not [n for n in os.listdir(local / node) if n.startswith(".zarrckpt-")], os.listdir(local / node)


def _fetch_kill_child(rank, world, port, local, message_bytes, result_dir):
    """One rank of a world of its own: restores (step 5 is newest; node1's copy lacks a
    file of node0, so node1 fetches node0's keys), and rank 2 (node1) kills itself right
    after writing the first message it received."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZARRCKPT_NODE=_node(rank, world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))

    def hook(label, k):
        if label == "restore 5 received" and k == 0 and rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    tiers._transfer_hook = hook
    outcome = "restored"
    mgr = _mgr(local, os.path.join(local, "..", "persistent"), persist_every=None, local_keep_last=3)
    mgr._tiers.message_bytes, mgr._tiers.lanes = message_bytes, 1
    try:
        mgr.restore(_state(world, 0))
    except Exception as e:  # noqa: BLE001 - the expected outcome on the survivors
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(outcome)
    os._exit(0)


def test_fetch_killed_midway_leaves_no_false_claim(clusters, tmp_path):
    """A fetch writes keys in place at their final sizes; when it is cut short (the
    receiving rank SIGKILLed after its first message, which ends in the middle of a key), the
    copy must not still claim the node it was fetching: node1's copy of step 5 had a damaged
    key of node0 (so node1 fetched node0's keys from node0); after the kill, with node0 gone,
    step 5 is not restorable and step 4 restores bit-exact from node1's copy."""
    from _cluster import free_port

    local = tmp_path / "local"
    kw = dict(persist_every=None, local_keep_last=3, chunk_target_bytes=None)  # a chunk per shard
    _run_save(clusters, 4, local, tmp_path / "persistent", steps=(3, 4, 5), **kw)
    m = json.loads((local / "node1" / "step_00000005.tier.json").read_text())
    own1 = {rel for rel, _ in m["files"]["node1"]}
    bucket = sorted((rel, size) for rel, size in m["files"]["node0"] if rel not in own1)
    first = tiers.split_ranges(bucket, 2)[0]  # what node1's first rank fetches, in order
    at, victim = 0, None
    for rel, off, n, size in first:
        if "/c/" in rel and off == 0 and n == size and size > 64:
            victim = (rel, at, size)
            break
        at += n
    assert victim is not None, first
    rel, at, size = victim
    (local / "node1" / "step_00000005" / rel).write_bytes(b"")  # damaged: node0 invalid in node1's copy
    results = tmp_path / "results"
    results.mkdir()
    # the first message ends in the middle of the victim
    procs = _four_processes(_fetch_kill_child, free_port(), str(local), at + size // 2, str(results))
    assert procs[2].exitcode == -signal.SIGKILL
    assert os.path.getsize(local / "node1" / "step_00000005" / rel) == size  # written in place, in part
    m = json.loads((local / "node1" / "step_00000005.tier.json").read_text())
    assert m["held"] == ["node1"] and not m["complete"], m["held"]  # un-claimed before the fetch
    assert not (local / "node1" / "step_00000005" / "zarr.json").exists()
    shutil.rmtree(local / "node0")
    res = _restore(clusters, 4, local, tmp_path / "persistent", **kw)
    assert all(r["step"] == 4 and r["source"] == "peers" and r["exact"] for r in res), res
