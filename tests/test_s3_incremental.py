"""Incremental saves on a real S3 server (SeaweedFS on 127.0.0.1, started by the suite): an
unchanged chunk is a server-side copy of the previous checkpoint's object (spec §7.9,
``zarrckpt/storage/s3copy.py``), no byte of it through the node; every step stays whole
after the others are deleted; what protects it when the copies cannot be trusted or made."""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import pytest
import torch

import zarrckpt
from _s3 import S3Server
from zarrckpt.storage import _tensorstore, content, s3copy

pytest.importorskip("obstore")

ROWS = 512  # 512 x 1024 fp32 = 2 MiB per tensor: chunks above the small-chunk path (1 MiB), through TensorStore


def opts(srv: S3Server) -> zarrckpt.StorageOptions:
    return zarrckpt.StorageOptions(endpoint=srv.endpoint, region=srv.region, access_key_id=srv.access_key,
                                   secret_access_key=srv.secret_key, request_retries=2)


def state(trained: float, frozen: float = 1.0) -> dict:
    """Four frozen 2 MiB tensors, one trained one, a small one and a step."""
    g = torch.Generator().manual_seed(int(frozen * 10))
    return {"base": {f"w{i}": torch.randn(ROWS, 1024, generator=g) * frozen for i in range(4)},
            "adapter": torch.full((ROWS, 1024), trained), "small": torch.arange(7) + int(trained),
            "step": int(trained)}


def check(url: str, o, want: dict) -> None:
    got = zarrckpt.load_state_dict(url, storage=o)
    for i in range(4):
        assert torch.equal(got["base"][f"w{i}"], want["base"][f"w{i}"]), i
    assert torch.equal(got["adapter"], want["adapter"])
    assert torch.equal(got["small"], want["small"]) and got["step"] == want["step"]


@pytest.fixture
def writes(monkeypatch):
    """Boxes written through TensorStore (a copied chunk is not among them)."""
    boxes: list = []
    real = _tensorstore.TensorStoreArray._region

    def counted(self, box):
        boxes.append((self.key, box))
        return real(self, box)

    monkeypatch.setattr(_tensorstore.TensorStoreArray, "_region", counted)
    return boxes


def test_unchanged_chunks_are_copied_server_side(s3, writes):
    o = opts(s3)
    run = s3.url(s3.fresh_prefix() + "run")
    a, b = f"{run}/a", f"{run}/b"
    sa, sb = state(1.0), state(2.0)
    zarrckpt.save(sa, a, storage=o, content_hashes=True)
    before = s3copy.counters()
    writes.clear()
    rep = zarrckpt.save(sb, b, storage=o, incremental_from=a)
    after = s3copy.counters()
    frozen = 4 * ROWS * 1024 * 4
    assert rep["bytes_linked"] == frozen, rep
    assert after["chunks_copied"] - before["chunks_copied"] == 4
    assert after["bytes_copied"] - before["bytes_copied"] == frozen
    assert {k for k, _ in writes} == {"adapter"}  # the frozen chunks never went through TensorStore
    check(b, o, sb)
    # every step whole after the one it copied from is deleted; generic readers read it
    keys = s3.list_objects(prefix=_key(s3, a) + "/")
    assert len(keys) > 10
    for key in keys:
        s3.delete_object(None, key)
    check(b, o, sb)
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": s3.kvstore_spec(path=_key(s3, b) + "/base/w2/")}
    arr = ts.open(spec, open=True, read=True).result()
    np.testing.assert_array_equal(arr.read().result(), sb["base"]["w2"].numpy())


def _key(srv: S3Server, url: str) -> str:
    return url.split(f"s3://{srv.buckets[0]}/", 1)[1].rstrip("/")


def test_content_hashes_are_the_same_on_s3_and_on_disk(s3, tmp_path):
    """The hash of a chunk does not depend on the path that wrote it (TensorStore on S3, the
    direct writer on disk): steps on either are compared with the same records."""
    o = opts(s3)
    url = s3.url(s3.fresh_prefix() + "h")
    sd = state(3.0)
    zarrckpt.save(sd, url, storage=o, content_hashes=True)
    zarrckpt.save(sd, tmp_path / "h", content_hashes=True)
    roots = [zarrckpt.open(url, endpoint=o.endpoint, region=o.region, access_key_id=o.access_key_id,
                           secret_access_key=o.secret_access_key).info.raw, zarrckpt.open(tmp_path / "h").info.raw]
    hashes = [r["attributes"]["zarrckpt"]["digests"]["content"]["chunks"] for r in roots]
    assert hashes[0] == hashes[1] and len(hashes[0]) >= 6
    assert all(len(base64.b64decode(v)) % 16 == 0 for v in hashes[0].values())


