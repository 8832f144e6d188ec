"""zarrckpt.format.layout: index sets vs torch's DTensor sharding, cells/replicas, chunk grid, save plans.

torch's result is computed without process groups: each mesh dim's placement is applied left to
right with ``Shard._split_tensor`` / ``_StridedShard._split_tensor`` to an index tensor
(``arange(numel).reshape(shape)``), exactly as DTensor's ``distribute_tensor`` cuts the local
shard of one rank.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard as TStridedShard

from zarrckpt.errors import UnsupportedPlacementError
from zarrckpt.format.layout import (
    ChunkWrite,
    Layout,
    Replicate,
    Send,
    Shard,
    StridedShard,
    chunk_bounds,
    dim_runs,
    placement_from_json,
    placement_to_json,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- helpers


def coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def index_array(shape) -> np.ndarray:
    return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)


def runs_index(runs) -> np.ndarray:
    """The global indices along one dim, in local order, held by ``runs``."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs])


def gather(glob: np.ndarray, runs_per_dim) -> np.ndarray:
    """``glob[runs]``: the local tensor made of the per-dim runs (np.ix_ style)."""
    if not runs_per_dim:
        return glob[()]
    return glob[np.ix_(*(runs_index(rs) for rs in runs_per_dim))]


def box_slices(box):
    return tuple(slice(a, b) for a, b in box)


def box_size(box) -> int:
    return math.prod(b - a for a, b in box)


def torch_local(shape, mesh_shape, placements, coord) -> np.ndarray:
    """The local tensor of ``coord`` as torch's DTensor placements cut it (no process groups)."""
    ndim = len(shape)
    t = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    for p, n, k in zip(placements, mesh_shape, coord):
        if isinstance(p, Shard):
            shards, _ = TShard(p.dim % ndim)._split_tensor(t, n, with_padding=False)
            t = shards[k]
        elif isinstance(p, StridedShard):
            shards, _ = TStridedShard(p.dim % ndim, split_factor=p.split_factor)._split_tensor(
                t, n, with_padding=False
            )
            t = shards[k]
    return t.numpy()


# --------------------------------------------------------------------------- strategies


@st.composite
def layout_args(draw, max_size: int = 40):
    ndim = draw(st.integers(0, 3))
    shape = tuple(
        draw(st.one_of(st.integers(0, max_size), st.sampled_from([0, 1, 2, 3, 7, 8, 9, 12, 17])))
        for _ in range(ndim)
    )
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    choices = [st.just(Replicate())]
    if ndim:
        dims = st.integers(-ndim, ndim - 1)  # negative dims normalise like torch's
        choices += [
            st.builds(Shard, dims),
            st.builds(StridedShard, dims, st.integers(1, 3)),
            # bias towards several mesh dims sharding the same tensor dim
            st.builds(Shard, st.just(0)),
            st.builds(StridedShard, st.just(0), st.integers(1, 3)),
        ]
    placements = tuple(draw(st.one_of(*choices)) for _ in mesh_shape)
    key = draw(st.sampled_from(["", "w", "model.layers.0.weight", "optim/state/3/exp_avg"]))
    split_min = draw(st.one_of(st.none(), st.integers(1, 64)))
    return shape, mesh_shape, placements, key, split_min


def make(args) -> Layout:
    shape, mesh_shape, placements, key, split_min = args
    return Layout(shape, mesh_shape, placements, key=key, replica_split_min_elems=split_min)


def collect_plans(lay: Layout):
    """Every coordinate's save plan: ({chunk index: (writer, ChunkWrite)}, [(sender, Send)])."""
    writes: dict[tuple, list[tuple[tuple, ChunkWrite]]] = {}
    sends: list[tuple[tuple, Send]] = []
    for c in coords(lay.mesh_shape):
        w, s = lay.save_plan(c)
        for cw in w:
            assert isinstance(cw, ChunkWrite)
            writes.setdefault(cw.index, []).append((c, cw))
        for sd in s:
            assert isinstance(sd, Send)
            sends.append((c, sd))
    return writes, sends


# ----------------------------------------------------------- 1. agreement with torch


