"""Pure layout logic: which part of a global tensor each mesh coordinate holds,
the chunk grid that follows those parts, and who writes each chunk.

No torch, no I/O. Everything is a function of (global shape, mesh shape,
placements, coordinate), so every rank computes its own plan without talking
to the others (spec §5.4 "Chunk grid", §8 "Writers").

Index sets
    A placement acts on one tensor dimension, so the part a coordinate holds is
    a Cartesian product of per-dimension index sets. Each index set is a list
    of *runs* ``[start, stop)`` of global indices, in the order they appear in
    the local tensor. ``Shard`` gives one run, ``_StridedShard`` (FSDP2 over TP)
    several. Splits follow ``torch.chunk``: pieces of ``ceil(L/n)``, the last
    ones short or empty.

Cells and replicas
    Along one tensor dimension the runs of all coordinates partition
    ``[0, size)``. A *cell* is one run per dimension; all coordinates that agree
    on the mesh dims that shard the tensor hold the same cell (its replicas).

Chunk grid
    Along each dimension the chunk size is the longest run. When every run
    boundary is a multiple of it (even sharding, a single ``Shard``, most real
    layouts) each chunk lies inside one cell: *aligned*. Nested uneven sharding
    (``[Shard(0), Shard(0)]`` with 4097 rows) is not; then each chunk is written
    by a replica of the cell that holds most of it, and the other cells' few
    boundary rows are sent to it point-to-point (:class:`ChunkWrite` sources,
    :class:`Send`). The gcd grid is never used: it can degrade to 1-row chunks.

Writers
    Of a cell's ``R`` replicas, chunk ``i`` of tensor ``key`` is written by
    replica ``(crc32(key) + i) mod R`` (``i`` the linear chunk index; see
    :meth:`Layout._pick` for split cells): replicated data is written once, and
    the work spreads over replicas. A replicated cell of at least
    ``replica_split_min_elems`` elements is cut into ``k <= R`` chunks along its
    longest dim (``k`` divides it) so that ``k`` replicas share its writing.
"""

from __future__ import annotations

import functools
import itertools
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..errors import UnsupportedPlacementError

__all__ = [
    "ChunkWrite",
    "Layout",
    "Placement",
    "Replicate",
    "Send",
    "Shard",
    "StridedShard",
    "chunk_bounds",
    "dim_runs",
    "piece_boxes",
    "piece_shape",
    "placement_from_json",
    "placement_to_json",
    "slices",
    "unit_elements",
]

Run = tuple[int, int]
Box = tuple[Run, ...]  # one [start, stop) per tensor dim
Coord = tuple[int, ...]


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class StridedShard:
    dim: int
    split_factor: int


@dataclass(frozen=True)
class Replicate:
    pass


Placement = Shard | StridedShard | Replicate


def placement_to_json(p: Placement) -> dict:
    if isinstance(p, Shard):
        return {"type": "shard", "dim": p.dim}
    if isinstance(p, StridedShard):
        return {"type": "strided_shard", "dim": p.dim, "split_factor": p.split_factor}
    return {"type": "replicate"}


def placement_from_json(j: dict) -> Placement:
    t = j.get("type") if isinstance(j, dict) else None
    try:
        if t == "shard":
            return Shard(int(j["dim"]))
        if t == "strided_shard":
            return StridedShard(int(j["dim"]), int(j["split_factor"]))
    except (KeyError, TypeError, ValueError):
        raise UnsupportedPlacementError(f"malformed placement {j!r}") from None
    if t == "replicate":
        return Replicate()
    raise UnsupportedPlacementError(f"unknown placement {j!r}")


# ----------------------------------------------------------------- index sets


