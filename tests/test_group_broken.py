"""A zarrckpt collective that failed marks its ranks broken for that process group only:
a world made again in the same process (a restart without a new process, a notebook, a
reused test worker) starts clean (review finding: the flag outlived destroy_process_group)."""

from __future__ import annotations

import os
import sys

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cluster import free_port  # noqa: E402


def _rank(rank: int, ports: list[int], path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import zarrckpt
    from zarrckpt.distributed import group as zdist

    seen = []
    for n, port in enumerate(ports):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        try:
            if n == 0:  # a collective failed here: the next save over these ranks is refused
                zdist._mark_broken(zdist.group(None), "a peer died (test)", publish=False)
                try:
                    zarrckpt.save({"w": torch.ones(2)}, f"{path}/a", entry_timeout=10)
                    seen.append("saved")
                except zarrckpt.DistributedError:
                    seen.append("refused")
            else:  # the world made again: clean
                zarrckpt.save({"w": torch.ones(2)}, f"{path}/b", entry_timeout=10)
                seen.append("saved")
        finally:
            dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write(",".join(seen))


def test_broken_ranks_are_forgotten_with_their_world(tmp_path):
    out = str(tmp_path / "out")
    mp.spawn(_rank, args=([free_port(), free_port()], str(tmp_path), out), nprocs=2)
    for r in range(2):
        assert open(f"{out}.{r}").read() == "refused,saved", r


def _gather_rank(rank: int, port: int, out: str) -> None:
    """Rank 2's zarrckpt collective failed (it marks the ranks broken and leaves); ranks 0
    and 1 go on into an all-gather and a gather: they must fail at once, not at the group's
    timeout (issue 28 item 7: object gathers could not be left before it)."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import zarrckpt
    from zarrckpt.distributed import group as zdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=120))
    g = zdist.group(None)
    seen = []
    if rank == 2:
        zdist._mark_broken(g, "rank 2's collective failed (test)")
        time.sleep(8)  # alive, elsewhere: never reaches the gathers
    else:
        for call in (lambda: g.all_gather(rank), lambda: g.gather_to_root(rank)):
            t0 = time.monotonic()
            try:
                call()
                seen.append("returned")
            except zarrckpt.DistributedError:
                seen.append(f"failed in {time.monotonic() - t0:.0f}s")
    with open(f"{out}.{rank}", "w") as f:
        f.write(",".join(seen))
    os._exit(0)  # no destroy_process_group: its barrier would wait for the broken peers


def test_object_gathers_fail_promptly_when_a_peer_will_not_come(tmp_path):
    out = str(tmp_path / "out")
    mp.spawn(_gather_rank, args=(free_port(), out), nprocs=3)
    for r in (0, 1):
        seen = open(f"{out}.{r}").read().split(",")
        assert len(seen) == 2 and all(s.startswith("failed in ") and int(s.split()[2][:-1]) <= 5 for s in seen), seen


def _p2p_rank(rank: int, port: int, out: str, how: str) -> None:
    """Rank 2 marks the ranks broken and stays away; ranks 0 and 1 wait to receive from it
    (gloo point-to-point works cannot be polled): they must fail at once, not at the
    group's timeout (issue 28 item 7, the part left after object gathers)."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import zarrckpt
    from zarrckpt.distributed import group as zdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=120))
    g = zdist.group(None)
    seen = "none"
    if rank == 2:
        zdist._mark_broken(g, "rank 2's collective failed (test)")
        time.sleep(8)  # alive, elsewhere: never sends
    else:
        buf = torch.empty(4, dtype=torch.uint8)
        t0 = time.monotonic()
        try:
            if how == "exchange":
                g.exchange([], [(2, buf)])
            else:
                g.irecv(buf, 2).wait()
            seen = "returned"
        except zarrckpt.DistributedError:
            seen = f"failed in {time.monotonic() - t0:.0f}s"
    with open(f"{out}.{rank}", "w") as f:
        f.write(seen)
    os._exit(0)


@pytest.mark.parametrize("how", ["exchange", "irecv"])
def test_point_to_point_fails_promptly_when_a_peer_will_not_send(tmp_path, how):
    out = str(tmp_path / "out")
    mp.spawn(_p2p_rank, args=(free_port(), out, how), nprocs=3)
    for r in (0, 1):
        seen = open(f"{out}.{r}").read()
        assert seen.startswith("failed in ") and int(seen.split()[2][:-1]) <= 5, seen
