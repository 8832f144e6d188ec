"""zarrckpt.dcp_storage: dcp.save / dcp.load through ZarrckptStorageWriter / ZarrckptStorageReader
(issue 17 item 1), on one process and on 2 and 4 gloo ranks with DTensor states."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import zarrckpt
from zarrckpt.dcp_storage import ZarrckptStorageReader, ZarrckptStorageWriter
from zarrckpt.format import dtypes
from zarrckpt.interop.dcp_storage import chunk_grid

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def bits(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = dtypes.to_numpy(t.detach().contiguous())
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)


def same(a, b) -> bool:
    """Bit-exact equality of nested states (tensors by bits and dtype, BytesIO by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and np.array_equal(bits(a), bits(b)))
    if isinstance(a, io.BytesIO) or isinstance(b, io.BytesIO):
        return isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue()
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def varied_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"layer.weight": torch.randn(7, 5, generator=g),
                  "layer.bias": torch.randn(5, generator=g).to(torch.bfloat16),
                  "scale": torch.tensor(2.5), "count": torch.arange(6, dtype=torch.int64) * (1 << 40),
                  "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3)},
        "optim": {"state": {"layer.weight": {"exp_avg": torch.randn(7, 5, generator=g), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["layer.weight"],
                                    "amsgrad": False, "foreach": None}]},
        "step": 42, "name": "run-α", "ratio": 0.25, "inf": float("inf"), "nan": float("nan"),
        "blob": b"\x00\x01\xffbytes", "buf": io.BytesIO(b"a BytesIO"), "ints": [1, 2, 3],
        "mixed": [torch.arange(4, dtype=torch.int32), torch.ones(2, dtype=torch.float16)],
        "nested": {"deeper": {"t": torch.randn(3, 3, generator=g).to(torch.float64), "s": "x"}},
    }


def zeros_like_state(s):
    if isinstance(s, torch.Tensor):
        return torch.zeros_like(s)
    if isinstance(s, dict):
        return {k: zeros_like_state(v) for k, v in s.items()}
    if isinstance(s, list) and any(isinstance(v, torch.Tensor) for v in s):
        return [zeros_like_state(v) for v in s]
    return None if not isinstance(s, (list, dict)) else s


# ---- one process ------------------------------------------------------------------------


def test_writer_state_reads_back_with_zarrckpt_and_zarr(tmp_path):
    state = varied_state()
    path = str(tmp_path / "ck")
    dcp.save(state, storage_writer=ZarrckptStorageWriter(path), no_dist=True)
    got = zarrckpt.load_state_dict(path)
    ck = zarrckpt.open(path)
    # byte leaves: bytes as bytes, BytesIO as its bytes (load_state_dict); tuples stay tuples
    expect = dict(state, buf=b"a BytesIO")
    got_buf = got["buf"]
    got["buf"] = got_buf.getvalue() if isinstance(got_buf, io.BytesIO) else got_buf
    assert same(got, expect)
    assert ck.array_info("buf").kind == "bytesio" and ck.array_info("blob").kind == "bytes"
    assert ck.array_info("model/layer.weight").kind == "tensor"
    # the same tree (keys, kinds, order) as zarrckpt.save of the same state dict
    zarrckpt.save(state, str(tmp_path / "ref"))
    assert json.dumps(ck.info.tree) == json.dumps(zarrckpt.open(str(tmp_path / "ref")).info.tree)
    # zarr-python, without zarrckpt
    zarr = pytest.importorskip("zarr")
    root = zarr.open_group(path, mode="r")
    for key in ("model/layer.weight", "model/count", "optim/state/layer.weight/exp_avg", "nested/deeper/t"):
        node = state
        for part in key.split("/"):
            node = node[part]
        assert np.array_equal(root[key][...], node.numpy()), key
    assert bytes(root["blob"][...]) == state["blob"]
    # the CLI verifies it (digests, consolidated metadata, chunk CRCs)
    out = subprocess.run([sys.executable, "-m", "zarrckpt", "verify", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "zarrckpt", "info", path], capture_output=True, text=True)
    assert out.returncode == 0 and "layer.weight" in out.stdout