def chunk_bounds(length: int, n: int, k: int) -> Run:
    """Piece ``k`` of ``n`` of ``range(length)`` as ``torch.chunk`` cuts it."""
    c = -(-length // n)
    lo = min(k * c, length)
    return lo, min(lo + c, length)


def _select(runs: Sequence[Run], lo: int, hi: int) -> list[Run]:
    """The runs covering local positions ``[lo, hi)`` of the concatenation of ``runs``."""
    out: list[Run] = []
    pos = 0
    for a, b in runs:
        n = b - a
        s, e = max(lo - pos, 0), min(hi - pos, n)
        if s < e:
            out.append((a + s, a + e))
        pos += n
        if pos >= hi:
            break
    return out


def _merge(runs: Sequence[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for a, b in runs:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def dim_runs(size: int, steps: tuple[tuple[Placement, int, int], ...]) -> tuple[Run, ...]:
    """Runs of ``range(size)`` held after ``steps`` = ((placement, mesh size, coordinate), ...)
    applied left to right, as DTensor does."""
    runs: list[Run] = [(0, size)] if size else []
    for p, n, k in steps:
        length = sum(b - a for a, b in runs)
        if isinstance(p, StridedShard):
            new: list[Run] = []
            for j in range(p.split_factor):
                a, b = chunk_bounds(length, p.split_factor, j)
                lo, hi = chunk_bounds(b - a, n, k)
                new += _select(runs, a + lo, a + hi)
            runs = new
        else:
            lo, hi = chunk_bounds(length, n, k)
            runs = _select(runs, lo, hi)
    return _merge(runs)


def slices(box: Box) -> tuple[slice, ...]:
    """NumPy/torch index of a box."""
    return tuple(slice(a, b) for a, b in box)


def _len(r: Run) -> int:
    return r[1] - r[0]


# ------------------------------------------------------------------- plans


@dataclass(frozen=True)
class ChunkWrite:
    """A chunk this coordinate writes. ``sources`` = ((source coord, box), ...) cover it;
    a source equal to the writer is a local copy."""

    index: tuple[int, ...]
    box: Box
    sources: tuple[tuple[Coord, Box], ...]


@dataclass(frozen=True)
class Send:
    """Part ``box`` of chunk ``index`` that this coordinate sends to writer ``dst``."""

    index: tuple[int, ...]
    dst: Coord
    box: Box


GROUP_MIN_FRACTION = 16  # cells of at least 1/16 of the group target are not grouped (Appendix C.1)


class Layout:
    """How one global tensor is spread over a mesh; see the module docstring."""

    def __init__(
        self,
        shape: Sequence[int],
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        *,
        key: str = "",
        replica_split_min_elems: int | None = None,
        group_min_elems: int | None = None,
    ) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.mesh_shape = tuple(int(m) for m in mesh_shape)
        if len(placements) != len(self.mesh_shape):
            raise UnsupportedPlacementError(
                f"{len(placements)} placements for a mesh of {len(self.mesh_shape)} dims"
            )
        ndim = len(self.shape)
        norm: list[Placement] = []
        for p in placements:
            if isinstance(p, (Shard, StridedShard)):
                d = p.dim + ndim if p.dim < 0 else p.dim
                if not 0 <= d < ndim:
                    raise UnsupportedPlacementError(
                        f"{p} shards dim {p.dim} of a {ndim}-d tensor of shape {self.shape}"
                    )
                if isinstance(p, StridedShard) and p.split_factor < 1:
                    raise UnsupportedPlacementError(f"{p}: split_factor must be >= 1")
                p = Shard(d) if isinstance(p, Shard) else StridedShard(d, p.split_factor)
            elif not isinstance(p, Replicate):
                raise UnsupportedPlacementError(f"unsupported placement {p!r}")
            norm.append(p)
        self.placements = tuple(norm)
        # mesh dims sharding each tensor dim, in mesh order
        self.sharding: tuple[tuple[int, ...], ...] = tuple(
            tuple(i for i, p in enumerate(self.placements) if not isinstance(p, Replicate) and p.dim == d)
            for d in range(ndim)
        )
        self.replica_dims = tuple(i for i, p in enumerate(self.placements) if isinstance(p, Replicate))
        self.replicas = math.prod(self.mesh_shape[i] for i in self.replica_dims)
        self.key_hash = zlib.crc32(key.encode())
        self.split: tuple[int, int] | None = None  # (dim, factor) of a replica split
        self.chunk_shape, self.aligned = self._grid(replica_split_min_elems)
        # the longest run per dim (one shard when aligned); chunks may group several of them
        self.cell_shape = self.chunk_shape
        if group_min_elems is not None and self.split is None and all(self.aligned) and all(self.shape):
            self.chunk_shape = self._grouped(group_min_elems)
        self.grouped = self.chunk_shape != self.cell_shape
        self.grid_shape = tuple(
            -(-s // c) if s else 0 for s, c in zip(self.shape, self.chunk_shape)
        )

    # ---- index sets ---------------------------------------------------------

    def _steps(self, d: int, coord: Coord) -> tuple[tuple[Placement, int, int], ...]:
        return tuple((self.placements[i], self.mesh_shape[i], coord[i]) for i in self.sharding[d])

    def runs(self, coord: Coord) -> tuple[tuple[Run, ...], ...]:
        """Per tensor dim, the runs held by ``coord``, in local order."""
        return tuple(dim_runs(self.shape[d], self._steps(d, coord)) for d in range(len(self.shape)))

    def local_shape(self, coord: Coord) -> tuple[int, ...]:
        return tuple(sum(map(_len, rs)) for rs in self.runs(coord))

    def check_local_shape(self, shape: tuple[int, ...], coord: Coord, key: str) -> None:
        """Raise if a local tensor's shape is not the one these placements give."""
        if tuple(shape) != self.local_shape(coord):
            from ..errors import StateDictMismatchError

            raise StateDictMismatchError(
                f"tensor {key!r}: local shape {tuple(shape)} at mesh coordinate {coord} differs from "
                f"{self.local_shape(coord)} computed from placements {self.placements}; please report "
                "this layout")

    def local_boxes(self, coord: Coord) -> Iterator[tuple[Box, Box]]:
        """(global box, box in the local tensor) pairs covering what ``coord`` holds."""
        per_dim = []
        for rs in self.runs(coord):
            pos, pairs = 0, []
            for a, b in rs:
                pairs.append(((a, b), (pos, pos + b - a)))
                pos += b - a
            per_dim.append(pairs)
        for combo in itertools.product(*per_dim):
            yield tuple(g for g, _ in combo), tuple(loc for _, loc in combo)

    def to_local(self, coord: Coord, box: Box) -> Box:
        """Where global ``box`` (inside what ``coord`` holds) sits in ``coord``'s local tensor."""
        out = []
        for rs, (s, e) in zip(self.runs(coord), box):
            pos = 0
            for a, b in rs:
                if a <= s and e <= b:
                    out.append((pos + s - a, pos + e - a))
                    break
                pos += b - a
            else:
                raise ValueError(f"box {box} is not held by coordinate {coord}")
        return tuple(out)

    def partition(self, d: int) -> tuple[tuple[Run, tuple[int, ...]], ...]:
        """All runs along tensor dim ``d`` with the sharding-mesh coordinates holding them."""
        cache = self.__dict__.setdefault("_partitions", {})
        if d not in cache:
            cache[d] = _partition(self.shape[d], tuple(
                (self.placements[i], self.mesh_shape[i]) for i in self.sharding[d]))
        return cache[d]

    # ---- chunk grid ---------------------------------------------------------

    def _grid(self, split_min: int | None) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        chunk, aligned = [], []
        for d, size in enumerate(self.shape):
            runs = [r for r, _ in self.partition(d)]
            longest = max((_len(r) for r in runs), default=0)
            c = max(longest, 1)
            chunk.append(c)
            aligned.append(all(a % c == 0 for a, _ in runs))
        if split_min is not None and self.replicas > 1 and all(aligned) and self.shape:
            # Spread a big replicated cell over its replicas: split the longest
            # dim by its largest divisor k <= R so chunks stay on the cell grid.
            if math.prod(chunk) >= split_min:
                d = max(range(len(chunk)), key=lambda i: chunk[i])
                # ... and never below split_min / 8 elements per chunk
                cap = min(self.replicas, math.prod(chunk) // max(split_min // 8, 1))
                k = max((k for k in range(2, cap + 1) if chunk[d] % k == 0), default=1)
                if k > 1:
                    chunk[d] //= k
                    self.split = (d, k)
        return tuple(chunk), tuple(aligned)

    def _grouped(self, want: int) -> tuple[int, ...]:
        """Chunks of whole neighbouring cells (shards), grown along the sharded dims in
        order; along the dim where the slab of cells reaches ``want`` elements, into the
        number of chunks nearest to slab / ``want`` (spec Appendix C.1), so chunks are
        about 0.75-1.5x the target rather than ``want`` plus a short remainder: fewer,
        larger objects for small shards, each still a union of whole shards, so a shard's
        data is one box of one chunk. Cells of at least
        ``want / GROUP_MIN_FRACTION`` elements are objects of a good size already and stay
        one chunk each: grouping them would only move data between ranks."""
        chunk = list(self.cell_shape)
        elems = math.prod(chunk)
        if elems * GROUP_MIN_FRACTION >= want:
            return tuple(chunk)
        for d, cell in enumerate(self.cell_shape):
            if elems >= want:
                break
            if not self.sharding[d]:
                continue  # the cell spans the whole dim already
            cells = -(-self.shape[d] // cell)
            n = max(1, -(-(2 * cells * elems - want) // (2 * want)))  # nearest; ties: fewer
            k = min(self.shape[d] // cell, -(-cells // n))
            if k > 1:
                chunk[d] = cell * k
                elems *= k
            if n > 1:
                break  # d is cut: growing another dim would only make chunks larger
        return tuple(chunk)

    def chunk_box(self, index: Sequence[int]) -> Box:
        return tuple(
            (i * c, min((i + 1) * c, s)) for i, c, s in zip(index, self.chunk_shape, self.shape)
        )

    def _pick(self, index: Sequence[int]) -> int:
        """Replica choice key of a chunk: ``crc32(key) + L`` where ``L`` is the C-order
        linear index of the chunk's cell in the cell grid, times the split factor ``k``,
        plus the chunk's position inside its cell along the split dim (spec §8). Chunks
        of one split cell thus go to ``k`` different replicas."""
        d, k = self.split if self.split else (-1, 1)
        lin = 0
        for dim, (i, g) in enumerate(zip(index, self.grid_shape)):
            if dim == d:
                i, g = i // k, -(-g // k)
            lin = lin * g + i
        return self.key_hash + lin * k + (index[d] % k if k > 1 else 0)

    def _replica(self, sharded: dict[int, int], pick: int) -> Coord:
        """The coordinate of replica ``pick % R`` of the cell fixed by ``sharded`` mesh coords."""
        coord = [0] * len(self.mesh_shape)
        for i, v in sharded.items():
            coord[i] = v
        r = pick % self.replicas
        for i in reversed(self.replica_dims):
            coord[i] = r % self.mesh_shape[i]
            r //= self.mesh_shape[i]
        return tuple(coord)

    def _starts(self, d: int) -> list[int]:
        cache = self.__dict__.setdefault("_run_starts", {})
        if d not in cache:
            cache[d] = [r[0] for r, _ in self.partition(d)]
        return cache[d]

    def _pieces(self, d: int, lo: int, hi: int) -> list[tuple[Run, tuple[int, ...]]]:
        part = self.partition(d)
        starts = self._starts(d)
        i = max(_bisect_right(starts, lo) - 1, 0)
        if self.grouped:  # chunk bounds are cell bounds: the runs lie wholly inside
            return [p for p in part[i:_bisect_left(starts, hi)] if p[0][0] < p[0][1]]
        out = []
        while i < len(part) and part[i][0][0] < hi:
            (a, b), who = part[i]
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append(((s, e), who))
            i += 1
        return out

    def _sharded_coords(self, combo) -> dict[int, int]:
        """The sharding mesh coordinates of the cell of one piece per dimension."""
        out: dict[int, int] = {}
        for d, (_, who) in enumerate(combo):
            out.update(zip(self.sharding[d], who))
        return out

    def _writer(self, pieces_per_dim: list, pick: int) -> Coord:
        """The writer of a chunk: replica ``pick`` of the cell of its main pieces (C.4)."""
        if self.grouped:  # equal cells: the writer rotates among them, by chunk and key
            main = [_rotate(ps, pick) for ps in pieces_per_dim]
        else:
            main = [max(ps, key=lambda p: _len(p[0])) for ps in pieces_per_dim]
        return self._replica(self._sharded_coords(main), pick)

    def _source(self, combo, writer: Coord, pick: int) -> Coord:
        """Who provides one piece of a chunk: the writer if it holds it, else replica ``pick``."""
        sc = self._sharded_coords(combo)
        return writer if all(writer[i] == v for i, v in sc.items()) else self._replica(sc, pick)

    def _chunk_writer(self, index: tuple[int, ...]) -> tuple[Box, list, int, Coord]:
        """(box, pieces per dim, pick, writer) of chunk ``index``; no per-piece work."""
        box = self.chunk_box(index)
        pieces_per_dim = [self._pieces(d, lo, hi) for d, (lo, hi) in enumerate(box)]
        pick = self._pick(index)
        return box, pieces_per_dim, pick, self._writer(pieces_per_dim, pick)

    def metadata_writer(self) -> Coord:
        """The coordinate that writes the array's ``zarr.json``: the writer of chunk 0."""
        if any(s == 0 for s in self.shape):
            return self._replica({i: 0 for dims in self.sharding for i in dims}, self.key_hash)
        return self._chunk_writer(tuple(0 for _ in self.shape))[3]

    def _chunks_touching(self, coord: Coord) -> Iterator[tuple[int, ...]]:
        per_dim = []
        for d, rs in enumerate(self.runs(coord)):
            c = self.chunk_shape[d]
            idx = sorted({i for a, b in rs for i in range(a // c, -(-b // c))})
            per_dim.append(idx)
        return itertools.product(*per_dim)

    def _own_pieces(self, coord: Coord, d: int, pieces: list, lo: int, hi: int) -> list:
        """The pieces of one chunk along ``d`` that ``coord`` holds (its own runs there)."""
        who = tuple(coord[i] for i in self.sharding[d])
        if self.grouped:
            return [((a, b), who) for a, b in self.runs(coord)[d] if lo <= a < hi and a < b]
        return [p for p in pieces if p[1] == who]

    def save_plan(self, coord: Coord) -> tuple[list[ChunkWrite], list[Send]]:
        """What ``coord`` writes and what it sends to other writers.

        Only chunks that touch the coordinate's own data are visited, so the cost
        is proportional to the local shard, not to the mesh.
        """
        writes: list[ChunkWrite] = []
        sends: list[Send] = []
        if any(s == 0 for s in self.shape):
            return writes, sends
        for index in self._chunks_touching(coord):
            box, pieces_per_dim, pick, writer = self._chunk_writer(index)
            if writer == coord:
                sources = tuple((self._source(combo, writer, pick), tuple(r for r, _ in combo))
                                for combo in itertools.product(*pieces_per_dim))
                writes.append(ChunkWrite(index, box, sources))
                continue
            # a sender visits only the pieces of its own cell (a grouped chunk has many)
            mine = [self._own_pieces(coord, d, ps, lo, hi) for d, (ps, (lo, hi)) in enumerate(zip(pieces_per_dim, box))]
            for combo in itertools.product(*mine):
                if self._source(combo, writer, pick) == coord:
                    sends.append(Send(index, writer, tuple(r for r, _ in combo)))
        return writes, sends


def _rotate(pieces: list[tuple[Run, tuple[int, ...]]], pick: int) -> tuple[Run, tuple[int, ...]]:
    """Of the longest pieces, the one at ``pick`` modulo their number. In an aligned layout
    every run but the last of a dimension has the longest length, so the short ones (at
    most the last) come last."""
    longest = _len(pieces[0][0])
    n = len(pieces)
    while _len(pieces[n - 1][0]) != longest:
        n -= 1
    return pieces[pick % n]


@functools.lru_cache(maxsize=4096)
def _partition(size: int, dims: tuple[tuple[Placement, int], ...]) -> tuple[tuple[Run, tuple[int, ...]], ...]:
    out = []
    for who in itertools.product(*(range(n) for _, n in dims)):
        steps = tuple((p, n, k) for (p, n), k in zip(dims, who))
        out.extend((r, who) for r in dim_runs(size, steps))
    out.sort()
    return tuple(out)


def _bisect_right(a: list[int], x: int) -> int:
    import bisect

    return bisect.bisect_right(a, x)


def _bisect_left(a: list[int], x: int) -> int:
    import bisect

    return bisect.bisect_left(a, x)


def piece_shape(shape: Sequence[int], itemsize: int, budget: int) -> tuple[int, ...]:
    """The largest box of at most ``budget`` bytes (at least one element) that is contiguous
    in C order: ``(1, ..., 1, k, s_{d+1}, ..., s_{n-1})``. Every extent is in
    ``1..max(s, 1)``, so it is also a valid Zarr chunk shape."""
    elems = max(1, budget // max(itemsize, 1))
    out = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        s = max(int(shape[d]), 1)
        if acc * s <= elems:
            out[d] = s
            acc *= s
        else:
            out[d] = max(1, elems // acc)
            break
    return tuple(out)


def piece_boxes(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """``(start, box)`` of every chunk of the grid, in C order (none if the array is empty)."""
    shape = tuple(shape)
    if not all(shape):
        return
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    for index in itertools.product(*map(range, grid)):
        start = tuple(i * c for i, c in zip(index, chunk))
        yield start, tuple((a, min(a + c, s)) for a, c, s in zip(start, chunk, shape))


def unit_elements(box: Box, unit: Sequence[int], shape: Sequence[int]) -> int:
    """Elements of the read units (inner chunks, else chunks, of extent ``unit``, cut at the
    array's ``shape``) that ``box`` touches: what a reader fetches to read ``box``."""
    n = 1
    for (a, b), u, size in zip(box, unit, shape):
        n *= min(-(-b // u) * u, size) - (a // u) * u
    return n
