"""What every benchmark process shares: host measurements (page cache, /proc/self/io, RSS),
state helpers, the timed-phase context (``Ctx``), each system's save/load call, the
layout-independent checksums, and the verification of every timed checkpoint: its
checksums at the call (``checksums``), the state overwritten at the may-change point of an
async save and restored afterwards (``scramble``), the checkpoint loaded back and compared
(``verify_checkpoint``), and no time reported for one that fails (``drop_times``)."""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor, Replicate

import zarrckpt
from report import SYSTEMS

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


def init_dist(rank: int, world: int, port: int, device_kind: str, threads_of: int):
    """Process group of ``world`` ranks (NCCL on CUDA, gloo on CPU) plus a gloo side group
    (DCP's async save can deadlock on the default group; also used for small agreements).
    Returns (device, gloo group)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // threads_of))
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(hours=1),
                            device_id=device if device_kind == "cuda" else None)
    return device, dist.new_group(backend="gloo")


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


# ------------------------------------------------------------------ checksums

_M1, _M2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64)  # odd 64-bit constants
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _digest(x: torch.Tensor, offsets, gshape) -> int:
    """Sum over the elements of a box of a tensor (``x`` = the box, at ``offsets`` in a
    tensor of ``gshape``) of ((bits XOR global_index * M2) * M1) mod 2^64. Summed over
    disjoint boxes that cover a tensor, it is the same whatever the boxes: a changed bit,
    or a value at a wrong position, changes it (up to 2^-64 collisions).

    Computed as M1 * sum(bits XOR (row_part + col_part) * M2) (multiplication distributes
    over the sum mod 2^64), a row of pieces at a time in two reused int64 buffers: the same
    value as the per-element formula, without a fresh allocation per piece."""
    if x.numel() == 0:
        return 0
    x = x.detach().contiguous()
    ncol = x.shape[-1] if x.dim() else 1
    bits = x.view(_INT[x.element_size()]).reshape(-1, ncol)
    gstride = [1] * len(gshape)
    for d in range(len(gshape) - 2, -1, -1):
        gstride[d] = gstride[d + 1] * gshape[d + 1]
    rows = torch.arange(bits.shape[0], device=x.device)
    base = torch.zeros_like(rows)
    for d in range(x.dim() - 2, -1, -1):  # global offset of each local row
        base += (rows % x.shape[d] + offsets[d]) * gstride[d]
        rows = rows // x.shape[d]
    col = torch.arange(ncol, device=x.device) + (offsets[-1] if x.dim() else 0)
    row_m2, col_m2 = base * _M2, col * _M2  # (row + col) * M2 = row * M2 + col * M2 (mod 2^64)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    step = max(1, ((8 << 20) if x.is_cuda else (1 << 20)) // ncol)
    n = min(step, bits.shape[0])
    idx = torch.empty((n, ncol), dtype=torch.int64, device=x.device)
    val = torch.empty((n, ncol), dtype=torch.int64, device=x.device)
    for a in range(0, bits.shape[0], step):
        m = min(step, bits.shape[0] - a)
        g, v = idx[:m], val[:m]
        torch.add(row_m2[a:a + m, None], col_m2[None, :], out=g)
        v.copy_(bits[a:a + m])
        total += v.bitwise_xor_(g).sum()
    return int(total * _M1)


def _box(t):
    """(local data, global offsets, global shape, counted here?) of a tensor leaf; a
    replicated copy is counted by one rank only."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        coord = t.device_mesh.get_coordinate() or []
        counted = all(c == 0 for c, p in zip(coord, t.placements) if isinstance(p, Replicate))
        return t.to_local(), offsets, tuple(t.shape), counted
    counted = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return t, (0,) * t.dim(), tuple(t.shape), counted


def checksums(sd, distributed: bool) -> dict[str, int]:
    """Per tensor key, the layout-independent checksum of all its elements (collective
    over the default group when ``distributed``)."""
    keys, vals = [], []
    for path, t in leaves(sd):
        x, offsets, gshape, counted = _box(t)
        keys.append("/".join(map(str, path)))
        vals.append(_digest(x, offsets, gshape) if counted else 0)
    if distributed:
        dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else "cpu"
        v = torch.tensor(vals, dtype=torch.int64, device=dev)
        dist.all_reduce(v)
        vals = v.tolist()
    return dict(zip(keys, vals))


def verify_checksums(target, ref: dict[str, int], distributed: bool) -> bool:
    got = checksums(target, distributed)
    return got.keys() == ref.keys() and all(got[k] == ref[k] for k in ref)


# ------------------------------------------------- verifying what was timed

VERIFY_GROUP_BYTES = int(os.environ.get("ZB_VERIFY_GROUP_MIB", "1024")) << 20
TIME_KEYS = ("seconds", "blocked", "may_change", "staged", "total", "committed")


