"""Every feature on a real S3 server (SeaweedFS on 127.0.0.1, started by the suite):
multi-rank saves from ranks that share no local disk, async saves, resharded loads,
load_state_dict, open, the manager; and the ways object storage fails: a server stopped
mid-save, a missing bucket, refused credentials, a server that rejects writes, two
saves at once, an unreachable endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import zarrckpt
from _s3 import S3Server

TESTS = os.path.dirname(os.path.abspath(__file__))


def opts(srv: S3Server, *, readonly: bool = False, secret: str | None = None,
         retries: int = 2) -> zarrckpt.StorageOptions:
    """Explicit per-call settings: nothing from the environment or ~/.aws."""
    key, sec = ((srv.readonly_access_key, srv.readonly_secret_key) if readonly
                else (srv.access_key, srv.secret_key))
    return zarrckpt.StorageOptions(endpoint=srv.endpoint, region=srv.region, access_key_id=key,
                                   secret_access_key=secret or sec, request_retries=retries)


def state(v: float, rows: int = 32) -> dict:
    return {"model": {f"w{i}": torch.full((rows, 16), v + i) for i in range(4)},
            "opt": {"step": int(v), "lr": 0.1}, "small": torch.arange(5) + int(v)}


def check(sd: dict, v: float, rows: int = 32) -> None:
    assert sd["opt"] == {"step": int(v), "lr": 0.1}
    assert torch.equal(sd["small"], torch.arange(5) + int(v))
    for i in range(4):
        assert torch.equal(sd["model"][f"w{i}"], torch.full((rows, 16), v + i))


def test_one_process_everything(s3):
    url = s3.url(s3.fresh_prefix() + "c")
    o = opts(s3)
    rep = zarrckpt.save(state(1.0), url, storage=o)
    assert rep["bytes_written"] > 0
    check(zarrckpt.load_state_dict(url, storage=o), 1.0)
    ck = zarrckpt.open(url, endpoint=o.endpoint, region=o.region, access_key_id=o.access_key_id,
                       secret_access_key=o.secret_access_key)
    assert ck.read("opt/step") == 1 and ck.read("model/w2").tolist() == [[3.0] * 16] * 32
    with pytest.raises(zarrckpt.CheckpointExistsError):
        zarrckpt.save(state(2.0), url, storage=o)
    zarrckpt.save(state(2.0), url, storage=o, overwrite=True)
    target = state(0.0)
    zarrckpt.load(target, url, storage=o)
    check(target, 2.0)
    zarrckpt.async_save(state(3.0), url, storage=o, overwrite=True).result(timeout=60)
    check(zarrckpt.load_state_dict(url, storage=o), 3.0)


def test_environment_credentials_and_no_noise_on_stderr(s3, tmp_path):
    """The usual way (AWS_* variables), with HOME holding no ~/.aws: nothing on stderr."""
    url = s3.url(s3.fresh_prefix() + "c")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({k: v for k, v in s3.env().items()
                if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL")})
    env["HOME"] = str(tmp_path)
    code = (f"import sys, torch; sys.path.insert(0, {os.path.dirname(TESTS)!r}); import zarrckpt;"
            f"zarrckpt.save({{'w': torch.arange(4.0), 'n': 3}}, {url!r});"
            f"print(zarrckpt.load_state_dict({url!r})['n'])")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "3", r.stderr
    assert r.stderr == "", r.stderr


# ------------------------------------------------------- many ranks, no shared disk


def rank_no_shared_disk(rank, world, url, endpoint, region, key, secret, workdir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)  # as on separate nodes: a local directory of its own, empty
    o = zarrckpt.StorageOptions(endpoint=endpoint, region=region, access_key_id=key,
                                secret_access_key=secret, request_retries=2)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24)
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(8), "step": 5}
    rep = zarrckpt.save(sd, url, storage=o, inner_chunk_bytes=1024)
    fut = zarrckpt.async_save({"w": distribute_tensor(full + 1, mesh, [Shard(0)]), "step": 6},
                              url + "-async", storage=o, inner_chunk_bytes=1024)
    fut.result(timeout=60)
    # resharded: rows -> columns
    target = {"w": distribute_tensor(torch.zeros(64, 24), mesh, [Shard(1)]), "b": torch.zeros(8), "step": 0}
    report: dict = {}
    zarrckpt.load(target, url, storage=o, report=report)
    ok = torch.equal(target["w"].full_tensor(), full) and target["step"] == 5
    with zarrckpt.CheckpointManager(url + "-run", keep_last=2, storage=o) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": distribute_tensor(full * step, mesh, [Shard(0)])})
        steps = mgr.steps()
        t = {"w": distribute_tensor(torch.zeros(64, 24), mesh, [Shard(1)])}
        restored = mgr.restore(t)
        ok = ok and torch.equal(t["w"].full_tensor(), full * 3)
    return rep["bytes_written"], ok, os.listdir(workdir), steps, restored, report["bytes_fetched"], report["bytes_needed"]


def test_ranks_that_share_no_disk(s3, clusters, tmp_path):
    url = s3.url(s3.fresh_prefix() + "c")
    out = clusters(2).run(rank_no_shared_disk, url, s3.endpoint, s3.region, s3.access_key, s3.secret_key,
                          str(tmp_path / "node"))
    assert sum(o[0] for o in out) == 64 * 24 * 4 + 8 * 4  # every byte once
    for _, ok, local, steps, restored, fetched, needed in out:
        assert ok and local == [] and steps == [2, 3] and restored == 3
    # shared reads (the default on S3): owners fetch chunks for the others, so compare the job
    assert sum(o[5] for o in out) <= 1.1 * sum(o[6] for o in out)
    check_w = zarrckpt.load_state_dict(url, storage=opts(s3))
    assert torch.equal(check_w["w"], torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24))
    assert zarrckpt.load_state_dict(url + "-async", storage=opts(s3))["step"] == 6


# ------------------------------------------------------- failures


def test_server_stopped_mid_save_then_back(tmp_path):
    with S3Server() as srv:
        url_old, url_new = srv.url("old"), srv.url("new")
        o = opts(srv)
        zarrckpt.save(state(1.0), url_old, storage=o)
        zarrckpt.save(state(1.0), url_new, storage=o)
        from zarrckpt.storage import Array

        real = Array.write
        calls = {"n": 0}

        def stop_after_two(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                srv.kill()  # the server dies in the middle of the save
            return real(self, *a, **k)

        Array.write = stop_after_two
        t0 = time.monotonic()
        try:
            with pytest.raises(zarrckpt.StorageError, match="unreachable|failing|storage"):
                zarrckpt.save(state(2.0, rows=32768), url_new, storage=o, overwrite=True, pack_bytes=0)
        finally:
            Array.write = real
        assert time.monotonic() - t0 < 60
        srv.start()
        check(zarrckpt.load_state_dict(url_old, storage=o), 1.0)  # earlier checkpoints untouched
        with pytest.raises(zarrckpt.IncompleteCheckpointError):  # in place: an interrupted save
            zarrckpt.load_state_dict(url_new, storage=o)
        with pytest.raises(zarrckpt.CheckpointExistsError, match="unfinished save"):
            zarrckpt.save(state(3.0), url_new, storage=o)  # it might still be running ...
        zarrckpt.save(state(3.0), url_new, storage=o, overwrite=True)  # ... unless we say so
        check(zarrckpt.load_state_dict(url_new, storage=o), 3.0)


def test_missing_bucket(s3):
    t0 = time.monotonic()
    with pytest.raises(zarrckpt.StorageError, match="bucket"):
        zarrckpt.save(state(1.0), "s3://no-such-bucket-zz/c", storage=opts(s3))
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.load_state_dict("s3://no-such-bucket-zz/c", storage=opts(s3))
    assert time.monotonic() - t0 < 30


def test_refused_credentials_and_read_only_identity(s3):
    url = s3.url(s3.fresh_prefix() + "c")
    zarrckpt.save(state(1.0), url, storage=opts(s3))
    with pytest.raises(zarrckpt.StorageError, match="permission|credentials"):
        zarrckpt.save(state(2.0), url, storage=opts(s3, secret="wrong"), overwrite=True)
    with pytest.raises(zarrckpt.StorageError, match="permission"):
        zarrckpt.save(state(2.0), url, storage=opts(s3, readonly=True), overwrite=True)
    check(zarrckpt.load_state_dict(url, storage=opts(s3, readonly=True)), 1.0)  # untouched, readable


def test_two_saves_to_one_url_at_once(s3):
    """Conditional writes: of two saves claiming one URL at the same moment, one fails at
    its claim or its commit; what is committed is one save's data."""
    for trial in range(3):
        url = s3.url(s3.fresh_prefix() + f"race{trial}")
        results: dict = {}
        go = threading.Barrier(2)

        def run(v: float) -> None:
            go.wait()
            try:
                zarrckpt.save(state(v), url, storage=opts(s3), pack_bytes=0)
                results[v] = "ok"
            except zarrckpt.ZarrckptError as e:
                results[v] = type(e).__name__

        threads = [threading.Thread(target=run, args=(v,)) for v in (1.0, 2.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [v for v, r in results.items() if r == "ok"]
        assert len(winners) == 1, results
        loser = [r for r in results.values() if r != "ok"][0]
        assert loser in ("ConcurrentSaveError", "CheckpointExistsError"), results
        check(zarrckpt.load_state_dict(url, storage=opts(s3)), winners[0])


def test_manager_example_on_s3(s3):
    """examples/train_with_manager.py pointed at an s3:// URL: killed, resumed on 1 rank."""
    url = s3.url(s3.fresh_prefix() + "run")
    env = dict(os.environ, **{k: v for k, v in s3.env().items()
                              if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                       "AWS_ENDPOINT_URL")})
    script = os.path.join(os.path.dirname(TESTS), "examples", "train_with_manager.py")
    r = subprocess.run([sys.executable, script, url], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[world 1] resumed from step 20" in r.stdout and f"checkpoint at {url}/step_00000040" in r.stdout
    prefix = url.split("/", 3)[3] + "/"
    rel = [k[len(prefix):] for k in s3.list_objects(prefix=prefix)]
    assert {k.split("/")[0] for k in rel} == {"step_00000020", "step_00000030", "step_00000040"}


def test_incremental_saves_on_s3_copy_unchanged_chunks(s3):
    """An incremental manager on S3 copies the unchanged chunks server-side (spec §7.9,
    tests/test_s3_incremental.py has the rest), small ones too, and every step is whole."""
    pytest.importorskip("obstore")
    url = s3.url(s3.fresh_prefix() + "run")
    o = opts(s3)
    m = zarrckpt.CheckpointManager(url, keep_last=1, incremental=True, storage=o)
    reps = [m.save(step, state(1.0)) for step in (1, 2)]
    assert reps[0]["bytes_linked"] == 0 and reps[1]["bytes_linked"] == 4 * 32 * 16 * 4 + 5 * 8, reps
    assert m.steps() == [2]
    check(zarrckpt.load_state_dict(url.rstrip("/") + "/step_00000002", storage=o), 1.0)