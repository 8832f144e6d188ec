"""Incremental saves (issue 31; spec §6.6.2, §7.9): chunk files whose content did not change
are hard-linked from the previous checkpoint; every step stays a complete, plain checkpoint."""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
import xxhash

import zarrckpt
from zarrckpt.storage import content as reuse  # noqa: E402
from zarrckpt.storage import _localfile
from zarrckpt.tools import inspect as zi

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"frozen": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(9)},  # 9 MiB
            "adapter": {"a": torch.randn(256, 1024, generator=g)},  # 1 MiB: 10 % of the bytes
            "bias": torch.randn(7, generator=g), "step": 1}


FROZEN = 9 * 256 * 1024 * 4 + 7 * 4  # the frozen matrices and the bias: every leaf but the adapter


def _zeros(sd: dict) -> dict:
    return {k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
            for k, v in sd.items()}


def _equal(a: dict, b: dict) -> bool:
    for k, v in a.items():
        if isinstance(v, dict):
            if not _equal(v, b[k]):
                return False
        elif isinstance(v, torch.Tensor):
            if not torch.equal(v, b[k]):
                return False
        elif v != b[k]:
            return False
    return True


def _loaded(path) -> dict:
    sd = _state()
    out = _zeros(sd)
    zarrckpt.load(out, path)
    return out


def _chunk_files(path) -> dict[str, os.stat_result]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            if f != "zarr.json":
                out[os.path.relpath(os.path.join(d, f), path)] = os.stat(os.path.join(d, f))
    return out


def _content(path) -> dict:
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)["attributes"]["zarrckpt"]["digests"].get("content")


def test_unchanged_chunks_are_linked_and_each_step_stands_alone(tmp_path):
    sd = _state()
    a, b = tmp_path / "a", tmp_path / "b"
    full = zarrckpt.save(sd, a, content_hashes=True)
    assert _content(a)["algorithm"] == "xxh3-128"
    sd["adapter"]["a"] += 1
    sd["step"] = 2
    rep = zarrckpt.save(sd, b, incremental_from=a)
    # 90 % of the bytes are frozen: at most 12 % of a full save's bytes are written (issue 31)
    assert rep["bytes_linked"] == FROZEN
    assert rep["bytes_written"] <= 0.12 * full["bytes_written"], (rep, full)
    fa, fb = _chunk_files(a), _chunk_files(b)
    assert fa.keys() == fb.keys()
    shared = {k for k in fb if fb[k].st_ino == fa[k].st_ino}
    assert shared == {k for k in fb if k.startswith(("frozen/", "bias/"))}, shared
    assert all(fb[k].st_nlink == 2 for k in shared)
    shutil.rmtree(a)  # deleting the other step never breaks this one
    assert _equal(_loaded(b), sd)
    assert zi.verify(str(b)).ok
    import zarr  # a generic reader sees a plain checkpoint
    g = zarr.open_group(str(b), mode="r")
    assert np.array_equal(g["frozen/w3"][...], sd["frozen"]["w3"].numpy())
    assert np.array_equal(g["adapter/a"][...], sd["adapter"]["a"].numpy())


def test_a_state_where_everything_changed_links_nothing(tmp_path):
    sd = _state()
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True)
    new = _state(seed=1)
    rep = zarrckpt.save(new, tmp_path / "b", incremental_from=tmp_path / "a")
    assert rep["bytes_linked"] == 0
    assert _equal(_loaded(tmp_path / "b"), new)


def test_a_colliding_hash_never_links_different_bytes(tmp_path, monkeypatch):
    """A hash double that says every chunk is equal: the unit CRC-32Cs still differ for
    changed chunks, which are written; unchanged ones (equal CRCs too) are linked."""
    def collide(bodies):
        for _ in bodies:  # the CRCs are computed as the bodies pass
            pass
        return b"\x00" * reuse.HASH_BYTES
    monkeypatch.setattr(reuse, "chunk_hash", collide)
    sd = _state()
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True)
    sd["adapter"]["a"] += 1
    rep = zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a")
    assert rep["bytes_linked"] == FROZEN  # the unchanged ones only
    shutil.rmtree(tmp_path / "a")
    assert _equal(_loaded(tmp_path / "b"), sd)


