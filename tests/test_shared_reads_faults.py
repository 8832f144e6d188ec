"""Shared reads when a rank dies (issue 28, item 7): every survivor fails promptly.

4 gloo ranks (group timeout 60 s) load a checkpoint with shared reads; rank 0 SIGKILLs itself
as it starts serving its chunks. Before, the survivors whose round check failed went on to
the load's C2 agreement (another all-reduce) while another survivor was still inside the
round's check: two different collectives, which only the group's timeout ended (30 min with
torch's default for gloo). Now a failed collective marks the group's ranks broken (no later
collective over them starts) and a rank blocked in an all-reduce leaves it as soon as the
store says another rank failed, or is gone (rank 0 hosts it here). The survivors stay alive
after they raise (their sockets stay open), so only that can end their waits.

The checkpoint is saved by one process (one chunk per array), so that each of the 4 ranks
reads a piece of every chunk through its owner (shared_reads=True on a local path)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch

import zarrckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cluster import free_port  # noqa: E402

ARRAYS = 24


def _worker(rank, world, port, path, victim, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import signal

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    target = {f"w{i}": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]) for i in range(ARRAYS)}
    if rank == victim:
        from zarrckpt.api import shared_reads

        def _serve(*args, **kwargs):
            out.put((rank, "died", time.time()))
            time.sleep(0.5)  # the message leaves first
            os.kill(os.getpid(), signal.SIGKILL)
        shared_reads._serve = _serve
    try:
        zarrckpt.load({"model": target}, path, shared_reads=True)
        out.put((rank, "ok", time.time()))
    except Exception as e:  # noqa: BLE001
        out.put((rank, f"{type(e).__name__}: {e}", time.time()))
    time.sleep(30)  # alive, sockets open: a peer's wait must end without our exit
    os._exit(0)


def _run(path, victim, world=4, limit=45.0):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, path, victim, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    died, results = None, {}
    deadline = time.monotonic() + limit
    try:
        while len(results) < world - 1 and time.monotonic() < deadline:
            try:
                rank, what, at = out.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            if what == "died":
                died = at
            else:
                results[rank] = (what, at)
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=5)
    return died, results


def test_rank_0_dying_while_serving_fails_every_other_rank_promptly(tmp_path):
    path = str(tmp_path / "ck")
    zarrckpt.save({"model": {f"w{i}": torch.full((64, 8), float(i)) for i in range(ARRAYS)}}, path)
    died, results = _run(path, victim=0)
    assert died is not None, results
    survivors = {1, 2, 3}
    assert set(results) == survivors, f"ranks {sorted(survivors - set(results))} still waiting: {results}"
    for rank, (what, at) in results.items():
        assert what.startswith("DistributedError"), (rank, what)
        assert at - died < 10, (rank, at - died, what)  # not the group's 60 s
