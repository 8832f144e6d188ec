"""A bounded chaos run of the checkpoint tiers (spec §7.8; issue 28), beside test_kill and
test_tiers' kill tests: one training run of 2 ranks on 2 simulated nodes, as nine jobs one
after the other, each a pair of spawned processes that restores, checks what it restored bit
for bit, and saves a few steps (``persist_every=2``, ``keep_last=2``, ``local_keep_last=2``).
Between and inside the jobs, faults at fixed points (so the test is deterministic):

1. fresh start, saves 1-4;
2. a rank SIGKILLed while step 6's replicas are sent (step 5 stands);
3. rank 0 SIGKILLed in the middle of step 6's promotion (6 stands locally, not promoted);
4. node1's tier wiped, and rank 1 SIGKILLed while it fetches step 6 from node0;
5. rank 0 SIGKILLed inside local retention (a manifest deleted, its copy not);
6. one flipped byte in one node's replica of step 8 (found, fetched again from its owner);
7. a reschedule onto node2/node3 (empty tiers): step 10 from the persistent root, saves 11-12;
8. back on node0/node1, whose tiers hold the stale step 10: step 12 from the persistent root,
   not a roll-back; rank 0 SIGKILLed inside the persistent root's retention;
9. a last restart.

Every restore must return the expected step (never older than the newest step that still
exists intact anywhere), with every value exact; a job that loses a rank must fail on the
survivor, never hang."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal

import torch

from _cluster import free_port
from test_tiers import _expected, _state

A, B = ["node0", "node1"], ["node2", "node3"]


def _job(rank, world, port, base, nodes, saves, kill, out):
    """One rank of one job: restore (checked), then save ``saves``; ``kill``: (rank, where,
    step) of the SIGKILL to inject, or None. Writes its outcome to ``out/rank<r>.json``."""
    from datetime import timedelta

    import torch.distributed as dist

    import zarrckpt
    from zarrckpt.api import tiers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZARRCKPT_NODE=nodes[rank])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    result = {}

    def record(**kw):
        result.update(kw)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    where, at = (kill[1], kill[2]) if kill and kill[0] == rank else (None, None)
    if where in ("replicate", "fetch"):
        label = f"save {at}" if where == "replicate" else f"restore {at} received"
        tiers._transfer_hook = lambda lab, k: die() if lab == label and k == 0 else None
    if where == "promote":
        calls = {"n": 0}

        def promotion_hook(rel):
            calls["n"] += 1
            if calls["n"] == 2:
                die()
        tiers._promotion_hook = promotion_hook
    if where == "local_retention":  # after step ``at``'s commit: the manifest goes, then death
        real = tiers.Tiers._retain_local

        def retain(self):
            if any(n.startswith(f"step_{at:08d}") for n in os.listdir(self.node_root)):
                def delete_then_die(root, name):
                    os.unlink(os.path.join(root, name + tiers.MANIFEST_SUFFIX))
                    die()
                tiers.delete_step = delete_then_die
            real(self)
        tiers.Tiers._retain_local = retain
    if where == "retention":
        zarrckpt.CheckpointManager._delete = lambda self, name, retire: die()

    mgr = zarrckpt.CheckpointManager(os.path.join(base, "persistent"), local_dir=os.path.join(base, "local"),
                                     local_replicas=1, persist_every=2, keep_last=2, local_keep_last=2,
                                     async_save=True, chunk_target_bytes=None)
    target = _state(world, 0)
    try:
        got = mgr.restore(target)
    except Exception as e:  # noqa: BLE001 - a job whose peer died: recorded
        record(error=f"{type(e).__name__}: {e}")
        os._exit(0)
    rep = mgr.last_restore or {}
    exact = got is None or (torch.equal(target["w"].full_tensor(), _expected(got))
                            and torch.equal(target["b"], torch.arange(10.0) + got) and target["step"] == got)
    record(restored=got, source=rep.get("source"), skipped=len(rep.get("skipped") or []), exact=exact)
    try:
        for s in saves:
            mgr.save(s, _state(world, s))
        mgr.close()
        record(saved=list(saves))
    except Exception as e:  # noqa: BLE001
        record(error=f"{type(e).__name__}: {e}")
    os._exit(0)


def _run(base, nodes, saves=(), kill=None) -> dict:
    out = os.path.join(base, "out")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_job, args=(r, 2, port, base, nodes, list(saves), kill, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    res = {}
    for r, p in enumerate(procs):
        path = os.path.join(out, f"rank{r}.json")
        res[r] = dict(json.load(open(path)) if os.path.exists(path) else {}, exitcode=p.exitcode)
    if kill is not None:
        assert res[kill[0]]["exitcode"] == -signal.SIGKILL, res
        other = 1 - kill[0]
        assert res[other]["exitcode"] == 0, res  # the survivor failed, not hung
    else:
        assert all(r["exitcode"] == 0 and "error" not in r for r in res.values()), res
    return res


def _restored(res: dict, step, source=None) -> None:
    for r, x in res.items():
        if "restored" not in x:
            continue  # killed before its restore ended (a fetch kill)
        assert x["restored"] == step and x["exact"], res
        assert source is None or x["source"] == source, res


def _persistent(base) -> list[int]:
    import zarrckpt

    return zarrckpt.CheckpointManager(os.path.join(base, "persistent")).steps()


def _flip_replica(base, step: int) -> None:
    """Flip a byte of one node's replica of the other node's chunk of ``b`` (every rank reads it)."""
    local = os.path.join(base, "local")
    m = json.load(open(os.path.join(local, "node0", f"step_{step:08d}.tier.json")))
    owner, rel = next((n, f[0]) for n in A for f in m["files"][n] if f[0].startswith("b/c/"))
    holder = next(n for n in A if n != owner)
    path = os.path.join(local, holder, f"step_{step:08d}", rel)
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def test_tiers_chaos(tmp_path):
    base = str(tmp_path)
    res = _run(base, A, saves=(1, 2, 3, 4))  # 1
    _restored(res, None)
    assert _persistent(base) == [2, 4]
    res = _run(base, A, saves=(5, 6), kill=(1, "replicate", 6))  # 2
    _restored(res, 4, "local")
    assert "error" in res[0], res
    res = _run(base, A, saves=(6, 7), kill=(0, "promote", 6))  # 3
    _restored(res, 5, "local")
    assert _persistent(base) == [2, 4]
    shutil.rmtree(os.path.join(base, "local", "node1"))  # 4
    res = _run(base, A, kill=(1, "fetch", 6))
    assert "error" in res[0], res
    res = _run(base, A, saves=(7, 8), kill=(0, "local_retention", 8))  # 5
    _restored(res, 6, "peers")
    _flip_replica(base, 8)  # 6
    res = _run(base, A, saves=(9, 10))
    _restored(res, 8, "peers")
    assert all(r["skipped"] == 1 for r in res.values()), res  # the damaged copy, said
    assert _persistent(base) == [4, 10]
    res = _run(base, B, saves=(11, 12))  # 7
    _restored(res, 10, "persistent")
    assert _persistent(base) == [10, 12]
    res = _run(base, A, saves=(13, 14), kill=(0, "retention", 14))  # 8
    _restored(res, 12, "persistent")
    assert 14 in _persistent(base)
    res = _run(base, A)  # 9
    _restored(res, 14, "local")
