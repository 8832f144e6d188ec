"""Time blocked by later async saves: many small leaves against few large ones, same bytes.

    python bench/async_leaves.py [--device cuda|cpu] [--mib 1024] [--leaves 64,2169] [--reps 5]
        [--dir /dev/shm/zal] [--out results.json] [--profile]

One process (a one-rank gloo group, as DCP's async_save needs one). For every leaf count N,
a state of N tensors of about ``--mib`` MiB in total on ``--device``; per system, one save to
warm up, then ``--reps`` later saves, the two systems alternating:

- zarrckpt: ``reserve_staging`` once, then ``async_save``. *blocked*: until the call returns
  (on CUDA the copies run on a side stream after it returns; the current stream waits for
  them); *staged*: until ``wait_staged()`` (the device->host copies are done).
- DCP best for async: ``dcp.async_save`` with ``BlockingAsyncStager(cache_staged_state_dict=
  True)`` (pinned, reused staging; it copies before returning, so blocked = staged) and
  ``FileSystemWriter(thread_count=4)``.

Every timed save is verified: the state's checksums are taken at the call (untimed), the
state is overwritten with garbage at the point where it may change (zarrckpt: when
``wait_staged()`` returns; DCP: when its call returns) and restored after the commit, and
the checkpoint is loaded back and compared (``harness.verify_checkpoint``). A save whose
checkpoint does not hold the values at the call reports no time (``verified: false``) and
is left out of the medians; ``total`` runs to the commit (a done-callback), so the
overwrite is not counted. The ``--step`` and ``--trace`` saves are verified the same way.

Each zarrckpt record also has the save report's ``plan`` and ``stage`` seconds; ``--profile``
prints a cProfile of 5 more later saves per leaf count. Also the copy bound: one ``copy_`` of the same bytes from the device into a pinned host
buffer (CUDA), or a memcpy (CPU). Prints a table and writes every number to JSON.
Issue 16 item 4's goals: blocked(2,169 leaves) <= 1.2 x blocked(64 leaves); staging >= 90 %
of the copy bound; blocked <= DCP's cached stager.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import zarrckpt
from harness import Commit, checksums, drop_times, load_with, scramble, verify_checkpoint
from zarrckpt.distributed.staging import shared_arena
from zarrckpt.planning.plan import local_view


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def state(n: int, nbytes: int, device: torch.device) -> dict:
    per = max(nbytes // n // 4, 1)
    g = torch.Generator(device=device).manual_seed(n)
    return {"model": {f"layers.{i}.weight": torch.rand(per, device=device, generator=g) for i in range(n)},
            "step": 1}


def copy_bound(nbytes: int, device: torch.device, reps: int) -> float:
    """Seconds of one copy of ``nbytes`` into pinned (CUDA) or plain (CPU) host memory."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out = []
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def verified(rec: dict, system: str, sd: dict, path: str, ref: dict) -> dict:
    """After the commit (untimed): the state restored as it was at the call (the second
    ``scramble`` undoes the first), the checkpoint loaded back by ``system`` and compared
    with ``ref``; a wrong one keeps no time."""
    sync(next(iter(sd["model"].values())).device)
    rec["restore_s"] = scramble(sd)
    v = verify_checkpoint(load_with(system, path), sd, ref, True)
    rec["verify_s"] = v.pop("verify_s")
    rec.update(v)
    return drop_times(rec)


def zarrckpt_save(sd: dict, path: str) -> dict:
    ref = checksums(sd, True)  # the values at the call (untimed)
    t0 = time.perf_counter()
    fut = zarrckpt.async_save(sd, path)
    t1 = time.perf_counter()
    done = Commit(fut)
    fut.wait_staged()
    t2 = time.perf_counter()
    overwrite = scramble(sd)  # the state may change now
    report = fut.result()
    rec = {"blocked": t1 - t0, "staged": t2 - t0, "total": done.at - t0, "overwrite_s": overwrite,
           **{f"phase_{k}": v for k, v in report["seconds"].items() if k in ("plan", "stage")}}
    return verified(rec, "zc", sd, path, ref)


def dcp_start(sd: dict, path: str, stager):
    """DCP's async_save; returns the future of the whole save."""
    fut = dcp.async_save(sd, storage_writer=FileSystemWriter(path, thread_count=4), async_stager=stager)
    return getattr(fut, "upload_completion", fut)


def dcp_save(sd: dict, path: str, stager) -> dict:
    ref = checksums(sd, True)
    t0 = time.perf_counter()
    fut = dcp_start(sd, path, stager)
    t1 = time.perf_counter()
    done = Commit(fut)
    overwrite = scramble(sd)  # its stager copied before returning: the state may change now
    fut.result()
    rec = {"blocked": t1 - t0, "staged": t1 - t0, "total": done.at - t0, "overwrite_s": overwrite}
    return verified(rec, "dcp", sd, path, ref)


