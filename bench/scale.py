"""Objects per checkpoint at scale, from the real planning code (issue 16).

For a Llama-3-70B-shaped state (723 parameters + AdamW ``exp_avg``/``exp_avg_sq``, fp32:
2,169 arrays, 847 GB), at 1,024 and 8,192 ranks, on an FSDP mesh (``[Shard(0)]``) and a 2-D
HSDP/TP mesh (``(dp, tp=8)``: ``[Shard(0), Shard(1)]`` for 2-D weights, ``[Shard(0),
Replicate()]`` for norms), with and without grouped chunks (``chunk_target_bytes``): the
chunk objects of the checkpoint, the ``zarr.json`` documents, their size distribution, the
objects one rank writes (the most any rank writes), the bytes every rank sends to chunk
writers before the save, and the metadata documents one rank reads at load (1.2: the root).
Pure Python, no torch.

    python bench/scale.py [--ranks 1024,8192] [--targets none,16,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time

from zarrckpt.format import layout as L

D, FF, LAYERS, VOCAB, KV = 8192, 28672, 80, 128256, 1024
ITEM = 4  # fp32


def state() -> list[tuple[str, tuple[int, ...]]]:
    params = [("tok_embeddings.weight", (VOCAB, D)), ("output.weight", (VOCAB, D)), ("norm.weight", (D,))]
    for i in range(LAYERS):
        params += [(f"layers.{i}.{n}", s) for n, s in (
            ("attention.wq.weight", (D, D)), ("attention.wk.weight", (KV, D)), ("attention.wv.weight", (KV, D)),
            ("attention.wo.weight", (D, D)), ("feed_forward.w1.weight", (FF, D)),
            ("feed_forward.w3.weight", (FF, D)), ("feed_forward.w2.weight", (D, FF)),
            ("attention_norm.weight", (D,)), ("ffn_norm.weight", (D,)))]
    return [(f"{part}/{k}", s) for part in ("model", "optim/exp_avg", "optim/exp_avg_sq") for k, s in params]


def mesh_for(kind: str, ranks: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple]:
    if kind == "fsdp":
        return (ranks,), (L.Shard(0),)
    tp = 8
    if len(shape) == 2:
        return (ranks // tp, tp), (L.Shard(0), L.Shard(1))
    return (ranks // tp, tp), (L.Shard(0), L.Replicate())


def run(kind: str, ranks: int, target: int | None, sample: int) -> dict:
    arrays = state()
    group = None if target is None else target // ITEM
    objects = 0
    sizes: list[int] = []
    layouts = []
    for key, shape in arrays:
        mesh, pl = mesh_for(kind, ranks, shape)
        lay = L.Layout(shape, mesh, pl, key=key, group_min_elems=group)
        layouts.append((key, shape, mesh, pl))
        n = math.prod(lay.grid_shape)
        objects += n
        last = math.prod(b - a for a, b in lay.chunk_box(tuple(g - 1 for g in lay.grid_shape))) * ITEM
        sizes += [math.prod(lay.chunk_shape) * ITEM] * (n - 1) + [last]  # all full but the last
    rng = random.Random(0)
    writes, sends, t_plan = [], [], []
    for _ in range(sample):  # what sampled ranks plan: every array's layout built cold
        t0 = time.perf_counter()
        w = s = 0
        coord = None
        for key, shape, mesh, pl in layouts:
            coord = coord if coord is not None and len(coord) == len(mesh) else tuple(rng.randrange(m) for m in mesh)
            mine, out = L.Layout(shape, mesh, pl, key=key, group_min_elems=group).save_plan(coord)
            w += len(mine)
            s += sum(math.prod(b - a for a, b in x.box) for x in out) * ITEM
        t_plan.append(time.perf_counter() - t0)
        writes.append(w)
        sends.append(s)
    # GETs of a same-layout load on an object store, per sampled rank: reading its own part,
    # a rank makes an index GET and an inner-chunk GET per chunk it meets (sharded chunks);
    # with shared reads (zarrckpt.api.shared_reads) its pieces of at most PIECE_BYTES go
    # through the chunks' owners, one GET per chunk object for the whole job
    from zarrckpt.api.shared_reads import PIECE_BYTES
    own_gets, shared_chunks, big_gets = [], set(), []
    for _ in range(sample):
        coord = None
        own = big = 0
        for key, shape, mesh, pl in layouts:
            coord = coord if coord is not None and len(coord) == len(mesh) else tuple(rng.randrange(m) for m in mesh)
            lay = L.Layout(shape, mesh, pl, key=key, group_min_elems=group)
            chunk = lay.chunk_shape
            for gbox, _ in lay.local_boxes(coord):
                first = [a // c for (a, _), c in zip(gbox, chunk)]
                last = [(b - 1) // c for (_, b), c in zip(gbox, chunk)]
                n = math.prod(l - f + 1 for f, l in zip(first, last))
                per = math.prod(b - a for a, b in gbox) * ITEM / n  # bytes per chunk piece (even)
                own += 2 * n
                if per <= PIECE_BYTES:
                    shared_chunks.update((key, i) for i in range(n))  # counted job-wide below
                else:
                    big += 2 * n
        own_gets.append(own)
        big_gets.append(big)
    groups = {"/".join(k.split("/")[:i]) for k, _ in arrays for i in range(1, k.count("/") + 1)}
    documents = len(arrays) + len(groups) + 1
    dec = statistics.quantiles(sizes, n=10)
    return {
        "mesh": kind, "ranks": ranks, "target_mib": None if target is None else target >> 20,
        "arrays": len(arrays), "chunk_objects": objects, "documents": documents,
        "objects_total": objects + documents, "bound_2x_arrays_plus_ranks": 2 * (len(arrays) + ranks),
        "chunk_mib_p10_p50_p90": [round(x / 2**20, 3) for x in (dec[0], statistics.median(sizes), dec[-1])],
        "objects_one_rank_writes": statistics.median(writes),
        "bytes_one_rank_sends": statistics.median(sends),
        "metadata_reads_per_rank_at_load": {"1.1": len(arrays) + 1, "1.2": 1},
        # job-wide GETs of a same-layout load on S3 (sampled ranks x ranks; shared: one GET per
        # chunk object of small pieces, i.e. at most the chunk objects, plus what ranks still
        # read themselves, plus the root per rank)
        "load_gets_job_own_reads": int(statistics.median(own_gets)) * ranks + ranks,
        "load_gets_job_shared_reads_at_most": objects + int(statistics.median(big_gets)) * ranks + ranks,
        "plan_s_one_rank_median": round(statistics.median(t_plan), 2),
        "state_gb": round(sum(math.prod(s) for _, s in arrays) * ITEM / 1e9, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1024,8192")
    ap.add_argument("--targets", default="none,16,64", help="chunk_target_bytes in MiB ('none': off)")
    ap.add_argument("--meshes", default="fsdp,hsdp_tp")
    ap.add_argument("--sample", type=int, default=2, help="ranks whose planning is timed")
    ap.add_argument("--json")
    opts = ap.parse_args()
    rows = []
    for kind in opts.meshes.split(","):
        for ranks in map(int, opts.ranks.split(",")):
            for t in opts.targets.split(","):
                target = None if t == "none" else int(t) << 20
                r = run(kind, ranks, target, opts.sample)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    print("| mesh | ranks | chunk_target | chunk objects | all objects (+ zarr.json) | ≤ 2 × (arrays + ranks) "
          "| chunk MiB p10 / p50 / p90 | objects one rank writes | MB one rank sends first | plan s / rank "
          "| load GETs (job): own reads / shared reads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ok = "yes" if r["objects_total"] <= r["bound_2x_arrays_plus_ranks"] else "no"
        t = "off" if r["target_mib"] is None else f"{r['target_mib']} MiB"
        p = " / ".join(map(str, r["chunk_mib_p10_p50_p90"]))
        print(f"| {r['mesh']} | {r['ranks']:,} | {t} | {r['chunk_objects']:,} | {r['objects_total']:,} | {ok} "
              f"({r['bound_2x_arrays_plus_ranks']:,}) | {p} | {r['objects_one_rank_writes']:,} "
              f"| {r['bytes_one_rank_sends'] / 1e6:.0f} | {r['plan_s_one_rank_median']} "
              f"| {r['load_gets_job_own_reads']:,} / ≤ {r['load_gets_job_shared_reads_at_most']:,} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
