"""Shared reads (zarrckpt.api.shared_reads): small pieces of a load fetched once per chunk
object by an owner rank and sent to the ranks that need them (issue 16: S3 loads of many
small shards made two requests per rank per chunk)."""

from __future__ import annotations

import os

import pytest

import _shared

W = 4


def _chunk_objects(path: str) -> int:
    return len([f for f in _shared.chunk_files(path) if "/c/" in f"/{f}/"])  # "c" alone: a 0-d array's


@pytest.mark.parametrize("placement", ["S0", "S1", "R"])
def test_each_chunk_object_is_fetched_once_for_the_whole_job(tmp_path, clusters, placement):
    """Same layout, resharded (rows -> columns) and replicated targets: every element right
    (compared on every rank), and the job GETs each chunk object exactly once, spread over
    the ranks, where per-rank reads would fetch each chunk (its index and its inner chunk)
    once per rank."""
    c = clusters(W)
    path = str(tmp_path / "c")
    c.run(_shared.save, path)
    out = c.run(_shared.load, path, placement, True)
    gets = [k for o in out for k in o["gets"]]
    assert len(gets) == len(set(gets)) == _chunk_objects(path)  # one GET per chunk object, job-wide
    assert sum(1 for o in out if o["gets"]) >= 2  # owners are spread over the ranks
    assert sum(o["fetched"] for o in out) <= 1.05 * sum(o["shared"]["bytes_needed"] for o in out) \
        or placement == "R"  # replicated: each rank needs all of it, fetched once
    assert all(o["shared"]["whole_chunks"] == len(o["gets"]) for o in out)


def test_without_shared_reads_each_rank_reads_for_itself(tmp_path, clusters):
    """The control: shared_reads=False (and the default on a file system) reads through each
    rank's own path, with no GET of whole chunk objects and no shared counters."""
    c = clusters(W)
    path = str(tmp_path / "c")
    c.run(_shared.save, path)
    for shared in (False, None):
        out = c.run(_shared.load, path, "S1", shared)
        assert all(o["shared"] is None and o["gets"] == [] for o in out)


def test_bf16_pieces_cast_into_fp32_targets(tmp_path, clusters):
    c = clusters(W)
    path = str(tmp_path / "c")
    c.run(_shared.save, path)
    c.run(_shared.load, path, "S1", True, None, True)  # compares inside


def test_a_corrupt_chunk_fails_the_load_on_every_rank(tmp_path, clusters):
    """The owner of a damaged chunk object finds its CRC-32C wrong; every rank's load fails
    (one error class), none hangs, and a clean load works afterwards."""
    c = clusters(W)
    path = str(tmp_path / "c")
    c.run(_shared.save, path)
    victim = os.path.join(path, "model", "w3", "c", "0", "0")
    data = bytearray(open(victim, "rb").read())
    data[5] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    out = c.run(_shared.load_fails, path)
    assert all(o.startswith("CorruptChunkError") for o in out), out  # one class on every rank
    assert all("crc32c" in o and "w3" in o for o in out), out
    data[5] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    c.run(_shared.load, path, "S0", True)


def test_a_missing_chunk_object_fails_the_load_on_every_rank(tmp_path, clusters):
    c = clusters(W)
    path = str(tmp_path / "c")
    c.run(_shared.save, path)
    os.remove(os.path.join(path, "model", "w5", "c", "0", "0"))
    out = c.run(_shared.load_fails, path)
    assert all(o.startswith("CorruptChunkError") for o in out), out
    assert all("missing" in o and "w5" in o for o in out), out


def test_truncated_and_bad_index_objects_are_refused():
    """decode() refuses what the spec's reader rules refuse, with the chunk named."""
    import numpy as np

    from zarrckpt.api.shared_reads import decode
    from zarrckpt.errors import CorruptChunkError
    from zarrckpt.storage import ChunkCodec

    codec = ChunkCodec((8, 4), (8, 4), (4, 4), True, np.dtype("float32"))
    import crc32c

    tiles = [np.arange(16, dtype=np.float32) + 16 * k for k in range(2)]
    body = b"".join(t.tobytes() + crc32c.crc32c(t.tobytes()).to_bytes(4, "little") for t in tiles)
    index = np.array([[0, 68], [68, 68]], dtype="<u8").tobytes()
    good = body + index + crc32c.crc32c(index).to_bytes(4, "little")
    cbox = ((0, 8), (0, 4))
    assert np.array_equal(decode(good, codec, (0, 0), cbox, "c/0/0"),
                          np.concatenate(tiles).reshape(8, 4))
    bad_index = np.array([[0, 68], [40, 68]], dtype="<u8").tobytes()
    for raw, what in [(good[:20], "truncated"), (good[:-1] + bytes([good[-1] ^ 1]), "shard index"),
                      (body + bad_index + crc32c.crc32c(bad_index).to_bytes(4, "little"), None),
                      (good[:3] + bytes([good[3] ^ 1]) + good[4:], "inner chunk (0, 0)")]:
        if what is None:  # overlapping entries: each still fits, so the CRC of the tile decides
            with pytest.raises(CorruptChunkError):
                decode(raw, codec, (0, 0), cbox, "c/0/0")
            continue
        with pytest.raises(CorruptChunkError, match="c/0/0") as e:
            decode(raw, codec, (0, 0), cbox, "c/0/0")
        assert what in str(e.value)
    absent = np.array([[0, 68], [2**64 - 1, 2**64 - 1]], dtype="<u8").tobytes()
    with pytest.raises(CorruptChunkError, match="absent"):
        decode(body[:68] + absent + crc32c.crc32c(absent).to_bytes(4, "little"), codec, (0, 0), cbox, "c/0/0")


