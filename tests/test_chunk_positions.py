"""Chunk bytes are tied to their place (spec §6.6, format 1.3; issue 28 item 9).

The CRC-32C of a chunk (§5.5) covers its bytes, not where they belong: two chunk files of
equal size swapped (in one array or between arrays), or a shard index entry rewritten to
point at another inner chunk (its own CRC recomputed), decode without a checksum error. From
1.3 the committed root records the CRC-32C each unit (chunk, or inner chunk) must carry at
its position (``digests.chunks``); every read path refuses such a checkpoint, naming the
array and the chunk: ``zarrckpt.load``, ``load_state_dict``, ``open().read`` (the direct
reader and the TensorStore path), and ``zarrckpt verify``. A 1.2 checkpoint has no table and
reads as before (the same swap still reads silently there). Generic readers still read every
chunk of a 1.3 checkpoint: the chunk bytes are unchanged.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt import errors
from zarrckpt.engine.writer import Writer
from zarrckpt.format import documents as fmt
from zarrckpt.format import dtypes
from zarrckpt.readers.verify import verify

GOLDEN = Path(__file__).resolve().parent / "golden"
TS = zarrckpt.StorageOptions(chunk_io="tensorstore")


def _swap(a: Path, b: Path) -> None:
    x, y = a.read_bytes(), b.read_bytes()
    assert len(x) == len(y) and x != y
    a.write_bytes(y)
    b.write_bytes(x)


def _plain_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Two uncompressed arrays of 4 plain (unsharded) chunks of 64 bytes each."""
    values = {"a": np.arange(64, dtype=np.float32).reshape(8, 8), "b": -np.arange(64, dtype=np.float32).reshape(8, 8)}
    with Writer(path, inner_chunk_bytes=1 << 20) as w:
        for name, v in values.items():
            arr = w.add_array((name,), v.shape, dtypes.by_zarr("float32"), chunk_shape=(2, 8))
            for start in arr.chunk_starts():
                arr.write(start, v[start[0]:start[0] + 2])
    return values


def _refused_everywhere(path: Path, array: str, chunk: str, target: dict) -> None:
    """Every read path refuses the checkpoint with CorruptChunkError naming array and chunk."""
    match = rf"array '{array}'.*chunk {chunk}.*position"
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.load_state_dict(path)
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.load_state_dict(path, storage=TS)  # the TensorStore path
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.load({k: v.clone() for k, v in target.items()}, path)
    with pytest.raises(errors.CorruptChunkError, match=match):
        zarrckpt.open(path).read(array)
    report = verify(path)
    assert not report.ok
    assert any(p.kind == "position" and p.array == array and p.chunk == chunk for p in report.problems), \
        [p.to_json() if hasattr(p, "to_json") else p for p in report.problems]


