"""Runs the GPU scenarios: one NCCL world of ``world`` processes (one GPU each) runs every
scenario in turn and writes each one's outcome, per rank, to a JSON file as it goes (a
world that hangs or dies still leaves what it found)."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta


def rank_main(rank: int, world: int, port: int, root: str, names: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from _scenarios import SCENARIOS, Ctx

    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world, timeout=timedelta(seconds=240),
                            device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (world,))
    results: dict = {}
    for name in names:
        min_world, fn = SCENARIOS[name]
        if world < min_world:
            continue
        notes: dict = {"mesh": mesh}
        try:
            fn(Ctx(rank, world, root, notes))
            res = {"ok": True}
        except BaseException:  # noqa: BLE001 - reported to the test
            res = {"ok": False, "error": traceback.format_exc()[-6000:]}
        res["notes"] = {k: str(v) for k, v in notes.items() if k != "mesh"}
        results[name] = res
        with open(out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out + ".tmp", out)
        ok = torch.tensor([int(res["ok"])], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank finished this scenario
    dist.destroy_process_group()
