"""The storage interface and its fault-injecting fake (issue 15 item 3).

A conformance suite runs every :class:`zarrckpt.storage.Storage` method against the
TensorStore file backend and against :class:`zarrckpt.storage.FaultStorage` with no
faults: both must behave the same. Then one test per fault kind shows how zarrckpt reacts
(a failed write, a torn write, a store that dies mid-save, a slow store)."""

from __future__ import annotations

import errno
import json
import time

import crc32c
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.inspect import verify
from zarrckpt.storage import FaultStorage, Storage, open_storage
from zarrckpt.storage.memory import unavailable


def state(value: float, n: int = 6, size: int = 64) -> dict:
    return {"model": {f"w{i}": torch.full((size, size), value) for i in range(n)},
            "big": torch.full((512, 512), value), "step": int(value)}


def assert_holds(where, value: float, n: int = 6) -> None:
    out = zarrckpt.load_state_dict(where)
    assert out["step"] == int(value)
    assert torch.equal(out["big"], torch.full((512, 512), value))
    for i in range(n):
        assert torch.equal(out["model"][f"w{i}"], torch.full((64, 64), value)), i


# ------------------------------------------------------------------- conformance


@pytest.fixture(params=["file", "fault"])
def store(request, tmp_path) -> Storage:
    if request.param == "file":
        return open_storage(tmp_path / "loc")
    return FaultStorage()


