"""The direct chunk-file path (zarrckpt/storage/_localfile.py) against TensorStore and
zarr-python: the same bytes on disk, file for file, and each reads what the others write."""

from __future__ import annotations

import filecmp
import importlib.util
import os
import threading
import time

import crc32c
import ml_dtypes
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from zarrckpt.format import dtypes
from zarrckpt.format import documents as fmt
from zarrckpt.errors import CorruptChunkError
from zarrckpt.storage import StorageOptions, open_storage
from zarrckpt.storage import _localfile
from zarrckpt.storage._localfile import LocalArray, chunk_codec

DIRECT = StorageOptions(chunk_io="direct")
TS = StorageOptions(chunk_io="tensorstore")

# (shape, chunk shape, numpy dtype, inner chunk bytes): whole and edge chunks, inner chunks
# partly and wholly in an edge chunk's padding, 0-d, 1-d, 3-d, bool, bf16, fp8, complex
CASES = [
    ((64, 48), (64, 48), np.float32, 1024),
    ((100, 70), (64, 48), np.float32, 1024),        # edge chunks; inner chunks partly padding
    ((65, 33), (64, 32), np.float32, 512),          # edge chunk of one row: inner chunks wholly padding
    ((1000,), (256,), np.float64, 256),
    ((7, 9, 11), (4, 9, 8), np.int16, 64),
    ((50, 40), (32, 32), np.bool_, 128),
    ((96, 64), (48, 64), ml_dtypes.bfloat16, 1024),
    ((40, 40), (40, 40), ml_dtypes.float8_e4m3fn, 256),
    ((30, 20), (16, 16), np.complex64, 512),
    ((), (), np.float32, 1 << 20),                  # 0-d: one plain chunk
    ((3000,), (1024,), np.uint8, 1 << 20),          # plain (unsharded) chunks with an edge
]


def values(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) > 0.5
    if np.dtype(dtype).kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def metadata(shape, chunk, dtype, inner_bytes):
    return fmt.array_metadata(shape=shape, dtype=dtypes.by_numpy(np.dtype(dtype)), chunk_shape=chunk,
                              attrs={}, dimension_names=[f"d{i}" for i in range(len(shape))],
                              inner_chunk_bytes=inner_bytes)


def chunk_boxes(shape, chunk):
    grid = [-(-n // c) if c else 1 for n, c in zip(shape, chunk)]
    for idx in np.ndindex(*grid):
        yield tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunk, shape))


def write_all(root, key, md, data, options):
    st = open_storage(str(root), options)
    st.make_dir()
    st.put(f"{key}/zarr.json", fmt.encode_document(md)).result()
    arr = st.open_for_write(key, md).result()
    futures = [arr.write(box, data[tuple(slice(a, b) for a, b in box)], stable=True)
               for box in chunk_boxes(data.shape, md["chunk_grid"]["configuration"]["chunk_shape"])]
    for f in futures:
        f.result()
    st.close()
    return arr


def files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n != "zarr.json":
                out[os.path.relpath(os.path.join(d, n), root)] = os.path.join(d, n)
    return out


@pytest.mark.parametrize("gather", [0, None], ids=["piece-by-piece", "one-call"])
@pytest.mark.parametrize("shape,chunk,dtype,inner_bytes", [CASES[1], CASES[4], CASES[8],
                                                           ((70000,), (65536,), np.uint8, 64)])
