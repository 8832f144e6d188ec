"""Checkpoint tiers (spec §7.8) against plain async saves, in one run, on CPU gloo ranks or GPUs.

    python bench/tiers.py [--world 4] [--mib 256] [--saves 4] [--device cpu|cuda] [--out FILE]

Ranks are spawned processes, two simulated nodes (ZARRCKPT_NODE). Prints, per rank 0:
time blocked per save (plain async_save to a directory vs a tiered manager's save), the
time until the local commit (replicas included), and restore times from the local tier,
from the peers (node1's tier wiped; the persistent directory moved away, so any read of it
would fail: bytes read from persistent storage = 0) and from the persistent copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zarrckpt


DEVICE = "cpu"


def state(world: int, mib: int, step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(DEVICE, (world,))
    rows = mib * (1 << 20) // 4 // 1024
    g = torch.Generator().manual_seed(step)
    return {"w": distribute_tensor(torch.randn(rows, 1024, generator=g).to(DEVICE), mesh, [Shard(0)]), "step": step}


def rank(r: int, world: int, port: int, root: str, mib: int, saves: int, out: str, device: str = "cpu") -> None:
    global DEVICE
    DEVICE = device
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZARRCKPT_NODE=f"node{r * 2 // world}")
    if device == "cuda":  # NCCL for the job's own collectives, gloo beside it (zarrckpt's side group is gloo)
        torch.cuda.set_device(r % torch.cuda.device_count())
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=r, world_size=world)
    else:
        dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)
    res: dict = {"plain_blocked": [], "plain_total": [], "tier_blocked": [], "tier_local_commit": []}
    sd = state(world, mib, 1)
    for s in range(saves):  # plain async_save
        t0 = time.perf_counter()
        fut = zarrckpt.async_save(sd, os.path.join(root, "plain", f"s{s}"))
        res["plain_blocked"].append(time.perf_counter() - t0)
        fut.result()
        res["plain_total"].append(time.perf_counter() - t0)
    local, persistent = os.path.join(root, "local"), os.path.join(root, "persistent")
    with zarrckpt.CheckpointManager(persistent, local_dir=local, persist_every=saves, async_save=True) as mgr:
        for s in range(1, saves + 1):
            t0 = time.perf_counter()
            fut = mgr.save(s, sd)
            res["tier_blocked"].append(time.perf_counter() - t0)
            fut.result()
            res["tier_local_commit"].append(time.perf_counter() - t0)
        mgr.wait()
    dist.barrier()

    def restore(tag: str) -> None:
        target = state(world, mib, 0)
        dist.barrier()
        t0 = time.perf_counter()
        with zarrckpt.CheckpointManager(persistent, local_dir=local) as mgr:
            step = mgr.restore(target)
            res[f"restore_{tag}"] = {"seconds": time.perf_counter() - t0, "step": step,
                                     "source": mgr.last_restore["source"],
                                     "fetched_bytes": mgr.last_restore.get("fetched_bytes_all_nodes", 0)}
        dist.barrier()

    restore("warmup")  # the first load of a process pays for imports and contexts
    restore("local")
    if r == 0:
        shutil.rmtree(os.path.join(local, "node1"))
        os.rename(persistent, persistent + ".away")
    restore("peers")
    if r == 0:
        os.rename(persistent + ".away", persistent)
        shutil.rmtree(local)
    restore("persistent")
    if r == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default=None, help="also write the raw numbers here (JSON)")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zarrckpt-tiers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    out = os.path.join(root, "result.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(rank, args=(a.world, port, root, a.mib, a.saves, out, a.device), nprocs=a.world,
                           start_method="spawn")
        with open(out) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), **res}, f, indent=1)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"{a.device}: {a.world} ranks as 2 nodes, {a.mib} MiB state, {a.saves} saves each (rank 0; medians)")
    print(f"  blocked per save: plain async_save {med(res['plain_blocked']):.3f} s, tiers {med(res['tier_blocked']):.3f} s")
    print(f"  until committed:  plain async_save {med(res['plain_total']):.3f} s, tiers (local + replicas) "
          f"{med(res['tier_local_commit']):.3f} s")
    for tag in ("local", "peers", "persistent"):
        r = res[f"restore_{tag}"]
        print(f"  restore {tag:>10}: {r['seconds']:.3f} s (step {r['step']}, source {r['source']}, "
              f"fetched {r['fetched_bytes'] / 2**20:.1f} MiB by all nodes)")
    print("  bytes read from persistent storage during the peer restore: 0 (the directory was moved away)")


if __name__ == "__main__":
    sys.exit(main())
