"""cProfile of one later async_save (many small leaves) and one load (moe-like leaves) on one
process; prints the top functions. A diagnostic for the per-leaf costs of BENCHMARKS.md.

    python bench/profile_one.py [--device cuda] [--dir /dev/shm/zprof]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import time

import torch
import torch.distributed as dist

import zarrckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default="/dev/shm/zprof")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29544")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device(a.device)
    shutil.rmtree(a.dir, ignore_errors=True)
    sd = {"model": {f"layers.{i}.weight": torch.rand((1 << 30) // 2169 // 4, device=dev) for i in range(2169)}}
    zarrckpt.reserve_staging(sd)
    for i in range(3):
        zarrckpt.async_save(sd, f"{a.dir}/a{i}").result()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    fut = zarrckpt.async_save(sd, f"{a.dir}/ax")
    pr.disable()
    print(f"async_save of 2,169 leaves: blocked {(time.perf_counter() - t0) * 1e3:.1f} ms")
    fut.result()
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    zarrckpt.release_staging()
    del sd
    sd = {"model": {f"e{i}": torch.rand(2 << 20, device=dev) for i in range(300)}}  # 300 x 8 MiB
    zarrckpt.save(sd, f"{a.dir}/m")
    for _ in range(2):
        zarrckpt.load(sd, f"{a.dir}/m")
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    rep: dict = {}
    zarrckpt.load(sd, f"{a.dir}/m", report=rep)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    pr.disable()
    print(f"load of 300 x 8 MiB: {time.perf_counter() - t0:.3f} s; report {rep.get('seconds')}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    shutil.rmtree(a.dir, ignore_errors=True)  # several GB of checkpoints
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
