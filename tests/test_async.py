"""async_save: snapshot semantics, reused staging, errors through the future, and no
deadlock against the training loop's own collectives."""

from __future__ import annotations

import os

import pytest
import torch

import zarrckpt
from zarrckpt.distributed import staging
from zarrckpt.planning.plan import ArrayPlan
from zarrckpt.storage import FaultStorage


def test_async_save_snapshots_and_commits(tmp_path):
    w = torch.arange(1000, dtype=torch.float32)
    fut = zarrckpt.async_save({"w": w, "step": 1}, tmp_path / "c")
    w.add_(1)  # training goes on: the checkpoint must hold the values at the call
    report = fut.result(timeout=60)
    assert fut.done()
    assert report["seconds"]["blocked"] == fut.staged_seconds
    assert report["bytes_staged"] >= 4000
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c")["w"], torch.arange(1000, dtype=torch.float32))


def test_staging_memory_is_reused_across_saves(tmp_path):
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    ptrs = set()
    for i in range(5):
        state["w"].add_(1)
        zarrckpt.async_save(state, tmp_path / f"c{i}").result(timeout=60)
        ptrs.add(staging.shared_arena()._buf.data_ptr())
    assert len(ptrs) == 1  # one buffer, allocated once
    assert torch.equal(zarrckpt.load_state_dict(tmp_path / "c4")["w"], state["w"])


def test_one_save_in_flight(tmp_path):
    a = zarrckpt.async_save({"x": torch.ones(10)}, tmp_path / "a")
    b = zarrckpt.async_save({"x": torch.zeros(10)}, tmp_path / "b")
    assert a.done()  # b waited for a before reusing the staging buffers
    b.result(timeout=60)


def test_background_error_surfaces_and_nothing_is_committed(tmp_path):
    store = FaultStorage(tmp_path / "c")
    # every chunk write: array regions and small-chunk puts (documents still succeed)
    store.fail(ops=("write", "put"), keys="*/c/*", error=OSError("disk on fire"))
    fut = zarrckpt.async_save({"x": torch.ones(10)}, store)
    with pytest.raises(OSError, match="disk on fire"):
        fut.result(timeout=60)
    with pytest.raises(zarrckpt.CheckpointNotFoundError):  # the path is as it was: absent
        zarrckpt.load_state_dict(tmp_path / "c")
    assert os.listdir(tmp_path) == []  # nor is the save's own directory left behind


