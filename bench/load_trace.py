"""Where a same-layout GPU load spends its time: a timeline of one rank's reads and copies.

    torchrun --nproc-per-node 2 bench/load_trace.py [--shape moe] [--state-gb 3] [--dir /dev/shm/zt]

Builds the FSDP2 + AdamW state of ``bench/models.py``, saves it with zarrckpt and with DCP,
then:

1. the file system alone: every rank reads its share of the checkpoint's chunk files with
   ``os.preadv`` in 8 MiB pieces into a pinned buffer and into plain memory, with 1-64
   threads, all ranks at once (GB/s per rank);
2. loads, DCP and zarrckpt alternating (slowest rank's seconds);
3. one more zarrckpt load traced on every rank: each direct-file read task (thread, start,
   end, bytes), the main thread's time adding reads, waiting for them, and issuing copies.

Prints a summary per rank and writes the traces to ``$OUT/load_trace_rank{r}.json``.
A probe, not a benchmark of record.

Every timed load is verified: the state's checksums are taken once after both saves (the
values the checkpoints must hold), the state is overwritten with garbage before each load
(untimed: every bit flipped, so a load that leaves anything out is caught), and after the
load its checksums must match. A load that fails reports no time (``None`` in ``loads``,
left out of the speedups; ``unverified`` counts them).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import os
import resource
import statistics
import sys
import threading
import time
import types

import crc32c
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zarrckpt  # noqa: E402
from harness import checksums, scramble  # noqa: E402
from models import finish_pair, saved_pair  # noqa: E402
from zarrckpt.api import load as zload  # noqa: E402
from zarrckpt.storage import _localfile  # noqa: E402


def chunk_files(root: str) -> list[str]:
    """Chunk files: every file below a ``c`` directory (spec: chunk keys ``c/i/j``)."""
    out = []
    for d, _, names in os.walk(root):
        if f"{os.sep}c{os.sep}" in d + os.sep:
            out += [os.path.join(d, n) for n in names]
    return sorted(out)


def raw_reads(files: list[str], threads: int, pinned: bool, piece: int = 8 << 20, crc: bool = False) -> float:
    """GB/s of reading ``files`` whole, ``piece`` bytes per task (and a CRC-32C of each)."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pinned).numpy()
    tasks, at = [], 0
    for f, n in zip(files, sizes):
        for off in range(0, n, piece):
            m = min(piece, n - off)
            tasks.append((f, off, at + off, m))
        at += n

    def one(t):
        f, off, dst, m = t
        fd = os.open(f, os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(buf[dst:dst + m])], off)
            if crc:
                crc32c.crc32c(memoryview(buf[dst:dst + m]))
        finally:
            os.close(fd)
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, tasks[:8]))  # warm the pool
        dist.barrier()
        t0 = time.perf_counter()
        list(pool.map(one, tasks))
        dt = time.perf_counter() - t0
    return total / dt / 1e9


def file_system_probe(out: dict, files: list[str], threads: str, cuda: bool) -> None:
    """Reads of the chunk files alone (this rank's share), with and without CRC-32C, and
    CRC-32C alone in 1 and 16 threads."""
    out["raw_files"] = len(files)
    out["raw_GBps"] = {}
    for pinned in ([True, False] if cuda else [False]):
        for t in (int(x) for x in threads.split(",")):
            out["raw_GBps"][f"{'pinned' if pinned else 'plain'} {t} threads"] = round(raw_reads(files, t, pinned), 2)
    for t in (16, 32):
        out["raw_GBps"][f"pinned {t} threads + crc32c"] = round(raw_reads(files, t, cuda, crc=True), 2)
    blob = np.random.randint(0, 255, 64 << 20, dtype=np.uint8)
    t0 = time.perf_counter()
    for _ in range(8):
        crc32c.crc32c(memoryview(blob))
    out["crc32c_1thread_GBps"] = round(8 * blob.nbytes / (time.perf_counter() - t0) / 1e9, 2)
    with cf.ThreadPoolExecutor(16) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda _: crc32c.crc32c(memoryview(blob)), range(64)))
        out["crc32c_16threads_GBps"] = round(64 * blob.nbytes / (time.perf_counter() - t0) / 1e9, 2)


