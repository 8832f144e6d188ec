"""Resharding pairs: a checkpoint saved on W ranks (or 1) loaded on another number of ranks
or another layout, by every system, in processes spawned for the load's world size.

    1_to_W    saved on 1 rank (FSDP2 on a 1-rank mesh), loaded on W ranks [Shard(0)]
    W_to_2W   saved on W ranks [Shard(0)], loaded on 2W ranks [Shard(0)]
    W_to_1    saved on W ranks, loaded by 1 process without a process group (plain tensors)
    S0_to_S1  saved on W ranks [Shard(0)], loaded on the same W ranks [Shard(1)] (2-D
              tensors; 1-D stay Shard(0)); run inside the shape's own processes
    1D_to_2D  saved on W ranks (1-D mesh), loaded on 2W ranks as a (W, 2) mesh:
              [Shard(0), Shard(1)] (1-D tensors [Shard(0), Replicate()])

AdamW's 0-d ``step`` tensors are plain CPU tensors in every target. Every loaded state is
checked against the saved one by per-tensor checksums that do not depend on the layout
(harness.checksums): every element's bits at its global position.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from harness import Ctx, check_saved, checksums, init_dist, load_pair, load_with, now, saver, tmap, verify_checksums
from models import build_state
from report import BENCH_SYSTEMS

PAIRS = ("1_to_W", "W_to_2W", "W_to_1", "S0_to_S1", "1D_to_2D")
RESHARD_SECTION = ("S0_to_S1", "W_to_1")  # the pairs the older "reshard" section ran


def wanted_pairs(only) -> list[str]:
    if "reshard_pairs" in only:
        return list(PAIRS)
    return list(RESHARD_SECTION) if "reshard" in only else []


def pair_info(name: str, w: int) -> dict:
    """Save world, load world, target kind and a label, for ``--world`` w."""
    return {
        "1_to_W": {"save_world": 1, "load_world": w, "target": "shard0",
                   "label": f"1 -> {w} ranks, Shard(0)"},
        "W_to_2W": {"save_world": w, "load_world": 2 * w, "target": "shard0",
                    "label": f"{w} -> {2 * w} ranks, Shard(0)"},
        "W_to_1": {"save_world": w, "load_world": 1, "target": "full",
                   "label": f"{w} ranks -> 1 process, plain tensors"},
        "S0_to_S1": {"save_world": w, "load_world": w, "target": "shard1",
                     "label": f"{w} ranks, Shard(0) -> Shard(1)"},
        "1D_to_2D": {"save_world": w, "load_world": 2 * w, "target": "2d",
                     "label": f"{w} ranks 1-D -> {2 * w} ranks 2-D ({w}x2), [Shard(0), Shard(1)]"},
    }[name]


def read_skeleton(sdir: str):
    return torch.load(os.path.join(sdir, "skeleton.pt"), weights_only=False)


def make_target(kind: str, skeleton, mesh, device):
    """Zeros in the target layout, built from the saved shapes (meta tensors)."""
    from torch.distributed.tensor import zeros as dzeros

    def make(m):
        if m.dim() == 0:
            return torch.zeros((), dtype=m.dtype)
        if kind == "full":
            return torch.zeros(m.shape, dtype=m.dtype, device=device)
        if kind == "shard0":
            placements = [Shard(0)]
        elif kind == "shard1":
            placements = [Shard(1 if m.dim() >= 2 else 0)]
        else:
            placements = [Shard(0), Shard(1)] if m.dim() >= 2 else [Shard(0), Replicate()]
        return dzeros(*m.shape, dtype=m.dtype, device_mesh=mesh, placements=placements)
    return tmap(make, skeleton)


def mesh_for(kind: str, world: int, device):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "full":
        return None
    return init_device_mesh(device.type, (world // 2, 2) if kind == "2d" else (world,))


def load_rounds(ctx: Ctx, name: str, sdir: str, ckpt_file: str, ref_file: str, mesh) -> list[dict]:
    """``cfg.reps`` timed loads of pair ``name`` by every system (order rotated)."""
    with open(os.path.join(sdir, ckpt_file)) as f:
        ckpt = json.load(f)
    with open(os.path.join(sdir, ref_file)) as f:
        ref = json.load(f)
    skel = read_skeleton(sdir)
    kind = pair_info(name, ctx.cfg.world)["target"]
    out = []
    for rep in range(ctx.cfg.reps):
        t0 = now()
        out.append(load_pair(ctx, rep, ckpt, lambda: make_target(kind, skel, mesh, ctx.device),
                             lambda t: verify_checksums(t, ref, ctx.distributed), no_dist=not ctx.distributed))
        if ctx.rank == 0:
            secs = ", ".join(f"{s} " + (f"{out[-1][s]['seconds']:.2f} s" if out[-1][s]["verified"] else
                                        "VERIFY FAILED, no time") + " (untimed: " + " ".join(
                f"{k} {v:.1f}" for k, v in out[-1][s]["untimed"].items()) + ")" for s in out[-1]["order"])
            print(f"  {name} rep {rep}: {secs} (whole round {now() - t0:.1f} s)", flush=True)
    return out


def remove_checkpoints(sdir: str, ckpt_file: str) -> None:
    path = os.path.join(sdir, ckpt_file)
    if os.path.exists(path):
        with open(path) as f:
            for p in json.load(f).values():
                shutil.rmtree(p, ignore_errors=True)


def save_world1(ctx: Ctx, shape: str, sdir: str, port: int) -> dict:
    """Build the shape on 1 rank (FSDP2 over a 1-rank mesh), record its checksums and save
    it with every system (untimed for the tables; seconds kept in the JSON, with each
    checkpoint loaded back and checked against those checksums: ``verified``; a failed
    one keeps no seconds)."""
    from torch.distributed.device_mesh import init_device_mesh

    device, ctx.gloo = init_dist(0, 1, port, ctx.cfg.device, 1)
    ctx.device = device
    mesh = init_device_mesh(device.type, (1,))
    t0 = now()
    sd, _ = build_state(shape, ctx.cfg, device, mesh)
    out = {"build_s": now() - t0}
    ref = checksums(sd, True)
    with open(os.path.join(sdir, "ref_w1.json"), "w") as f:
        json.dump(ref, f)
    ckpt, out["save"], out["verified"] = {}, {}, {}
    for s in BENCH_SYSTEMS:
        ckpt[s] = os.path.join(ctx.cfg.dir, f"{shape}_{s}_w1")
        rec = check_saved(ctx.measure(saver(ctx, s, sd, ckpt[s])), load_with(s, ckpt[s]), sd, ref, True)
        out["save"][s], out["verified"][s] = rec["seconds"], rec["verified"]
    with open(os.path.join(sdir, "ckpt_w1.json"), "w") as f:
        json.dump(ckpt, f)
    return out


def pair_worker(rank: int, cfg, port: int, sdir: str, job: dict) -> None:
    """One spawned process of a resharding job: ``job`` = {"name", "world", "device",
    "loads": [pair names], "ckpt", "ref" (files under sdir), "rm" (checkpoint lists to
    delete after the loads), "save" (build and save the shape on 1 rank afterwards)}."""
    world = job["world"]
    ctx_dist = world > 1
    if ctx_dist:
        device, gloo = init_dist(rank, world, port, job["device"], world)
    else:
        device, gloo = torch.device("cuda", 0) if job["device"] == "cuda" else torch.device("cpu"), None
        if job["device"] == "cuda":
            torch.cuda.set_device(0)
        import warnings
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    ctx = Ctx(rank, cfg, device, distributed=ctx_dist, systems=BENCH_SYSTEMS)
    ctx.gloo = gloo
    with open(os.path.join(sdir, "dcp_threads.json")) as f:
        ctx.dcp_threads = json.load(f)
    out: dict = {"rank": rank, "device": str(device), "world": world}
    meshes: dict = {}
    for name in job["loads"]:
        kind = pair_info(name, cfg.world)["target"]
        if kind not in meshes:
            meshes[kind] = mesh_for(kind, world, device)
        out[name] = load_rounds(ctx, name, sdir, job["ckpt"], job["ref"], meshes[kind])
    if rank == 0:
        for f in job.get("rm", []):
            remove_checkpoints(sdir, f)
    if ctx_dist:
        dist.barrier()
    if job.get("save"):
        out["save_w1"] = save_world1(ctx, job["shape"], sdir, port)
    with open(os.path.join(sdir, f"job_{job['name']}_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def jobs(cfg, shape: str, pairs: list[str], gpus: int) -> list[dict]:
    """The spawns after a shape's own run, in an order that keeps at most one set of
    checkpoints (the W-rank or the 1-rank one) on disk at a time."""
    w, out = cfg.world, []
    big = [p for p in ("W_to_2W", "1D_to_2D") if p in pairs]
    if big:
        dev = cfg.device if cfg.device == "cpu" or gpus >= 2 * w else "cpu"
        out.append({"name": "load2W", "world": 2 * w, "device": dev, "loads": big,
                    "ckpt": f"ckpt_w{w}.json", "ref": f"ref_w{w}.json"})
    out.append({"name": "w1", "world": 1, "device": cfg.device, "shape": shape,
                "loads": [p for p in ("W_to_1",) if p in pairs], "ckpt": f"ckpt_w{w}.json",
                "ref": f"ref_w{w}.json", "rm": [] if cfg.keep else [f"ckpt_w{w}.json"], "save": "1_to_W" in pairs})
    if "1_to_W" in pairs:
        out.append({"name": "loadW", "world": w, "device": cfg.device, "loads": ["1_to_W"],
                    "ckpt": "ckpt_w1.json", "ref": "ref_w1.json", "rm": [] if cfg.keep else ["ckpt_w1.json"]})
    return out