@SETTINGS
@given(layout_args())
def test_runs_agree_with_torch(args):
    shape, mesh_shape, placements, _, _ = args
    lay = make(args)
    glob = index_array(shape)
    for c in coords(mesh_shape):
        expected = torch_local(shape, mesh_shape, placements, c)
        got = gather(glob, lay.runs(c))
        assert got.shape == expected.shape, (c, lay.runs(c))
        np.testing.assert_array_equal(got, expected, err_msg=f"coord {c} runs {lay.runs(c)}")
        assert lay.local_shape(c) == tuple(expected.shape)
        for rs in lay.runs(c):  # runs are non-empty, in range, and merged
            for (a, b), nxt in zip(rs, rs[1:] + ((None, None),)):
                assert 0 <= a < b
                assert nxt[0] != b


def test_chunk_bounds_is_torch_chunk():
    for length in range(0, 30):
        for n in range(1, 7):
            pieces = TShard(0)._split_tensor(torch.arange(length), n, with_padding=False)[0]
            for k in range(n):
                a, b = chunk_bounds(length, n, k)
                assert pieces[k].tolist() == list(range(a, b))


# ------------------------------------------------------ 2. partition, cells, replicas


@SETTINGS
@given(layout_args())
def test_runs_partition_each_dim_and_replicas(args):
    shape, mesh_shape, placements, _, _ = args
    lay = make(args)
    cs = coords(mesh_shape)

    for d, size in enumerate(shape):
        part = lay.partition(d)
        runs = [r for r, _ in part]
        # disjoint, sorted, no gaps, cover [0, size)
        pos = 0
        for a, b in runs:
            assert a == pos and b > a
            pos = b
        assert pos == size
        # what each coordinate holds along d is in the partition, tagged with its sharding coords
        tagged = set(part)
        from_coords = set()
        for c in cs:
            who = tuple(c[i] for i in lay.sharding[d])
            for r in lay.runs(c)[d]:
                assert (r, who) in tagged
                from_coords.add((r, who))
        assert from_coords == tagged

    # every cell is held by exactly `replicas` coordinates ...
    replica_dims = [i for i, p in enumerate(lay.placements) if isinstance(p, Replicate)]
    assert lay.replicas == math.prod(mesh_shape[i] for i in replica_dims)
    count = np.zeros(shape, dtype=np.int64)
    for c in cs:
        if any(not rs for rs in lay.runs(c)):
            continue
        count[np.ix_(*(runs_index(rs) for rs in lay.runs(c)))] += 1
    if count.size:
        assert (count == lay.replicas).all()

    # ... and the coordinates holding the same (non-empty) cell are exactly the replicas:
    # those that agree on every mesh dim that is not Replicate.
    def cell_of(c):
        return tuple(c[i] for i in range(len(mesh_shape)) if i not in replica_dims)

    holders: dict[tuple, set] = {}
    for c in cs:
        if math.prod(lay.local_shape(c)) == 0:
            continue
        holders.setdefault(lay.runs(c), set()).add(c)
    for cell, who in holders.items():
        assert len(who) == lay.replicas
        assert len({cell_of(c) for c in who}) == 1
        (one,) = {cell_of(c) for c in who}
        assert who == {c for c in cs if cell_of(c) == one}


# ---------------------------------------------------------------------------- 3. chunks