def test_whole_chunks_in_one_call_or_piece_by_piece(tmp_path, monkeypatch, shape, chunk, dtype, inner_bytes, gather):
    """A small chunk is written by one descriptor and one vectored write (inner chunks that are
    strided in the source gathered first; over IOV_MAX buffers in several calls: 1,024 inner
    chunks of 64 bytes), or, where the gathered copies would exceed GATHER_BYTES, piece by
    piece: the same bytes as TensorStore's either way."""
    if gather is not None:
        monkeypatch.setattr(_localfile, "GATHER_BYTES", gather)
    calls: list[int] = []
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
    md = metadata(shape, chunk, dtype, inner_bytes)
    data = values(shape, dtype)
    write_all(tmp_path / "direct", "x", md, data, DIRECT)
    monkeypatch.setattr(os, "pwritev", real)
    calls.remove(1)  # zarr.json (a chunk is at least a body and its CRC)
    write_all(tmp_path / "ts", "x", md, data, TS)
    fa, fb = files(tmp_path / "direct"), files(tmp_path / "ts")
    assert sorted(fa) == sorted(fb) and fa
    for k in fa:
        assert filecmp.cmp(fa[k], fb[k], shallow=False), k
    assert max(calls) <= 1024
    if gather is None:
        c = chunk_codec(md)
        present = [(os.path.getsize(f) - c.index_nbytes) // (c.inner_nbytes + 4) for f in fa.values()]
        assert len(calls) == sum(-(-(2 * n + 1) // 1024) for n in present), calls  # one per file and 1,024 buffers


@pytest.mark.parametrize("shape,chunk,dtype,inner_bytes", CASES)
def test_same_bytes_as_tensorstore_and_each_reads_the_other(tmp_path, shape, chunk, dtype, inner_bytes):
    md = metadata(shape, chunk, dtype, inner_bytes)
    assert chunk_codec(md) is not None
    data = values(shape, dtype)
    a = write_all(tmp_path / "direct", "x", md, data, DIRECT)
    assert isinstance(a, LocalArray)
    write_all(tmp_path / "ts", "x", md, data, TS)
    fa, fb = files(tmp_path / "direct"), files(tmp_path / "ts")
    assert sorted(fa) == sorted(fb) and fa
    for k in fa:
        assert filecmp.cmp(fa[k], fb[k], shallow=False), k
    # each path reads the other's files, whole and in random regions
    rng = np.random.default_rng(1)
    for src in ("direct", "ts"):
        for opts in (DIRECT, TS):
            arr = open_storage(str(tmp_path / src), opts).open_for_read("x", md).result()
            out = np.empty(shape, dtype)
            arr.read_into(tuple((0, n) for n in shape), out).result()
            assert out.tobytes() == data.tobytes()
            for _ in range(5):
                box = tuple(tuple(sorted(rng.integers(0, n + 1, 2))) for n in shape)
                part = np.zeros([b - a for a, b in box], dtype)
                arr.read_into(box, part).result()
                assert part.tobytes() == data[tuple(slice(a, b) for a, b in box)].tobytes()
    # zarr-python reads the direct path's array
    if np.dtype(dtype).kind != "V" and dtype not in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        got = zarr.open_array(str(tmp_path / "direct" / "x"), mode="r")[...]
        assert np.asarray(got).tobytes() == data.tobytes()


def test_strided_sources_and_targets(tmp_path):
    base = values((256, 512), np.float32)
    data = base.T[::2]  # (256, 256), neither row- nor column-contiguous
    md = metadata(data.shape, (128, 256), np.float32, 4096)
    write_all(tmp_path / "d", "x", md, data, DIRECT)
    got = zarr.open_array(str(tmp_path / "d" / "x"), mode="r")[...]
    np.testing.assert_array_equal(got, data)
    arr = open_storage(str(tmp_path / "d"), DIRECT).open_for_read("x", md).result()
    big = np.zeros((300, 600), np.float32)
    view = big[10:266:1, 20:532:2]  # a strided target
    arr.read_into(((0, 256), (0, 256)), view).result()
    np.testing.assert_array_equal(view, data)
    assert not big[:10].any()


def test_a_shard_is_written_and_read_by_several_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(_localfile, "PIECE_BYTES", 3 * 1028)  # 3 inner chunks per task
    data = values((64, 256), np.float32)
    md = metadata(data.shape, (64, 256), np.float32, 1024)
    seen = set()
    orig = LocalArray._write_inner

    def spy(self, *a):  # slow enough that the tasks overlap: one free thread cannot take them all
        seen.add(threading.get_ident())
        time.sleep(0.02)
        return orig(self, *a)
    monkeypatch.setattr(LocalArray, "_write_inner", spy)
    write_all(tmp_path / "d", "x", md, data, DIRECT)
    write_all(tmp_path / "t", "x", md, data, TS)
    assert filecmp.cmp(tmp_path / "d/x/c/0/0", tmp_path / "t/x/c/0/0", shallow=False)
    assert len(seen) > 1
    seen.clear()
    orig_read = LocalArray._read_units

    def spy_read(self, *a):
        seen.add(threading.get_ident())
        time.sleep(0.02)
        return orig_read(self, *a)
    monkeypatch.setattr(LocalArray, "_read_units", spy_read)
    arr = open_storage(str(tmp_path / "d"), DIRECT).open_for_read("x", md).result()
    before = _localfile.counters()["bytes_read"]
    assert arr.read().result().tobytes() == data.tobytes()
    assert len(seen) > 1  # a one-process load of one array uses several threads
    # split between tasks, the shard is read by inner chunks (and its index, perhaps by more
    # than one task at once), never whole by each task
    assert _localfile.counters()["bytes_read"] - before < 2 * os.path.getsize(tmp_path / "d/x/c/0/0")


def test_compressed_arrays_go_through_tensorstore(tmp_path):
    md = fmt.array_metadata(shape=(64, 64), dtype=dtypes.by_numpy(np.dtype(np.float32)), chunk_shape=(64, 64),
                            attrs={}, dimension_names=["a", "b"], compression=fmt.compression_codec("zstd"),
                            inner_chunk_bytes=1024)
    assert chunk_codec(md) is None
    arr = open_storage(str(tmp_path), DIRECT).open_for_write("x", md).result()
    assert not isinstance(arr, LocalArray)


def damaged(tmp_path):
    data = values((64, 96), np.float32)
    md = metadata(data.shape, (32, 96), np.float32, 1024)
    write_all(tmp_path, "x", md, data, DIRECT)
    return md, data


def read_all(tmp_path, md, opts=DIRECT):
    arr = open_storage(str(tmp_path), opts).open_for_read("x", md).result()
    out = np.empty(md["shape"], np.float32)
    arr.read_into(tuple((0, n) for n in md["shape"]), out).result()
    return out


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_in_an_inner_chunk_names_chunk_and_inner_chunk(tmp_path):
    md, _ = damaged(tmp_path)
    flip(tmp_path / "x/c/1/0", 5000)  # inside an inner chunk of the second shard
    with pytest.raises(CorruptChunkError, match=r"array 'x': chunk c/1/0 inner chunk \[\d+, \d+\] fails its crc32c"):
        read_all(tmp_path, md)
    with pytest.raises(ValueError, match="DATA_LOSS.*Digest mismatch"):  # TensorStore agrees
        read_all(tmp_path, md, TS)


def test_damaged_shard_index_missing_and_truncated_chunks(tmp_path):
    md, data = damaged(tmp_path)
    size = os.path.getsize(tmp_path / "x/c/0/0")
    flip(tmp_path / "x/c/0/0", size - 10)
    with pytest.raises(CorruptChunkError, match="c/0/0: its shard index fails its crc32c"):
        read_all(tmp_path, md)
    os.remove(tmp_path / "x/c/0/0")
    with pytest.raises(CorruptChunkError, match="chunk c/0/0 is missing from storage"):
        read_all(tmp_path, md)
    with open(tmp_path / "x/c/1/0", "r+b") as f:
        f.truncate(100)
    arr = open_storage(str(tmp_path), DIRECT).open_for_read("x", md).result()
    with pytest.raises(CorruptChunkError, match="c/1/0 is truncated"):
        arr.read_into(((32, 64), (0, 96)), np.empty((32, 96), np.float32)).result()


def test_index_pointing_outside_the_file_is_refused(tmp_path):
    md, _ = damaged(tmp_path)
    path = tmp_path / "x/c/0/0"
    raw = bytearray(path.read_bytes())
    n = chunk_codec(md).count  # inner chunks per shard
    table = np.frombuffer(bytes(raw[-(16 * n + 4):-4]), "<u8").reshape(n, 2).copy()
    table[0, 0] = len(raw)  # offset past the end, with a valid index checksum
    body = table.tobytes()
    raw[-(16 * n + 4):] = body + crc32c.crc32c(body).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match=r"inner chunk \[0, 0\]: index entry .* does not fit"):
        read_all(tmp_path, md)


def test_partial_writes_are_refused(tmp_path):
    md = metadata((64, 64), (32, 64), np.float32, 1024)
    arr = open_storage(str(tmp_path), DIRECT).open_for_write("x", md).result()
    with pytest.raises(ValueError, match="whole chunks"):
        arr.write(((0, 16), (0, 64)), np.zeros((16, 64), np.float32))


def test_fsync_each_and_counters(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    before = _localfile.counters()
    data = values((64, 96), np.float32)
    md = metadata(data.shape, (32, 96), np.float32, 1024)
    write_all(tmp_path, "x", md, data, StorageOptions(fsync="each"))
    assert sorted(p for p in synced if "/c/" in p) == sorted(map(str, files(tmp_path).values()))  # each chunk file
    after = _localfile.counters()
    assert after["bytes_written"] - before["bytes_written"] == sum(
        os.path.getsize(p) for p in files(tmp_path).values())
    read_all(tmp_path, md)
    assert _localfile.counters()["bytes_read"] - after["bytes_read"] == sum(
        os.path.getsize(p) for p in files(tmp_path).values())


def test_small_shards_are_read_whole_in_one_call_and_still_checked(tmp_path, monkeypatch):
    data = values((64, 96), np.float32)
    md = metadata(data.shape, (32, 96), np.float32, 1024)  # 12 KiB shards of 1 KiB inner chunks
    write_all(tmp_path, "x", md, data, DIRECT)
    size = os.path.getsize(tmp_path / "x/c/0/0")
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(off) or real(fd, bufs, off))
    before = _localfile.counters()["bytes_read"]
    np.testing.assert_array_equal(read_all(tmp_path, md), data)
    assert calls == [0, 0]  # one call per shard file, from its start
    assert _localfile.counters()["bytes_read"] - before == 2 * size
    # a region that needs part of a shard reads only the inner chunks it needs
    calls.clear()
    before = _localfile.counters()["bytes_read"]
    arr = open_storage(str(tmp_path), DIRECT).open_for_read("x", md).result()
    part = np.empty((8, 96), np.float32)
    arr.read_into(((0, 8), (0, 96)), part).result()
    np.testing.assert_array_equal(part, data[:8])
    assert 0 < _localfile.counters()["bytes_read"] - before < size
    # damage is found the same way
    flip(tmp_path / "x/c/1/0", 3000)
    with pytest.raises(CorruptChunkError, match=r"chunk c/1/0 inner chunk \[\d+, \d+\] fails its crc32c"):
        read_all(tmp_path, md)
    flip(tmp_path / "x/c/1/0", 3000)
    flip(tmp_path / "x/c/1/0", size - 7)
    with pytest.raises(CorruptChunkError, match="c/1/0: its shard index fails its crc32c"):
        read_all(tmp_path, md)


@pytest.mark.parametrize("scratch_chunks", [1, 3, 64])
@pytest.mark.parametrize("shape,chunk,dtype,inner_bytes", CASES)
def test_runs_of_inner_chunks_read_every_region_exactly(tmp_path, monkeypatch, shape, chunk, dtype, inner_bytes,
                                                        scratch_chunks):
    """Shards read inner chunk by inner chunk (not whole): neighbours in the file come in
    one preadv, into the target or through a buffer of ``scratch_chunks`` inner chunks;
    whole reads, random regions and strided targets give the stored values."""
    md = metadata(shape, chunk, dtype, inner_bytes)
    codec = chunk_codec(md)
    monkeypatch.setattr(_localfile, "WHOLE_FILE_BYTES", 0)
    monkeypatch.setattr(_localfile._Run, "SCRATCH", scratch_chunks * codec.inner_nbytes)
    data = values(shape, dtype)
    write_all(tmp_path, "x", md, data, DIRECT)
    arr = open_storage(str(tmp_path), DIRECT).open_for_read("x", md).result()
    rng = np.random.default_rng(2)
    boxes = [tuple((0, n) for n in shape)] + [
        tuple(tuple(sorted(rng.integers(0, n + 1, 2))) for n in shape) for _ in range(12)]
    for box in boxes:
        want = data[tuple(slice(a, b) for a, b in box)]
        part = np.zeros(want.shape, dtype)
        arr.read_into(box, part).result()
        assert part.tobytes() == want.tobytes(), box
        if want.ndim:  # a strided target: every other element of a bigger array
            big = np.zeros([2 * n for n in want.shape], dtype)
            view = big[tuple(slice(None, None, 2) for _ in want.shape)]
            arr.read_into(box, view).result()
            assert view.tobytes() == want.tobytes(), box
            assert not big[tuple(slice(1, None, 2) for _ in want.shape)].any()


def test_a_run_of_inner_chunks_is_one_preadv_and_each_is_still_checked(tmp_path, monkeypatch):
    data = values((256, 512), np.float32)
    md = metadata(data.shape, (128, 512), np.float32, 16 << 10)  # inner chunks of 32 x 128: 4 x 4 a shard
    monkeypatch.setattr(_localfile, "WHOLE_FILE_BYTES", 0)
    write_all(tmp_path, "x", md, data, DIRECT)
    codec = chunk_codec(md)
    assert codec.inner == (32, 128) and codec.grid == (4, 4)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
    np.testing.assert_array_equal(read_all(tmp_path, md), data)
    # 2 shards of 16 inner chunks: 16 bodies and 16 CRCs per call, the index read apart
    assert sorted(calls) == [32, 32]
    # the 11th inner chunk of the second shard, in the middle of its run, is named
    flip(tmp_path / "x/c/1/0", 10 * (codec.inner_nbytes + 4) + 100)
    with pytest.raises(CorruptChunkError, match=r"chunk c/1/0 inner chunk \[2, 2\] fails its crc32c"):
        read_all(tmp_path, md)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=6), st.integers(0, 64))
