"""zarrckpt vs torch.distributed.checkpoint (DCP): one command, same state, same run.

    python bench/bench.py --device cpu|cuda --state-gb 2 --reps 3 --dir /path \
        [--shape linear,transformer,moe] [--world 2] [--small-tensors 10000] \
        [--only save,async,load,reshard,reshard_pairs,small,sim] [--out results.json]

For every model shape, spawns the ranks itself and runs three systems side by side --
zarrckpt, DCP with its defaults, and DCP at its best (writer threads chosen by a sweep at
the start of the shape, pinned reusable async staging) -- in an order rotated every rep,
measures the storage's own bandwidth in every rep, then loads the checkpoints on other
world sizes and layouts in further spawns. Prints one markdown table per shape and
section and writes every raw number to JSON. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import zarrckpt
from harness import (Commit, Ctx, bit_equal, check_saved, checksums, d2h_bw, dir_stats, drop_caches,  # noqa: F401
                     drop_times, free_port, fs_type, init_dist, leaves, load_pair, load_with, local, now, rotate, saver,
                     scramble, sizes, storage_bw, tmap, verify_checksums)
from models import SHAPES, build_state, tensor_stats
from report import BENCH_SYSTEMS, report
from reshard import jobs, make_target, pair_worker, wanted_pairs
from sim import run_sim

SECTIONS = ("save", "async", "load", "reshard", "reshard_pairs", "small", "sim")
STATE_SECTIONS = {"save", "async", "load", "reshard", "reshard_pairs"}


# ------------------------------------------------------------------ DCP at its best

def sweep_threads(ctx: Ctx, sd, tag: str) -> dict:
    """Sync DCP saves with ``FileSystemWriter(thread_count=T)`` for every T of
    ``--dcp-threads``, ``--sweep-reps`` times (order rotated); each checkpoint is loaded
    back and checked against the state's checksums at the call (untimed), and one that
    fails counts no time. The T of the fastest median over verified saves (rank 0's
    timing, which spans the barriers) becomes ``ctx.dcp_threads``."""
    cfg = ctx.cfg
    secs: dict[int, list[float]] = {t: [] for t in cfg.dcp_threads}
    failed: dict[int, int] = {t: 0 for t in cfg.dcp_threads}
    for r in range(cfg.sweep_reps):
        for t in rotate(cfg.dcp_threads, r):
            path = os.path.join(cfg.dir, f"sweep_{tag}_t{t}")
            ref = checksums(sd, True)
            rec = ctx.measure(lambda: dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=t)))
            check_saved(rec, load_with("dcp_best", path), sd, ref, True)
            if rec["verified"]:
                secs[t].append(rec["seconds"])
            else:
                failed[t] += 1
            ctx.rmtree(path)
    med = {t: statistics.median(v) for t, v in secs.items() if v}
    choice = [min(med, key=med.get) if med else cfg.dcp_threads[0]]
    dist.broadcast_object_list(choice, src=0, group=ctx.gloo)
    ctx.dcp_threads = choice[0]
    return {"seconds": {str(t): v for t, v in secs.items()}, "median": {str(t): v for t, v in med.items()},
            "chosen": choice[0], "unverified": {str(t): n for t, n in failed.items() if n}}


class DcpStager:
    """The async stager of ``dcp_best``: ``DefaultStager(StagingOptions(pinned, shared memory
    off, async staging, non-blocking copies))`` -- pinned memory and non-blocking copies
    only on CUDA (torch refuses non-blocking copies without an accelerator and ignores
    pinning). ``--dcp-stager reuse`` (default) keeps one stager for every save of a shape,
    so its cached staging storages are reused; ``per-save`` makes one per save."""

    def __init__(self, cuda: bool, mode: str) -> None:
        self.options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                      use_non_blocking_copy=cuda)
        self.mode, self.stager = mode, None
        self.fallback, self.error = mode == "blocking", ("--dcp-stager blocking" if mode == "blocking" else None)

    def get(self) -> DefaultStager:
        if self.stager is None and self.fallback:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)
        if self.stager is None:
            self.stager = DefaultStager(self.options)
        return self.stager

    def warm(self, sd, ctx=None) -> None:
        """Stage once, untimed (as zarrckpt.reserve_staging): the cached storages exist
        before rep 0. With ``ctx``, a whole untimed async save: where this torch's
        DefaultStager cannot stage the state (torch 2.11 fails to deep-copy DTensors:
        ``KeyError: <class 'type'>``), fall back on every rank to DCP's next best,
        ``BlockingAsyncStager(cache_staged_state_dict=True)`` (pinned, reused; it stages
        before the call returns) and record why."""
        if ctx is None:
            if self.mode == "reuse":
                self.get().stage(sd).result()
            return
        path = os.path.join(ctx.cfg.dir, "_dcp_warm")
        failed = torch.zeros(1)
        try:
            if self.fallback:
                raise RuntimeError(self.error)
            fut = dcp.async_save(sd, storage_writer=FileSystemWriter(path, thread_count=ctx.dcp_threads),
                                 async_stager=self.get(), process_group=ctx.gloo)
            getattr(fut, "upload_completion", fut).result()
        except Exception as e:  # noqa: BLE001 - recorded, then the fallback is used
            failed[0] = 1
            self.error = f"{type(e).__name__}: {e}"
        dist.all_reduce(failed, group=ctx.gloo)
        ctx.rmtree(path)
        if failed.item():
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            self.close()
            self.fallback = True
            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)
            fut = dcp.async_save(sd, storage_writer=FileSystemWriter(path, thread_count=ctx.dcp_threads),
                                 async_stager=self.stager, process_group=ctx.gloo)
            fut.result()
            ctx.rmtree(path)

    def cached(self) -> int:
        inner = getattr(self.stager, "_state_dict_stager", None)
        return len(inner._cached_storage_mapping) if inner is not None else 0

    def after_save(self) -> None:
        if self.mode == "per-save":
            self.close()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


# ---------------------------------------------------------------- sections

def record_files(ctx, cur):
    def after(_, rec):
        if ctx.rank == 0:
            rec["files"], rec["disk_bytes"] = dir_stats(cur[0])
    return after


def sync_save(ctx, rep, sd, ckpt, tag="sync"):
    """Timed saves into fresh directories; ``ckpt`` keeps the latest per system (for loads).
    Each checkpoint is loaded back by its system and checked against the state's checksums
    taken at the call (untimed); one that fails reports no time."""
    for p in ckpt.values():
        ctx.rmtree(p)
    cur, ref = [None], {}

    def prepare(s):
        ckpt[s] = cur[0] = os.path.join(ctx.cfg.dir, f"{s}_{tag}_{rep}")
        t0 = now()
        ref["sums"] = checksums(sd, True)
        ref["s"] = now() - t0
        return saver(ctx, s, sd, cur[0])

    def after(s, rec):
        record_files(ctx, cur)(s, rec)
        rec.setdefault("untimed", {})["ref_s"] = ref["s"]
        check_saved(rec, load_with(s, cur[0]), sd, ref["sums"], True)
    return ctx.pair(rep, prepare, after)


def async_save(ctx, rep, sd, stager: DcpStager):
    """blocked: the call's return; may_change: until the state may change (zarrckpt:
    ``wait_staged()``; DCP: the ``staging_completion`` future, or the call itself when it
    returns a plain Future, as with its default stager); seconds: until committed.

    At the may-change point every local shard of the state is overwritten with garbage
    (``scramble``, as training would change it); the save's seconds run from the call to
    its commit (a done-callback), so that overwrite is not counted. After the commit
    (untimed) the state is restored (``scramble`` again) and the checkpoint is loaded back
    and checked against the state's checksums taken at the call; one that fails reports
    no time."""
    cur, ref = [None], {}

    def prepare(s):
        cur[0] = path = os.path.join(ctx.cfg.dir, f"{s}_async_{rep}")
        t0 = now()
        ref["sums"] = checksums(sd, True)
        ref["s"] = now() - t0

        def run():
            t0 = now()
            if s == "zc":
                fut = zarrckpt.async_save(sd, path)
                blocked = now() - t0
                done = Commit(fut)
                fut.wait_staged()  # CUDA copies run on a side stream after the call returns
                may_change = now() - t0
                overwrite = scramble(sd)  # the state may change now
                report = fut.result()
                return {"blocked": blocked, "may_change": may_change, "staged_seconds": fut.staged_seconds,
                        "report": report, "seconds": done.at - t0, "overwrite_s": overwrite}
            if s == "dcp":
                fut = dcp.async_save(sd, checkpoint_id=path, process_group=ctx.gloo)
            else:
                fut = dcp.async_save(sd, storage_writer=FileSystemWriter(path, thread_count=ctx.dcp_threads),
                                     async_stager=stager.get(), process_group=ctx.gloo)
            blocked = now() - t0
            upload = getattr(fut, "upload_completion", fut)
            done = Commit(upload)
            staged = getattr(fut, "staging_completion", None)
            if staged is not None:
                staged.result()
            may_change = now() - t0
            overwrite = scramble(sd)  # the state may change now
            upload.result()
            return {"blocked": blocked, "may_change": may_change, "returned": type(fut).__name__,
                    "seconds": done.at - t0, "overwrite_s": overwrite}
        return run

    def after(s, rec):
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        rec.setdefault("untimed", {})["restore_s"] = scramble(sd)  # the state as it was at the call
        rec["untimed"]["ref_s"] = ref["s"]
        record_files(ctx, cur)(s, rec)
        if s == "dcp_best":
            rec["stager_cached_storages"] = stager.cached()
            stager.after_save()
        check_saved(rec, load_with(s, cur[0]), sd, ref["sums"], True)
        ctx.rmtree(cur[0])
    return ctx.pair(rep, prepare, after)


def same_layout_load(ctx, rep, ckpt, sd):
    def verify(t):
        return all(bit_equal(local(a), local(b)) for (_, a), (_, b) in zip(leaves(t), leaves(sd)))
    return load_pair(ctx, rep, ckpt, lambda: tmap(torch.zeros_like, sd), verify)


def small_state(n: int, device):
    """n replicated plain fp32 tensors of 1-16 KB, identical on every rank."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    return {f"t{i:05d}": torch.rand(rng.randint(256, 4096), generator=gen).to(device) for i in range(n)}