def check_plan(lay: Layout) -> tuple[dict, list]:
    shape = lay.shape
    numel = math.prod(shape)
    glob = index_array(shape)
    writes, sends = collect_plans(lay)

    # the grid covers the tensor
    assert len(lay.chunk_shape) == len(lay.grid_shape) == len(shape)
    for s, c, g in zip(shape, lay.chunk_shape, lay.grid_shape):
        assert c >= 1
        assert g == -(-s // c)
    grid = list(itertools.product(*(range(g) for g in lay.grid_shape)))
    cover = np.zeros(shape, dtype=np.int64)
    for idx in grid:
        cover[box_slices(lay.chunk_box(idx))] += 1
    assert (cover == 1).all()

    if numel == 0:
        assert not writes and not sends
        return writes, sends

    # every chunk is written by exactly one coordinate
    assert set(writes) == set(grid)
    for idx, ws in writes.items():
        assert len(ws) == 1, f"chunk {idx} written by {[c for c, _ in ws]}"

    expected_sends = Counter()
    total = 0
    for idx, [(writer, cw)] in writes.items():
        assert cw.box == lay.chunk_box(idx)
        total += box_size(cw.box)
        # sources partition the chunk
        seen = np.zeros(shape, dtype=np.int64)
        for src, box in cw.sources:
            assert box_size(box) > 0
            for (a, b), (lo, hi) in zip(box, cw.box):
                assert lo <= a < b <= hi
            seen[box_slices(box)] += 1
            # the source holds the box: its local tensor has the right values there
            loc = lay.to_local(src, box)
            local = gather(glob, lay.runs(src))
            np.testing.assert_array_equal(local[box_slices(loc)], glob[box_slices(box)])
            if src != writer:
                expected_sends[(src, idx, writer, box)] += 1
        inside = seen[box_slices(cw.box)]
        assert (inside == 1).all() and seen.sum() == inside.size
        if all(lay.aligned):
            assert all(src == writer for src, _ in cw.sources)

    # non-local pieces and Sends match 1:1
    actual_sends = Counter((c, s.index, s.dst, s.box) for c, s in sends)
    assert actual_sends == expected_sends
    assert all(c != s.dst for c, s in sends)
    if all(lay.aligned):
        assert not sends
    # replicated data is written once
    assert total == numel
    return writes, sends


@SETTINGS
@given(layout_args())
def test_save_plan(args):
    check_plan(make(args))


@settings(max_examples=150, deadline=None)
@given(layout_args(max_size=12), st.integers(1, 4))
def test_replica_split_stays_valid(args, extra):
    """Big replicated cells split over replicas: plans stay valid, chunks stay inside cells."""
    shape, mesh_shape, placements, key, _ = args
    mesh_shape = mesh_shape + (extra,)
    placements = placements + (Replicate(),)
    lay = Layout(shape, mesh_shape, placements, key=key, replica_split_min_elems=1)
    plain = Layout(shape, mesh_shape, placements, key=key)
    for c, p in zip(lay.chunk_shape, plain.chunk_shape):
        assert p % c == 0
    writes, _ = check_plan(lay)
    # the k chunks of a split cell go to k different replicas (k <= R)
    split = [d for d, (c, p) in enumerate(zip(lay.chunk_shape, plain.chunk_shape)) if c != p]
    assert len(split) <= 1
    if split:
        (d,) = split
        k = plain.chunk_shape[d] // lay.chunk_shape[d]
        assert 2 <= k <= lay.replicas
        by_cell: dict[tuple, list] = {}
        for idx, [(writer, _)] in writes.items():
            cell = idx[:d] + (idx[d] // k,) + idx[d + 1 :]
            by_cell.setdefault(cell, []).append(writer)
        for cell, writers in by_cell.items():
            assert len(set(writers)) == len(writers), (cell, writers)


# ------------------------------------------------------------------------ 4. local boxes


@SETTINGS
@given(layout_args())
def test_local_boxes(args):
    shape, mesh_shape, placements, _, _ = args
    lay = make(args)
    glob = index_array(shape)
    for c in coords(mesh_shape):
        local = torch_local(shape, mesh_shape, placements, c)
        assert tuple(local.shape) == lay.local_shape(c)
        cover = np.zeros(lay.local_shape(c), dtype=np.int64)
        n = 0
        for gbox, lbox in lay.local_boxes(c):
            n += 1
            assert [b - a for a, b in gbox] == [b - a for a, b in lbox]
            cover[box_slices(lbox)] += 1
            np.testing.assert_array_equal(local[box_slices(lbox)], glob[box_slices(gbox)])
            assert lay.to_local(c, gbox) == lbox
        assert (cover == 1).all()
        if math.prod(lay.local_shape(c)) == 0:
            assert n == 0


def test_to_local_rejects_foreign_box():
    lay = Layout((8,), (2,), [Shard(0)])
    assert lay.to_local((1,), ((5, 7),)) == ((1, 3),)
    with pytest.raises(ValueError):
        lay.to_local((0,), ((3, 5),))  # straddles the two shards
    with pytest.raises(ValueError):
        lay.to_local((0,), ((5, 6),))


# -------------------------------------------------------------------- 5. specific cases


def test_nested_uneven_shard_4097_rows():
    lay = Layout((4097, 16), (2, 2), [Shard(0), Shard(0)], key="w")
    assert lay.chunk_shape == (1025, 16)  # not the gcd grid (1-row chunks)
    assert lay.aligned == (False, True)
    assert [lay.local_shape(c)[0] for c in coords((2, 2))] == [1025, 1024, 1024, 1024]
    writes, sends = check_plan(lay)
    assert len(writes) == 4  # ceil(4097 / 1025)
    assert sends  # boundary rows move to the chunk's writer
    # only boundary rows move: far fewer than the tensor
    assert sum(box_size(s.box) for _, s in sends) < 4097 * 16 // 4


def test_fsdp2_over_tp_docstring_example():
    lay = Layout((8, 8), (2, 2), [StridedShard(0, 2), Shard(0)])
    assert lay.runs((0, 0))[0] == ((0, 2),)
    assert lay.runs((0, 1))[0] == ((4, 6),)  # rank 1: rows 4-5
    assert lay.runs((1, 0))[0] == ((2, 4),)
    assert lay.runs((1, 1))[0] == ((6, 8),)
    assert all(lay.runs(c)[1] == ((0, 8),) for c in coords((2, 2)))
    for c in coords((2, 2)):
        np.testing.assert_array_equal(
            gather(index_array((8, 8)), lay.runs(c)),
            torch_local((8, 8), (2, 2), lay.placements, c),
        )
    check_plan(lay)


def test_strided_shard_multiple_runs():
    # FSDP(2) over TP(3): coordinate (f, t) holds half f of TP shard t
    lay = Layout((12,), (2, 3), [StridedShard(0, 3), Shard(0)])
    for f, t in coords((2, 3)):
        assert lay.runs((f, t)) == (((4 * t + 2 * f, 4 * t + 2 * f + 2),),)
    # the strided placement alone: one run per split
    alone = Layout((12,), (2,), [StridedShard(0, 3)])
    assert alone.runs((1,)) == (((2, 4), (6, 8), (10, 12)),)
    assert alone.local_shape((1,)) == (6,)
    for lay_ in (lay, alone):
        for c in coords(lay_.mesh_shape):
            np.testing.assert_array_equal(
                gather(index_array((12,)), lay_.runs(c)),
                torch_local((12,), lay_.mesh_shape, lay_.placements, c),
            )
        check_plan(lay_)


def test_hsdp_spreads_writers_over_replicas():
    mesh, placements = (4, 2), [Replicate(), Shard(0)]
    replica_of_writer = []
    for i in range(16):
        lay = Layout((64, 8), mesh, placements, key=f"model.layers.{i}.weight")
        writes, _ = check_plan(lay)
        assert len(writes) == 2
        replica_of_writer += [w[0] for [(w, _)] in writes.values()]
    counts = Counter(replica_of_writer)
    assert len(counts) == 4, counts  # every replica writes something
    assert max(counts.values()) <= 2 * min(counts.values())


def test_zero_dim_replicated():
    lay = Layout((), (4,), [Replicate()], key="step")
    assert lay.chunk_shape == () and lay.grid_shape == ()
    assert lay.local_shape((2,)) == ()
    writes, sends = check_plan(lay)
    assert list(writes) == [()]
    assert not sends
    assert sum(len(lay.save_plan(c)[0]) for c in coords((4,))) == 1


def test_big_replicated_tensor_split_across_replicas():
    lay = Layout((1024, 1024), (4,), [Replicate()], key="emb", replica_split_min_elems=1 << 16)
    assert lay.chunk_shape == (256, 1024)
    writes, sends = check_plan(lay)
    assert not sends
    assert sorted(w for [(w, _)] in writes.values()) == [(0,), (1,), (2,), (3,)]
    # without the option it is one chunk, written once
    plain = Layout((1024, 1024), (4,), [Replicate()], key="emb")
    assert plain.chunk_shape == (1024, 1024)
    assert len(check_plan(plain)[0]) == 1
    # below the threshold it is not split
    small = Layout((1024, 1024), (4,), [Replicate()], key="emb", replica_split_min_elems=1 << 21)
    assert small.chunk_shape == (1024, 1024)


def test_split_cell_spreads_over_all_replicas_with_sharded_inner_dim():
    # HSDP-style: 4 replicas x 2 shards of dim 1; each (1024, 512) cell is split in 4 along dim 0.
    lay = Layout(
        (1024, 1024), (4, 2), [Replicate(), Shard(1)], key="emb", replica_split_min_elems=1 << 16
    )
    assert lay.chunk_shape == (256, 512)
    writes, _ = check_plan(lay)
    for j in range(2):  # cell j along dim 1
        writers = {writes[(i, j)][0][0] for i in range(4)}
        assert len(writers) == 4, f"cell {j}: 4 sub-chunks written by only {sorted(writers)}"


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (3, 0, 2)])
@pytest.mark.parametrize(
    "mesh,placements",
    [
        ((2,), [Shard(0)]),
        ((2, 2), [Shard(0), Shard(0)]),
        ((2, 2), [Replicate(), Shard(-1)]),
        ((3,), [Replicate()]),
        ((2, 2), [StridedShard(0, 2), Shard(0)]),
    ],
)
def test_empty_tensor_has_no_writes(shape, mesh, placements):
    lay = Layout(shape, mesh, placements, key="e")
    for c in coords(mesh):
        assert lay.save_plan(c) == ([], [])
        assert math.prod(lay.local_shape(c)) == 0
    check_plan(lay)


