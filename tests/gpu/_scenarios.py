"""The GPU correctness scenarios: each runs on every rank of an NCCL world (one GPU a rank)
and checks values bit for bit against what the state held at the call, with the state
overwritten right after the documented point where it may change (``save`` returned;
``async_save``'s ``wait_staged()`` returned).

A scenario is ``name(ctx)``; it raises on a wrong value. ``ctx`` holds the rank, the world
size, a scratch directory shared by the ranks (``ctx.dir(name)``) and the default mesh.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import zarrckpt

SCENARIOS: dict[str, tuple[int, Callable]] = {}  # name -> (least world size, function)
REUSED: list[bool] = []  # per async_and_check: did the save reuse the previous plans and staging?


def scenario(min_world: int = 1):
    def deco(fn):
        SCENARIOS[fn.__name__] = (min_world, fn)
        return fn
    return deco


@dataclass
class Ctx:
    rank: int
    world: int
    root: str
    notes: dict

    def dir(self, name: str) -> str:
        path = os.path.join(self.root, name)
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        dist.barrier()
        return path

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())


# ---- the state and its checks ---------------------------------------------------------------

def _dtensor_type():
    from torch.distributed.tensor import DTensor
    return DTensor


def leaves(d: Any, p: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor leaf, Stateful objects through their state_dict."""
    out = []
    if hasattr(d, "state_dict") and not isinstance(d, (dict, torch.Tensor)):
        d = d.state_dict()
    if isinstance(d, dict):
        for k, v in d.items():
            out += leaves(v, f"{p}/{k}")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            out += leaves(v, f"{p}/{i}")
    elif isinstance(d, torch.Tensor):
        out.append((p, d))
    return out


def loc(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, _dtensor_type()) else t


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    """Every leaf's local values, copied to the CPU (what the checkpoint must hold)."""
    torch.cuda.synchronize()
    return {k: loc(t).detach().cpu().clone() for k, t in leaves(state)}


def full_snapshot(state: dict) -> dict[str, torch.Tensor]:
    """Every leaf's global value on the CPU (collective for DTensors)."""
    out = {}
    for k, t in leaves(state):
        out[k] = (t.full_tensor() if isinstance(t, _dtensor_type()) else t).detach().cpu().clone()
    return out


def _bump(t: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.dtype.is_floating_point and t.element_size() == 1:  # fp8: no add kernel
        t.copy_((t.float() + 1).to(t.dtype))
    else:
        t.add_(1)


def train_step(state: dict) -> None:
    """Every value changes (on the training stream)."""
    with torch.no_grad():
        for _, t in leaves(state):
            _bump(loc(t))


def overwrite(state: dict) -> None:
    """What training does once the state may change: every value, at once, on the
    current stream (no synchronize: a save must not depend on the caller's waiting)."""
    with torch.no_grad():
        for _, t in leaves(state):
            x = loc(t)
            if x.dtype == torch.bool:
                x.logical_not_()
            elif x.dtype.is_floating_point and x.element_size() == 1:
                x.copy_(torch.full_like(x, float("nan"), dtype=torch.float32).to(x.dtype))
            elif x.dtype.is_floating_point:
                x.fill_(float("nan"))
            else:
                x.fill_(-7)


def put_back(state: dict, ref: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in leaves(state):
            loc(t).copy_(ref[k].to(loc(t).device))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads included), dtype and shape too."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().cpu(), b.contiguous().cpu()
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def expect_equal(what: str, got: dict, ref: dict) -> None:
    missing = sorted(set(ref) - set(got))
    wrong = [k for k in ref if k in got and not same(got[k], ref[k])]
    if missing or wrong:
        raise AssertionError(f"{what}: {len(wrong)} leaves wrong {wrong[:4]}, missing {missing[:4]}")


def check_checkpoint(state: dict, path: str, ref: dict, full_ref: dict | None = None) -> None:
    """The checkpoint at ``path`` holds ``ref``: loaded back into ``state`` in place (this
    rank's shards, on their devices) and, where ``full_ref`` is given, as plain CPU tensors
    (``load_state_dict``, the global values). ``state`` is left holding ``ref``."""
    overwrite(state)
    zarrckpt.load(state, path)
    expect_equal(f"{path} loaded in place", snapshot(state), ref)
    if full_ref is not None:
        sd = zarrckpt.load_state_dict(path)
        expect_equal(f"{path} load_state_dict", dict(leaves(sd)), full_ref)
    put_back(state, ref)


def async_and_check(state: dict, path: str, *, full: bool = True, **kw) -> dict:
    """One async save, the state overwritten right after wait_staged(); checked."""
    ref = snapshot(state)
    full_ref = full_snapshot(state) if full else None
    fut = zarrckpt.async_save(state, path, **kw)
    fut.wait_staged()
    overwrite(state)
    REUSED.append(fut.run.leaf_sources is not None)  # the later-save fast path ran
    report = fut.result(timeout=300)
    dist.barrier()
    put_back(state, ref)
    check_checkpoint(state, path, ref, full_ref)
    return report


def sync_and_check(state: dict, path: str, *, full: bool = True, **kw) -> dict:
    ref = snapshot(state)
    full_ref = full_snapshot(state) if full else None
    report = zarrckpt.save(state, path, **kw)
    overwrite(state)
    dist.barrier()
    put_back(state, ref)
    check_checkpoint(state, path, ref, full_ref)
    return report


# ---- models -------------------------------------------------------------------------------

def fsdp2_adamw(ctx: Ctx, layers: int = 4, width: int = 256, mesh: Any = None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width, device="cuda")).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


