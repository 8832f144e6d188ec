"""What a file system gives many small files against a few large ones (issue 30: are
thousands of chunk files what limits a many-small save or load?), with no checkpoint code:
``--procs`` processes (the ranks of one host) each write ``--bytes`` through ``--threads``
threads, once as ``--files`` files in a directory each (``a<i>/c/0``, as a chunk beside its
array's ``zarr.json``), once as one file per thread; then read each set back into one buffer.
Writes are not fsynced (tmpfs has nothing to sync; on disks pass ``--fsync``), reads follow
the writes (warm page cache: the bound of a warm load; drop the cache yourself for a cold one).

    python bench/files_bound.py --dir /dev/shm/zfb --procs 4 --threads 32 --files 2104 --bytes 1e9

Prints one line per case: aggregate GB/s over all processes (slowest process's time) and
files per second.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import shutil
import time

import numpy as np


def _write(path: str, buf: memoryview, fsync: bool) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.pwrite(fd, buf, 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: str, buf: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.preadv(fd, [buf], 0)
        assert n == len(buf), (path, n, len(buf))
    finally:
        os.close(fd)


def _proc(rank: int, a: argparse.Namespace, start, q) -> None:
    data = np.random.default_rng(rank).integers(0, 255, int(a.bytes), dtype=np.uint8)
    out = np.zeros_like(data)
    out.fill(1)  # faulted in before any timed read (a load reads into memory it owns already)
    res = {}
    for case, count in (("many", a.files), ("few", a.threads)):
        size = len(data) // count
        root = f"{a.dir}/{case}/r{rank}"
        paths = [f"{root}/a{i}/c/0" for i in range(count)]
        views = [memoryview(data)[i * size:(i + 1) * size] for i in range(count)]
        outs = [memoryview(out)[i * size:(i + 1) * size] for i in range(count)]
        with cf.ThreadPoolExecutor(a.threads) as ex:
            start.wait()
            t = time.perf_counter()
            list(ex.map(lambda pv: _write(pv[0], pv[1], a.fsync), zip(paths, views)))
            res[f"{case}_write"] = time.perf_counter() - t
            start.wait()
            t = time.perf_counter()
            list(ex.map(lambda pv: _read(pv[0], pv[1]), zip(paths, outs)))
            res[f"{case}_read"] = time.perf_counter() - t
        assert np.array_equal(out[:size * count], data[:size * count])
        start.wait()
        if rank == 0:
            shutil.rmtree(f"{a.dir}/{case}", ignore_errors=True)
        start.wait()
    q.put(res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--files", type=int, default=2104)
    ap.add_argument("--bytes", type=float, default=1e9, help="per process")
    ap.add_argument("--fsync", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for rep in range(a.reps):
        start, q = ctx.Barrier(a.procs), ctx.Queue()
        ps = [ctx.Process(target=_proc, args=(r, a, start, q)) for r in range(a.procs)]
        for p in ps:
            p.start()
        res = [q.get() for _ in ps]
        for p in ps:
            p.join()
        total = a.bytes * a.procs
        for case, count in (("many", a.files), ("few", a.threads)):
            for op in ("write", "read"):
                secs = max(r[f"{case}_{op}"] for r in res)
                rows.append({"rep": rep, "case": case, "files_per_proc": count, "op": op, "seconds": secs,
                             "GB_per_s": total / secs / 1e9, "files_per_s": count * a.procs / secs})
                print(f"rep {rep} {case:4s} ({count} files of {a.bytes / count / 1e6:.2f} MB per process) {op:5s}: "
                      f"{secs:.3f} s, {total / secs / 1e9:.2f} GB/s, {count * a.procs / secs:,.0f} files/s", flush=True)
    print(json.dumps({"args": vars(a), "rows": rows}))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
