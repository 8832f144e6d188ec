"""Incremental managers with tiers (issue 31 item 4): ``CheckpointManager(..., local_dir=...,
incremental=True)``. A node's local copy links the chunks that did not change from its
newest complete copy of the run, and a promotion links (file systems) the chunk files the
previous committed persistent step holds with the same content instead of sending them.
Every step stays a complete, plain checkpoint: loaded bit for bit after the others are
deleted. A manager that is not incremental links nothing (the control: the same checks
fail there)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import zarrckpt
import zarrckpt.inspect
from zarrckpt.format import documents as fmt


def _frozen() -> dict:
    g = torch.Generator().manual_seed(7)
    return {f"f{i}": torch.randn(256, 64, generator=g) for i in range(6)}


def _state(step: int) -> dict:
    return {**_frozen(), "trained": torch.full((256, 64), float(step)), "step": step}


def _chunk_files(step_dir: str) -> dict[str, os.stat_result]:
    out = {}
    for d, _, files in os.walk(step_dir):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), step_dir).replace(os.sep, "/")
            if "/c/" in rel or rel.endswith("/c"):
                out[rel] = os.stat(os.path.join(d, f))
    return out


def _shared(a: str, b: str) -> set[str]:
    """Chunk files of step dirs ``a`` and ``b`` that are one inode (hard links)."""
    fa, fb = _chunk_files(a), _chunk_files(b)
    return {k for k in fa if k in fb and (fa[k].st_ino, fa[k].st_dev) == (fb[k].st_ino, fb[k].st_dev)}


def _run(tmp_path, monkeypatch, incremental: bool, **kw) -> tuple[str, str, list]:
    monkeypatch.setenv("ZARRCKPT_NODE", "solo")
    local, persistent = str(tmp_path / "local"), str(tmp_path / "persistent")
    promotions = []
    with zarrckpt.CheckpointManager(persistent, local_dir=local, local_replicas=1, persist_every=1,
                                    local_keep_last=5, incremental=incremental, async_save=True, **kw) as mgr:
        for s in (1, 2, 3):
            fut = mgr.save(s, _state(s))
            fut.result()
            mgr.wait()
            promotions.append(getattr(fut, "promotion", None))
    return os.path.join(local, "solo"), persistent, promotions


def test_local_copies_and_promotions_link_what_did_not_change(tmp_path, monkeypatch):
    local, persistent, promotions = _run(tmp_path, monkeypatch, incremental=True)
    names = [fmt.step_name(s) for s in (1, 2, 3)]
    frozen = {k for k in _chunk_files(os.path.join(persistent, names[0])) if k.startswith("f")}
    assert frozen
    # the local tier: steps 2 and 3 link step 1's frozen chunks (the node's complete copy)
    assert _shared(os.path.join(local, names[0]), os.path.join(local, names[2])) >= frozen
    # the persistent root: promotions 2 and 3 link the step before's, the trained array is sent
    for a, b in ((0, 1), (1, 2)):
        shared = _shared(os.path.join(persistent, names[a]), os.path.join(persistent, names[b]))
        assert shared >= frozen, (a, b, shared)
        assert not any(k.startswith("trained") for k in shared)
    assert promotions[0]["bytes_linked"] == 0
    for p in promotions[1:]:
        assert p["bytes_linked"] >= 6 * 256 * 64 * 4 and p["bytes_copied"] < p["bytes_linked"], p
    # every step is plain and complete: deleting the others never breaks it
    def exact(name: str) -> None:
        sd = zarrckpt.load_state_dict(os.path.join(persistent, name))
        for k, v in _state(int(name[len("step_"):])).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(torch.as_tensor(sd[k]), v), (name, k)

    shutil.rmtree(os.path.join(persistent, names[1]))
    exact(names[0])
    exact(names[2])
    shutil.rmtree(os.path.join(persistent, names[0]))
    exact(names[2])
    assert zarrckpt.inspect.verify(os.path.join(persistent, names[2])).ok


def test_a_manager_that_is_not_incremental_links_nothing(tmp_path, monkeypatch):
    local, persistent, promotions = _run(tmp_path, monkeypatch, incremental=False)
    names = [fmt.step_name(s) for s in (1, 2, 3)]
    assert not _shared(os.path.join(local, names[0]), os.path.join(local, names[2]))
    assert not _shared(os.path.join(persistent, names[1]), os.path.join(persistent, names[2]))
    assert all(p.get("bytes_linked", 0) == 0 for p in promotions)


def test_a_changed_chunk_with_the_same_hash_is_sent_not_linked(tmp_path, monkeypatch):
    """A content hash that collides (a test double) does not link different bytes: the unit
    CRC-32Cs differ, so the promotion sends the file (spec §7.9's two checks)."""
    from zarrckpt.storage import content

    monkeypatch.setattr(content, "chunk_hash", lambda bodies: (sum(len(memoryview(b)) for b in bodies) * 0).to_bytes(16, "big"))
    local, persistent, promotions = _run(tmp_path, monkeypatch, incremental=True)
    names = [fmt.step_name(s) for s in (1, 2, 3)]
    shared = _shared(os.path.join(persistent, names[1]), os.path.join(persistent, names[2]))
    assert not any(k.startswith("trained") for k in shared), shared
    sd = zarrckpt.load_state_dict(os.path.join(persistent, names[2]))
    assert torch.equal(torch.as_tensor(sd["trained"]), torch.full((256, 64), 3.0))


def test_links_are_made_durable_one_by_one_with_fsync_each(tmp_path, monkeypatch):
    """fsync="each": every file a promotion links is fsynced (as a linking save does);
    with the default "end" the promotion's one syncfs covers them."""
    from zarrckpt.storage import content

    synced = []
    real = content.fsync_path
    monkeypatch.setattr(content, "fsync_path", lambda p: synced.append(p) or real(p))
    local, persistent, promotions = _run(tmp_path, monkeypatch, incremental=True,
                                         storage=zarrckpt.StorageOptions(fsync="each"))
    name = fmt.step_name(3)
    linked = _shared(os.path.join(persistent, fmt.step_name(2)), os.path.join(persistent, name))
    assert linked
    done = {os.path.relpath(p, persistent).replace(os.sep, "/") for p in synced}
    for rel in linked:  # made durable inside the promotion's own directory, before its commit
        assert any(d.endswith(rel) and d.startswith(".zarrckpt-") for d in done), (rel, sorted(done)[:5])
