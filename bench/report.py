"""Markdown tables and combined numbers from the per-rank records of bench.py.

Conventions: seconds of a phase = the slowest rank's (every phase is timed between
barriers); "zarrckpt speedup" of a system = median over reps of (that system's seconds /
zarrckpt's seconds in the same rep), so > 1 means zarrckpt is faster; GB/s = the state's
global bytes / median seconds; GB = 10^9 bytes. Every timed checkpoint is verified (see
harness.verify_checkpoint): a rep whose checkpoint failed has no time, is left out of
every median and ratio, and the system's name in the table says in how many reps.
"""

from __future__ import annotations

import statistics

SYSTEMS = ("zc", "dcp")  # the two systems of bench_s3.py (and harness.Ctx's default)
BENCH_SYSTEMS = ("zc", "dcp", "dcp_best")  # bench.py: zarrckpt, DCP defaults, DCP at its best
NAMES = {"zc": "zarrckpt", "dcp": "DCP defaults", "dcp_best": "DCP best"}
SPEEDUP = "zarrckpt speedup (this s / zarrckpt s, >1: zarrckpt faster)"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def human(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def systems_of(rows) -> list[str]:
    return [s for s in BENCH_SYSTEMS if rows and s in rows[0]]


def verified_of(recs) -> bool | None:
    """False when any record failed verification, None when some were not checked (a JSON
    from a bench.py before every timed checkpoint was verified), else True."""
    flags = [r.get("verified") for r in recs]
    if any(f is False for f in flags):
        return False
    return None if any(f is None for f in flags) else True


def combine(per_rank) -> list[dict]:
    """``per_rank[r][i]`` = rank r's record of rep i ({"rep", "order", system: record}).
    Per rep and system, over ranks: seconds, blocked, may_change and RSS = max; I/O bytes
    summed; files from rank 0; verified = all ranks. A rep whose checkpoint failed
    verification (on any rank) has no times: seconds, blocked and may_change are None, and
    every median and ratio below leaves it out."""
    out = []
    for i, row0 in enumerate(per_rank[0]):
        row = {"rep": row0["rep"], "order": row0.get("order")}
        for s in BENCH_SYSTEMS:
            if s not in row0:
                continue
            recs = [pr[i][s] for pr in per_rank]
            reports = [r.get("report") or {} for r in recs]
            ok = verified_of(recs)

            def slowest(key, default=0):
                vals = [r.get(key, default) for r in recs]
                return None if ok is False or any(v is None for v in vals) else max(vals)
            row[s] = {"seconds": slowest("seconds"),
                      "blocked": slowest("blocked"),
                      "may_change": None if ok is False else max(
                          (r.get("may_change", r.get("blocked", 0)) or 0) for r in recs),
                      "rss_peak_mb": max(r["rss_peak_mb"] for r in recs),
                      "rss_retained_mb": max(r.get("rss_retained_mb", 0) for r in recs),
                      **{k: sum(r.get(k, 0) for r in recs) for k in ("rchar", "read_bytes", "bytes_needed")},
                      "fetched": sum(p.get("bytes_fetched", 0) for p in reports) if s == "zc" else None,
                      "zc_needed": sum(p.get("bytes_needed", 0) for p in reports) if s == "zc" else None,
                      "files": recs[0].get("files"), "disk_bytes": recs[0].get("disk_bytes"),
                      "verified": ok}
        out.append(row)
    return out


def good(rows, s) -> list[dict]:
    """The reps whose system-``s`` checkpoint was not found wrong (their times count)."""
    return [r for r in rows if r[s]["verified"] is not False]


def ratio(rows, s, field="seconds"):
    """Median over reps of (system s / zarrckpt) in the same rep; reps where either
    system's checkpoint failed verification are left out."""
    return median([r[s][field] / r["zc"][field] for r in rows
                   if r[s][field] is not None and r["zc"][field]])


def name(rows, s) -> str:
    bad = sum(1 for r in rows if r[s]["verified"] is False)
    unchecked = sum(1 for r in rows if r[s]["verified"] is None)
    note = f" (VERIFY FAILED in {bad} of {len(rows)} reps: their times dropped)" if bad else ""
    return NAMES[s] + note + (f" (not verified in {unchecked} reps)" if unchecked else "")


def f3(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def f2(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def row_line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def header(title, head) -> list[str]:
    return [f"\n#### {title}\n", row_line(head), "|" + "---|" * len(head)]


def table(title, rows, payload, io=False, bw=None, bw_kind="write") -> str:
    """One row per system: medians over reps, speedups, % of the same rep's best storage
    bandwidth (``bw``: rep -> bytes/s), RSS, files; for loads the bytes needed/read."""
    head = ["system", "seconds (median)", "GB/s", SPEEDUP]
    head += [f"% of storage {bw_kind} BW"] if bw else []
    head += ["peak RSS Δ MB (max)", "files (bytes on disk)"]
    head += ["bytes needed", "read (rchar)", "rchar / needed", "zarrckpt fetched (report)",
             "fetched / needed"] if io else []
    lines = header(title, head)
    for s in systems_of(rows):
        ok = good(rows, s)
        med = median([r[s]["seconds"] for r in ok])
        files, disk = rows[-1][s].get("files"), rows[-1][s].get("disk_bytes")
        cells = [name(rows, s), f3(med), f2(payload / med / 1e9) if med else "-",
                 "—" if s == "zc" else f2(ratio(rows, s))]
        if bw:
            pct = median([payload / r[s]["seconds"] / bw[r["rep"]] for r in ok])
            cells.append("-" if pct is None else f"{100 * pct:.0f}%")
        cells += [f"{max(r[s]['rss_peak_mb'] for r in rows):.0f}",
                  "-" if files is None else f"{files} ({human(disk)})"]
        if io:
            need, got = median([r[s]["bytes_needed"] for r in ok]), median([r[s]["rchar"] for r in ok])
            fetched = median([r[s].get("fetched") for r in ok])
            cells += [human(need), human(got), f2(got / need) if need and got is not None else "-",
                      human(fetched) if fetched is not None else "-",
                      f2(fetched / need) if fetched is not None and need else "-"]
        lines.append(row_line(cells))
    return "\n".join(lines)


def async_table(title, rows, payload) -> str:
    head = ["system", "blocked s (call returns)", "may change s (staging done)", "total s (committed)",
            "staging GB/s (state / may change)", "zarrckpt speedup: blocked", "may change", "total",
            "peak RSS Δ MB (max)", "retained MB (max)"]
    lines = header(title, head)
    for s in systems_of(rows):
        b, m, t = (median([r[s][k] for r in good(rows, s)]) for k in ("blocked", "may_change", "seconds"))
        cells = [name(rows, s), f3(b), f3(m), f3(t), f2(payload / m / 1e9) if m else "-"]
        cells += ["—"] * 3 if s == "zc" else [f2(ratio(rows, s, k)) for k in ("blocked", "may_change", "seconds")]
        cells += [f"{max(r[s]['rss_peak_mb'] for r in rows):.0f}",
                  f"{max(r[s]['rss_retained_mb'] for r in rows):.0f}"]
        lines.append(row_line(cells))
    return "\n".join(lines)


def bw_table(ranks):
    """Aggregate bandwidth per (rep, threads): all ranks' bytes / slowest rank's time.
    Also the best write and read bandwidth of each rep (bytes/s)."""
    agg = {}
    for r in ranks:
        for b in r["bw"]:
            e = agg.setdefault((b["rep"], b["threads"]), {"bytes": 0, "w": 0, "r": 0})
            e["bytes"] += b["bytes"]
            e["w"], e["r"] = max(e["w"], b["write_s"]), max(e["r"], b["read_s"])
    lines = header("Storage bandwidth (plain fsynced sequential I/O, same bytes per rank)",
                   ["threads per rank", "write GB/s (median)", "read GB/s (median)"])
    for t in sorted({k[1] for k in agg}):
        es = [e for k, e in agg.items() if k[1] == t]
        lines.append(f"| {t} | {median([e['bytes'] / e['w'] / 1e9 for e in es]):.2f} | "
                     f"{median([e['bytes'] / e['r'] / 1e9 for e in es]):.2f} |")
    d2h: dict = {}
    for r in ranks:
        for b in r.get("d2h", []):
            e = d2h.setdefault(b["rep"], {"bytes": 0, "s": 0})
            e["bytes"] += b["bytes"]
            e["s"] = max(e["s"], b["seconds"])
    if d2h:
        lines.append(f"\nPinned device-to-host copy, every rank at once (the staging bound): "
                     f"{median([e['bytes'] / e['s'] / 1e9 for e in d2h.values()]):.1f} GB/s (median of reps)")
    best_w, best_r = {}, {}
    for (rep, _), e in agg.items():
        best_w[rep] = max(best_w.get(rep, 0), e["bytes"] / e["w"])
        best_r[rep] = max(best_r.get(rep, 0), e["bytes"] / e["r"])
    return "\n".join(lines), best_w, best_r


def sweep_table(title, sweep, payload, stager=None) -> str:
    bad = sweep.get("unverified") or {}
    lines = header(title, ["FileSystemWriter thread_count", "sync save s (median of the verified saves)",
                           "GB/s", "chosen for DCP best"])
    for t in sorted(sweep["seconds"], key=int):
        med = sweep["median"].get(t)
        note = f" ({len(sweep['seconds'][t])} verified; VERIFY FAILED {bad[t]}, dropped)" if bad.get(t) else \
            f" ({len(sweep['seconds'][t])})"
        lines.append(row_line([t, f3(med) + note, f2(payload / med / 1e9) if med else "-",
                               "yes" if int(t) == sweep["chosen"] else ""]))
    if stager:
        lines.append(f"\nDCP best async: {stager}")
    return "\n".join(lines)


def pairs_table(cfg, pairs, info) -> tuple[str, dict]:
    """One row per (pair, system): seconds, speedup, bytes needed vs fetched."""
    from reshard import PAIRS, pair_info

    head = ["pair", "loaded on", "system", "seconds (median)", SPEEDUP, "bytes needed",
            "zarrckpt fetched (report)", "fetched / needed", "read (rchar)", "rchar / needed"]
    lines = header("Resharded loads (checkpoint saved on one layout, loaded on another)", head)
    combined = {}
    for p in PAIRS:
        if p not in pairs:
            continue
        rows = combined[p] = combine(pairs[p]["ranks"])
        dev = pairs[p]["device"]
        where = f"{pairs[p]['world']} rank(s), {dev}"
        if cfg.device == "cuda" and dev == "cpu":
            where += f" (CPU targets over gloo: {info.get('gpus', 0)} GPUs < {pairs[p]['world']} ranks)"
        for s in systems_of(rows):
            ok = good(rows, s)
            need, got = median([r[s]["bytes_needed"] for r in ok]), median([r[s]["rchar"] for r in ok])
            fetched = median([r[s].get("fetched") for r in ok])
            lines.append(row_line([
                pair_info(p, cfg.world)["label"], where, name(rows, s), f3(median([r[s]["seconds"] for r in ok])),
                "—" if s == "zc" else f2(ratio(rows, s)), human(need),
                human(fetched) if fetched is not None else "-",
                f2(fetched / need) if fetched is not None and need else "-", human(got),
                f2(got / need) if need and got is not None else "-"]))
    return "\n".join(lines), combined


def shape_section(cfg, shape, data, info) -> tuple[str, dict]:
    ranks = data["ranks"]
    r0 = ranks[0]
    p, st = r0["payload_bytes"], r0["stats"]
    out = [f"\n### Shape `{shape}`: {p / 1e9:.2f} GB of fp32 state, FSDP2 Shard(0) + AdamW",
           f"\nModel {r0['model']}. {st['tensors']} tensors ({st['scalars']} of them AdamW's 0-d `step`); "
           f"per-rank bytes of the others: min {human(st['local_bytes_min'])}, median "
           f"{human(st['local_bytes_median'])}, max {human(st['local_bytes_max'])}."]
    raw: dict = {"combined": {}}
    text, best_w, best_r = bw_table(ranks)
    out.append(text)
    stager = (f"`DefaultStager(StagingOptions(use_pinned_memory={cfg.device == 'cuda'}, use_shared_memory=False, "
              f"use_async_staging=True, use_non_blocking_copy={cfg.device == 'cuda'}))`, "
              f"{'one reused for every save of the shape (staged once, untimed, before rep 0)' if cfg.dcp_stager == 'reuse' else 'a new one per save'}")
    if "BlockingAsyncStager" in str(r0.get("dcp_stager", "")):
        stager = f"`{r0['dcp_stager']}`"
    out.append(sweep_table(f"DCP writer-thread sweep (`{shape}`)", r0["sweep"], p, stager))
    for sec, title in (("save", "Sync save"), ("async", "Async save"), ("load", "Load, same layout")):
        if sec not in r0:
            continue
        rows = raw["combined"][sec] = combine([r[sec] for r in ranks])
        title = f"{title} (`{shape}`)"
        if sec == "save":
            out.append(table(title, rows, p, bw=best_w))
        elif sec == "async":
            out.append(async_table(title, rows, p))
        else:
            out.append(table(title, rows, p, io=True, bw=best_r, bw_kind="read"))
    if data.get("pairs"):
        text, raw["combined"]["pairs"] = pairs_table(cfg, data["pairs"], info)
        out.append(text)
    return "\n".join(out), raw


def report(cfg, shapes, small, sim, info) -> tuple[str, dict]:
    out = [f"## zarrckpt vs DCP — {info['device_desc']}, world {cfg.world}, {cfg.dir} ({info['fs_type']}), "
           f"{cfg.reps} reps, page cache: {info['drop_caches']}, wall {info.get('wall_s', 0):.0f} s"]
    raw: dict = {"machine": info, "shapes": {}}
    for shape, data in shapes.items():
        text, extra = shape_section(cfg, shape, data, info)
        out.append(text)
        raw["shapes"][shape] = dict(data, **extra)
    if small:
        p = small[0]["payload_bytes"]
        out.append(f"\n### {cfg.small_tensors} replicated tensors of 1-16 KB ({p / 1e6:.1f} MB)")
        out.append(sweep_table("DCP writer-thread sweep (small tensors)", small[0]["sweep"], p))
        raw["small"] = {"ranks": small, "combined": {}}
        for k in ("save", "load"):
            rows = raw["small"]["combined"][k] = combine([r[k] for r in small])
            out.append(table(f"Small tensors: {k}", rows, p, io=k == "load"))
    if sim:
        raw["sim"] = sim
        out.append(f"\n### Planning for {sim['tensors']} tensors on mesh {sim['mesh']} (8,192 ranks)\n\n"
                   f"| per-rank Layout + save_plan (median of {sim['coords_sampled']} coords) | slowest coord | "
                   "sum over 8,192 ranks (extrapolated CPU-s) | committed root zarr.json |\n|---|---|---|---|\n"
                   f"| {sim['plan_s_median']:.3f} s | {sim['plan_s_max']:.3f} s at {sim['worst_coord']} | "
                   f"{sim['all_ranks_cpu_s_extrapolated']:.0f} s | {sim['root_zarr_json_bytes'] / 1e3:.1f} KB |")
    return "\n".join(out), raw
