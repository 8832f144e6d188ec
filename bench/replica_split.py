"""Replicated data: one writer per tensor vs split across replicas (replica_split_bytes).

    python bench/replica_split.py [dir]   # 2 gloo ranks, 4 replicated 128 MiB tensors, 4 reps

Prints per-configuration sorted save times (alternating order, page cache dropped).
"""
import os, shutil, subprocess, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zarrckpt

DIR = sys.argv[1] if len(sys.argv) > 1 else "/tmp/zarrckpt-replica-split"
def drop(): subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True)
def worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    sd = {f"emb{i}": torch.randn(8192, 4096) for i in range(4)}  # 4 x 128 MiB replicated plain tensors
    res = {}
    for rep in range(4):
        order = [("split", 64 << 20), ("one-writer", None)]
        if rep % 2: order.reverse()
        for name, split in order:
            path = f"{DIR}/{name}_{rep}"
            dist.barrier()
            if rank == 0: drop()
            dist.barrier(); t = time.perf_counter()
            rep_ = zarrckpt.save(sd, path, replica_split_bytes=split)
            dist.barrier(); res.setdefault(name, []).append((time.perf_counter() - t, rep_["bytes_written"]))
            if rank == 0: shutil.rmtree(path)
    if rank == 0 or True:
        print(rank, {k: (sorted(x for x, _ in v), v[0][1]) for k, v in res.items()}, flush=True)
if __name__ == "__main__":
    shutil.rmtree(DIR, ignore_errors=True)
    mp.spawn(worker, args=(2, 29544), nprocs=2)