def test_combined_crc_is_the_crc_of_the_concatenation(parts, pad):
    """The CRC of parts of one size, combined from theirs, is that of their concatenation."""
    size = max(map(len, parts)) + pad
    parts = [p.ljust(size, b"\x5a") for p in parts]
    assert _localfile.combined_crc([crc32c.crc32c(p) for p in parts], size) == crc32c.crc32c(b"".join(parts))


def test_damage_in_two_inner_chunks_of_a_run_names_the_first(tmp_path, monkeypatch):
    data = values((128, 512), np.float32)
    md = metadata(data.shape, (128, 512), np.float32, 16 << 10)
    monkeypatch.setattr(_localfile, "WHOLE_FILE_BYTES", 0)
    write_all(tmp_path, "x", md, data, DIRECT)
    enc = chunk_codec(md).inner_nbytes + 4
    for k in (5, 9):  # the same byte of two inner chunks, the same flip
        flip(tmp_path / "x/c/0/0", k * enc + 64)
    with pytest.raises(CorruptChunkError, match=r"chunk c/0/0 inner chunk \[1, 1\] fails its crc32c"):
        read_all(tmp_path, md)


def test_run_buffers_are_kept_for_the_next_read_and_freed_by_release_staging(tmp_path, monkeypatch):
    data = values((256, 512), np.float32)
    md = metadata(data.shape, (128, 512), np.float32, 16 << 10)
    monkeypatch.setattr(_localfile, "WHOLE_FILE_BYTES", 0)
    write_all(tmp_path, "x", md, data, DIRECT)
    _localfile.release_buffers()
    np.testing.assert_array_equal(read_all(tmp_path, md), data)
    kept = list(_localfile._RUN_BUFFERS._free)
    assert kept and sum(b.nbytes for b in kept) <= _localfile._RUN_BUFFERS.keep
    np.testing.assert_array_equal(read_all(tmp_path, md), data)
    assert any(b is k for b in _localfile._RUN_BUFFERS._free for k in kept)  # reused, not reallocated
    _localfile.release_buffers()
    assert not _localfile._RUN_BUFFERS._free
    if importlib.util.find_spec("torch") is not None:  # the public call frees them too
        import zarrckpt

        read_all(tmp_path, md)
        assert _localfile._RUN_BUFFERS._free
        zarrckpt.release_staging()
        assert not _localfile._RUN_BUFFERS._free


