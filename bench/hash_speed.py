"""Throughput of candidate per-chunk content hashes (issue 31: incremental checkpoints).

    python bench/hash_speed.py                     # the table (about 30 s on 2 cores)
    python bench/hash_speed.py --seconds 0.1 --repeat 1 --sizes 1M   # a quick look
    python bench/hash_speed.py --json out.json     # also write the numbers
    python bench/hash_speed.py --write-dir /dev/shm  # and the save path: write vs hash vs link

For each hash and buffer size it prints:

* ``1 thread``: GB per CPU second of one thread hashing one buffer again and again
  (``time.thread_time``, so load from other processes does not lower it: a per-core
  figure). The buffer stays in cache up to the L2/L3 size: the case of a hash computed
  right after the CRC-32C pass, on bytes that just passed through the CPU; 32 MiB is
  about the L3 size, so that row is nearer to memory bandwidth. Best of ``--repeat``
  runs of ``--seconds``.
* ``N threads``: GB per wall second of N threads (default 2) together, each hashing its
  own buffer for the same time. ``scale`` = that / the 1-thread figure in wall time. A
  function that releases the GIL scales towards min(N, free cores); one that holds it
  stays near 1.0 (or below). With other load on the machine the ceiling is lower and the
  figure noisy: trust the GIL column, and compare with ``sha256`` and ``crc32c``, which
  release the GIL for large buffers.
* ``per 1 MiB``: microseconds of CPU per 1 MiB inner chunk (zarrckpt's default inner chunk
  size, spec C.2), i.e. what the hash adds to each inner chunk written.
* ``GIL``: a probe independent of free cores: a thread calls the hash once on a large
  buffer (``--probe-mib``, 256 MiB) while the main thread waits to run Python code; the
  time until the main thread ran, as a fraction of the call, is ~0 if the call released
  the GIL and ~1 if it held it. (Buffers of at most 64 KiB are not probed: ``xxhash``
  releases the GIL only above 65,536 bytes, ``hashlib`` above 2 KiB.)

Rows: ``crc32c`` (the ``crc32c`` package, already a dependency: the reference),
``xxh3_64`` / ``xxh3_128`` (``xxhash``), ``blake3`` (``blake3``, one thread),
``blake2b`` and ``sha256`` (``hashlib``), ``crc32c+xxh3_128`` (both over the same buffer,
one after the other: the fused pass of the design note), ``copy`` (``np.copyto``, a
memory-bandwidth reference) and ``bytes() control`` (a copy that holds the GIL: what the
GIL probe and the scaling test show for a function that does not release it). A package
that is not installed is reported as such.

``--write-dir DIR`` adds a second table (the only part that writes files, under DIR,
removed afterwards): what a save pays per MiB of chunk data today (CRC-32C + pwritev per
1 MiB unit), with the hash fused into that loop or as a pass of its own before the
write (a changed chunk), and for an unchanged chunk (hash pass, then ``os.link`` from
the previous step's file). On tmpfs the write is a memory copy, so the CPU ratio is the
worst case of the hash's share; on a disk the write's wall time dominates.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import ssl
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

SIZES = {"64K": 64 << 10, "1M": 1 << 20, "32M": 32 << 20}


def _candidates() -> dict[str, Callable[[memoryview], object] | str]:
    """name -> function of a buffer, or a string saying why it is missing."""
    out: dict[str, Callable[[memoryview], object] | str] = {}
    try:
        import crc32c

        out["crc32c"] = lambda b: crc32c.crc32c(b)
    except ImportError:
        out["crc32c"] = "not installed (pip install crc32c)"
    try:
        import xxhash

        out["xxh3_64"] = lambda b: xxhash.xxh3_64_intdigest(b)
        out["xxh3_128"] = lambda b: xxhash.xxh3_128_digest(b)
    except ImportError:
        out["xxh3_64"] = out["xxh3_128"] = "not installed (pip install xxhash)"
    try:
        import blake3

        out["blake3"] = lambda b: blake3.blake3(b).digest()  # max_threads=1: one core
    except ImportError:
        out["blake3"] = "not installed (pip install blake3)"
    out["blake2b"] = lambda b: hashlib.blake2b(b, digest_size=32).digest()
    out["sha256"] = lambda b: hashlib.sha256(b).digest()
    if callable(out.get("crc32c")) and callable(out.get("xxh3_128")):
        c, x = out["crc32c"], out["xxh3_128"]

        def fused(b: memoryview) -> object:
            return c(b), x(b)

        out["crc32c+xxh3_128"] = fused
    scratch: dict[int, np.ndarray] = {}

    def copy(b: memoryview) -> None:
        dst = scratch.get(id(b))
        if dst is None:
            dst = scratch[id(b)] = np.empty(b.nbytes, np.uint8)
        np.copyto(dst, np.frombuffer(b, np.uint8))

    out["copy"] = copy
    out["bytes() control"] = lambda b: bytes(b)  # a memcpy that holds the GIL: calibrates the probe
    return out


def _run(fn: Callable[[memoryview], object], bufs: list[memoryview], seconds: float) -> tuple[float, float]:
    """len(bufs) threads, each hashing its own buffer for ``seconds``: (bytes per second of
    wall time, all threads together; bytes per CPU second of one thread, from
    ``time.thread_time``, which other processes' load does not lower)."""
    n = len(bufs)
    done = [0] * n
    cpu = [0.0] * n
    barrier = threading.Barrier(n + 1)
    stop_at = [0.0]

    def work(i: int) -> None:
        b = bufs[i]
        size = b.nbytes
        barrier.wait()
        end = stop_at[0]
        c0 = time.thread_time()
        count = 0
        while True:
            fn(b)
            count += 1
            if count >= 2 and time.perf_counter() >= end:
                break
        cpu[i] = time.thread_time() - c0
        done[i] = count * size

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return sum(done) / wall, sum(done) / max(sum(cpu), 1e-9)


def _gil_probe(fn: Callable[[memoryview], object], buf: memoryview, tries: int = 3) -> float:
    """When another Python thread gets to run during one call of ``fn`` on ``buf``, as a
    fraction of the call's duration (the smallest of ``tries``): near 0 when ``fn``
    releases the GIL (the other thread runs as soon as the OS wakes it), near 1 when it
    holds the GIL for the whole call. Independent of how many cores are free, as long
    as the call is much longer than a thread wake-up (hence a large buffer)."""
    best = 1.0
    for _ in range(tries):
        inside = threading.Event()
        t = [0.0, 0.0]

        def call() -> None:
            inside.set()
            t[0] = time.perf_counter()
            fn(buf)
            t[1] = time.perf_counter()

        th = threading.Thread(target=call)
        th.start()
        inside.wait()
        t_main = time.perf_counter()  # needs the GIL: runs during the call only if it was released
        th.join()
        best = min(best, max(0.0, t_main - t[0]) / max(t[1] - t[0], 1e-9))
    return best


def _write_sim(directory: str, chunk_mib: int, count: int, repeat: int) -> list[dict]:
    """The save path of one chunk file per ``chunk_mib`` MiB, in 1 MiB units (zarrckpt's
    uncompressed layout: each unit followed by its CRC-32C), ``count`` chunks a run: CPU
    (``time.thread_time``, system time included) and wall time per MiB, best of ``repeat``.
    Rows: today's write; the hash fused into the CRC loop (changed chunk, hash recorded);
    hash pass first, then the write (changed chunk); an unchanged chunk: CRC + hash pass,
    then ``os.link`` from the previous step; the same with the hash alone."""
    import shutil
    import tempfile

    try:
        import crc32c
        import xxhash
    except ImportError as e:
        print(f"--write-dir needs crc32c and xxhash: {e}")
        return []

    unit = 1 << 20
    rng = np.random.default_rng(1)
    chunks = [rng.integers(0, 256, chunk_mib * unit, dtype=np.uint8) for _ in range(count)]
    root = tempfile.mkdtemp(dir=directory, prefix="hash-speed-")

    def units(c: np.ndarray) -> list[memoryview]:
        mv = memoryview(c)
        return [mv[i:i + unit] for i in range(0, len(mv), unit)]

    def create(path: str, n: int) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, n * (unit + 4))
        return fd

    def plain(c: np.ndarray, path: str, prev: str) -> None:
        us = units(c)
        fd = create(path, len(us))
        for k, u in enumerate(us):
            os.pwritev(fd, [u, crc32c.crc32c(u).to_bytes(4, "little")], k * (unit + 4))
        os.close(fd)

    def fused(c: np.ndarray, path: str, prev: str) -> None:
        us = units(c)
        fd = create(path, len(us))
        hs = []
        for k, u in enumerate(us):
            v = crc32c.crc32c(u)
            hs.append(xxhash.xxh3_128_digest(u))
            os.pwritev(fd, [u, v.to_bytes(4, "little")], k * (unit + 4))
        os.close(fd)
        xxhash.xxh3_128_digest(b"".join(hs))

    def hashed(us: list[memoryview]) -> tuple[list[int], bytes]:
        crcs, hs = [], []
        for u in us:
            crcs.append(crc32c.crc32c(u))
            hs.append(xxhash.xxh3_128_digest(u))
        return crcs, xxhash.xxh3_128_digest(b"".join(hs))

    def two_pass(c: np.ndarray, path: str, prev: str) -> None:
        us = units(c)
        crcs, _ = hashed(us)
        fd = create(path, len(us))
        for k, u in enumerate(us):
            os.pwritev(fd, [u, crcs[k].to_bytes(4, "little")], k * (unit + 4))
        os.close(fd)

    def linked(c: np.ndarray, path: str, prev: str) -> None:
        hashed(units(c))
        os.link(prev, path)

    def linked_hash_only(c: np.ndarray, path: str, prev: str) -> None:
        xxhash.xxh3_128_digest(b"".join(xxhash.xxh3_128_digest(u) for u in units(c)))
        os.link(prev, path)

    modes = {"write (CRC, pwritev): today": plain,
             "changed, fused CRC+xxh3_128+write": fused,
             "changed, CRC+xxh3_128 pass, write": two_pass,
             "unchanged, CRC+xxh3_128, link": linked,
             "unchanged, xxh3_128 only, link": linked_hash_only}
    out: list[dict] = []
    try:
        prev_dir = os.path.join(root, "prev")
        os.makedirs(prev_dir)
        for i, c in enumerate(chunks):
            plain(c, os.path.join(prev_dir, str(i)), "")
        mib = chunk_mib * count
        print(f"write path in {directory}: {count} chunk files of {chunk_mib} MiB in 1 MiB units a run, "
              f"best of {repeat}; per MiB of chunk data")
        head = f"{'case':<36}  {'CPU us/MiB':>10}  {'wall us/MiB':>11}  {'CPU vs today':>12}"
        print(head)
        print("-" * len(head))
        best = {name: [float("inf"), float("inf")] for name in modes}
        for rep in range(max(1, repeat) + 1):  # round-robin, so load that comes and goes hits every case
            for name, fn in modes.items():
                d = os.path.join(root, f"run-{rep}")
                os.makedirs(d)
                c0, w0 = time.thread_time(), time.perf_counter()
                for i, c in enumerate(chunks):
                    fn(c, os.path.join(d, str(i)), os.path.join(prev_dir, str(i)))
                cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
                shutil.rmtree(d)
                if rep:  # the first round warms up the file system (page allocation) and is dropped
                    best[name] = [min(best[name][0], cpu), min(best[name][1], wall)]
        base = best["write (CRC, pwritev): today"][0]
        for name, (cpu, wall) in best.items():
            cpu_us, wall_us = cpu / mib * 1e6, wall / mib * 1e6
            print(f"{name:<36}  {cpu_us:>10.1f}  {wall_us:>11.1f}  {cpu / base:>11.2f}x", flush=True)
            out.append({"case": name, "cpu_us_per_mib": cpu_us, "wall_us_per_mib": wall_us})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _dist(name: str) -> str:
    try:
        d = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return f"{name}: not installed"
    tags = [line[5:] for line in (d.read_text("WHEEL") or "").splitlines() if line.startswith("Tag: ")]
    return f"{name} {d.version} ({tags[0] if tags else 'no wheel tag'})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64K,1M,32M", help="comma-separated, from " + ",".join(SIZES))
    ap.add_argument("--seconds", type=float, default=0.2, help="time per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="1-thread runs per cell (best is kept)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the scaling test (0: skip it)")
    ap.add_argument("--probe-mib", type=int, default=256, help="buffer of the GIL probe in MiB (0: skip it)")
    ap.add_argument("--only", default="", help="comma-separated hash names to run (default: all)")
    ap.add_argument("--write-dir", default="", help="also time the save path: chunk files written to "
                    "this directory (e.g. /dev/shm, or a disk), plain vs hashed vs linked")
    ap.add_argument("--write-chunk-mib", type=int, default=64, help="chunk file size of --write-dir")
    ap.add_argument("--json", default="", help="also write the results to this file")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")

    cands = _candidates()
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        cands = {k: v for k, v in cands.items() if k in keep}
    rng = np.random.default_rng(0)
    nbuf = max(1, args.threads)
    buffers = {s: [memoryview(rng.integers(0, 256, SIZES[s], dtype=np.uint8)) for _ in range(nbuf)] for s in sizes}

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start")
    print("packages: " + "; ".join(_dist(n) for n in ("crc32c", "xxhash", "blake3", "numpy")))
    print(f"hashlib: {ssl.OPENSSL_VERSION} (the ssl module's; hashlib's sha256/blake2b come from it or CPython)")
    print(f"{args.seconds} s per measurement, 1 thread best of {args.repeat}; GB = 1e9 bytes")
    print()
    th = args.threads
    probe = None
    if args.probe_mib:
        probe = memoryview(np.arange(args.probe_mib << 17, dtype=np.uint64).view(np.uint8))
    head = f"{'hash':<16}{'size':>5}  {'1 thread':>8}"
    if th:
        head += f"  {f'{th} threads':>9}  {'scale':>5}"
    head += f"  {'per 1 MiB':>10}"
    if probe is not None:
        head += f"  {'GIL':>12}"
    print(f"1 thread: GB per CPU second of the hashing thread (time.thread_time: best of {args.repeat})")
    if th:
        print(f"{th} threads: GB per wall second, all threads together; scale: that / 1 thread, wall time")
    if probe is not None:
        print(f"GIL: when another thread ran during one call on {args.probe_mib} MiB, as a fraction of the "
              "call (~0: released, ~1: held)")
    print()
    print(head)
    print("-" * len(head))

    results: list[dict] = []
    for name, fn in cands.items():
        if isinstance(fn, str):
            print(f"{name:<16}  {fn}")
            results.append({"hash": name, "missing": fn})
            continue
        gil = _gil_probe(fn, probe) if probe is not None else None
        for k, s in enumerate(sizes):
            bufs = buffers[s]
            for b in bufs:
                fn(b)  # warm up (imports, allocations)
            runs = [_run(fn, bufs[:1], args.seconds) for _ in range(max(1, args.repeat))]
            one_cpu = max(r[1] for r in runs)
            one_wall = max(r[0] for r in runs)
            row = {"hash": name, "size": s, "bytes": SIZES[s], "gbps_cpu_1": one_cpu / 1e9,
                   "gbps_wall_1": one_wall / 1e9}
            line = f"{name:<16}{s:>5}  {one_cpu / 1e9:>8.2f}"
            if th:
                many = _run(fn, bufs[:th], args.seconds)[0]
                row.update(gbps_wall_n=many / 1e9, threads=th, scale=many / one_wall)
                line += f"  {many / 1e9:>9.2f}  {many / one_wall:>5.2f}"
            us = (1 << 20) / one_cpu * 1e6
            row["us_per_mib"] = us
            line += f"  {us:>7.1f} us"
            if gil is not None and k == 0:
                row["gil_fraction"] = gil
                line += f"  {gil:>5.2f} {'held' if gil > 0.5 else 'released':>8}"
            print(line, flush=True)
            results.append(row)
    print()
    writes = []
    if args.write_dir:
        writes = _write_sim(args.write_dir, args.write_chunk_mib, 4, max(args.repeat, 3))
        print()
    print(f"load average {os.getloadavg()[0]:.2f} at the end" if hasattr(os, "getloadavg") else "")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version, "cores": os.cpu_count(), "load_start": load,
                       "seconds": args.seconds, "repeat": args.repeat, "results": results,
                       "writes": writes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