def test_dim_runs_examples():
    assert dim_runs(10, ()) == ((0, 10),)
    assert dim_runs(0, ((Shard(0), 2, 1),)) == ()
    assert dim_runs(10, ((Shard(0), 4, 3),)) == ((9, 10),)
    assert dim_runs(5, ((Shard(0), 4, 3),)) == ()  # torch.chunk: pieces of 2 -> 2, 2, 1, empty
    assert dim_runs(8, ((StridedShard(0, 2), 2, 1),)) == ((2, 4), (6, 8))


# ------------------------------------------------------------------ 6. placements as JSON


@given(
    st.one_of(
        st.just(Replicate()),
        st.builds(Shard, st.integers(0, 7)),
        st.builds(StridedShard, st.integers(0, 7), st.integers(1, 16)),
    )
)
@settings(max_examples=50, deadline=None)
def test_placement_json_round_trip(p):
    import json

    j = placement_to_json(p)
    assert json.loads(json.dumps(j)) == j
    assert placement_from_json(j) == p
    assert type(placement_from_json(j)) is type(p)


def test_placement_json_forms():
    assert placement_to_json(Shard(1)) == {"type": "shard", "dim": 1}
    assert placement_to_json(StridedShard(0, 2)) == {
        "type": "strided_shard",
        "dim": 0,
        "split_factor": 2,
    }
    assert placement_to_json(Replicate()) == {"type": "replicate"}