def test_a_manager_copies_and_retention_keeps_every_step_whole(s3):
    o = opts(s3)
    url = s3.url(s3.fresh_prefix() + "m")
    m = zarrckpt.CheckpointManager(url, keep_last=1, incremental=True, storage=o)
    linked = []
    for step in (1, 2, 3):
        linked.append(m.save(step, state(float(step)))["bytes_linked"])
    assert linked[0] == 0 and linked[1] == linked[2] == 4 * ROWS * 1024 * 4
    assert m.steps() == [3]  # steps 1 and 2 deleted: 3 copied from 2, which copied from 1
    check(url.rstrip("/") + "/step_00000003", o, state(3.0))


def test_tier_promotions_copy_what_did_not_change(s3, tmp_path, monkeypatch):
    """An incremental manager with tiers (spec §7.8, "Incremental tiers"): each promotion to
    the bucket copies the unchanged chunks server-side from the step promoted before and
    sends only the rest; retention then deletes the older steps and the newest still loads
    bit for bit."""
    monkeypatch.setenv("ZARRCKPT_NODE", "solo")
    o = opts(s3)
    url = s3.url(s3.fresh_prefix() + "t")
    promotions = []
    with zarrckpt.CheckpointManager(url, local_dir=str(tmp_path / "local"), local_replicas=1, persist_every=1,
                                    keep_last=1, incremental=True, async_save=True, storage=o) as m:
        for step in (1, 2, 3):
            fut = m.save(step, state(float(step)))
            fut.result()
            m.wait()
            promotions.append(fut.promotion)
        assert m.steps() == [3]
    frozen = 4 * ROWS * 1024 * 4
    assert promotions[0]["bytes_linked"] == 0, promotions
    for p in promotions[1:]:
        assert "error" not in p and p["bytes_linked"] >= frozen and p["bytes_copied"] < frozen, p
    check(url.rstrip("/") + "/step_00000003", o, state(3.0))


def test_colliding_hashes_never_copy_different_bytes(s3, monkeypatch):
    """A content hash that always collides (a test double): the unit CRC-32Cs (spec §7.9
    check 4) still tell the changed chunks apart, so they are written, not copied."""
    o = opts(s3)
    run = s3.url(s3.fresh_prefix() + "x")
    zarrckpt.save(state(1.0), f"{run}/a", storage=o, content_hashes=True)
    monkeypatch.setattr(content, "chunk_hash", lambda bodies: (sum(1 for _ in bodies), b"\0" * 16)[1])
    zarrckpt.save(state(1.0), f"{run}/a2", storage=o, content_hashes=True)  # PREV's records from the double too
    sd = state(2.0, frozen=2.0)  # every value differs
    rep = zarrckpt.save(sd, f"{run}/b", storage=o, incremental_from=f"{run}/a2")
    assert rep["bytes_linked"] == 0
    check(f"{run}/b", o, sd)


def test_a_failed_copy_writes_the_chunk(s3, monkeypatch):
    import obstore

    o = opts(s3)
    run = s3.url(s3.fresh_prefix() + "f")
    zarrckpt.save(state(1.0), f"{run}/a", storage=o, content_hashes=True)

    def refuse(*a, **k):
        raise OSError("copy refused (test)")

    monkeypatch.setattr(obstore, "copy", refuse)
    before = s3copy.counters()["copy_failures"]
    sd = state(2.0)
    rep = zarrckpt.save(sd, f"{run}/b", storage=o, incremental_from=f"{run}/a")
    assert rep["bytes_linked"] == 0 and s3copy.counters()["copy_failures"] - before == 4
    check(f"{run}/b", o, sd)


def test_previous_replaced_during_the_save_commits_nothing(s3, monkeypatch):
    """Copies are of whatever PREV's keys hold when they are made: a PREV overwritten by
    another save while this one copied from it fails this save clearly, and nothing of it is
    committed; PREV's new contents are untouched."""
    from zarrckpt.readers import previous

    o = opts(s3)
    run = s3.url(s3.fresh_prefix() + "r")
    zarrckpt.save(state(1.0), f"{run}/a", storage=o, content_hashes=True)
    real = previous.Previous.confirm

    def replaced(self):
        zarrckpt.save(state(9.0, frozen=9.0), f"{run}/a", storage=o, overwrite=True)
        return real(self)

    monkeypatch.setattr(previous.Previous, "confirm", replaced)
    with pytest.raises(zarrckpt.ZarrckptError, match="changed while this save copied"):
        zarrckpt.save(state(2.0), f"{run}/b", storage=o, incremental_from=f"{run}/a")
    with pytest.raises(zarrckpt.ZarrckptError):
        zarrckpt.load_state_dict(f"{run}/b", storage=o)
    check(f"{run}/a", o, state(9.0, frozen=9.0))