@pytest.mark.parametrize("change", ["dtype", "shape", "inner_chunks"])
def test_other_metadata_is_never_linked(tmp_path, change):
    sd = {"w": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)}
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True, inner_chunk_bytes=64 << 10)
    opts = {"inner_chunk_bytes": 64 << 10}
    if change == "dtype":
        sd = {"w": sd["w"].view(torch.int32)}  # the same bytes, another data type
    elif change == "shape":
        sd = {"w": sd["w"].reshape(128, 512)}  # the same bytes, another shape
    else:
        opts = {"inner_chunk_bytes": 32 << 10}
    rep = zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a", **opts)
    assert rep["bytes_linked"] == 0
    out = {"w": torch.zeros_like(sd["w"])}
    zarrckpt.load(out, tmp_path / "b")
    assert torch.equal(out["w"], sd["w"])


def test_a_previous_checkpoint_without_hashes_links_nothing_and_says_so(tmp_path, caplog):
    sd = _state()
    zarrckpt.save(sd, tmp_path / "a")  # no content hashes
    with caplog.at_level("WARNING", logger="zarrckpt"):
        rep = zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a")
    assert rep["bytes_linked"] == 0
    assert "records no content hashes" in caplog.text
    with caplog.at_level("WARNING", logger="zarrckpt"):
        rep = zarrckpt.save(sd, tmp_path / "c", incremental_from=tmp_path / "missing")
    assert rep["bytes_linked"] == 0 and "cannot be opened" in caplog.text
    assert _equal(_loaded(tmp_path / "c"), sd)


