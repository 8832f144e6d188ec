"""Real multi-process worlds for tests: N spawned processes joined by gloo.

A ``Cluster`` is started once per world size and reused by every test (spawning
torch processes costs seconds). ``cluster.run(fn, *args)`` runs the importable
function ``fn(rank, world_size, *args)`` on every rank and returns the results
in rank order; an exception on any rank fails the call with every rank's
traceback. A hung or crashed cluster is torn down and rebuilt on next use.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from datetime import timedelta

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inq, outq, timeout_s: float) -> None:
    sys.path.insert(0, TESTS_DIR)
    sys.path.insert(0, os.path.dirname(TESTS_DIR))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    while True:
        job = inq.get()
        if job is None:
            break
        module, name, args = job
        try:
            fn = getattr(importlib.import_module(module), name)
            outq.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - reported to the test
            outq.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Cluster:
    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self.outq = ctx.Queue()
        self.inqs = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.inqs[r], self.outq, timeout_s),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float | None = None):
        module = fn.__module__
        for q in self.inqs:
            q.put((module, fn.__name__, args))
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        deadline = timeout or self.timeout_s * 2 + 30
        try:
            for _ in range(self.world_size):
                rank, ok, value = self.outq.get(timeout=deadline)
                (results if ok else failures)[rank] = value
        except queue.Empty:
            self.close()
            raise AssertionError(
                f"{fn.__name__} timed out on world {self.world_size}; "
                f"finished ranks {sorted(results) + sorted(failures)}; failures: {failures}"
            ) from None
        if failures:
            if any("Connection" in f or "gloo" in f.lower() for f in failures.values()):
                self.close()  # a collective broke; peers may be wedged
            raise AssertionError(
                "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            )
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        self.broken = True
        for q in self.inqs:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