def test_without_obstore_every_chunk_is_written_and_the_log_says_why(s3, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "obstore", None)
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    monkeypatch.setattr(s3copy, "_copiers", {})
    monkeypatch.setattr(s3copy, "_warned", set())
    o = opts(s3)
    run = s3.url(s3.fresh_prefix() + "n")
    zarrckpt.save(state(1.0), f"{run}/a", storage=o, content_hashes=True)
    sd = state(2.0)
    with caplog.at_level("WARNING", logger="zarrckpt"):
        rep = zarrckpt.save(sd, f"{run}/b", storage=o, incremental_from=f"{run}/a")
    assert rep["bytes_linked"] == 0
    assert "obstore is not installed" in caplog.text
    check(f"{run}/b", o, sd)
    json.dumps(rep)


def test_the_environment_does_not_redirect_or_resign_copies(s3, monkeypatch, writes):
    """obstore reads AWS_* variables of its own; the copier gives it the save's endpoint,
    region and keys, so a stray session token or endpoint changes nothing."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "not-this-one")
    monkeypatch.setenv("AWS_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(s3copy, "_copiers", {})
    o = opts(s3)
    run = s3.url(s3.fresh_prefix() + "e")
    zarrckpt.save(state(1.0), f"{run}/a", storage=o, content_hashes=True)
    before = s3copy.counters()
    sd = state(2.0)
    rep = zarrckpt.save(sd, f"{run}/b", storage=o, incremental_from=f"{run}/a")
    after = s3copy.counters()
    assert rep["bytes_linked"] == 4 * ROWS * 1024 * 4
    assert after["chunks_copied"] - before["chunks_copied"] == 4 and after["copy_failures"] == before["copy_failures"]
    check(f"{run}/b", o, sd)


def test_plain_saves_never_make_a_copier(s3, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "obstore", None)
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    monkeypatch.setattr(s3copy, "_copiers", {})
    monkeypatch.setattr(s3copy, "_warned", set())
    with caplog.at_level("WARNING", logger="zarrckpt"):
        zarrckpt.save(state(1.0), s3.url(s3.fresh_prefix() + "p"), storage=opts(s3), content_hashes=True)
    assert "copied" not in caplog.text and s3copy._copiers == {}


def test_a_cancelled_copy_or_write_waits_for_its_task():
    """An aborted save cancels what is in flight (storage/inflight.py, abort=True): the
    future of a chunk task stays pending until the task has ended (it reads the caller's
    data), and a task not yet at its write does not write."""
    import concurrent.futures as cf

    f = _tensorstore._Guarded()
    assert f.cancel() is False and not f.done()
    assert f.issue(lambda: pytest.fail("a cancelled task wrote")) is None
    f.end(_tensorstore._stopped())
    with pytest.raises(zarrckpt.StorageError, match="cancelled"):
        f.result(timeout=1)
    g = _tensorstore._Guarded()
    inner = cf.Future()
    assert g.issue(lambda: inner) is inner
    inner.add_done_callback(g.end_with)
    assert g.cancel() is False and inner.cancelled() and g.done()  # the write's cancel ends it
    with pytest.raises(cf.CancelledError):
        g.result(timeout=1)


def test_a_save_that_fails_between_copies_leaves_every_step_as_it_was(s3, monkeypatch):
    """The save fails after two copies (the third raises past the copier's own fallback, as a
    crash in it would: the error surfaces as it is): PREV
    is untouched and loads bit for bit, the new step is not committed, and the same save
    run again completes, copying."""
    o = opts(s3)
    run = s3.url(s3.fresh_prefix() + "k")
    sa = state(1.0)
    zarrckpt.save(sa, f"{run}/a", storage=o, content_hashes=True)
    real = s3copy.Copier.copy
    calls = []

    def third_fails(self, src, dst, nbytes, tried=None):
        calls.append(src)
        if len(calls) == 3:
            raise RuntimeError("connection lost (test)")
        return real(self, src, dst, nbytes, tried)

    monkeypatch.setattr(s3copy.Copier, "copy", third_fails)
    sb = state(2.0)
    with pytest.raises(RuntimeError, match="connection lost"):
        zarrckpt.save(sb, f"{run}/b", storage=o, incremental_from=f"{run}/a")
    check(f"{run}/a", o, sa)
    with pytest.raises(zarrckpt.ZarrckptError):
        zarrckpt.load_state_dict(f"{run}/b", storage=o)
    monkeypatch.setattr(s3copy.Copier, "copy", real)
    rep = zarrckpt.save(sb, f"{run}/b", storage=o, incremental_from=f"{run}/a", overwrite=True)
    assert rep["bytes_linked"] == 4 * ROWS * 1024 * 4
    check(f"{run}/b", o, sb)
