"""Rank functions of tests/test_grouped_chunks.py (run on 4 gloo ranks): DTensors of small
shards saved with chunks that group whole shards (``chunk_target_bytes``), then loaded on
other placements and meshes."""

from __future__ import annotations

import glob
import os

import numpy as np
import torch

import zarrckpt
from _roundtrip import _local, _placements, bits

# key: (shape, mesh shape, save placements, load mesh shape, load placements)
SPECS = {
    "model/emb": ((2048, 256), (4,), "S0", (2, 2), "S1,S0"),  # 512 KiB shards: one 2 MiB object
    "model/w": ((4098, 128), (4,), "S0", (4,), "S1"),  # uneven: 3 shards of 1025 rows, then 1023
    "model/tp": ((512, 512), (2, 2), "S0,S1", (4,), "S0"),  # 2-D: grouped along dim 0, then dim 1
    "model/big": ((16384, 128), (4,), "S0", (4,), "S1"),  # 2 MiB shards: >= 1/16 of the target, not grouped
    "model/bias": ((64,), (4,), "S0", (4,), "S0"),  # tiny: one object
}
TARGET = 16 << 20  # bytes (cells of at least 1/16 of it, 1 MiB, are not grouped: Appendix C.1)


def global_tensor(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(SPECS[key][0], generator=g)


def _state(which: str, zeros: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    out: dict = {"model": {}}
    for key, (shape, mesh_s, pl, load_mesh, load_pl) in SPECS.items():
        mesh_shape, spec = (mesh_s, pl) if which == "save" else (load_mesh, load_pl)
        mesh = init_device_mesh("cpu", mesh_shape)
        placements = _placements(spec)
        full = torch.zeros(shape) if zeros else global_tensor(key)
        local = _local(full, mesh, placements)
        out["model"][key.split("/")[1]] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                             shape=full.shape, stride=full.stride())
    return out


def save(rank: int, world: int, path: str, target: int | None = TARGET) -> dict:
    zarrckpt.save(_state("save", False), path, chunk_target_bytes=target)
    return {k: sorted(os.path.relpath(f, os.path.join(path, k))
                      for f in glob.glob(os.path.join(path, k, "c", "**"), recursive=True) if os.path.isfile(f))
            for k in SPECS}


def load_and_compare(rank: int, world: int, path: str, layouts: str = "load") -> dict:
    """Load into the load layouts (``"load"``) or the save layouts (``"save"``) and compare
    every element with the global tensors."""
    state = _state(layouts, True)
    report: dict = {}
    zarrckpt.load(state, path, report=report)
    for key in SPECS:
        t = state["model"][key.split("/")[1]]
        full = t.full_tensor()
        assert np.array_equal(bits(full), bits(global_tensor(key))), key
    return {"needed": report["bytes_needed"], "fetched": report["bytes_fetched"]}


# ---- 8 ranks: many small shards, counted ----------------------------------------------

N_SMALL = 40  # DTensors of 32 x 64 fp32 shards (8 KiB) on 8 ranks
N_PLAIN = 10  # small plain leaves beside them


def many_small(rank: int, world: int, path: str) -> dict:
    """Save 40 small-shard DTensors with grouped chunks, then load them back: the chunk
    files of the checkpoint, the zarr.json documents this rank read during the load, and
    the files below the checkpoint it made a metadata call (``os.stat``) on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from zarrckpt.storage import _tensorstore

    mesh = init_device_mesh("cpu", (world,))

    def state(zeros: bool) -> dict:
        out = {}
        for i in range(N_SMALL):
            g = torch.Generator().manual_seed(i)
            full = torch.zeros(32 * world, 64) if zeros else torch.randn(32 * world, 64, generator=g)
            out[f"w{i}"] = DTensor.from_local(full.chunk(world)[rank].contiguous(), mesh, [Shard(0)],
                                              run_check=False, shape=full.shape, stride=full.stride())
        for i in range(N_PLAIN):  # small replicated leaves (norms, biases): arrays of their own
            out[f"norm{i}"] = torch.zeros(64) if zeros else torch.full((64,), float(i))
        return {"model": out, "step": 7}

    zarrckpt.save(state(False), path)  # the defaults: grouped chunks, no packs
    reads: list[str] = []
    cls = _tensorstore.TensorStoreStorage
    real_bytes, real_get = cls.read_bytes, cls.get

    def read_bytes(self, key):
        reads.append(key)
        return real_bytes(self, key)

    def get(self, key):
        reads.append(key)
        return real_get(self, key)

    stats: list[str] = []  # metadata calls by path (stat) and chunk files opened (each then fstat-ed)
    opened: list[str] = []
    real_stat, real_open = os.stat, os.open

    def counting_stat(p, *a, **k):
        if str(p).startswith(str(path)):
            stats.append(os.path.relpath(p, path))
        return real_stat(p, *a, **k)

    def counting_open(p, *a, **k):
        if str(p).startswith(str(path)):
            opened.append(os.path.relpath(p, path))
        return real_open(p, *a, **k)

    cls.read_bytes, cls.get = read_bytes, get
    os.stat, os.open = counting_stat, counting_open
    try:
        target = state(True)
        zarrckpt.load(target, path)
    finally:
        cls.read_bytes, cls.get = real_bytes, real_get
        os.stat, os.open = real_stat, real_open
    for i in range(N_SMALL):
        g = torch.Generator().manual_seed(i)
        want = torch.randn(32 * world, 64, generator=g).chunk(world)[rank]
        assert torch.equal(target["model"][f"w{i}"].to_local(), want), i
    for i in range(N_PLAIN):
        assert torch.equal(target["model"][f"norm{i}"], torch.full((64,), float(i))), i
    files = [os.path.relpath(f, path) for f in glob.glob(os.path.join(path, "**"), recursive=True)
             if os.path.isfile(f)]
    return {"documents_read": [k for k in reads if k.endswith("zarr.json")], "files": len(files), "stats": stats,
            "opened": opened,
            "chunk_files": sum("/c/" in f or f.endswith("/c") for f in files)}


def async_repeated(rank: int, world: int, path: str) -> dict:
    """Three async saves of grouped small shards (the exchange runs in the background, on
    the staged copies, over the side group), the state changed after each call returns;
    every checkpoint holds the values of its call."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    fulls = {f"w{i}": torch.randn(8 * world, 16, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    state = {"model": {k: DTensor.from_local(v.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                             shape=v.shape, stride=v.stride()) for k, v in fulls.items()},
             "norm": torch.ones(16), "step": 0}
    futures, expected = [], []
    for step in range(3):
        state["step"] = step
        expected.append({k: v.clone() for k, v in fulls.items()})
        futures.append(zarrckpt.async_save(state, f"{path}/s{step}"))
        for v in fulls.values():
            v.add_(1)
        for t in state["model"].values():  # training goes on at once
            t.to_local().add_(1)
        state["norm"].add_(1)
        dist.all_reduce(torch.ones(1))  # the loop's own collective, while the save runs
    chunk_files = []
    for step, fut in enumerate(futures):
        fut.result(timeout=120)
        got = zarrckpt.load_state_dict(f"{path}/s{step}")
        assert got["step"] == step and torch.equal(got["norm"], torch.full((16,), float(1 + step)))
        for k, v in expected[step].items():
            assert torch.equal(got["model"][k], v), (step, k)
        chunk_files.append(sum(os.path.isfile(f) for f in glob.glob(f"{path}/s{step}/model/*/c/**/*", recursive=True)))
    return {"chunk_files": chunk_files}


