"""Faults on one process (issue 6): a failed save stops writing before it raises, an
overwrite keeps the old checkpoint until the new one commits, concurrent writers and
readers, full and read-only disks, hostile inputs. Multi-rank faults: test_faults_dist.py."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import crc32c
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.storage import FaultStorage, translate_error

TESTS = os.path.dirname(os.path.abspath(__file__))


def state(value: float, n: int = 8, size: int = 64) -> dict:
    return {"model": {f"w{i}": torch.full((size, size), value) for i in range(n)}, "step": int(value)}


def assert_holds(path, value: float, n: int = 8) -> None:
    out = zarrckpt.load_state_dict(path)
    assert out["step"] == int(value)
    for i in range(n):
        assert torch.equal(out["model"][f"w{i}"], torch.full_like(out["model"][f"w{i}"], value)), i


# ------------------------------------------------------------- a failed save stops


def test_failed_save_waits_for_every_write_it_issued(tmp_path):
    """With a slow disk, writes still queued when one fails must not land after save raises
    (they used to overwrite a retry that had committed meanwhile)."""
    store = FaultStorage(tmp_path / "c").slow(0.05, ops="put")
    store.fail(ops="put", keys="*/w3/c/*", error=OSError(errno.EIO, "I/O error"))
    with pytest.raises(zarrckpt.StorageError, match="w3") as ei:
        zarrckpt.save(state(1.0, n=16), store, pack_bytes=0)
    raised_at = time.monotonic()
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.EIO
    time.sleep(0.3)
    done_at = [e.end for e in store.events if e.op == "put" and e.error is None]
    assert done_at and max(done_at) <= raised_at  # nothing completed after the raise
    assert not os.listdir(tmp_path)  # and the save left nothing behind


def test_retry_after_failed_save_holds_its_own_values(tmp_path):
    store = FaultStorage(tmp_path / "c").slow(0.01, ops="put")
    store.fail(ops="put", keys="*/w5/c/0/0", error=OSError(errno.EIO, "I/O error"))
    with pytest.raises(zarrckpt.StorageError):
        zarrckpt.save(state(1.0, n=16), store, pack_bytes=0)
    store.heal().slow(0.01, ops="put")
    zarrckpt.save(state(2.0, n=16), store, pack_bytes=0)
    time.sleep(0.3)
    assert_holds(tmp_path / "c", 2.0, n=16)


# ------------------------------------------------------------- overwrite


@pytest.mark.parametrize("bad", ["meta", "sparse", "quantized", "deep", "nested_key_type"])
def test_overwrite_validates_every_leaf_before_touching_the_old_checkpoint(tmp_path, bad):
    zarrckpt.save(state(1.0), tmp_path / "c")
    new = state(2.0)
    if bad == "meta":
        new["model"]["w0"] = torch.empty(64, 64, device="meta")
    elif bad == "sparse":
        new["model"]["w0"] = torch.eye(64).to_sparse()
    elif bad == "quantized":
        new["model"]["w0"] = torch.quantize_per_tensor(torch.ones(64, 64), 0.1, 0, torch.quint8)
    elif bad == "deep":
        deep: dict = {}
        node = deep
        for _ in range(5000):
            node["x"] = {}
            node = node["x"]
        new["deep"] = deep
    else:
        new["model"][("tuple", "key")] = torch.ones(1)
    with pytest.raises((zarrckpt.UnsupportedValueError, RecursionError, zarrckpt.ZarrckptError)) as ei:
        zarrckpt.save(new, tmp_path / "c", overwrite=True)
    assert isinstance(ei.value, zarrckpt.ZarrckptError), type(ei.value)
    assert_holds(tmp_path / "c", 1.0)
    assert os.listdir(tmp_path) == ["c"]


def test_overwrite_keeps_old_checkpoint_loadable_until_commit(tmp_path, monkeypatch):
    zarrckpt.save(state(1.0), tmp_path / "c")
    from zarrckpt.engine import commit as _commit

    seen = {}
    real = _commit.publish

    def spy(target, root):
        seen["before"] = zarrckpt.load_state_dict(tmp_path / "c")["step"]  # old one, still whole
        real(target, root)

    monkeypatch.setattr(_commit, "publish", spy)
    zarrckpt.save(state(2.0), tmp_path / "c", overwrite=True)
    assert seen["before"] == 1
    assert_holds(tmp_path / "c", 2.0)
    assert os.listdir(tmp_path) == ["c"]  # the replaced data is gone


def test_overwrite_failing_mid_write_leaves_old_checkpoint(tmp_path):
    store = FaultStorage(tmp_path / "c")
    zarrckpt.save(state(1.0), store)
    store.fail(ops="put", error=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(zarrckpt.StorageError, match="no space left") as ei:
        zarrckpt.save(state(2.0), store, overwrite=True, pack_bytes=0)
    assert ei.value.errno == errno.ENOSPC
    store.heal()
    assert_holds(tmp_path / "c", 1.0)
    assert os.listdir(tmp_path) == ["c"]


def test_leftovers_of_a_crashed_save_do_not_block_the_path(tmp_path):
    # what a save killed before its commit leaves: a pending claim and its own directory
    zarrckpt.save(state(1.0), tmp_path / ".c.zarrckpt-0123456789abcdef0123456789abcd")
    os.makedirs(tmp_path / "c")
    root = {"zarr_format": 3, "node_type": "group", "attributes": {"zarrckpt": {
        "format": "zarrckpt", "version": "1.0", "state": "pending", "save_id": "x" * 30,
        "world_size": 1, "created": "2026-01-01T00:00:00Z", "writer": {}}}}
    (tmp_path / "c" / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load_state_dict(tmp_path / "c")
    zarrckpt.save(state(2.0), tmp_path / "c")  # no overwrite needed for an interrupted save
    assert_holds(tmp_path / "c", 2.0)


def test_object_store_overwrite_interrupted_in_clearing_is_reusable():
    url = FaultStorage()  # memory: in place, as on S3; clear deletes key by key
    zarrckpt.save(state(1.0), url)
    keys = url.list_keys()
    url.die_after(1 + (len(keys) - 1) // 2)  # the root un-committed, then half of the deletes
    with pytest.raises(zarrckpt.StorageError, match="unreachable"):
        zarrckpt.save(state(2.0), url, overwrite=True)
    url.heal()
    assert 1 < len(url.list_keys()) < len(keys)  # died while clearing
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load_state_dict(url)  # the root stayed: an interrupted save, not foreign data
    with pytest.raises(zarrckpt.CheckpointExistsError, match="unfinished save"):
        zarrckpt.save(state(3.0), url)  # in place, it might still be running ...
    zarrckpt.save(state(3.0), url, overwrite=True)  # ... and with overwrite=True it is reused
    assert_holds(url, 3.0)


# ------------------------------------------------------------- two writers, one path


def _writer(path: str, value: float, go, q) -> None:
    sys.path.insert(0, os.path.dirname(TESTS))
    import torch as _torch

    import zarrckpt as z

    st = {"model": {f"w{i}": _torch.full((256, 256), value) for i in range(24)}, "step": int(value)}
    go.wait()
    try:
        z.save(st, path, pack_bytes=0)
        q.put((value, "ok"))
    except z.ZarrckptError as e:
        q.put((value, type(e).__name__))


def test_two_jobs_saving_to_one_path(tmp_path):
    ctx = mp.get_context("spawn")
    for trial in range(4):
        path = str(tmp_path / f"t{trial}")
        go, q = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(path, v, go, q)) for v in (1.0, 2.0)]
        for p in procs:
            p.start()
        time.sleep(2.0)  # both imported and waiting
        go.set()
        for p in procs:
            p.join(120)
        outcomes = dict(q.get(timeout=5) for _ in procs)
        winners = [v for v, o in outcomes.items() if o == "ok"]
        assert len(winners) == 1, outcomes
        loser = next(o for v, o in outcomes.items() if o != "ok")
        assert loser in ("ConcurrentSaveError", "CheckpointExistsError"), outcomes
        out = zarrckpt.load_state_dict(path)
        assert out["step"] == int(winners[0])
        for w in out["model"].values():
            assert torch.equal(w, torch.full((256, 256), winners[0]))
        assert sorted(os.listdir(tmp_path / "")) == sorted(f"t{i}" for i in range(trial + 1))


# ------------------------------------------------------------- readers across an overwrite


def test_reader_across_an_overwrite_is_told(tmp_path, monkeypatch):
    zarrckpt.save(state(1.0, size=512), tmp_path / "c", pack_bytes=0)
    from zarrckpt.api import load as _load

    real = _load._Reads.finish

    def overwrite_midway(self):
        zarrckpt.save(state(2.0, size=512), tmp_path / "c", overwrite=True, pack_bytes=0)
        real(self)

    monkeypatch.setattr(_load._Reads, "finish", overwrite_midway)
    target = {"model": {f"w{i}": torch.zeros(512, 512) for i in range(8)}, "step": 0}
    with pytest.raises(zarrckpt.CheckpointChangedError, match="replaced while it was being read"):
        zarrckpt.load(target, tmp_path / "c")


def test_expanded_target_is_refused(tmp_path):
    zarrckpt.save({"w": torch.arange(8.0).reshape(2, 4)}, tmp_path / "c")
    target = {"w": torch.zeros(1, 4).expand(2, 4)}
    with pytest.raises(zarrckpt.StateDictMismatchError, match="'w'.*share memory"):
        zarrckpt.load(target, tmp_path / "c")
    strided = torch.zeros(4, 8)[:, ::2].t()  # strided but not overlapping: fine
    out = {"w": strided[:2]}
    zarrckpt.load(out, tmp_path / "c")
    assert torch.equal(out["w"], torch.arange(8.0).reshape(2, 4))


def test_meta_targets_are_materialized(tmp_path):
    zarrckpt.save({"w": torch.arange(6.0), "b": torch.ones(2)}, tmp_path / "c")
    target = {"w": torch.empty(6, device="meta"), "b": torch.zeros(2)}
    out = zarrckpt.load(target, tmp_path / "c")
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], torch.arange(6.0))
    assert torch.equal(out["b"], torch.ones(2))


# ------------------------------------------------------------- storage errors


@contextlib.contextmanager
def tmpfs(path, size: str):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_is_a_storage_error_and_keeps_the_old_checkpoint(tmp_path):
    with tmpfs(tmp_path / "small", "2m") as d:
        zarrckpt.save({"w": torch.ones(1000)}, d / "c")
        big = {"w": torch.ones(1000), "huge": torch.ones(1 << 20)}  # 4 MiB > 2 MiB
        with pytest.raises(zarrckpt.StorageError) as ei:
            zarrckpt.save(big, d / "c", overwrite=True)
        assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC, ei.value
        assert "no space" in str(ei.value) or "full" in str(ei.value)
        assert torch.equal(zarrckpt.load_state_dict(d / "c")["w"], torch.ones(1000))
        assert os.listdir(d) == ["c"]


def test_read_only_mount_is_a_storage_error(tmp_path):
    with tmpfs(tmp_path / "ro", "2m") as d:
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        with pytest.raises(zarrckpt.StorageError, match="read-only") as ei:
            zarrckpt.save({"w": torch.ones(10)}, d / "c")
        assert isinstance(ei.value, OSError) and ei.value.errno == errno.EROFS


def test_status_codes_decide_the_error_class(tmp_path):
    zarrckpt.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, tmp_path / "c", pack_bytes=0)
    chunk = next(os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "c" / "w") for f in fs
                 if f != "zarr.json")
    data = bytearray(open(chunk, "rb").read())
    data[10] ^= 0xFF
    open(chunk, "wb").write(bytes(data))
    with pytest.raises(zarrckpt.CorruptChunkError, match="'w'.*checksum"):
        zarrckpt.load_state_dict(tmp_path / "c")
    # a message that merely mentions "missing" is not a missing chunk
    e = translate_error(ValueError("INVALID_ARGUMENT: field 'missing_thing' is bad"), "w", "write")
    assert isinstance(e, zarrckpt.StorageError) and not isinstance(e, zarrckpt.CorruptChunkError)
    e = translate_error(ValueError("RESOURCE_EXHAUSTED: quota"), "w", "write")
    assert isinstance(e, zarrckpt.StorageError) and e.errno == errno.ENOSPC


def test_unreachable_object_store_fails_within_bounded_time(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    t0 = time.monotonic()
    with pytest.raises(zarrckpt.StorageError, match="unreachable|failing|storage"):
        zarrckpt.save({"w": torch.ones(4)}, "s3://zarrckpt-test-bucket/x",
                      storage=zarrckpt.StorageOptions(request_retries=2))
    with pytest.raises(zarrckpt.ZarrckptError):
        zarrckpt.load_state_dict("s3://zarrckpt-test-bucket/x")
    assert time.monotonic() - t0 < 60


def test_memory_urls_outlive_the_call():
    zarrckpt.save({"w": torch.arange(5.0), "step": 7}, "memory://faults/mem")
    out = zarrckpt.load_state_dict("memory://faults/mem")
    assert out["step"] == 7 and torch.equal(out["w"], torch.arange(5.0))


def test_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    zarrckpt.save({"w": torch.ones(3)}, "~/ckpt")
    assert (tmp_path / "ckpt" / "zarr.json").exists()
    assert torch.equal(zarrckpt.load_state_dict("~/ckpt")["w"], torch.ones(3))


# ------------------------------------------------------------- inputs


@pytest.mark.parametrize("pack_bytes", [0, 65536])
def test_bytesio_leaves_round_trip(tmp_path, pack_bytes):
    buf = io.BytesIO(b"\x00\x01 some extra state \xff" * 10)
    zarrckpt.save({"extra": buf, "n": 1}, tmp_path / "c", pack_bytes=pack_bytes)
    out = zarrckpt.load_state_dict(tmp_path / "c")
    assert isinstance(out["extra"], io.BytesIO) and out["extra"].getvalue() == buf.getvalue()
    target = {"extra": io.BytesIO(), "n": 0}
    zarrckpt.load(target, tmp_path / "c")
    assert target["extra"].getvalue() == buf.getvalue() and target["n"] == 1


def test_async_saves_from_two_threads_are_not_mixed(tmp_path):
    results = {}

    def go(value: float) -> None:
        sd = {f"w{i}": torch.full((128, 128), value) for i in range(16)}
        results[value] = zarrckpt.async_save(sd, tmp_path / f"v{value}").result(timeout=120)

    for _ in range(3):
        threads = [threading.Thread(target=go, args=(v,)) for v in (1.0, 2.0, 3.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for v in (1.0, 2.0, 3.0):
            out = zarrckpt.load_state_dict(tmp_path / f"v{v}")
            assert all(torch.equal(w, torch.full((128, 128), v)) for w in out.values()), v
        for v in (1.0, 2.0, 3.0):
            import shutil

            shutil.rmtree(tmp_path / f"v{v}")


def test_reserve_staging_before_the_first_async_save(tmp_path):
    from zarrckpt.distributed import staging

    sd = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    zarrckpt.release_staging()
    n = zarrckpt.reserve_staging(sd)
    assert n >= 256 * 256 * 4 + 256 * 4
    ptr = staging.shared_arena()._buf.data_ptr()
    zarrckpt.async_save(sd, tmp_path / "c").result(timeout=60)
    assert staging.shared_arena()._buf.data_ptr() == ptr  # no allocation in the first save


def test_async_save_then_exit_without_waiting_commits_and_warns(tmp_path):
    code = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(TESTS)!r})
import zarrckpt
from zarrckpt.storage import FaultStorage
store = FaultStorage({str(tmp_path / 'c')!r}).slow(0.02, ops="put")
zarrckpt.async_save({{f"w{{i}}": torch.full((64, 64), 5.0) for i in range(40)}}, store, pack_bytes=0)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "async save" in r.stderr and "in flight" in r.stderr, r.stderr
    assert r.stderr.count("in flight") == 1, r.stderr  # once, not again through logging
    out = zarrckpt.load_state_dict(tmp_path / "c")
    assert len(out) == 40 and all(torch.equal(v, torch.full((64, 64), 5.0)) for v in out.values())


# ------------------------------------------------------------- nothing is a pickle


def test_every_stored_file_is_json_or_a_checksummed_chunk(tmp_path):
    sd = {"w": torch.randn(64, 64), "big": torch.randn(1024, 1024), "b": b"raw", "n": {"x": 1},
          "small": [torch.ones(3), torch.zeros(2)]}
    zarrckpt.save(sd, tmp_path / "c", inner_chunk_bytes=64 << 10)
    seen = 0
    for root, _, files in os.walk(tmp_path / "c"):
        for f in files:
            data = open(os.path.join(root, f), "rb").read()
            rel = os.path.relpath(os.path.join(root, f), tmp_path / "c")
            if f == "zarr.json":
                json.loads(data)  # JSON, nothing else
                continue
            # a chunk (<array>/c/<i>/...): plain [bytes, crc32c], or a shard whose index
            # (at the end) carries its own crc32c; nothing else is stored
            array_dir, _, _ = rel.partition("/c/")
            doc = json.loads((tmp_path / "c" / array_dir / "zarr.json").read_text())
            assert doc["node_type"] == "array", rel
            codecs = doc["codecs"]
            if codecs[0]["name"] == "sharding_indexed":
                outer = doc["chunk_grid"]["configuration"]["chunk_shape"]
                n = int(np.prod([a // b for a, b in zip(outer, codecs[0]["configuration"]["chunk_shape"])]))
                index = data[-(16 * n + 4):]
                assert crc32c.crc32c(index[:-4]).to_bytes(4, "little") == index[-4:], rel
            else:
                assert [c["name"] for c in codecs] == ["bytes", "crc32c"], rel
                assert crc32c.crc32c(data[:-4]).to_bytes(4, "little") == data[-4:], rel
            seen += 1
    assert seen >= 2  # the sharded array and the pack


# ------------------------------------------------------------- file size limits


@pytest.mark.parametrize("chunk_io", ["direct", "tensorstore"])
def test_file_size_limit_is_a_storage_error_naming_the_array(tmp_path, chunk_io):
    """With RLIMIT_FSIZE below a chunk's size, creating the chunk file used to raise a bare
    OSError(EFBIG) from os.ftruncate, outside the storage error translation."""
    code = f"""
import resource, signal, sys, torch
sys.path.insert(0, {os.path.dirname(TESTS)!r})
import zarrckpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    zarrckpt.save({{"small": torch.ones(4), "big": torch.ones(1 << 20)}}, {str(tmp_path / 'c')!r},
                  pack_bytes=0, storage=zarrckpt.StorageOptions(chunk_io={chunk_io!r}))
except BaseException as e:
    print(type(e).__name__, isinstance(e, zarrckpt.StorageError), getattr(e, "errno", None), e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cls, is_storage, err, msg = r.stdout.split(" ", 3)
    assert cls == "StorageError" and is_storage == "True", r.stdout
    assert "'big'" in msg and "too large" in msg.lower(), r.stdout
    if chunk_io == "direct":
        assert int(err) == errno.EFBIG
    assert os.listdir(tmp_path) == []  # the path is as it was before the save
