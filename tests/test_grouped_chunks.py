"""Chunks that group whole shards (``chunk_target_bytes``; spec Appendix C.1, issue 16 item 1):
the layout's invariants for any mesh and placements, and a 4-rank save whose small shards are
gathered into few objects, loaded bit-exact on other meshes reading only what it needs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _grouped
import zarrckpt
from zarrckpt.format import documents as fmt
from zarrckpt.format import dtypes
from zarrckpt.format.layout import Layout, Replicate, Shard, StridedShard


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["shard", "replicate", "strided"]))
        d = draw(st.integers(0, ndim - 1))
        placements.append(Shard(d) if kind == "shard" else Replicate() if kind == "replicate"
                          else StridedShard(d, draw(st.integers(1, 3))))
    want = draw(st.integers(1, 2 * math.prod(shape)))
    return Layout(shape, mesh, placements, key=draw(st.text(max_size=5)), group_min_elems=want), want


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_grouped_chunks_are_unions_of_whole_cells_with_one_writer(case):
    lay, want = case
    coords = list(itertools.product(*map(range, lay.mesh_shape)))
    if lay.grouped:  # chunks only ever group (aligned grids, no replica split)
        for c, cell, s in zip(lay.chunk_shape, lay.cell_shape, lay.shape):
            assert c % cell == 0 and c <= s
        full = all(c + cell > s for d, (c, cell, s) in enumerate(zip(lay.chunk_shape, lay.cell_shape, lay.shape))
                   if lay.sharding[d])  # no sharded dim fits another whole cell
        elems = math.prod(lay.chunk_shape)
        assert 2 * elems >= want or full  # grown to the target (nearest count of chunks) ...
        assert lay.chunk_shape == lay.cell_shape or 2 * elems < 5 * want  # ... and not far past it
    writers: dict = {}
    sent: set = set()
    for coord in coords:
        writes, sends = lay.save_plan(coord)
        for w in writes:
            assert w.index not in writers, "two writers for one chunk"
            writers[w.index] = (coord, w)
        sent |= {(s.index, coord, s.box) for s in sends}
    assert set(writers) == set(itertools.product(*map(range, lay.grid_shape)))
    received = set()
    for index, (coord, w) in writers.items():
        assert w.box == lay.chunk_box(index)
        covered = sum(math.prod(b - a for a, b in box) for _, box in w.sources)
        assert covered == math.prod(b - a for a, b in w.box)  # sources tile the chunk
        received |= {(index, src, box) for src, box in w.sources if src != coord}
    assert received == sent  # every piece a writer waits for is sent, once


def test_writers_of_grouped_chunks_rotate_over_the_ranks():
    """1,000 small arrays on 64 ranks, one chunk each: the writing spreads (no rank 0 hot spot)."""
    counts = np.zeros(64, int)
    for i in range(1000):
        lay = Layout((64 * 8, 16), (64,), (Shard(0),), key=f"layers.{i}.w", group_min_elems=1 << 20)
        assert lay.grid_shape == (1, 1)
        counts[lay.metadata_writer()[0]] += 1
    assert counts.max() <= 3 * 1000 / 64


def test_inner_chunks_lie_within_one_shard():
    lay = Layout((4096, 1024), (8,), (Shard(0),), group_min_elems=(64 << 20) // 4)
    doc = fmt.array_metadata(shape=lay.shape, dtype=dtypes.by_zarr("float32"), chunk_shape=lay.chunk_shape,
                             attrs={}, dimension_names=["a", "b"], cell_shape=lay.cell_shape)
    inner = doc["codecs"][0]["configuration"]["chunk_shape"]
    assert lay.chunk_shape == (4096, 1024) and lay.cell_shape == (512, 1024)
    assert all(c % i == 0 for c, i in zip(lay.cell_shape, inner))


def test_objects_at_1024_ranks_grow_as_arrays_not_arrays_times_ranks():
    """The planning code for one rank of 1,024, on a Llama-3-70B-shaped state (FSDP
    Shard(0), fp32 params + AdamW moments): chunk objects with and without grouping."""
    d, ff, layers, vocab, ranks = 8192, 28672, 80, 128256, 1024
    params = [(vocab, d), (vocab, d), (d,)]
    for _ in range(layers):
        params += [(d, d), (1024, d), (1024, d), (d, d), (ff, d), (ff, d), (d, ff), (d,), (d,)]
    shapes = params * 3  # param, exp_avg, exp_avg_sq

    def objects(target):
        total = 0
        for shape in set(shapes):
            lay = Layout(shape, (ranks,), (Shard(0),),
                         group_min_elems=None if target is None else target // 4)
            total += math.prod(lay.grid_shape) * shapes.count(shape)
        return total

    plain, grouped = objects(None), objects(64 << 20)
    assert len(shapes) == 2169
    assert plain > 2_000_000  # ~ arrays x ranks
    assert grouped < 20_000  # ~ arrays + bytes / 64 MiB
    total_bytes = sum(math.prod(s) * 4 for s in shapes)
    assert grouped <= len(shapes) + 2 * total_bytes // (64 << 20)
    # the default target (256 MiB): chunks + one zarr.json per array (+ a few groups and the
    # root) within the bound 2 x (arrays + ranks); chunks along the cut dim are the
    # nearest count to slab / target, ties to fewer: a 939 MB weight is 3 objects, not 4
    documents = len(shapes) + 1 + 5
    assert objects(256 << 20) + documents <= 2 * (len(shapes) + ranks)
    w1 = Layout((ff, d), (ranks,), (Shard(0),), group_min_elems=(256 << 20) // 4)
    assert w1.grid_shape == (3, 1)


@pytest.mark.slow
def test_four_ranks_save_grouped_chunks_and_load_on_other_meshes(tmp_path, clusters):
    c = clusters(4)
    path = str(tmp_path / "c")
    files = c.run(_grouped.save, path)[0]
    assert files["model/emb"] == ["c/0/0"]  # four 512 KiB shards: one object
    assert files["model/w"] == ["c/0/0", "c/1/0"]  # three whole 1025-row shards, then the last
    assert files["model/tp"] == ["c/0/0"]  # 2x2 shards of 256 KiB: grouped along dim 0, then dim 1
    assert len(files["model/big"]) == 4  # 2 MiB shards are objects of a good size alone
    assert files["model/bias"] == ["c/0"]
    same = c.run(_grouped.load_and_compare, path, "save")  # compares every element on every rank
    for r in same:  # a rank reads its own shards out of the grouped chunks, nothing more
        assert r["fetched"] == r["needed"], r
    plain = str(tmp_path / "plain")
    c.run(_grouped.save, plain, None)
    grouped, ungrouped = (c.run(_grouped.load_and_compare, p) for p in (path, plain))
    for g, u in zip(grouped, ungrouped):  # on other layouts, no more than one chunk per shard reads
        assert g["needed"] == u["needed"] and g["fetched"] <= 1.05 * u["fetched"], (g, u)
    ck = zarrckpt.open(path)
    assert ck["model/emb"].chunks == (2048, 256)
    assert all(s % i == 0 for s, i in zip((512, 256), ck["model/emb"].inner_chunks))


@pytest.mark.slow
def test_eight_ranks_of_small_shards_make_few_files_and_read_one_document(tmp_path, clusters):
    """8 ranks with the default options, 40 DTensors of 8 KiB shards and 10 small plain
    tensors: one chunk file per array (not 8 per DTensor, no hidden packs), files within
    2 x (arrays + ranks), and a load on every rank reads one metadata document, the root."""
    c = clusters(8)
    out = c.run(_grouped.many_small, str(tmp_path / "c"))
    arrays = _grouped.N_SMALL + _grouped.N_PLAIN
    assert out[0]["chunk_files"] == arrays  # 8 shards of 8 KiB per DTensor: one 64 KiB chunk
    assert out[0]["files"] <= 2 * (arrays + 8)  # chunks, array zarr.json, groups, root
    for rank, r in enumerate(out):
        assert r["documents_read"] == ["zarr.json"], (rank, r["documents_read"])
        # metadata calls: the root, then each chunk file read opened once (without blocking)
        # and checked by fstat on its descriptor (spec §3.2): no stat of a chunk path, no
        # array zarr.json, no chunk directory walk
        chunks = [s for s in r["opened"] if "/c/" in s]
        assert len(chunks) == arrays and len(set(chunks)) == arrays, (rank, r["opened"])
        assert not [s for s in r["stats"] if "/c/" in s], (rank, r["stats"])
        assert set(r["stats"]) <= {".", "zarr.json"}, (rank, r["stats"])


def test_async_saves_of_grouped_chunks_exchange_in_the_background(tmp_path, clusters):
    """async_save stages each rank's own shards and returns; the exchange that builds the
    grouped chunks runs later on the staged copies (side group), while the training loop
    changes the state and runs its own collectives."""
    out = clusters(4).run(_grouped.async_repeated, str(tmp_path))
    for r in out:
        assert r["chunk_files"] == [6, 6, 6]  # one chunk per array, not one per rank


def test_shards_of_a_sixteenth_of_the_target_or_more_are_not_grouped():
    """Appendix C.1 step 3: a cell of at least chunk_target_bytes / 16 is an object of a
    good size already; grouping it would only move data between ranks (2-GPU saves of
    16-64 MB shards were slower with it)."""
    from zarrckpt.format.layout import GROUP_MIN_FRACTION, Layout, Shard

    target = (256 << 20) // 4  # elements of fp32
    cell_rows = target // GROUP_MIN_FRACTION // 1024  # a 16 MiB cell of 1024 columns
    at = Layout((2 * cell_rows, 1024), (2,), (Shard(0),), group_min_elems=target)
    below = Layout((2 * (cell_rows - 1), 1024), (2,), (Shard(0),), group_min_elems=target)
    assert at.chunk_shape == (cell_rows, 1024) and not at.grouped
    assert below.chunk_shape == (2 * (cell_rows - 1), 1024) and below.grouped
