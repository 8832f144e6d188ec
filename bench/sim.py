"""Planning at scale without a cluster: 8,192 simulated ranks (dp=1024 x tp=8), 1,000 tensors.

Times what every rank does before a save writes anything -- ``Layout(...)`` and
``save_plan(coord)`` for each of its tensors, with cold caches, as a fresh rank
starts -- for a sample of mesh coordinates, and measures the committed root
``zarr.json`` (the tree of 1,000 keys). Pure Python, one process, no torch.

    python bench/sim.py [--tensors 1000] [--coords 16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from zarrckpt.format import documents as fmt
from zarrckpt.format import layout as L
from zarrckpt.format import tree as ztree

MESH = (1024, 8)
PLACEMENTS = [(L.Shard(0), L.Shard(1)), (L.Replicate(), L.Shard(0)), (L.StridedShard(0, 8), L.Shard(0))]
LAYER = [("attention.wq.weight", (4096, 4096)), ("attention.wk.weight", (1024, 4096)),
         ("attention.wv.weight", (1024, 4096)), ("attention.wo.weight", (4096, 4096)),
         ("feed_forward.w1.weight", (14336, 4096)), ("feed_forward.w2.weight", (4096, 14336)),
         ("feed_forward.w3.weight", (14336, 4096)), ("attention_norm.weight", (4096,)),
         ("ffn_norm.weight", (4096,))]
SPLIT = (64 << 20) // 4  # SaveOptions.replica_split_bytes default, in fp32 elements


def tensors(n: int) -> list[tuple[str, tuple[int, ...], tuple]]:
    """A Llama-8B-like stack: the 2-D weights cycle through the three placements layer by
    layer; norms are [Shard(0), Replicate()]."""
    out = [("tok_embeddings.weight", (128256, 4096), PLACEMENTS[0])]
    for i in range(n - 1):
        name, shape = LAYER[i % len(LAYER)]
        pl = PLACEMENTS[(i // len(LAYER)) % 3] if len(shape) == 2 else (L.Shard(0), L.Replicate())
        out.append((f"layers.{i // len(LAYER)}.{name}", shape, pl))
    return out


def plan(ts, coord) -> dict:
    L.dim_runs.cache_clear()  # every rank starts cold
    L._partition.cache_clear()
    t0, writes, sends = time.perf_counter(), 0, 0
    for key, shape, pl in ts:
        w, s = L.Layout(shape, MESH, pl, key=f"model/{key}", replica_split_min_elems=SPLIT).save_plan(coord)
        writes, sends = writes + len(w), sends + len(s)
    return {"coord": list(coord), "seconds": time.perf_counter() - t0, "writes": writes, "sends": sends}


def root_bytes(ts) -> int:
    """Size of the committed root zarr.json, encoded as Storage.write_json does."""
    tree = ztree.encode_tree({"model": {k: "ARRAY" for k, _, _ in ts}}, lambda x: x == "ARRAY")
    writer = dict.fromkeys(("zarrckpt", "torch", "tensorstore", "python"), "0.0.0")
    root = fmt.root_metadata(state="committed", save_id=fmt.new_save_id(), world_size=MESH[0] * MESH[1],
                             created=fmt.utc_now(), writer=writer, tree=tree, num_arrays=len(ts))
    return len(json.dumps(root, indent=2, allow_nan=False).encode())


def run_sim(n_tensors: int = 1000, n_coords: int = 16) -> dict:
    ts = tensors(n_tensors)
    rng = random.Random(0)
    coords = [(0, 0), (MESH[0] - 1, MESH[1] - 1), (MESH[0] // 2 - 1, MESH[1] // 2 - 1)]
    coords += [(rng.randrange(MESH[0]), rng.randrange(MESH[1])) for _ in range(max(n_coords - 3, 0))]
    plans = [plan(ts, c) for c in coords]
    secs = [p["seconds"] for p in plans]
    return {"mesh": list(MESH), "tensors": len(ts), "coords_sampled": len(coords), "plans": plans,
            "plan_s_median": statistics.median(secs), "plan_s_max": max(secs),
            "worst_coord": plans[secs.index(max(secs))]["coord"],
            "all_ranks_cpu_s_extrapolated": statistics.fmean(secs) * MESH[0] * MESH[1],
            "root_zarr_json_bytes": root_bytes(ts)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--coords", type=int, default=16)
    args = ap.parse_args()
    r = run_sim(args.tensors, args.coords)
    print(json.dumps({k: v for k, v in r.items() if k != "plans"}, indent=1))