def test_the_recorded_hash_is_xxh3_128_of_the_decoded_units(tmp_path):
    """Spec §6.6.2, from the values alone: per chunk, XXH3-128 over its units' decoded bytes
    (padding = fill value) in C order of the units, canonical big-endian digest."""
    w = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    zarrckpt.save({"w": w}, tmp_path / "a", content_hashes=True, inner_chunk_bytes=4 * 4 * 4)
    doc = json.load(open(tmp_path / "a" / "w" / "zarr.json"))
    chunk = doc["chunk_grid"]["configuration"]["chunk_shape"]
    inner = doc["codecs"][0]["configuration"]["chunk_shape"]
    table = base64.b64decode(_content(tmp_path / "a")["chunks"]["w"])
    grid = [-(-s // c) for s, c in zip(w.shape, chunk)]
    assert len(table) == 16 * int(np.prod(grid))
    padded = np.zeros([g * c for g, c in zip(grid, chunk)], np.float32)
    padded[:10, :6] = w.numpy()
    for n, index in enumerate(np.ndindex(*grid)):
        h = xxhash.xxh3_128()
        per = [c // i for c, i in zip(chunk, inner)]
        for j in np.ndindex(*per):
            lo = [ci * c + ji * i for ci, c, ji, i in zip(index, chunk, j, inner)]
            if any(a >= s for a, s in zip(lo, w.shape)):
                continue  # wholly in the padding: not stored, not hashed
            h.update(padded[lo[0]:lo[0] + inner[0], lo[1]:lo[1] + inner[1]].tobytes())
        assert table[16 * n:16 * n + 16] == h.digest(), index


def test_a_rewritten_chunk_never_truncates_a_linked_file(tmp_path):
    """The direct writer creates chunk files with O_EXCL and unlinks what is there: a file
    shared with another step is never written in place."""
    sd = _state()
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True)
    zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a")
    files = _chunk_files(tmp_path / "a")
    key = next(k for k in files if k.startswith("frozen/w0"))
    before = open(tmp_path / "a" / key, "rb").read()
    arr = _localfile.LocalArray.__new__(_localfile.LocalArray)
    arr._dirs = set()
    _localfile.LocalArray._create(arr, str(tmp_path / "b" / key), 10)
    assert open(tmp_path / "a" / key, "rb").read() == before
    assert os.path.getsize(tmp_path / "b" / key) == 10


def test_manager_incremental_keeps_every_step_whole_under_retention(tmp_path):
    sd = _state()
    m = zarrckpt.CheckpointManager(tmp_path / "run", keep_last=2, incremental=True)
    written = []
    for step in range(1, 5):
        sd["adapter"]["a"] += 1
        sd["step"] = step
        written.append(m.save(step, sd)["bytes_written"])
    assert m.steps() == [3, 4]
    assert all(w <= 0.12 * written[0] for w in written[1:]), written
    # N checkpoints of the frozen case take about (1 + 0.12 N) x one on disk: count inodes once
    seen, total = set(), 0
    for d, _, files in os.walk(tmp_path / "run"):
        for f in files:
            st = os.stat(os.path.join(d, f))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    one = sum(st.st_size for st in _chunk_files(tmp_path / "run" / "step_00000004").values())
    assert total <= (1 + 0.12 * 2) * one * 1.05, (total, one)
    out = _zeros(sd)
    assert m.restore(out) == 4 and _equal(out, sd)
    shutil.rmtree(tmp_path / "run" / "step_00000004")
    out = _zeros(sd)
    zarrckpt.load(out, tmp_path / "run" / "step_00000003")
    assert torch.equal(out["frozen"]["w5"], sd["frozen"]["w5"])


def test_async_save_is_incremental_too(tmp_path):
    sd = _state()
    zarrckpt.async_save(sd, tmp_path / "a", content_hashes=True).result()
    sd["adapter"]["a"] += 1
    fut = zarrckpt.async_save(sd, tmp_path / "b", incremental_from=tmp_path / "a")
    fut.wait_staged()
    expect = _state()
    expect["adapter"]["a"] += 1
    sd["adapter"]["a"] += 100  # may change now
    rep = fut.result()
    assert rep["bytes_linked"] == FROZEN
    shutil.rmtree(tmp_path / "a")
    assert _equal(_loaded(tmp_path / "b"), expect)


def _killed_rank(path_a: str, path_b: str, after: int) -> None:
    """Save incrementally and die (SIGKILL-like os._exit) at a point: ``after`` links
    (an int), ``"write"`` (the first chunk file of changed data written) or ``"publish"``
    (every chunk durable, the commit not made)."""
    import zarrckpt
    from zarrckpt.engine import commit as c
    from zarrckpt.storage import _tensorstore as t
    from zarrckpt.storage import content as r

    made = [0]
    real = r.link

    def link(src, dst, dirs=None):
        ok = real(src, dst, dirs)
        made[0] += 1
        if made[0] >= after:
            os._exit(9)
        return ok
    if after == "write":  # whichever writer takes the changed chunk: a small file, or direct
        real_put, real_whole = t._put_file, _localfile.LocalArray._write_whole

        def put(path, data, fsync):
            real_put(path, data, fsync)
            if not path.endswith("zarr.json"):
                os._exit(9)

        def whole(self, *a, **k):
            real_whole(self, *a, **k)
            os._exit(9)
        t._put_file = put
        _localfile.LocalArray._write_whole = whole
    elif after == "publish":
        def publish(target, root):
            os._exit(9)
        c.publish = publish
    else:
        r.link = link
    sd = _state()
    sd["adapter"]["a"] += 1
    zarrckpt.save(sd, path_b, incremental_from=path_a)
    os._exit(0)


@pytest.mark.parametrize("after", [1, 5, "write", "publish"])
def test_a_kill_during_an_incremental_save_leaves_the_previous_step_intact(tmp_path, after):
    import multiprocessing as mp

    sd = _state()
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True)
    before = {k: open(tmp_path / "a" / k, "rb").read() for k in _chunk_files(tmp_path / "a")}
    p = mp.get_context("spawn").Process(target=_killed_rank, args=(str(tmp_path / "a"), str(tmp_path / "b"), after))
    p.start()
    p.join(120)
    assert p.exitcode == 9
    assert {k: open(tmp_path / "a" / k, "rb").read() for k in _chunk_files(tmp_path / "a")} == before
    assert _equal(_loaded(tmp_path / "a"), sd)
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load(_zeros(sd), tmp_path / "b")  # never committed
    sd["adapter"]["a"] += 1  # the save again, after the crash
    zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a", overwrite=True)
    assert _equal(_loaded(tmp_path / "b"), sd)


def _dist_rank(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    full = {f"w{i}": torch.randn(64, 4096, generator=g) for i in range(6)}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    zarrckpt.save(sd, f"{root}/a", content_hashes=True, chunk_target_bytes=None)
    with torch.no_grad():
        sd["w0"].to_local().add_(1)
    rep = zarrckpt.save(sd, f"{root}/b", incremental_from=f"{root}/a", chunk_target_bytes=None)
    import torch.distributed as dist
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/a")
    dist.barrier()
    out = {k: distribute_tensor(torch.zeros(64, 4096), mesh, [Shard(0)]) for k in full}
    zarrckpt.load(out, f"{root}/b")
    ok = all(torch.equal(out[k].full_tensor(), full[k] + (1 if k == "w0" else 0)) for k in full)
    return {"ok": ok, "linked": rep["bytes_linked"], "written": rep["bytes_written"]}


def test_two_ranks_link_their_own_chunks(tmp_path, clusters):
    res = clusters(2).run(_dist_rank, str(tmp_path))
    assert all(r["ok"] for r in res)
    # 5 of 6 arrays unchanged; each rank writes and links its own shards' chunks
    assert all(r["linked"] == 5 * 32 * 4096 * 4 for r in res), res


def test_small_chunks_are_linked_too(tmp_path):
    """Chunks of at most 1 MiB take the small-file path (batched writes): linked as well,
    after the writer compares the CRC-32C (spec §7.9 checks 3 and 4)."""
    g = torch.Generator().manual_seed(3)
    sd = {f"w{i}": torch.randn(64, 256, generator=g) for i in range(10)}  # 64 KiB each
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True)
    sd["w0"] += 1
    rep = zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a")
    assert rep["bytes_linked"] == 9 * 64 * 256 * 4, rep
    fa, fb = _chunk_files(tmp_path / "a"), _chunk_files(tmp_path / "b")
    assert {k for k in fb if fb[k].st_ino == fa[k].st_ino} == {k for k in fb if not k.startswith("w0/")}
    shutil.rmtree(tmp_path / "a")
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    zarrckpt.load(out, tmp_path / "b")
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_small_chunks_with_a_colliding_hash_are_written(tmp_path, monkeypatch):
    monkeypatch.setattr(reuse, "chunk_hash", lambda bodies: [None for _ in bodies] and b"\x00" * 16)
    sd = {f"w{i}": torch.full((64, 256), float(i)) for i in range(3)}
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True)
    sd["w1"] += 1
    rep = zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a")
    assert rep["bytes_linked"] == 2 * 64 * 256 * 4
    shutil.rmtree(tmp_path / "a")
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    zarrckpt.load(out, tmp_path / "b")
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_ls_shows_bytes_of_its_own_and_shared(tmp_path, capsys):
    from zarrckpt.tools import cli

    sd = _state()
    m = zarrckpt.CheckpointManager(tmp_path / "run", incremental=True)
    for step in (1, 2):
        sd["adapter"]["a"] += 1
        m.save(step, sd)
    found = zi.ls(str(tmp_path / "run"))
    assert [x.step for x in found] == [1, 2]
    for x in found:  # the frozen chunk files are shared, the adapter's and the documents are not
        assert x.shared_bytes >= 9 * 256 * 1024 * 4
        assert 256 * 1024 * 4 <= x.own_bytes < 2 * 256 * 1024 * 4 + (1 << 20)
    assert cli.main(["ls", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "OWN" in out and "SHARED" in out
    shutil.rmtree(tmp_path / "run" / "step_00000001")
    (x,) = zi.ls(str(tmp_path / "run"))
    assert x.shared_bytes == 0  # nothing shared any more: all of it is its own


def test_diff_tells_unchanged_arrays_from_the_recorded_hashes(tmp_path):
    """zarrckpt diff between two steps that record content hashes: arrays whose metadata,
    content hashes and unit CRCs agree are identical without a chunk read (issue 31 item 4)."""
    sd = _state()
    zarrckpt.save(sd, tmp_path / "a", content_hashes=True)
    sd["adapter"]["a"] += 1
    zarrckpt.save(sd, tmp_path / "b", incremental_from=tmp_path / "a")
    before = _localfile.counters()["bytes_read"]
    rep = zi.diff(str(tmp_path / "a"), str(tmp_path / "b"), jobs=1)
    read = _localfile.counters()["bytes_read"] - before
    status = {d.key: d.status for d in rep.leaves}
    assert status["adapter/a"] == "different"
    assert all(status[f"frozen/w{i}"] == "identical" for i in range(9))
    assert read < 3 * 256 * 1024 * 4, read  # the adapter of both sides (and the small bias), not the rest
    plain = tmp_path / "plain"  # without hashes on one side every array is read and compared
    zarrckpt.save(sd, plain)
    before = _localfile.counters()["bytes_read"]
    assert zi.diff(str(tmp_path / "b"), str(plain), jobs=1).same
    assert _localfile.counters()["bytes_read"] - before >= 2 * 10 * 256 * 1024 * 4


def test_open_run_tells_unchanged_arrays_and_reads_them_once(tmp_path):
    """open_run over an incremental run (issue 31 item 4): each variable's
    ``same_as_previous`` comes from the roots alone, and a reduction over the steps reads a
    frozen array's chunks once, not once per step; the values are every step's own."""
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    sd = _state()
    adapters = []
    with zarrckpt.CheckpointManager(tmp_path / "run", incremental=True) as mgr:
        for step in (1, 2, 3):
            sd["adapter"]["a"] += 1
            adapters.append(sd["adapter"]["a"].clone())
            mgr.save(step, sd)
    ds = zarrckpt.open_run(tmp_path / "run")
    assert ds["frozen/w0"].attrs["same_as_previous"] == [-1, 1, 1]
    assert ds["adapter/a"].attrs["same_as_previous"] == [-1, 0, 0]
    before = zarrckpt.storage.io_counters()["bytes_read"]
    frozen = ds[[f"frozen/w{i}" for i in range(9)]]
    sums = frozen.sum([d for d in frozen.dims if d != "step"]).compute()
    read = zarrckpt.storage.io_counters()["bytes_read"] - before
    assert 9 * 256 * 1024 * 4 <= read < 2 * 9 * 256 * 1024 * 4, read  # once, not three times
    for i in range(9):
        want = float(sd["frozen"][f"w{i}"].double().sum())
        assert sums[f"frozen/w{i}"].values == pytest.approx([want] * 3, rel=1e-5)
    got = ds["adapter/a"].values
    for k in range(3):
        assert np.array_equal(got[k], adapters[k].numpy())
    # a run saved without hashes cannot tell: every step is read
    with zarrckpt.CheckpointManager(tmp_path / "plain") as mgr:
        for step in (1, 2):
            mgr.save(step, sd)
    assert zarrckpt.open_run(tmp_path / "plain")["frozen/w0"].attrs["same_as_previous"] == [-1, -1]


def test_stats_over_an_incremental_run_reads_unchanged_arrays_once(tmp_path):
    """zarrckpt stats over a run: an array the roots' recorded hashes say is unchanged since
    the step before takes that step's statistics without a read (issue 31 item 4); every
    step's numbers equal those of that checkpoint alone."""
    sd = _state()
    with zarrckpt.CheckpointManager(tmp_path / "run", incremental=True) as mgr:
        for step in (1, 2, 3):
            sd["adapter"]["a"] += 1
            mgr.save(step, sd)
    before = _localfile.counters()["bytes_read"]
    run = zi.stats(str(tmp_path / "run"), jobs=1)
    read = _localfile.counters()["bytes_read"] - before
    one_step = 10 * 256 * 1024 * 4
    assert one_step <= read < one_step + 3 * 256 * 1024 * 4, read  # step 1 whole, then the adapter
    for step, got in zip((1, 2, 3), run):
        alone = zi.stats(str(tmp_path / "run" / f"step_{step:08d}"), jobs=1)[0]
        assert [(t.key, t.mean, t.std, t.min, t.max) for t in got.tensors] == \
            [(t.key, t.mean, t.std, t.min, t.max) for t in alone.tensors]