def test_reader_loads_zarrckpt_save_bit_exact(tmp_path):
    state = varied_state()
    path = str(tmp_path / "ck")
    zarrckpt.save(state, path)
    target = zeros_like_state(state)
    target["optim"]["param_groups"] = [{"lr": 0.0, "betas": (0, 0), "params": [], "amsgrad": True,
                                        "foreach": None}]
    dcp.load(target, storage_reader=ZarrckptStorageReader(path), no_dist=True)
    assert same(target, state)


def test_reader_and_writer_round_trip_real_optimizer(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 1}
    path = str(tmp_path / "ck")
    dcp.save(state, storage_writer=ZarrckptStorageWriter(path), no_dist=True)
    # zarrckpt.load into a fresh model's get_state_dict
    model2 = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2(torch.randn(3, 6)).sum().backward()
    opt2.step()
    msd2, osd2 = get_state_dict(model2, opt2)
    st2 = {"model": msd2, "optim": osd2, "step": 0}
    dcp.load(st2, storage_reader=ZarrckptStorageReader(path), no_dist=True)
    set_state_dict(model2, opt2, model_state_dict=st2["model"], optim_state_dict=st2["optim"])
    assert same(get_state_dict(model2, opt2)[1]["state"], osd["state"])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    st3 = {"model": get_state_dict(model2, opt2)[0]}
    with pytest.warns(UserWarning, match="unloaded"):
        zarrckpt.load(st3, path, strict=False)
    assert same(st3["model"], msd)


class Opaque:  # torch.load(weights_only=True) refuses it
    def __init__(self):
        self.x = 1


def test_unrepresentable_value_commits_nothing(tmp_path):
    path = tmp_path / "ck"
    w = ZarrckptStorageWriter(str(path))
    with pytest.raises(CheckpointException, match="weights_only|never pickles"):
        dcp.save({"w": torch.ones(3), "obj": Opaque()}, storage_writer=w, no_dist=True)
    with pytest.raises(zarrckpt.ZarrckptError):
        zarrckpt.open(str(path))
    w.abort()
    assert os.listdir(tmp_path) == []  # claim, hidden directory and lock file removed


def test_failed_save_is_cleaned_at_next_save(tmp_path):
    path = str(tmp_path / "ck")
    w = ZarrckptStorageWriter(path)
    with pytest.raises(CheckpointException):
        dcp.save({"obj": Opaque()}, storage_writer=w, no_dist=True)
    assert os.listdir(tmp_path)  # the pending claim and the save's directory are still there
    dcp.save({"w": torch.ones(2)}, storage_writer=w, no_dist=True)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert torch.equal(zarrckpt.load_state_dict(path)["w"], torch.ones(2))


def test_overwrite(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(2)}, storage_writer=ZarrckptStorageWriter(path), no_dist=True)
    with pytest.raises(CheckpointException, match="overwrite"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=ZarrckptStorageWriter(path, overwrite=False), no_dist=True)
    assert torch.equal(zarrckpt.load_state_dict(path)["w"], torch.ones(2))
    dcp.save({"w": torch.zeros(2)}, storage_writer=ZarrckptStorageWriter(path, overwrite=True), no_dist=True)
    assert torch.equal(zarrckpt.load_state_dict(path)["w"], torch.zeros(2))


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")  # FileSystemWriter's
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_resave_replaces_the_checkpoint_as_dcps_own_writer_does(tmp_path, where):
    """DCP's FileSystemWriter overwrites by default (overwrite=True); a drop-in must too (it
    raised CheckpointException), atomically: a failed re-save leaves the old checkpoint."""
    fs = str(tmp_path / "dcp")
    for value in (1.0, 2.0):  # what the replaced writer does
        dcp.save({"w": torch.full((2,), value)}, storage_writer=dcp.FileSystemWriter(fs), no_dist=True)
    path = str(tmp_path / "ck") if where == "local" else f"memory://resave-{tmp_path.name}/ck"
    for value in (1.0, 2.0):
        dcp.save({"w": torch.full((2,), value), "step": int(value)}, storage_writer=ZarrckptStorageWriter(path),
                 no_dist=True)
        sd = zarrckpt.load_state_dict(path)
        assert torch.equal(sd["w"], torch.full((2,), value)) and sd["step"] == int(value)
    w = ZarrckptStorageWriter(path)
    with pytest.raises(CheckpointException, match="weights_only|never pickles"):
        dcp.save({"w": torch.full((2,), 3.0), "obj": Opaque()}, storage_writer=w, no_dist=True)
    if where == "local":  # the old checkpoint stays loadable until a replacement commits
        assert torch.equal(zarrckpt.load_state_dict(path)["w"], torch.full((2,), 2.0))
        w.abort()
        assert sorted(os.listdir(tmp_path)) == ["ck", "dcp"]
    dcp.save({"w": torch.full((2,), 4.0)}, storage_writer=w, no_dist=True)
    sd = zarrckpt.load_state_dict(path)
    assert list(sd) == ["w"] and torch.equal(sd["w"], torch.full((2,), 4.0))


