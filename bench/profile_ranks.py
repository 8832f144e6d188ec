"""Where one rank's sync save and load spend their time, on N ranks (NCCL on GPUs, gloo on
CPU): the save's and load's own phase timings per rank, and the wall time of the slowest
rank, for a bench model shape; every timed save is loaded back and checked against the
state at the call, every timed load against the saved state (overwritten before it).
A timing whose check fails is printed as VERIFY FAILED instead.

    torchrun --nproc-per-node 4 bench/profile_ranks.py --shape moe --hidden 1536 --state-gb 4 \
        --dir /dev/shm/zprof [--reps 3] [--dcp-threads 16]

Run under ``py-spy record --subprocesses --threads -f raw -o FILE -- torchrun ...`` for
stacks. ``--dcp-threads T`` also times DCP (``FileSystemWriter(thread_count=T)``) in the
same process, alternating with zarrckpt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import zarrckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import checksums, load_with, scramble, verify_checkpoint, verify_checksums  # noqa: E402
from models import build_state  # noqa: E402


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="moe")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--state-gb", type=float, default=4.0)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--expert-hidden", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/zprof")
    ap.add_argument("--dcp-threads", type=int, default=0)
    ap.add_argument("--options", default="{}", help="zarrckpt.save keyword options as JSON")
    ap.add_argument("--io-threads", type=int, default=0,
                    help="StorageOptions(file_io_concurrency=N) for zarrckpt's saves and loads (0: default)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval(S) in every rank (0: Python's default, 5 ms): how soon a "
                         "reader or writer thread back from a system call gets the GIL from a busy caller")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    cuda = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    cfg = SimpleNamespace(state_gb=a.state_gb, hidden=a.hidden, experts=a.experts,
                          expert_hidden=a.expert_hidden, vocab=a.vocab)
    sd, p = build_state(a.shape, cfg, torch.device("cuda") if cuda else torch.device("cpu"), mesh)
    n = sum(1 for _ in _leaves(sd))
    nbytes = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in _leaves(sd))
    if rank == 0:
        shutil.rmtree(a.dir, ignore_errors=True)
        print(f"{a.shape} {p}: {n} tensors, {nbytes / 1e9:.3f} GB on rank 0, world {world}", flush=True)
    dist.barrier()
    opts = json.loads(a.options)
    lopts = {}
    if a.io_threads:
        opts["storage"] = lopts["storage"] = zarrckpt.StorageOptions(file_io_concurrency=a.io_threads)
    ref = checksums(sd, True)
    rows = []
    for rep in range(a.reps):
        systems = ["zc", "dcp"] if a.dcp_threads else ["zc"]
        for s in systems if rep % 2 == 0 else systems[::-1]:
            path = f"{a.dir}/{s}{rep}"
            rep_save: dict = {}
            if s == "zc":
                secs = timed(lambda: rep_save.update(zarrckpt.save(sd, path, **opts)))
            else:
                secs = timed(lambda: dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=a.dcp_threads)))
            ok = verify_checkpoint(load_with(s, path), sd, ref, True)["verified"]
            saved = scramble(sd) is not None  # the load must put back every value
            rep_load: dict = {}
            if s == "zc":
                lsecs = timed(lambda: zarrckpt.load(sd, path, report=rep_load, **lopts))
            else:
                lsecs = timed(lambda: dcp.load(sd, checkpoint_id=path))
            lok = verify_checksums(sd, ref, True) and saved
            mine = {"rank": rank, "system": s, "rep": rep, "save_s": secs, "save_ok": ok, "load_s": lsecs,
                    "load_ok": lok, "save_timings": rep_save.get("seconds"), "load_timings": rep_load.get("seconds"),
                    "load_read": rep_load.get("read_seconds")}
            got = [None] * world
            dist.all_gather_object(got, mine)
            rows.extend(got)
            if rank == 0:
                tag = lambda ok, x: f"{x:.3f} s" if ok else "VERIFY FAILED"  # noqa: E731
                print(f"rep {rep} {s}: save {tag(ok, secs)} ({nbytes * world / secs / 1e9:.2f} GB/s), "
                      f"load {tag(lok, lsecs)} ({nbytes * world / lsecs / 1e9:.2f} GB/s)", flush=True)
                for r in got:
                    print(f"   rank {r['rank']} save {_fmt(r['save_timings'])} | load {_fmt(r['load_timings'])}"
                          + (f" | read: {_fmt(r['load_read'])}" if r.get("load_read") else ""))
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        for s in ("zc", "dcp"):
            mine = [r for r in rows if r["system"] == s and r["rank"] == 0]
            if mine:
                print(f"{s}: save median {statistics.median(r['save_s'] for r in mine):.3f} s, "
                      f"load median {statistics.median(r['load_s'] for r in mine):.3f} s")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"args": vars(a), "tensors": n, "bytes_per_rank": nbytes, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, torch.Tensor):
        yield obj


def _fmt(t) -> str:
    if not t:
        return "-"
    return " ".join(f"{k} {v:.3f}" for k, v in t.items() if isinstance(v, (int, float)))


if __name__ == "__main__":
    main()