def write_skeleton(ctx, sd, sdir):
    """Shapes/dtypes of the state (meta tensors), from which other layouts' targets are built."""
    if ctx.rank == 0:
        skel = tmap(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), sd)
        torch.save(skel, os.path.join(sdir, "skeleton.pt"))
    ctx.sync()


def checked(res: dict, rep: int) -> str:
    """How rep ``rep``'s timed checkpoints verified (this rank's records), for the log."""
    bad, n = [], 0
    for sec, rows in res.items():
        if sec == "pairs":
            rows = [r for v in rows.values() for r in v]
        if not isinstance(rows, list):
            continue
        for row in rows:
            if isinstance(row, dict) and row.get("rep") == rep:
                for s, rec in row.items():
                    if isinstance(rec, dict) and "verified" in rec:
                        n += 1
                        if not rec["verified"]:
                            bad.append(f"{sec}/{s}")
    return f"{n} timed checkpoints verified" if not bad else f"VERIFY FAILED: {', '.join(bad)} (of {n})"


def dump(ctx, sdir, name, obj):
    if ctx.rank == 0:
        with open(os.path.join(sdir, name), "w") as f:
            json.dump(obj, f)


# ------------------------------------------------------------------ processes

def setup(rank, cfg, port):
    from torch.distributed.device_mesh import init_device_mesh

    device, gloo = init_dist(rank, cfg.world, port, cfg.device, cfg.world)
    ctx = Ctx(rank, cfg, device, systems=BENCH_SYSTEMS)
    ctx.gloo = gloo
    return ctx, init_device_mesh(device.type, (cfg.world,))