def test_a_directory_that_is_not_a_zarrckpt_checkpoint_is_never_overwritten(tmp_path):
    """Where the writer differs from FileSystemWriter: a DCP checkpoint (or any non-empty
    directory that is not a zarrckpt checkpoint) at the path is refused, with or without
    overwrite."""
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    before = sorted(os.listdir(path))
    for overwrite in (True, False):
        with pytest.raises(CheckpointException, match="not a zarrckpt checkpoint"):
            dcp.save({"w": torch.zeros(2)}, storage_writer=ZarrckptStorageWriter(path, overwrite=overwrite),
                     no_dist=True)
    assert sorted(os.listdir(path)) == before


def test_checkpoint_id_and_compression(tmp_path):
    w = ZarrckptStorageWriter(str(tmp_path / "unused"), compression="zstd")
    dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(tmp_path / "ck"), storage_writer=w, no_dist=True)
    ck = zarrckpt.open(str(tmp_path / "ck"))
    assert "zstd" in json.dumps(ck.array_info("w").metadata["codecs"])
    r = ZarrckptStorageReader(str(tmp_path / "nothing"))
    t = {"w": torch.zeros(1000)}
    dcp.load(t, checkpoint_id=str(tmp_path / "ck"), storage_reader=r, no_dist=True)
    assert torch.equal(t["w"], torch.arange(1000.0))
    assert ZarrckptStorageReader.validate_checkpoint_id(str(tmp_path / "ck"))
    assert not ZarrckptStorageReader.validate_checkpoint_id(str(tmp_path / "nothing"))


def test_plan_caching_is_refused_before_writing(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlanner

    caches = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
              "_cached_final_save_plan")
    saved = {c: dict(getattr(SavePlanner, c)) for c in caches}
    try:
        for c in caches:
            getattr(SavePlanner, c).clear()
        state = {"w": torch.ones(3)}
        dcp.save(state, storage_writer=ZarrckptStorageWriter(str(tmp_path / "a")), no_dist=True,
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        assert torch.equal(zarrckpt.load_state_dict(str(tmp_path / "a"))["w"], torch.ones(3))
        with pytest.raises(CheckpointException, match="cached"):
            dcp.save(state, storage_writer=ZarrckptStorageWriter(str(tmp_path / "b")), no_dist=True,
                     planner=DefaultSavePlanner(enable_plan_caching=True))
        assert not (tmp_path / "b").exists()
    finally:
        for c in caches:
            getattr(SavePlanner, c).clear()
            getattr(SavePlanner, c).update(saved[c])


def test_chunk_grid_of_nested_uneven_boxes():
    # 9 rows on a 2x2 mesh with [Shard(0), Shard(0)]: 3, 2, 2, 2 rows
    boxes = [((0, 0), (3, 4)), ((3, 0), (2, 4)), ((5, 0), (2, 4)), ((7, 0), (2, 4))]
    assert chunk_grid((9, 4), boxes) == (1, 4)
    assert chunk_grid((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))]) == (4, 4)
    assert chunk_grid((13, 4), [((0, 0), (7, 4)), ((7, 0), (6, 4))]) == (7, 4)  # uneven: still one per shard
    assert chunk_grid((), [((), ())]) == ()
    assert chunk_grid((0, 3), []) == (1, 3)


