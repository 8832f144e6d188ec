"""Same-run A/B of two zarrckpt revisions on the CPU benchmark (``bench.py``).

Runs ``bench.py`` from a git worktree of each revision, alternating A, B, A, B ... (``--rounds``
times each), the same options every time, and compares zarrckpt's own times: for every
shape and operation (sync save, async blocked and total, load, resharded loads) the median
over reps in each run, then the median of the B/A ratios of adjacent runs (>1: B slower).
DCP runs in every ``bench.py`` run too; ``zc/dcp_best`` is reported per run as a second,
machine-normalized view.

    python bench/ab.py ee3984d HEAD --rounds 2 -- --device cpu --state-gb 0.5 --hidden 1024 \\
        --reps 3 --dcp-threads 4 --only save,async,load --dir /tmp/zbab

Everything after ``--`` goes to ``bench.py`` (``--dir`` is suffixed per run; ``--out`` is
set here). The JSON of every run and the summary land in ``--out-dir``.

``bench.py`` verifies every checkpoint it times; a rep whose checkpoint failed has no
time and is left out of these medians too (the summary's ``unverified`` counts them per
run, and the table says so). A revision whose ``bench.py`` predates verification gives
records without a ``verified`` flag: they are used, and counted as ``unchecked``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OPS = {"save": ("save", "seconds"), "async blocked": ("async", "blocked"), "async total": ("async", "seconds"),
       "load": ("load", "seconds")}


def worktree(rev: str, where: str, side: str) -> str:
    path = os.path.join(where, f"{side}-{rev.replace('/', '_')}")  # A and B may name the same revision
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, rev], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def run(tree: str, args: list[str], out: str, tag: str) -> dict:
    args = list(args)
    if "--dir" in args:
        i = args.index("--dir") + 1
        args[i] = f"{args[i].rstrip('/')}-{tag}"
    env = dict(os.environ, PYTHONPATH=tree)
    # each tree's own bench.py (its planning section imports that tree's internals); check
    # with `git diff A B -- bench/` that the harness did not change between the two
    cmd = [sys.executable, os.path.join(tree, "bench", "bench.py"), *args, "--out", out]
    print("+", f"PYTHONPATH={tree}", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=tree)
    with open(out) as f:
        return json.load(f)


def times(reps: list, s: str, field: str, count: dict) -> list[float]:
    """System ``s``'s ``field`` over the reps whose checkpoint did not fail verification;
    ``count`` tallies the reps left out (``unverified``) and those without a flag
    (``unchecked``: a bench.py before verification)."""
    out = []
    for r in reps:
        rec = r.get(s)
        if not rec:
            continue
        flag = rec.get("verified")
        if flag is False or rec.get(field) is None:
            count["unverified"] = count.get("unverified", 0) + 1
            continue
        if flag is None:
            count["unchecked"] = count.get("unchecked", 0) + 1
        out.append(rec[field])
    return out


def medians(result: dict, count: dict | None = None) -> dict[tuple[str, str], float]:
    """(shape, operation) -> zarrckpt's median seconds in one run over its verified reps;
    also 'zc/dcp_best'. ``count`` receives the unverified and unchecked reps."""
    out: dict = {}
    count = {} if count is None else count
    for shape, body in result["shapes"].items():
        comb = body.get("combined", {})
        for op, (section, field) in OPS.items():
            reps = comb.get(section) or []
            zc = times(reps, "zc", field, count)
            best = times(reps, "dcp_best", field, count)
            if zc:
                out[shape, op] = statistics.median(zc)
                if best and statistics.median(best) > 0:
                    out[shape, op + " zc/dcp_best"] = statistics.median(zc) / statistics.median(best)
        for pair, reps in (comb.get("pairs") or {}).items():
            zc = times(reps, "zc", "seconds", count) if isinstance(reps, list) else []
            if zc:
                out[shape, f"reshard {pair}"] = statistics.median(zc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "out", "ab-" + datetime.datetime.now().strftime("%H%M%S")))
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = ap.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]
    os.makedirs(opts.out_dir, exist_ok=True)
    where = tempfile.mkdtemp(prefix="zarrckpt-ab-")
    trees: dict[str, str] = {}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    counts: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        trees["A"], trees["B"] = worktree(opts.a, where, "A"), worktree(opts.b, where, "B")
        for i in range(opts.rounds):
            for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                out = os.path.join(opts.out_dir, f"{side}{i}.json")
                count: dict = {}
                runs[side].append(medians(run(trees[side], bench_args, out, f"{side}{i}"), count))
                counts[side].append(count)
    finally:
        for t in trees.values():
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", t], check=False)
    rows = []
    for key in sorted(set().union(*runs["A"], *runs["B"])):
        pairs = [b[key] / a[key] for a, b in zip(runs["A"], runs["B"]) if key in a and key in b and a[key] > 0]
        if not pairs:
            continue
        rows.append({"shape": key[0], "op": key[1], "A": [r.get(key) for r in runs["A"]],
                     "B": [r.get(key) for r in runs["B"]], "median B/A": statistics.median(pairs)})
    summary = {"a": opts.a, "b": opts.b, "rounds": opts.rounds, "bench_args": bench_args,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rows": rows,
               "unverified": counts}
    with open(os.path.join(opts.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n| shape | measure | A ({opts.a}) | B ({opts.b}) | median B/A |\n|---|---|---|---|---|")
    for r in rows:
        fa = ", ".join(f"{x:.3f}" for x in r["A"] if x is not None)
        fb = ", ".join(f"{x:.3f}" for x in r["B"] if x is not None)
        print(f"| {r['shape']} | {r['op']} | {fa} | {fb} | {r['median B/A']:.2f} |")
    for side, rev in (("A", opts.a), ("B", opts.b)):
        bad = sum(c.get("unverified", 0) for c in counts[side])
        unchecked = sum(c.get("unchecked", 0) for c in counts[side])
        if bad:
            print(f"\n{side} ({rev}): {bad} timed reps whose checkpoint FAILED verification were left out")
        if unchecked:
            print(f"\n{side} ({rev}): {unchecked} timed reps were not verified (its bench.py predates "
                  "verification); they are included")


if __name__ == "__main__":
    main()
