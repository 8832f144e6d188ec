"""cProfile of one later async_save (many small leaves) and one load (moe-like leaves) on one
process; prints the top functions. A diagnostic for the per-leaf costs of BENCHMARKS.md.

    python bench/profile_one.py [--device cuda] [--dir /dev/shm/zprof] [--mib 1024] [--leaves 2169]

Every checkpoint it saves is verified (checksums at the call; the state overwritten when
``wait_staged()`` returns and restored after the commit; loaded back and compared), and
the profiled load is checked against the saved state (overwritten before it); a failure
prints "VERIFY FAILED" beside the time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import time

import torch
import torch.distributed as dist

import zarrckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import checksums, load_with, scramble, verify_checkpoint  # noqa: E402


def saved(sd: dict, path: str, prof=None) -> str:
    """One async save (under ``prof``, printing the time blocked, when given), verified:
    "" when its checkpoint holds the values at the call."""
    ref = checksums(sd, True)
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    fut = zarrckpt.async_save(sd, path)
    if prof is not None:
        prof.disable()
        print(f"async_save of {len(sd['model']):,} leaves: blocked {(time.perf_counter() - t0) * 1e3:.1f} ms")
    fut.wait_staged()
    scramble(sd)  # the state may change now
    fut.result()
    if next(iter(sd["model"].values())).is_cuda:
        torch.cuda.synchronize()
    scramble(sd)  # as it was at the call
    ok = verify_checkpoint(load_with("zc", path), sd, ref, True)["verified"]
    return "" if ok else f"VERIFY FAILED: {path} does not hold the values at the call"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default="/dev/shm/zprof")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--mib", type=int, default=1024, help="bytes of the many-leaf state")
    ap.add_argument("--leaves", type=int, default=2169)
    ap.add_argument("--load-arrays", type=int, default=300, help="8 MiB tensors of the loaded state")
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29544")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device(a.device)
    shutil.rmtree(a.dir, ignore_errors=True)
    sd = {"model": {f"layers.{i}.weight": torch.rand((a.mib << 20) // a.leaves // 4, device=dev)
                    for i in range(a.leaves)}}
    zarrckpt.reserve_staging(sd)
    failed = [f for f in (saved(sd, f"{a.dir}/a{i}") for i in range(3)) if f]
    pr = cProfile.Profile()
    failed += [f for f in [saved(sd, f"{a.dir}/ax", pr)] if f]
    print("\n".join(failed) or "every async save verified")
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    zarrckpt.release_staging()
    del sd
    sd = {"model": {f"e{i}": torch.rand(2 << 20, device=dev) for i in range(a.load_arrays)}}  # 8 MiB each
    ref = checksums(sd, True)
    zarrckpt.save(sd, f"{a.dir}/m")
    for _ in range(2):
        zarrckpt.load(sd, f"{a.dir}/m")
    scramble(sd)  # untimed: the load must put back every value
    pr = cProfile.Profile()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    pr.enable()
    rep: dict = {}
    zarrckpt.load(sd, f"{a.dir}/m", report=rep)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    pr.disable()
    dt = time.perf_counter() - t0
    ok = checksums(sd, True) == ref
    print(f"load of {a.load_arrays} x 8 MiB: " + (f"{dt:.3f} s" if ok else "VERIFY FAILED, no time")
          + f"; report {rep.get('seconds')}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
    shutil.rmtree(a.dir, ignore_errors=True)  # several GB of checkpoints
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
