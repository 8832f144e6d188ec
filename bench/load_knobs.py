"""Where a same-layout load of many mid-size arrays spends its time (issue 16: GPU `moe`).

    torchrun --nproc-per-node 2 bench/load_knobs.py [--shape moe] [--state-gb 3] [--dir /dev/shm/zk]

Builds the FSDP2 + AdamW state of ``bench/models.py`` on every rank's GPU (CPU with gloo
when there is none), saves it once with zarrckpt and once with DCP (FileSystemWriter, 16
threads), then alternates loads: DCP (FileSystemReader, default) and zarrckpt with its
defaults and with one knob changed at a time (bytes in flight, staging, file threads).
Prints the slowest rank's seconds per variant (median of ``--reps``) and zarrckpt's own
per-phase seconds, as JSON lines. A probe, not a benchmark of record.

Every timed load is verified: the state is overwritten with garbage before it (untimed:
every bit flipped) and its checksums must match those taken after the saves; a load that
fails reports no time (``None``, left out of the medians; ``unverified`` counts them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zarrckpt  # noqa: E402
from harness import checksums, scramble  # noqa: E402
from models import finish_pair, saved_pair  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="moe")
    ap.add_argument("--state-gb", type=float, default=3.0)
    ap.add_argument("--dir", default="/dev/shm/zk")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's default zarrckpt loads")
    a = ap.parse_args()
    sd, p, device, zpath, dpath = saved_pair(a.shape, a.state_gb, a.dir)
    cuda, rank, world = device.type == "cuda", dist.get_rank(), dist.get_world_size()
    ref = checksums(sd, True)  # what both checkpoints hold (the state has not changed since)
    unverified: dict[str, int] = {}
    variants = {
        "zarrckpt": {},
        "inflight 1 GiB": {"max_inflight_bytes": 1 << 30},
        "staging 4 GiB": {"max_staging_bytes": 4 << 30},
        "inflight 1 GiB + staging 4 GiB": {"max_inflight_bytes": 1 << 30, "max_staging_bytes": 4 << 30},
        "64 file threads": {"storage": zarrckpt.StorageOptions(file_io_concurrency=64)},
    }
    times: dict[str, list[float]] = {k: [] for k in ["dcp", *variants]}
    phases: dict[str, list] = {k: [] for k in variants}
    for rep in range(a.reps):
        for name in ["dcp", *variants]:
            scramble(sd)  # untimed: the load must put back every value
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            report: dict = {}
            if name == "dcp":
                dcp.load(sd, storage_reader=dcp.FileSystemReader(dpath))
            elif a.profile and rank == 0 and name == "zarrckpt":
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
                zarrckpt.load(sd, zpath, report=report, **variants[name])
                prof.disable()
            else:
                zarrckpt.load(sd, zpath, report=report, **variants[name])
            if cuda:
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            ok = checksums(sd, True) == ref  # untimed
            times[name].append(float(dt) if ok else None)
            if not ok:
                unverified[name] = unverified.get(name, 0) + 1
            if report:
                phases[name].append({k: round(v, 3) for k, v in report["seconds"].items()})
    if rank == 0:
        med = {k: statistics.median(x for x in v if x is not None) for k, v in times.items()
               if any(x is not None for x in v)}
        out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": world, "plan": p,
               "seconds": {k: round(v, 3) for k, v in med.items()}, "unverified": unverified,
               "vs_dcp": {k: round(med["dcp"] / v, 2) for k, v in med.items() if "dcp" in med},
               "phases_rank0_last": {k: v[-1] for k, v in phases.items() if v}}
        print(json.dumps(out), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"load_knobs_{a.shape}.json"), "w") as f:
                json.dump({**out, "all": times}, f, indent=1)
    if a.profile and rank == 0:
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finish_pair(a.dir)


if __name__ == "__main__":
    main()