# ---- several ranks ------------------------------------------------------------------------

SPEC = {"w": ((13, 10), torch.float32), "v": ((9, 6), torch.bfloat16), "i": ((5, 3), torch.int64)}


def full(name: str) -> torch.Tensor:
    shape, dt = SPEC[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(shape, generator=g) * 10
    return (x * 1e9).to(dt) if dt == torch.int64 else x.to(dt)


def _placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def dstate(mesh_shape, spec: str, zeros: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    pl = _placements(spec)
    model = {k: distribute_tensor(torch.zeros_like(full(k)) if zeros else full(k), mesh, pl) for k in SPEC}
    exp = full("w") * 0.5
    optim = {"state": {"w": {"exp_avg": distribute_tensor(torch.zeros_like(exp) if zeros else exp, mesh, pl),
                             "step": torch.tensor(0.0 if zeros else 3.0)}},
             "param_groups": [{"lr": 0.0 if zeros else 0.01, "params": ["w"]}]}
    return {"model": model, "optim": optim, "step": 0 if zeros else 7}


def check_dstate(state: dict) -> None:
    for k in SPEC:
        got = state["model"][k].full_tensor()
        assert got.dtype == full(k).dtype and np.array_equal(bits(got), bits(full(k))), k
    assert np.array_equal(bits(state["optim"]["state"]["w"]["exp_avg"].full_tensor()), bits(full("w") * 0.5))
    assert float(state["optim"]["state"]["w"]["step"]) == 3.0
    assert state["optim"]["param_groups"] == [{"lr": 0.01, "params": ["w"]}]
    assert state["step"] == 7


def rank_writer_save(rank, world, path, mesh_shape, spec, max_chunks=None):
    kw = {} if max_chunks is None else {"max_chunks": max_chunks}
    dcp.save(dstate(mesh_shape, spec), storage_writer=ZarrckptStorageWriter(path, **kw))
    return True


def rank_zarrckpt_save(rank, world, path, mesh_shape, spec):
    zarrckpt.save(dstate(mesh_shape, spec), path)


def rank_reader_load(rank, world, path, mesh_shape, spec):
    from zarrckpt.storage import io_counters

    state = dstate(mesh_shape, spec, zeros=True)
    before = io_counters()["bytes_read"]
    dcp.load(state, storage_reader=ZarrckptStorageReader(path))
    read = io_counters()["bytes_read"] - before
    check_dstate(state)
    return read


def rank_zarrckpt_load(rank, world, path, mesh_shape, spec):
    state = dstate(mesh_shape, spec, zeros=True)
    zarrckpt.load(state, path)
    check_dstate(state)


def rank_writer_save_refused(rank, world, path):
    state = {"x": None}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    state["x"] = distribute_tensor(torch.arange(201 * 2, dtype=torch.float32).reshape(201, 2), mesh,
                                   _placements("S0,S0"))
    with pytest.raises(CheckpointException, match="grid of 201 chunks"):
        dcp.save(state, storage_writer=ZarrckptStorageWriter(path, max_chunks=1))
    return True


def rank_failing_write(rank, world, path):
    from zarrckpt.storage import FaultStorage

    store = FaultStorage(path)
    if rank == 1:
        store.fail(ops="writes", keys="*/c/*")  # every chunk write of rank 1 fails
    w = ZarrckptStorageWriter(store)
    with pytest.raises(CheckpointException):
        dcp.save(dstate((world,), "S0"), storage_writer=w)
    torch.distributed.barrier()
    seen = None
    if rank == 0:
        with pytest.raises(zarrckpt.ZarrckptError):
            zarrckpt.open(path)  # the pending claim is refused
        parent = os.path.dirname(path)
        for entry in os.listdir(parent):  # nothing there is a committed checkpoint
            root = os.path.join(parent, entry, "zarr.json")
            if os.path.exists(root):
                with open(root) as f:
                    assert json.load(f)["attributes"]["zarrckpt"]["state"] == "pending"
        w.abort()
        seen = sorted(os.listdir(parent))
    torch.distributed.barrier()
    return seen


@pytest.mark.parametrize("world, save, load", [
    (2, ((2,), "S0"), ((2,), "S1")),
    (4, ((4,), "S0"), ((2, 2), "S1,S0")),
])
def test_writer_save_then_zarrckpt_load_other_layout(tmp_path, clusters, world, save, load):
    path = str(tmp_path / "ck")
    clusters(world).run(rank_writer_save, path, *save)
    clusters(world).run(rank_zarrckpt_load, path, *load)
    got = zarrckpt.load_state_dict(path)
    for k in SPEC:
        assert np.array_equal(bits(got["model"][k]), bits(full(k))), k
    ck = zarrckpt.open(path)
    assert ck.world_size == world
    rows = SPEC["w"][0][0]
    assert ck.array_info("model/w").chunk_shape[0] == -(-rows // world)  # one chunk per shard


def test_writer_save_then_reader_load_other_world(tmp_path, clusters):
    path = str(tmp_path / "ck")
    clusters(2).run(rank_writer_save, path, (2,), "S0")
    clusters(4).run(rank_reader_load, path, (2, 2), "S1,R")
    clusters(1).run(rank_reader_load, path, (1,), "R")


def test_zarrckpt_save_then_reader_load_other_world(tmp_path, clusters):
    path = str(tmp_path / "ck")
    clusters(4).run(rank_zarrckpt_save, path, (2, 2), "S0,S1")
    clusters(2).run(rank_reader_load, path, (2,), "S1")
    clusters(4).run(rank_reader_load, path, (4,), "S0")


def test_nested_uneven_sharding(tmp_path, clusters):
    path = str(tmp_path / "ck")
    clusters(4).run(rank_writer_save, path, (2, 2), "S0,S0")
    ck = zarrckpt.open(path)
    assert ck.array_info("model/v").chunk_shape == (1, 6)  # 9 rows as 3, 2, 2, 2: one-row chunks
    got = zarrckpt.load_state_dict(path)
    for k in SPEC:
        assert np.array_equal(bits(got["model"][k]), bits(full(k))), k
    clusters(2).run(rank_reader_load, path, (2,), "S0")
    clusters(4).run(rank_zarrckpt_load, path, (2, 2), "S1,S0")


def test_nested_uneven_beyond_the_chunk_limit_is_refused(tmp_path, clusters):
    path = str(tmp_path / "ck")
    clusters(4).run(rank_writer_save_refused, path)
    assert os.listdir(tmp_path) == []  # refused in prepare_global_plan: nothing written


def test_failure_on_one_rank_commits_nothing(tmp_path, clusters):
    path = str(tmp_path / "ck")
    seen = clusters(2).run(rank_failing_write, path)
    assert seen[0] == []  # after abort(): no claim, no hidden directory, no lock file
    assert not os.path.exists(path)


def rank_reader_load_rows(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zarrckpt.storage import io_counters

    mesh = init_device_mesh("cpu", (world,))
    state = {"big": distribute_tensor(torch.zeros(1024, 512), mesh, [Shard(0)])}
    before = io_counters()["bytes_read"]
    dcp.load(state, storage_reader=ZarrckptStorageReader(path))
    read = io_counters()["bytes_read"] - before
    g = torch.Generator().manual_seed(5)
    expect = torch.randn(1024, 512, generator=g)
    assert torch.equal(state["big"].full_tensor(), expect)
    return read


def test_resharded_load_reads_only_needed_chunks(tmp_path, clusters):
    path = str(tmp_path / "ck")
    g = torch.Generator().manual_seed(5)
    zarrckpt.save({"big": torch.randn(1024, 512, generator=g)}, path, inner_chunk_bytes=64 << 10)
    info = zarrckpt.open(path).array_info("big")
    assert info.chunk_shape == (1024, 512)  # one chunk (shard) of 2 MiB, inner chunks of 64 KiB
    reads = clusters(2).run(rank_reader_load_rows, path)
    # full_tensor() above reads nothing from storage; each rank needs half of the 2 MiB
    # (plus shard indexes and the root); reading the whole array would be 2 MiB
    for r in reads:
        assert (1 << 20) <= r < (1 << 20) + (128 << 10), reads