class Trace:
    def __init__(self) -> None:
        self.reads: list = []
        self.main: list = []
        self.calls: dict = {}  # (name, thread) -> [seconds, bytes, calls]
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()

    def wrap(self):
        trace = self
        orig_units = _localfile.LocalArray._read_units
        orig_switch = zload._Reads._switch
        orig_add = zload._Reads.add

        def _read_units(self, box, origin, out, units, whole=frozenset()):
            t0 = time.perf_counter()
            try:
                return orig_units(self, box, origin, out, units, whole)
            finally:
                t1 = time.perf_counter()
                with trace.lock:
                    trace.reads.append((threading.get_ident(), t0 - trace.t0, t1 - trace.t0,
                                        len(units) * (self.codec.inner_nbytes + 4)))

        def _switch(self):
            t0 = time.perf_counter()
            self.pending.wait()
            t1 = time.perf_counter()
            pending_wait = self.pending.wait
            self.pending.wait = lambda: None
            try:
                orig_switch(self)
            finally:
                self.pending.wait = pending_wait
            t2 = time.perf_counter()
            trace.main.append(("switch", t0 - trace.t0, t1 - trace.t0, t2 - trace.t0, len(self.batch)))

        def add(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig_add(self, *a, **k)
            finally:
                trace.main.append(("add", t0 - trace.t0, time.perf_counter() - trace.t0))
        orig_preadv, orig_crc_mod, orig_open = _localfile._preadv_all, _localfile.crc32c, _localfile.os

        def timed(name, fn, nbytes):
            def call(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    with trace.lock:
                        rec = trace.calls.setdefault(name, [0.0, 0, 0])
                        rec[0] += dt
                        rec[1] += nbytes(a)
                        rec[2] += 1
            return call
        _localfile._preadv_all = timed("preadv", orig_preadv, lambda a: sum(memoryview(b).nbytes for b in a[1]))
        _localfile.crc32c = types.SimpleNamespace(crc32c=timed("crc32c", orig_crc_mod.crc32c,
                                                                lambda a: memoryview(a[0]).nbytes))
        _localfile.os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
        for name in ("open", "close", "fstat", "pread"):
            setattr(_localfile.os, name, timed(name, getattr(os, name), lambda a: 0))
        _localfile.LocalArray._read_units = _read_units
        zload._Reads._switch = _switch
        zload._Reads.add = add

        def undo():
            _localfile.LocalArray._read_units = orig_units
            zload._Reads._switch = orig_switch
            zload._Reads.add = orig_add
            _localfile._preadv_all, _localfile.crc32c, _localfile.os = orig_preadv, orig_crc_mod, orig_open
        return undo

    def summary(self, total: float) -> dict:
        r = sorted(self.reads, key=lambda x: x[1])
        busy = sum(b - a for _, a, b, _ in r)
        nbytes = sum(n for *_, n in r)
        adds = [x for x in self.main if x[0] == "add"]
        sw = [x for x in self.main if x[0] == "switch"]
        # concurrency over time: sample every ms
        span = (r[0][1], r[-1][2]) if r else (0, 0)
        samples = np.arange(span[0], span[1], 1e-3)
        conc = [sum(1 for _, a, b, _ in r if a <= s < b) for s in samples] if r else [0]
        rates = [n / (b - a) / 1e9 for _, a, b, n in r if b > a]
        return {"total_s": round(total, 3), "read_tasks": len(r), "bytes": nbytes, "threads": len({t for t, *_ in r}),
                "first_read_s": round(span[0], 3), "last_read_end_s": round(span[1], 3),
                "read_busy_thread_s": round(busy, 3), "mean_concurrency": round(float(np.mean(conc)), 1),
                "per_task_GBps_median": round(statistics.median(rates), 2) if rates else None,
                "job_read_GBps": round(nbytes / max(span[1] - span[0], 1e-9) / 1e9, 2),
                "calls": {k: {"s": round(v[0], 3), "GB": round(v[1] / 1e9, 3), "n": v[2]} for k, v in self.calls.items()},
                "add_calls": len(adds), "add_s": round(sum(b - a for _, a, b in adds), 3),
                "switches": [(round(a, 3), round(b - a, 3), round(c - b, 3), n) for _, a, b, c, n in sw]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="moe")
    ap.add_argument("--state-gb", type=float, default=3.0)
    ap.add_argument("--dir", default="/dev/shm/zt")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--raw-threads", default="1,8,16,32,64")
    ap.add_argument("--only-loads", action="store_true", help="skip the file-system probe")
    ap.add_argument("--defaults-only", action="store_true", help="DCP and zarrckpt's defaults only")
    ap.add_argument("--io-threads", default="", help="also load with these file_io_concurrency values (1,4,...)")
    ap.add_argument("--shared-reads", action="store_true", help="also load with shared_reads=True")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before every load (root)")
    a = ap.parse_args()
    sd, p, device, zpath, dpath = saved_pair(a.shape, a.state_gb, a.dir)
    cuda, rank, world = device.type == "cuda", dist.get_rank(), dist.get_world_size()
    ref = checksums(sd, True)  # what both checkpoints hold (the state has not changed since)
    out: dict = {"rank": rank, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                 "cpus": os.cpu_count(), "plan": p}
    if not a.only_loads:
        file_system_probe(out, chunk_files(zpath)[rank::world], a.raw_threads, cuda)
    if cuda:  # host->device bandwidth of one big pinned copy
        h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        d = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_GBps"] = round((1 << 30) / (time.perf_counter() - t0) / 1e9, 1)
        del h, d
    runs = hasattr(_localfile, "_Run")  # absent from code before this probe (run as a baseline)
    defaults = (_localfile._Run.MAX, _localfile._Run.SCRATCH) if runs else (0, 0)

    piece_default = _localfile.PIECE_BYTES

    def knobs(run_max: int = defaults[0], scratch: int = defaults[1], piece: int = piece_default, **_):
        """Set the direct reader's knobs (inner chunks per preadv, run buffer, bytes per read
        task); returns a function that restores them."""
        if not runs:
            return lambda: None
        _localfile._Run.MAX, _localfile._Run.SCRATCH, _localfile.PIECE_BYTES = run_max, scratch, piece

        def undo():
            (_localfile._Run.MAX, _localfile._Run.SCRATCH), _localfile.PIECE_BYTES = defaults, piece_default
        return undo
    variants = {
        "zarrckpt": {},
        "read tasks of 8 MiB": {"piece": 8 << 20},
        "read tasks of 4 MiB": {"piece": 4 << 20},
        "1 GiB in flight": {"load": {"max_inflight_bytes": 1 << 30}},
        "8 MiB tasks, 1 GiB in flight": {"piece": 8 << 20, "load": {"max_inflight_bytes": 1 << 30}},
    } if runs and not a.defaults_only else {"zarrckpt": {}}
    if a.shared_reads:
        variants["shared reads"] = {"load": {"shared_reads": True}}
    for n in filter(None, a.io_threads.split(",")):
        variants[f"{n} io threads"] = {"load": {"storage": zarrckpt.StorageOptions(file_io_concurrency=int(n))}}
    times: dict[str, list[float]] = {"dcp": [], **{k: [] for k in variants}}
    per_load: dict[str, list[dict]] = {}  # zarrckpt: each load's phases and garbage-collector time
    gc_passes: list[tuple[int, float]] = []
    cpu_s: dict[str, list[float]] = {}  # this process's CPU seconds (every thread) per load
    gc_start: list[float] = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_passes.append((info["generation"], time.perf_counter() - gc_start[0]))
    gc.callbacks.append(on_gc)
    unverified: dict[str, int] = {}
    for rep in range(a.reps):
        names = list(times) if rep % 2 == 0 else list(times)[::-1]
        for name in names:
            scramble(sd)  # untimed: the load must put back every value
            if a.drop_caches and rank == 0:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            if name == "dcp":
                dcp.load(sd, storage_reader=dcp.FileSystemReader(dpath))
            else:
                undo = knobs(**variants[name])
                rep_: dict = {}
                gc_passes.clear()
                try:
                    zarrckpt.load(sd, zpath, report=rep_, **variants[name].get("load", {}))
                finally:
                    undo()
                per_load.setdefault(name, []).append(
                    {**{k: round(v, 3) for k, v in rep_.get("seconds", {}).items()},
                     "gc_s": round(sum(d for _, d in gc_passes), 3), "gc_gen2": sum(1 for g, _ in gc_passes if g == 2)})
            if cuda:
                torch.cuda.synchronize()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu_s.setdefault(name, []).append(round(ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime, 3))
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            ok = checksums(sd, True) == ref  # untimed
            times[name].append(round(float(dt), 3) if ok else None)
            if not ok:
                unverified[name] = unverified.get(name, 0) + 1
    out["loads"] = times
    out["unverified"] = unverified
    out["per_load"] = per_load
    out["cpu_s"] = cpu_s

    def med(v):
        v = [x for x in v if x is not None]
        return statistics.median(v) if v else None
    out["speedup_median"] = {k: round(med(times["dcp"]) / med(v), 2) if med(times["dcp"]) and med(v) else None
                             for k, v in times.items()}
    trace = Trace()
    scramble(sd)
    undo = trace.wrap()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    trace.t0 = t0 = time.perf_counter()
    report: dict = {}
    zarrckpt.load(sd, zpath, report=report)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    undo()
    out["traced"] = trace.summary(total)
    out["traced"]["verified"] = checksums(sd, True) == ref
    out["phases"] = {k: round(v, 3) for k, v in report["seconds"].items()}
    print(json.dumps(out), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"load_trace_rank{rank}.json"), "w") as f:
            json.dump({**out, "reads": trace.reads, "main": trace.main}, f)
    finish_pair(a.dir)


if __name__ == "__main__":
    main()
