"""progress= on save, async_save and load (issue 29 item 4): a callback told
(phase, done_bytes, total_bytes) from a documented thread, or a tqdm bar; nothing at all
(no per-chunk work) when it is not given."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import zarrckpt
from zarrckpt.api import load as zload
from zarrckpt.engine import save as zengine


def state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(512, 1024), "b": torch.randn(1024), "h": torch.randn(64, 64).bfloat16()},
            "step": 7, "blob": b"x" * 1000}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.threads: set[int] = set()

    def __call__(self, phase: str, done: int, total: int) -> None:
        self.calls.append((phase, done, total))
        self.threads.add(threading.get_ident())


def check_calls(calls: list, first: str, last: str) -> int:
    """The shape every operation's calls have: ``first`` from 0 up to its total (never
    down, never past it, at least once per piece), then ``last`` once with done == total."""
    assert calls[0][:2] == (first, 0) and calls[-1][0] == last, calls
    total = calls[0][2]
    body = calls[:-1]
    assert {p for p, _, _ in body} == {first} and {t for _, _, t in calls} == {total}, calls
    done = [d for _, d, _ in body]
    assert done == sorted(done) and done[-1] == total and all(0 <= d <= total for d in done), calls
    assert calls[-1] == (last, total, total)
    return total


def test_save_reports_bytes_written_from_the_calling_thread(tmp_path):
    rec = Recorder()
    rep = zarrckpt.save(state(), tmp_path / "c", progress=rec, chunk_target_bytes=None, inner_chunk_bytes=1 << 16)
    total = check_calls(rec.calls, "write", "commit")
    assert total == rep["bytes_written"] == (512 * 1024 + 1024) * 4 + 64 * 64 * 2 + 1000  # the bytes leaf too
    assert len(rec.calls) >= 4 and rec.threads == {threading.get_ident()}


def test_async_save_reports_from_its_background_thread(tmp_path):
    rec = Recorder()
    fut = zarrckpt.async_save(state(), tmp_path / "c", progress=rec)
    rep = fut.result(timeout=120)
    assert check_calls(rec.calls, "write", "commit") == rep["bytes_written"]
    assert threading.get_ident() not in rec.threads and len(rec.threads) == 1


@pytest.mark.parametrize("cast", [False, True])  # True: every read goes through the staging arena
def test_load_reports_bytes_read_from_the_calling_thread(tmp_path, cast):
    sd = state()
    zarrckpt.save(sd, tmp_path / "c", inner_chunk_bytes=1 << 16)
    target = {"model": {k: torch.zeros(v.shape, dtype=torch.float64 if cast else v.dtype)
                        for k, v in sd["model"].items()}, "step": 0, "blob": b""}
    rec, rep = Recorder(), {}
    zarrckpt.load(target, tmp_path / "c", progress=rec, cast=cast, report=rep, max_inflight_bytes=1 << 20)
    total = check_calls(rec.calls, "read", "apply")
    assert total == rep["bytes_needed"] == (512 * 1024 + 1024) * 4 + 64 * 64 * 2  # into tensor targets
    assert len(rec.calls) > 4 and rec.threads == {threading.get_ident()}
    assert torch.equal(target["model"]["w"], sd["model"]["w"].double() if cast else sd["model"]["w"])


def test_a_fresh_optimizer_state_filled_from_the_checkpoint_counts_too(tmp_path):
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    zarrckpt.save({"optim": optim.state_dict()}, tmp_path / "c")
    fresh = torch.optim.AdamW(torch.nn.Linear(8, 4).parameters())
    rec, rep = Recorder(), {}
    zarrckpt.load({"optim": fresh}, tmp_path / "c", progress=rec, report=rep)
    assert check_calls(rec.calls, "read", "apply") == rep["bytes_needed"] > 0


def test_progress_true_draws_a_tqdm_bar_on_stderr(tmp_path, capsys):
    pytest.importorskip("tqdm")
    zarrckpt.save(state(), tmp_path / "c", progress=True)
    err = capsys.readouterr().err
    assert "zarrckpt save" in err and "100%" in err and "commit" in err, err
    zarrckpt.async_save(state(), tmp_path / "d", progress=True).result(timeout=120)
    assert "zarrckpt async_save" in capsys.readouterr().err
    zarrckpt.load(state(), tmp_path / "c", progress=True)
    err = capsys.readouterr().err
    assert "zarrckpt load" in err and "100%" in err and "apply" in err, err


def test_progress_true_without_tqdm_names_the_install_command_before_anything_is_done(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    for call in (lambda: zarrckpt.save(state(), tmp_path / "c", progress=True),
                 lambda: zarrckpt.async_save(state(), tmp_path / "c", progress=True),
                 lambda: zarrckpt.load({"step": 0}, tmp_path / "c", progress=True)):
        with pytest.raises(zarrckpt.MissingDependencyError, match=r"progress=True\) needs tqdm.*pip install tqdm"):
            call()
        assert not (tmp_path / "c").exists()


def test_a_progress_that_is_neither_callable_nor_true_is_refused(tmp_path):
    with pytest.raises(ValueError, match="progress must be"):
        zarrckpt.save(state(), tmp_path / "c", progress="yes")
    with pytest.raises(ValueError, match="progress must be"):
        zarrckpt.load({"step": 0}, tmp_path / "c", progress=1)


@pytest.mark.parametrize("api", ["save", "async_save", "load"])
def test_a_failed_call_closes_its_bar(tmp_path, monkeypatch, api):
    from zarrckpt.api import _progress

    pytest.importorskip("tqdm")
    zarrckpt.save(state(), tmp_path / "c")
    closed = []
    real = _progress._Bar.close
    monkeypatch.setattr(_progress._Bar, "close", lambda self: closed.append(self.bar is not None) or real(self))

    def fail(*args, **kwargs):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # one process: the error itself
        if api == "load":
            monkeypatch.setattr(zload._Reads, "finish", fail)
            zarrckpt.load(state(), tmp_path / "c", progress=True)
        else:
            monkeypatch.setattr(zengine.ChunkWriter, "finish", fail)
            save = zarrckpt.save if api == "save" else (lambda *a, **k: zarrckpt.async_save(*a, **k).result(60))
            save(state(), tmp_path / "d", progress=True)
    assert True in closed  # the bar that was drawing


def test_without_progress_nothing_is_counted(tmp_path, monkeypatch):
    """progress=None (the default) takes the paths without any per-chunk or per-read work."""
    def never(*args, **kwargs):
        raise AssertionError("progress bookkeeping without a progress callback")

    monkeypatch.setattr(zengine, "_Reported", never)
    monkeypatch.setattr(zload, "_Reporting", never)
    sd = state()
    zarrckpt.save(sd, tmp_path / "c")
    zarrckpt.async_save(sd, tmp_path / "d").result(timeout=120)
    zarrckpt.load(state(), tmp_path / "c")


def rank_progress(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32), mesh, [Shard(0)])
    rec = Recorder()
    rep = zarrckpt.save({"w": w, "step": 1}, path, progress=rec, chunk_target_bytes=None)
    check_calls(rec.calls, "write", "commit")
    back = {"w": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(1)])}
    loaded = Recorder()
    zarrckpt.load(back, path, progress=loaded)
    check_calls(loaded.calls, "read", "apply")
    assert torch.equal(back["w"].full_tensor(), torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32))
    return rec.calls[-1][2], rep["bytes_written"], loaded.calls[-1][2]


def test_each_rank_reports_its_own_bytes(tmp_path, clusters):
    out = clusters(2).run(rank_progress, str(tmp_path / "c"))
    assert [o[0] for o in out] == [o[1] for o in out] and sum(o[0] for o in out) == 64 * 32 * 4
    assert [o[2] for o in out] == [64 * 16 * 4] * 2  # each rank reads its column half


def rank_without_tqdm(rank, world, path):
    """progress=True where tqdm is missing: what the save raised on this rank, and when."""
    import time

    sys.modules["tqdm"] = None
    sys.modules["tqdm.auto"] = None
    t0 = time.monotonic()
    try:
        zarrckpt.save({"w": torch.ones(3)}, path, progress=True, entry_timeout=30)
        out = "ok"
    except zarrckpt.ZarrckptError as e:
        out = type(e).__name__
    finally:
        del sys.modules["tqdm"], sys.modules["tqdm.auto"]
    return out, time.monotonic() - t0


def test_progress_true_without_tqdm_fails_every_rank_at_once(tmp_path, clusters):
    """Review finding: only rank 0 made the bar, so only rank 0 found tqdm missing and the
    others waited out the entry timeout, then blamed rank 0."""
    out = clusters(2).run(rank_without_tqdm, str(tmp_path / "c"))
    assert [o for o, _ in out] == ["MissingDependencyError"] * 2, out
    assert all(t < 10 for _, t in out), out