@pytest.mark.parametrize(
    "bad", [{"type": "partial"}, {"type": "Shard", "dim": 0}, {}, {"dim": 0}, "shard", None, []]
)
def test_unknown_placement_json_raises(bad):
    with pytest.raises(UnsupportedPlacementError):
        placement_from_json(bad)


def test_unsupported_placements_raise():
    from torch.distributed.tensor.placement_types import Partial

    for p in [Partial(), "replicate", object(), TShard(0)]:
        with pytest.raises(UnsupportedPlacementError):
            Layout((4,), (2,), [p])
    # UnsupportedPlacementError is a ValueError
    with pytest.raises(ValueError):
        Layout((4,), (2,), [Partial()])


@pytest.mark.parametrize(
    "shape,placement",
    [
        ((4,), Shard(1)),
        ((4,), Shard(-2)),
        ((4, 4), Shard(2)),
        ((), Shard(0)),
        ((4,), StridedShard(1, 2)),
        ((4,), StridedShard(-2, 2)),
        ((4,), StridedShard(0, 0)),
    ],
)
def test_bad_shard_dim_raises(shape, placement):
    with pytest.raises(UnsupportedPlacementError):
        Layout(shape, (2,), [placement])


def test_negative_dims_normalise_and_placement_count_checked():
    lay = Layout((4, 6), (2, 3), [Shard(-1), StridedShard(-2, 2)])
    assert lay.placements == (Shard(1), StridedShard(0, 2))
    with pytest.raises(UnsupportedPlacementError):
        Layout((4,), (2, 2), [Shard(0)])


# ------------------------------------------------------------------------------ scale


def test_scale_plan_is_local():
    lay = Layout((8192 * 4, 1024), (1024, 8), [Shard(0), Shard(1)], key="big")
    t0 = time.perf_counter()
    writes, sends = lay.save_plan((517, 5))
    elapsed = time.perf_counter() - t0
    assert sends == []
    assert len(writes) == 1
    (cw,) = writes
    assert cw.index == (517, 5)
    assert cw.box == ((517 * 32, 518 * 32), (640, 768))
    assert cw.sources == (((517, 5), cw.box),)
    assert lay.chunk_shape == (32, 128) and all(lay.aligned)
    assert elapsed < 5.0  # generous: proves it does not walk the mesh per chunk


def test_scale_plan_is_local_uneven_nested():
    lay = Layout((8192 * 4 + 1, 1024), (1024, 8), [Shard(0), Shard(0)], key="big")
    assert lay.aligned == (False, True)
    writes, sends = lay.save_plan((517, 5))
    assert len(writes) <= 2 and len(sends) <= 2
    assert writes or sends
