"""A training loop with checkpoint tiers (spec §7.8): FSDP2 + AdamW on 4 CPU ranks as 2
simulated nodes (ZARRCKPT_NODE=node0/node1) checkpoints every 2 steps to each node's local
tier (a copy of each node's files on the other node), promotes every 3rd save (every 6th
step) to the persistent directory in the background, and is killed with SIGKILL at step
15. Then node1 is "replaced": its local tier is wiped. The job restarts on the same 4
ranks and resumes from step 14 restored from the peers' copies (the persistent directory is
only listed, to make sure it holds nothing newer: no step of it is read), then trains on to
step 20.

    python examples/train_with_tiers.py [DIR]     # DIR/local (the nodes' tiers), DIR/persistent

On a real cluster pass local_dir="/dev/shm/ckpt" (or an NVMe path) on every host and the
persistent root as a shared path or s3://bucket/prefix; nodes are found by host name.
Ranks are spawned processes joined by gloo; no GPU needed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import zarrckpt

WORLD, KILL_AT, END, EVERY = 4, 15, 20, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def run(rank: int, world: int, port: int, root: str, kill_at: int | None) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["ZARRCKPT_NODE"] = f"node{rank * 2 // world}"  # 2 ranks per "node"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state(step: int) -> dict:
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd, "step": step}

    with zarrckpt.CheckpointManager(os.path.join(root, "persistent"), local_dir=os.path.join(root, "local"),
                                    local_replicas=1, persist_every=3 * EVERY, keep_last=2,
                                    async_save=True) as mgr:
        st = state(0)
        start = mgr.restore(st) or 0
        if start:
            set_state_dict(model, optim, model_state_dict=st["model"], optim_state_dict=st["optim"])
        if rank == 0:
            rep = mgr.last_restore or {}
            src = rep.get("source")
            if src == "peers":  # every rank of the replaced node fetched its share at once
                src += f", {rep['fetched_bytes_all_nodes']} bytes fetched in {rep['fetch_seconds']:.2f} s"
            print(f"[world {world}] " + (f"resumed from step {start} (source: {src})" if start else "starting fresh"),
                  flush=True)
        for step in range(start + 1, END + 1):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            if step % EVERY == 0:
                mgr.save(step, state(step), metrics={"loss": float(loss.detach())})
            if step == kill_at:
                mgr.wait()  # the saves so far are on both nodes' tiers (a save in flight would be lost)
                os.kill(os.getpid(), signal.SIGKILL)
        mgr.wait()
        if rank == 0:
            print(f"[world {world}] step {step}, loss {float(loss.detach()):.4f}, persistent steps {mgr.steps()}",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "run")
    # 1. four ranks (two "nodes") train, checkpoint every 2 steps, and are killed at step 15
    ctx = mp.start_processes(run, args=(WORLD, free_port(), root, KILL_AT), nprocs=WORLD, join=False,
                             start_method="spawn")
    for p in ctx.processes:
        p.join()
    assert all(p.exitcode == -signal.SIGKILL for p in ctx.processes), [p.exitcode for p in ctx.processes]
    persistent = zarrckpt.CheckpointManager(os.path.join(root, "persistent"))
    print(f"[killed at step {KILL_AT}] persistent steps: {persistent.steps()}; local tiers: "
          + "; ".join(f"{n}: {sorted(os.listdir(os.path.join(root, 'local', n)))}"
                      for n in sorted(os.listdir(os.path.join(root, "local")))), flush=True)
    # 2. node1 is replaced by a machine with an empty local tier
    shutil.rmtree(os.path.join(root, "local", "node1"))
    print("[node1 replaced] its local tier is empty", flush=True)
    # 3. the job restarts: the newest step comes from node0's copies, over the process group
    mp.start_processes(run, args=(WORLD, free_port(), root, None), nprocs=WORLD, start_method="spawn")
    print(f"checkpoint at {os.path.join(root, 'local', 'node0')} and {persistent.step_path(persistent.latest_step())} "
          f"(persistent steps {persistent.steps()})")


if __name__ == "__main__":
    main()
