"""Markdown tables and combined numbers from the per-rank records of bench.py.

Conventions: seconds of a phase = the slowest rank's (every phase is timed between
barriers); speedup vs DCP = median over reps of (DCP seconds / zarrckpt seconds), so
> 1 means zarrckpt is faster; GB/s = the state's global bytes / median seconds.
"""

from __future__ import annotations

import statistics

SYSTEMS = ("zc", "dcp")
NAMES = {"zc": "zarrckpt", "dcp": "DCP"}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def combine(ranks, section, key=None):
    """Per rep and system, over ranks: seconds and RSS = max; I/O bytes summed; files from
    rank 0."""
    get = (lambda r: r[section]) if key is None else (lambda r: r[section][key])
    out = []
    for i in range(len(get(ranks[0]))):
        row = {"rep": i}
        for s in SYSTEMS:
            recs = [get(r)[i][s] for r in ranks]
            row[s] = {"seconds": max(r["seconds"] for r in recs),
                      "blocked": max(r.get("blocked", 0) for r in recs),
                      "may_change": max(r.get("may_change", r.get("blocked", 0)) for r in recs),
                      "rss_peak_mb": max(r["rss_peak_mb"] for r in recs),
                      **{k: sum(r.get(k, 0) for r in recs) for k in ("rchar", "read_bytes", "bytes_needed")},
                      "fetched": sum((r.get("report") or {}).get("bytes_fetched", 0) for r in recs),
                      "files": recs[0].get("files"), "disk_bytes": recs[0].get("disk_bytes"),
                      "verified": all(r.get("verified", True) for r in recs)}
        out.append(row)
    return out


