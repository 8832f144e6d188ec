"""Faults across ranks (issue 6): every failure reaches every rank promptly with one error
class naming the failing ranks; sub-group async saves; ranks that disagree; Stateful
order; ShardedTensor; meta DTensors; a process group torn down with a save in flight."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import pytest
import torch

import zarrckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cluster import free_port  # noqa: E402


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _sharded(world, value: float = 1.0, rows: int = 64):
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(torch.full((rows, 16), value), _mesh(world), [Shard(0)])


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except zarrckpt.ZarrckptError as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


# ----------------------------------------------------------- async from sub-groups


def rank_async_sub_groups(rank, world, path):
    import torch.distributed as dist
    from zarrckpt.distributed import group as zdist

    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=40)),
              dist.new_group([2, 3], timeout=timedelta(seconds=40))]
    mine = groups[rank // 2]
    stage = rank // 2
    for step in range(3):
        sd = {"stage": stage, "w": torch.full((32, 8), float(10 * stage + step))}
        fut = zarrckpt.async_save(sd, f"{path}/stage{stage}/s{step}", process_group=mine)
        fut.result(timeout=60)
    side = zdist.group(mine).side_group()
    keys = sorted(zdist._side_groups)
    return keys, side.timeout().total_seconds()


def test_async_save_from_sub_groups(tmp_path, clusters):
    out = clusters(4).run(rank_async_sub_groups, str(tmp_path))
    for keys, timeout in out:
        assert ((0, 1) in keys) != ((2, 3) in keys)  # keyed by the ranks, one per stage here
        assert timeout == 40  # the caller's timeout, not torch's 30 minutes
    for stage in (0, 1):
        for step in range(3):
            sd = zarrckpt.load_state_dict(tmp_path / f"stage{stage}" / f"s{step}")
            assert sd["stage"] == stage and torch.equal(sd["w"], torch.full((32, 8), float(10 * stage + step)))


# ----------------------------------------------------------- failures reach every rank


def rank_staging_fails(rank, world, path):
    from zarrckpt.distributed import staging

    real = staging.Arena.stage
    if rank == 1:
        def broken(self, src):
            raise MemoryError("cannot pin memory")
        staging.Arena.stage = broken
    try:
        return _outcome(lambda: zarrckpt.async_save({"w": _sharded(world)}, path))
    finally:
        staging.Arena.stage = real


def test_async_staging_failure_reaches_every_rank(tmp_path, clusters):
    out = clusters(2).run(rank_staging_fails, str(tmp_path / "c"))
    for cls, msg, seconds in out:
        assert cls == "SaveFailedError" and "rank(s) [1]" in msg and "cannot pin memory" in msg, out
        assert seconds < 20
    assert os.listdir(tmp_path) == []  # the path is as it was


def rank_pack_fails(rank, world, path):
    import zarrckpt.api.save as s

    real = s.pack_bytes
    if rank == 1:
        def broken(plan):
            raise RuntimeError("device copy failed")
        s.pack_bytes = broken
    try:
        sd = {f"b{i}": torch.ones(4) for i in range(8)}  # small plain leaves: packed
        return _outcome(lambda: zarrckpt.save(sd, path, pack_bytes=64 << 10))
    finally:
        s.pack_bytes = real


def test_packing_failure_reaches_every_rank(tmp_path, clusters):
    out = clusters(2).run(rank_pack_fails, str(tmp_path / "c"))
    for cls, msg, seconds in out:
        assert cls == "SaveFailedError" and "rank(s) [1]" in msg and "device copy failed" in msg, out
        assert seconds < 20
    assert os.listdir(tmp_path) == []


def rank_disagree(rank, world, path, what):
    sd = {"w": _sharded(world)}
    if what == "path":
        return _outcome(lambda: zarrckpt.save(sd, f"{path}/r{rank}"))
    if what == "compression":
        return _outcome(lambda: zarrckpt.save(sd, path, compression="zstd" if rank else None))
    return _outcome(lambda: zarrckpt.save(sd, path, pack_bytes=0 if rank else 1024))


@pytest.mark.parametrize("what", ["path", "compression", "pack_bytes"])
def test_ranks_that_disagree_are_refused(tmp_path, clusters, what):
    out = clusters(2).run(rank_disagree, str(tmp_path / "c"), what)
    for cls, msg, _ in out:
        assert cls == "SaveFailedError" and "disagree" in msg, out
    assert not os.path.exists(tmp_path / "c")


def rank_exists(rank, world, path):
    zarrckpt.save({"w": _sharded(world)}, path)
    return _outcome(lambda: zarrckpt.save({"w": _sharded(world, 2.0)}, path))


def test_existing_checkpoint_is_the_same_error_on_every_rank(tmp_path, clusters):
    out = clusters(2).run(rank_exists, str(tmp_path / "c"))
    assert [cls for cls, _, _ in out] == ["CheckpointExistsError"] * 2, out
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c")["w"], torch.ones(64, 16))


def rank_load_fails_on_one(rank, world, path):
    zarrckpt.save({"w": _sharded(world), "b": torch.ones(3)}, path)
    target = {"w": _sharded(world, 0.0), "b": torch.zeros(3 if rank == 0 else 4)}
    out = _outcome(lambda: zarrckpt.load(target, path))
    return out, float(target["w"].to_local().sum())


def test_load_failure_on_one_rank_fails_every_rank(tmp_path, clusters):
    out = clusters(2).run(rank_load_fails_on_one, str(tmp_path / "c"))
    for (cls, msg, seconds), loaded in out:
        assert cls == "ShapeMismatchError" and "'b'" in msg, out
        assert loaded == 0.0  # validation failed somewhere: no rank touched its targets
    assert "rank(s) [1]" in out[0][0][1]


# ----------------------------------------------------------- Stateful order


class Collective:
    """A Stateful whose load_state_dict runs a collective (as real ones may)."""

    def __init__(self, name):
        self.name = name
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        import torch.distributed as dist

        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, self.name)
        assert len(set(names)) == 1, f"ranks loaded Stateful leaves in different orders: {names}"
        self.value = sd["value"]


def rank_stateful_order(rank, world, path):
    objs = {n: Collective(n) for n in ("a", "b", "c")}
    for i, o in enumerate(objs.values()):
        o.value = i + 1
    zarrckpt.save(dict(objs), path)
    order = ["a", "b", "c"] if rank == 0 else ["c", "a", "b"]
    fresh = {n: Collective(n) for n in order}
    zarrckpt.load(fresh, path)
    return {n: o.value for n, o in fresh.items()}


def test_stateful_leaves_load_in_one_order_on_every_rank(tmp_path, clusters):
    out = clusters(2).run(rank_stateful_order, str(tmp_path / "c"))
    assert out == [{"a": 1, "b": 2, "c": 3}] * 2


# ----------------------------------------------------------- ShardedTensor, meta DTensors


def _sharded_tensor(world, rows=10, cols=6, dim=0):
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.empty(spec, rows, cols)
    for shard in st.local_shards():
        o = shard.metadata.shard_offsets
        s = shard.metadata.shard_sizes
        full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
        shard.tensor.copy_(full[o[0]:o[0] + s[0], o[1]:o[1] + s[1]])
    return st


def rank_sharded_tensor(rank, world, path):
    import warnings

    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.simplefilter("ignore")
    st = _sharded_tensor(world)
    rep = zarrckpt.save({"st": st, "st1": _sharded_tensor(world, 7, 9, dim=1)}, path)
    # load back into a ShardedTensor and into a DTensor
    back = _sharded_tensor(world)
    for shard in back.local_shards():
        shard.tensor.zero_()
    dt = distribute_tensor(torch.zeros(10, 6), _mesh(world), [Shard(1)])
    zarrckpt.load({"st": back}, path, strict=False)
    zarrckpt.load({"st": dt}, path, strict=False)
    ok = all(torch.equal(a.tensor, b.tensor) for a, b in zip(st.local_shards(), back.local_shards()))
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    return rep["bytes_written"], ok, torch.equal(dt.full_tensor(), full)


def test_sharded_tensor_with_chunk_spec(tmp_path, clusters):
    out = clusters(2).run(rank_sharded_tensor, str(tmp_path / "c"))
    assert sum(w for w, _, _ in out) == (60 + 63) * 4  # each byte written once
    assert all(ok and dt_ok for _, ok, dt_ok in out)
    sd = zarrckpt.load_state_dict(tmp_path / "c")
    assert torch.equal(sd["st"], torch.arange(60, dtype=torch.float32).reshape(10, 6))
    assert torch.equal(sd["st1"], torch.arange(63, dtype=torch.float32).reshape(7, 9))


def rank_enumerable_spec(rank, world, path):
    import warnings

    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    warnings.simplefilter("ignore")
    spec = EnumerableShardingSpec([
        ShardMetadata([0, 0], [2, 4], "rank:0/cpu"), ShardMetadata([2, 0], [2, 4], "rank:1/cpu")])
    st = sharded_tensor.empty(spec, 4, 4)
    return _outcome(lambda: zarrckpt.save({"st": st}, path))


def test_other_sharding_specs_are_refused_before_writing(tmp_path, clusters):
    out = clusters(2).run(rank_enumerable_spec, str(tmp_path / "c"))
    for cls, msg, _ in out:
        assert cls == "UnsupportedPlacementError" and "EnumerableShardingSpec" in msg, out
    assert not os.path.exists(tmp_path / "c")


def rank_meta_dtensor(rank, world, path):
    from torch.distributed.tensor import Shard, distribute_tensor

    zarrckpt.save({"w": _sharded(world, 3.0)}, path)
    meta = distribute_tensor(torch.empty(64, 16, device="meta"), _mesh(world), [Shard(1)])
    out = zarrckpt.load({"w": meta}, path)
    w = out["w"]
    return w.device.type, float(w.to_local().sum()), tuple(w.to_local().shape)


def test_meta_dtensor_targets_are_materialized(tmp_path, clusters):
    out = clusters(2).run(rank_meta_dtensor, str(tmp_path / "c"))
    assert out == [("cpu", 3.0 * 64 * 8, (64, 8))] * 2


# ----------------------------------------------------------- teardown with a save in flight


def rank_destroy(rank, world, port, path, q):
    import warnings

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    from zarrckpt.storage import _tensorstore as t

    real = t._put_file

    def slow(*a):
        time.sleep(0.01)
        real(*a)

    t._put_file = slow
    sd = {f"w{i}": _sharded(world, 4.0, rows=16) for i in range(30)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fut = zarrckpt.async_save(sd, path, pack_bytes=0)
        dist.destroy_process_group()  # without waiting
    q.put((rank, fut.done(), fut.exception() is None, [str(w.message) for w in caught]))


def test_destroy_process_group_with_a_save_in_flight(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    path = str(tmp_path / "c")
    procs = [ctx.Process(target=rank_destroy, args=(r, 2, port, path, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = sorted(q.get(timeout=5) for _ in procs)
    for rank, done, ok, warned in results:
        assert done and ok, results
        assert any("in flight" in w for w in warned), warned
    sd = zarrckpt.load_state_dict(path)
    assert len(sd) == 30 and all(torch.equal(v, torch.full((16, 16), 4.0)) for v in sd.values())


def rank_metrics_differ(rank, world, path):
    mgr = zarrckpt.CheckpointManager(path)
    mgr.save(1, {"w": _sharded(world)}, metrics={"loss": 0.5 + rank})  # per-rank losses differ
    return mgr.metrics(1)


def test_manager_metrics_are_rank_0s(tmp_path, clusters):
    assert clusters(2).run(rank_metrics_differ, str(tmp_path / "run")) == [{"loss": 0.5}] * 2


# ----------------------------------------------------------- a rank that never calls save


def rank_skips_save(rank, world, path):
    """Rank 2 skips the first save and calls it late; then every rank saves together."""
    out = []
    if rank != 2:
        out.append(_outcome(lambda: zarrckpt.save({"w": torch.ones(4)}, f"{path}/a", entry_timeout=3)))
    else:
        time.sleep(6)  # the others have given up by now
        out.append(_outcome(lambda: zarrckpt.save({"w": torch.ones(4)}, f"{path}/a", entry_timeout=3)))
    # the group is still usable, and the ranks' calls line up again
    out.append(_outcome(lambda: zarrckpt.save({"w": torch.full((4,), 2.0)}, f"{path}/b", entry_timeout=30)))
    return out


def test_rank_that_does_not_call_save_is_named_quickly(tmp_path, clusters):
    out = clusters(3).run(rank_skips_save, str(tmp_path))
    for rank in (0, 1):
        cls, msg, seconds = out[rank][0]
        assert cls == "DistributedError" and "rank(s) [2]" in msg and "did not enter" in msg, out
        assert 2.5 < seconds < 15  # the entry timeout, far below the group's 60 s
    cls, msg, seconds = out[2][0]
    assert cls == "DistributedError" and "rank 2" in msg and "given up" in msg, out
    assert seconds < 5  # told at once, no hang
    assert all(o[1][0] == "ok" for o in out), out
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "b")["w"], torch.full((4,), 2.0))
    assert not (tmp_path / "a").exists()


def rank_skips_load(rank, world, path):
    """Rank 1 skips a load and calls it late (through ZARRCKPT_ENTRY_TIMEOUT); then both load."""
    os.environ["ZARRCKPT_ENTRY_TIMEOUT"] = "3"
    try:
        if rank == 1:
            time.sleep(6)
        out = [_outcome(lambda: zarrckpt.load({"w": torch.zeros(4)}, path))]
    finally:
        del os.environ["ZARRCKPT_ENTRY_TIMEOUT"]
    target = {"w": torch.zeros(4)}
    out.append(_outcome(lambda: zarrckpt.load(target, path)))
    return out, target["w"].tolist()


def rank_save_all(rank, world, path):
    zarrckpt.save({"w": torch.ones(4)}, path)


def test_rank_that_does_not_call_load_is_named_quickly(tmp_path, clusters):
    path = str(tmp_path / "c")
    clusters(2).run(rank_save_all, path)
    out = clusters(2).run(rank_skips_load, path)
    cls, msg, seconds = out[0][0][0]
    assert cls == "DistributedError" and "rank(s) [1]" in msg and "load" in msg, out
    assert 2.5 < seconds < 15
    cls, msg, seconds = out[1][0][0]
    assert cls == "DistributedError" and "given up" in msg and seconds < 5, out
    assert all(o[0][1][0] == "ok" and o[1] == [1.0] * 4 for o in out), out


def test_save_without_a_process_group_in_a_world_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.warns(RuntimeWarning, match="WORLD_SIZE=4 but no process group"):
        zarrckpt.save({"w": torch.ones(4)}, tmp_path / "c")
    with pytest.warns(RuntimeWarning, match="WORLD_SIZE=4 but no process group"):
        zarrckpt.async_save({"w": torch.ones(4)}, tmp_path / "d").result(timeout=60)
    monkeypatch.setenv("WORLD_SIZE", "1")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zarrckpt.save({"w": torch.ones(4)}, tmp_path / "e")