def async_different_keys(rank: int, world: int, path: str) -> dict:
    """Ranks hold different plain leaves (pipeline stages; torchtitan's per-rank dataloader
    state): three async saves, the state changed right after each call returns."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8 * world * 4, dtype=torch.float32).reshape(8 * world, 4)
    state = {"w": DTensor.from_local(full.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False,
                                     shape=full.shape, stride=full.stride()),
             f"stage{rank}": {"p": torch.full((64,), float(rank)), "blob": b"r%d" % rank},
             "shared": torch.zeros(16), "step": 0}
    futures, expected = [], []
    for step in range(3):
        state["step"] = step
        expected.append({"p": [torch.full((64,), float(r) + step) for r in range(world)],
                         "shared": torch.full((16,), float(step))})
        futures.append(zarrckpt.async_save(state, f"{path}/s{step}"))
        state[f"stage{rank}"]["p"].add_(1)  # training goes on at once
        state["shared"].add_(1)
    for step, fut in enumerate(futures):
        fut.result(timeout=120)
        got = zarrckpt.load_state_dict(f"{path}/s{step}")
        for r in range(world):
            assert torch.equal(got[f"stage{r}"]["p"], expected[step]["p"][r]), (step, r)
            assert got[f"stage{r}"]["blob"] == b"r%d" % r
        assert torch.equal(got["shared"], expected[step]["shared"]) and torch.equal(got["w"], full)
    return {"ok": True}
