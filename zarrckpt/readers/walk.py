"""Reading arrays box by box with bounded memory, and results as JSON: what
:mod:`zarrckpt.inspect` and ``verify`` share.

A stored chunk is the unit of reading (an unsharded chunk is decoded whole anyway); a
shard larger than the budget is read in groups of whole inner chunks. ``parallel`` runs
a function over many units with a bounded number in flight, so neither memory nor the
number of pending futures grows with the size of a checkpoint.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format import documents as fmt
from ..format.layout import piece_shape
from ..storage import Storage

__all__ = ["Box", "JsonReport", "Progress", "ProgressFn", "box_bytes", "boxes", "chunk_grid",
           "json_text", "json_values", "parallel", "raw_root", "units"]

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Progress:
    """Where a long call is: ``bytes_done`` of ``bytes_total`` bytes of array data read,
    ``done`` of ``total`` units (chunks for verify, leaves for diff and stats); ``key``
    the leaf last worked on."""

    key: str
    bytes_done: int
    bytes_total: int
    done: int
    total: int


ProgressFn = Callable[[Progress], None]


def json_values(obj: Any) -> Any:
    """``obj`` as plain JSON values: dataclasses as objects (with the properties named in
    their ``_json_extra``), tuples as lists, non-finite floats as the strings ``"nan"``,
    ``"inf"``, ``"-inf"``, bytes as ``{"bytes": length}``, NumPy scalars as Python ones."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: json_values(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for name in getattr(obj, "_json_extra", ()):
            out[name] = json_values(getattr(obj, name))
        return out
    if isinstance(obj, dict):
        return {str(k): json_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_values(v) for v in obj]
    if isinstance(obj, (bytes, bytearray)):
        return {"bytes": len(obj)}
    if isinstance(obj, (np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else ("nan" if f != f else "inf" if f > 0 else "-inf")
    return obj


def json_text(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as JSON text (of :func:`json_values`; strict JSON: no NaN or Infinity)."""
    return json.dumps(json_values(obj), indent=indent, allow_nan=False)


class JsonReport:
    """What every result dataclass of :mod:`zarrckpt.inspect` can do: ``as_dict()``, its
    plain JSON values, and ``to_json()``, the JSON text ``zarrckpt ... --json`` prints."""

    def as_dict(self) -> dict[str, Any]:
        return json_values(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json_text(self, indent)


def chunk_grid(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """``(index, box)`` of every chunk of a regular grid, C order; one (``()``) for 0-d,
    none when a dimension is 0."""
    if not all(shape):
        return
    grid = [-(-s // c) for s, c in zip(shape, chunk)]
    for index in np.ndindex(*grid):
        yield index, tuple((i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunk, shape))


def units(box: Box, inner: tuple[int, ...] | None, itemsize: int, budget: int) -> list[Box]:
    """A chunk's box as boxes to read: the whole chunk, or, for a shard larger than
    ``budget`` bytes, groups of whole inner chunks of at most ``budget`` bytes (at least
    one inner chunk). An unsharded chunk is decoded whole anyway: it is one unit."""
    ext = [b - a for a, b in box]
    if inner is None or math.prod(ext) * itemsize <= budget:
        return [box]
    counts = [-(-e // n) for e, n in zip(ext, inner)]
    group = piece_shape(counts, math.prod(inner) * itemsize, budget)
    shape = [g * n for g, n in zip(group, inner)]
    return [tuple((a + i * s, min(a + (i + 1) * s, b)) for (a, b), i, s in zip(box, index, shape))
            for index in np.ndindex(*[-(-e // s) for e, s in zip(ext, shape)])]


def boxes(a: fmt.ArrayInfo, budget: int) -> Iterator[Box]:
    for _, box in chunk_grid(a.shape, a.chunk_shape):
        yield from units(box, a.inner_chunk_shape, a.dtype.numpy.itemsize, budget)


def box_bytes(box: Box, itemsize: int) -> int:
    return math.prod(b - a for a, b in box) * itemsize


def parallel(fn: Callable[[Any], Any], items: Iterable[Any], jobs: int) -> Iterator[tuple[Any, Any]]:
    """``(item, fn(item))`` in completion order, at most ``jobs`` running and ``2 * jobs``
    submitted at a time (so memory does not grow with the number of items). An error of
    ``fn`` is raised after the work already submitted has finished."""
    if jobs == 1:
        for it in items:
            yield it, fn(it)
        return
    it = iter(items)
    with cf.ThreadPoolExecutor(jobs, thread_name_prefix="zarrckpt-walk") as pool:
        running: dict[cf.Future, Any] = {}
        for x in it:
            running[pool.submit(fn, x)] = x
            if len(running) >= 2 * jobs:
                break
        while running:
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for f in done:
                x = running.pop(f)
                yield x, f.result()
                nxt = next(it, _END)
                if nxt is not _END:
                    running[pool.submit(fn, nxt)] = nxt


_END = object()


def raw_root(storage: Storage) -> dict[str, Any] | None:
    """The ``zarrckpt`` attributes of the root, parsed leniently (pending roots, damaged
    ones): None when absent or not JSON (:func:`format.documents.root_attributes`)."""
    return fmt.root_attributes(storage.read_bytes("zarr.json")[0])