def scramble(sd) -> float:
    """Overwrite every local shard of ``sd`` in place with garbage: every bit of every
    element flipped (bitwise NOT of the bits: floats become other, mostly huge or NaN,
    values; ``logical_not`` for bool). Each element changes, and a second call restores
    the state bit for bit, so the benchmark's later repetitions see the state they expect
    with no copy kept and no new buffer. On CUDA the kernels are queued on the current
    stream. Returns the host seconds it took."""
    t0 = now()
    seen = set()
    with torch.no_grad():
        for _, t in leaves(sd):
            x = local(t)
            if x.numel() == 0 or x.device.type == "meta":
                continue
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)
            if key in seen:  # the same memory twice (tied leaves): flipping it twice would undo it
                continue
            seen.add(key)
            if x.dtype == torch.bool:
                x.logical_not_()
            else:
                x.view(_INT[x.element_size()]).bitwise_not_()
    return now() - t0


def _weight(t) -> int:
    """Bytes a leaf holds per rank, the same number on every rank (a DTensor's global
    bytes over its mesh size), so that every rank cuts the same groups."""
    n = t.numel() * t.element_size()
    return n // t.device_mesh.size() if isinstance(t, DTensor) else n


def _subset(obj, keep: set[int]):
    """Fresh zeros of the tensors of ``obj`` whose id is in ``keep``, in the same nested
    dicts (other keys left out); a list or tuple holding one of them is taken whole.
    None when nothing is kept."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj) if id(obj) in keep else None
    if isinstance(obj, dict):
        out = {k: v for k, v in ((k, _subset(v, keep)) for k, v in obj.items()) if v is not None}
        return out or None
    if isinstance(obj, (list, tuple)):
        return tmap(torch.zeros_like, obj) if any(id(t) in keep for _, t in leaves(obj)) else None
    return None


def _agree_failed(failed: bool, distributed: bool) -> bool:
    if not distributed:
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    dist.all_reduce(flag, group=_cpu_group())
    return bool(flag.item())


_CPU_GROUP: dict = {}


def _cpu_group():
    """A gloo group for the verifier's own agreement (the default group may be NCCL); one
    per default group (made collectively the first time every rank verifies)."""
    default = dist.distributed_c10d._get_default_group()
    if default not in _CPU_GROUP:
        _CPU_GROUP.clear()
        _CPU_GROUP[default] = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _CPU_GROUP[default]


def verify_checkpoint(load, sd, ref: dict[str, int], distributed: bool, group_bytes: int | None = None) -> dict:
    """Load a checkpoint of ``sd`` with the system's own load (``load(target)``, collective)
    into fresh zeros of ``sd``'s layout, at most ``group_bytes`` per rank at a time
    (default ``ZB_VERIFY_GROUP_MIB``, 1024 MiB: the memory verification adds between timed
    phases is bounded), and compare the layout-independent checksum of every tensor with
    ``ref`` (``checksums(sd)`` taken at the call). Untimed. Returns ``verified``,
    ``verify_s``, the first keys that differ (``wrong``) and a load's error, if any."""
    t0 = now()
    limit = group_bytes or VERIFY_GROUP_BYTES
    groups: list[list] = [[]]
    size = 0
    for _, t in leaves(sd):
        w = _weight(t)
        if groups[-1] and size + w > limit:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += w
    got: dict[str, int] = {}
    error = None
    for g in groups:
        if not g:
            continue
        target = _subset(sd, {id(t) for t in g})
        try:
            load(target)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be loaded is not verified
            error = f"{type(e).__name__}: {e}"[:500]
        if _agree_failed(error is not None, distributed):
            error = error or "the load failed on another rank"
            break
        got.update(checksums(target, distributed))
        del target
    wrong = [] if error else [k for k in ref if got.get(k) != ref[k]] + sorted(set(got) - set(ref))
    out = {"verified": error is None and not wrong, "verify_s": now() - t0}
    if wrong:
        out["wrong"] = wrong[:8]
        out["wrong_count"] = len(wrong)
    if error:
        out["verify_error"] = error
    return out


def drop_times(rec: dict) -> dict:
    """A record whose checkpoint failed verification reports no time: its timing fields
    are set to None (the measured values are kept apart, under ``unverified_times``)."""
    if rec.get("verified") is False:
        kept = {k: rec[k] for k in TIME_KEYS if rec.get(k) is not None}
        if kept:
            rec["unverified_times"] = kept
        for k in kept:
            rec[k] = None
    return rec


def check_saved(rec: dict, load, sd, ref: dict[str, int], distributed: bool) -> dict:
    """Verify the checkpoint a timed phase wrote (``verify_checkpoint``) and record the
    outcome in ``rec``: ``verified``, its seconds under ``untimed.verify_s``, and no time
    when it failed (``drop_times``)."""
    v = verify_checkpoint(load, sd, ref, distributed)
    rec.setdefault("untimed", {})["verify_s"] = v.pop("verify_s")
    rec.update(v)
    return drop_times(rec)


class Commit:
    """When a future completed, by a done-callback (called in the thread that completes
    it), so that work the caller does meanwhile -- overwriting the state after the
    may-change point -- is not counted in the save's time. Register it right after the
    call returns."""

    def __init__(self, fut) -> None:
        self.at = None
        fut.add_done_callback(self._done)

    def _done(self, _) -> None:
        if self.at is None:
            self.at = now()


