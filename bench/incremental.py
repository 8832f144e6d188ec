"""Incremental saves against plain saves, same process, alternating (issue 31's goals).

    python bench/incremental.py --dir /dev/shm/zinc [--mib 1024] [--tensors 64] [--reps 5] [--world 1]
    python bench/incremental.py --s3 [--mib 256] ...   # S3: a SeaweedFS server started here (tests/_s3.py)
    python bench/incremental.py --device cuda --dir ...  # the state on the GPU: staging and hashing there

State: ``--tensors`` fp32 tensors of ``--mib`` MiB in all, 90 % of the bytes "frozen" (never
change), 10 % "trained" (changed before every save). Per repetition, in rotated order:

* ``plain``: the trained tensors changed, then ``save(sd, p)`` (no hashes);
* ``frozen``: ``save(sd, p, incremental_from=prev)`` after the trained tensors changed
  (``prev`` saved with ``content_hashes=True``);
* ``changed``: every tensor changed, then ``save(sd, p, incremental_from=prev)``.

Every checkpoint is loaded back (untimed) and compared with the state at the call; a
failure prints VERIFY FAILED and counts no time. Bytes written come from the save's own
report (``bytes_written``, ``bytes_linked``); disk use of N frozen-case steps counts each
inode once (not on S3, where a copy is an object of its own). With ``--s3`` every save goes
to a SeaweedFS server on 127.0.0.1 (its data under ``--dir``), unchanged chunks are copied
server-side (``storage/s3copy.py``), and nothing is deleted between saves. Goals (issue 31): frozen writes <= 12 % of a plain save's bytes in <= 25 % of its
time; changed costs <= 5 % more than plain; N steps use <= (1 + 0.12 N) x one step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

import zarrckpt


def _disk(root: str) -> int:
    seen, total = set(), 0
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def _verify(sd: dict, path: str, storage=None) -> bool:
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    zarrckpt.load(out, path, storage=storage)
    return all(torch.equal(out[k], sd[k]) for k in sd)


def _sync(path: str) -> None:
    os.sync()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="frozen-case steps for the disk-use figure")
    ap.add_argument("--s3", action="store_true", help="save to a SeaweedFS S3 server started here")
    ap.add_argument("--device", default="cpu", help="where the state lives (cpu, cuda)")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    storage, server, base = None, None, a.dir
    if a.s3:
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from _s3 import S3Server

        server = S3Server(buckets=("zinc",), root=os.path.join(a.dir, "seaweedfs"))
        storage = zarrckpt.StorageOptions(endpoint=server.endpoint, region=server.region,
                                          access_key_id=server.access_key, secret_access_key=server.secret_key)
        base = server.url("run")
    n = a.tensors
    per = (a.mib << 20) // n // 4
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i:03d}": torch.randn(per, generator=g).to(a.device) for i in range(n)}
    trained = [k for k in sorted(sd)][: max(1, n // 10)]
    print(f"{a.mib} MiB in {n} tensors, {len(trained)} trained ({100 * len(trained) / n:.0f} % of the bytes), "
          f"dir {a.dir}, device {a.device}")
    prev = f"{base}/prev"
    zarrckpt.save(sd, prev, content_hashes=True, storage=storage)
    times: dict[str, list[float]] = {"plain": [], "frozen": [], "changed": []}
    nbytes: dict[str, list[int]] = {k: [] for k in times}
    kinds = list(times)
    for rep in range(a.reps):
        for kind in kinds[rep % 3:] + kinds[:rep % 3]:
            with torch.no_grad():
                for k in (sd if kind == "changed" else trained):
                    sd[k].add_(1.0)
            path = f"{base}/{kind}{rep}"
            opts = {} if kind == "plain" else {"incremental_from": prev}
            if a.device != "cpu":
                torch.cuda.synchronize()
            _sync(a.dir)
            t0 = time.perf_counter()
            rep_ = zarrckpt.save(sd, path, storage=storage, **opts)
            dt = time.perf_counter() - t0
            ok = _verify(sd, path, storage)
            print(f"rep {rep} {kind:8s} " + (f"{dt:.3f} s" if ok else "VERIFY FAILED") +
                  f"  written {rep_['bytes_written'] / 2**20:8.1f} MiB  linked {rep_.get('bytes_linked', 0) / 2**20:8.1f} MiB",
                  flush=True)
            if ok:
                times[kind].append(dt)
                nbytes[kind].append(rep_["bytes_written"])
            if a.s3:  # nothing renamed or deleted on the server
                prev = path if kind != "plain" else prev
            elif kind != "plain":  # the next incremental save compares with the newest one
                shutil.rmtree(prev)
                os.rename(path, prev)
            else:
                shutil.rmtree(path)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    byt = {k: statistics.median(v) for k, v in nbytes.items() if v}
    print(f"\nmedians: plain {med['plain']:.3f} s, frozen {med['frozen']:.3f} s "
          f"({med['frozen'] / med['plain']:.1%} of plain's time, {byt['frozen'] / byt['plain']:.1%} of its bytes), "
          f"all changed {med['changed']:.3f} s ({med['changed'] / med['plain'] - 1:+.1%} against plain)")
    if server is not None:
        server.close()
        shutil.rmtree(a.dir, ignore_errors=True)
        return
    run = f"{a.dir}/run"
    m = zarrckpt.CheckpointManager(run, incremental=True)
    for step in range(a.steps):
        with torch.no_grad():
            for k in trained:
                sd[k].add_(1.0)
        m.save(step, sd)
    one = _disk(f"{run}/{zarrckpt.format_step_name(0)}") if hasattr(zarrckpt, "format_step_name") else \
        _disk(f"{run}/step_00000000")
    total = _disk(run)
    print(f"{a.steps} frozen-case steps: {total / 2**20:.1f} MiB on disk = {total / one:.2f} x one step "
          f"(goal <= {1 + 0.12 * a.steps:.2f})")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
