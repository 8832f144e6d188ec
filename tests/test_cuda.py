"""On 2 GPUs over NCCL: FSDP2 save (sync and async, pinned staging), resharded load into
CUDA DTensors, and a CPU read back. Runs on the lent GPU machine; CI has no GPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import zarrckpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cluster import free_port  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)]


def _rank(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from zarrckpt.distributed import staging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1000), nn.ReLU(), nn.Linear(1000, 300)).cuda()
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    ref = {k: v.full_tensor().cpu() for k, v in msd.items()}

    small = torch.arange(10, device="cuda")  # a plain CUDA tensor: packed (copied to host)
    zarrckpt.save({"small": small}, f"{path}/small")
    assert torch.equal(zarrckpt.load_state_dict(f"{path}/small")["small"], small.cpu())
    fut = zarrckpt.async_save({"model": msd, "optim": osd}, f"{path}/async")
    assert staging.shared_arena().pinned
    with torch.no_grad():  # training continues; the checkpoint keeps the old values
        for p in model.parameters():
            p.add_(1)
    fut.result(timeout=120)
    zarrckpt.save({"model": msd}, f"{path}/sync")  # after the +1

    # Resharded load into CUDA DTensors split by columns.
    for name, expect in (("async", ref), ("sync", {k: v + 1 for k, v in ref.items()})):
        target = {"model": {k: distribute_tensor(torch.zeros_like(v, device="cuda"), mesh,
                                                 [Shard(v.dim() - 1)]) for k, v in ref.items()}}
        zarrckpt.load(target, f"{path}/{name}", strict=False)
        for k, v in target["model"].items():
            assert v.to_local().is_cuda
            assert torch.equal(v.full_tensor().cpu(), expect[k]), (name, k)
    if rank == 0:
        sd = zarrckpt.load_state_dict(f"{path}/async", keys=["model"])
        for k, v in ref.items():
            assert torch.equal(sd["model"][k], v), k
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_on_two_gpus(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)


def _overlap_rank(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    w = distribute_tensor(torch.arange(1 << 22, dtype=torch.float32, device="cuda").reshape(2048, 2048),
                          mesh, [Shard(0)])
    ref = w.full_tensor().cpu()
    zarrckpt.reserve_staging({"w": w})
    # default: the current stream waits for the side-stream copies, so this add comes after them
    fut = zarrckpt.async_save({"w": w}, f"{path}/default")
    w.to_local().add_(1)
    fut.result(timeout=120)
    # overlap=True: nothing waits until the caller says so
    fut = zarrckpt.async_save({"w": w}, f"{path}/overlap", overlap=True)
    fut.wait_staged(torch.cuda.current_stream())
    w.to_local().add_(1)
    assert fut.result(timeout=120)["bytes_staged"] > 0 and fut.staged()
    if rank == 0:
        assert torch.equal(zarrckpt.load_state_dict(f"{path}/default")["w"], ref)
        assert torch.equal(zarrckpt.load_state_dict(f"{path}/overlap")["w"], ref + 1)
    dist.barrier()
    dist.destroy_process_group()


def test_async_staging_on_a_side_stream(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_overlap_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
