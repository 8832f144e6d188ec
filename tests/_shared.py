"""Rank functions of tests/test_shared_reads.py (4 gloo ranks): loads whose small pieces are
read through one owner rank per chunk object (``zarrckpt.api.shared_reads``)."""

from __future__ import annotations

import os

import numpy as np
import torch

import zarrckpt
from _roundtrip import bits

N = 24  # small DTensors (Shard(0), 8 rows of 64 per rank)


def _full(i: int, world: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8 * world, 64, generator=g).to(dtype)


def state(world: int, placement: str, zeros: bool, *, bf16_as=torch.bfloat16) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    pl = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}[placement]
    model = {}
    for i in range(N):
        full = _full(i, world)
        model[f"w{i}"] = distribute_tensor(torch.zeros_like(full) if zeros else full, mesh, pl)
    half = _full(N, world, torch.bfloat16)
    model["half"] = distribute_tensor(torch.zeros(half.shape, dtype=bf16_as) if zeros else half, mesh, pl)
    model["norm"] = torch.zeros(64) if zeros else torch.arange(64.0)  # replicated plain leaf
    model["ids"] = torch.zeros(10, dtype=torch.int64) if zeros else torch.arange(10) * 7
    model["scale"] = torch.tensor(0.0) if zeros else torch.tensor(2.5)  # 0-d, as AdamW's step
    return {"model": model, "step": 0 if zeros else 3}


def save(rank: int, world: int, path: str, storage: dict | None = None) -> None:
    o = zarrckpt.StorageOptions(**storage) if storage else None
    zarrckpt.save(state(world, "S0", False), path, storage=o)


def load(rank: int, world: int, path: str, placement: str, shared: bool | None,
         storage: dict | None = None, cast: bool = False) -> dict:
    """Load into ``placement`` (with ``cast``: the bf16 array into an fp32 target) and
    compare every element; the report's counters and the chunk objects this rank GOT."""
    from zarrckpt.storage import _tensorstore

    o = zarrckpt.StorageOptions(**storage) if storage else None
    target = state(world, placement, True, bf16_as=torch.float32 if cast else torch.bfloat16)
    gets: list[str] = []
    cls = _tensorstore.TensorStoreStorage
    real = cls.get

    def get(self, key):
        if "/c/" in key or key.split("/")[-1] == "c":
            gets.append(key)
        return real(self, key)
    cls.get = get
    from zarrckpt.storage._tensorstore import io_counters
    import tensorstore as ts

    def http() -> int:
        return sum(int(v.get("value", 0)) for m in ts.experimental_collect_matching_metrics(
            "/tensorstore/http/request_started") for v in m["values"])
    before, b_io = http(), io_counters().get("bytes_read", 0)
    report: dict = {}
    try:
        zarrckpt.load(target, path, report=report, shared_reads=shared, storage=o, cast=cast)
    finally:
        cls.get = real
    m = target["model"]
    for i in range(N):
        assert np.array_equal(bits(m[f"w{i}"].full_tensor()), bits(_full(i, world))), i
    want = _full(N, world, torch.bfloat16)
    got = m["half"].full_tensor()
    assert (torch.equal(got, want.float()) if cast else np.array_equal(bits(got), bits(want)))
    assert torch.equal(m["norm"], torch.arange(64.0)) and torch.equal(m["ids"], torch.arange(10) * 7)
    assert m["scale"].item() == 2.5
    assert target["step"] == 3
    return {"shared": report["shared_reads"], "gets": gets, "needed": report["bytes_needed"],
            "fetched": report["bytes_fetched"], "http": http() - before,
            "read": io_counters().get("bytes_read", 0) - b_io}


def load_fails(rank: int, world: int, path: str) -> str:
    target = state(world, "S0", True)
    try:
        zarrckpt.load(target, path, shared_reads=True)
    except zarrckpt.ZarrckptError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def chunk_files(path: str) -> list[str]:
    out = []
    for root, _, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, f), path) for f in files if f != "zarr.json"]
    return sorted(out)
