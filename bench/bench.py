"""zarrckpt vs torch.distributed.checkpoint (DCP): one command, same state, same run.

    python bench/bench.py --device cpu|cuda --state-gb 2 --reps 3 --dir /path \
        [--world 2] [--small-tensors 10000] [--out results.json] \
        [--only save,async,load,reshard,small,sim]

Spawns the ranks itself, alternates the two systems (zarrckpt first on even reps,
DCP first on odd), measures the storage's own bandwidth in every rep, prints one
markdown table per section and writes every raw number to JSON. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

import zarrckpt
from report import SYSTEMS, report
from sim import run_sim

SECTIONS = ("save", "async", "load", "reshard", "small", "sim")
BW_BLOCK = 8 << 20
now = time.perf_counter


# ----------------------------------------------------------------- host helpers

def fs_type(path: str) -> str:
    path, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind


def drop_caches(path: str) -> str:
    """Drop the page cache (needs root); skipped on tmpfs, whose data lives in memory."""
    if fs_type(path) in ("tmpfs", "ramfs"):
        return "skipped (tmpfs)"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as e:
        return f"not permitted ({e.strerror})"


def proc_io() -> dict[str, int]:
    """rchar: bytes returned by read syscalls (page cache included); read_bytes: block device."""
    try:
        with open("/proc/self/io") as f:
            rows = dict(line.split(": ") for line in f.read().splitlines())
        return {"rchar": int(rows["rchar"]), "read_bytes": int(rows["read_bytes"])}
    except OSError:
        return {"rchar": 0, "read_bytes": 0}


class RssMonitor:
    """Samples VmRSS every 20 ms; ``phase()`` yields a dict that receives the peak above the
    phase's starting RSS and what the phase left allocated (MB)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.peak, self.lock, self.interval = 0, threading.Lock(), interval
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))

    def _run(self) -> None:
        while True:
            v = self.rss()
            with self.lock:
                self.peak = max(self.peak, v)
            time.sleep(self.interval)

    @contextlib.contextmanager
    def phase(self):
        base = self.rss()
        with self.lock:
            self.peak = base
        rec: dict = {}
        yield rec
        end = self.rss()
        with self.lock:
            peak = max(self.peak, end)
        rec["rss_peak_mb"], rec["rss_retained_mb"] = (peak - base) / 2**20, (end - base) / 2**20


def dir_stats(path: str) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = size = 0
    for root, _, names in os.walk(path):
        files += len(names)
        size += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return files, size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------- state helpers