def test_on_s3_the_default_shares_and_cuts_the_requests(s3, clusters):
    """On an object store shared reads are the default: the job's HTTP requests during a
    load against a real S3 server (SeaweedFS), counted by TensorStore, with and without."""
    c = clusters(W)
    url = s3.url(s3.fresh_prefix() + "c")
    o = {"endpoint": s3.endpoint, "region": s3.region, "access_key_id": s3.access_key,
         "secret_access_key": s3.secret_key}
    c.run(_shared.save, url, o)
    shared = c.run(_shared.load, url, "S0", None, o)
    own = c.run(_shared.load, url, "S0", False, o)
    arrays = _shared.N + 4
    assert all(r["shared"] is not None for r in shared) and all(r["shared"] is None for r in own)
    gets = [k for r in shared for k in r["gets"]]
    assert len(gets) == len(set(gets)) == arrays  # small arrays: one chunk object each, GOT once
    n_shared, n_own = sum(r["http"] for r in shared), sum(r["http"] for r in own)
    # per rank: the root, then an index and an inner chunk per array; shared: a GET per array
    # for the whole job, plus the root per rank
    assert n_own >= 2 * arrays * W and n_shared <= arrays + 4 * W, (n_shared, n_own)


def test_a_padding_index_entry_outside_its_shard_is_refused():
    """Spec §5.5: a present index entry must lie inside the shard, also for an inner chunk
    wholly in the padding that no read decodes (shared reads parse indexes themselves;
    issue 28 item 11)."""
    import crc32c
    import numpy as np

    from zarrckpt.api.shared_reads import decode
    from zarrckpt.errors import CorruptChunkError
    from zarrckpt.storage import ChunkCodec

    codec = ChunkCodec((4, 4), (8, 4), (4, 4), True, np.dtype("float32"))  # inner chunk 1: padding only
    tile = np.arange(16, dtype=np.float32)
    body = tile.tobytes() + crc32c.crc32c(tile.tobytes()).to_bytes(4, "little")

    def shard(entry1):
        index = np.array([[0, 68], entry1], dtype="<u8").tobytes()
        return body + index + crc32c.crc32c(index).to_bytes(4, "little")

    absent = 2**64 - 1
    assert np.array_equal(decode(shard([absent, absent]), codec, (0, 0), ((0, 4), (0, 4)), "c/0/0"),
                          tile.reshape(4, 4))
    with pytest.raises(CorruptChunkError, match=r"c/0/0, inner chunk \[1, 0\].*does not fit"):
        decode(shard([1000, 68]), codec, (0, 0), ((0, 4), (0, 4)), "c/0/0")


def w_shared_load(rank, world, path):
    """A load of every array with shared_reads=True; what it raised, by class and message."""
    import torch

    import zarrckpt

    target = {"a": torch.zeros(8, 8), "b": torch.zeros(8, 8)}
    try:
        zarrckpt.load(target, path, shared_reads=True)
        return "ok"
    except zarrckpt.ZarrckptError as e:
        return f"{type(e).__name__}: {e}"


def test_shared_reads_refuse_chunks_out_of_place(tmp_path, clusters):
    """Format 1.3 (spec §6.6): shared reads decode chunk objects themselves, and check each
    chunk's CRC-32C against the one the root records for its position: chunk files swapped
    between two arrays are refused on every rank, naming the array and chunk."""
    from pathlib import Path

    import test_chunk_positions as tcp

    path = Path(tmp_path) / "c"
    tcp._plain_checkpoint(path)
    assert clusters(2).run(w_shared_load, str(path)) == ["ok", "ok"]
    tcp._swap(path / "a" / "c" / "1" / "0", path / "b" / "c" / "1" / "0")
    out = clusters(2).run(w_shared_load, str(path))
    assert all(o.startswith("CorruptChunkError") and "position" in o and "c/1/0" in o for o in out), out


def test_bool_bytes_other_than_0_and_1_are_refused():
    """Spec §5.2 (settled in 1.3, B4 of the 1.2 reader review): shared reads decode chunks
    themselves and refuse a bool byte other than 0 or 1, as the direct reader does."""
    import crc32c
    import numpy as np

    from zarrckpt.api.shared_reads import decode
    from zarrckpt.errors import CorruptChunkError
    from zarrckpt.storage import ChunkCodec

    codec = ChunkCodec((4,), (4,), (4,), False, np.dtype("bool"))
    for body, ok in ((bytes([0, 1, 1, 0]), True), (bytes([0, 1, 2, 0]), False)):
        raw = body + crc32c.crc32c(body).to_bytes(4, "little")
        if ok:
            assert decode(raw, codec, (0,), ((0, 4),), "c/0").tolist() == [False, True, True, False]
        else:
            with pytest.raises(CorruptChunkError, match=r"c/0: a bool element is stored as the byte 2"):
                decode(raw, codec, (0,), ((0, 4),), "c/0")