def table(title, rows, payload, field="seconds", io=False, bw=None):
    """Markdown, medians over reps; speedup = median over reps of (DCP s / zarrckpt s)."""
    head = ["system", f"{ {'blocked': 'blocked ', 'may_change': 'until state may change: '}.get(field, '')}seconds (median)",
            "GB/s", "speedup vs DCP (>1: zarrckpt faster)",
            "peak RSS Δ MB (max)", "files (bytes on disk)"]
    head += ["bytes needed", "bytes read (rchar)", "read / needed", "zarrckpt-reported fetched"] if io else []
    head += ["% of storage write BW"] if bw else []
    lines = [f"\n### {title}\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in SYSTEMS:
        med = median([r[s][field] for r in rows])
        ratio = median([r["dcp"][field] / r["zc"][field] for r in rows if r["zc"][field]]) if s == "zc" else None
        files, disk = rows[-1][s].get("files"), rows[-1][s].get("disk_bytes")
        cells = [NAMES[s] + ("" if all(r[s]["verified"] for r in rows) else " (VERIFY FAILED)"),
                 f"{med:.3f}", f"{payload / med / 1e9:.2f}" if med else "-", f"{ratio:.2f}" if ratio else "-",
                 f"{max(r[s]['rss_peak_mb'] for r in rows):.0f}", "-" if files is None else f"{files} ({disk / 1e6:.1f} MB)"]
        if io:
            need, got = median([r[s]["bytes_needed"] for r in rows]), median([r[s]["rchar"] for r in rows])
            fetched = median([r[s].get("fetched") for r in rows])
            cells += [f"{need / 1e6:.1f} MB", f"{got / 1e6:.1f} MB", f"{got / need:.2f}" if need else "-",
                      f"{fetched / 1e6:.1f} MB" if fetched else "-"]
        if bw:
            cells.append(f"{100 * median([payload / r[s]['seconds'] / bw[r['rep']] for r in rows]):.0f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bw_table(ranks):
    """Aggregate bandwidth per (rep, threads): all ranks' bytes / slowest rank's time."""
    agg = {}
    for r in ranks:
        for b in r["bw"]:
            e = agg.setdefault((b["rep"], b["threads"]), {"bytes": 0, "w": 0, "r": 0})
            e["bytes"] += b["bytes"]
            e["w"], e["r"] = max(e["w"], b["write_s"]), max(e["r"], b["read_s"])
    lines = ["\n### Storage bandwidth (plain fsynced sequential I/O, same bytes per rank)\n",
             "| threads per rank | write GB/s (median) | read GB/s (median) |", "|---|---|---|"]
    for t in sorted({k[1] for k in agg}):
        es = [e for k, e in agg.items() if k[1] == t]
        lines.append(f"| {t} | {median([e['bytes'] / e['w'] / 1e9 for e in es]):.2f} | "
                     f"{median([e['bytes'] / e['r'] / 1e9 for e in es]):.2f} |")
    best = {}  # best write bandwidth of each rep (bytes/s), for "% of storage write BW"
    for (rep, _), e in agg.items():
        best[rep] = max(best.get(rep, 0), e["bytes"] / e["w"])
    return "\n".join(lines), best


def report(cfg, ranks, reshard1, sim, info) -> tuple[str, dict]:
    out = [f"## zarrckpt vs DCP — {info['device_desc']}, world {cfg.world}, {cfg.dir} ({info['fs_type']}), "
           f"{cfg.reps} reps, page cache: {info['drop_caches']}"]
    raw = {"machine": info, "ranks": ranks}
    if ranks and "payload_bytes" in ranks[0]:
        p = ranks[0]["payload_bytes"]
        out.append(f"\nState: {p / 1e9:.2f} GB in {ranks[0]['tensors']} tensors "
                   f"(model {ranks[0]['model']}), fp32, FSDP2 Shard(0) + AdamW.")
        text, best = bw_table(ranks)
        out.append(text)
        for sec, title, kw in [("save", "Sync save", {"bw": best}),
                               ("async", "Async save: blocked (until the call returns)", {"field": "blocked"}),
                               ("async", "Async save: until the state may change (staging copies done)",
                                {"field": "may_change"}),
                               ("async", "Async save: total (until committed)", {}),
                               ("load", "Load, same layout", {"io": True}),
                               ("reshard2", "Resharded load: 2 ranks Shard(0) -> 2 ranks Shard(1)", {"io": True})]:
            if sec in ranks[0]:
                rows = raw.setdefault(f"combined_{sec}", combine(ranks, sec))
                out.append(table(title, rows, p, **kw))
        if reshard1:
            raw["reshard1"] = reshard1
            rows = [{"rep": r["rep"], **{s: dict(r[s], fetched=(r[s].get("report") or {}).get("bytes_fetched"))
                                         for s in SYSTEMS}} for r in reshard1]
            out.append(table("Resharded load: 2 ranks Shard(0) -> 1 process, plain full tensors", rows, p, io=True))
    if ranks and "small" in ranks[0]:
        p = ranks[0]["small"]["payload_bytes"]
        for k in ("save", "load"):
            rows = raw.setdefault(f"combined_small_{k}", combine(ranks, "small", k))
            out.append(table(f"{cfg.small_tensors} replicated tensors of 1-16 KB ({p / 1e6:.1f} MB): {k}",
                             rows, p, io=k == "load"))
    if sim:
        raw["sim"] = sim
        out.append(f"\n### Planning for {sim['tensors']} tensors on mesh {sim['mesh']} (8,192 ranks)\n\n"
                   f"| per-rank Layout + save_plan (median of {sim['coords_sampled']} coords) | slowest coord | "
                   "sum over 8,192 ranks (extrapolated CPU-s) | committed root zarr.json |\n|---|---|---|---|\n"
                   f"| {sim['plan_s_median']:.3f} s | {sim['plan_s_max']:.3f} s at {sim['worst_coord']} | "
                   f"{sim['all_ranks_cpu_s_extrapolated']:.0f} s | {sim['root_zarr_json_bytes'] / 1e3:.1f} KB |")
    return "\n".join(out), raw