def tmap(fn, obj):
    """Map ``fn`` over the tensor leaves of a nested dict/list/tuple; deep-copy the rest."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tmap(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tmap(fn, v) for v in obj)
    return copy.deepcopy(obj)


def leaves(obj, prefix=()):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (dict, list, tuple)):
        for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            yield from leaves(v, prefix + (k,))


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def bit_equal(a, b) -> bool:
    a, b = a.detach().contiguous(), b.detach().to(a.device).contiguous()
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def get_at(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def sizes(sd) -> tuple[int, int]:
    """(global bytes of the state's tensors, bytes held by this rank)."""
    ts = [t for _, t in leaves(sd)]
    return (sum(t.numel() * t.element_size() for t in ts),
            sum(local(t).numel() * t.element_size() for t in ts))


def build_state(cfg, device, mesh):
    """FSDP2 stack of Linear layers + AdamW after one step, fp32: params + 2 moments ~ state_gb."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    n_params = cfg.state_gb * 1e9 / 12
    hidden = cfg.hidden or 4096
    while not cfg.hidden and hidden > 64 and n_params / (hidden * hidden + hidden) < 8:
        hidden //= 2
    layers = max(1, round(n_params / (hidden * hidden + hidden)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(1234 + mesh.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-hidden ** -0.5, hidden ** -0.5, generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, hidden, device=device, generator=gen)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}, {"hidden": hidden, "layers": layers}


def small_state(n: int, device):
    """n replicated plain fp32 tensors of 1-16 KB, identical on every rank."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    return {f"t{i:05d}": torch.rand(rng.randint(256, 4096), generator=gen).to(device) for i in range(n)}


# ------------------------------------------------------------------- harness

class Ctx:
    """One process's view: barriers (when distributed), page-cache drops, timed phases."""

    def __init__(self, rank, cfg, device, distributed=True):
        self.rank, self.cfg, self.device, self.distributed = rank, cfg, device, distributed
        self.mon = RssMonitor()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if self.distributed:
            dist.barrier()

    def drop(self) -> str:
        status = drop_caches(self.cfg.dir) if self.rank == 0 else ""
        self.sync()
        return status

    def rmtree(self, path):
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.sync()

    def measure(self, fn) -> dict:
        """Barrier, run ``fn``, barrier: seconds, RSS peak/retained, /proc/self/io deltas,
        plus whatever dict ``fn`` returns."""
        self.sync()
        io0 = proc_io()
        with self.mon.phase() as rec:
            t0 = now()
            extra = fn()
            self.sync()
            rec["seconds"] = now() - t0
        io1 = proc_io()
        rec.update({k: io1[k] - io0[k] for k in io0})
        rec.update(extra if isinstance(extra, dict) else {})
        return rec

    def pair(self, rep, prepare, after=None) -> dict:
        """Both systems, zarrckpt first on even reps. ``prepare(system)`` (untimed) returns
        the callable to time; ``after(system, record)`` verifies / cleans up (untimed)."""
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        out = {"rep": rep, "order": list(order)}
        for s in order:
            fn = prepare(s)
            out[s] = self.measure(fn)
            if after:
                after(s, out[s])
        return out


def storage_bw(ctx: Ctx, nbytes: int, threads: int) -> dict:
    """Plain sequential writes of ``nbytes`` per rank spread over ``threads`` files (8 MiB
    writes, fsync per file), then reads of them after dropping the page cache."""
    d = os.path.join(ctx.cfg.dir, "bw")
    os.makedirs(d, exist_ok=True)
    paths = [os.path.join(d, f"r{ctx.rank}_t{i}") for i in range(threads)]
    per = max(nbytes // threads, 1)
    block = memoryview(os.urandom(BW_BLOCK))

    def write(p):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = per
        while left:
            left -= os.write(fd, block[:min(BW_BLOCK, left)])
        os.fsync(fd)
        os.close(fd)

    def read(p):
        buf = bytearray(BW_BLOCK)
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    with ThreadPoolExecutor(threads) as pool:
        w = ctx.measure(lambda: list(pool.map(write, paths)))
        drop = ctx.drop()
        r = ctx.measure(lambda: list(pool.map(read, paths)))
    for p in paths:
        os.remove(p)
    ctx.sync()
    return {"threads": threads, "bytes": per * threads, "write_s": w["seconds"], "read_s": r["seconds"],
            "drop": drop}


# ---------------------------------------------------------------- sections

def saver(s, sd, path):
    if s == "zc":
        return lambda: {"report": zarrckpt.save(sd, path)}
    return lambda: dcp.save(sd, checkpoint_id=path)


def record_files(ctx, cur):
    def after(_, rec):
        if ctx.rank == 0:
            rec["files"], rec["disk_bytes"] = dir_stats(cur[0])
    return after


def sync_save(ctx, rep, sd, ckpt, tag="sync"):
    """Timed saves into fresh directories; ``ckpt`` keeps the latest per system (for loads)."""
    for p in ckpt.values():
        ctx.rmtree(p)
    cur = [None]

    def prepare(s):
        ckpt[s] = cur[0] = os.path.join(ctx.cfg.dir, f"{s}_{tag}_{rep}")
        return saver(s, sd, cur[0])
    return ctx.pair(rep, prepare, record_files(ctx, cur))


def async_save(ctx, rep, sd, dcp_group):
    cur = [None]

    def prepare(s):
        cur[0] = path = os.path.join(ctx.cfg.dir, f"{s}_async_{rep}")

        def run():
            t0 = now()
            if s == "zc":
                fut = zarrckpt.async_save(sd, path)
                blocked = now() - t0
                fut.wait_staged()  # CUDA copies run on a side stream after the call returns
                may_change = now() - t0
                return {"blocked": blocked, "may_change": may_change, "staged_seconds": fut.staged_seconds,
                        "report": fut.result()}
            fut = dcp.async_save(sd, checkpoint_id=path, process_group=dcp_group)
            blocked = now() - t0
            getattr(fut, "upload_completion", fut).result()  # Future, or AsyncSaveResponse
            return {"blocked": blocked, "may_change": blocked}  # default DCP stages before returning
        return run

    def after(s, rec):
        record_files(ctx, cur)(s, rec)
        ctx.rmtree(cur[0])
    return ctx.pair(rep, prepare, after)


def load_pair(ctx, rep, ckpt, make_target, verify, no_dist=False):
    """Each system loads its checkpoint into a fresh target (built untimed, cache dropped)."""
    box = {}

    def prepare(s):
        box["t"] = target = make_target()
        box["needed"], box["drop"] = sizes(target)[1], ctx.drop()
        if s == "dcp":
            return lambda: dcp.load(target, checkpoint_id=ckpt[s], no_dist=no_dist)

        def run():
            rep_: dict = {}
            zarrckpt.load(target, ckpt[s], report=rep_)
            return {"report": rep_}
        return run

    def after(s, rec):
        rec["bytes_needed"], rec["drop"] = box["needed"], box["drop"]
        rec["verified"] = verify(box.pop("t"))
    return ctx.pair(rep, prepare, after)


def same_layout_load(ctx, rep, ckpt, sd):
    def verify(t):
        return all(bit_equal(local(a), local(b)) for (_, a), (_, b) in zip(leaves(t), leaves(sd)))
    return load_pair(ctx, rep, ckpt, lambda: tmap(torch.zeros_like, sd), verify)


def small_section(ctx, device):
    sd = small_state(ctx.cfg.small_tensors, device)
    out = {"payload_bytes": sizes(sd)[0], "save": [], "load": []}
    for rep in range(ctx.cfg.reps):
        ckpt: dict = {}
        out["save"].append(sync_save(ctx, rep, sd, ckpt, tag="small"))
        out["load"].append(same_layout_load(ctx, rep, ckpt, sd))
        for p in ckpt.values():
            ctx.rmtree(p)
    return out


def write_skeleton(ctx, sd, outdir):
    """Shapes/dtypes of the state (meta tensors) + two full reference tensors, from which
    the resharded loads build and check their targets."""
    skel = tmap(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), sd)
    first = next(iter(sd["model"]))
    keys = [("model", first), ("optim", "state", first, "exp_avg")]
    ref = {"/".join(k): get_at(sd, k).full_tensor().cpu() for k in keys}  # collective
    if ctx.rank == 0:
        torch.save({"skeleton": skel, "ref": ref, "ref_keys": keys}, os.path.join(outdir, "skeleton.pt"))
    ctx.sync()


def read_skeleton(outdir):
    return torch.load(os.path.join(outdir, "skeleton.pt"), weights_only=False)


def shard1_target(outdir, mesh):
    """Every 2-D tensor a DTensor [Shard(1)], 1-D [Shard(0)], 0-D plain CPU (as AdamW's step)."""
    from torch.distributed.tensor import zeros as dzeros

    def make(m):
        if m.dim() == 0:
            return torch.zeros((), dtype=m.dtype)
        return dzeros(*m.shape, dtype=m.dtype, device_mesh=mesh, placements=[Shard(1 if m.dim() >= 2 else 0)])
    return tmap(make, read_skeleton(outdir)["skeleton"])


def verify_ref(target, outdir) -> bool:
    sk = read_skeleton(outdir)
    ok = True
    for k in sk["ref_keys"]:
        t = get_at(target, k)
        ok &= bit_equal(t.full_tensor() if isinstance(t, DTensor) else t, sk["ref"]["/".join(k)])
    return ok


def dist_worker(rank, cfg, port, outdir):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world))
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo", rank=rank, world_size=cfg.world,
                            timeout=datetime.timedelta(hours=1),
                            device_id=device if cfg.device == "cuda" else None)
    dcp_group = dist.new_group(backend="gloo")  # DCP's async save can deadlock on the default group
    mesh = init_device_mesh(device.type, (cfg.world,))
    ctx = Ctx(rank, cfg, device)
    res: dict = {"rank": rank}
    ckpt: dict = {}
    if set(cfg.only) & {"save", "async", "load", "reshard"}:
        t0 = now()
        sd, res["model"] = build_state(cfg, device, mesh)
        res["build_s"] = now() - t0
        res["payload_bytes"], res["local_bytes"] = sizes(sd)
        res["tensors"] = sum(1 for _ in leaves(sd))
        write_skeleton(ctx, sd, outdir)
        if "async" in cfg.only:  # page-lock the async staging buffer before the first save
            t0 = now()
            zarrckpt.reserve_staging(sd)
            res["reserve_staging_s"] = now() - t0
        for rep in range(cfg.reps):
            if "save" in cfg.only:  # free the disk before the storage test (peak: ~3x the state)
                for p in ckpt.values():
                    ctx.rmtree(p)
            res.setdefault("bw", []).extend(
                dict(storage_bw(ctx, res["local_bytes"], t), rep=rep) for t in sorted({1, cfg.bw_threads}))
            if "save" in cfg.only:
                res.setdefault("save", []).append(sync_save(ctx, rep, sd, ckpt))
            elif not ckpt:  # the loads need a checkpoint: save once, untimed
                sync_save(ctx, rep, sd, ckpt)
            if "async" in cfg.only:
                res.setdefault("async", []).append(async_save(ctx, rep, sd, dcp_group))
            if "load" in cfg.only:
                res.setdefault("load", []).append(same_layout_load(ctx, rep, ckpt, sd))
            if "reshard" in cfg.only:
                res.setdefault("reshard2", []).append(load_pair(
                    ctx, rep, ckpt, lambda: shard1_target(outdir, mesh), lambda t: verify_ref(t, outdir)))
        with open(os.path.join(outdir, "ckpt.json"), "w") as f:
            json.dump(ckpt, f)
        del sd
    if "small" in cfg.only:
        res["small"] = small_section(ctx, device)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def one_rank_worker(_, cfg, outdir):
    """Resharded load onto 1 process, no process group: plain full-shape CPU tensors."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with open(os.path.join(outdir, "ckpt.json")) as f:
        ckpt = json.load(f)
    ctx = Ctx(0, cfg, torch.device("cpu"), distributed=False)
    skel = read_skeleton(outdir)["skeleton"]
    out = [load_pair(ctx, rep, ckpt, lambda: tmap(lambda m: torch.zeros(m.shape, dtype=m.dtype), skel),
                     lambda t: verify_ref(t, outdir), no_dist=True) for rep in range(cfg.reps)]
    with open(os.path.join(outdir, "reshard1.json"), "w") as f:
        json.dump(out, f)


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
    ap.add_argument("--state-gb", type=float, default=2.0, help="params + exp_avg + exp_avg_sq, in GB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", required=True, help="new or empty scratch directory (local disk, /dev/shm/...)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--small-tensors", type=int, default=10000)
    ap.add_argument("--hidden", type=int, default=0, help="Linear width (default 4096; less for tiny states)")
    ap.add_argument("--bw-threads", type=int, default=0,
                    help="threads per rank of the storage test besides 1 (default: zarrckpt's file_io_concurrency)")
    ap.add_argument("--sim-tensors", type=int, default=1000)
    ap.add_argument("--sim-coords", type=int, default=16, help="mesh coordinates timed in the sim section")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--out", default=None, help="JSON file (default: bench/out/results-<time>.json)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints under --dir")
    cfg = ap.parse_args(argv)
    cfg.only = [s.strip() for s in cfg.only.split(",") if s.strip()]
    if unknown := set(cfg.only) - set(SECTIONS):
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.world:
        ap.error(f"--world {cfg.world} needs as many GPUs; {torch.cuda.device_count()} visible")
    if not cfg.bw_threads:
        from zarrckpt.storage import StorageOptions

        cfg.bw_threads = StorageOptions().file_io_concurrency
    return cfg


def main(argv=None) -> None:
    cfg = parse_args(argv)
    os.makedirs(cfg.dir, exist_ok=True)
    if os.listdir(cfg.dir):
        sys.exit(f"--dir {cfg.dir} is not empty; give a new or empty directory")
    outdir = os.path.join(cfg.dir, "_results")
    os.makedirs(outdir)
    info = machine_info(cfg)
    ranks, reshard1, sim = [], None, None
    if set(cfg.only) - {"sim"}:
        mp.spawn(dist_worker, args=(cfg, free_port(), outdir), nprocs=cfg.world)
        for r in range(cfg.world):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        if "reshard" in cfg.only:
            mp.spawn(one_rank_worker, args=(cfg, outdir), nprocs=1)
            with open(os.path.join(outdir, "reshard1.json")) as f:
                reshard1 = json.load(f)
    if "sim" in cfg.only:
        sim = run_sim(cfg.sim_tensors, cfg.sim_coords)
    text, raw = report(cfg, ranks, reshard1, sim, info)
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
