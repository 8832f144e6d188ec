"""Save with one layout, load with another: every pair, on real gloo worlds of 1, 2, 4.

Expected local shards come from torch's own placement split functions, never
from zarrckpt's layout code, so the two are checked against each other.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import zarrckpt

# name: (world size, mesh shape, placements spec); None mesh = plain tensors
LAYOUTS = {
    "w1-R": (1, (1,), "R"),
    "w2-S0": (2, (2,), "S0"),
    "w2-S1": (2, (2,), "S1"),
    "w2-R": (2, (2,), "R"),
    "w2-plain": (2, None, ""),
    "w4-S0": (4, (4,), "S0"),
    "w4-S0,S1": (4, (2, 2), "S0,S1"),
    "w4-S0,S0": (4, (2, 2), "S0,S0"),
    "w4-SS0:2,S0": (4, (2, 2), "SS0:2,S0"),
    "w4-R,S0": (4, (2, 2), "R,S0"),
    "w4-S1,R": (4, (2, 2), "S1,R"),
}
SHAPES = {"w": ((13, 10), torch.float32), "v": ((9, 6), torch.bfloat16), "i": ((5, 3), torch.int64)}


def global_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for k, (shape, dt) in SHAPES.items():
        x = torch.randn(shape, generator=g) * 100
        out[k] = x.to(dt)
    return out


def parse_placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec.split(","):
        if p == "R":
            out.append(Replicate())
        elif p.startswith("SS"):
            d, sf = p[2:].split(":")
            out.append(_StridedShard(int(d), split_factor=int(sf)))
        else:
            out.append(Shard(int(p[1:])))
    return out


def torch_local(t: torch.Tensor, mesh_shape, placements, coord) -> torch.Tensor:
    """The local shard as torch's placement split functions cut it (left to right)."""
    from torch.distributed.tensor import Replicate

    for i, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        t = p._split_tensor(t, mesh_shape[i], with_padding=False)[0][coord[i]]
    return t.contiguous()


def make_state(layout: str, fill_zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    _, mesh_shape, spec = LAYOUTS[layout]
    state = {}
    glob = global_state()
    if mesh_shape is None:
        return {"model": {k: torch.zeros_like(v) if fill_zero else v for k, v in glob.items()},
                "step": 0 if fill_zero else 42}
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = parse_placements(spec)
    coord = mesh.get_coordinate()
    for k, v in glob.items():
        local = torch_local(v, mesh_shape, placements, coord)
        if fill_zero:
            local = torch.zeros_like(local)
        state[k] = DTensor.from_local(local, mesh, placements, run_check=False,
                                      shape=v.shape, stride=v.stride())
    return {"model": state, "step": 0 if fill_zero else 42}


def rank_save(rank, world, layout, path):
    return zarrckpt.save(make_state(layout, fill_zero=False), path)


def rank_load_and_check(rank, world, layout, path):
    state = make_state(layout, fill_zero=True)
    report = {}
    zarrckpt.load(state, path, report=report)
    assert state["step"] == 42
    glob = global_state()
    _, mesh_shape, spec = LAYOUTS[layout]
    for k, v in glob.items():
        got = state["model"][k]
        if mesh_shape is None:
            expect = v
        else:
            expect = torch_local(v, mesh_shape, parse_placements(spec), got.device_mesh.get_coordinate())
            got = got.to_local()
        assert got.dtype == expect.dtype
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 and False else got, expect), k
    return report


_saved: dict[str, str] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, clusters):
    """Each save layout saved once per module: layout -> (path, per-rank reports)."""

    def get(layout: str):
        if layout not in _saved:
            path = str(tmp_path_factory.mktemp("ckpt") / layout)
            world = LAYOUTS[layout][0]
            reports = clusters(world).run(rank_save, layout, path)
            _saved[layout] = (path, reports)
        return _saved[layout]

    return get


@pytest.mark.parametrize("save_layout", list(LAYOUTS))
def test_save_writes_each_byte_once(saved, save_layout):
    path, reports = saved(save_layout)
    total = sum(v.numel() * v.element_size() for v in global_state().values())
    written = sum(r["bytes_written"] for r in reports)
    if LAYOUTS[save_layout][1] is None:  # small plain tensors are packed, 8-byte aligned
        assert total <= written < total + 8 * len(SHAPES)
    else:
        assert written == total
    # every chunk file exists exactly where the grid says, read back by TensorStore
    ck = zarrckpt.open(path)
    for k, v in global_state().items():
        info = ck.array_info(f"model/{k}")
        assert info.shape == tuple(v.shape)
        np.testing.assert_array_equal(ck.read(f"model/{k}").view(np.uint8),
                                      _np(v).view(np.uint8))


