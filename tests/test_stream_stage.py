"""Sync saves of device leaves stream through a bounded host arena a batch at a time
(``SaveRun._stream_stage``): one device synchronisation per batch of leaves that fit, and
never a leaf's bytes overwritten by the next batch before its writes are done.

CI has no GPU, so the CPU leaves here take the device path: ``ArrayPlan.on_host`` is patched
to say "not on the host", which sends them through the streaming arena exactly as CUDA
leaves are (the copies are then synchronous, so what this checks is the batching, the
order and the arena's reuse; ``tests/gpu/`` runs the same path on GPUs)."""

from __future__ import annotations

import pytest
import torch

import zarrckpt
from zarrckpt.api import save as _save
from zarrckpt.planning import plan as _plan


@pytest.fixture
def as_device(monkeypatch):
    """Every tensor leaf streams through the arena; returns the list of synchronisations."""
    syncs: list[int] = []
    monkeypatch.setattr(_plan.ArrayPlan, "on_host", property(lambda self: not isinstance(self.source, torch.Tensor)))
    real = _save.sync_devices

    def counted(tensors):
        syncs.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(_save, "sync_devices", counted)
    return syncs


def _state(sizes: list[int], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)},
            "step": torch.tensor(7, dtype=torch.int64)}


def _check(state: dict, path) -> None:
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "step": torch.tensor(0, dtype=torch.int64)}
    zarrckpt.load(target, path)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v), k
    assert int(target["step"]) == 7


def test_one_synchronisation_when_every_leaf_fits(tmp_path, as_device):
    state = _state([16, 1000, 3, 4096, 250] * 40)  # 200 leaves, ~0.9 MB
    zarrckpt.save(state, tmp_path / "c")
    _check(state, tmp_path / "c")
    assert len(as_device) == 1, as_device  # was one per leaf (201)


@pytest.mark.parametrize("staging", [4 << 10, 20 << 10, 64 << 10])
def test_batches_through_a_small_arena(tmp_path, as_device, staging):
    """Leaves of 64 B to 16 KB and two bigger than the arena (a buffer of their own):
    each batch fills the arena, the next waits for the writes of the one before."""
    sizes = [16, 1000, 3, 4096, 250, 700, 2048, 5] * 12 + [staging // 2, 3 * staging // 4, 2 * staging]
    state = _state(sizes, seed=1)
    zarrckpt.release_staging()  # the process's arena, kept from earlier saves, may be bigger
    zarrckpt.save(state, tmp_path / "c", max_staging_bytes=staging)
    _check(state, tmp_path / "c")
    staged = sum(4 * n for n in sizes if 4 * n <= staging)
    assert staged // staging <= len(as_device) < len(sizes) // 2, (len(as_device), len(sizes))


def test_leaves_asked_out_of_order_are_still_right(tmp_path, as_device, monkeypatch):
    """The engine asks for leaves in plan order; if it did not, a leaf outside the current
    batch starts a new one (never reads another leaf's bytes)."""
    real = _save.engine.write_arrays

    def reversed_order(store, documents, arrays, *a, **kw):
        return real(store, documents, list(reversed(arrays)), *a, **kw)

    monkeypatch.setattr(_save.engine, "write_arrays", reversed_order)
    state = _state([100, 7, 2000, 33, 512] * 10, seed=2)
    zarrckpt.release_staging()
    zarrckpt.save(state, tmp_path / "c", max_staging_bytes=16 << 10)
    _check(state, tmp_path / "c")


def test_two_ranks_grouped_and_not(clusters, tmp_path):
    """Two gloo ranks, FSDP-like Shard(0) DTensors, grouped chunks (the exchange) and one
    chunk per shard: the streamed local data of each rank is what lands."""
    assert clusters(2).run(_two_ranks, str(tmp_path)) == [60, 60]


def _two_ranks(rank: int, world: int, path: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    full = {f"w{i}": torch.randn(8 * (i + 1), 3, generator=g) for i in range(30)}
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    checked = 0
    real = _plan.ArrayPlan.on_host
    _plan.ArrayPlan.on_host = property(lambda self: not isinstance(self.source, torch.Tensor))
    try:  # this worker process serves other tests after this one
        for grouped in (None, 256 << 20):
            dst = f"{path}/{grouped}"
            zarrckpt.save(state, dst, chunk_target_bytes=grouped, max_staging_bytes=2 << 10)
            got = zarrckpt.load_state_dict(dst)
            for k, v in full.items():
                assert torch.equal(got[k], v), (grouped, k)
                checked += 1
    finally:
        _plan.ArrayPlan.on_host = real
    return checked