def _metadata(sharded: bool) -> dict:
    plain = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    codecs = plain if not sharded else [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [4, 8], "codecs": plain, "index_codecs": plain, "index_location": "end"}}]
    return {"zarr_format": 3, "node_type": "array", "shape": [20, 16], "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [8, 16]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0.0, "codecs": codecs}


def test_open_storage_returns_a_storage_as_it_is(store):
    assert open_storage(store) is store
    assert isinstance(open_storage("memory://conformance/shorthand"), Storage)


def test_documents(store):
    store.make_dir()
    assert store.read_bytes("zarr.json")[0] is None and store.read_json("zarr.json") is None
    assert store.get("zarr.json").result() is None
    _, absent = store.read_bytes("zarr.json")
    assert store.write_atomic("zarr.json", b'{"a": 1}', if_equal=absent)
    assert not store.write_atomic("zarr.json", b'{"a": 2}', if_equal=absent)  # no longer absent
    data, gen = store.read_bytes("zarr.json")
    assert data == b'{"a": 1}' and store.read_json("zarr.json") == {"a": 1}
    assert store.get("zarr.json").result() == b'{"a": 1}'
    assert store.read_if_changed("zarr.json", gen) is None
    assert store.write_atomic("zarr.json", b'{"a": 3}', if_equal=gen)
    assert not store.write_atomic("zarr.json", b'{"a": 4}', if_equal=gen)  # stale
    changed = store.read_if_changed("zarr.json", gen)
    assert changed is not None and changed[0] == b'{"a": 3}' and changed[1] != gen
    assert store.write_atomic("zarr.json", b"[1]")  # unconditional
    with pytest.raises(zarrckpt.FormatError, match="JSON object"):
        store.read_json("zarr.json")
    store.put("bad.json", b"{").result()
    with pytest.raises(zarrckpt.FormatError, match="not valid JSON"):
        store.read_json("bad.json")


def test_put_and_plain_chunks(store):
    store.put("a/zarr.json", b"{}").result()
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    store.write_plain_chunk("a", (0, 1), data).result()
    store.write_plain_chunk("s", (), np.array(7, np.int64)).result()
    store.close()
    stored, _ = store.read_bytes("a/c/0/1")
    assert stored == data.tobytes() + crc32c.crc32c(data.tobytes()).to_bytes(4, "little")
    assert store.read_bytes("s/c")[0][:8] == np.array(7, np.int64).tobytes()


def test_listing_clear_and_remove(store):
    assert store.is_empty() and store.list_children() == [] and store.list_keys() == []
    store.make_dir()
    for key in ("zarr.json", "b/zarr.json", "b/c/0", "a/x"):
        store.put(key, b"1").result()
    store.flush()
    assert store.exists() and not store.is_empty()
    assert store.list_children() == ["a", "b", "zarr.json"]
    assert store.list_keys() == ["a/x", "b/c/0", "b/zarr.json", "zarr.json"]
    store.clear(keep=("zarr.json",))
    assert store.list_keys() == ["zarr.json"]
    store.remove()
    assert store.is_empty() and store.list_keys() == []


def test_child_name_and_identity(store):
    child = store.child("step_00000001")
    assert isinstance(child, type(store)) and child.name == "step_00000001"
    assert child.url == f"{store.url.rstrip('/')}/step_00000001"
    assert child.options == store.options
    child.make_dir()
    assert child.write_atomic("zarr.json", b"{}")
    assert store.list_children() == ["step_00000001"]
    assert store.read_bytes("step_00000001/zarr.json")[0] == b"{}"
    ident = store.identity()
    json.dumps(ident)
    assert ident == open_storage(store.url).identity()  # the same place, however reached
    assert ident != child.identity()
    assert "aws_credentials" not in json.dumps(ident)


def test_kind_of_location(store):
    if isinstance(store, FaultStorage):  # memory: an object store's rules (no rename)
        assert not store.can_rename and store.local_path is None
        with pytest.raises(NotImplementedError):
            store.sibling("x")
    else:
        assert store.can_rename and store.local_path.endswith("/loc/")
        assert store.sibling("x").local_path.endswith("/x/")
    with store.parent_lock():
        pass


@pytest.mark.parametrize("sharded", [False, True])
def test_arrays(store, sharded):
    md = _metadata(sharded)
    store.put("w/zarr.json", json.dumps(md).encode()).result()
    data = np.arange(20 * 16, dtype=np.float32).reshape(20, 16)
    arr = store.open_for_write("w", md).result()
    assert arr.shape == (20, 16)
    futures = [arr.write(((a, min(a + 8, 20)), (0, 16)), data[a:a + 8], stable=True) for a in (0, 8, 16)]
    for f in futures:
        f.result()
    store.close()
    store.flush()
    arr = store.open_for_read("w", md).result()
    assert np.array_equal(arr.read().result(), data)
    out = np.zeros((20, 16), np.float32)
    arr.read_into(((3, 17), (2, 9)), out[3:17, 2:9]).result()
    assert np.array_equal(out[3:17, 2:9], data[3:17, 2:9])
    assert np.array_equal(arr.read(((0, 2), (0, 2))).result(), data[:2, :2])
    assert store.list_keys() == ["w/c/0/0", "w/c/1/0", "w/c/2/0", "w/zarr.json"]


def test_a_missing_chunk_is_an_error_not_zeros(store):
    md = _metadata(False)
    arr = store.open_for_read("w", md).result()
    with pytest.raises(Exception) as ei:
        arr.read(((0, 8), (0, 16))).result()
    assert isinstance(zarrckpt.storage.translate_error(ei.value, "w"), zarrckpt.CorruptChunkError)


def test_the_same_checkpoint_on_both(store, tmp_path):
    zarrckpt.save(state(1.0), store, inner_chunk_bytes=64 << 10)
    assert_holds(store, 1.0)
    assert verify(store).ok


# ------------------------------------------------------------------- faults


def test_a_failed_put_fails_the_save_and_leaves_the_location_as_it_was(tmp_path):
    """File-system rules (the fault store wraps a directory): the save raises the disk's
    error, and the location holds what it held before, here a committed checkpoint."""
    store = FaultStorage(tmp_path / "c")
    zarrckpt.save(state(1.0), store, pack_bytes=0)
    store.fail(ops="put", keys="*w3/c/*", error=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(zarrckpt.StorageError, match="w3.*no space left") as ei:
        zarrckpt.save(state(2.0), store, pack_bytes=0, overwrite=True)
    assert ei.value.errno == errno.ENOSPC
    failed = [e.key for e in store.events if e.error is not None]  # in the save's own directory
    assert failed and all(k.startswith("../.zarrckpt-") and k.endswith("/model/w3/c/0/0") for k in failed)
    store.heal()
    assert_holds(store, 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_failed_claim_leaves_an_object_store_as_it_was():
    store = FaultStorage()
    store.fail(ops="write_atomic", error=unavailable())
    with pytest.raises(zarrckpt.StorageError, match="unreachable"):
        zarrckpt.save(state(1.0), store)
    assert store.list_keys() == []  # the claim is the first write: nothing was written
    store.heal()
    zarrckpt.save(state(1.0), store)
    assert_holds(store, 1.0)


def test_fail_times_then_succeeds():
    store = FaultStorage().fail(ops="read_bytes", keys="x", times=2)
    for _ in range(2):
        with pytest.raises(zarrckpt.StorageError, match="I/O error") as ei:
            store.read_bytes("x")
        assert ei.value.errno == errno.EIO
    assert store.read_bytes("x")[0] is None
    assert store.counts["read_bytes"] == 3


@pytest.mark.parametrize("leaf", ["big", "model/w2"])  # a shard through TensorStore; a small chunk
def test_a_truncated_chunk_is_refused_on_load(leaf):
    store = FaultStorage()
    store.truncate(keys=f"{leaf}/c/*", to=100)
    zarrckpt.save(state(1.0), store, pack_bytes=0, inner_chunk_bytes=64 << 10)  # a torn write reports success
    store.heal()
    assert len(store.read_bytes(f"{leaf}/c/0/0")[0]) == 100
    with pytest.raises(zarrckpt.CorruptChunkError, match=leaf.split("/")[-1]):
        zarrckpt.load_state_dict(store)
    report = verify(store)
    assert not report.ok and {p.array for p in report.problems} == {leaf}


@pytest.mark.parametrize("where", ["memory", "file"])
def test_dying_mid_save_commits_nothing_and_a_retry_succeeds(where, tmp_path):
    store = FaultStorage(tmp_path / "c" if where == "file" else None)
    store.die_after(5)  # the claim, group documents, then a few chunks
    with pytest.raises(zarrckpt.StorageError, match="unreachable or failing"):
        zarrckpt.save(state(1.0), store, pack_bytes=0)
    with pytest.raises(zarrckpt.StorageError):
        store.read_bytes("zarr.json")  # dead for every operation, reads too
    store.heal()
    with pytest.raises((zarrckpt.IncompleteCheckpointError, zarrckpt.CheckpointNotFoundError)):
        zarrckpt.load_state_dict(store)
    # in place (object stores) the dead save's claim stays: only overwrite=True takes it over
    zarrckpt.save(state(2.0), store, pack_bytes=0, overwrite=where == "memory")
    assert_holds(store, 2.0)


def test_a_slow_store_still_completes_a_save():
    store = FaultStorage().slow(0.02, ops="writes")
    t0 = time.monotonic()
    zarrckpt.save(state(1.0), store, pack_bytes=0)
    assert time.monotonic() - t0 >= 0.02 * 3  # the claim, the commit and the writes between
    writes = [e for e in store.events if e.op in ("put", "write", "write_atomic")]
    assert writes and all(e.end - e.start >= 0.02 for e in writes)
    assert_holds(store, 1.0)


def test_children_and_siblings_share_the_faults(tmp_path):
    store = FaultStorage(tmp_path / "c")
    child, sibling = store.child("x"), store.sibling("y")
    child.fail(ops="put", keys="../y/*")
    with pytest.raises(OSError):
        sibling.put("k", b"1").result()
    child.put("k", b"1").result()
    assert store.counts["put"] == 2 and sibling.counts is store.counts
    with pytest.raises(ValueError, match="unknown operation"):
        store.slow(1.0, ops="wirte")