def shape_worker(rank, cfg, port, sdir, shape):
    """One rank of one shape: build, sweep DCP's writer threads, then the reps."""
    ctx, mesh = setup(rank, cfg, port)
    device = ctx.device
    pairs = wanted_pairs(cfg.only)
    res: dict = {"rank": rank, "shape": shape}
    t0 = now()
    sd, res["model"] = build_state(shape, cfg, device, mesh)
    res["build_s"] = now() - t0
    res["payload_bytes"], res["local_bytes"] = sizes(sd)
    res["stats"] = tensor_stats(t for _, t in leaves(sd))
    res["tensors"] = res["stats"]["tensors"]
    write_skeleton(ctx, sd, sdir)
    if pairs:
        ref = checksums(sd, True)
        dump(ctx, sdir, f"ref_w{cfg.world}.json", ref)
    res["sweep"] = sweep_threads(ctx, sd, shape)
    dump(ctx, sdir, "dcp_threads.json", ctx.dcp_threads)
    stager = DcpStager(device.type == "cuda", cfg.dcp_stager)
    if "async" in cfg.only:  # both systems' staging memory before the first save, untimed
        t0 = now()
        zarrckpt.reserve_staging(sd)
        res["reserve_staging_s"] = now() - t0
        t0 = now()
        stager.warm(sd, ctx)
        res["dcp_stager_warm_s"] = now() - t0
        res["dcp_stager"] = ("BlockingAsyncStager(cache_staged_state_dict=True), because DefaultStager "
                             f"failed: {stager.error}") if stager.fallback else f"DefaultStager({stager.options})"
    ckpt: dict = {}
    for rep in range(cfg.reps):
        if "save" in cfg.only:  # free the disk before the storage test
            for p in ckpt.values():
                ctx.rmtree(p)
        res.setdefault("bw", []).extend(
            dict(storage_bw(ctx, res["local_bytes"], t), rep=rep) for t in cfg.bw_threads)
        if ctx.device.type == "cuda":  # the device-to-host bound of a sync save's staging
            res.setdefault("d2h", []).append(dict(d2h_bw(ctx, res["local_bytes"]), rep=rep))
        if "save" in cfg.only:
            res.setdefault("save", []).append(sync_save(ctx, rep, sd, ckpt))
        elif not ckpt:  # the loads need checkpoints: save once, untimed
            sync_save(ctx, rep, sd, ckpt)
        if "async" in cfg.only:
            res.setdefault("async", []).append(async_save(ctx, rep, sd, stager))
        if "load" in cfg.only:
            res.setdefault("load", []).append(same_layout_load(ctx, rep, ckpt, sd))
        if "S0_to_S1" in pairs:
            res.setdefault("pairs", {}).setdefault("S0_to_S1", []).append(load_pair(
                ctx, rep, ckpt, lambda: make_target("shard1", sd, mesh, device),
                lambda t: verify_checksums(t, ref, True)))
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {shape} rep {rep} done; {checked(res, rep)}", flush=True)
    stager.close()
    zarrckpt.release_staging()
    dump(ctx, sdir, f"ckpt_w{cfg.world}.json", ckpt)
    if not (set(pairs) - {"S0_to_S1"}) and not cfg.keep:  # no later load needs them
        for p in ckpt.values():
            ctx.rmtree(p)
    with open(os.path.join(sdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def small_worker(rank, cfg, port, sdir):
    """``--small-tensors`` replicated tiny tensors: the writer-thread sweep, then save and
    load per rep."""
    ctx, _ = setup(rank, cfg, port)
    sd = small_state(cfg.small_tensors, ctx.device)
    out = {"rank": rank, "payload_bytes": sizes(sd)[0], "save": [], "load": []}
    out["sweep"] = sweep_threads(ctx, sd, "small")
    for rep in range(cfg.reps):
        ckpt: dict = {}
        out["save"].append(sync_save(ctx, rep, sd, ckpt, tag="small"))
        out["load"].append(same_layout_load(ctx, rep, ckpt, sd))
        for p in ckpt.values():
            ctx.rmtree(p)
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] small rep {rep} done; {checked(out, rep)}", flush=True)
    with open(os.path.join(sdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def read_ranks(sdir, prefix, n):
    out = []
    for r in range(n):
        with open(os.path.join(sdir, f"{prefix}rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def run_shape(cfg, outdir, shape) -> dict:
    """The shape's own spawn, then the resharding jobs (other world sizes)."""
    sdir = os.path.join(outdir, shape)
    os.makedirs(sdir)
    print(f"[{time.strftime('%H:%M:%S')}] shape {shape}", flush=True)
    mp.spawn(shape_worker, args=(cfg, free_port(), sdir, shape), nprocs=cfg.world)
    ranks = read_ranks(sdir, "", cfg.world)
    pairs = wanted_pairs(cfg.only)
    out = {"ranks": ranks, "pairs": {}}
    if "S0_to_S1" in pairs:
        out["pairs"]["S0_to_S1"] = {"world": cfg.world, "device": cfg.device,
                                    "ranks": [r["pairs"]["S0_to_S1"] for r in ranks]}
    gpus = torch.cuda.device_count() if cfg.device == "cuda" else 0
    for job in jobs(cfg, shape, pairs, gpus) if set(pairs) - {"S0_to_S1"} else []:
        print(f"[{time.strftime('%H:%M:%S')}] {shape}: {job['name']} on {job['world']} rank(s), "
              f"{job['device']}", flush=True)
        mp.spawn(pair_worker, args=(cfg, free_port(), sdir, job), nprocs=job["world"])
        recs = read_ranks(sdir, f"job_{job['name']}_", job["world"])
        for name in job["loads"]:
            out["pairs"][name] = {"world": job["world"], "device": job["device"],
                                  "ranks": [r[name] for r in recs]}
        if job.get("save"):
            out["save_w1"] = recs[0]["save_w1"]
    return out


def machine_info(cfg) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(p):
        try:
            return version(p)
        except PackageNotFoundError:
            return None
    gpu = torch.cuda.get_device_name(0) if cfg.device == "cuda" else None
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    git = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe", "--always",
                          "--dirty"], capture_output=True, text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "argv": sys.argv,
            "host": platform.node(), "cpu_count": os.cpu_count(), "mem_bytes": mem,
            "python": platform.python_version(), "torch": torch.__version__, "tensorstore": ver("tensorstore"),
            "zarrckpt": zarrckpt.__version__, "numpy": ver("numpy"), "git": git or None, "gpu": gpu,
            "gpus": torch.cuda.device_count() if cfg.device == "cuda" else 0, "fs_type": fs_type(cfg.dir),
            "device_desc": f"{cfg.world}x {gpu}" if gpu else f"CPU ({os.cpu_count()} cores)",
            "drop_caches": drop_caches(cfg.dir), "config": vars(cfg)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--state-gb", type=float, default=2.0,
                    help="params + exp_avg + exp_avg_sq per shape, in GB (sets the number of blocks)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", required=True, help="new or empty scratch directory (local disk, /dev/shm/...)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shape", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--hidden", type=int, default=0, help="width H (default 4096; linear: less for tiny states)")
    ap.add_argument("--vocab", type=int, default=131072, help="transformer: embedding rows")
    ap.add_argument("--experts", type=int, default=32, help="moe: experts per block")
    ap.add_argument("--expert-hidden", type=int, default=0, help="moe: expert width F (default H/4)")
    ap.add_argument("--dcp-threads", default="1,2,4,8,16", help="FileSystemWriter thread counts swept")
    ap.add_argument("--sweep-reps", type=int, default=0, help="saves per thread count in the sweep (default --reps)")
    ap.add_argument("--dcp-stager", choices=["reuse", "per-save", "blocking"], default="reuse",
                    help="dcp_best async: one DefaultStager for all saves of a shape, or one per save; "
                         "blocking: BlockingAsyncStager(cache_staged_state_dict=True) (torch 2.11's "
                         "DefaultStager fails on DTensors: KeyError <class 'type'> in its deepcopy)")
    ap.add_argument("--small-tensors", type=int, default=10000)
    ap.add_argument("--bw-threads", default="",
                    help="comma list of threads per rank of the storage test (default: 1,4,16 and zarrckpt's "
                         "file_io_concurrency)")
    ap.add_argument("--sim-tensors", type=int, default=1000)
    ap.add_argument("--sim-coords", type=int, default=16, help="mesh coordinates timed in the sim section")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--out", default=None, help="JSON file (default: bench/out/results-<time>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints under --dir")
    cfg = ap.parse_args(argv)
    cfg.only = [s.strip() for s in cfg.only.split(",") if s.strip()]
    if unknown := set(cfg.only) - set(SECTIONS):
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    cfg.shapes = [s.strip() for s in cfg.shape.split(",") if s.strip()]
    if unknown := set(cfg.shapes) - set(SHAPES):
        ap.error(f"unknown shape(s) {sorted(unknown)}; choose from {SHAPES}")
    cfg.dcp_threads = sorted({int(t) for t in cfg.dcp_threads.split(",")})
    cfg.sweep_reps = cfg.sweep_reps or cfg.reps
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.world:
        ap.error(f"--world {cfg.world} needs as many GPUs; {torch.cuda.device_count()} visible")
    if cfg.bw_threads:
        cfg.bw_threads = sorted({int(t) for t in cfg.bw_threads.split(",")})
    else:
        from zarrckpt.storage import StorageOptions

        cfg.bw_threads = sorted({1, 4, 16, StorageOptions().file_io_concurrency})
    return cfg


def main(argv=None) -> None:
    cfg = parse_args(argv)
    t_start = now()
    os.makedirs(cfg.dir, exist_ok=True)
    if os.listdir(cfg.dir):
        sys.exit(f"--dir {cfg.dir} is not empty; give a new or empty directory")
    outdir = os.path.join(cfg.dir, "_results")
    os.makedirs(outdir)
    info = machine_info(cfg)
    shapes, small, sim = {}, None, None
    if set(cfg.only) & STATE_SECTIONS:
        for shape in cfg.shapes:
            shapes[shape] = run_shape(cfg, outdir, shape)
    if "small" in cfg.only:
        sdir = os.path.join(outdir, "small")
        os.makedirs(sdir)
        mp.spawn(small_worker, args=(cfg, free_port(), sdir), nprocs=cfg.world)
        small = read_ranks(sdir, "", cfg.world)
    if "sim" in cfg.only:
        sim = run_sim(cfg.sim_tensors, cfg.sim_coords)
    info["wall_s"] = now() - t_start
    text, raw = report(cfg, shapes, small, sim, info)
    print(text)
    out = cfg.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                  f"results-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(raw, markdown=text), f, indent=1)
    print(f"\nraw numbers: {out}")
    if not cfg.keep:
        for name in os.listdir(cfg.dir):
            shutil.rmtree(os.path.join(cfg.dir, name), ignore_errors=True)


if __name__ == "__main__":
    main()