# ------------------------------------------------------------------- harness

def rotate(seq, rep: int) -> list:
    """The order of rep ``rep``: rotated by one each rep (for two, alternating)."""
    k = rep % len(seq)
    return list(seq[k:]) + list(seq[:k])


class Ctx:
    """One process's view: barriers (when distributed), page-cache drops, timed phases.
    ``systems``: those every timed pair runs (default zarrckpt and DCP, as bench_s3.py
    uses it); ``dcp_threads``: the FileSystemWriter thread count of the ``dcp_best`` system."""

    def __init__(self, rank, cfg, device, distributed=True, systems=SYSTEMS):
        self.rank, self.cfg, self.device, self.distributed = rank, cfg, device, distributed
        self.systems = tuple(systems)
        self.mon = RssMonitor()
        self.dcp_threads = 1

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
        plus whatever dict ``fn`` returns. ``fn`` may return its own ``seconds`` (an async
        save: from the call to the commit, leaving out the overwrite of the state that
        runs meanwhile); the barrier-to-barrier time is then kept as ``phase_s``."""
        self.sync()
        io0 = proc_io()
        with self.mon.phase() as rec:
            t0 = now()
            extra = fn()
            self.sync()
            rec["seconds"] = now() - t0
        io1 = proc_io()
        rec.update({k: io1[k] - io0[k] for k in io0})
        if isinstance(extra, dict) and "seconds" in extra:
            rec["phase_s"] = rec["seconds"]
        rec.update(extra if isinstance(extra, dict) else {})
        return rec

    def pair(self, rep, prepare, after=None) -> dict:
        """Every system once, in an order rotated by one each rep (two systems: zarrckpt
        first on even reps). ``prepare(system)`` (untimed) returns the callable to time;
        ``after(system, record)`` verifies / cleans up (untimed)."""
        order = rotate(self.systems, rep)
        out = {"rep": rep, "order": order}
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


_PINNED: dict[int, torch.Tensor] = {}


def d2h_bw(ctx: Ctx, nbytes: int) -> dict:
    """The bound of device-to-host staging: ``nbytes`` per rank copied from one device
    buffer into a page-locked host buffer (allocated once per process, untimed), every
    rank at once (the host's copy engines and memory are shared)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = _PINNED.get(nbytes)
    if dst is None:
        dst = _PINNED[nbytes] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)  # warm
    torch.cuda.synchronize()
    m = ctx.measure(lambda: (dst.copy_(src, non_blocking=True), torch.cuda.synchronize()))
    del src
    return {"bytes": nbytes, "seconds": m["seconds"]}


# ------------------------------------------------------------ the systems' calls

def saver(ctx: Ctx, s: str, sd, path: str):
    """The timed sync save of system ``s``: zarrckpt with no options; DCP with its
    defaults (1 thread per rank); DCP best with ``ctx.dcp_threads`` writer threads."""
    if s == "zc":
        return lambda: {"report": zarrckpt.save(sd, path)}
    if s == "dcp":
        return lambda: dcp.save(sd, checkpoint_id=path)
    return lambda: dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=ctx.dcp_threads))


def loader(s: str, target, path: str, no_dist: bool = False):
    """The timed load of system ``s``. Both DCP systems use ``FileSystemReader``, which has
    no thread or other speed option in torch 2.13 (``dcp_best`` reads the checkpoint that
    its tuned writer wrote)."""
    if s != "zc":
        return lambda: dcp.load(target, checkpoint_id=path, no_dist=no_dist)

    def run():
        rep: dict = {}
        prof = os.environ.get("ZB_PROFILE_LOAD")  # a diagnostic: cProfile each load of rank 0
        if prof and (not dist.is_initialized() or dist.get_rank() == 0):
            import cProfile
            pr = cProfile.Profile()
            pr.runcall(zarrckpt.load, target, path, report=rep)
            pr.dump_stats(f"{prof}.{time.time_ns()}")
        else:
            zarrckpt.load(target, path, report=rep)
        return {"report": rep}
    return run


def load_with(s: str, path: str, no_dist: bool = False):
    """``load(target)`` of system ``s`` for the checkpoint at ``path`` (for verification)."""
    return lambda target: loader(s, target, path, no_dist)()


def load_pair(ctx: Ctx, rep: int, ckpt: dict, make_target, verify, no_dist: bool = False) -> dict:
    """Each system loads its checkpoint into a fresh target (built untimed, cache dropped)."""
    box = {}

    def prepare(s):
        t0 = now()
        box["t"] = target = make_target()
        t1 = now()
        box["needed"], box["drop"] = sizes(target)[1], ctx.drop()
        box["untimed"] = {"target_s": t1 - t0, "drop_s": now() - t1}
        return loader(s, target, ckpt[s], no_dist)

    def after(s, rec):
        rec["bytes_needed"], rec["drop"] = box["needed"], box["drop"]
        t0 = now()
        rec["verified"] = bool(verify(box.pop("t")))
        rec["untimed"] = dict(box["untimed"], verify_s=now() - t0)
        drop_times(rec)
    return ctx.pair(rep, prepare, after)
