"""Summarise a ``py-spy record --subprocesses --threads [--idle] -f raw`` file: for the
stacks of one process (default: the first worker) that pass through a frame matching
``--under`` (e.g. ``zarrckpt/api/save.py``), the samples per thread name, and the
functions with the most inclusive and self samples on the thread(s) chosen.

    python bench/spy_summary.py spy.txt --under "save (zarrckpt/api/save.py" --thread MainThread
"""

from __future__ import annotations

import argparse
import collections
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--process", type=int, default=1, help="index of the process (0: the launcher)")
    ap.add_argument("--under", default="", help="only stacks with a frame containing this")
    ap.add_argument("--thread", default="", help="only threads whose name starts with this")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    procs: list[str] = []
    threads: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    self_: collections.Counter = collections.Counter()
    total = 0
    for line in open(a.file):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        ps = [f for f in frames if f.startswith("process ")]
        key = ps[-1].split(":")[0] if ps else "?"
        if key not in procs:
            procs.append(key)
        if procs.index(key) != a.process:
            continue
        if a.under and not any(a.under in f for f in frames):
            continue
        th = next((f for f in frames if f.startswith("thread ")), "thread ?")
        name = re.sub(r"^thread \(\d+\):?\s*", "", th) or "?"
        name = re.sub(r"_\d+$", "_N", name)
        threads[name] += int(n)
        if a.thread and not name.startswith(a.thread):
            continue
        total += int(n)
        body = [re.sub(r":\d+\)", ")", f) for f in frames if not f.startswith(("process ", "thread "))]
        for f in set(body):
            incl[f] += int(n)
        if body:
            self_[body[-1]] += int(n)
    print(f"processes seen: {len(procs)}; samples kept: {total}")
    print("samples per thread name:", ", ".join(f"{k} {v}" for k, v in threads.most_common(12)))
    print(f"\ninclusive (of {total}):")
    for f, n in incl.most_common(a.top):
        print(f"  {n / max(total, 1):6.1%}  {f}")
    print("\nself:")
    for f, n in self_.most_common(a.top):
        print(f"  {n / max(total, 1):6.1%}  {f}")


if __name__ == "__main__":
    main()