def medians(recs: list[dict]) -> dict:
    """Medians of the verified records' numbers (None where none verified), with counts."""
    ok = [r for r in recs if r.get("verified")]
    keys = list(dict.fromkeys(k for r in recs for k, v in r.items()
                              if (v is None or isinstance(v, (int, float))) and not isinstance(v, bool)
                              and k != "wrong_count"))
    out = {}
    for k in keys:
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out.update(verified=len(ok), unverified=len(recs) - len(ok))
    return out


def trace(sd: dict, where: str, n: int) -> dict:
    """5 more later saves, each with CUDA timing events on the staging side stream: ``gpu``
    from the side stream's start (it waits for the current stream) to the end of its copies,
    ``gpu_from_call`` from the call to that end (the staging time the device sees: the
    training stream waits for it), ``first_issue`` (host) from the call to the first step
    issued, ``stage_end`` (host) to the end of ``stage()``; then ``replay``: the last save's staging steps issued again in a
    loop with every source known (the device time of the copies alone)."""
    from zarrckpt.api import save as _save

    marks: dict = {}
    real_call, real_stage = _save._Feed.__call__, _save.SaveRun.stage

    def call(self, leaves):
        if "first_issue" not in marks:
            marks["first_issue"] = time.perf_counter()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.side)
            marks["ev0"] = ev
        t = time.perf_counter()
        try:
            return real_call(self, leaves)
        finally:
            marks["feed_host"] = marks.get("feed_host", 0.0) + time.perf_counter() - t

    def stage(self, arena, **kw):
        out = real_stage(self, arena, **kw)
        marks["stage_end"] = time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(_save._copy_stream(torch.device("cuda", torch.cuda.current_device())))
        marks["ev1"] = ev
        return out

    _save._Feed.__call__, _save.SaveRun.stage = call, stage
    recs = []
    try:
        for rep in range(5):
            marks.clear()
            path = os.path.join(where, f"traced_{n}_{rep}")
            ref = checksums(sd, True)
            torch.cuda.synchronize()
            call = torch.cuda.Event(enable_timing=True)
            call.record()  # the device is idle: this is the call's time on the device's clock
            t0 = time.perf_counter()
            fut = zarrckpt.async_save(sd, path)
            t1 = time.perf_counter()
            fut.wait_staged()
            t2 = time.perf_counter()
            scramble(sd)  # the state may change now (after the events above were recorded)
            fut.result()
            rec = {"blocked": t1 - t0, "staged": t2 - t0, "stage_end": marks["stage_end"] - t0}
            if "ev0" in marks:
                rec["first_issue"] = marks["first_issue"] - t0
                rec["gpu"] = marks["ev0"].elapsed_time(marks["ev1"]) / 1e3
                rec["gpu_from_call"] = call.elapsed_time(marks["ev1"]) / 1e3
                rec["feed_host"] = marks["feed_host"]
            recs.append(verified(rec, "zc", sd, path, ref))
            shutil.rmtree(path, ignore_errors=True)
    finally:
        _save._Feed.__call__, _save.SaveRun.stage = real_call, real_stage
    st = _save._STAGED
    srcs = [local_view(t) for t in sd["model"].values()]  # leaf order
    by_pos = [None] * len(st.todo)
    for k, j in enumerate(st.leaf_index):
        by_pos[k] = srcs[j] if j < len(srcs) else None
    arena = shared_arena()
    side = _save._copy_stream(torch.device("cuda", torch.cuda.current_device()))
    raw = arena.raw()

    def gathers(step):
        for ks, views in step.groups:
            torch._foreach_copy_(views, [by_pos[k] for k in ks])

    def d2h(step):
        if step.groups:
            raw[step.start:step.end].copy_(st.device_bufs[step.buf][:step.end - step.start], non_blocking=True)

    def issue(step):
        st.issue(step, by_pos, arena, [])
        if step is st.steps[-1]:
            st.finish(by_pos, arena, [])

    out = medians(recs)
    for name, fn in (("replay", issue),
                     ("replay_gathers", gathers), ("replay_d2h", d2h)):
        times, host = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side), torch.no_grad():
                a.record()
                t = time.perf_counter()
                for step in st.steps:
                    fn(step)
                host.append(time.perf_counter() - t)
                b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = statistics.median(times)
        out[name + "_host"] = statistics.median(host)
    out["steps"] = len(st.steps)
    print(f"trace {n} leaves (median of {out['verified']} verified of 5, ms): " + ", ".join(
        f"{k} {v * 1e3:.2f}" for k, v in out.items() if k not in ("steps", "verified", "unverified") and v is not None)
        + f"; {out['steps']} steps" + (f"; {out['unverified']} VERIFY FAILED, dropped" if out["unverified"] else ""))
    return out