def _np(t: torch.Tensor) -> np.ndarray:
    from zarrckpt.format import dtypes

    return dtypes.to_numpy(t.contiguous())


@pytest.mark.parametrize("save_layout", list(LAYOUTS))
def test_chunks_follow_save_layout(saved, save_layout):
    path, _ = saved(save_layout)
    world, mesh_shape, spec = LAYOUTS[save_layout]
    if mesh_shape is None:  # small plain tensors: each its own array, one chunk (no packs from 1.2)
        ck = zarrckpt.open(path)
        assert not any(ck.is_packed(f"model/{k}") for k in SHAPES)
        assert not os.path.exists(os.path.join(path, ".packs"))
        for k, (shape, _) in SHAPES.items():
            assert ck[f"model/{k}"].chunks == tuple(shape)
        return
    with open(os.path.join(path, "model", "w", "zarr.json")) as f:
        meta = json.load(f)
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    attrs = meta["attributes"]["zarrckpt"]
    if mesh_shape is None:
        assert attrs["kind"] == "tensor" and chunk == [13, 10]
        return
    assert attrs["kind"] == "dtensor"
    assert attrs["mesh"]["shape"] == list(mesh_shape)
    assert len(attrs["placements"]) == len(mesh_shape)
    # the shards (cells, spec C.1 steps 1-2) and the chunks that group whole cells by default
    # (C.1 step 3: shards this small are grouped along each sharded dimension as far as the
    # extent allows; 13 rows in cells of 4 make chunks of 12, and the last row a chunk)
    cell = {"R": [13, 10], "S0": [4, 10] if world == 4 else [7, 10], "S1": [13, 5],
            "S0,S1": [7, 5], "S0,S0": [4, 10], "SS0:2,S0": [4, 10], "R,S0": [7, 10], "S1,R": [13, 5]}
    grouped = {"R": [13, 10], "S0": [12, 10] if world == 4 else [7, 10], "S1": [13, 10],
               "S0,S1": [7, 10], "S0,S0": [4, 10], "SS0:2,S0": [4, 10], "R,S0": [7, 10], "S1,R": [13, 10]}
    assert chunk == grouped[spec]
    codecs = meta["codecs"]
    if chunk != cell[spec]:  # inner chunks stay within one cell (C.2)
        inner = codecs[0]["configuration"]["chunk_shape"]
        assert all(c % i == 0 for c, i in zip(cell[spec], inner)), (inner, cell[spec])


@pytest.mark.parametrize("load_layout", list(LAYOUTS))
@pytest.mark.parametrize("save_layout", list(LAYOUTS))
def test_reshard(saved, clusters, save_layout, load_layout):
    path, _ = saved(save_layout)
    world = LAYOUTS[load_layout][0]
    clusters(world).run(rank_load_and_check, load_layout, path)


@pytest.mark.parametrize("save_layout", list(LAYOUTS))
def test_load_into_plain_tensors_one_process(saved, save_layout):
    path, _ = saved(save_layout)
    sd = zarrckpt.load_state_dict(path)
    assert sd["step"] == 42
    for k, v in global_state().items():
        assert torch.equal(sd["model"][k], v)


@pytest.mark.parametrize("save_layout", ["w4-S0,S0", "w2-S1", "w4-SS0:2,S0"])
def test_zarr_python_reads_global_tensor(saved, save_layout):
    import zarr

    path, _ = saved(save_layout)
    for k, v in global_state().items():
        a = zarr.open_array(os.path.join(path, "model", k), mode="r")
        np.testing.assert_array_equal(a[...].view(np.uint8), _np(v).view(np.uint8))


