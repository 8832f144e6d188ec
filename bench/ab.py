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


def worktree(rev: str, where: str) -> str:
    path = os.path.join(where, rev.replace("/", "_"))
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


def medians(result: dict) -> dict[tuple[str, str], float]:
    """(shape, operation) -> zarrckpt's median seconds in one run; also 'zc/dcp_best'."""
    out = {}
    for shape, body in result["shapes"].items():
        comb = body.get("combined", {})
        for op, (section, field) in OPS.items():
            reps = comb.get(section) or []
            zc = [r["zc"][field] for r in reps if r.get("zc")]
            best = [r["dcp_best"][field] for r in reps if r.get("dcp_best")]
            if zc:
                out[shape, op] = statistics.median(zc)
                if best and statistics.median(best) > 0:
                    out[shape, op + " zc/dcp_best"] = statistics.median(zc) / statistics.median(best)
        for pair, reps in (comb.get("pairs") or {}).items():
            zc = [r["zc"]["seconds"] for r in reps if r.get("zc")] if isinstance(reps, list) else []
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
    trees = {"A": worktree(opts.a, where), "B": worktree(opts.b, where)}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        for i in range(opts.rounds):
            for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                out = os.path.join(opts.out_dir, f"{side}{i}.json")
                runs[side].append(medians(run(trees[side], bench_args, out, f"{side}{i}")))
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
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rows": rows}
    with open(os.path.join(opts.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n| shape | measure | A ({opts.a}) | B ({opts.b}) | median B/A |\n|---|---|---|---|---|")
    for r in rows:
        fa = ", ".join(f"{x:.3f}" for x in r["A"] if x is not None)
        fb = ", ".join(f"{x:.3f}" for x in r["B"] if x is not None)
        print(f"| {r['shape']} | {r['op']} | {fa} | {fb} | {r['median B/A']:.2f} |")


if __name__ == "__main__":
    main()