_MATMULS: list[int] = []


def step_delay(sd: dict, where: str, n: int, stager, reps: int) -> dict:
    """How much longer one training step is when it starts with a save (CUDA): the step is a
    fixed device workload (bf16 matmuls, ~50 ms) then an in-place update of every state
    tensor (the optimizer step, which must not run before the copies end); the delay is the
    step's wall time with the save minus without it (median of ``reps``, same process).
    zarrckpt default: the current stream waits for the side-stream copies; ``overlap``: the
    matmuls run during the copies and only the update waits (``wait_staged(stream)``); DCP:
    its cached stager copies before returning."""
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):  # warm up (cuBLAS handles, kernels)
        torch.mm(a, a, out=b)
    k = 1
    while k < 4096:  # matmuls for ~50 ms, once per process (every leaf count gets the same step)
        if _MATMULS:
            k = _MATMULS[0]
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            torch.mm(a, a, out=b)
        torch.cuda.synchronize()
        if time.perf_counter() - t0 > 0.05:
            _MATMULS.append(k)
            break
        k *= 2
    tensors = list(sd["model"].values())

    def step(before=None, after=None) -> dict:
        """One step; its wall time and where it went: host seconds until the save call
        returned and until the update was queued, device seconds from the call to the
        matmuls' start, their end and the update's end (CUDA events on the current stream)."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        ev[0].record()  # the device is idle: the call's time on its clock
        t0 = time.perf_counter()
        fut = before() if before else None
        t1 = time.perf_counter()
        ev[1].record()
        for _ in range(k):
            torch.mm(a, a, out=b)
        ev[2].record()
        if after:
            after(fut)
        torch._foreach_mul_(tensors, 1.0001)
        ev[3].record()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        rec = {"wall": time.perf_counter() - t0, "host_call": t1 - t0, "host_queued": t2 - t0,
               **{name: ev[0].elapsed_time(e) / 1e3 for name, e in zip(("dev_mm_start", "dev_mm_end", "dev_end"),
                                                                        ev[1:])}}
        if fut is not None:  # the update changed the state; overwrite the rest too (untimed)
            rec["overwrite_s"] = scramble(sd)
            fut.result()
        return rec

    out: dict = {"matmuls": k}
    kinds = {
        "zarrckpt": (lambda p: (lambda: zarrckpt.async_save(sd, p)), None),
        "zarrckpt_overlap": (lambda p: (lambda: zarrckpt.async_save(sd, p, overlap=True)),
                             lambda f: f.wait_staged(torch.cuda.current_stream())),
        "dcp_cached_stager": (lambda p: (lambda: dcp_start(sd, p, stager)), None),
    }
    delays: dict = {name: [] for name in kinds}
    for rep in range(reps + 1):
        names = list(kinds) if rep % 2 == 0 else list(kinds)[::-1]
        for name in names:
            path = os.path.join(where, f"step_{name}_{n}_{rep}")
            shutil.rmtree(path, ignore_errors=True)
            base = step()
            before, after = kinds[name]
            ref = checksums(sd, True)  # the values at the call (the step's update changes them)
            with_save = step(before(path), after)
            system = "dcp" if name.startswith("dcp") else "zc"
            rec = {"delay": with_save["wall"] - base["wall"], **{f"base_{x}": v for x, v in base.items()},
                   **with_save}
            rec = verified(rec, system, sd, path, ref)
            if rec["verified"] is False:  # a delay measured with a wrong checkpoint is no delay
                rec.setdefault("unverified_times", {}).update({x: rec[x] for x in ("delay", "wall", "host_call",
                                                                                    "host_queued")})
                for x in ("delay", "wall", "host_call", "host_queued", "dev_mm_start", "dev_mm_end", "dev_end"):
                    rec[x] = None
            if rep:
                delays[name].append(rec)
            shutil.rmtree(path, ignore_errors=True)
    for name, d in delays.items():
        out[name] = medians(d)
        out[name]["raw"] = d

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f}"
    print(f"step delay {n} leaves ({k} matmuls; median of the verified of {reps}, ms): " + "; ".join(
        f"{name} {ms(out[name]['delay'])} (call {ms(out[name]['host_call'])}, queued "
        f"{ms(out[name]['host_queued'])}, device: matmuls {ms(out[name]['dev_mm_start'])}-"
        f"{ms(out[name]['dev_mm_end'])}, end {ms(out[name]['dev_end'])}; without a save "
        f"{ms(out[name]['base_dev_end'])}; {out[name]['verified']} verified"
        + (f", {out[name]['unverified']} VERIFY FAILED" if out[name]["unverified"] else "") + ")"
        for name in delays))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--leaves", default="64,2169")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm/zal")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile 5 more later saves per leaf count")
    ap.add_argument("--trace", action="store_true",
                    help="CUDA: time 5 more later saves on the device (side stream) and the same copies alone")
    ap.add_argument("--step", action="store_true",
                    help="CUDA: how much longer a training step is when it starts with a save")
    a = ap.parse_args()
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    device = torch.device(a.device)
    nbytes = a.mib << 20
    bound = copy_bound(nbytes, device, a.reps)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
               "bytes": nbytes, "copy_bound_s": bound, "leaves": {}}
    for n in (int(x) for x in a.leaves.split(",")):
        sd = state(n, nbytes, device)
        zarrckpt.reserve_staging(sd)
        # the cached stager pins its copy: on a machine without CUDA it cannot, so there DCP
        # copies into fresh host tensors every save
        stager = BlockingAsyncStager(cache_staged_state_dict=device.type == "cuda")
        runs = {"zarrckpt": [], "dcp_cached_stager": []}
        for rep in range(a.reps + 1):
            order = ["zarrckpt", "dcp_cached_stager"] if rep % 2 == 0 else ["dcp_cached_stager", "zarrckpt"]
            for s in order:
                path = os.path.join(a.dir, f"{s}_{n}_{rep}")
                shutil.rmtree(path, ignore_errors=True)
                rec = zarrckpt_save(sd, path) if s == "zarrckpt" else dcp_save(sd, path, stager)
                for t in sd["model"].values():  # training goes on
                    t.mul_(1.0001)
                if rep:  # the first save of each system warms up (plans, pinned buffers)
                    runs[s].append(rec)
                shutil.rmtree(path, ignore_errors=True)
        if a.trace and device.type == "cuda":
            results.setdefault("trace", {})[n] = trace(sd, a.dir, n)
        if a.step and device.type == "cuda":
            results.setdefault("step_delay", {})[n] = step_delay(sd, a.dir, n, stager, a.reps)
        if a.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            checked = []
            for rep in range(5):
                path = os.path.join(a.dir, f"profiled_{n}_{rep}")
                ref = checksums(sd, True)
                prof.enable()
                fut = zarrckpt.async_save(sd, path)
                prof.disable()
                fut.wait_staged()
                scramble(sd)
                fut.result()
                checked.append(verified({}, "zc", sd, path, ref)["verified"])
                shutil.rmtree(path, ignore_errors=True)
            print(f"--- {n} leaves: 5 later async_save calls under cProfile "
                  f"({sum(checked)} of 5 checkpoints verified)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        results["leaves"][n] = {s: medians(recs) for s, recs in runs.items()}
        results["leaves"][n]["raw"] = runs
        zarrckpt.release_staging()
        del sd, stager
    print(f"device {results['device']}, {a.mib} MiB, copy bound {bound * 1e3:.1f} ms "
          f"({nbytes / bound / 1e9:.1f} GB/s)")
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    def checked(r):
        return f"{r['verified']} of {r['verified'] + r['unverified']}" + (" (VERIFY FAILED: times dropped)"
                                                                          if r["unverified"] else "")
    print("| leaves | zarrckpt blocked | zarrckpt staged | staged % of copy bound | DCP cached stager blocked "
          "| verified zarrckpt / DCP |")
    print("|---|---|---|---|---|---|")
    for n, r in results["leaves"].items():
        z, d = r["zarrckpt"], r["dcp_cached_stager"]
        pct = "-" if z["staged"] is None else f"{bound / z['staged'] * 100:.0f} %"
        print(f"| {n} | {ms(z['blocked'])} | {ms(z['staged'])} | {pct} | {ms(d['blocked'])} "
              f"| {checked(z)} / {checked(d)} |")
    ns = list(results["leaves"])
    if len(ns) >= 2:
        lo, hi = results["leaves"][ns[0]]["zarrckpt"], results["leaves"][ns[-1]]["zarrckpt"]
        if None not in (lo["blocked"], hi["blocked"]):
            print(f"blocked {ns[-1]} / {ns[0]} leaves: {hi['blocked'] / lo['blocked']:.2f}x; "
                  f"staged: {hi['staged'] / lo['staged']:.2f}x")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                f"async-leaves-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
