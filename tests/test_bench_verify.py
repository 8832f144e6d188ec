"""The benchmarks verify what they time (issue 27 item 4): the async-save measurement of
``bench/bench.py`` overwrites the state at the may-change point, restores it after the
commit, loads every system's checkpoint back and compares per-tensor checksums with the
state at the call; a record whose checkpoint is wrong reports no time, and the report
leaves it out of every median and ratio.

Runs on 2 gloo ranks (the shared test cluster), a tiny FSDP-like state: a DTensor, a
plain replicated tensor, AdamW-like 0-d CPU ``step`` tensors, bool and int leaves.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import os
import sys
import types

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _bench():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    mod = sys.modules.get("bench")
    if mod is not None and not hasattr(mod, "async_save"):  # the bench/ directory as a namespace package
        del sys.modules["bench"]
    return importlib.import_module("bench")


def _report():
    _bench()
    return importlib.import_module("report")


_CTX: dict = {}


def _ctx(root: str):
    """One harness context per process (its RSS sampler is a thread that lives on)."""
    import torch

    B = _bench()
    ctx = _CTX.get("ctx")
    if ctx is None:
        ctx = _CTX["ctx"] = B.Ctx(torch.distributed.get_rank(), None, torch.device("cpu"), systems=B.BENCH_SYSTEMS)
        ctx.gloo = None  # the default group is gloo here
        ctx.dcp_threads = 1
    ctx.cfg = types.SimpleNamespace(dir=root)
    return ctx


def _state():
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": distribute_tensor(torch.randn(8, 6, generator=g), mesh, [Shard(0)]),
                      "b": torch.randn(6, generator=g),
                      "mask": torch.rand(5, generator=g) > 0.5,
                      "ids": torch.arange(7, dtype=torch.int32)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": ["w"]}]}}


class _LateFuture(cf.Future):
    """A save that copies nothing at the call: it reads the state when its result is asked
    for, after the may-change point (what the GPU bug of issue 27 amounted to)."""

    def __init__(self, sd, path, save) -> None:
        super().__init__()
        self.sd, self.path, self.save, self.staged_seconds = sd, path, save, 0.0

    def wait_staged(self, stream=None) -> None:
        pass

    def result(self, timeout=None):
        if not self.done():
            self.set_result(self.save(self.sd, self.path))
        return super().result(timeout)


def async_records(rank: int, world: int, root: str, mode: str) -> dict:
    """One rep of bench.py's async section (zarrckpt, DCP defaults, DCP best) with zarrckpt's
    save as ``mode`` says: ``ok``; ``copy``: it saves a copy whose ``model/w`` differs by one
    element; ``late``: it reads the state only after the may-change point."""
    import torch

    import zarrckpt

    B = _bench()
    ctx = _ctx(root)
    sd = _state()
    before = B.checksums(sd, True)
    real = zarrckpt.async_save

    def copy_save(state, path, **kw):
        bad = B.tmap(lambda t: t.clone(), state)
        with torch.no_grad():
            B.local(bad["model"]["w"]).view(-1)[0] += 1.0
        return real(bad, path, **kw)

    def late_save(state, path, **kw):
        return _LateFuture(state, path, lambda s, p: zarrckpt.save(s, p, **kw))

    stager = B.DcpStager(False, "reuse")
    if mode != "ok":
        B.zarrckpt.async_save = copy_save if mode == "copy" else late_save
    try:
        row = B.async_save(ctx, 0, sd, stager)
    finally:
        B.zarrckpt.async_save = real
        stager.close()
        zarrckpt.release_staging()
    restored = B.checksums(sd, True) == before
    return {"row": row, "restored": restored}


@pytest.mark.parametrize("mode", ["ok", "copy", "late"])
def test_async_save_records_are_verified(clusters, tmp_path, mode):
    out = clusters(2).run(async_records, str(tmp_path / mode), mode)
    B = _bench()
    for rank_out in out:
        assert rank_out["restored"]  # the overwrite at the may-change point was undone exactly
        row = rank_out["row"]
        for s in ("dcp", "dcp_best"):  # DCP's checkpoints are verified the same way, and are right
            assert row[s]["verified"] is True and row[s]["seconds"] > 0, row[s]
            assert row[s]["untimed"]["verify_s"] > 0 and row[s]["overwrite_s"] >= 0
        zc = row["zc"]
        if mode == "ok":
            assert zc["verified"] is True
            assert zc["seconds"] > 0 and zc["blocked"] > 0 and zc["may_change"] >= zc["blocked"]
            assert "wrong" not in zc
        else:
            assert zc["verified"] is False
            assert zc["seconds"] is None and zc["blocked"] is None and zc["may_change"] is None
            assert zc["unverified_times"]["seconds"] > 0  # measured, kept apart, reported nowhere
            if mode == "copy":
                assert zc["wrong"] == ["model/w"] and zc["wrong_count"] == 1
            else:  # every tensor leaf: the save read the state after it was overwritten
                assert zc["wrong_count"] == 6 and "optim/state/w/step" in zc["wrong"]

    R = _report()
    rows = R.combine([[o["row"]] for o in out])
    assert rows[0]["dcp"]["verified"] is True
    text = R.async_table("Async save", rows, 1000)
    zc_line = next(line for line in text.splitlines() if line.startswith("| zarrckpt"))
    if mode == "ok":
        assert rows[0]["zc"]["verified"] is True and "VERIFY FAILED" not in text
        assert R.ratio(rows, "dcp") is not None
    else:
        assert rows[0]["zc"]["verified"] is False and rows[0]["zc"]["seconds"] is None
        assert "VERIFY FAILED in 1 of 1 reps" in zc_line
        assert zc_line.split("|")[2].strip() == "-"  # no time reported
        assert R.ratio(rows, "dcp") is None  # no ratio against an unverified zarrckpt rep


def test_report_skips_unverified_reps():
    """The medians and ratios of report.py use only verified reps (here zarrckpt's rep 1
    is wrong: its 0.1 s would otherwise make zarrckpt look 10x faster)."""
    B, R = _bench(), _report()

    def rec(sec, ok=True):
        return B.drop_times({"seconds": sec, "rss_peak_mb": 0, "verified": ok})
    per_rank = [[{"rep": 0, "order": ["zc", "dcp"], "zc": rec(1.0), "dcp": rec(2.0)},
                 {"rep": 1, "order": ["dcp", "zc"], "zc": rec(0.1, False), "dcp": rec(1.0)},
                 {"rep": 2, "order": ["zc", "dcp"], "zc": rec(1.0), "dcp": rec(3.0)}]]
    rows = R.combine(per_rank)
    assert [r["zc"]["seconds"] for r in rows] == [1.0, None, 1.0]
    assert R.ratio(rows, "dcp") == 2.5  # reps 0 and 2 only
    text = R.table("Sync save", rows, 10**9)
    zc_line = next(line for line in text.splitlines() if line.startswith("| zarrckpt"))
    assert "VERIFY FAILED in 1 of 3 reps" in zc_line and "| 1.000 |" in zc_line