def test_bad_state_raises_at_the_call_and_destination_errors_from_the_future(tmp_path):
    """What the caller passed is checked before async_save returns (nothing written);
    what the destination says (a checkpoint already there) is found in the background,
    where the path is claimed, and raised by the future; the checkpoint there is kept."""
    with pytest.raises(zarrckpt.UnsupportedValueError, match="bad"):
        zarrckpt.async_save({"bad": object()}, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    zarrckpt.save({"x": 1}, tmp_path / "c")
    fut = zarrckpt.async_save({"x": 2}, tmp_path / "c")
    with pytest.raises(zarrckpt.CheckpointExistsError):
        fut.result(timeout=60)
    assert zarrckpt.load_state_dict(tmp_path / "c") == {"x": 1}
    assert sorted(os.listdir(tmp_path)) == ["c"]  # nor is the save's own directory left behind


def test_sync_save_streams_device_data_through_a_bounded_buffer(tmp_path, monkeypatch):
    # No GPU here: pretend CPU tensors live on a device so they take the staging path.
    monkeypatch.setattr(ArrayPlan, "on_host", property(lambda self: False))
    zarrckpt.release_staging()  # the streaming arena is reused across calls: start afresh
    taken = []
    real_stage = staging.Arena.stage

    def spy(self, src):
        taken.append((self.capacity, src.numel() * src.element_size()))
        return real_stage(self, src)

    monkeypatch.setattr(staging.Arena, "stage", spy)
    state = {f"w{i}": torch.randn(64, 64) for i in range(6)}  # 16 KiB each
    zarrckpt.save(state, tmp_path / "c", max_staging_bytes=40 << 10, pack_bytes=0)
    assert len(taken) == 6 and all(cap == 40 << 10 for cap, _ in taken)
    out = zarrckpt.load_state_dict(tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())


def rank_async_with_training_collectives(rank, world, path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(4000, dtype=torch.float32).reshape(40, 100), mesh, [Shard(0)])
    futs = []
    for step in range(3):
        futs.append(zarrckpt.async_save({"w": w, "step": step}, f"{path}/s{step}"))
        # the training loop's own collectives on the default group, while the save runs
        for _ in range(20):
            t = torch.ones(1)
            dist.all_reduce(t)
            dist.barrier()
        w.to_local().add_(1)
    return [f.result(timeout=60)["bytes_written"] for f in futs]


def test_async_save_does_not_deadlock_with_training_collectives(tmp_path, clusters):
    written = clusters(2).run(rank_async_with_training_collectives, str(tmp_path))
    assert [a + b for a, b in zip(*written)] == [16000] * 3
    for step in range(3):
        sd = zarrckpt.load_state_dict(tmp_path / f"s{step}")
        assert sd["step"] == step
        assert torch.equal(sd["w"], torch.arange(4000, dtype=torch.float32).reshape(40, 100) + step)


def test_load_streams_cast_targets_through_bounded_buffer(tmp_path):
    state = {f"w{i}": torch.randn(64, 64).to(torch.bfloat16) for i in range(6)}
    zarrckpt.save(state, tmp_path / "c")
    target = {k: torch.zeros(64, 64) for k in state}  # fp32 targets: staged, then cast
    zarrckpt.load(target, tmp_path / "c", cast=True, max_staging_bytes=20 << 10)
    assert all(torch.equal(target[k], v.float()) for k, v in state.items())


def test_large_regions_are_read_in_pieces_and_the_arena_is_reused(tmp_path):
    w = torch.randn(1024, 1024)  # 4 MiB: sharded with 64 KiB inner chunks
    store = FaultStorage(tmp_path / "c")  # no faults: it counts the region reads
    zarrckpt.save({"w": w}, store, inner_chunk_bytes=64 << 10)
    zarrckpt.release_staging()
    ptrs = set()
    for _ in range(2):
        target = {"w": torch.zeros(1024, 1024, dtype=torch.float64)}  # a cast: staged through the arena
        zarrckpt.load(target, store, cast=True, max_inflight_bytes=8 << 20)
        assert torch.equal(target["w"], w.double())
        ptrs.add(staging._STREAM._buf.data_ptr())
    assert len(ptrs) == 1  # one pinned buffer for both loads
    calls = [e.box for e in store.events if e.op == "read"]
    assert len(calls) == 2 * 4  # 1 MiB pieces (8 MiB / 8), on inner-chunk boundaries
    assert all((b - a) % 64 == 0 or b == 1024 for (a, b), _ in calls)
    sd = zarrckpt.load_state_dict(tmp_path / "c", max_inflight_bytes=8 << 20)
    assert torch.equal(sd["w"], w)


def test_later_saves_reuse_the_plans_and_follow_every_change(tmp_path, monkeypatch):
    """Issue 16 item 4: a save whose leaves all have the previous save's signature reuses its
    plans (no leaf is planned again) and its staged views; any change of structure, shape,
    dtype or value type plans afresh; values and data are always this save's."""
    from zarrckpt.planning import plan as _plan

    calls = []
    real = _plan.plan_leaf
    monkeypatch.setattr(_plan, "plan_leaf", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    state = {"model": {f"w{i}": torch.randn(64) for i in range(20)}, "step": 0, "blob": b"ab",
             "opt": {"lr": 0.1, "betas": (0.9, 0.99)}}
    for step in range(3):
        state["step"] = step
        state["opt"]["lr"] = 0.1 / (step + 1)
        for t in state["model"].values():
            t.add_(1)
        calls.clear()
        zarrckpt.async_save(state, tmp_path / f"s{step}").result(timeout=60)
        assert len(calls) == (21 if step == 0 else 0), calls  # 20 tensors and the bytes, planned once
        got = zarrckpt.load_state_dict(tmp_path / f"s{step}")
        assert got["step"] == step and got["opt"]["lr"] == 0.1 / (step + 1) and got["blob"] == b"ab"
        assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
    changes = [
        lambda s: s["model"].__setitem__("w0", torch.randn(65)),  # a shape
        lambda s: s["model"].__setitem__("w1", torch.randn(64, dtype=torch.float64)),  # a dtype
        lambda s: s["model"].__setitem__("new", torch.randn(3)),  # a key
        lambda s: s.__setitem__("blob", b"abc"),  # a bytes length
        lambda s: s.__setitem__("step", "seven"),  # a value's type
    ]
    for i, change in enumerate(changes):
        change(state)
        calls.clear()
        zarrckpt.async_save(state, tmp_path / f"c{i}").result(timeout=60)
        assert calls, i  # planned afresh
        got = zarrckpt.load_state_dict(tmp_path / f"c{i}")
        assert set(got["model"]) == set(state["model"]) and got["blob"] == state["blob"]
        assert got["step"] == state["step"]
        for k, v in state["model"].items():
            assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), (i, k)


def test_the_one_pass_walk_of_later_saves_follows_changes_that_keep_the_leaf_count(tmp_path, monkeypatch):
    """Later async saves resolve Statefuls and compare with the previous save's template in
    one walk (plan.resolve_reusing); every change below keeps the number of leaves, so only
    the comparison of structure and leaves can catch it. Values are always this save's, and
    parameters are staged without autograd (their local views are copied under no_grad)."""
    from zarrckpt.api import save as _save
    from zarrckpt.planning import plan as _plan

    class Box:  # a Stateful
        def __init__(self) -> None:
            self.sd = {"a": torch.arange(4.0), "b": 1}

        def state_dict(self):
            return dict(self.sd)

        def load_state_dict(self, sd):
            self.sd = sd

    calls = []
    real = _plan.plan_leaf
    monkeypatch.setattr(_plan, "plan_leaf", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    lin = torch.nn.Linear(4, 3)
    state = {"model": lin.state_dict(keep_vars=True), "box": Box(), "empty": {}, "pair": (torch.ones(2), [3, 4]),
             "z": torch.zeros(3), "same": {"p": torch.ones(2), "q": torch.full((2,), 2.0)}}
    assert lin.weight.requires_grad

    def roundtrip(name: str) -> bool:
        calls.clear()
        zarrckpt.async_save(state, tmp_path / name).result(timeout=60)
        got = zarrckpt.load_state_dict(tmp_path / name)
        flat, gflat = _flat(state), _flat(got)
        assert set(gflat) == set(flat), name
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                assert gflat[k].dtype == v.dtype and torch.equal(gflat[k], v.detach()), (name, k)
            else:
                assert gflat[k] == v, (name, k)
        return bool(calls)

    assert roundtrip("first")
    assert not roundtrip("same")  # reused
    st = _save._STAGED
    assert st is not None and not any(getattr(h, "requires_grad", False) for h in st.hosts)
    assert lin.weight.grad_fn is None and lin.weight.requires_grad
    changes = [
        ("key order", lambda s: s.__setitem__("model", dict(reversed(list(s["model"].items()))))),
        ("same-shaped keys swapped", lambda s: s.__setitem__("same", {"q": s["same"]["q"], "p": s["same"]["p"]})),
        ("a key renamed", lambda s: s["same"].__setitem__("r", s["same"].pop("q"))),
        ("stateful leaf", lambda s: s["box"].sd.__setitem__("a", torch.arange(5.0))),
        ("stateful value type", lambda s: s["box"].sd.__setitem__("b", "one")),
        ("empty dict filled", lambda s: s.__setitem__("empty", {"x": 1})),
        ("tuple to list", lambda s: s.__setitem__("pair", [torch.ones(2), [3, 4]])),
        ("int to tensor", lambda s: s["pair"].__setitem__(1, [3, torch.ones(1)])),
        ("a tensor renamed", lambda s: s.__setitem__("z", {"z": torch.zeros(3)})),
        ("a negative view", lambda s: s.__setitem__("z", {"z": torch._neg_view(torch.ones(3))})),
    ]
    for name, change in changes:
        change(state)
        roundtrip(name)
        assert not roundtrip(name + "-again") or name == "a negative view"  # the new shape is reused


def _flat(sd: dict) -> dict:
    from zarrckpt.format import tree as ztree
    from zarrckpt.planning.state import is_array_leaf, resolve_stateful

    return {ztree.key_of(p): v for p, v in ztree.flatten(resolve_stateful(sd), is_array_leaf)}


def test_the_future_is_a_concurrent_future_with_a_staging_future(tmp_path):
    """Issue 17 item 3: trainers assert concurrent.futures.Future (torchtitan) and wait for
    staging alone (DCP's AsyncSaveResponse names)."""
    import concurrent.futures as cf

    calls = []
    fut = zarrckpt.async_save({"w": torch.ones(8)}, tmp_path / "c")
    assert isinstance(fut, cf.Future) and isinstance(fut.staging_completion, cf.Future)
    assert fut.upload_completion is fut
    fut.add_done_callback(lambda f: calls.append(f.result()["path"]))
    assert fut.staging_completion.result(timeout=60) == fut.staged_seconds  # CPU: staged at the call
    done, _ = cf.wait([fut], timeout=60)
    assert done == {fut} and calls == [fut.result()["path"]]
    bad = zarrckpt.async_save({"w": torch.ones(8)}, tmp_path / "c")  # exists: fails in the background
    assert isinstance(bad.exception(timeout=60), zarrckpt.CheckpointExistsError)
    assert bad.staging_completion.done()


def test_async_saves_of_ranks_holding_different_keys(tmp_path, clusters):
    """A later async save reuses the staged plans; where ranks hold different plain leaves,
    who writes them is decided before async_save returns, and what a rank must write but
    did not stage is copied then (found by torchtitan's per-rank dataloader state)."""
    import _grouped

    assert clusters(2).run(_grouped.async_different_keys, str(tmp_path)) == [{"ok": True}] * 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_later_saves_copy_while_walking_the_state(tmp_path, monkeypatch, device):
    """Issue 16 item 4: a later async save whose plans and staging are reused issues its
    copies in steps while it walks the state (the first step before the walk has found
    half the leaves), in the order the walk finds them, whatever the key order; small
    CUDA leaves of several dtypes are gathered on the device, large ones and CPU leaves
    copied straight. Every checkpoint holds the values at its call; a change found late in
    the walk, after steps were issued, stages afresh and stays exact."""
    import numpy as np

    from zarrckpt.api import save as _save

    calls: list[int] = []
    real = _save._Feed.__call__

    def spy(self, leaves):
        calls.append(len(leaves))
        return real(self, leaves)

    monkeypatch.setattr(_save._Feed, "__call__", spy)
    monkeypatch.setattr(_save._Staging, "_BATCH", 2 << 20)  # several steps on the GPU too
    monkeypatch.setattr(_save, "_COPY_THREADS", max(2, _save._COPY_THREADS))  # CPU steps on a 1-core machine too
    g = torch.Generator().manual_seed(0)
    # keys out of sorted order: the plans are in key order, the arena in walk order
    layers = {f"layers.{i}": {"w": torch.randn(128, 512, generator=g),
                              "b": torch.randn(64, generator=g).to(torch.bfloat16),
                              "n": torch.arange(i, i + 3), "flag": torch.rand(7, generator=g) > 0.5}
              for i in reversed(range(60))}
    state = {"model": layers, "big": torch.randn(1 << 20, generator=g), "step": 0,
             "np": np.arange(5.0), "cpu": torch.ones(9)}
    state = {k: ({n: {m: t.to(device) for m, t in d.items()} for n, d in v.items()} if k == "model"
                 else v.to(device) if k == "big" else v) for k, v in state.items()}
    leaves = 4 * 60 + 3

    def snapshot():
        return {"big": state["big"].cpu().clone(), "cpu": state["cpu"].clone(),
                **{f"{n}.{m}": t.cpu().clone() for n, d in state["model"].items() for m, t in d.items()}}

    def check(name, expect):
        got = zarrckpt.load_state_dict(tmp_path / name)
        assert torch.equal(got["big"], expect["big"]) and torch.equal(got["cpu"], expect["cpu"])
        for n, d in got["model"].items():
            for m, t in d.items():
                assert t.dtype == expect[f"{n}.{m}"].dtype and torch.equal(t, expect[f"{n}.{m}"]), (name, n, m)

    for step in range(4):
        if step == 3:  # found at the walk's last layer, after most steps were issued
            state["model"]["layers.0"]["w"] = torch.randn(128, 511, device=device)
        calls.clear()
        state["step"] = step
        expect = snapshot()
        fut = zarrckpt.async_save(state, tmp_path / f"s{step}")
        for d in state["model"].values():  # training goes on at once
            d["w"].add_(1)
            d["n"].add_(1)
        state["big"].mul_(2)
        state["cpu"].add_(1)
        fut.result(timeout=120)
        check(f"s{step}", expect)
        if step in (1, 2):  # reused: copies began early in the walk
            assert calls and calls[0] < leaves // 2, calls
        assert zarrckpt.load_state_dict(tmp_path / f"s{step}")["step"] == step


def test_an_error_late_in_the_walk_waits_for_the_copies_issued(tmp_path, monkeypatch):
    """A later save whose walk fails after its first staging steps were issued (a Stateful
    that raises) reports the error, waits for those copies, and the next save is exact."""
    from zarrckpt.api import save as _save

    waited = []
    real = _save._Feed.abandon
    monkeypatch.setattr(_save._Feed, "abandon", lambda self: waited.append(self.next) or real(self))

    class Boom:
        fail = False

        def state_dict(self):
            if Boom.fail:
                raise RuntimeError("boom")
            return {"x": torch.ones(2)}

        def load_state_dict(self, sd):
            pass

    layers = {f"l{i}": torch.randn(128, 512) for i in range(80)}  # 20 MiB: steps on the copy threads
    state = {"model": layers, "z": Boom()}
    zarrckpt.async_save(state, tmp_path / "a").result(timeout=60)
    zarrckpt.async_save(state, tmp_path / "b").result(timeout=60)
    Boom.fail = True
    with pytest.raises(Exception, match="boom"):
        zarrckpt.async_save(state, tmp_path / "c").result(timeout=60)
    assert waited and waited[-1] > 0  # steps had been issued, and were waited for
    Boom.fail = False
    for t in layers.values():
        t.add_(1)
    expect = {k: v.clone() for k, v in layers.items()}
    zarrckpt.async_save(state, tmp_path / "d").result(timeout=60)
    got = zarrckpt.load_state_dict(tmp_path / "d")
    assert all(torch.equal(got["model"][k], v) for k, v in expect.items())
