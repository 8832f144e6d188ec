"""Checkpoint tiers under faults (spec §7.8, issue 28 items 1-4): copies of another run, a
reschedule onto other hosts, one flipped byte in a replica or in the source of a fetch.
2 gloo ranks as 2 simulated nodes (ZARRCKPT_NODE); every restore is checked bit for bit.

* another run's copies under the same ``local_dir`` are never restored (their manifests
  name another persistent root), and the new run's saves are not counted against them;
* a restore lists the persistent root and takes its step when it is newer than the
  tiers' (a job that came back to hosts with stale tiers does not roll back);
* a damaged replica (same size, one byte flipped) is found when the load fails, verified
  against the digests of the manifest, un-claimed, and the step is taken from the next
  source: the peer's copy, else the persistent root, else an older step;
* a fetch verifies what it received before it commits the copy: bad bytes are never
  committed nor spread, and the next source is used."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from test_tiers import _restore, _run_save

N0, N1 = ["node0", "node1"], ["node2", "node3"]


def _manifest(local, node: str, step: int) -> dict:
    return json.loads((local / node / f"step_{step:08d}.tier.json").read_text())


def _flip(path, at: int | None = None) -> None:
    """Flip one byte of ``path`` (its middle by default), keeping its size."""
    size = os.path.getsize(path)
    at = size // 2 if at is None else at
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _chunk_of(m: dict, owner: str, avoid: set[str] = frozenset()) -> str:
    """The largest chunk file of node ``owner`` listed by manifest ``m`` (not one of ``avoid``)."""
    return max((f[1], f[0]) for f in m["files"][owner] if "/c/" in f[0] and f[0] not in avoid)[1]


def _ok(res, step: int, source: str | None = None) -> bool:
    return all(r is not None and r["step"] == step and r["exact"] and (source is None or r["source"] == source)
               for r in res)


def test_another_runs_copies_are_not_restored(clusters, tmp_path):
    """Issue 28 item 1: run2 (an empty persistent root) shares run1's local_dir: its
    restore finds nothing (not run1's step 4 from "local"); its own saves restore and are
    not deleted by local retention in favour of run1's newer steps."""
    local = tmp_path / "local"
    _run_save(clusters, 2, local, tmp_path / "run1", steps=(1, 2, 3, 4), persist_every=2, _nodes=N0)
    res = _restore(clusters, 2, local, tmp_path / "run1", persist_every=2, _nodes=N0)
    assert _ok(res, 4, "local"), res
    res = _restore(clusters, 2, local, tmp_path / "run2", persist_every=2, _nodes=N0)
    assert res == [None, None], res
    _run_save(clusters, 2, local, tmp_path / "run2", steps=(1,), persist_every=2, _nodes=N0)
    m = _manifest(local, "node0", 1)
    assert m["run"] == os.path.realpath(tmp_path / "run2"), m["run"]
    assert sorted(os.listdir(local / "node0")) == ["step_00000001", "step_00000001.tier.json"]  # run1's: gone
    res = _restore(clusters, 2, local, tmp_path / "run2", persist_every=2, _nodes=N0)
    assert _ok(res, 1, "local"), res


def test_reschedule_does_not_roll_back(clusters, tmp_path):
    """Issue 28 item 2: job A on node0/node1 saves 1-4 (2, 4 promoted); job B on node2/node3
    restores 4 from the persistent root and saves 5-8 (6, 8 promoted); job C back on
    node0/node1 restores 8 from the persistent root, not the stale 4 of its tiers; its
    next promoted step is promoted (not skipped as committed already)."""
    import zarrckpt

    local, persistent = tmp_path / "local", tmp_path / "persistent"
    kw = dict(persist_every=2, keep_last=2)
    _run_save(clusters, 2, local, persistent, steps=(1, 2, 3, 4), _nodes=N0, **kw)
    res = _restore(clusters, 2, local, persistent, _nodes=N1, **kw)
    assert _ok(res, 4, "persistent"), res
    _run_save(clusters, 2, local, persistent, steps=(5, 6, 7, 8), _nodes=N1, **kw)
    res = _restore(clusters, 2, local, persistent, _nodes=N0, **kw)
    assert _ok(res, 8, "persistent"), res
    _run_save(clusters, 2, local, persistent, steps=(9, 10), _nodes=N0, **kw)
    assert zarrckpt.CheckpointManager(str(persistent)).steps() == [8, 10]
    res = _restore(clusters, 2, local, persistent, _nodes=N0, **kw)
    assert _ok(res, 10, "local"), res


def test_flipped_byte_in_a_replica_falls_back(clusters, tmp_path):
    """Issue 28 item 3: one byte of one node's replica of the other's chunk of "b" flipped: the
    restore takes step 2 with those keys fetched again from their owner ("peers"), and the next
    restore is "local". With the same byte flipped in both copies, from the persistent
    root; with that gone too, the older step 1."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    kw = dict(persist_every=2, chunk_target_bytes=None, _nodes=N0)  # a chunk per shard
    _run_save(clusters, 2, local, persistent, steps=(1, 2), **kw)
    m = _manifest(local, "node1", 2)
    owner, rel = next((n, f[0]) for n in N0 for f in m["files"][n] if f[0].startswith("b/c/"))  # all read "b"
    holder = next(n for n in N0 if n != owner)
    _flip(local / holder / "step_00000002" / rel)
    for expect in ("peers", "local"):  # repaired by the first restore
        res = _restore(clusters, 2, local, persistent, **kw)
        assert _ok(res, 2, expect), (expect, res)
    _flip(local / holder / "step_00000002" / rel)
    _flip(local / owner / "step_00000002" / rel)
    res = _restore(clusters, 2, local, persistent, **kw)
    assert _ok(res, 2, "persistent"), res
    assert all(r["skipped"] for r in res), res  # the damaged copies, said
    shutil.rmtree(persistent)
    res = _restore(clusters, 2, local, persistent, **kw)
    assert _ok(res, 1, "local"), res


def test_fetch_never_commits_bad_bytes(clusters, tmp_path):
    """Issue 28 item 4: one byte of node1's own chunk flipped, node0 wiped: node0 fetches
    step 2 from node1, finds the bad file by its digest, commits nothing of it, and the
    restore takes step 2 from the persistent root; node0's copy of step 2 does not claim
    node1's keys and has no root. Without the persistent root: the older step 1 from the
    peers. Restarts keep working."""
    import zarrckpt

    local, persistent = tmp_path / "local", tmp_path / "persistent"
    kw = dict(persist_every=2, chunk_target_bytes=None, _nodes=N0)  # a chunk per shard
    _run_save(clusters, 2, local, persistent, steps=(1, 2), **kw)
    rel = _chunk_of(_manifest(local, "node1", 2), "node1")
    _flip(local / "node1" / "step_00000002" / rel, 100)
    shutil.rmtree(local / "node0")
    res = _restore(clusters, 2, local, persistent, **kw)
    assert _ok(res, 2, "persistent"), res
    copy = local / "node0" / "step_00000002"
    assert not (copy / "zarr.json").exists()
    m0 = _manifest(local, "node0", 2) if (local / "node0" / "step_00000002.tier.json").exists() else None
    assert m0 is None or ("node1" not in m0["held"] and not m0["complete"]), m0
    with pytest.raises(zarrckpt.CheckpointNotFoundError):
        zarrckpt.load_state_dict(str(copy))
    res = _restore(clusters, 2, local, persistent, **kw)
    assert _ok(res, 2, "persistent"), res
    shutil.rmtree(persistent)
    res = _restore(clusters, 2, local, persistent, **kw)
    assert _ok(res, 1), res


def test_manifests_follow_the_schema(clusters, tmp_path):
    """Every manifest written (after a save, and after a fetch completed a copy) validates
    against ``$defs/tierManifest``; its digests cover exactly the keys its files list, and
    are what :func:`tiers.key_digest` computes from the stored bytes."""
    from test_spec import assert_valid

    from zarrckpt.api import tiers

    local, persistent = tmp_path / "local", tmp_path / "persistent"
    kw = dict(persist_every=None, chunk_target_bytes=None, _nodes=N0)
    _run_save(clusters, 2, local, persistent, steps=(1, 2), local_replicas=0, **kw)
    res = _restore(clusters, 2, local, persistent, local_replicas=0, **kw)  # each fetches the other's keys
    assert _ok(res, 2, "peers"), res
    res = _restore(clusters, 2, local, tmp_path / "elsewhere", local_replicas=0, **kw)
    assert res == [None, None], res  # a manager of another persistent root uses none of them
    for node in N0:
        for step in (1, 2):
            m = _manifest(local, node, step)
            assert_valid("tierManifest", m, f"{node} step {step}")
            keys = {rel for files in m["files"].values() for rel, _ in files}
            assert set(m["digests"]["keys"]) == keys
            d = local / node / f"step_{step:08d}"
            for rel in keys:
                if rel in {f[0] for n in m["held"] for f in m["files"][n]}:
                    assert tiers.key_digest(rel, directory=str(d)) == m["digests"]["keys"][rel], rel
    bad = dict(_manifest(local, "node0", 2))
    del bad["run"]
    from test_spec import is_valid

    assert not is_valid("tierManifest", bad)


def rank_restore_wrong_shape(rank, world, local, persistent, nodes):
    """A restore into a target whose ``b`` has another shape: the load's own error."""
    import torch

    import zarrckpt
    from test_tiers import _state

    os.environ["ZARRCKPT_NODE"] = nodes[rank]
    target = _state(world, 0)
    target["b"] = torch.zeros(11)
    with zarrckpt.CheckpointManager(persistent, local_dir=local, local_replicas=1, persist_every=None) as mgr:
        try:
            mgr.restore(target)
        except zarrckpt.ZarrckptError as e:
            return type(e).__name__
    return None


def test_damaged_root_is_rewritten_and_a_mismatch_is_not_damage(clusters, tmp_path):
    """A flipped byte in one node's committed root of its copy: the load fails on its digest,
    the copies are verified, the root is removed and written again from the manifest, and
    the step restores from "local". A target that does not match is the load's own error:
    raised, with every copy left as it was (not un-claimed)."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    kw = dict(persist_every=None, _nodes=N0)
    _run_save(clusters, 2, local, persistent, steps=(1, 2), **kw)
    root = local / "node1" / "step_00000002" / "zarr.json"
    data = root.read_bytes()
    at = data.index(b'"step"')
    _flip(root, at + 1)
    res = _restore(clusters, 2, local, persistent, **kw)
    assert _ok(res, 2, "local") and all(len(r["skipped"]) == 1 for r in res), res
    assert root.read_bytes() == data
    got = clusters(2).run(rank_restore_wrong_shape, str(local), str(persistent), N0)
    assert got == ["ShapeMismatchError"] * 2, got
    for node in N0:
        m = _manifest(local, node, 2)
        assert m["complete"] and m["held"] == N0, m["held"]
