"""Checkpoint tiers (spec §7.8) against plain async saves, in one run, on CPU gloo ranks or GPUs.

    python bench/tiers.py [--world 4] [--mib 256] [--saves 4] [--device cpu|cuda] [--out FILE]
                          [--message-mib 4] [--depth 3] [--transport gloo|nccl]

Ranks are spawned processes, two simulated nodes (ZARRCKPT_NODE). Prints, per rank 0:
time blocked per save (plain async_save to a directory vs a tiered manager's save), the
time until the local commit (replicas included), and restore times from the local tier,
from the peers (node1's tier wiped; the persistent directory moved away, so any read of it
would fail: bytes read from persistent storage = 0) and from the persistent copy; and the
replicas' own throughput (bytes a rank received / seconds of its replication phase, and the
same for the peer fetch). ``--message-mib``/``--depth``/``--transport`` set the tiers'
message size, slots per stream and transport (defaults: the library's).
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


def rank(r: int, world: int, port: int, root: str, mib: int, saves: int, out: str, device: str = "cpu",
         tune: dict | None = None) -> None:
    global DEVICE
    DEVICE = device
    tune = tune or {}
    if tune.get("transport"):
        os.environ["ZARRCKPT_TIER_TRANSPORT"] = tune["transport"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZARRCKPT_NODE=f"node{r * 2 // world}")
    if device == "cuda":  # NCCL for the job's own collectives, gloo beside it (zarrckpt's side group is gloo)
        torch.cuda.set_device(r % torch.cuda.device_count())
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=r, world_size=world)
    else:
        dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)
    res: dict = {"plain_blocked": [], "plain_total": [], "tier_blocked": [], "tier_local_commit": [],
                 "tier_replicate_s": [], "tier_replica_bytes": []}

    def tuned(mgr):
        if mgr._tiers is not None:
            if tune.get("message_mib"):
                mgr._tiers.message_bytes = int(tune["message_mib"] * (1 << 20))
            if tune.get("depth"):
                mgr._tiers.depth = tune["depth"]
        return mgr

    sd = state(world, mib, 1)
    for s in range(saves):  # plain async_save
        t0 = time.perf_counter()
        fut = zarrckpt.async_save(sd, os.path.join(root, "plain", f"s{s}"))
        res["plain_blocked"].append(time.perf_counter() - t0)
        fut.result()
        res["plain_total"].append(time.perf_counter() - t0)
    local, persistent = os.path.join(root, "local"), os.path.join(root, "persistent")
    with tuned(zarrckpt.CheckpointManager(persistent, local_dir=local, persist_every=saves, async_save=True)) as mgr:
        for s in range(1, saves + 1):
            t0 = time.perf_counter()
            fut = mgr.save(s, sd)
            res["tier_blocked"].append(time.perf_counter() - t0)
            rep = fut.result()
            res["tier_local_commit"].append(time.perf_counter() - t0)
            res["tier_replicate_s"].append(rep["seconds"].get("replicate", rep["seconds"].get("commit", 0.0)))
            res["tier_replica_bytes"].append(rep.get("replica_bytes_received", 0))
        mgr.wait()
    dist.barrier()

    def restore(tag: str) -> None:
        target = state(world, mib, 0)
        dist.barrier()
        t0 = time.perf_counter()
        with tuned(zarrckpt.CheckpointManager(persistent, local_dir=local)) as mgr:
            step = mgr.restore(target)
            rep = mgr.last_restore
            res[f"restore_{tag}"] = {"seconds": time.perf_counter() - t0, "step": step,
                                     "source": rep["source"],
                                     "fetched_bytes": rep.get("fetched_bytes_all_nodes", 0),
                                     "fetch_seconds": rep.get("fetch_seconds")}
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
    ap.add_argument("--message-mib", type=float, default=None, help="replica message size (MiB)")
    ap.add_argument("--depth", type=int, default=None, help="slots per replica stream and side")
    ap.add_argument("--transport", choices=["gloo", "nccl"], default=None,
                    help="replica transport (ZARRCKPT_TIER_TRANSPORT); nccl needs --device cuda")
    a = ap.parse_args()
    tune = {"message_mib": a.message_mib, "depth": a.depth, "transport": a.transport}
    root = tempfile.mkdtemp(prefix="zarrckpt-tiers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    out = os.path.join(root, "result.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(rank, args=(a.world, port, root, a.mib, a.saves, out, a.device, tune), nprocs=a.world,
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
    rep_s, rep_b = med(res["tier_replicate_s"]), med(res["tier_replica_bytes"])
    if rep_b:
        print(f"  replication (rank 0): {rep_b / 2**20:.1f} MiB received in {rep_s:.3f} s = "
              f"{rep_b / rep_s / 1e9:.2f} GB/s per rank")
    for tag in ("local", "peers", "persistent"):
        r = res[f"restore_{tag}"]
        print(f"  restore {tag:>10}: {r['seconds']:.3f} s (step {r['step']}, source {r['source']}, "
              f"fetched {r['fetched_bytes'] / 2**20:.1f} MiB by all nodes"
              + (f" in {r['fetch_seconds']:.3f} s" if r.get("fetch_seconds") else "") + ")")
    print("  bytes read from persistent storage during the peer restore: 0 (the directory was moved away)")


if __name__ == "__main__":
    sys.exit(main())
