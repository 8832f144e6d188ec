"""Ctrl-C in the middle of a 2-rank save (issue 18, item 5): the interrupted rank raises
KeyboardInterrupt itself (not a SaveFailedError wrapping it) once the save has cleaned up,
and the other rank is told that rank 0 was interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from _cluster import free_port  # noqa: E402

RANK = """
import os, signal, sys, time
from datetime import timedelta
# a process started from a background job of a shell without job control (nohup ... &) inherits
# SIGINT ignored, and Python then installs no handler: Ctrl-C must raise here all the same
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
import zarrckpt
from zarrckpt.storage import _tensorstore as t

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
real = t._put_file
def slow(path, data, fsync):  # a slow disk: the save is still writing when SIGINT comes
    open({marker!r} + str(rank), "w").close()
    time.sleep(0.05)
    real(path, data, fsync)
t._put_file = slow
try:
    zarrckpt.save({{f"w{{i}}": torch.full((8, 8), 1.0) for i in range(200)}}, {path!r}, pack_bytes=0)
except zarrckpt.ZarrckptError as e:
    print("RAISED", type(e).__name__, e, flush=True)
"""


def test_ctrl_c_during_a_two_rank_save_raises_keyboard_interrupt(tmp_path):
    marker = str(tmp_path / "writing")
    code = RANK.format(root=os.path.dirname(TESTS), marker=marker, path=str(tmp_path / "c"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker + "0"):
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out0, err0 = outs[0]
    last = err0.strip().splitlines()[-1]  # the exception the process died of
    assert procs[0].returncode != 0 and last.endswith("KeyboardInterrupt"), (out0, err0)
    assert "RAISED" not in out0 and "SaveFailedError:" not in err0, err0
    out1, err1 = outs[1]
    assert procs[1].returncode == 0, err1
    assert "RAISED SaveFailedError" in out1 and "rank(s) [0]" in out1, (out1, err1)
    assert "interrupted (KeyboardInterrupt)" in out1, out1
    assert sorted(os.listdir(tmp_path)) == ["writing0", "writing1"]  # the save was cleaned up