def rank_nested_uneven(rank, world, path):
    """[Shard(0), Shard(0)] with 4097 rows: chunks of 1025 rows, boundary rows exchanged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(4097 * 3, dtype=torch.float32).reshape(4097, 3)
    pl = [Shard(0), Shard(0)]
    local = torch_local(full, (2, 2), pl, mesh.get_coordinate())
    dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=full.shape, stride=full.stride())
    rep = zarrckpt.save({"x": dt}, path)
    return rep["bytes_written"]


def test_nested_uneven_exchange(tmp_path, clusters):
    path = str(tmp_path / "ck")
    written = clusters(4).run(rank_nested_uneven, path)
    assert sum(written) == 4097 * 3 * 4
    with open(os.path.join(path, "x", "zarr.json")) as f:
        assert json.load(f)["chunk_grid"]["configuration"]["chunk_shape"] == [1025, 3]
    assert len(os.listdir(os.path.join(path, "x", "c"))) == 4  # not 4097 one-row chunks
    sd = zarrckpt.load_state_dict(path)
    assert torch.equal(sd["x"], torch.arange(4097 * 3, dtype=torch.float32).reshape(4097, 3))


def rank_partial(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    try:
        zarrckpt.save({"p": dt}, path)
    except zarrckpt.UnsupportedPlacementError as e:
        return str(e)
    return None


def test_partial_is_refused(tmp_path, clusters):
    msgs = clusters(2).run(rank_partial, str(tmp_path / "ck"))
    assert all(m and "Partial" in m and "redistribute" in m and "'p'" in m for m in msgs), msgs
    assert not os.path.exists(tmp_path / "ck" / "zarr.json")


def rank_mismatch(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    dt = DTensor.from_local(torch.full((4, 4), 7.0), mesh, [Shard(0)], run_check=False)
    try:
        zarrckpt.load({"model": {"w": dt}, "step": 0}, path, strict=False)
    except zarrckpt.ShapeMismatchError as e:
        # nothing half-loaded: the local shard is untouched
        assert torch.equal(dt.to_local(), torch.full((4, 4), 7.0))
        return str(e)
    return None


def test_shape_mismatch_on_reshard(saved, clusters):
    path, _ = saved("w2-S0")
    msgs = clusters(2).run(rank_mismatch, path)
    assert all("model/w" in m and "(13, 10)" in m and "(8, 4)" in m for m in msgs)


def rank_pipeline_stages(rank, world, path):
    """Pipeline-parallel style: each rank holds different plain tensors and values."""
    state = {"shared": torch.full((3,), 1.0), "step": 5,
             "stage": {str(rank): {"w": torch.full((4, 4), float(rank)), "meta": rank}}}
    return zarrckpt.save(state, path)["bytes_written"]


def test_ranks_with_different_keys(tmp_path, clusters):
    path = str(tmp_path / "ck")
    written = clusters(2).run(rank_pipeline_stages, path)
    assert sum(written) == 3 * 4 + 2 * 16 * 4
    sd = zarrckpt.load_state_dict(path)
    assert sd["step"] == 5 and torch.equal(sd["shared"], torch.ones(3))
    for r in range(2):
        assert torch.equal(sd["stage"][str(r)]["w"], torch.full((4, 4), float(r)))
        assert sd["stage"][str(r)]["meta"] == r


def rank_key_type_clash(rank, world, path):
    state = {"s": {(0 if rank == 0 else "0"): torch.ones(2)}}
    try:
        zarrckpt.save(state, path)
    except zarrckpt.ZarrckptError as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_ranks_disagreeing_on_key_types_fail_cleanly(tmp_path, clusters):
    msgs = clusters(2).run(rank_key_type_clash, str(tmp_path / "ck"))
    assert all(m and "same stored name" in m for m in msgs), msgs


def rank_save_big_rows(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024)  # 8 MiB
    zarrckpt.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, path)


def rank_load_columns(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    t = distribute_tensor(torch.zeros(2048, 1024), mesh, [Shard(1)])
    rep = {}
    zarrckpt.load({"w": t}, path, report=rep)
    full = torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024)
    assert torch.equal(t.full_tensor(), full)
    return rep


def test_resharded_load_fetches_only_what_it_needs(tmp_path, clusters):
    path = str(tmp_path / "ck")
    clusters(2).run(rank_save_big_rows, path)
    reps = clusters(2).run(rank_load_columns, path)
    for rep in reps:
        assert rep["bytes_needed"] == 2048 * 512 * 4
        assert rep["bytes_fetched"] <= 1.1 * rep["bytes_needed"], rep


def rank_pipeline_dtensors(rank, world, path):
    """PP x DP: each pipeline stage holds its own DTensors, sharded over its dp sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    full = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3) + 100 * stage
    state = {f"stage{stage}": {"w": distribute_tensor(full, mesh["dp"], [Shard(0)])}, "step": 3}
    return zarrckpt.save(state, path)["bytes_written"]


def test_pipeline_stages_with_dtensors_on_sub_meshes(tmp_path, clusters):
    path = str(tmp_path / "ck")
    written = clusters(4).run(rank_pipeline_dtensors, path)
    assert sum(written) == 2 * 10 * 3 * 4
    sd = zarrckpt.load_state_dict(path)
    for stage in range(2):
        expect = torch.arange(30, dtype=torch.float32).reshape(10, 3) + 100 * stage
        assert torch.equal(sd[f"stage{stage}"]["w"], expect)
    assert sd["step"] == 3
