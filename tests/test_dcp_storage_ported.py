"""PyTorch DCP test cases, ported by hand, run through both DCP's own FileSystemWriter/Reader
("fs", the baseline) and zarrckpt's ZarrckptStorageWriter/Reader ("zarrckpt").

The torch wheel ships no tests, so these follow the cases of torch's
test/distributed/checkpoint/ (test_file_system_checkpoint.py: tensor-only and nested
state dicts, non-tensor values; test_dtensor_checkpoint.py / test_dtensor_resharding.py:
DTensor save and load with other placements and world sizes, replicated DTensors;
test_planner.py / test_state_dict_utils: partial and strict loads, dtype conversion at load;
test_format_utils.py: dcp_to_torch_save (_EmptyStateDictLoadPlanner); test_async.py:
async_save; e2e/test_fsdp_ep / test_e2e_save_and_load.py: FSDP2 model + optimizer through
get_state_dict / set_state_dict), written again for this repository.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from zarrckpt.dcp_storage import ZarrckptStorageReader, ZarrckptStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
BACKENDS = ["fs", "zarrckpt"]


def writer(backend: str, path: str):
    return FileSystemWriter(path) if backend == "fs" else ZarrckptStorageWriter(path)


def reader(backend: str, path: str):
    return FileSystemReader(path) if backend == "fs" else ZarrckptStorageReader(path)


def save1(state, backend, path, **kw):
    dcp.save(state, storage_writer=writer(backend, path), no_dist=True, **kw)


def load1(state, backend, path, **kw):
    dcp.load(state, storage_reader=reader(backend, path), no_dist=True, **kw)


# ---- one process -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_write_only_tensor(tmp_path, backend):
    sd = {"sentinel": torch.rand(10, 10)}
    save1(sd, backend, str(tmp_path / "c"))
    sd2 = {"sentinel": torch.rand(10, 10)}
    assert not torch.equal(sd["sentinel"], sd2["sentinel"])
    load1(sd2, backend, str(tmp_path / "c"))
    assert torch.equal(sd["sentinel"], sd2["sentinel"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_dicts_and_lists_flattened(tmp_path, backend):
    sd = {"a": {"b": torch.rand(3), "c": [torch.rand(2), torch.rand(4)], "d": {"e": torch.arange(5)}},
          "f": torch.rand(2, 2)}
    save1(sd, backend, str(tmp_path / "c"))
    sd2 = {"a": {"b": torch.zeros(3), "c": [torch.zeros(2), torch.zeros(4)],
                 "d": {"e": torch.zeros(5, dtype=torch.long)}}, "f": torch.zeros(2, 2)}
    load1(sd2, backend, str(tmp_path / "c"))
    assert torch.equal(sd2["a"]["b"], sd["a"]["b"]) and torch.equal(sd2["a"]["c"][1], sd["a"]["c"][1])
    assert torch.equal(sd2["a"]["d"]["e"], sd["a"]["d"]["e"]) and torch.equal(sd2["f"], sd["f"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_tensor_values(tmp_path, backend):
    sd = {"t": torch.rand(3), "bytes0": [1], "bytes1": "string", "bio": io.BytesIO(b"abc"), "n": None,
          "f": 1.5, "tup": (1, "x"), "d": {"lr": 0.1, "names": ["a", "b"]}}
    save1(sd, backend, str(tmp_path / "c"))
    sd2 = {"t": torch.zeros(3), "bytes0": [], "bytes1": "", "bio": io.BytesIO(), "n": 1, "f": 0.0,
           "tup": (), "d": {"lr": 0.0, "names": []}}
    load1(sd2, backend, str(tmp_path / "c"))
    assert torch.equal(sd2["t"], sd["t"])
    assert sd2["bio"].getvalue() == b"abc"
    for k in ("bytes0", "bytes1", "n", "f", "tup", "d"):
        assert sd2[k] == sd[k], k


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_empty_and_dtypes(tmp_path, backend):
    sd = {"s": torch.tensor(3.25), "e": torch.zeros(0, 4), "bf": torch.randn(5).bfloat16(),
          "h": torch.randn(3).half(), "i8": torch.arange(-3, 3, dtype=torch.int8), "b": torch.tensor([True, False]),
          "c": torch.randn(3, dtype=torch.complex64), "f8": torch.randn(4).to(torch.float8_e4m3fn)}
    save1(sd, backend, str(tmp_path / "c"))
    sd2 = {k: torch.zeros_like(v) for k, v in sd.items()}
    load1(sd2, backend, str(tmp_path / "c"))
    for k in sd:
        assert sd2[k].dtype == sd[k].dtype and torch.equal(sd2[k].view(torch.uint8) if k == "f8" else sd2[k],
                                                           sd[k].view(torch.uint8) if k == "f8" else sd[k]), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_converts_dtype(tmp_path, backend):
    sd = {"w": torch.randn(4, 4)}
    save1(sd, backend, str(tmp_path / "c"))
    sd2 = {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}
    load1(sd2, backend, str(tmp_path / "c"))
    assert torch.equal(sd2["w"], sd["w"].bfloat16())


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_load_and_strict_missing_key(tmp_path, backend):
    save1({"a": torch.rand(2), "b": torch.rand(3)}, backend, str(tmp_path / "c"))
    sd = {"a": torch.zeros(2), "missing": torch.zeros(1)}
    with pytest.raises(CheckpointException, match="missing"):
        load1(sd, backend, str(tmp_path / "c"))
    load1(sd, backend, str(tmp_path / "c"), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert sd["a"].abs().sum() > 0 and torch.equal(sd["missing"], torch.zeros(1))
    only_b = {"b": torch.zeros(3)}  # a subset of the checkpoint's keys loads
    load1(only_b, backend, str(tmp_path / "c"))
    assert only_b["b"].abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_mismatch_is_an_error(tmp_path, backend):
    save1({"a": torch.rand(2, 3)}, backend, str(tmp_path / "c"))
    with pytest.raises(CheckpointException, match="[Ss]ize|shape"):
        load1({"a": torch.zeros(3, 2)}, backend, str(tmp_path / "c"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_to_torch_save_with_empty_state_dict_planner(tmp_path, backend):
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd = {"model": {"w": torch.rand(3, 2), "b": torch.rand(2)}, "optim": {"step": torch.tensor(2.0)}, "epoch": 4}
    save1(sd, backend, str(tmp_path / "c"))
    out: dict = {}
    _load_state_dict(out, storage_reader=reader(backend, str(tmp_path / "c")), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    assert torch.equal(out["model"]["w"], sd["model"]["w"]) and torch.equal(out["optim"]["step"], sd["optim"]["step"])
    assert out["epoch"] == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_save(tmp_path, backend):
    sd = {"w": torch.rand(8, 8), "step": 3}
    fut = dcp.async_save(sd, storage_writer=writer(backend, str(tmp_path / "c")), no_dist=True)
    fut.result()
    sd2 = {"w": torch.zeros(8, 8), "step": 0}
    load1(sd2, backend, str(tmp_path / "c"))
    assert torch.equal(sd2["w"], sd["w"]) and sd2["step"] == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_and_optimizer_round_trip(tmp_path, backend):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        return m, o

    m, o = make()
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    msd, osd = get_state_dict(m, o)
    save1({"model": msd, "optim": osd}, backend, str(tmp_path / "c"))
    m2, o2 = make()
    m2(torch.randn(2, 4)).sum().backward()
    o2.step()
    o2.step()
    msd2, osd2 = get_state_dict(m2, o2)
    st = {"model": msd2, "optim": osd2}
    load1(st, backend, str(tmp_path / "c"))
    set_state_dict(m2, o2, model_state_dict=st["model"], optim_state_dict=st["optim"])
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    s1, s2 = o.state_dict(), o2.state_dict()
    for k in s1["state"]:
        for n in s1["state"][k]:
            assert torch.equal(s1["state"][k][n], s2["state"][k][n]), (k, n)
    assert s1["param_groups"] == s2["param_groups"]


# ---- several ranks -----------------------------------------------------------------------


def _pl(spec):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split(",")]


def _g(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def rank_dtensor_save(rank, world, backend, path, mesh_shape, spec):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    sd = {"dtensor": distribute_tensor(_g((16, 12), 1), mesh, _pl(spec)),
          "uneven": distribute_tensor(_g((11, 7), 2), mesh, _pl(spec)),
          "plain": _g((5,), 3), "bytes0": [1], "bytes1": "string", "step": 10}
    dcp.save(sd, storage_writer=writer(backend, path))


def rank_dtensor_load(rank, world, backend, path, mesh_shape, spec):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    sd = {"dtensor": distribute_tensor(torch.zeros(16, 12), mesh, _pl(spec)),
          "uneven": distribute_tensor(torch.zeros(11, 7), mesh, _pl(spec)),
          "plain": torch.zeros(5), "bytes0": [], "bytes1": "", "step": 0}
    dcp.load(sd, storage_reader=reader(backend, path))
    assert torch.equal(sd["dtensor"].full_tensor(), _g((16, 12), 1))
    assert torch.equal(sd["uneven"].full_tensor(), _g((11, 7), 2))
    assert torch.equal(sd["plain"], _g((5,), 3))
    assert sd["bytes0"] == [1] and sd["bytes1"] == "string" and sd["step"] == 10


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("save_layout, load_layout", [
    ((2, (2,), "S0"), (2, (2,), "S0")),          # same layout
    ((2, (2,), "S0"), (2, (2,), "S1")),          # resharding, same world
    ((2, (2,), "R"), (4, (2, 2), "S0,S1")),      # replicated saved, 2-D load
    ((4, (2, 2), "R,S0"), (2, (2,), "S1")),      # HSDP-style (replicas deduplicated)
    ((4, (2, 2), "S0,S1"), (1, (1,), "R")),      # 2-D saved, one rank loads
])
def test_dtensor_resharding(tmp_path, clusters, backend, save_layout, load_layout):
    path = str(tmp_path / "c")
    clusters(save_layout[0]).run(rank_dtensor_save, backend, path, *save_layout[1:])
    clusters(load_layout[0]).run(rank_dtensor_load, backend, path, *load_layout[1:])


def _fsdp_model(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()


def rank_fsdp_e2e(rank, world, backend, path, phase):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp_model(world)
    if phase == "save":
        _train(model, opt, 2, 0)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer(backend, path))
        _train(model, opt, 1, 1)
        return [p.full_tensor().sum().item() for p in model.parameters()]
    _train(model, opt, 1, 7)  # different state, then restore and take the same step
    msd, osd = get_state_dict(model, opt)
    st = {"model": msd, "optim": osd}
    dcp.load(st, storage_reader=reader(backend, path))
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    _train(model, opt, 1, 1)
    return [p.full_tensor().sum().item() for p in model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_model_and_optimizer_e2e(tmp_path, clusters, backend):
    path = str(tmp_path / "c")
    ref = clusters(2).run(rank_fsdp_e2e, backend, path, "save")
    got = clusters(2).run(rank_fsdp_e2e, backend, path, "load")
    assert got == ref
