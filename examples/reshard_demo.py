"""zarrckpt in one script: train with FSDP2 on 2 CPU ranks, save, then load the
checkpoint resharded -- on 1 process into plain tensors, and on 2 ranks with
other placements (Shard(1) instead of Shard(0)) -- and read it with zarr-python.

    python examples/reshard_demo.py [checkpoint_dir]

Ranks are spawned processes joined by gloo; no GPU needed.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import zarrckpt


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def train_and_save(rank: int, world: int, port: int, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init(rank, world, port)
    model = make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # parameters become Shard(0) DTensors
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    report = zarrckpt.save({"model": model_sd, "optim": optim_sd, "step": 5}, path, overwrite=True)
    full = {k: v.full_tensor().numpy() for k, v in model_sd.items()}  # a collective: all ranks
    if rank == 0:
        seconds = report["seconds"]  # per phase, and their "total"
        phases = ", ".join(f"{name} {s:.3f}" for name, s in seconds.items() if name != "total")
        print(f"[save, 2 ranks, Shard(0)] wrote {report['bytes_written']} bytes on rank 0 in "
              f"{seconds['total']:.3f} s ({phases})")
        np.savez(path + ".reference.npz", **full)  # to check the loads below against
    dist.barrier()  # let every rank finish its collectives before tearing gloo down
    dist.destroy_process_group()


def load_column_sharded(rank: int, world: int, port: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    # Same model, but every matrix split by columns: a layout the save never had.
    target = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(v.dim() - 1)])
                        for k, v in make_model().state_dict().items()}}
    report = {}
    zarrckpt.load(target, path, report=report)  # model only: stored optim and step are left, as asked
    reference = reference_tensors(path)
    for k, v in target["model"].items():
        assert torch.equal(v.full_tensor(), reference[k]), k
    if rank == 0:
        print(f"[load, 2 ranks, Shard(1)] read {report['bytes_needed']} bytes on rank 0; "
              "matches the saved model bit for bit")
    dist.barrier()  # let every rank finish its collectives before tearing gloo down
    dist.destroy_process_group()


def reference_tensors(path: str) -> dict[str, torch.Tensor]:
    with np.load(path + ".reference.npz", allow_pickle=False) as z:
        return {k: torch.from_numpy(z[k]) for k in z.files}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "ckpt")
    mp.spawn(train_and_save, args=(2, free_port(), path), nprocs=2)

    # One process, no process group: plain CPU tensors.
    sd = zarrckpt.load_state_dict(path)
    reference = reference_tensors(path)
    assert all(torch.equal(sd["model"][k], v) for k, v in reference.items())
    print(f"[load_state_dict, 1 process] step={sd['step']}, "
          f"{len(sd['model'])} model tensors, AdamW state for {len(sd['optim']['state'])} params")

    mp.spawn(load_column_sharded, args=(2, free_port(), path), nprocs=2)

    # Plain Zarr: no zarrckpt reader needed.
    import zarr

    w = zarr.open_array(os.path.join(path, "model", "0.weight"), mode="r")
    print(f"[zarr-python] model/0.weight: shape={w.shape} dtype={w.dtype} chunks={w.chunks} "
          f"attrs={dict(w.attrs)['zarrckpt']['placements']}")
    print(f"checkpoint at {path}")


if __name__ == "__main__":
    main()