def tile_boxes(shape, inner, rng, n=8):
    """The whole array and ``n`` random boxes on tile boundaries (ending on one or at the end)."""
    yield tuple((0, s) for s in shape)
    for _ in range(n):
        box = []
        for s, t in zip(shape, inner):
            ends = sorted(rng.choice(list(range(0, s, t)) + [s], 2, replace=False))
            box.append((int(ends[0]), int(ends[1])))
        yield tuple(box)


@pytest.mark.parametrize("shape,chunk,dtype,inner_bytes", [c for c in CASES if c[0] and c[3] < (1 << 20)])
def test_read_tiles_reads_whole_inner_chunks_in_grid_order(tmp_path, monkeypatch, shape, chunk, dtype, inner_bytes):
    """Issue 16 (GPU loads): ``read_tiles`` reads the stored inner chunks that meet a box on
    tile boundaries whole, padding included, into consecutive tiles in C order of their grid
    positions, with no rearranging copy (neighbours in a file: one preadv, one CRC)."""
    md = metadata(shape, chunk, dtype, inner_bytes)
    codec = chunk_codec(md)
    monkeypatch.setattr(_localfile, "WHOLE_FILE_BYTES", 0)
    data = values(shape, dtype)
    write_all(tmp_path, "x", md, data, DIRECT)
    arr = open_storage(str(tmp_path), DIRECT).open_for_read("x", md).result()
    tile = arr.tile_shape()
    assert tile == codec.inner
    fill = np.zeros((), dtype)
    for box in tile_boxes(shape, tile, np.random.default_rng(3)):
        grid = [-(-b // t) - a // t for (a, b), t in zip(box, tile)]
        out = np.full((int(np.prod(grid)), *tile), 1, dtype)
        arr.read_tiles(box, out).result()
        for k, g in enumerate(np.ndindex(*grid)):
            lo = [(a // t + x) * t for (a, _), t, x in zip(box, tile, g)]
            part = tuple(slice(l, min(l + t, s)) for l, t, s in zip(lo, tile, shape))
            want = data[part]
            got = out[k][tuple(slice(0, p.stop - p.start) for p in part)]
            assert got.tobytes() == want.tobytes(), (box, g)
            pad = np.ones(tile, bool)
            pad[tuple(slice(0, p.stop - p.start) for p in part)] = False
            assert (out[k][pad] == fill).all(), (box, g)  # padding as stored: the fill value


def test_read_tiles_of_a_shard_is_one_preadv_and_one_crc_and_names_damage(tmp_path, monkeypatch):
    data = values((256, 512), np.float32)
    md = metadata(data.shape, (128, 512), np.float32, 16 << 10)  # inner chunks of 32 x 128: 4 x 4 a shard
    monkeypatch.setattr(_localfile, "WHOLE_FILE_BYTES", 0)
    write_all(tmp_path, "x", md, data, DIRECT)
    arr = open_storage(str(tmp_path), DIRECT).open_for_read("x", md).result()
    calls, crcs = [], []
    real, real_crc = os.preadv, _localfile.crc32c.crc32c
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
    monkeypatch.setattr(_localfile, "crc32c", type("M", (), {"crc32c": staticmethod(
        lambda b: crcs.append(memoryview(b).nbytes) or real_crc(b))}))
    out = np.zeros((32, 32, 128), np.float32)
    arr.read_tiles(((0, 256), (0, 512)), out).result()
    want = data.reshape(8, 32, 4, 128).transpose(0, 2, 1, 3).reshape(32, 32, 128)
    np.testing.assert_array_equal(out, want)
    assert sorted(calls) == [32, 32]  # 16 bodies + 16 CRCs per shard
    assert sorted(n for n in crcs if n > 1000) == [16 * 32 * 128 * 4] * 2  # one CRC per shard's run
    flip(tmp_path / "x/c/1/0", 10 * (chunk_codec(md).inner_nbytes + 4) + 100)
    with pytest.raises(CorruptChunkError, match=r"chunk c/1/0 inner chunk \[2, 2\] fails its crc32c"):
        arr.read_tiles(((0, 256), (0, 512)), out).result()
    with pytest.raises(ValueError, match="tile boundaries"):
        arr.read_tiles(((0, 256), (0, 500)), out)  # not at a tile boundary nor at the end


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12), st.integers(1, 4)), min_size=0, max_size=3))
@settings(max_examples=300, deadline=None)
def test_present_count_is_the_number_of_inner_chunks_present(dims):
    """``ChunkCodec.present_count`` (arithmetic) against ``present`` (the enumeration) for
    every chunk of random shapes, chunk shapes and inner chunk shapes, edge chunks included."""
    shape = tuple(n for n, _, _ in dims)
    inner = tuple(i for _, _, i in dims)
    chunk = tuple(c * i for _, c, i in dims)
    codec = _localfile.ChunkCodec(shape, chunk, inner, True, np.dtype("<f4"))
    for index in np.ndindex(*[max(1, -(-n // c)) for n, c in zip(shape, chunk)]):
        assert codec.present_count(index) == len(codec.present(index)), (shape, chunk, inner, index)
