"""The CheckpointManager of a multi-rank job on a real S3 server (issue 28, items 5 and 6).

* A restarted job's first save of a step that the killed job left pending commits: the
  decision to overwrite it is rank 0's, broadcast, and retention (at the manager's first
  save, in rank 0's background thread) leaves a step being saved alone. Before, each rank
  decided from its own read of the root while rank 0's first retention deleted that step in
  between, and the save's agreement refused the mismatch (repro s3_restart_overwrite_race).
* Slow retention does not fail the next save: rank 0 no longer waits for the previous
  commit's deletions before the save's entry check, where the other ranks gave up and blamed
  it (repro s3_slow_retention_blocks_save). Retention is late, and still done.

Two gloo ranks spawned per test; S3 = SeaweedFS (tests/_s3.py), through the test proxy of
test_s3_manager_faults for slow DELETEs."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch

import zarrckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cluster import free_port  # noqa: E402
from test_s3_manager_faults import FailingProxy, opts  # noqa: E402


def _state(step: int, arrays: int) -> dict:
    return {"model": {f"w{i}": torch.full((64,), float(step)) for i in range(arrays)}, "step": step}


def _worker(rank, world, port, env, job, args, out):
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        out.put((rank, job(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))
    out.close()
    out.join_thread()  # the result is sent before the process ends
    os._exit(0)  # no teardown: a rank waiting for another must not hang the test


def _run(job, args, env, world=2, limit=120.0):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, env, job, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + limit
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, res = out.get(timeout=1)
                results[rank] = res
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert len(results) == world, f"ranks {sorted(set(range(world)) - set(results))} did not finish: {results}"
    return [results[r] for r in range(world)]


def _storage(endpoint, region, key, secret):
    return zarrckpt.StorageOptions(endpoint=endpoint, region=region, access_key_id=key,
                                   secret_access_key=secret, request_retries=2)


# ------------------------------------------------------------------ item 5


def job_restart_saves_pending_step(rank, url, storage):
    mgr = zarrckpt.CheckpointManager(url, keep_last=3, async_save=True, storage=_storage(*storage))
    target = _state(-1, 8)
    start = mgr.restore(target)
    fut = mgr.save(2, _state(2, 8))
    fut.result(timeout=60)
    mgr.close()
    return start, target["step"], mgr.steps()


def test_a_restarted_jobs_first_save_of_a_pending_step_commits(s3):
    prefix = s3.fresh_prefix()
    url = s3.url(prefix + "run")
    storage = (s3.endpoint, s3.region, s3.access_key, s3.secret_key)
    with zarrckpt.CheckpointManager(url, storage=_storage(*storage)) as job_a:
        job_a.save(1, _state(1, 8))
        job_a.save(2, _state(2, 8))
    # job A was killed while saving step 2: its root says "pending" (spec 7.4)
    bucket, key = s3.buckets[0], f"{prefix}run/step_00000002/zarr.json"
    root = json.loads(s3.get_object(bucket, key))
    root["attributes"]["zarrckpt"]["state"] = "pending"
    s3.put_object(bucket, key, json.dumps(root).encode())
    assert zarrckpt.CheckpointManager(url, storage=_storage(*storage)).steps() == [1]

    out = _run(job_restart_saves_pending_step, (url, storage), s3.env())
    assert out == [(1, 1, [1, 2])] * 2, out
    loaded = zarrckpt.load_state_dict(url.rstrip("/") + "/step_00000002", storage=_storage(*storage))
    assert loaded["step"] == 2 and torch.equal(loaded["model"]["w7"], torch.full((64,), 2.0))


# ------------------------------------------------------------------ item 6


def job_slow_retention(rank, url, storage):
    os.environ["ZARRCKPT_ENTRY_TIMEOUT"] = "4"  # the entry window, shorter than the deletion
    mgr = zarrckpt.CheckpointManager(url, keep_last=1, async_save=True, storage=_storage(*storage))
    mgr.save(1, _state(1, 24)).result(timeout=60)
    mgr.save(2, _state(2, 24)).result(timeout=60)  # committed: rank 0 now retires step 1, slowly
    t0 = time.monotonic()
    mgr.save(3, _state(3, 24)).result(timeout=60)
    took = time.monotonic() - t0
    mgr.close()  # waits for retention
    return took, mgr.steps()


def test_slow_retention_does_not_fail_the_next_save(s3):
    proxy = FailingProxy(s3.endpoint)
    try:
        proxy.delete_delay = 0.2  # step 1's ~50 objects: about 10 s of deletes, entry window 4 s
        url = s3.url(s3.fresh_prefix() + "run")
        storage = (proxy.endpoint, s3.region, s3.access_key, s3.secret_key)
        out = _run(job_slow_retention, (url, storage), s3.env(), limit=150)
        assert all(isinstance(o, tuple) for o in out), out  # save(3) committed on both ranks
        assert out[0][1] == [3], out  # rank 0's close() waited for retention: late, and done
        assert zarrckpt.CheckpointManager(url, storage=_storage(*storage)).steps() == [3]
        assert proxy.deletes > 20  # it was slow: longer than the entry window
    finally:
        proxy.close()