def test_the_root_records_each_units_stored_crc(tmp_path):
    """The table holds, for an uncompressed array, exactly the stored crc32c trailers, in C
    order of the unit grid: what a reader written from the spec compares."""
    values = _plain_checkpoint(tmp_path / "ck")
    attrs = json.loads((tmp_path / "ck" / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
    assert attrs["version"] == "1.3"
    for name in values:
        table = struct.unpack("<4I", base64.b64decode(attrs["digests"]["chunks"][name]))
        trailers = tuple(int.from_bytes((tmp_path / "ck" / name / "c" / str(i) / "0").read_bytes()[-4:], "little")
                         for i in range(4))
        assert table == trailers
    # a sharded golden: the trailer of every inner chunk the index names, in unit-grid order
    path = GOLDEN / "v1.3" / "four_ranks_dtensor"
    root = json.loads((path / "zarr.json").read_bytes())
    doc = root["consolidated_metadata"]["metadata"]["st_rows"]
    table = np.frombuffer(base64.b64decode(root["attributes"]["zarrckpt"]["digests"]["chunks"]["st_rows"]), "<u4")
    unit = fmt.unit_shape(doc)
    grid = fmt.unit_grid(doc)
    per = [c // n for c, n in zip(doc["chunk_grid"]["configuration"]["chunk_shape"], unit)]
    for g in np.ndindex(*grid):
        index, j = [k // p for k, p in zip(g, per)], [k % p for k, p in zip(g, per)]
        raw = (path / "st_rows" / "c" / "/".join(map(str, index))).read_bytes()
        count = int(np.prod(per))
        entries = np.frombuffer(raw[len(raw) - 16 * count - 4:-4], "<u8").reshape(count, 2)
        off, n = (int(x) for x in entries[int(np.ravel_multi_index(j, per))])
        body = raw[off:off + n]
        assert crc32c.crc32c(body[:-4]) == int.from_bytes(body[-4:], "little") == table[np.ravel_multi_index(g, grid)]


def test_plain_chunks_swapped_within_an_array_are_refused(tmp_path):
    path = tmp_path / "ck"
    values = _plain_checkpoint(path)
    target = {k: torch.zeros(v.shape) for k, v in values.items()}
    assert np.array_equal(zarrckpt.load_state_dict(path)["a"].numpy(), values["a"])
    _swap(path / "a" / "c" / "1" / "0", path / "a" / "c" / "2" / "0")
    _refused_everywhere(path, "a", "c/1/0", target)
    np.testing.assert_array_equal(zarrckpt.open(path).read("b"), values["b"])  # other arrays still read


def test_plain_chunks_swapped_between_arrays_are_refused(tmp_path):
    path = tmp_path / "ck"
    values = _plain_checkpoint(path)
    target = {k: torch.zeros(v.shape) for k, v in values.items()}
    _swap(path / "a" / "c" / "3" / "0", path / "b" / "c" / "3" / "0")
    _refused_everywhere(path, "a", "c/3/0", target)
    with pytest.raises(errors.CorruptChunkError, match=r"array 'b'.*chunk c/3/0.*position"):
        zarrckpt.open(path).read("b")


def _golden_copy(tmp_path: Path, version: str, name: str = "four_ranks_dtensor") -> Path:
    dst = tmp_path / name
    shutil.copytree(GOLDEN / version / name, dst)
    return dst


def _target(path: Path) -> dict:
    """load()'s in-place target for every tensor leaf of a golden checkpoint."""
    return {k: torch.as_tensor(v).clone() for k, v in zarrckpt.load_state_dict(path).items()
            if isinstance(v, torch.Tensor) and k in ("unaligned", "shard0_uneven", "st_rows")}


def test_shards_swapped_within_and_between_arrays_are_refused(tmp_path):
    """Sharded arrays: whole shard files of equal size swapped (their indexes with them)."""
    path = _golden_copy(tmp_path, "v1.3")
    target = _target(path)
    _swap(path / "unaligned" / "c" / "0" / "0", path / "unaligned" / "c" / "2" / "0")
    _refused_everywhere(path, "unaligned", "c/0/0", target)

    path = _golden_copy(tmp_path / "b", "v1.3")
    _swap(path / "unaligned" / "c" / "1" / "0", path / "shard0_uneven" / "c" / "0" / "0")
    _refused_everywhere(path, "shard0_uneven", "c/0/0", target)


def test_a_shard_index_entry_pointing_at_another_inner_chunk_is_refused(tmp_path):
    """The entry of inner chunk 0 rewritten to the (offset, nbytes) of inner chunk 1 of the same
    shard, the index's own CRC-32C recomputed: every checksum holds, the position does not."""
    path = _golden_copy(tmp_path, "v1.3")
    target = _target(path)
    f = path / "st_rows" / "c" / "0" / "0"
    raw = bytearray(f.read_bytes())
    doc = json.loads((path / "zarr.json").read_bytes())["consolidated_metadata"]["metadata"]["st_rows"]
    count = int(np.prod([c // n for c, n in zip(doc["chunk_grid"]["configuration"]["chunk_shape"],
                                                doc["codecs"][0]["configuration"]["chunk_shape"])]))
    start = len(raw) - 16 * count - 4
    entries = np.frombuffer(bytes(raw[start:-4]), "<u8").reshape(count, 2).copy()
    assert entries[0, 1] == entries[1, 1] and entries[0, 0] != entries[1, 0]
    entries[0] = entries[1]
    index = entries.tobytes()
    raw[start:] = index + crc32c.crc32c(index).to_bytes(4, "little")
    f.write_bytes(bytes(raw))
    _refused_everywhere(path, "st_rows", "c/0/0", target)


def test_the_same_swap_in_a_1_2_checkpoint_reads_as_before(tmp_path):
    """A 1.2 root has no table: its chunks read exactly as 1.2 readers read them (the swap goes
    unnoticed there, which is what 1.3 closes); the untouched 1.2 golden reads bit for bit
    (tests/test_golden.py)."""
    path = _golden_copy(tmp_path, "v1.2")
    _swap(path / "unaligned" / "c" / "0" / "0", path / "unaligned" / "c" / "2" / "0")
    got = zarrckpt.load_state_dict(path)["unaligned"]
    want = zarrckpt.load_state_dict(GOLDEN / "v1.2" / "four_ranks_dtensor")["unaligned"]
    assert torch.equal(got[:3], want[6:]) and torch.equal(got[6:], want[:3])
    assert verify(path).ok


def test_generic_readers_read_every_chunk_of_a_1_3_checkpoint(tmp_path):
    """The chunk bytes stay standard: zarr-python and TensorStore read what zarrckpt reads."""
    import tensorstore as ts
    import zarr

    path = tmp_path / "ck"
    values = _plain_checkpoint(path)
    for name, v in values.items():
        np.testing.assert_array_equal(zarr.open_array(str(path / name), mode="r")[...], v)
    golden = GOLDEN / "v1.3" / "four_ranks_dtensor"
    for name in ("st_rows", "unaligned", "edge_padding"):
        want = zarrckpt.open(golden).read(name)
        np.testing.assert_array_equal(zarr.open_array(str(golden / name), mode="r")[...], want)
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(golden / name)}}
        np.testing.assert_array_equal(ts.open(spec, read=True).result().read().result(), want)


def test_a_1_3_root_without_its_table_or_with_a_wrong_one_is_refused():
    """§6.6: digests.chunks is REQUIRED from 1.3, lists exactly the arrays, 4 bytes per unit."""
    raw = (GOLDEN / "v1.3" / "one_default" / "zarr.json").read_bytes()
    doc = json.loads(raw)
    attrs = doc["attributes"]["zarrckpt"]

    def reseal(d: dict) -> bytes:
        d["attributes"]["zarrckpt"]["digests"]["root"] = fmt.ZERO_DIGEST
        d["attributes"]["zarrckpt"]["digests"]["root"] = fmt.sha256_hex(fmt.encode_document(d))
        return fmt.encode_document(d)

    no_table = json.loads(raw)
    del no_table["attributes"]["zarrckpt"]["digests"]["chunks"]
    with pytest.raises(errors.FormatError, match="digests.chunks"):
        fmt.parse_root_bytes(reseal(no_table), "x")
    extra = json.loads(raw)
    extra["attributes"]["zarrckpt"]["digests"]["chunks"]["nope"] = ""
    with pytest.raises(errors.IntegrityError, match="digests.chunks"):
        fmt.parse_root_bytes(reseal(extra), "x")
    path = next(iter(attrs["digests"]["chunks"]))
    arr = doc["consolidated_metadata"]["metadata"][path]
    with pytest.raises(errors.FormatError, match="expected 4 per unit"):
        fmt.parse_chunk_table(base64.b64encode(b"\0" * 3).decode(), arr, path)
    with pytest.raises(errors.FormatError, match="not a base64"):
        fmt.parse_chunk_table("!!!!", arr, path)
    # relabelled 1.2: the table is not used (an older root's member is not this format's)
    old = json.loads(raw)
    old["attributes"]["zarrckpt"]["version"] = "1.2"
    assert fmt.parse_root_bytes(reseal(old), "x").chunk_tables is None


def test_tier_copies_and_promoted_steps_carry_the_table(tmp_path, monkeypatch):
    """The manager's node-tier saves (spec §7.8) write format 1.3 roots too, and promotion
    copies them: both record the chunk positions, so a tier copy with two chunk files
    swapped is refused by a load like any checkpoint."""
    monkeypatch.setenv("ZARRCKPT_NODE", "solo")
    state = {"a": torch.arange(64.0).reshape(8, 8), "b": -torch.arange(64.0).reshape(8, 8)}
    with zarrckpt.CheckpointManager(tmp_path / "p", local_dir=tmp_path / "l", local_replicas=0,
                                    persist_every=1, chunk_target_bytes=None) as mgr:
        mgr.save(1, state)
    roots = [tmp_path / "l" / "solo" / fmt.step_name(1), tmp_path / "p" / fmt.step_name(1)]
    for root in roots:
        doc = json.loads((root / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
        assert set(doc["digests"]["chunks"]) == {"a", "b"}, root
    local = roots[0]
    _swap(local / "a" / "c" / "0" / "0", local / "b" / "c" / "0" / "0")
    with pytest.raises(errors.CorruptChunkError, match="position"):
        zarrckpt.load_state_dict(local)


def test_dcp_storage_writer_and_jax_save_record_positions(tmp_path):
    """The other writers of the engine write 1.3 roots too: DCP's storage layer
    (``ZarrckptStorageWriter``: each rank's CRCs reach finish() with its write results) and
    ``zarrckpt.jax.save`` (one process); a swap in what they wrote is refused."""
    import torch.distributed.checkpoint as dcp

    from zarrckpt.dcp_storage import ZarrckptStorageWriter

    state = {"a": torch.arange(64.0).reshape(8, 8), "b": -torch.arange(64.0).reshape(8, 8), "n": 3}
    dcp.save(state, storage_writer=ZarrckptStorageWriter(str(tmp_path / "d")),
             no_dist=True)
    doc = json.loads((tmp_path / "d" / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
    assert {"a", "b"} <= set(doc["digests"]["chunks"])
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "d")["a"], state["a"])
    _swap(tmp_path / "d" / "a" / "c" / "0" / "0", tmp_path / "d" / "b" / "c" / "0" / "0")
    with pytest.raises(errors.CorruptChunkError, match="position"):
        zarrckpt.load_state_dict(tmp_path / "d")
    jax = pytest.importorskip("jax")
    from zarrckpt import jax as zjax

    zjax.save({"a": jax.numpy.arange(12.0)}, str(tmp_path / "j"))
    doc = json.loads((tmp_path / "j" / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
    assert set(doc["digests"]["chunks"]) == {"a"}


def test_checked_reads_of_unaligned_boxes_keep_their_unit_buffers_within_the_bound(tmp_path, monkeypatch):
    """A checked TensorStore read (format 1.3) of a box that does not start and end on unit
    boundaries goes through a buffer of the whole units. A reshard onto shards smaller than
    a unit counted only the box against ``max_inflight_bytes``: 1,024 one-row reads of
    64 KiB units held 64 MiB under a 1 MiB bound. The load now counts the units."""
    import threading
    import time
    import weakref

    from zarrckpt.api.load import _Reads
    from zarrckpt.readers.checkpoint import Checkpoint
    from zarrckpt.storage import _tensorstore

    w = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)
    zarrckpt.save({"w": w}, tmp_path / "c", inner_chunk_bytes=64 << 10)
    ck = Checkpoint(str(tmp_path / "c"), zarrckpt.StorageOptions(chunk_io="tensorstore"))
    info = ck.array_info("w")
    unit = info.inner_chunk_shape or info.chunk_shape
    assert unit[0] > 4, unit  # a unit spans several of the rows read below

    live, peak, lock = [0], [0], threading.Lock()
    orig = _tensorstore._unit_buffer

    def tracked(shape, dtype):
        buf = orig(shape, dtype)
        with lock:
            live[0] += buf.nbytes
            peak[0] = max(peak[0], live[0])

        def gone(n=buf.nbytes):
            with lock:
                live[0] -= n
        weakref.finalize(buf, gone)
        return buf

    check = _tensorstore.TensorStoreArray._check_units

    def slow_check(self, whole, data):
        time.sleep(0.002)  # checks finish after the next reads are issued
        return check(self, whole, data)

    monkeypatch.setattr(_tensorstore, "_unit_buffer", tracked)
    monkeypatch.setattr(_tensorstore.TensorStoreArray, "_check_units", slow_check)
    out = torch.zeros(4096, 64)
    rows = range(1, 4096, 4)
    limit = 1 << 20
    with _Reads(ck, 1, limit) as reads:
        reads.add("w", info, [(((r, r + 1), (0, 64)), ((r, r + 1), (0, 64))) for r in rows], out)
        reads.finish()
    for r in rows:
        assert torch.equal(out[r], w[r])
    # each one-row read holds the whole units of its row; a few may outlive their reads'
    # accounting by a moment (their check tasks are returning)
    from zarrckpt.format.layout import unit_elements

    held = unit_elements(((1, 2), (0, 64)), unit, (4096, 64)) * 4
    assert 0 < peak[0] <= limit + 4 * held, (peak[0], limit, held)