class Box:
    """A Stateful holding a GPU tensor and a value."""

    def __init__(self, device) -> None:
        self.t = torch.arange(6.0, device=device)
        self.n = 3

    def state_dict(self) -> dict:
        return {"t": self.t, "n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.t.copy_(sd["t"])
        self.n = sd["n"]


def mixed_state(ctx: Ctx) -> dict:
    """DTensors (sharded, replicated), GPU and CPU plain tensors (the same on every rank),
    0-d leaves on both, bf16/fp16/fp8/bool/int, a Stateful and plain values."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = ctx.notes["mesh"]
    g = torch.Generator().manual_seed(1)
    dev = ctx.device
    state = {
        "w": distribute_tensor(torch.randn(64, 48, generator=g).to(dev), mesh, [Shard(0)]),
        "w_bf16": distribute_tensor(torch.randn(33, 20, generator=g).to(dev, torch.bfloat16), mesh, [Shard(1)]),
        "rep": distribute_tensor(torch.randn(10, generator=g).to(dev), mesh, [Replicate()]),
        "gpu": torch.randn(300, generator=g).to(dev),
        "gpu_big": torch.randn(3 << 20, generator=g).to(dev),  # 12 MiB: copied straight
        "gpu_strided": torch.randn(40, 30, generator=g).to(dev).t(),  # not contiguous
        "cpu": torch.randn(50, generator=g),
        "step_gpu": torch.tensor(7.0, device=dev),
        "step_cpu": torch.tensor(3.0),
        "half": torch.randn(17, generator=g).to(dev, torch.float16),
        "e4m3": torch.randn(40, generator=g).to(dev).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(24, generator=g).to(dev).to(torch.float8_e5m2),
        "flags": (torch.rand(13, generator=g) > 0.5).to(dev),
        "ints": torch.arange(11, device=dev),
        "box": Box(dev),
        "epoch": 4, "name": "run", "sched": {"lr": [0.1, 0.01]},
    }
    for i in range(40):  # AdamW-like triples: small GPU leaves with 0-d CPU ones between them
        state[f"opt{i:02d}"] = {"exp_avg": torch.randn(64, generator=g).to(dev),
                                "exp_avg_sq": torch.rand(64, generator=g).to(dev, torch.bfloat16),
                                "step": torch.tensor(float(i))}
    return state


# ---- scenarios ---------------------------------------------------------------------------

@scenario()
def async_saves_fsdp2_adamw(ctx: Ctx) -> None:
    """Issue 27's reproduction, then every case the issue names: first and later saves,
    after a load, after release_staging(), with reserve_staging(), after a structure change
    and a dtype change."""
    base = ctx.dir("async_fsdp2")
    state = fsdp2_adamw(ctx)
    REUSED.clear()
    for i in range(3):
        train_step(state)
        async_and_check(state, f"{base}/s{i}")
    assert REUSED == [False, True, True], REUSED  # later saves ran the reuse path
    zarrckpt.load(state, f"{base}/s0")  # a load between saves (into the live state)
    train_step(state)
    async_and_check(state, f"{base}/after_load")
    zarrckpt.release_staging()
    train_step(state)
    async_and_check(state, f"{base}/after_release")
    async_and_check(state, f"{base}/after_release2")
    zarrckpt.reserve_staging(state)
    train_step(state)
    async_and_check(state, f"{base}/reserved")
    from zarrckpt.api.async_save import local_staging_bytes
    zarrckpt.reserve_staging(local_staging_bytes(state) * 2)  # a new arena
    async_and_check(state, f"{base}/reserved_bigger")
    state["extra"] = {"gpu": torch.arange(5.0, device=ctx.device), "cpu": torch.tensor(2.0)}
    async_and_check(state, f"{base}/structure")
    train_step(state)
    async_and_check(state, f"{base}/structure2")
    state["extra"]["gpu"] = state["extra"]["gpu"].to(torch.bfloat16)
    async_and_check(state, f"{base}/dtype")
    train_step(state)
    async_and_check(state, f"{base}/dtype2")
    zarrckpt.wait_for_saves()


@scenario()
def sync_saves_fsdp2_adamw(ctx: Ctx) -> None:
    base = ctx.dir("sync_fsdp2")
    state = fsdp2_adamw(ctx)
    for i in range(3):
        train_step(state)
        sync_and_check(state, f"{base}/s{i}")
    train_step(state)
    sync_and_check(state, f"{base}/small_staging", max_staging_bytes=64 << 10)  # streams through a small arena


@scenario()
def incremental_saves_gpu(ctx: Ctx) -> None:
    """Incremental saves of a GPU state (issue 31): frozen layers linked from the previous
    step, the rest written; sync and async, grouped chunks and one chunk per shard; every
    step checked after the steps it links from are deleted."""
    base = ctx.dir("incremental")
    state = fsdp2_adamw(ctx)
    frozen = [k for k, _ in leaves(state["model"]) if k.startswith("/0.")]  # layer 0 is frozen
    if not frozen:  # leaves' paths start with "/": a prefix that matches nothing links nothing
        raise AssertionError(f"no frozen leaf among {[k for k, _ in leaves(state['model'])]}")

    def step() -> None:  # every value changes except layer 0's parameters
        keep = {k: loc(t).clone() for k, t in leaves(state["model"]) if k in frozen}
        train_step(state)
        with torch.no_grad():
            for k, t in leaves(state["model"]):
                if k in keep:
                    loc(t).copy_(keep[k])
        torch.cuda.synchronize()

    for grouped in (None, 256 << 20):
        kw = {"chunk_target_bytes": grouped}
        sync_and_check(state, f"{base}/{grouped}/a", content_hashes=True, **kw)
        step()
        rep = sync_and_check(state, f"{base}/{grouped}/b", incremental_from=f"{base}/{grouped}/a", **kw)
        step()
        rep2 = async_and_check(state, f"{base}/{grouped}/c", incremental_from=f"{base}/{grouped}/b", **kw)
        zarrckpt.wait_for_saves()
        linked = torch.tensor([rep["bytes_linked"], rep2["bytes_linked"]], device="cuda")
        dist.all_reduce(linked)
        if linked[0] <= 0 or linked[1] <= 0:
            raise AssertionError(f"incremental saves linked nothing: {linked.tolist()}")
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(f"{base}/{grouped}/a")
            shutil.rmtree(f"{base}/{grouped}/b")
        dist.barrier()
        ref = snapshot(state)
        check_checkpoint(state, f"{base}/{grouped}/c", ref)


@scenario()
def mixed_state_saves(ctx: Ctx) -> None:
    base = ctx.dir("mixed")
    state = mixed_state(ctx)
    REUSED.clear()
    for i in range(4):
        train_step(state)
        async_and_check(state, f"{base}/a{i}")
    assert REUSED == [False, True, True, True], REUSED
    train_step(state)
    sync_and_check(state, f"{base}/sync")
    # the structure changes, a leaf moves from the CPU to the GPU, a dtype changes
    state["opt07"]["step"] = state["opt07"]["step"].to(ctx.device)
    state["cpu"] = state["cpu"].to(torch.float64)
    state["new"] = torch.ones(3, 3, device=ctx.device)
    for i in range(3):
        train_step(state)
        async_and_check(state, f"{base}/b{i}")
    zarrckpt.wait_for_saves()


@scenario()
def async_overlap_mode(ctx: Ctx) -> None:
    """overlap=True: the current stream does not wait; the caller waits with wait_staged()."""
    base = ctx.dir("overlap")
    state = mixed_state(ctx)
    for i in range(3):
        train_step(state)
        async_and_check(state, f"{base}/o{i}", overlap=True)
    zarrckpt.wait_for_saves()


@scenario()
def wait_staged_on_a_stream(ctx: Ctx) -> None:
    """wait_staged(stream): the training stream waits for the copies without the CPU
    blocking; work queued on it after that sees the state change only after staging."""
    base = ctx.dir("stream_wait")
    state = mixed_state(ctx)
    side = torch.cuda.Stream()
    for i in range(3):
        train_step(state)
        ref, full_ref = snapshot(state), full_snapshot(state)
        fut = zarrckpt.async_save(state, f"{base}/w{i}", overlap=True)
        fut.wait_staged(side)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            overwrite(state)
        torch.cuda.current_stream().wait_stream(side)
        fut.result(timeout=300)
        dist.barrier()
        put_back(state, ref)
        check_checkpoint(state, f"{base}/w{i}", ref, full_ref)
    zarrckpt.wait_for_saves()


@scenario(min_world=2)
def tensor_parallel(ctx: Ctx) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    base = ctx.dir("tp")
    mesh = ctx.notes["mesh"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    for i in range(3):
        train_step(state)
        async_and_check(state, f"{base}/a{i}")
    sync_and_check(state, f"{base}/s")
    # resharded: every weight loaded as Shard(1) / Shard(0) the other way round
    full = full_snapshot({"model": msd})
    target = {"model": {k: distribute_tensor(torch.zeros_like(v, device="cuda"), mesh, [Shard(v.dim() - 1)])
                        for k, v in ((k[len("/model/"):], v) for k, v in full.items())}}
    zarrckpt.load(target, f"{base}/s", strict=False)
    expect_equal("tp resharded", {f"/model/{k}": v.full_tensor().cpu() for k, v in target["model"].items()}, full)
    zarrckpt.wait_for_saves()


def _fsdp_tp(ctx: Ctx, mesh2d: Any) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
    parallelize_module(model, mesh2d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh2d["dp"])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


@scenario(min_world=2)
def fsdp_over_tp_strided(ctx: Ctx) -> None:
    """FSDP2 over TP on a (dp, tp) mesh: ``_StridedShard`` placements (dp > 1), saved and
    loaded back, and resharded onto a 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    base = ctx.dir("fsdp_tp")
    mesh2d = init_device_mesh("cuda", (ctx.world // 2, 2), mesh_dim_names=("dp", "tp"))
    state = _fsdp_tp(ctx, mesh2d)
    ctx.notes["placements"] = sorted({str(t.placements) for _, t in leaves(state)
                                      if isinstance(t, _dtensor_type())})
    # FSDP2 over TP gives _StridedShard placements on (1, 2) and (2, 2) meshes alike (a lone
    # _StridedShard built by hand on a 1-D mesh is refused by torch 2.11's DTensor itself)
    assert any("_StridedShard" in p for p in ctx.notes["placements"]), ctx.notes["placements"]
    for i in range(3):
        train_step(state)
        async_and_check(state, f"{base}/a{i}")
    sync_and_check(state, f"{base}/s")
    full = full_snapshot({"model": state["model"]})
    mesh = ctx.notes["mesh"]
    target = {"model": {k[len("/model/"):]: distribute_tensor(torch.zeros_like(v, device="cuda"), mesh, [Shard(0)])
                        for k, v in full.items()}}
    zarrckpt.load(target, f"{base}/s", strict=False)
    expect_equal("fsdp+tp resharded to 1-D", {f"/model/{k}": v.full_tensor().cpu()
                                              for k, v in target["model"].items()}, full)
    zarrckpt.wait_for_saves()


@scenario(min_world=2)
def hsdp_2d_mesh(ctx: Ctx) -> None:
    """HSDP: FSDP2 on a (replicate, shard) mesh; replicas write once, load back exact."""
    from torch.distributed.device_mesh import init_device_mesh

    base = ctx.dir("hsdp")
    mesh2d = init_device_mesh("cuda", (2, ctx.world // 2), mesh_dim_names=("replicate", "shard"))
    state = fsdp2_adamw(ctx, layers=3, width=128, mesh=mesh2d)
    for i in range(3):
        train_step(state)
        async_and_check(state, f"{base}/a{i}")
    sync_and_check(state, f"{base}/s")
    zarrckpt.wait_for_saves()


@scenario(min_world=2)
def grouped_chunks_exchange(ctx: Ctx) -> None:
    """Small shards grouped into one chunk each (chunk_target_bytes): the other ranks send
    theirs over NCCL to the chunk's writer; sync and later async saves exact; one chunk
    object per array. Nested uneven ``[Shard(0), Shard(0)]`` where 4 GPUs are lent."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    base = ctx.dir("grouped")
    mesh = ctx.notes["mesh"]
    g = torch.Generator().manual_seed(2)
    state = {f"t{i}": distribute_tensor(torch.randn(8 * ctx.world + i, 16, generator=g).cuda(), mesh, [Shard(0)])
             for i in range(12)}
    state["bf16"] = distribute_tensor(torch.randn(40, 6, generator=g).cuda().to(torch.bfloat16), mesh, [Shard(0)])
    if ctx.world >= 4:
        m2 = init_device_mesh("cuda", (2, ctx.world // 2))
        state["nested"] = distribute_tensor(torch.randn(4097, 3, generator=g).cuda(), m2, [Shard(0), Shard(0)])
    for i in range(3):
        train_step(state)
        async_and_check(state, f"{base}/a{i}")
    train_step(state)
    sync_and_check(state, f"{base}/s")
    if ctx.rank == 0:  # t0's shards are even: one chunk (t3's 10 + 9 rows stay one chunk each, spec C.1)
        chunks = [os.path.join(d, f) for d, _, fs in os.walk(f"{base}/s/t0/c") for f in fs]
        ctx.notes["t0_chunk_objects"] = len(chunks)
        assert len(chunks) == 1, chunks
    zarrckpt.wait_for_saves()


@scenario()
def resharded_and_cast_loads(ctx: Ctx) -> None:
    """Loads into GPU targets of another placement, of another dtype (cast=True), meta
    targets (materialized on the GPU), uneven shards, and plain CPU tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    base = ctx.dir("reshard")
    mesh = ctx.notes["mesh"]
    g = torch.Generator().manual_seed(3)
    full = {"a": torch.randn(96, 40, generator=g), "uneven": torch.randn(7, 9, generator=g),
            "b16": torch.randn(30, 8, generator=g).to(torch.bfloat16), "plain": torch.randn(12, generator=g)}
    state = {k: distribute_tensor(v.cuda(), mesh, [Shard(0)]) for k, v in full.items() if k != "plain"}
    state["plain"] = full["plain"].cuda()
    sync_and_check(state, f"{base}/s")
    path = f"{base}/s"
    for placement in (Shard(1), Replicate(), Shard(0)):
        target = {k: distribute_tensor(torch.zeros_like(v).cuda(), mesh, [placement]) for k, v in full.items()
                  if k != "plain"}
        target["plain"] = torch.zeros(12, device="cuda")
        zarrckpt.load(target, path)
        got = {k: (v.full_tensor() if isinstance(v, _dtensor_type()) else v).cpu() for k, v in target.items()}
        expect_equal(f"load as {placement}", {f"/{k}": v for k, v in got.items()}, {f"/{k}": v for k, v in full.items()})
    # casts: fp32 -> bf16 targets and bf16 -> fp32
    target = {"a": distribute_tensor(torch.zeros(96, 40, device="cuda", dtype=torch.bfloat16), mesh, [Shard(1)]),
              "b16": distribute_tensor(torch.zeros(30, 8, device="cuda"), mesh, [Shard(0)])}
    zarrckpt.load(target, path, strict=False, cast=True)
    expect_equal("cast", {"/a": target["a"].full_tensor().cpu(), "/b16": target["b16"].full_tensor().cpu()},
                 {"/a": full["a"].to(torch.bfloat16), "/b16": full["b16"].float()})
    # meta targets come back as real tensors on the mesh's device
    meta = {k: distribute_tensor(torch.empty(v.shape, dtype=v.dtype, device="meta"), mesh, [Shard(0)])
            for k, v in full.items() if k != "plain"}
    meta["plain"] = torch.empty(12, device="meta")
    out = zarrckpt.load(meta, path)
    got = {}
    for k, v in out.items():
        if isinstance(v, _dtensor_type()):
            assert v.to_local().device.type == "cuda", k
            v = v.full_tensor()
        got[f"/{k}"] = v.cpu()
    expect_equal("meta targets", got, {f"/{k}": v for k, v in full.items()})
    expect_equal("load_state_dict", dict(leaves(zarrckpt.load_state_dict(path))), {f"/{k}": v for k, v in full.items()})


@scenario(min_world=2)
def shared_reads_into_gpu(ctx: Ctx) -> None:
    """shared_reads=True: each stored byte read by one rank, the rest through the group."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    base = ctx.dir("shared")
    mesh = ctx.notes["mesh"]
    g = torch.Generator().manual_seed(4)
    full = {f"r{i}": torch.randn(64, 33, generator=g) for i in range(6)}
    full["h"] = torch.randn(100, generator=g).to(torch.bfloat16)
    state = {k: distribute_tensor(v.cuda(), mesh, [Shard(0)]) for k, v in full.items()}
    sync_and_check(state, f"{base}/s")
    target = {k: distribute_tensor(torch.zeros_like(v).cuda(), mesh, [Replicate()]) for k, v in full.items()}
    report: dict = {}
    zarrckpt.load(target, f"{base}/s", shared_reads=True, report=report)
    expect_equal("shared reads", {f"/{k}": v.to_local().cpu() for k, v in target.items()},
                 {f"/{k}": v for k, v in full.items()})
    plain = {k: torch.zeros_like(v).cuda() for k, v in full.items()}
    zarrckpt.load(plain, f"{base}/s", shared_reads=True)
    expect_equal("shared reads, plain GPU targets", {f"/{k}": v.cpu() for k, v in plain.items()},
                 {f"/{k}": v for k, v in full.items()})


@scenario(min_world=2)
def tiers_gpu_state(ctx: Ctx) -> None:
    """The manager with node tiers (one node a rank): async saves of a GPU state, restore
    from the node's own copy, then with that copy wiped (a peer's replica), bit for bit."""
    base = ctx.dir("tiers")
    os.environ["ZARRCKPT_NODE"] = f"node{ctx.rank}"
    state = mixed_state(ctx)
    refs = {}
    with zarrckpt.CheckpointManager(f"{base}/persistent", local_dir=f"{base}/local", local_replicas=1,
                                    persist_every=2, async_save=True) as mgr:
        for step in range(1, 4):
            train_step(state)
            refs[step] = snapshot(state)
            fut = mgr.save(step, state)
            getattr(fut, "wait_staged", lambda: None)()
            overwrite(state)  # the state may change now
            put_back(state, refs[step])
    sources = []
    for wipe in (False, True):
        if wipe and ctx.rank == 0:
            shutil.rmtree(f"{base}/local/node0", ignore_errors=True)
        dist.barrier()
        fresh = mixed_state(ctx)
        overwrite(fresh)
        with zarrckpt.CheckpointManager(f"{base}/persistent", local_dir=f"{base}/local", local_replicas=1,
                                        persist_every=2) as mgr:
            step = mgr.restore(fresh)
            sources.append((mgr.last_restore or {}).get("source"))
        assert step == 3, step
        expect_equal(f"tiers restore (wiped={wipe})", snapshot(fresh), refs[3])
    ctx.notes["sources"] = sources
    os.environ.pop("ZARRCKPT_NODE", None)


@scenario()
def dcp_storage_adapter(ctx: Ctx) -> None:
    """torch.distributed.checkpoint's save and load through zarrckpt's storage layer, on
    an FSDP2 + AdamW GPU state; dcp.async_save too."""
    import torch.distributed.checkpoint as dcp

    from zarrckpt.dcp_storage import ZarrckptStorageReader, ZarrckptStorageWriter

    base = ctx.dir("dcp")
    state = fsdp2_adamw(ctx)
    for i in range(2):
        train_step(state)
        ref = snapshot(state)
        dcp.save(state, storage_writer=ZarrckptStorageWriter(f"{base}/s{i}"))
        overwrite(state)
        dcp.load(state, storage_reader=ZarrckptStorageReader(f"{base}/s{i}"))
        expect_equal(f"dcp round trip {i}", snapshot(state), ref)
    train_step(state)
    ref = snapshot(state)
    fut = dcp.async_save(state, storage_writer=ZarrckptStorageWriter(f"{base}/async"))
    fut.result()
    overwrite(state)
    dcp.load(state, storage_reader=ZarrckptStorageReader(f"{base}/async"))
    expect_equal("dcp async_save", snapshot(state), ref)
    # and zarrckpt reads what DCP wrote through it
    overwrite(state)
    zarrckpt.load(state, f"{base}/async")
    expect_equal("zarrckpt.load of a dcp.save", snapshot(state), ref)


def _live(model, optimizers) -> dict:
    """The live tensors of a torchtitan job: parameters and every optimizer state tensor."""
    opts = getattr(optimizers, "optimizers", [optimizers])
    return {"params": dict(model.named_parameters()),
            "optim": {f"{i}.{n}": o.state[p] for i, o in enumerate(opts)
                      for n, p in model.named_parameters() if p in o.state}}


def _titan_job(ctx: Ctx, folder: str, async_mode: str):
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from zarrckpt.torchtitan import ZarrckptCheckpointManager

    class TrainState:
        def __init__(self) -> None:
            self.step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, sd):
            self.step = sd["step"]

    class Data:
        def __init__(self) -> None:
            self.pos = 0

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, sd):
            self.pos = sd["pos"]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32)).cuda()
    mesh = ctx.notes["mesh"]
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    ocfg = default_adamw(lr=1e-2)
    optimizers = ocfg.build(model_parts=[model])
    lrs = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, decay_type="linear",
                                       min_lr_factor=0.1).build(optimizers=optimizers, training_steps=8)
    ts, data = TrainState(), Data()
    config = ZarrckptCheckpointManager.Config(enable=True, folder="checkpoint", interval=1, async_mode=async_mode,
                                              keep_latest_k=0)
    ck = config.build(dataloader=data, model_parts=[model], optimizers=optimizers, lr_schedulers=lrs,
                      states={"train_state": ts}, sd_adapter=None, base_folder=folder)
    return model, optimizers, lrs, ts, data, ck


@scenario()
def torchtitan_backend(ctx: Ctx) -> None:
    """zarrckpt as torchtitan's checkpointer on an FSDP2 GPU job, in every async mode, in
    the trainer's order (maybe_wait_for_staging before optimizers.step, save after it);
    the state is overwritten where torchtitan lets training change it (after save returns,
    and for pinned memory after maybe_wait_for_staging); every step loads back exact."""
    for mode in ("disabled", "async", "async_with_pinned_mem"):
        folder = ctx.dir(f"titan_{mode}")
        model, optimizers, lrs, ts, data, ck = _titan_job(ctx, folder, mode)
        ck.load(step=-1)
        refs = {}
        for step in range(1, 5):
            x = torch.randn(8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            model(x).square().mean().backward()
            ck.maybe_wait_for_staging()
            optimizers.step()
            lrs.step()
            optimizers.zero_grad()
            ts.step, data.pos = step, step * 10
            live = _live(model, optimizers)
            refs[step] = snapshot(live)
            ck.save(step, last_step=False)
            ck.maybe_wait_for_staging()
            overwrite(live)  # what the next step may do now
            put_back(live, refs[step])
        ck.close()
        zarrckpt.wait_for_saves()
        dist.barrier()
        for step in range(1, 5):
            model2, opt2, lrs2, ts2, data2, ck2 = _titan_job(ctx, folder, "disabled")
            model2(torch.randn(2, 64, device="cuda")).sum().backward()  # optimizer state to load into
            opt2.step()
            opt2.zero_grad()
            ck2.load(step=step)
            assert ts2.step == step and data2.pos == step * 10, (mode, step, ts2.step, data2.pos)
            expect_equal(f"torchtitan {mode} step {step}", snapshot(_live(model2, opt2)), refs[step])
            ck2.close()
