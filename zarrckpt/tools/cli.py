"""The ``zarrckpt`` command (also ``python -m zarrckpt``): look at, check, compare, convert
and analyse checkpoints from a shell::

    zarrckpt info PATH [--depth N] [-k PATTERN]...          what is in it, and how it was saved
    zarrckpt verify PATH [--jobs N]                         every document, chunk and checksum
    zarrckpt diff A B [--atol X] [--rtol Y] [--all]         keys, shapes, dtypes, max differences
    zarrckpt convert SRC DST [--to FORMAT] [-k OLD[=NEW]]... [--dtype DT] [--memory-limit SIZE]
    zarrckpt stats PATH... [--plot norms.png]               norm, mean, std, min, max, zeros/NaN/Inf
    zarrckpt ls URL                                         the checkpoints of a run: step, state, size, time;
                                                            what dead saves left there (local only)
    zarrckpt clean DIR [--dry-run]                          remove what saves that died left (local only)

Options may come before or after the paths. ``-k``/``--keys`` (info, diff, stats,
convert) and ``--dtype`` take one value each and may be repeated (``-k model -k optim``);
a ``-k`` pattern that selects no key is an error that names the closest keys.

Paths may be local or ``s3://``, ``gs://``, ``file://`` URLs (S3 settings from the usual
``AWS_*`` variables and ``~/.aws``). Every command prints for people by default and one
JSON document with ``--json``; shows progress on stderr when stderr is a terminal (not
with ``--quiet``); and exits with

* 0: done, and every check passed (``verify``: no damage; ``diff``: the same keys and
  values, bit for bit or within ``--atol``/``--rtol``);
* 1: a check failed (``verify`` found damage; ``diff`` found a difference);
* 2: a usage or input error (no checkpoint there, a missing dependency, a bad option):
  one line on stderr, no traceback (``ZARRCKPT_DEBUG=1`` shows it).

Only ``convert`` from or to DCP and ``torch.save`` imports torch; everything else runs
without it. The work is done by :mod:`zarrckpt.inspect` and :mod:`zarrckpt.convert`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from . import inspect as zi
from ..readers.lazy import format_bytes
from .._optional import require
from ..errors import CheckpointExistsError, CheckpointNotFoundError, ZarrckptError

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


# ------------------------------------------------------------------ progress


class ProgressBar:
    """``label [#####-----]  42% 1.2/2.9 GiB key`` on one line of ``stream``, redrawn at most
    10 times a second, erased by :meth:`close`. Does nothing when ``enabled`` is False.
    Takes any object with ``bytes_done``, ``bytes_total`` and ``key`` (the progress records
    of :mod:`zarrckpt.inspect` and :mod:`zarrckpt.convert`)."""

    def __init__(self, label: str, stream: TextIO, enabled: bool) -> None:
        self.label, self.stream, self.enabled = label, stream, enabled
        self._last = 0.0
        self._drawn = False

    def __call__(self, p: Any) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        final = p.bytes_done >= p.bytes_total
        if now - self._last < 0.1 and not final:
            return
        self._last = now
        frac = p.bytes_done / p.bytes_total if p.bytes_total else 1.0
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        text = (f"{self.label} [{bar}] {frac * 100:3.0f}% {format_bytes(p.bytes_done)}/"
                f"{format_bytes(p.bytes_total)} {p.key}")
        cols = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r" + text[:max(cols - 1, 20)] + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _progress(args: argparse.Namespace, label: str) -> ProgressBar:
    stream = sys.stderr
    enabled = not args.quiet and hasattr(stream, "isatty") and stream.isatty()
    return ProgressBar(label, stream, enabled)


# ------------------------------------------------------------------ text helpers


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Aligned columns; the indices in ``right`` are right-aligned (numbers)."""
    cols = list(zip(*([list(headers)] + [list(r) for r in rows])))
    widths = [max(len(c) for c in col) for col in cols]
    out = []
    for r in [headers, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return f"{x:.4g}"


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x * 100:.3g}%"


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _shape(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "[" + ", ".join(map(str, shape)) + "]"


def _emit_json(obj: Any) -> None:
    sys.stdout.write(zi.to_json(obj) + "\n")


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


# ------------------------------------------------------------------ info


def _info(args: argparse.Namespace) -> int:
    ci = zi.info(args.path, keys=args.keys)
    if args.json:
        _emit_json(ci)
        return EXIT_OK
    print(ci.url)
    if ci.state != "committed":
        print(f"  state    {ci.state}: a save (id {ci.save_id}, started {ci.created} by "
              f"{ci.world_size} process(es)) was interrupted or is still running; it was never committed")
        return EXIT_OK
    procs = _plural(ci.world_size or 0, "process", "processes")
    print(f"  state    committed, format {ci.version}")
    print(f"  saved    {ci.created} by {procs}, committed {ci.committed}")
    if ci.meshes:
        print("  mesh     " + "; ".join(map(str, ci.meshes)))
    if ci.step is not None or ci.metrics:
        line = f"  step     {ci.step if ci.step is not None else '-'}"
        if ci.metrics:
            line += "   " + ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={_short(v, 20)}"
                                  for k, v in ci.metrics.items())
        print(line)
    other = {k: v for k, v in ci.metadata.items() if k not in ("step", "metrics")}
    if other:
        print(f"  metadata {_short(other, 100)}")
    if ci.writer:
        print("  writer   " + ", ".join(f"{k} {v}" for k, v in ci.writer.items()))
    print()
    rows = _tree_rows(ci.leaves, args.depth)
    if rows:
        for line in _table(["KEY", "DTYPE", "SHAPE", "SIZE", "LAYOUT"], rows, right=(3,)):
            print("  " + line)
        print()
    print(f"  {_plural(ci.num_keys, 'key')}, {_plural(ci.num_arrays, 'array')}, {format_bytes(ci.nbytes)} of "
          "array data" + (" (selected)" if args.keys else ""))
    return EXIT_OK


def _tree_rows(leaves: Sequence[zi.LeafInfo], depth: int | None) -> list[list[str]]:
    """Rows of the info table: groups as ``name/`` headings, leaves indented under them;
    groups below ``depth`` components collapsed into one summary row."""
    rows: list[list[str]] = []
    open_parts: list[str] = []
    collapsed: dict[str, list] = {}  # group key -> [row, keys, arrays, bytes]

    def headings(parts: list[str]) -> None:
        nonlocal open_parts
        common = 0
        while common < min(len(open_parts), len(parts)) and open_parts[common] == parts[common]:
            common += 1
        open_parts = open_parts[:common]
        for p in parts[common:]:
            rows.append(["  " * len(open_parts) + p + "/", "", "", "", ""])
            open_parts.append(p)

    for leaf in leaves:
        parts = leaf.key.split("/")
        if depth is not None and len(parts) > depth:
            group = parts[:depth]
            gkey = "/".join(group)
            entry = collapsed.get(gkey)
            if entry is None:
                headings(group[:-1])
                row = ["  " * len(open_parts) + group[-1] + "/", "", "", "", ""]
                rows.append(row)
                entry = collapsed[gkey] = [row, 0, 0, 0]
            entry[1] += 1
            entry[2] += leaf.is_array
            entry[3] += leaf.nbytes
            entry[0][3] = format_bytes(entry[3])
            entry[0][4] = f"{_plural(entry[1], 'key')}, {_plural(entry[2], 'array')}"
            continue
        headings(parts[:-1])
        name = "  " * len(open_parts) + parts[-1]
        if not leaf.is_array:
            rows.append([name, "=", _short(leaf.value), "", ""])
        elif leaf.kind in ("bytes", "bytesio"):
            rows.append([name, leaf.kind, _shape(leaf.shape), format_bytes(leaf.nbytes), leaf.layout()])
        else:
            rows.append([name, leaf.dtype or "", _shape(leaf.shape), format_bytes(leaf.nbytes), leaf.layout()])
    return rows


# ------------------------------------------------------------------ verify


def _verify(args: argparse.Namespace) -> int:
    with _progress(args, "verify") as bar:
        rep = zi.verify(args.path, jobs=args.jobs, progress=bar)
    if args.json:
        _emit_json(rep)
        return EXIT_OK if rep.ok else EXIT_FAILED
    what = (f"{_plural(rep.arrays, 'array')}, {_plural(rep.chunks, 'chunk')}, {format_bytes(rep.bytes)} read "
            f"in {rep.seconds:.1f} s")
    if rep.ok:
        print(f"ok: {rep.url}: {what}; every document matches its digest, every chunk is present and "
              "passes its CRC-32C")
        return EXIT_OK
    for p in rep.problems:
        print(f"{p.kind.upper():<11} {p.where()}: {p.message}")
    broken = {p.array for p in rep.problems if p.array is not None}
    print(f"FAILED: {rep.url}: {_plural(len(rep.problems), 'problem')}"
          + (f" in {_plural(len(broken), 'array')}" if broken else "")
          + (f" ({what})" if rep.state == "committed" else ""))
    return EXIT_FAILED


# ------------------------------------------------------------------ diff


def _diff(args: argparse.Namespace) -> int:
    with _progress(args, "diff") as bar:
        rep = zi.diff(args.a, args.b, atol=args.atol, rtol=args.rtol, keys=args.keys, jobs=args.jobs, progress=bar)
    code = EXIT_OK if rep.same else EXIT_FAILED
    if args.json:
        _emit_json(rep)
        return code
    print(f"A: {rep.a}\nB: {rep.b}")
    for k in rep.only_a:
        print(f"only in A: {k}")
    for k in rep.only_b:
        print(f"only in B: {k}")
    shown = rep.leaves if args.all else [d for d in rep.leaves if d.status != "identical"]
    rows = []
    for d in shown:
        if d.status in ("identical", "close", "different") and d.dtype_a is None:  # values
            detail = "" if d.status == "identical" else f"{_short(d.value_a, 30)} -> {_short(d.value_b, 30)}"
            rows.append([d.key, d.status, "", "", "", detail])
            continue
        if d.status == "shape":
            detail = f"shape {_shape(d.shape_a)} -> {_shape(d.shape_b)}"
        elif d.status == "kind":
            detail = f"{'array' if d.dtype_a else 'value'} -> {'array' if d.dtype_b else 'value'}"
        elif d.status == "dtype":
            detail = f"dtype {d.dtype_a} -> {d.dtype_b}"
        else:
            detail = ""
        diff_count = f"{d.num_different} of {d.numel}" if d.status not in ("shape", "kind") else ""
        rows.append([d.key, d.status, diff_count, _num(d.max_abs), _num(d.max_rel), detail])
    if rows:
        for line in _table(["KEY", "STATUS", "DIFFERENT", "MAX ABS", "MAX REL", ""], rows, right=(2, 3, 4)):
            print(line)
    n_diff = len(rep.differing)
    n = len(rep.leaves)
    if rep.same:
        close = sum(d.status == "close" for d in rep.leaves)
        tol = f" (atol={rep.atol or 0}, rtol={rep.rtol or 0}; {close} within tolerance, not bit-identical)" \
            if close else ""
        print(f"same: {_plural(n, 'key')}, " + ("values within tolerance" if close else "bit-identical") + tol)
    else:
        parts = []
        if n_diff:
            parts.append(f"{n_diff} of {_plural(n, 'common key')} differ")
        if rep.only_a:
            parts.append(f"{_plural(len(rep.only_a), 'key')} only in A")
        if rep.only_b:
            parts.append(f"{_plural(len(rep.only_b), 'key')} only in B")
        print("different: " + ", ".join(parts))
    return code


# ------------------------------------------------------------------ convert


_TORCH_FORMATS = ("dcp", "torch_save")
_SUFFIX_FORMATS = {".safetensors": "safetensors", ".pt": "torch_save", ".pth": "torch_save", ".bin": "torch_save"}


def _format_name(name: str | None) -> str | None:
    if name is None:
        return None
    name = name.strip().lower().replace("-", "_")
    name = {"hf": "safetensors", "torch": "torch_save", "pt": "torch_save"}.get(name, name)
    from .convert import FORMATS

    if name not in FORMATS:
        raise _Usage(f"unknown format {name!r}; one of {', '.join(FORMATS)}")
    return name


def _keys_arg(items: list[str] | None) -> Any:
    """``--keys model/`` (select) ... or ``--keys model/=`` (rename a prefix): a list of
    prefixes, or a mapping when any item renames (the others keep their names)."""
    if not items:
        return None
    if not any("=" in i for i in items):
        return items
    return dict((i.split("=", 1) if "=" in i else (i, i)) for i in items)


def _dtype_arg(items: list[str] | None) -> Any:
    if not items:
        return None
    if len(items) == 1 and "=" not in items[0]:
        return items[0]
    if not all("=" in i for i in items):
        raise _Usage("--dtype takes one dtype (every floating-point array), or FROM=TO pairs")
    return dict(i.split("=", 1) for i in items)


def _size_arg(text: str | None, what: str) -> int | None:
    if text is None or text.lower() == "none":
        return None
    from ..interop.safetensors_io import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise _Usage(f"{what}: {e}") from None


def _convert(args: argparse.Namespace) -> int:
    from . import convert as zc

    src_fmt = _format_name(args.from_format) or zc.detect_format(args.src)
    if src_fmt in _TORCH_FORMATS:
        require("torch", f"converting from {src_fmt}")
    to_fmt = _format_name(args.to_format)
    if to_fmt is None:
        dst = os.fspath(args.dst)
        to_fmt = next((f for suf, f in _SUFFIX_FORMATS.items() if dst.endswith(suf)), None)
        if to_fmt is None:
            if src_fmt == "zarrckpt":
                raise _Usage("converting from zarrckpt: say --to (safetensors, torch_save or dcp), or give DST a "
                             ".safetensors / .pt name")
            to_fmt = "zarrckpt"
    if to_fmt in _TORCH_FORMATS:
        require("torch", f"converting to {to_fmt}")
    options: dict[str, Any] = {"keys": _keys_arg(args.keys), "dtype": _dtype_arg(args.dtype),
                               "overwrite": args.overwrite, "strict": not args.skip_unsupported}
    if args.memory_limit is not None:
        options["memory_limit"] = _size_arg(args.memory_limit, "--memory-limit")
    only = {"max_shard_size": "safetensors", "prefix": "safetensors", "compression": "zarrckpt",
            "pack_bytes": "zarrckpt"}
    for name, fmt_name in only.items():
        value = getattr(args, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if to_fmt != fmt_name:
            raise _Usage(f"{flag} applies to {fmt_name} output only (converting to {to_fmt})")
        if name == "max_shard_size":
            value = _size_arg(value, flag)  # "none": never shard
        elif name == "pack_bytes":
            value = _size_arg(value, flag) or 0
        options[name] = value
    with _progress(args, "convert") as bar:
        options["progress"] = bar
        try:
            rep = zc.convert(args.src, args.dst, from_format=src_fmt, to_format=to_fmt, **options)
        except CheckpointExistsError as e:  # the library names overwrite=True: say the flag
            if getattr(e, "option", None):
                raise CheckpointExistsError(str(e).replace(e.option, "--overwrite")) from None
            raise
    if args.json:
        _emit_json(rep)
        return EXIT_OK
    print(f"converted {rep.source} ({rep.source_format}) -> {rep.destination} ({rep.destination_format}): "
          f"{_plural(rep.leaves, 'leaf', 'leaves')} ({_plural(rep.arrays, 'array')}), "
          f"{format_bytes(rep.bytes)} in {rep.seconds:.1f} s")
    for key, why in rep.skipped:
        print(f"  skipped {key}: {why}")
    for f in rep.files:
        print(f"  wrote {f}")
    return EXIT_OK


# ------------------------------------------------------------------ stats


def _stats(args: argparse.Namespace) -> int:
    paths = args.paths[0] if len(args.paths) == 1 else args.paths
    if args.plot:
        zi.plot_format(args.plot)  # a suffix it cannot write: refused before the reads
    with _progress(args, "stats") as bar:
        results = zi.stats(paths, keys=args.keys, jobs=args.jobs, progress=bar)
    plot = None
    if args.plot:
        plot = zi.plot_norms(results, args.plot)
    if args.json:
        _emit_json({"checkpoints": results, "plot": plot})
        return EXIT_OK
    for r in results:
        print(f"step {r.step if r.step is not None else '-'}  {r.url}")
        rows = [[t.key, t.dtype, _shape(t.shape), _num(t.norm), _num(t.mean), _num(t.std), _num(t.min),
                 _num(t.max), _pct(t.zeros), _pct(t.nan), _pct(t.inf)] for t in r.tensors]
        for line in _table(["KEY", "DTYPE", "SHAPE", "NORM", "MEAN", "STD", "MIN", "MAX", "ZEROS", "NAN", "INF"],
                           rows, right=tuple(range(3, 11))):
            print("  " + line)
        print()
    if len(results) > 1:
        steps = [str(r.step) if r.step is not None else f"#{i}" for i, r in enumerate(results)]
        keys = list(dict.fromkeys(t.key for r in results for t in r.tensors))
        norms = [{t.key: t.norm for t in r.tensors} for r in results]
        print("norm by step")
        rows = [[k, *(_num(n.get(k)) for n in norms)] for k in keys]
        for line in _table(["KEY", *steps], rows, right=tuple(range(1, len(steps) + 1))):
            print("  " + line)
    if plot:
        print(f"plot: {plot}")
    return EXIT_OK


# ------------------------------------------------------------------ ls


def _ls(args: argparse.Namespace) -> int:
    try:
        found = zi.ls(args.url, sizes=not args.no_sizes)
    except CheckpointNotFoundError as e:
        notes = _leftover_notes(args.url, zi.leftovers(args.url))
        if notes:
            raise CheckpointNotFoundError(f"{e}; " + "; ".join(notes)) from None
        raise
    left = zi.leftovers(args.url)
    if args.json:
        _emit_json({"checkpoints": found, "leftovers": left})
        return EXIT_OK
    rows = [[str(x.step) if x.step is not None else "-", x.state,
             format_bytes(x.nbytes) if x.nbytes is not None else "-",
             str(x.num_arrays) if x.num_arrays is not None else "-", x.time or "-", x.url] for x in found]
    head = ["STEP", "STATE", "SIZE", "ARRAYS", "TIME", "PATH"]
    if any(x.shared_bytes for x in found):  # incremental saves: files hard-linked between steps
        for row, x in zip(rows, found):
            row[3:3] = [format_bytes(x.own_bytes) if x.own_bytes is not None else "-",
                        format_bytes(x.shared_bytes) if x.shared_bytes is not None else "-"]
        head[3:3] = ["OWN", "SHARED"]
    for line in _table(head, rows, right=(0, 2, 3, 4, 5) if len(head) > 6 else (0, 2, 3)):
        print(line)
    counts: dict[str, int] = {}
    for x in found:
        counts[x.state] = counts.get(x.state, 0) + 1
    notes = {"pending": " (a save interrupted or still running)", "damaged": " (run zarrckpt verify on them)"}
    print(f"{_plural(len(found), 'checkpoint')}: "
          + ", ".join(f"{n} {s}{notes.get(s, '')}" for s, n in counts.items()))
    for x in found:
        if x.error:
            print(f"  {x.name}: {x.error}")
        if x.saved_step is not None and x.saved_step != x.step:
            print(f"  {x.name}: saved step {x.saved_step}; STEP shows the step of its directory name")
    for line in _leftover_notes(args.url, left):
        print(line)
    return EXIT_OK


def _leftover_notes(url: str, left: list[zi.Leftover]) -> list[str]:
    """One line for the leftovers of dead saves (with their size and the command that
    removes them), one for the saves still running; none when there are none."""
    dead = [x for x in left if not x.live]
    running = {(x.name, x.save_id) for x in left if x.live}
    notes = []
    if dead:
        folder = os.path.dirname(dead[0].path)
        where = url if os.path.normpath(os.path.abspath(url)) == folder else folder
        size = format_bytes(sum(x.nbytes for x in dead))
        notes.append(f"{_plural(len(dead), 'leftover')} of dead saves ({size}): "
                     f"zarrckpt clean {shlex.quote(where)} removes them")
    if running:
        notes.append(f"{_plural(len(running), 'save')} in progress "
                     f"({format_bytes(sum(x.nbytes for x in left if x.live))} written so far)")
    return notes


# ------------------------------------------------------------------ clean


def _clean(args: argparse.Namespace) -> int:
    from ..engine.commit import clean_leftovers
    from ..storage import open_storage

    local = open_storage(args.dir).local_path
    local = None if local is None else local.rstrip("/") or "/"
    if local is not None and not os.path.isdir(local):  # as every command: exit 2, not "0 leftovers"
        raise FileNotFoundError(f"no directory at {args.dir!r}" if not os.path.exists(local)
                                else f"{args.dir!r} is not a directory")
    found = clean_leftovers(args.dir, dry_run=args.dry_run)
    if args.json:
        _emit_json({"dry_run": args.dry_run, "leftovers": found})
        return EXIT_OK
    if "://" in args.dir and not args.dir.startswith("file://"):
        print(f"{args.dir}: nothing to clean on object stores: an interrupted save there is a pending "
              "root at the checkpoint's own path (zarrckpt ls shows it), and whether its writer still "
              "runs cannot be known; once it is gone, a save with overwrite=True replaces it")
        return EXIT_OK
    dead, live = ("would remove", "would keep (live)") if args.dry_run else ("removed", "live (kept)")
    rows = [[live if x.live else dead, x.kind, format_bytes(x.nbytes), x.path] for x in found]
    if rows:
        for line in _table(["ACTION", "KIND", "SIZE", "PATH"], rows, right=(2,)):
            print(line)
    gone = [x for x in found if not x.live]
    size = format_bytes(sum(x.nbytes for x in gone))
    kept = len(found) - len(gone)
    if args.dry_run:
        print(f"would remove {_plural(len(gone), 'leftover')} of saves that died ({size}) and keep {kept} "
              f"of running saves; nothing removed (--dry-run)")
    else:
        print(f"removed {_plural(len(gone), 'leftover')} of saves that died ({size}); kept {kept} of running saves")
    return EXIT_OK


# ------------------------------------------------------------------ the parser


class _Usage(Exception):
    """A bad combination of options found after parsing (exit status 2)."""


def _parser() -> argparse.ArgumentParser:
    from .._version import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    keys = argparse.ArgumentParser(add_help=False)
    keys.add_argument("-k", "--keys", action="append", metavar="PATTERN",
                      help="only keys under this prefix (model, optim/state) or matching this glob "
                           "(model/*.bias); repeat for several")
    jobs = argparse.ArgumentParser(add_help=False)
    jobs.add_argument("-j", "--jobs", type=_positive, default=zi.DEFAULT_JOBS,
                      help=f"read this many chunks or tensors at once (default {zi.DEFAULT_JOBS})")

    p = argparse.ArgumentParser(
        prog="zarrckpt", description="Inspect, verify, compare, convert and analyse zarrckpt checkpoints.",
        epilog="Exit status: 0 ok, 1 a check failed (verify, diff), 2 a usage or input error.")
    p.add_argument("--version", action="version", version=f"zarrckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("info", parents=[common, keys], help="what a checkpoint holds and how it was saved",
                       description="State, format, save time, world size and mesh, and every key with its dtype, "
                                   "shape, bytes and saved layout, as a tree; totals.")
    c.add_argument("path")
    c.add_argument("-d", "--depth", type=_positive, help="collapse groups deeper than this many key components")
    c.set_defaults(run=_info)

    c = sub.add_parser("verify", parents=[common, jobs], help="check every document, chunk and checksum",
                       description="Check the root and every array document against their SHA-256 digests, "
                                   "that every chunk is stored, and every chunk's CRC-32C. Exit status 1 and a "
                                   "line per problem (naming the tensor and chunk) when anything is wrong.")
    c.add_argument("path")
    c.set_defaults(run=_verify)

    c = sub.add_parser("diff", parents=[common, keys, jobs], help="compare two checkpoints",
                       description="Keys only in one, kind/shape/dtype differences, and for each tensor the "
                                   "number of differing elements and max abs / max relative (to B) differences, "
                                   "read chunk by chunk. Exit status 0 only when both hold the same keys with "
                                   "bit-identical values (or within --atol/--rtol when given).")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--atol", type=_non_negative, help="absolute tolerance: |a - b| <= atol + rtol * |b|")
    c.add_argument("--rtol", type=_non_negative, help="relative tolerance (of |b|)")
    c.add_argument("--all", action="store_true", help="list identical keys too")
    c.set_defaults(run=_diff)

    c = sub.add_parser("convert", parents=[common], help="convert to or from safetensors, torch.save, DCP",
                       description="Convert between zarrckpt and Hugging Face safetensors (one file, or a folder "
                                   "sharded with model.safetensors.index.json), torch.save files (read with "
                                   "weights_only=True) and PyTorch DCP directories, streaming with bounded memory. "
                                   "torch.save and DCP need torch; safetensors does not.")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--from", dest="from_format", metavar="FORMAT",
                   help="zarrckpt, safetensors, torch_save or dcp (default: detected)")
    c.add_argument("--to", dest="to_format", metavar="FORMAT",
                   help="zarrckpt, safetensors, torch_save or dcp (default: from DST's suffix, else zarrckpt)")
    c.add_argument("-k", "--keys", action="append", metavar="PREFIX[=NEW]",
                   help="only keys starting with this prefix; PREFIX=NEW also renames (model/= drops 'model/'); "
                        "repeat for several")
    c.add_argument("--dtype", action="append", metavar="DTYPE",
                   help="cast every floating-point array to DTYPE (bf16, float16 ...), or FROM=TO (repeat for "
                        "several pairs)")
    c.add_argument("--memory-limit", metavar="SIZE", help="tensor data held at once (default 1GiB; e.g. 256MB)")
    c.add_argument("--max-shard-size", metavar="SIZE",
                   help="safetensors folders: bytes per file (default 5GB; 'none': one file)")
    c.add_argument("--prefix", help="safetensors folders: file name prefix (default 'model')")
    c.add_argument("--compression", choices=["zstd", "gzip"], help="zarrckpt output: compress chunks")
    c.add_argument("--pack-bytes", metavar="SIZE", help="zarrckpt output: pack leaves up to this size into hidden byte arrays (deprecated; default 0: every leaf its own array)")
    c.add_argument("--overwrite", action="store_true", help="replace what is at DST")
    c.add_argument("--skip-unsupported", action="store_true",
                   help="skip leaves the destination cannot hold (listed) instead of failing")
    c.set_defaults(run=_convert)

    c = sub.add_parser("stats", parents=[common, keys, jobs], help="per-tensor statistics, across a run",
                       description="Per tensor: L2 norm, mean, std, min, max over the finite elements, and the "
                                   "fractions of zeros, NaN and Inf, read chunk by chunk. Several checkpoints (or "
                                   "a run directory): a table per step, the norms by step, and --plot.")
    c.add_argument("paths", nargs="+", metavar="PATH", help="checkpoints, or one run directory / prefix")
    c.add_argument("--plot", metavar="OUT.png",
                   help="plot each tensor's norm across steps (matplotlib), in the format OUT's suffix names "
                        "(.png, .svg, .pdf, .jpg ...)")
    c.set_defaults(run=_stats)

    c = sub.add_parser("ls", parents=[common], help="the checkpoints under a run directory or prefix",
                       description="Every checkpoint under a directory or bucket prefix (or the one at it): "
                                   "step, state (committed, pending, damaged), size of array data, time; "
                                   "on local file systems also what dead saves left there (zarrckpt clean "
                                   "removes it) and the saves still running.")
    c.add_argument("url")
    c.add_argument("--no-sizes", action="store_true", help="do not read array documents for sizes (faster)")
    c.set_defaults(run=_ls)

    c = sub.add_parser("clean", parents=[common], help="remove what saves that died left beside checkpoints",
                       description="Remove, directly under a local directory, what saves whose process is "
                                   "gone left there (their lock is free): their hidden directories "
                                   "(.zarrckpt-<save id>.<checkpoint name in hex>, with -old for a replaced "
                                   "checkpoint moved aside), lock files (the same name and .lock) and pending "
                                   "claims (a checkpoint directory whose root says pending). Those of running "
                                   "saves are listed and kept. Object stores: nothing is removed (see spec §7.5).")
    c.add_argument("dir", help="the directory holding the checkpoints (a run directory), not a checkpoint")
    c.add_argument("-n", "--dry-run", action="store_true", help="list what would be removed, remove nothing")
    c.set_defaults(run=_clean)
    return p


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {v}")
    return v


def _non_negative(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return v


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and not isinstance(e, ZarrckptError) and e.args:
        return str(e.args[0])
    text = str(e) or type(e).__name__
    return " ".join(text.split())  # one line


def _more_paths(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """``stats A -k model B``: paths after an option (argparse takes the first run of
    paths only) join the others; any other leftover argument is a usage error."""
    if getattr(args, "paths", None) is None or any(e.startswith("-") for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.paths.extend(extra)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _more_paths(parser, args, extra)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except _Usage as e:
        parser.exit(EXIT_ERROR, f"zarrckpt {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        print(f"zarrckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `zarrckpt ls ... | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep interpreter exit quiet
        except OSError:
            pass
        return EXIT_OK
    except (ZarrckptError, OSError, ImportError, ValueError, KeyError) as e:
        if os.environ.get("ZARRCKPT_DEBUG"):
            raise
        print(f"zarrckpt {args.command}: error: {_message(e)}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_ERROR  # pragma: no cover - parser.exit raises


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
