"""Replicated data: one writer per tensor vs split across replicas (replica_split_bytes).

    python bench/replica_split.py [dir] [--rows 8192] [--reps 4]
    # 2 gloo ranks, 4 replicated tensors of rows x 4096 fp32 (128 MiB at 8192 rows)

Prints per-configuration sorted save times (alternating order, page cache dropped). Every
save is verified: loaded back into fresh tensors and compared with the state's checksums
at the call (untimed); a save that fails prints no time ("VERIFY FAILED").
"""
import argparse, os, shutil, subprocess, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zarrckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import checksums, load_with, verify_checkpoint  # noqa: E402


def drop(): subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, stderr=subprocess.DEVNULL)
def worker(rank, world, port, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    sd = {f"emb{i}": torch.randn(a.rows, 4096) for i in range(4)}  # 4 replicated plain tensors
    res, failed = {}, {}
    for rep in range(a.reps):
        order = [("split", 64 << 20), ("one-writer", None)]
        if rep % 2: order.reverse()
        for name, split in order:
            path = f"{a.dir}/{name}_{rep}"
            ref = checksums(sd, True)  # untimed
            dist.barrier()
            if rank == 0: drop()
            dist.barrier(); t = time.perf_counter()
            rep_ = zarrckpt.save(sd, path, replica_split_bytes=split)
            dist.barrier(); dt = time.perf_counter() - t
            if verify_checkpoint(load_with("zc", path), sd, ref, True)["verified"]:  # untimed
                res.setdefault(name, []).append((dt, rep_["bytes_written"]))
            else:
                failed[name] = failed.get(name, 0) + 1
            if rank == 0: shutil.rmtree(path)
    print(rank, {k: (sorted(x for x, _ in v), v[0][1]) for k, v in res.items()},
          "all saves verified" if not failed else f"VERIFY FAILED (no time): {failed}", flush=True)
if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", default="/tmp/zarrckpt-replica-split")
    ap.add_argument("--rows", type=int, default=8192, help="rows of each 4096-wide fp32 tensor")
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    mp.spawn(worker, args=(2, 29544, a), nprocs=2)
