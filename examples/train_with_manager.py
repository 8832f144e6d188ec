"""A training loop with zarrckpt.CheckpointManager: FSDP2 + AdamW on 2 CPU ranks saves
every 10 steps (asynchronously, keeping the last 2 and every 20th), is killed with
SIGKILL at step 25 while a save is in flight, then resumes on 1 rank -- another world
size -- from the latest committed step and trains on to step 40. SIGTERM (what
schedulers send before preempting) makes every rank save and stop at the same step.

    python examples/train_with_manager.py [ROOT]     # a directory, or s3://bucket/prefix

For s3:// the usual AWS_* variables (or ~/.aws files) give the endpoint, region and
keys. Ranks are spawned processes joined by gloo; no GPU needed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import zarrckpt

KILL_AT, END = 25, 40


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

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state(step: int) -> dict:
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd, "step": step}

    with zarrckpt.CheckpointManager(root, keep_last=2, keep_every=20, async_save=True) as mgr:
        st = state(0)
        start = mgr.restore(st) or 0  # the latest committed step, resharded onto this world
        if start:
            set_state_dict(model, optim, model_state_dict=st["model"], optim_state_dict=st["optim"])
        if rank == 0:
            print(f"[world {world}] {'resumed from step ' + str(start) if start else 'starting fresh'}",
                  flush=True)
        mgr.install_preemption_handler()
        for step in range(start + 1, END + 1):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            stop = mgr.reached_preemption(step)
            if step % 10 == 0 or step == kill_at or stop:
                mgr.save(step, state(step), metrics={"loss": float(loss.detach())})
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # the job dies, a save in flight
            if stop:
                break
        if rank == 0:
            print(f"[world {world}] step {step}, loss {float(loss.detach()):.4f}, committed steps {mgr.steps()}",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "run")
    # 1. two ranks train, save every 10 steps, and are killed at step 25
    ctx = mp.start_processes(run, args=(2, free_port(), root, KILL_AT), nprocs=2, join=False,
                             start_method="spawn")
    for p in ctx.processes:
        p.join()
    assert all(p.exitcode == -signal.SIGKILL for p in ctx.processes), [p.exitcode for p in ctx.processes]
    latest = zarrckpt.CheckpointManager(root).latest_step()
    print(f"[killed at step {KILL_AT}] latest committed step: {latest}", flush=True)
    # 2. one rank resumes from the latest committed step and trains on
    mp.start_processes(run, args=(1, free_port(), root, None), nprocs=1, start_method="spawn")
    mgr = zarrckpt.CheckpointManager(root)
    print(f"checkpoint at {mgr.step_path(mgr.latest_step())} (steps {mgr.steps()})")


if __name__ == "__main__":
    main()
